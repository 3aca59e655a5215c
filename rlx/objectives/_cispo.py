"""CISPO: REINFORCE with a clipped, detached IS weight (verl `compute_policy_loss_cispo`)."""

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Shaped

from rlx.objectives._checks import check_non_negative, check_range
from rlx.objectives._metrics import PolicyLossMetrics
from rlx.objectives._policy_inputs import policy_loss_result, prepare_policy_inputs
from rlx.objectives._ratios import masked_log_ratio


def cispo_loss(
  logp: Float[Array, "B T"],
  old_logp: Float[Array, "B T"],
  advantages: Float[Array, "B T"],
  mask: Shaped[Array, "B T"],
  *,
  clip_low: float | Float[Array, ""] = 1.0,
  clip_high: float | Float[Array, ""] = 0.2,
  is_weights: Float[Array, "B T"] | None = None,
  agg: str = "token-mean",
  agg_scale: Float[Array, ""] | float | None = None,
) -> tuple[Float[Array, ""], PolicyLossMetrics]:
  """Clipped IS-weight Sequence Policy Optimization loss (MiniMax-M1).

    r   = exp(clamp(lp - olp, -20, 20))
    L_t = -sg(clip(r, 1 - clip_low, 1 + clip_high)) * A * lp * sg(is_weights)
    loss = aggregate(L, mask, agg)
  The IS weight is truncated and detached, so gradients are never zeroed (every
  token contributes `-w A grad lp`). MiniMax 2025, https://arxiv.org/abs/2506.13585;
  verl `compute_policy_loss_cispo`. The default `clip_low = 1.0` puts the lower
  bound at 0, i.e. no lower truncation (the paper only truncates from above).

  Args:
    logp: current-policy log-probs (differentiated), with shape `[B, T]`.
    old_logp: old-policy log-probs (detached), with shape `[B, T]`.
    advantages: per-token advantages (detached), with shape `[B, T]`.
    mask: 1/True on the tokens that count, with shape `[B, T]`.
    clip_low: in [0, 1]; lower weight bound `1 - clip_low` (1 means none).
    clip_high: `>= 0`; upper weight bound `1 + clip_high`.
    is_weights: rollout-correction weights (detached), with shape `[B, T]`.
    agg: aggregation mode (see `aggregate`).
    agg_scale: optional denominator for `aggregate` (global batch scale).

  Returns:
    `(loss, metrics)`: float32 scalar and `PolicyLossMetrics` (ratio = `r`;
    clip fractions count tokens whose weight is truncated, any advantage sign;
    no dual clip).
  """
  check_range(
    clip_low,
    "clip_low",
    low=0.0,
    high=1.0,
    why=" (the weight's lower bound is 1 - clip_low; 1 means no lower truncation)",
  )
  check_non_negative(clip_high, "clip_high")
  x = prepare_policy_inputs(
    logp, old_logp, advantages, mask, is_weights=is_weights, agg=agg, agg_scale=agg_scale
  )
  log_ratio = masked_log_ratio(x.logp, x.old_logp, x.valid)
  ratio = jnp.exp(log_ratio)
  low, high = 1.0 - clip_low, 1.0 + clip_high
  weight = jax.lax.stop_gradient(jnp.clip(ratio, low, high))
  per_token = -weight * x.advantages * x.logp
  return policy_loss_result(
    x, per_token, log_ratio, ratio, clipped_low=ratio < low, clipped_high=ratio > high
  )
