"""SAPO: a smooth sigmoid gate on the ratio instead of a hard clip (verl SAPO loss)."""

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Shaped

from rlx.objectives._checks import check_finite, check_positive
from rlx.objectives._metrics import PolicyLossMetrics
from rlx.objectives._policy_inputs import policy_loss_result, prepare_policy_inputs
from rlx.objectives._ratios import masked_log_ratio


def sapo_loss(
  logp: Float[Array, "B T"],
  old_logp: Float[Array, "B T"],
  advantages: Float[Array, "B T"],
  mask: Shaped[Array, "B T"],
  *,
  tau_pos: float | Float[Array, ""] = 1.0,
  tau_neg: float | Float[Array, ""] = 1.05,
  is_weights: Float[Array, "B T"] | None = None,
  agg: str = "token-mean",
  agg_scale: Float[Array, ""] | float | None = None,
) -> tuple[Float[Array, ""], PolicyLossMetrics]:
  """Soft Adaptive Policy Optimization loss (soft gate).

    r    = exp(clamp(lp - olp, -20, 20))
    tau  = tau_pos if A > 0 else tau_neg
    f(r) = (4 / tau) * sigmoid(tau * (r - 1))
    L_t  = -f(r) * A * sg(is_weights)
    loss = aggregate(L, mask, agg)
  `f'(1) = 1`, so on-policy the gradient is the plain policy gradient; far
  from `r = 1` the gate's gradient decays smoothly instead of being cut. Gao et
  al. (Qwen team) 2025, "Soft Adaptive Policy Optimization",
  https://arxiv.org/abs/2511.20347; verl `compute_policy_loss_sapo`.

  Args:
    logp: current-policy log-probs (differentiated), with shape `[B, T]`.
    old_logp: old-policy log-probs (detached), with shape `[B, T]`.
    advantages: per-token advantages (detached), with shape `[B, T]`.
    mask: 1/True on the tokens that count, with shape `[B, T]`.
    tau_pos: finite gate temperature `> 0` for positive advantages.
    tau_neg: finite gate temperature `> 0` for non-positive advantages.
    is_weights: rollout-correction weights (detached), with shape `[B, T]`.
    agg: aggregation mode (see `aggregate`).
    agg_scale: optional denominator for `aggregate` (global batch scale).

  Returns:
    `(loss, metrics)`: float32 scalar and `PolicyLossMetrics` (ratio = `r`;
    the clip fractions are 0: nothing is hard-clipped).
  """
  for name, tau in (("tau_pos", tau_pos), ("tau_neg", tau_neg)):
    # tau = inf would make the gate 0 everywhere (no gradient, loss 0).
    check_positive(tau, name)
    check_finite(tau, name)
  x = prepare_policy_inputs(
    logp, old_logp, advantages, mask, is_weights=is_weights, agg=agg, agg_scale=agg_scale
  )
  adv = x.advantages
  log_ratio = masked_log_ratio(x.logp, x.old_logp, x.valid)
  ratio = jnp.exp(log_ratio)
  tau = jnp.where(adv > 0, tau_pos, tau_neg)
  gate = (4.0 / tau) * jax.nn.sigmoid(tau * (ratio - 1.0))
  return policy_loss_result(x, -gate * adv, log_ratio, ratio)
