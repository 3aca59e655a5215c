"""SAT: a staleness-adaptive trust region that contracts PPO's outward clip endpoint on the tail."""

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Shaped

from rlx.objectives import _checks
from rlx.objectives._metrics import PolicyLossMetrics
from rlx.objectives._policy_inputs import prepare_policy_inputs
from rlx.objectives._ppo import clipped_policy_loss
from rlx.objectives._ratios import masked_log_ratio

# Relative slack on `quantile * n` before the ceiling, so that float32 rounding
# of a product that is an integer (0.9 * 10) does not move the quantile rank.
_RANK_SLACK = 1e-6


class SatClipBounds(NamedTuple):
  """SAT's per-token clip radii and their diagnostics (float32, no gradient).

  Attributes:
    clip_low: contracted lower radii `eps_low * c_minus`, `[B, T]` (PPO's
      convention: token t is clipped from below at `1 - clip_low[t]`); the
      nominal `eps_low` at masked positions.
    clip_high: contracted upper radii `eps_high * c_plus`, `[B, T]`.
    threshold: the detached tail reference `q`, the `quantile` quantile of
      `|d|` over the valid tokens (0 when there is none).
    gate_rate: fraction of valid tokens with `q > 0` and `|d| > q` (at most
      `1 - quantile`; less with ties at `q`).
  """

  clip_low: jax.Array
  clip_high: jax.Array
  threshold: jax.Array
  gate_rate: jax.Array


def _check_sat_hyper(quantile, kernel_power) -> None:
  _checks.check_range(quantile, "quantile", low=0.0, high=1.0, low_open=True)
  _checks.check_positive(kernel_power, "kernel_power")
  _checks.check_finite(kernel_power, "kernel_power")


def _lower_quantile(values: jax.Array, valid: jax.Array, quantile) -> jax.Array:
  """`inf {x >= 0 : F(x) >= quantile}` of `values` over `valid` (the inverse-CDF quantile).

  That is the `ceil(quantile * n)`-th smallest of the n valid values; 0 when n = 0.
  """
  flat_valid = valid.reshape(-1)
  flat = jnp.where(flat_valid, values.reshape(-1), jnp.inf)
  ordered = jnp.sort(flat)
  n = jnp.sum(flat_valid).astype(jnp.float32)
  target = jnp.float32(quantile) * n
  rank = jnp.ceil(target - _RANK_SLACK * jnp.maximum(target, 1.0))
  index = jnp.clip(rank, 1.0, jnp.maximum(n, 1.0)).astype(jnp.int32) - 1
  return jnp.where(n > 0, ordered[index], 0.0)


def _sat_bounds(
  log_ratio: jax.Array, valid: jax.Array, clip_low, clip_high, quantile, kernel_power
) -> SatClipBounds:
  """SAT radii from a detached float32 `[B, T]` log-ratio (internal, no validation)."""
  d = jax.lax.stop_gradient(_checks.where_mask(valid, log_ratio))
  d = _checks.clip(d, -_checks.LOG_RATIO_CLAMP, _checks.LOG_RATIO_CLAMP)
  staleness = jnp.abs(d)
  q = _lower_quantile(staleness, valid, quantile)
  gated = valid & (q > 0) & (staleness > q)
  safe_q = jnp.where(q > 0, q, 1.0)

  def hill(u):  # psi(u; q) = 1 / (1 + (u / q)^p), psi(0) = 1, psi(q) = 1/2
    return 1.0 / (1.0 + jnp.power(u / safe_q, kernel_power))

  c_plus = jnp.where(gated, hill(jnp.maximum(d, 0.0)), 1.0)
  c_minus = jnp.where(gated, hill(jnp.maximum(-d, 0.0)), 1.0)
  count = jnp.maximum(jnp.sum(valid).astype(jnp.float32), 1.0)
  return SatClipBounds(
    clip_low=jnp.float32(clip_low) * c_minus,
    clip_high=jnp.float32(clip_high) * c_plus,
    threshold=q,
    gate_rate=jnp.sum(gated).astype(jnp.float32) / count,
  )


def sat_clip_bounds(
  log_ratio: Float[Array, "B T"],
  mask: Shaped[Array, "B T"],
  *,
  clip_low: float | Float[Array, ""] = 0.2,
  clip_high: float | Float[Array, ""] = 0.2,
  quantile: float | Float[Array, ""] = 0.9,
  kernel_power: float | Float[Array, ""] = 2.0,
) -> SatClipBounds:
  """SAT's staleness-contracted PPO radii (Yang et al. 2026, Eqs. 13-17).

  With the detached sampled log-ratio `d = sg(log r)` (clamped to +-20) as the
  staleness proxy, over the valid tokens of the batch passed in:
    q        = sg(inf {x >= 0 : F_|d|(x) >= quantile})        (Eq. 14)
    psi(u)   = 1 / (1 + (u / q)^p),   u+ = [d]+,  u- = [-d]+  (Eq. 15, p = 2)
    c+-      = psi(u+-)  if q > 0 and |d| > q,  else 1        (Eq. 16)
    eps_low~ = eps_low c-,   eps_high~ = eps_high c+          (Eq. 17)
  Only the sign-selected endpoint of a gated token moves inward (d > 0: the
  upper one, d < 0: the lower one), so the interval stays inside PPO's and
  pull-back updates keep their gradient. Pass the result to `ppo_clip_loss`
  (`clip_low=b.clip_low, clip_high=b.clip_high`) for SAT-PPO/GRPO (what
  `sat_loss` does), or, with the sequence log-ratio broadcast over each
  sequence's tokens, to `gspo_loss` for the paper's SAT-GSPO (Eq. 20).

  Reference: Yang et al. 2026, "Stale but Stable: Staleness-Adaptive Trust
  Regions for Stabilizing Asynchronous Reinforcement Learning",
  https://arxiv.org/abs/2607.18722, Section 4.2; project page
  https://jyyang26.github.io/stable_async_analysis (paper values
  `quantile = 0.9`, kernel exponent 2, `eps_low = eps_high = 0.2`).

  Args:
    log_ratio: the sampled log-ratio `log pi / mu` of the ratio the loss clips,
      with shape `[B, T]` (read detached).
    mask: 1/True on the tokens that count, with shape `[B, T]`.
    clip_low: nominal lower radius `eps_low` in [0, 1).
    clip_high: nominal upper radius `eps_high >= 0`.
    quantile: tail level `alpha` in (0, 1].
    kernel_power: exponent `p > 0` of the Hill kernel (paper: 2).

  Returns:
    `SatClipBounds` (radii `[B, T]`, threshold and gate rate scalars).
  """
  _checks.check_token_arrays(log_ratio=log_ratio, mask=mask)
  _checks.check_float_array(log_ratio, "log_ratio")
  _checks.check_ratio_clips(clip_low, clip_high)
  _check_sat_hyper(quantile, kernel_power)
  valid = _checks.as_mask(mask)
  return _sat_bounds(_checks.as_f32(log_ratio), valid, clip_low, clip_high, quantile, kernel_power)


def sat_loss(
  logp: Float[Array, "B T"],
  old_logp: Float[Array, "B T"],
  advantages: Float[Array, "B T"],
  mask: Shaped[Array, "B T"],
  *,
  clip_low: float | Float[Array, ""] = 0.2,
  clip_high: float | Float[Array, ""] = 0.2,
  dual_clip: float | Float[Array, ""] | None = None,
  quantile: float | Float[Array, ""] = 0.9,
  kernel_power: float | Float[Array, ""] = 2.0,
  is_weights: Float[Array, "B T"] | None = None,
  agg: str = "token-mean",
  agg_scale: Float[Array, ""] | float | None = None,
) -> tuple[Float[Array, ""], PolicyLossMetrics]:
  """PPO clipped surrogate with SAT's staleness-adaptive per-token radii (token-ratio SAT).

  With `d = sg(clamp(lp - olp, -20, 20))` and `(eps_low~, eps_high~) =
  sat_clip_bounds(d, mask)` (the radii of Eqs. 13-17):
    r~_t = clip(r_t, 1 - eps_low~_t, 1 + eps_high~_t)          (Eq. 18)
    L_t  = max(-A r_t, -A r~_t) = -S_t^SAT                     (Eq. 19)
    L_t  = min(L_t, -A c) for A < 0, if `dual_clip` c is given (as `ppo_clip_loss`)
    loss = aggregate(L * sg(is_weights), mask, agg)
  Implements Eqs. (13)-(19) of Yang et al. 2026, "Stale but Stable:
  Staleness-Adaptive Trust Regions for Stabilizing Asynchronous Reinforcement
  Learning", https://arxiv.org/abs/2607.18722 (Section 4.2, the token-ratio
  variant, SAT-GRPO in its experiments). With `old_logp` the behaviour
  (sampler) log-probs, `d` is the paper's staleness proxy `log pi / mu`.
  Properties (its Proposition 4.1): the per-token interval lies inside PPO's,
  the surrogate is pointwise at least as pessimistic as PPO's (the loss at
  least PPO's), and the gradient differs from PPO's only on the newly clipped
  outward band of gated tokens. Tokens inside the tail threshold keep PPO's
  radii, so a batch where `q = 0` (on-policy) gives PPO's loss.

  The threshold `q` is the quantile over the valid tokens of the batch passed
  in, as in the paper (the micro-batch under gradient accumulation), so unlike
  PPO, splitting the batch into micro-batches can change the loss.

  Args:
    logp: current-policy log-probs (differentiated), with shape `[B, T]`.
    old_logp: behaviour / old-policy log-probs (detached), with shape `[B, T]`.
    advantages: per-token advantages (detached), with shape `[B, T]`.
    mask: 1/True on the tokens that count, with shape `[B, T]`.
    clip_low: nominal lower radius `eps_low` in [0, 1) (paper: 0.2).
    clip_high: nominal upper radius `eps_high >= 0` (paper: 0.2).
    dual_clip: dual-clip constant `c > 1` for negative advantages, or None
      (the paper uses none).
    quantile: tail level `alpha` in (0, 1] of the threshold `q` (paper: 0.9).
    kernel_power: exponent `p > 0` of the Hill kernel (paper: 2).
    is_weights: rollout-correction weights (detached), with shape `[B, T]`.
    agg: aggregation mode (see `aggregate`).
    agg_scale: optional denominator for `aggregate` (global batch scale).

  Returns:
    `(loss, metrics)`: float32 scalar and `PolicyLossMetrics` (ratio = `r`;
    clip fractions count the tokens outside their contracted interval).
  """
  _checks.check_ratio_clips(clip_low, clip_high, dual_clip)
  _check_sat_hyper(quantile, kernel_power)
  x = prepare_policy_inputs(
    logp, old_logp, advantages, mask, is_weights=is_weights, agg=agg, agg_scale=agg_scale
  )
  log_ratio = masked_log_ratio(x.logp, x.old_logp, x.valid)
  bounds = _sat_bounds(log_ratio, x.valid, clip_low, clip_high, quantile, kernel_power)
  return clipped_policy_loss(
    x, clip_low=bounds.clip_low, clip_high=bounds.clip_high, dual_clip=dual_clip
  )
