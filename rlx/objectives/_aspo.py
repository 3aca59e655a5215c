"""ASPO: asymmetric importance sampling (flipped ratio for positive advantages), soft dual clip."""

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Shaped

from rlx.objectives._checks import (
  check_greater,
  check_range,
  check_ratio_clips,
  check_scalar,
  clip,
  is_concrete,
)
from rlx.objectives._metrics import PolicyLossMetrics
from rlx.objectives._policy_inputs import (
  clipped_loss_result,
  clipped_surrogate,
  prepare_policy_inputs,
)
from rlx.objectives._ratios import masked_log_ratio


def _high_entropy_tokens(entropy: jax.Array, valid: jax.Array, top_fraction: float) -> jax.Array:
  """True on the valid tokens above their sequence's (1 - top_fraction) entropy quantile.

  As the reference (`torch.nanquantile(..., dim=-1)`), the quantile (linear
  interpolation) is taken per sequence over its valid tokens; a fraction of 1
  selects every valid token.
  """
  if top_fraction >= 1.0:
    return valid
  values = jnp.where(valid, entropy.astype(jnp.float32), jnp.nan)
  threshold = jnp.nanquantile(values, 1.0 - top_fraction, axis=1, keepdims=True)
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
  positive_dual_clip: float | Float[Array, ""] | None = 3.0,
  entropy: Float[Array, "B T"] | None = None,
  is_weights: Float[Array, "B T"] | None = None,
  agg: str = "token-mean",
  agg_scale: Float[Array, ""] | float | None = None,
) -> tuple[Float[Array, ""], PolicyLossMetrics]:
  """Asymmetric Importance Sampling Policy Optimization loss (Archer2.0).

  With `r = exp(clamp(lp - olp, -20, 20))` and per-token clip `eps_low, eps_high`
  (the `high_entropy_*` values for the top `high_entropy_fraction` of each
  sequence's valid tokens by `entropy`, `clip_low/clip_high` for the others):
  - A > 0, flipped ratio: `r^ = min(r, 1 + eps_high)`,
      `L = -A (r^ / sg(r^)) / sg(r^)`
    value `-A / r^`, gradient `-A (1 / r) grad lp` inside the clip, 0 above it.
    Positive dual clip `c+` (`positive_dual_clip`): where the flipped weight
    `1 / r > c+` (r < 1 / c+), `L = -A c+ exp(lp - sg(lp))`: value `-A c+`,
    gradient `-A c+ grad lp`, so a token whose probability dropped gets weight
    at most c+. With `positive_dual_clip=None` the weight 1/r is unbounded
    (up to e^20 through the log-ratio clamp).
  - A <= 0, PPO lower clip: `L = max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high))`;
    soft dual clip where `r > c`: `L = -A c exp(lp - sg(lp))`, whose gradient
    `-A c grad lp` survives (capped weight c instead of r).
  - `L = L * sg(is_weights)`, `loss = aggregate(L, mask, agg)`.
  "ASPO: Asymmetric Importance Sampling Policy Optimization",
  https://arxiv.org/abs/2510.06062; reference Archer2.0
  `compute_policy_loss_archer` (`negative_clip_ratio_c = positive_clip_ratio_c
  = 3`, entropy quantile 0.8 per sequence). Deviation: beyond either dual clip
  the reference's value is `-A sg(c) lp`; rlx uses `-A c exp(lp - sg(lp))`,
  which has the same gradient and the value at the clip (`-A c`), so the loss
  value stays continuous and comparable with PPO's. The entropy quantile is per
  sequence, so the loss does not depend on how the batch is split into
  micro-batches.

  Args:
    logp: current-policy log-probs (differentiated), with shape `[B, T]`.
    old_logp: old-policy log-probs (detached), with shape `[B, T]`.
    advantages: per-token advantages (detached), with shape `[B, T]`.
    mask: 1/True on the tokens that count, with shape `[B, T]`.
    clip_low: `>= 0`, lower clip of low-entropy tokens (A < 0).
    clip_high: `>= 0`, upper clip of low-entropy tokens (A > 0, flipped).
    high_entropy_clip_low: `>= 0`, lower clip of high-entropy tokens.
    high_entropy_clip_high: `>= 0`, upper clip of high-entropy tokens.
    high_entropy_fraction: fraction in [0, 1] of each sequence's valid tokens
      treated as high entropy (a Python float).
    dual_clip: soft dual-clip constant `c > 1` for A < 0 (required: ASPO's
      negative branch is defined with it).
    positive_dual_clip: cap `c+ > 1` on the flipped weight `1 / r` for A > 0,
      or None for no cap.
    entropy: per-token policy entropy (detached), with shape `[B, T]`; None
      uses the low-entropy clips everywhere.
    is_weights: rollout-correction weights (detached), with shape `[B, T]`.
    agg: aggregation mode (see `aggregate`).
    agg_scale: optional denominator for `aggregate` (global batch scale).

  Returns:
    `(loss, metrics)`: float32 scalar and `PolicyLossMetrics` (ratio = `r`;
    clip_frac_dual counts both dual clips: A < 0 with r > c and A > 0 with
    1 / r > c+).
  """
  check_ratio_clips(clip_low, clip_high, dual_clip, dual_clip_optional=False)
  check_ratio_clips(high_entropy_clip_low, high_entropy_clip_high, prefix="high_entropy_")
  check_greater(positive_dual_clip, 1.0, "positive_dual_clip", optional=True)
  check_scalar(high_entropy_fraction, "high_entropy_fraction")
  if not is_concrete(high_entropy_fraction):
    raise ValueError(
      "`high_entropy_fraction` must be a Python float (it fixes a quantile at trace time), "
      "got a traced value."
    )
  check_range(high_entropy_fraction, "high_entropy_fraction", low=0.0, high=1.0)
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
    wide = _high_entropy_tokens(sg(jnp.asarray(entropy)), x.valid, high_entropy_fraction)
    eps_low = jnp.where(wide, high_entropy_clip_low, clip_low)
    eps_high = jnp.where(wide, high_entropy_clip_high, clip_high)
  log_ratio = masked_log_ratio(x.logp, x.old_logp, x.valid)
  ratio = jnp.exp(log_ratio)
  low, high = 1.0 - eps_low, 1.0 + eps_high
  soft = jnp.exp(x.logp - sg(x.logp))  # value 1, gradient grad lp
  # A > 0: flipped importance weight 1 / r inside the upper clip.
  capped = clip(ratio, high=high)
  positive = -adv * (capped / sg(capped)) / sg(capped)
  clipped_dual = (adv < 0) & (ratio > dual_clip)
  if positive_dual_clip is not None:
    # 1 / r > c+  <=>  r c+ < 1 (the upper clip 1 + eps >= 1 > 1 / c+ never interferes).
    capped_positive = ratio * positive_dual_clip < 1.0
    positive = jnp.where(capped_positive, -adv * positive_dual_clip * soft, positive)
    clipped_dual = clipped_dual | ((adv > 0) & capped_positive)
  # A <= 0: PPO lower clip, soft dual clip above c.
  negative = clipped_surrogate(ratio, clip(ratio, low, high), adv)
  negative = jnp.where(ratio > dual_clip, -adv * dual_clip * soft, negative)
  per_token = jnp.where(adv > 0, positive, negative)
  below, above = ratio < low, ratio > high
  return clipped_loss_result(
    x, per_token, log_ratio, ratio, below=below, above=above, clipped_dual=clipped_dual
  )
