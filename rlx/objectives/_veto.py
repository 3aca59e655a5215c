"""Rollout-mismatch veto: drop every sequence holding a token the trainer finds very unlikely."""

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Shaped

from rlx.objectives import _checks


def rollout_veto_mask(
  old_logp: Float[Array, "B T"],
  rollout_logp: Float[Array, "B T"],
  mask: Shaped[Array, "B T"],
  *,
  threshold: float | Float[Array, ""],
) -> Bool[Array, "B T"]:
  """Keep-mask of the veto: a sequence with any valid token whose `rho_t < tau` is removed.

    log rho_t = old_logp_t - rollout_logp_t     (unclamped)
    keep_it   = m_it  and  not any_s (m_is and log rho_is < log tau)

  A token the sampler picked but the trainer gives a far smaller probability
  (`rho -> 0`) marks a sequence the trainer would never have produced; its
  whole sequence is dropped rather than reweighted. The comparison is in log
  space on the unclamped log-ratio, so thresholds below e^-20 (e.g. 1e-12)
  act as stated. Reference: verl `trainer/ppo/rollout_corr_helper.py` (its
  per-token veto); Yingru Li et al., "When Speed Kills
  Stability: Demystifying RL Collapse from the Training-Inference Mismatch",
  https://richardli.xyz/rl-collapse.

  Args:
    old_logp: trainer log-probs of the sampled tokens, with shape `[B, T]`.
    rollout_logp: sampler log-probs of the same tokens, with shape `[B, T]`.
    mask: 1/True on the tokens that count, with shape `[B, T]`.
    threshold: `tau > 0` (e.g. 1e-4).

  Returns:
    bool `[B, T]`, a subset of `mask`. Masked positions never matter.
  """
  _checks.check_token_arrays(old_logp=old_logp, rollout_logp=rollout_logp, mask=mask)
  mask = jnp.asarray(mask)
  _checks.check_positive(threshold, "threshold")
  valid = _checks.as_mask(mask)
  log_rho = jax.lax.stop_gradient(
    _checks.where_mask(valid, _checks.as_f32(old_logp))
    - _checks.where_mask(valid, _checks.as_f32(rollout_logp))
  )
  below = valid & (log_rho < jnp.log(jnp.asarray(threshold, jnp.float32)))
  return valid & ~jnp.any(below, axis=1, keepdims=True)
