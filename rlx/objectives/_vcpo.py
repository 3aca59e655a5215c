"""VCPO: an effective-sample-size learning-rate factor for off-policy batches."""

import jax.numpy as jnp
from jaxtyping import Array, Bool, Float

from rlx.objectives import _checks
from rlx.objectives._ess import effective_sample_size


def vcpo_lr_factor(
  seq_weights: Float[Array, " B"],
  *,
  valid: Bool[Array, " B"] | None = None,
) -> tuple[Float[Array, ""], Float[Array, ""]]:
  """Normalised ESS of sequence IS weights and the learning-rate factor sqrt(min(1, ESS)).

    rho_ess   = (sum_i w_i)^2 / (B * sum_i w_i^2)
    lr_factor = sqrt(min(1, rho_ess)),   lr = lr_base * lr_factor

  over the B valid sequences. rho_ess is 1 for equal weights and 1/B when one
  sequence carries all the weight. With no valid sequence, or all weights 0,
  the ESS is undefined and both outputs are 1 (the update is empty anyway).
  The optimizer applies the factor, e.g. through `optax.scale_by_schedule` or
  by scaling the updates; nothing here is differentiated.

  Reference: Huang et al. 2026, "Stable Asynchrony: Variance-Controlled
  Off-Policy RL for LLMs" (VCPO), https://arxiv.org/abs/2602.17616, code
  https://github.com/mit-han-lab/vcpo: ESS-guided step scaling
  `lr_eff ~ sqrt(rho_ess)` for AdamW-style optimizers. rlx implements that
  step-size rule, not the paper's closed-form off-policy baseline.

  Typical use, with the SAMPLED tokens' mask:
    w = sequence_importance_weights(old_logp, rollout_logp, mask)
    rho_ess, lr_factor = vcpo_lr_factor(w, valid=jnp.any(mask, axis=1))

  Args:
    seq_weights: non-negative sequence-level IS weights `[B]`, e.g.
      `sequence_importance_weights(old_logp, rollout_logp, mask)` (possibly
      truncated); finite and >= 0 where valid (checked when concrete).
    valid: optional bool or 0/1 `[B]`; False entries are ignored (NaN-safe).

  Returns:
    `(rho_ess, lr_factor)`, float32 scalars.
  """
  _checks.check_real_array(seq_weights, "seq_weights")
  seq_weights = jnp.asarray(seq_weights)
  _checks.check_rank(seq_weights, 1, "seq_weights")
  if seq_weights.shape[0] == 0:
    raise ValueError("`seq_weights` must hold at least one sequence, got shape (0,).")
  if valid is None:
    valid = jnp.ones(seq_weights.shape, jnp.bool_)
  else:
    _checks.check_real_array(valid, "valid")
    _checks.check_same_shape("seq_weights", seq_weights, {"valid": valid})
    _checks.check_mask_values(valid, "valid")
    valid = _checks.as_mask(jnp.asarray(valid))
  _checks.check_weight_values(seq_weights, valid, "seq_weights")
  rho_ess = effective_sample_size(seq_weights, valid)
  lr_factor = jnp.sqrt(jnp.minimum(rho_ess, 1.0))
  return rho_ess, lr_factor
