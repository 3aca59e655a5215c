"""Per-row advantages from group rewards, by baseline name."""

import jax.numpy as jnp
from jaxtyping import Array, Float

from rlx import objectives

BASELINES = ("grpo", "drgrpo", "rloo", "median")


def group_advantages(
  rewards: Float[Array, " B"], group_size: int, baseline: str
) -> tuple[Float[Array, " B"], Float[Array, " B"]]:
  """Advantages and keep-mask of prompt-major rows (row i*K + j = sample j of prompt i).

  Baselines (all from rlx.objectives):
    grpo    (s - mean) / (std + eps)          Shao et al. 2024, https://arxiv.org/abs/2402.03300
    drgrpo  s - mean                          Liu et al. 2025, https://arxiv.org/abs/2503.20783
    rloo    s - mean of the other samples     Ahmadian et al. 2024, https://arxiv.org/abs/2402.14740
    median  MC-GRPO: (s - median) / std over K = G + 1 samples, the median
            pivot dropped (keep = 0), https://github.com/lotusroot-kim/MC-GRPO

  Args:
    rewards: f32[B] per-row rewards, B = num_groups * group_size.
    group_size: K, samples per prompt (odd for "median").
    baseline: one of `BASELINES`.

  Returns:
    `(advantages f32[B], keep f32[B])`; keep is all ones except the median pivots.
  """
  if baseline not in BASELINES:
    raise ValueError(f"`baseline` must be one of {BASELINES}, got {baseline!r}.")
  rewards = jnp.asarray(rewards, jnp.float32)
  if rewards.ndim != 1 or rewards.shape[0] % group_size:
    raise ValueError(
      f"`rewards` must be f32[B] with B a multiple of group_size={group_size}, got {rewards.shape}."
    )
  grouped = rewards.reshape(-1, group_size)
  keep = jnp.ones_like(grouped)
  if baseline == "grpo":
    adv = objectives.grpo_advantages(grouped)
  elif baseline == "drgrpo":
    adv = objectives.drgrpo_advantages(grouped)
  elif baseline == "rloo":
    adv = objectives.rloo_advantages(grouped)
  else:
    adv, keep = objectives.median_advantages(grouped)
  return adv.reshape(-1), keep.reshape(-1)
