"""Group-relative outcome advantages (GRPO, Dr.GRPO, RLOO) and token broadcasting.

Rewards arrive as `[num_groups, G]`: row `i` holds the scalar rewards of the G
responses sampled for prompt `i`. Advantages come back with the same shape;
`broadcast_to_tokens` spreads one value per sequence over its response tokens
after the caller flattens groups into the batch (`advantages.reshape(-1)`).

All arithmetic is float32 whatever the input dtype. Advantages carry no
gradient into the policy (rewards are data), but the functions are plain jnp
and differentiable should a caller need it.
"""

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from rlx.objectives import _checks


def check_rewards(rewards: jax.Array, name: str = "rewards") -> jax.Array:
  """Validates `[num_groups, G]` rewards and returns the bool mask of finite entries.

  Raises ValueError for a rank other than 2, a zero-size shape, or, when the
  values are concrete (an eager call), any NaN/inf entry, naming the first
  group that holds one. Under `jit` the values are unknown; callers then
  exclude the non-finite entries with the returned mask.
  """
  _checks.check_real_array(rewards, name)
  _checks.check_rank(rewards, 2, name)
  _checks.check_not_empty(
    rewards, name, "[num_groups, G] with at least one group and one sample per group"
  )
  if _checks.is_concrete(rewards):
    values = np.asarray(rewards)
    bad = ~np.isfinite(values)
    if bad.any():
      group, member = (int(i) for i in np.argwhere(bad)[0])
      raise ValueError(
        f"`{name}` must be finite: group {group} holds {values[group, member]} at sample "
        f"{member} ({int(bad.sum())} non-finite value(s) in total; groups "
        f"{sorted({int(g) for g in np.nonzero(bad.any(axis=1))[0]})})."
      )
  return jnp.isfinite(jnp.asarray(rewards))


def group_scale(rewards: jax.Array, finite: jax.Array) -> jax.Array:
  """A power of two per group, `[Ng, 1]`, within a factor 2 of the largest finite |reward|.

  Statistics are computed on `rewards / scale`: dividing by a power of two is
  exact, so results are unchanged for ordinary rewards, while sums and squares
  stay finite for rewards up to the float32 maximum (1e30 would otherwise
  square to inf and give every member advantage 0). 1 for an all-zero group.
  """
  biggest = jnp.max(jnp.where(finite, jnp.abs(rewards), 0.0), axis=1, keepdims=True)
  _, exponent = jnp.frexp(biggest)
  # |exponent| <= 125 keeps the scale and its reciprocal normal (XLA flushes subnormals).
  exponent = jnp.clip(exponent - 1, -125, 125)
  return jnp.where(biggest > 0, jnp.ldexp(jnp.float32(1.0), exponent), jnp.float32(1.0))


def _group_stats(rewards: jax.Array, finite: jax.Array) -> tuple[jax.Array, ...]:
  """Count, sum, mean and unbiased std over each group's finite members, `[Ng, 1]` each."""
  count = jnp.sum(finite, axis=1, keepdims=True).astype(jnp.float32)
  values = jnp.where(finite, rewards, 0.0)
  total = jnp.sum(values, axis=1, keepdims=True)
  mean = total / jnp.maximum(count, 1.0)
  square = jnp.sum(jnp.where(finite, jnp.square(rewards - mean), 0.0), axis=1, keepdims=True)
  std = jnp.sqrt(square / jnp.maximum(count - 1.0, 1.0))
  return count, total, mean, std


def grpo_advantages(
  rewards: Float[Array, "Ng G"],
  *,
  normalize_std: bool = True,
  eps: float = 1e-6,
) -> Float[Array, "Ng G"]:
  """GRPO group-normalised outcome advantages.

  A_ig = (s_ig - mean_g s) / (std_g s + eps)   (normalize_std=True, GRPO)
  A_ig =  s_ig - mean_g s                      (normalize_std=False, Dr.GRPO)

  `std` is the *unbiased* (N - 1) standard deviation of the group, as in verl's
  `compute_grpo_outcome_advantage`. A singleton group (G = 1) uses mean 0 and
  std 1, again as verl does, so its advantage is `s / (1 + eps)` (or `s`). A
  response at its group mean gets exactly 0, even with `eps = 0` and a group of
  equal rewards (where the formula would be 0 / 0).

  Non-finite rewards: an eager call raises ValueError naming the group. Under
  `jit` a NaN/inf reward is contained: it gets advantage 0 and is left out of
  its group's mean and std, so the finite members are scored as a group of
  the finite ones (one finite member: the singleton rule above).

  References: Shao et al. 2024, "DeepSeekMath" (GRPO),
  https://arxiv.org/abs/2402.03300; Liu et al. 2025, "Understanding R1-Zero-Like
  Training" (Dr.GRPO), https://arxiv.org/abs/2503.20783.

  Args:
    rewards: per-response scalar rewards with shape `[num_groups, G]`.
    normalize_std: divide by the group standard deviation (GRPO) or not (Dr.GRPO).
    eps: added to the standard deviation before dividing, `>= 0`.

  Returns:
    float32 advantages with shape `[num_groups, G]`.
  """
  finite = check_rewards(rewards)
  rewards = _checks.as_f32(rewards)
  _checks.check_flag(normalize_std, "normalize_std")
  _checks.check_finite(eps, "eps")
  _checks.check_non_negative(eps, "eps")
  scale = group_scale(rewards, finite)
  scaled = jnp.where(finite, rewards / scale, 0.0)
  count, _, mean, std = _group_stats(scaled, finite)
  singleton = count <= 1.0
  mean = jnp.where(singleton, 0.0, mean)
  std = jnp.where(singleton, 1.0 / scale, std)
  centered = jnp.where(finite, scaled - mean, 0.0)
  if not normalize_std:
    return centered * scale
  # A group of equal rewards gives exactly 0, also with eps = 0 (not 0 / 0 = NaN).
  return jnp.where(centered == 0, jnp.float32(0.0), centered / (std + eps / scale))


def drgrpo_advantages(rewards: Float[Array, "Ng G"]) -> Float[Array, "Ng G"]:
  """Dr.GRPO advantages: the group mean baseline without std scaling.

  A_ig = s_ig - mean_g s   (singleton group: mean 0, so A = s).

  Equivalent to `grpo_advantages(rewards, normalize_std=False)`, including its
  handling of non-finite rewards. Reference: Liu et al. 2025, "Understanding
  R1-Zero-Like Training: A Critical Perspective", https://arxiv.org/abs/2503.20783.

  Args:
    rewards: per-response scalar rewards with shape `[num_groups, G]`.

  Returns:
    float32 advantages with shape `[num_groups, G]`.
  """
  return grpo_advantages(rewards, normalize_std=False)


def rloo_advantages(rewards: Float[Array, "Ng G"]) -> Float[Array, "Ng G"]:
  """REINFORCE leave-one-out advantages.

  A_ig = s_ig - mean_{j != g} s_ij = G / (G - 1) * (s_ig - mean_g s).

  A singleton group has no other member to form a baseline; as in verl's
  `compute_rloo_outcome_advantage` its baseline is 0, so A = s.

  Non-finite rewards: an eager call raises ValueError naming the group. Under
  `jit` a NaN/inf reward is contained: it gets advantage 0 and is left out of
  the other members' baselines (a group of its finite members; one finite
  member: the singleton rule above).

  Reference: Ahmadian et al. 2024, "Back to Basics: Revisiting REINFORCE Style
  Optimization for Learning from Human Feedback in LLMs",
  https://arxiv.org/abs/2402.14740.

  Args:
    rewards: per-response scalar rewards with shape `[num_groups, G]`.

  Returns:
    float32 advantages with shape `[num_groups, G]`.
  """
  finite = check_rewards(rewards)
  rewards = _checks.as_f32(rewards)
  scale = group_scale(rewards, finite)
  values = jnp.where(finite, rewards / scale, 0.0)
  count, total, _, _ = _group_stats(values, finite)
  others = jnp.maximum(count - 1.0, 1.0)
  baseline = jnp.where(count <= 1.0, 0.0, (total - values) / others)
  return jnp.where(finite, (values - baseline) * scale, 0.0)


def broadcast_to_tokens(
  seq_values: Float[Array, " B"],
  mask: Float[Array, "B T"],
) -> Float[Array, "B T"]:
  """Broadcasts one value per sequence over its valid tokens.

  out[b, t] = seq_values[b] if mask[b, t] else 0.

  Selection uses `jnp.where`, so a NaN in `seq_values` of a sequence whose mask
  is all zero never reaches the output.

  Args:
    seq_values: per-sequence values (e.g. flattened advantages) with shape `[B]`.
    mask: response mask with shape `[B, T]` (bool or 0/1).

  Returns:
    float32 array with shape `[B, T]`.
  """
  _checks.check_real_array(seq_values, "seq_values")
  _checks.check_real_array(mask, "mask")
  seq_values = jnp.asarray(seq_values)
  mask = jnp.asarray(mask)
  _checks.check_rank(seq_values, 1, "seq_values")
  _checks.check_token_arrays(mask=mask)
  if mask.shape[0] != seq_values.shape[0]:
    raise ValueError(
      f"`seq_values` must have shape [B] = ({mask.shape[0]},) matching `mask` {mask.shape}, "
      f"got {tuple(seq_values.shape)}; flatten [num_groups, G] advantages with .reshape(-1)."
    )
  values = _checks.as_f32(seq_values)[:, None]
  return jnp.where(_checks.as_mask(mask), values, jnp.float32(0.0))
