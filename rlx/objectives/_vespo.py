"""VESPO: a gamma-kernel weight of the true sequence ratio, REINFORCE-style, for stale data."""

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Shaped

from rlx.objectives import _checks
from rlx.objectives._aggregate import aggregate
from rlx.objectives._metrics import PolicyLossMetrics, policy_loss_metrics
from rlx.objectives._policy_inputs import prepare_policy_inputs
from rlx.objectives._ratios import masked_log_ratio

# Floors of the reference: lambda of the kernel, and weights / ratios before a log.
_MIN_LAMBDA = 1e-4
_MIN_WEIGHT = 1e-8


def _first_valid(values: jax.Array, valid: jax.Array) -> jax.Array:
  """`values[i, t_i]` at each row's first valid token `t_i` (row 0 entry if none), `[B]`."""
  first = jnp.argmax(valid, axis=1)
  return jnp.take_along_axis(values, first[:, None], axis=1)[:, 0]


def vespo_loss(
  logp: Float[Array, "B T"],
  old_logp: Float[Array, "B T"],
  advantages: Float[Array, "B T"],
  mask: Shaped[Array, "B T"],
  *,
  k_pos: float | Float[Array, ""] = 2.0,
  lambda_pos: float | Float[Array, ""] = 3.0,
  k_neg: float | Float[Array, ""] = 3.0,
  lambda_neg: float | Float[Array, ""] = 2.0,
  is_weights: Float[Array, "B T"] | None = None,
  agg: str = "token-mean",
  agg_scale: Float[Array, ""] | float | None = None,
) -> tuple[Float[Array, ""], PolicyLossMetrics]:
  """Variational sequence-level soft policy optimization loss (gamma-weighted REINFORCE).

  With `delta_t = clamp(lp_t - olp_t, -20, 20)`, optional token weights
  `rho_t` (`is_weights`) and `A_i` the advantage of sequence i's first valid
  token:
    s_i      = clamp(sum_t m_t delta_t + sum_t m_t clamp(log max(rho_t, 1e-8), -20, 20),
                     -20, 20)
    w_i      = exp(s_i)                                   (true sequence ratio, no 1/n)
    (k, lam) = (k_pos, lambda_pos) if A_i >= 0 else (k_neg, lambda_neg),
               lam <- max(lam, 1e-4)
    phi(w)   = exp(lam + k log max(w, 1e-8) - lam w)      (gamma kernel, phi(1) = 1)
    L_it     = -sg(phi(w_i)) A_it lp_it                   (phi non-finite -> 0)
    loss     = aggregate(L, mask, agg)                    (default token-mean)
  so the gradient is `phi(w_i) A grad log pi`: a sequence whose ratio is far
  from 1 (stale, or off the sampler) is smoothly down-weighted on both sides,
  with the peak of `phi` at `w = k / lam` (2/3 for A >= 0, 3/2 for A < 0 with
  the defaults). The value
  of the loss is a REINFORCE surrogate (like CISPO's), not a ratio objective.

  Shen et al. 2026, "VESPO: Variational Sequence-Level Soft Policy
  Optimization for Stable Off-Policy LLM Training",
  https://arxiv.org/abs/2602.10693; as its public code computes it
  (https://github.com/FloyedShen/VESPO, `compute_policy_loss_vespo` in
  `recipe/vespo/code/core_algos.py`), whose defaults (2, 3) / (3, 2) are used
  here (its docstring states 2 / 1.5 / 4 / 2.5; the code is what ran).
  Deviation: the reference reads the sequence advantage at token 0; rlx reads
  it at the first valid token (the same whenever token 0 counts).

  `is_weights`: unlike the other losses, which multiply the per-token loss by
  them, VESPO folds the rollout-correction weights `rho = pi_old / pi_sampler`
  into the sequence ratio in log space, so `w_i = pi / pi_sampler` (the
  reference's use of its `rollout_is_weights`). They must be TOKEN-level
  weights (e.g. `rollout_correction(..., level="token")`): sequence-level
  weights broadcast over the tokens would be counted once per token.

  Args:
    logp: current-policy log-probs (differentiated), with shape `[B, T]`.
    old_logp: old-policy log-probs (detached), with shape `[B, T]`.
    advantages: per-token advantages (detached), with shape `[B, T]`; the sign
      of each sequence's (first valid) advantage selects its kernel.
    mask: 1/True on the tokens that count, with shape `[B, T]`.
    k_pos: kernel shape `k >= 0` for sequences with `A >= 0`.
    lambda_pos: kernel rate `lam >= 0` for `A >= 0` (floored at 1e-4).
    k_neg: kernel shape `k >= 0` for sequences with `A < 0`.
    lambda_neg: kernel rate `lam >= 0` for `A < 0` (floored at 1e-4).
    is_weights: token-level rollout-correction weights (detached), with shape
      `[B, T]`, folded into `w` in log space (see above).
    agg: aggregation mode (see `aggregate`).
    agg_scale: optional denominator for `aggregate` (global batch scale).

  Returns:
    `(loss, metrics)`: float32 scalar and `PolicyLossMetrics` (ratio = the
    sequence ratio `w_i`, broadcast over the sequence's tokens; approx_kl uses
    the token log-ratio; the clip fractions are 0: nothing is clipped).
  """
  for name, value in (
    ("k_pos", k_pos),
    ("lambda_pos", lambda_pos),
    ("k_neg", k_neg),
    ("lambda_neg", lambda_neg),
  ):
    _checks.check_non_negative(value, name)
    _checks.check_finite(value, name)
  x = prepare_policy_inputs(
    logp, old_logp, advantages, mask, is_weights=is_weights, agg=agg, agg_scale=agg_scale
  )
  sg = jax.lax.stop_gradient
  clamp = _checks.LOG_RATIO_CLAMP
  log_ratio = masked_log_ratio(x.logp, x.old_logp, x.valid)
  seq_log_ratio = jnp.sum(log_ratio, axis=1)
  if x.is_weights is not None:
    log_rho = _checks.clip(jnp.log(jnp.maximum(x.is_weights, _MIN_WEIGHT)), -clamp, clamp)
    seq_log_ratio = seq_log_ratio + jnp.sum(_checks.where_mask(x.valid, log_rho), axis=1)
  w = jnp.exp(sg(_checks.clip(seq_log_ratio, -clamp, clamp)))
  positive = _first_valid(x.advantages, x.valid) >= 0
  k = jnp.where(positive, k_pos, k_neg)
  lam = jnp.maximum(jnp.where(positive, lambda_pos, lambda_neg), _MIN_LAMBDA)
  phi = jnp.exp(lam + k * jnp.log(jnp.maximum(w, _MIN_WEIGHT)) - lam * w)
  phi = sg(jnp.where(jnp.isfinite(phi), phi, 0.0))
  per_token = -phi[:, None] * x.advantages * x.logp
  loss = aggregate(per_token, x.valid, agg, scale=agg_scale)
  metrics = policy_loss_metrics(
    x.valid,
    log_ratio=log_ratio,
    ratio=jnp.broadcast_to(w[:, None], log_ratio.shape),
    is_weights=x.is_weights,
  )
  return loss, metrics
