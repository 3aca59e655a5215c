"""Importance weights of the sampled tokens and sequences, and their renormalisation.

Notation: `log rho_t = clamp(target_logp_t - behaviour_logp_t, -20, 20)`, the
clamped token log-ratio of the policy being corrected towards (e.g. the
trainer's `old_logp`) over the policy that sampled (e.g. the rollout engine's
`rollout_logp`). Everything is computed from detached inputs.
"""

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Shaped

from rlx.objectives import _checks
from rlx.objectives._ratios import masked_log_ratio


def _clamped_log_ratio(target_logp, behaviour_logp, mask) -> tuple[jax.Array, jax.Array]:
  _checks.check_token_arrays(target_logp=target_logp, behaviour_logp=behaviour_logp, mask=mask)
  mask = jnp.asarray(mask)
  valid = _checks.as_mask(mask)
  sg = jax.lax.stop_gradient
  log_rho = masked_log_ratio(
    sg(_checks.as_f32(target_logp)), sg(_checks.as_f32(behaviour_logp)), valid
  )
  return log_rho, valid


def token_importance_weights(
  target_logp: Float[Array, "B T"],
  behaviour_logp: Float[Array, "B T"],
  mask: Shaped[Array, "B T"],
) -> Float[Array, "B T"]:
  """Token importance weights `rho_t = exp(clamp(target_logp_t - behaviour_logp_t, -20, 20))`.

  The per-token (T)IS weight of rollout correction (Yao et al. 2025, "Your
  Efficient RL Framework Secretly Brings You Off-Policy RL Training",
  https://fengyao.notion.site/off-policy-rl; verl
  `trainer/ppo/rollout_corr_helper.py`); truncate with `jnp.minimum(rho, C)`.

  Args:
    target_logp: log-probs of the target policy (e.g. `old_logp`), `[B, T]`.
    behaviour_logp: log-probs of the sampling policy (e.g. `rollout_logp`), `[B, T]`.
    mask: 1/True on the tokens that count, with shape `[B, T]`.

  Returns:
    float32 `[B, T]`, 0 wherever `mask` is 0; never differentiated.
  """
  log_rho, valid = _clamped_log_ratio(target_logp, behaviour_logp, mask)
  return jnp.where(valid, jnp.exp(log_rho), 0.0)


def sequence_importance_weights(
  target_logp: Float[Array, "B T"],
  behaviour_logp: Float[Array, "B T"],
  mask: Shaped[Array, "B T"],
) -> Float[Array, " B"]:
  """Sequence importance weights `w_i = exp(clamp(sum_t m_it log rho_it, -20, 20))`.

  `w_i = prod_t rho_it`, the likelihood ratio of the whole sampled sequence,
  with each token's log-ratio clamped to +-20 before the sum and the sum
  clamped to +-20 before `exp` (so `w <= e^20` and `w^2` stays finite in
  float32). Used for sequence-level (T)IS (verl
  `trainer/ppo/rollout_corr_helper.py`, sequence level) and for VCPO's
  effective sample size (Huang et al. 2026, "Stable Asynchrony:
  Variance-Controlled Off-Policy RL for LLMs", https://arxiv.org/abs/2602.17616):
  pass the mask of the SAMPLED tokens, before any token is dropped.

  Args:
    target_logp: log-probs of the target policy (e.g. `old_logp`), `[B, T]`.
    behaviour_logp: log-probs of the sampling policy (e.g. `rollout_logp`), `[B, T]`.
    mask: 1/True on the tokens that count, with shape `[B, T]`.

  Returns:
    float32 `[B]`; 1 for a sequence without valid tokens; never differentiated.
  """
  log_rho, _ = _clamped_log_ratio(target_logp, behaviour_logp, mask)
  clamp = _checks.LOG_RATIO_CLAMP
  return jnp.exp(jnp.clip(jnp.sum(log_rho, axis=1), -clamp, clamp))


def renormalize_weights(
  weights: Float[Array, "..."],
  valid: Shaped[Array, "..."],
) -> Float[Array, "..."]:
  """Weights divided by their mean over the valid entries: `w / (sum_v w / n)`.

  So the valid weights average exactly 1 (self-normalised importance
  sampling; verl `trainer/ppo/rollout_corr_helper.py` batch normalisation).
  When there is no valid entry, or their mean is 0, the weights are returned
  unchanged. Entries outside `valid` are divided too (callers zero them).

  Args:
    weights: importance weights, any shape (`[B]` or `[B, T]`); finite and
      >= 0 where valid (checked when concrete).
    valid: bool or 0/1 with the shape of `weights`.

  Returns:
    float32 with the shape of `weights`; never differentiated.
  """
  _checks.check_real_array(weights, "weights")
  _checks.check_real_array(valid, "valid")
  weights = jnp.asarray(weights)
  _checks.check_not_empty(weights, "weights")
  _checks.check_same_shape("weights", weights, {"valid": valid})
  _checks.check_mask_values(valid, "valid")
  valid = _checks.as_mask(jnp.asarray(valid))
  _checks.check_weight_values(weights, valid, "weights")
  w = jax.lax.stop_gradient(_checks.as_f32(weights))
  count = jnp.sum(valid.astype(jnp.float32))
  mean = _checks.safe_div(jnp.sum(jnp.where(valid, w, 0.0)), count, 1.0)
  return w / jnp.where(mean > 0, mean, 1.0)
