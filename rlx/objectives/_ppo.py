"""PPO clipped surrogate, token level, with clip-higher and dual clip (verl vanilla loss)."""

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Shaped

from rlx.objectives._checks import check_ratio_clips, clip
from rlx.objectives._metrics import PolicyLossMetrics
from rlx.objectives._policy_inputs import (
  PolicyInputs,
  clipped_loss_result,
  clipped_surrogate,
  dual_clip_tokens,
  prepare_policy_inputs,
  token_clip_bound,
)
from rlx.objectives._ratios import masked_log_ratio


def ppo_clip_loss(
  logp: Float[Array, "B T"],
  old_logp: Float[Array, "B T"],
  advantages: Float[Array, "B T"],
  mask: Shaped[Array, "B T"],
  *,
  clip_low: float | Float[Array, ""] | Float[Array, "B T"] = 0.2,
  clip_high: float | Float[Array, ""] | Float[Array, "B T"] = 0.2,
  dual_clip: float | Float[Array, ""] | None = None,
  is_weights: Float[Array, "B T"] | None = None,
  agg: str = "token-mean",
  agg_scale: Float[Array, ""] | float | None = None,
) -> tuple[Float[Array, ""], PolicyLossMetrics]:
  """PPO clipped surrogate loss with asymmetric clip range and optional dual clip.

  With `delta = clamp(lp - olp, -20, 20)` and `r = exp(delta)`:
    L_t = max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high))
    L_t = min(L_t, -A c)            for A < 0, if `dual_clip` c is given
    L_t = L_t * sg(is_weights)      if `is_weights` is given
    loss = aggregate(L, mask, agg)
  Schulman et al. 2017 (https://arxiv.org/abs/1707.06347); clip-higher from
  DAPO (https://arxiv.org/abs/2503.14476: clip_low=0.2, clip_high=0.28); dual
  clip from Ye et al. 2020 (https://arxiv.org/abs/1912.09729, verl default
  c = 3). Reference: verl `compute_policy_loss_vanilla`. A ratio exactly on a
  bound counts as inside the closed window and keeps its gradient (as with
  `torch.clamp`; the same holds for every clipped loss in rlx.objectives).

  `clip_low` / `clip_high` may be per-token `[B, T]` arrays (detached), e.g.
  SAT's staleness-contracted radii (`sat_clip_bounds`); token t is then
  clipped to `[1 - clip_low[t], 1 + clip_high[t]]`. Scalars give exactly the
  scalar computation.

  Args:
    logp: current-policy log-probs (differentiated), with shape `[B, T]`.
    old_logp: old-policy log-probs (detached), with shape `[B, T]`.
    advantages: per-token advantages (detached), with shape `[B, T]`.
    mask: 1/True on the tokens that count, with shape `[B, T]`.
    clip_low: lower clip `eps_low` in [0, 1) (bound `1 - eps_low`): a scalar or
      a per-token array with shape `[B, T]`, every entry in range.
    clip_high: upper clip `eps_high >= 0` (bound `1 + eps_high`): a scalar or a
      per-token array with shape `[B, T]`.
    dual_clip: dual-clip constant `c > 1` for negative advantages, or None.
    is_weights: rollout-correction weights (detached), with shape `[B, T]`.
    agg: aggregation mode (see `aggregate`).
    agg_scale: optional denominator for `aggregate` (global batch scale).

  Returns:
    `(loss, metrics)`: float32 scalar and `PolicyLossMetrics` (ratio = `r`).
  """
  check_ratio_clips(clip_low, clip_high, dual_clip, token_shape=np.shape(logp), token_mask=mask)
  x = prepare_policy_inputs(
    logp, old_logp, advantages, mask, is_weights=is_weights, agg=agg, agg_scale=agg_scale
  )
  return clipped_policy_loss(
    x,
    clip_low=token_clip_bound(clip_low, x.valid),
    clip_high=token_clip_bound(clip_high, x.valid),
    dual_clip=dual_clip,
  )


def clipped_policy_loss(
  x: PolicyInputs, *, clip_low, clip_high, dual_clip, token_weight=None
) -> tuple[jax.Array, PolicyLossMetrics]:
  """PPO's clipped surrogate on validated inputs (internal; shared with SAT, M2PO and MinPRO).

  `clip_low` / `clip_high` are scalars or float32 `[B, T]` arrays (detached).
  `token_weight` (detached float32 `[B, T]`, or None) multiplies each token's
  surrogate after the clips and the ratio the metrics report (MinPRO's prefix
  weight); the clip fractions stay those of the token ratio.
  """
  adv = x.advantages
  log_ratio = masked_log_ratio(x.logp, x.old_logp, x.valid)
  ratio = jnp.exp(log_ratio)
  low, high = 1.0 - clip_low, 1.0 + clip_high
  per_token = clipped_surrogate(ratio, clip(ratio, low, high), adv)
  clipped_dual = None
  if dual_clip is not None:
    per_token, clipped_dual = dual_clip_tokens(per_token, adv, dual_clip, ratio > dual_clip)
  below, above = ratio < low, ratio > high
  if token_weight is not None:
    per_token, ratio = token_weight * per_token, token_weight * ratio
  return clipped_loss_result(
    x, per_token, log_ratio, ratio, below=below, above=above, clipped_dual=clipped_dual
  )
