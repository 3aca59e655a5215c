"""VCPO: an effective-sample-size learning-rate factor and the minimum-variance baseline."""

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float

from rlx.objectives import _checks
from rlx.objectives._advantages import check_rewards
from rlx.objectives._ess import effective_sample_size

# Groups whose reward std is at most this are not divided by it (the reference's guard).
_MIN_REWARD_STD = 1e-8


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
  `lr_eff ~ sqrt(rho_ess)` for AdamW-style optimizers. VCPO's other half, the
  closed-form minimum-variance off-policy baseline, is `vcpo_baseline` /
  `vcpo_advantages`.

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
  valid = _checks.checked_weight_mask(seq_weights, valid, "seq_weights")
  rho_ess = effective_sample_size(seq_weights, valid)
  lr_factor = jnp.sqrt(jnp.minimum(rho_ess, 1.0))
  return rho_ess, lr_factor


def _check_group_array(x, name: str, rewards: jax.Array) -> jax.Array:
  """A non-negative `[num_groups, G]` array with the shape of `rewards`, float32."""
  _checks.check_float_array(x, name)
  x = jnp.asarray(x)
  _checks.check_same_shape("rewards", rewards, {name: x})
  _checks.check_weight_values(x, None, name)
  return _checks.as_f32(x)


def vcpo_baseline(
  rewards: Float[Array, "Ng G"],
  grad_norms: Float[Array, "Ng G"],
  seq_weights: Float[Array, "Ng G"],
  *,
  eps: float | Float[Array, ""] = 1e-8,
) -> Float[Array, " Ng"]:
  """VCPO's closed-form off-policy optimal baseline (OPOB), one per group.

    W_i = w_i^2 ||grad_theta log pi_theta(tau_i)||^2
    b*  = sum_i W_i R_i / (sum_i W_i + eps)

  over the G responses of each group (prompt). For the per-sample
  importance-weighted REINFORCE estimator `g_i = w_i (R_i - b) grad log
  pi(tau_i)` (unbiased for any constant `b`, since `E_mu[w grad log pi] = 0`),
  the trace of the variance is `E[w^2 ||grad log pi||^2 (R - b)^2]` minus a
  term free of `b`: a quadratic in `b`, minimised by the ratio of
  expectations whose sample version is `b*`. Responses whose score gradient or IS weight is
  large dominate the baseline; with equal `W_i` it is the group's mean reward
  (GRPO's baseline), and with every `W_i = 0` it is 0.

  Reference: Huang et al. 2026, "Stable Asynchrony: Variance-Controlled
  Off-Policy RL for LLMs" (VCPO), https://arxiv.org/abs/2602.17616; code
  https://github.com/mit-han-lab/vcpo (the formula in its README,
  `compute_opob_baseline` in `recipe/fully_async_policy/staleness_utils.py`,
  group scope, mean aggregation, `eps = 1e-8`). Its options `use_is_weights=
  False` and `normalize_by_length` correspond to passing `seq_weights = 1`
  and `grad_norms / L_i`.

  Args:
    rewards: scalar rewards `R_i` with shape `[num_groups, G]`; finite.
    grad_norms: per-response score-gradient norms `||grad log pi(tau_i)||`
      (of the whole sequence log-prob, a sum over its tokens) with shape
      `[num_groups, G]`; finite and >= 0 (checked when concrete). The caller
      computes them (one backward pass per response); nothing here is
      differentiated.
    seq_weights: sequence importance weights `w_i` (e.g.
      `sequence_importance_weights(old_logp, rollout_logp, mask)` reshaped to
      `[num_groups, G]`); finite and >= 0 (checked when concrete).
    eps: `>= 0`, added to the denominator.

  Returns:
    float32 baselines with shape `[num_groups]`.
  """
  finite = check_rewards(rewards)
  rewards = _checks.as_f32(rewards)
  grad_norms = _check_group_array(grad_norms, "grad_norms", rewards)
  seq_weights = _check_group_array(seq_weights, "seq_weights", rewards)
  _checks.check_non_negative(eps, "eps")
  _checks.check_finite(eps, "eps")
  sg = jax.lax.stop_gradient
  weight = sg(jnp.square(grad_norms) * jnp.square(seq_weights))
  # Under jit, non-finite entries (not checkable there) are left out.
  weight = jnp.where(finite & jnp.isfinite(weight), weight, 0.0)
  total = jnp.sum(jnp.where(weight > 0, weight * sg(rewards), 0.0), axis=1)
  return total / (jnp.sum(weight, axis=1) + eps)


def vcpo_advantages(
  rewards: Float[Array, "Ng G"],
  grad_norms: Float[Array, "Ng G"],
  seq_weights: Float[Array, "Ng G"],
  *,
  normalize_std: bool = True,
  eps: float | Float[Array, ""] = 1e-8,
) -> Float[Array, "Ng G"]:
  """Advantages with VCPO's off-policy optimal baseline: `(R_i - b*) / sigma`.

    A_i = (R_i - b*_g) / sigma_g   if normalize_std and sigma_g > 1e-8
    A_i =  R_i - b*_g              otherwise

  with `b*_g = vcpo_baseline(...)` of the response's group and `sigma_g` the
  population (N) standard deviation of the group's rewards, as VCPO's
  reference scales reward and baseline by `1 / sigma` (its `norm_by_std`,
  `torch.std(unbiased=False)`, `reward_std > 1e-8`). With equal `W_i` and
  `normalize_std=False` this is Dr.GRPO's `R - mean R`.

  Reference: Huang et al. 2026 (VCPO), https://arxiv.org/abs/2602.17616;
  https://github.com/mit-han-lab/vcpo (`_update_grad_buffers` in
  `verl/workers/actor/megatron_actor.py`).

  Args:
    rewards: scalar rewards with shape `[num_groups, G]`; finite.
    grad_norms: per-response score-gradient norms, `[num_groups, G]`, >= 0.
    seq_weights: sequence importance weights, `[num_groups, G]`, >= 0.
    normalize_std: divide by the group's reward standard deviation.
    eps: `>= 0`, added to the baseline's denominator.

  Returns:
    float32 advantages with shape `[num_groups, G]` (0 for non-finite rewards
    under `jit`); spread them over tokens with `broadcast_to_tokens`.
  """
  _checks.check_flag(normalize_std, "normalize_std")
  baseline = vcpo_baseline(rewards, grad_norms, seq_weights, eps=eps)
  finite = jnp.isfinite(jnp.asarray(rewards))
  values = jnp.where(finite, _checks.as_f32(rewards), 0.0)
  centered = jnp.where(finite, values - baseline[:, None], 0.0)
  if not normalize_std:
    return centered
  count = jnp.maximum(jnp.sum(finite, axis=1, keepdims=True).astype(jnp.float32), 1.0)
  mean = jnp.sum(values, axis=1, keepdims=True) / count
  variance = jnp.sum(jnp.where(finite, jnp.square(values - mean), 0.0), axis=1, keepdims=True)
  std = jnp.sqrt(variance / count)
  return jnp.where(std > _MIN_REWARD_STD, centered / jnp.where(std > 0, std, 1.0), centered)
