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
from jaxtyping import Array, Float

from rlx.objectives import _checks


def _check_rewards(rewards: jax.Array, name: str = "rewards") -> None:
  _checks.check_rank(rewards, 2, name)
  if rewards.shape[1] < 1:
    raise ValueError(f"`{name}` must have at least one sample per group, got {rewards.shape}.")


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

  References: Shao et al. 2024, "DeepSeekMath" (GRPO),
  https://arxiv.org/abs/2402.03300; Liu et al. 2025, "Understanding R1-Zero-Like
  Training" (Dr.GRPO), https://arxiv.org/abs/2503.20783.

  Args:
    rewards: per-response scalar rewards with shape `[num_groups, G]`.
    normalize_std: divide by the group standard deviation (GRPO) or not (Dr.GRPO).
    eps: added to the standard deviation before dividing.

  Returns:
    float32 advantages with shape `[num_groups, G]`.
  """
  rewards = _checks.as_f32(rewards)
  _check_rewards(rewards)
  _checks.check_non_negative(eps, "eps")
  group_size = rewards.shape[1]
  if group_size == 1:
    mean = jnp.zeros_like(rewards)
    std = jnp.ones_like(rewards)
  else:
    mean = jnp.mean(rewards, axis=1, keepdims=True)
    std = jnp.std(rewards, axis=1, keepdims=True, ddof=1)
  centered = rewards - mean
  if not normalize_std:
    return centered
  # A group of equal rewards gives exactly 0, also with eps = 0 (not 0 / 0 = NaN).
  return jnp.where(centered == 0, jnp.float32(0.0), centered / (std + eps))


def drgrpo_advantages(rewards: Float[Array, "Ng G"]) -> Float[Array, "Ng G"]:
  """Dr.GRPO advantages: the group mean baseline without std scaling.

  A_ig = s_ig - mean_g s   (singleton group: mean 0, so A = s).

  Equivalent to `grpo_advantages(rewards, normalize_std=False)`. Reference:
  Liu et al. 2025, "Understanding R1-Zero-Like Training: A Critical
  Perspective", https://arxiv.org/abs/2503.20783.

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

  Reference: Ahmadian et al. 2024, "Back to Basics: Revisiting REINFORCE Style
  Optimization for Learning from Human Feedback in LLMs",
  https://arxiv.org/abs/2402.14740.

  Args:
    rewards: per-response scalar rewards with shape `[num_groups, G]`.

  Returns:
    float32 advantages with shape `[num_groups, G]`.
  """
  rewards = _checks.as_f32(rewards)
  _check_rewards(rewards)
  group_size = rewards.shape[1]
  if group_size == 1:
    return rewards
  total = jnp.sum(rewards, axis=1, keepdims=True)
  baseline = (total - rewards) / (group_size - 1)
  return rewards - baseline


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
  seq_values = jnp.asarray(seq_values)
  mask = jnp.asarray(mask)
  _checks.check_rank(seq_values, 1, "seq_values")
  _checks.check_rank(mask, 2, "mask")
  if mask.shape[0] != seq_values.shape[0]:
    raise ValueError(
      f"`seq_values` must have shape [B] = ({mask.shape[0]},) matching `mask` {mask.shape}, "
      f"got {tuple(seq_values.shape)}; flatten [num_groups, G] advantages with .reshape(-1)."
    )
  values = _checks.as_f32(seq_values)[:, None]
  return jnp.where(_checks.as_mask(mask), values, jnp.float32(0.0))
