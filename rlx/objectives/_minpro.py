"""MinPRO: PPO token loss reweighted by the minimum ratio of the preceding prefix."""

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Shaped

from rlx.objectives._checks import check_flag, check_ratio_clips
from rlx.objectives._metrics import PolicyLossMetrics
from rlx.objectives._policy_inputs import prepare_policy_inputs
from rlx.objectives._ppo import clipped_policy_loss
from rlx.objectives._ratios import masked_log_ratio, masked_min_prefix


def minpro_loss(
  logp: Float[Array, "B T"],
  old_logp: Float[Array, "B T"],
  advantages: Float[Array, "B T"],
  mask: Shaped[Array, "B T"],
  *,
  clip_low: float | Float[Array, ""] = 0.2,
  clip_high: float | Float[Array, ""] = 0.2,
  dual_clip: float | Float[Array, ""] | None = None,
  inclusive: bool = False,
  cap_prefix: bool = False,
  is_weights: Float[Array, "B T"] | None = None,
  agg: str = "token-mean",
  agg_scale: Float[Array, ""] | float | None = None,
) -> tuple[Float[Array, ""], PolicyLossMetrics]:
  """Minimum-prefix-ratio policy optimization loss.

  Replaces the cumulative prefix ratio `prod_{j<t} r_j` of sequence-level IS by
  the (detached) minimum token ratio of the preceding valid prefix:
    delta_t = clamp(lp_t - olp_t, -20, 20),  r_t = exp(delta_t)
    P_t     = exp(sg(min_{j<t, m_j=1} delta_j))       (1 if the prefix is empty)
    L_t     = P_t * max(-A r_t, -A clip(r_t, 1 - clip_low, 1 + clip_high))
    L_t     = P_t * min(max(...), -A c)                for A < 0, if `dual_clip` c
    loss    = aggregate(L * sg(is_weights), mask, agg)
  Lei, Cheng and Tao 2026, "A Step Back: Prefix Importance Ratio Stabilizes
  Policy Optimization" (MinPRO), https://arxiv.org/abs/2601.22718; no public
  code was found. The following details are rlx's choices, exposed as
  keywords:
  - `inclusive=False`: the prefix is strict (`j < t`), so the token's own ratio
    enters only once, through the clipped PPO term. `True` uses `j <= t`.
  - `cap_prefix=False`: `P_t` may exceed 1 when every prefix ratio does (it is
    the literal minimum). `True` uses `min(P_t, 1)`, which only down-weights.
  - The prefix term multiplies the token's clipped surrogate (it is outside
    the clip, so clipping decisions are the plain PPO ones and P_t is a
    positive detached weight), with PPO's default symmetric clip 0.2.

  Args:
    logp: current-policy log-probs (differentiated), with shape `[B, T]`.
    old_logp: old-policy log-probs (detached), with shape `[B, T]`.
    advantages: per-token advantages (detached), with shape `[B, T]`.
    mask: 1/True on the tokens that count, with shape `[B, T]`.
    clip_low: lower clip `>= 0` on the token ratio.
    clip_high: upper clip `>= 0` on the token ratio.
    dual_clip: dual-clip constant `c > 1` for A < 0, or None.
    inclusive: include token t itself in the prefix minimum.
    cap_prefix: cap the prefix weight at 1.
    is_weights: rollout-correction weights (detached), with shape `[B, T]`.
    agg: aggregation mode (see `aggregate`).
    agg_scale: optional denominator for `aggregate` (global batch scale).

  Returns:
    `(loss, metrics)`: float32 scalar and `PolicyLossMetrics` (ratio = the
    effective ratio `P_t * r_t`; clip fractions from the token ratio `r_t`).
  """
  check_ratio_clips(clip_low, clip_high, dual_clip)
  check_flag(inclusive, "inclusive")
  check_flag(cap_prefix, "cap_prefix")
  x = prepare_policy_inputs(
    logp, old_logp, advantages, mask, is_weights=is_weights, agg=agg, agg_scale=agg_scale
  )
  log_ratio = masked_log_ratio(x.logp, x.old_logp, x.valid)
  log_prefix = masked_min_prefix(jax.lax.stop_gradient(log_ratio), x.valid, inclusive=inclusive)
  if cap_prefix:
    log_prefix = jnp.minimum(log_prefix, 0.0)
  prefix = jnp.exp(log_prefix)
  return clipped_policy_loss(
    x, clip_low=clip_low, clip_high=clip_high, dual_clip=dual_clip, token_weight=prefix
  )
