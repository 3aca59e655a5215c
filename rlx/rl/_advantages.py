"""Per-row advantages from group rewards, by baseline name."""

import jax.numpy as jnp
from jaxtyping import Array, Float

from rlx import objectives

# Baselines computed from the group's rewards alone (`group_advantages`).
GROUP_BASELINES = ("grpo", "drgrpo", "rloo", "median")
# Every `rl.baseline`: "vcpo" also needs each response's score-gradient norm and
# IS weight, so the learner computes it after the log-probs (`vcpo_row_advantages`).
BASELINES = (*GROUP_BASELINES, "vcpo")


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
    baseline: one of `GROUP_BASELINES` ("vcpo" needs more than rewards:
      `vcpo_row_advantages`).

  Returns:
    `(advantages f32[B], keep f32[B])`; keep is all ones except the median pivots.
  """
  if baseline == "vcpo":
    raise ValueError(
      "`baseline`='vcpo' needs each row's score-gradient norm and IS weight, not only the "
      "rewards: use `rlx.rl.vcpo_row_advantages` (or `rlx.objectives.vcpo_advantages`)."
    )
  if baseline not in GROUP_BASELINES:
    raise ValueError(f"`baseline` must be one of {GROUP_BASELINES}, got {baseline!r}.")
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


def vcpo_row_advantages(
  rewards: Float[Array, " B"],
  score_norms: Float[Array, " B"],
  current_logp: Float[Array, "B S"],
  rollout_logp: Float[Array, "B S"],
  loss_mask: Float[Array, "B S"],
  group_size: int,
) -> Float[Array, " B"]:
  """Per-row advantages with VCPO's minimum-variance off-policy baseline. Pure.

    w_i  = exp(sum_s m_is (current_logp_is - rollout_logp_is))   (sequence IS weight,
                                                                   log clamped to +-20)
    b*_g = sum_i w_i^2 ||g_i||^2 R_i / (sum_i w_i^2 ||g_i||^2 + 1e-8)   over group g
    A_i  = (R_i - b*_g) / sigma_g   (sigma_g: the group's population reward std,
                                     skipped when <= 1e-8)

  `rlx.objectives.vcpo_advantages` with `seq_weights =
  rlx.objectives.sequence_importance_weights(current_logp, rollout_logp,
  loss_mask)` (untruncated, as VCPO's default `use_clipped_is_ratios=False`)
  and `grad_norms = score_norms`. Huang et al. 2026, "Stable Asynchrony:
  Variance-Controlled Off-Policy RL for LLMs", https://arxiv.org/abs/2602.17616
  (code https://github.com/mit-han-lab/vcpo, defaults of its recipes: group
  scope, mean aggregation, IS weights on, no length normalisation, divided by
  the group's reward std).

  Args:
    rewards: f32[B] per-row rewards, prompt-major (row i*K + j = sample j of prompt i).
    score_norms: f32[B] `||grad log pi_theta(tau_i)||` at the learner's current
      params (`rlx.train.ComputeLogprobs.score_norms`).
    current_logp: f32[B, S] the learner's current per-token log-probs.
    rollout_logp: f32[B, S] the behaviour policy's (the sampler's) log-probs.
    loss_mask: [B, S] the trained tokens.
    group_size: K, samples per prompt.

  Returns:
    f32[B] advantages.
  """
  b = rewards.shape[0]
  if rewards.ndim != 1 or b % group_size or tuple(score_norms.shape) != (b,):
    raise ValueError(
      f"`rewards` and `score_norms` must be f32[B] with B a multiple of group_size={group_size}, "
      f"got {tuple(rewards.shape)} and {tuple(score_norms.shape)}."
    )
  weights = objectives.sequence_importance_weights(current_logp, rollout_logp, loss_mask)
  grouped = (x.reshape(-1, group_size) for x in (rewards, score_norms, weights))
  return objectives.vcpo_advantages(*grouped).reshape(-1)
