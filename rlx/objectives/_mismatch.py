"""Rollout/trainer mismatch: KL estimates between the sampler's and the trainer's policy."""

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Shaped

from rlx.objectives import _checks, _kl
from rlx.objectives._ratios import masked_log_ratio


class MismatchKL(NamedTuple):
  """Token-mean KL(pi_rollout || pi_old) estimates, float32 scalars.

  Attributes:
    k1: mean of `-log rho` (unbiased, can be negative).
    k3: mean of `rho - 1 - log rho` (unbiased, >= 0, low variance).
  """

  k1: jax.Array
  k3: jax.Array


def rollout_mismatch_kl(
  old_logp: Float[Array, "B T"],
  rollout_logp: Float[Array, "B T"],
  mask: Shaped[Array, "B T"],
) -> MismatchKL:
  """k1 and k3 estimates of KL(pi_rollout || pi_old) from the sampled tokens.

  With `log rho_t = clamp(old_logp_t - rollout_logp_t, -20, 20)` (trainer over
  sampler) and the `n` valid tokens:

    k1 = sum_t m_t (-log rho_t) / n
    k3 = sum_t m_t (rho_t - 1 - log rho_t) / n

  the estimators of J. Schulman, "Approximating KL Divergence" (2020),
  http://joschu.net/blog/kl-approx.html, with samples from the sampler
  (`Delta = rollout_logp - old_logp`). The values do not depend on any
  correction setting: `rollout_correction` reports the same numbers as
  `RolloutCorrectionMetrics.mismatch_k1/k3`. k3 is not clamped to +-10 (verl
  clamps it only as a loss penalty); the +-20 log-ratio clamp keeps it finite.
  Reference: verl `trainer/ppo/rollout_corr_helper.py` (its mismatch metrics).

  Args:
    old_logp: trainer log-probs of the sampled tokens, with shape `[B, T]`.
    rollout_logp: sampler log-probs of the same tokens, with shape `[B, T]`.
    mask: 1/True on the tokens that count, with shape `[B, T]`.

  Returns:
    `MismatchKL(k1, k3)`; both 0 when no token is valid. Nothing is
    differentiated. Masked positions are replaced before any arithmetic.
  """
  _checks.check_token_arrays(old_logp=old_logp, rollout_logp=rollout_logp, mask=mask)
  mask = jnp.asarray(mask)
  valid = _checks.as_mask(mask)
  old = jax.lax.stop_gradient(_checks.as_f32(old_logp))
  rollout = jax.lax.stop_gradient(_checks.as_f32(rollout_logp))
  delta = -masked_log_ratio(old, rollout, valid)  # rollout - old, clamped; 0 where invalid
  n = jnp.sum(valid.astype(jnp.float32))
  k1 = jnp.sum(jnp.where(valid, _kl.k1(delta), 0.0))
  k3 = jnp.sum(jnp.where(valid, _kl.k3(delta), 0.0))
  return MismatchKL(k1=_checks.safe_div(k1, n, 0.0), k3=_checks.safe_div(k3, n, 0.0))
