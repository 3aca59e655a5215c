"""GSPO: PPO clipping on the length-normalised sequence ratio (verl `compute_policy_loss_gspo`)."""

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Shaped

from rlx.objectives._checks import check_ratio_clips, clip
from rlx.objectives._metrics import PolicyLossMetrics
from rlx.objectives._policy_inputs import (
  clipped_loss_result,
  clipped_surrogate,
  prepare_policy_inputs,
  token_clip_bound,
)
from rlx.objectives._ratios import masked_log_ratio, masked_sequence_log_ratio

# Upper cap on the per-token log of the sequence ratio (verl).
_MAX_LOG_SEQUENCE_RATIO = 10.0


def gspo_loss(
  logp: Float[Array, "B T"],
  old_logp: Float[Array, "B T"],
  advantages: Float[Array, "B T"],
  mask: Shaped[Array, "B T"],
  *,
  clip_low: float | Float[Array, ""] | Float[Array, "B T"] = 3e-4,
  clip_high: float | Float[Array, ""] | Float[Array, "B T"] = 4e-4,
  is_weights: Float[Array, "B T"] | None = None,
  agg: str = "seq-mean-token-mean",
  agg_scale: Float[Array, ""] | float | None = None,
) -> tuple[Float[Array, ""], PolicyLossMetrics]:
  """Group Sequence Policy Optimization loss (sequence-level ratio, token-level gradient).

    s_i    = sum_t m_it (lp_it - olp_it) / max(n_i, 1)
    log w  = min(sg(s_i) + lp_it - sg(lp_it), 10)      (value s_i, gradient per token)
    L_it   = max(-A w, -A clip(w, 1 - clip_low, 1 + clip_high)) * sg(is_weights)
    loss   = aggregate(L, mask, agg)                     (default seq-mean-token-mean)
  No dual clip. Zheng et al. 2025, https://arxiv.org/abs/2507.18071 (paper
  values clip_low = 3e-4, clip_high = 4e-4); verl `compute_policy_loss_gspo`.
  The clips may be per-token `[B, T]` arrays (detached), e.g. SAT's contracted
  radii computed from the broadcast sequence log-ratio (`sat_clip_bounds`).

  Args:
    logp: current-policy log-probs (differentiated), with shape `[B, T]`.
    old_logp: old-policy log-probs (detached), with shape `[B, T]`.
    advantages: per-token advantages (detached), with shape `[B, T]`.
    mask: 1/True on the tokens that count, with shape `[B, T]`.
    clip_low: lower clip in [0, 1) on the sequence ratio: a scalar or a
      per-token array with shape `[B, T]`.
    clip_high: upper clip `>= 0` on the sequence ratio: a scalar or a per-token
      array with shape `[B, T]`.
    is_weights: rollout-correction weights (detached), with shape `[B, T]`.
    agg: aggregation mode (see `aggregate`).
    agg_scale: optional denominator for `aggregate` (global batch scale).

  Returns:
    `(loss, metrics)`: float32 scalar and `PolicyLossMetrics` (ratio = the
    sequence ratio `w`, broadcast over the sequence's tokens; approx_kl uses
    the token log-ratio).
  """
  check_ratio_clips(clip_low, clip_high, token_shape=np.shape(logp), token_mask=mask)
  x = prepare_policy_inputs(
    logp, old_logp, advantages, mask, is_weights=is_weights, agg=agg, agg_scale=agg_scale
  )
  clip_low, clip_high = token_clip_bound(clip_low, x.valid), token_clip_bound(clip_high, x.valid)
  sg = jax.lax.stop_gradient
  adv = x.advantages
  seq_log_ratio = masked_sequence_log_ratio(x.logp, x.old_logp, x.valid)[:, None]
  log_w = clip(sg(seq_log_ratio) + x.logp - sg(x.logp), high=_MAX_LOG_SEQUENCE_RATIO)
  w = jnp.exp(log_w)
  low, high = 1.0 - clip_low, 1.0 + clip_high
  per_token = clipped_surrogate(w, clip(w, low, high), adv)
  log_ratio = masked_log_ratio(x.logp, x.old_logp, x.valid)
  return clipped_loss_result(x, per_token, log_ratio, w, below=w < low, above=w > high)
