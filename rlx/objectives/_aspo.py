"""ASPO: asymmetric importance sampling (flipped ratio for positive advantages), soft dual clip."""

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Shaped

from rlx.objectives._aggregate import aggregate
from rlx.objectives._checks import check_greater, check_non_negative
from rlx.objectives._metrics import PolicyLossMetrics, policy_loss_metrics
from rlx.objectives._policy_inputs import apply_is_weights, prepare_policy_inputs
from rlx.objectives._ratios import masked_log_ratio


def _high_entropy_tokens(entropy: jax.Array, valid: jax.Array, top_fraction) -> jax.Array:
  """True on the valid tokens whose entropy is above the batch's (1 - top_fraction) quantile."""
  values = jnp.where(valid, entropy.astype(jnp.float32), jnp.nan)
  threshold = jnp.nanquantile(values, 1.0 - top_fraction)
  return valid & (values > threshold)


def aspo_loss(
  logp: Float[Array, "B T"],
  old_logp: Float[Array, "B T"],
  advantages: Float[Array, "B T"],
  mask: Shaped[Array, "B T"],
  *,
  clip_low: float | Float[Array, ""] = 0.2,
  clip_high: float | Float[Array, ""] = 0.2,
  high_entropy_clip_low: float | Float[Array, ""] = 0.4,
  high_entropy_clip_high: float | Float[Array, ""] = 0.4,
  high_entropy_fraction: float = 0.2,
  dual_clip: float | Float[Array, ""] = 3.0,
  entropy: Float[Array, "B T"] | None = None,
  is_weights: Float[Array, "B T"] | None = None,
  agg: str = "token-mean",
  agg_scale: Float[Array, ""] | float | None = None,
) -> tuple[Float[Array, ""], PolicyLossMetrics]:
  """Asymmetric Importance Sampling Policy Optimization loss (Archer2.0).

  With `r = exp(clamp(lp - olp, -20, 20))` and per-token clip `eps_low, eps_high`
  (the `high_entropy_*` values for the top `high_entropy_fraction` of valid
  tokens by `entropy` in this batch, `clip_low/clip_high` for the others):
  - A > 0, flipped ratio: `r^ = min(r, 1 + eps_high)`,
      `L = -A (r^ / sg(r^)) / sg(r^)`
    value `-A / r^`, gradient `-A (1 / r) grad lp` inside the clip, 0 above it.
    There is no lower bound for A > 0: the flipped weight 1/r of a token whose
    probability dropped grows, bounded only by the +-20 log-ratio clamp.
  - A <= 0, PPO lower clip: `L = max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high))`;
    soft dual clip where `r > c`: `L = -A c exp(lp - sg(lp))`, whose gradient
    `-A c grad lp` survives (capped weight c instead of r).
  - `L = L * sg(is_weights)`, `loss = aggregate(L, mask, agg)`.
  Seed "ASPO: Asymmetric Importance Sampling Policy Optimization"; reference
  Archer2.0 `compute_policy_loss_archer`. Deviation: beyond the dual clip the
  reference's value is `-A sg(c) lp`; rlx uses `-A c exp(lp - sg(lp))`, which
  has the same gradient and the dual-clip value `-A c`, so the loss value stays
  continuous and comparable with PPO's. The entropy quantile is taken over the
  valid tokens of the batch passed in (under micro-batching: per micro-batch).

  Args:
    logp: current-policy log-probs (differentiated), with shape `[B, T]`.
    old_logp: old-policy log-probs (detached), with shape `[B, T]`.
    advantages: per-token advantages (detached), with shape `[B, T]`.
    mask: 1/True on the tokens that count, with shape `[B, T]`.
    clip_low: `>= 0`, lower clip of low-entropy tokens (A < 0).
    clip_high: `>= 0`, upper clip of low-entropy tokens (A > 0, flipped).
    high_entropy_clip_low: `>= 0`, lower clip of high-entropy tokens.
    high_entropy_clip_high: `>= 0`, upper clip of high-entropy tokens.
    high_entropy_fraction: fraction in [0, 1] of valid tokens treated as high entropy.
    dual_clip: soft dual-clip constant `c > 1` for A < 0.
    entropy: per-token policy entropy (detached), with shape `[B, T]`; None
      uses the low-entropy clips everywhere.
    is_weights: rollout-correction weights (detached), with shape `[B, T]`.
    agg: aggregation mode (see `aggregate`).
    agg_scale: optional denominator for `aggregate` (global batch scale).

  Returns:
    `(loss, metrics)`: float32 scalar and `PolicyLossMetrics` (ratio = `r`).
  """
  for value, name in (
    (clip_low, "clip_low"),
    (clip_high, "clip_high"),
    (high_entropy_clip_low, "high_entropy_clip_low"),
    (high_entropy_clip_high, "high_entropy_clip_high"),
  ):
    check_non_negative(value, name)
  check_greater(dual_clip, 1.0, "dual_clip")
  if not 0.0 <= high_entropy_fraction <= 1.0:
    raise ValueError(f"`high_entropy_fraction` must be in [0, 1], got {high_entropy_fraction!r}.")
  x = prepare_policy_inputs(
    logp,
    old_logp,
    advantages,
    mask,
    is_weights=is_weights,
    agg=agg,
    agg_scale=agg_scale,
    entropy=entropy,
  )
  sg = jax.lax.stop_gradient
  adv = x.advantages
  if entropy is None:
    eps_low, eps_high = clip_low, clip_high
  else:
    high = _high_entropy_tokens(sg(jnp.asarray(entropy)), x.valid, high_entropy_fraction)
    eps_low = jnp.where(high, high_entropy_clip_low, clip_low)
    eps_high = jnp.where(high, high_entropy_clip_high, clip_high)
  log_ratio = masked_log_ratio(x.logp, x.old_logp, x.valid)
  ratio = jnp.exp(log_ratio)
  low, high = 1.0 - eps_low, 1.0 + eps_high
  # A > 0: flipped importance weight 1 / r inside the upper clip.
  capped = jnp.minimum(ratio, high)
  positive = -adv * (capped / sg(capped)) / sg(capped)
  # A <= 0: PPO lower clip, soft dual clip above c.
  negative = jnp.maximum(-adv * ratio, -adv * jnp.clip(ratio, low, high))
  soft_dual = -adv * dual_clip * jnp.exp(x.logp - sg(x.logp))
  negative = jnp.where(ratio > dual_clip, soft_dual, negative)
  per_token = apply_is_weights(jnp.where(adv > 0, positive, negative), x.is_weights)
  loss = aggregate(per_token, x.valid, agg, scale=agg_scale)
  metrics = policy_loss_metrics(
    x.valid,
    log_ratio=log_ratio,
    ratio=ratio,
    clipped_low=(adv < 0) & (ratio < low),
    clipped_high=(adv > 0) & (ratio > high),
    clipped_dual=(adv < 0) & (ratio > dual_clip),
    is_weights=x.is_weights,
  )
  return loss, metrics
