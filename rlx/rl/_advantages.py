"""Per-row advantages from group rewards, by baseline name."""

import jax
import jax.numpy as jnp
import numpy as np
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
    W_i  = w_i^2 ||g_i||^2,  scaled per group so that its largest W is 1
    b*_g = sum_i W_i R_i / (sum_i W_i + 1e-8)   over group g
    A_i  = (R_i - b*_g) / sigma_g   (sigma_g: the group's population reward std,
                                     skipped when <= 1e-8)

  The baseline of Huang et al. 2026, "Stable Asynchrony: Variance-Controlled
  Off-Policy RL for LLMs", https://arxiv.org/abs/2602.17616 (code
  https://github.com/mit-han-lab/vcpo: group scope, mean aggregation, IS
  weights on and untruncated, no length normalisation, divided by the group's
  reward std, as its recipes set them), computed by
  `rlx.objectives.vcpo_advantages`. W is formed in log space and scaled per
  group (which leaves b* unchanged), so the 1e-8 is relative: a group whose
  rows all became unlikely still gets its weighted mean, and w^2 ||g||^2 never
  overflows float32.

  What differs from the reference implementation: it takes each
  trajectory's gradient norm of its surrogate loss with unit advantage, at the
  parameters of each mini-batch; that equals `min(w_i, C) ||g_i||` (its loss's
  truncated sequence IS weight, C = 8 in its recipes, times the score norm)
  at the first mini-batch, so its W carries an extra `min(w_i, C)^2`. Here W
  is the paper's `w^2 ||grad log pi||^2`, with both factors taken once per
  iteration, at the learner's params before the update (`score_norms`,
  `current_logp`), for every mini-batch and epoch.

  Args:
    rewards: f32[B] per-row rewards, prompt-major (row i*K + j = sample j of prompt i).
    score_norms: f32[B] `||grad log pi_theta(tau_i)||` at the learner's current
      params (`rlx.train.ComputeLogprobs.score_norms`), >= 0.
    current_logp: f32[B, S] the learner's current per-token log-probs.
    rollout_logp: f32[B, S] the behaviour policy's (the sampler's) log-probs.
    loss_mask: [B, S] the trained tokens.
    group_size: K >= 1, samples per prompt; B must be a multiple of it.

  Returns:
    f32[B] advantages.
  """
  if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
    raise ValueError(f"`group_size` must be an int >= 1, got {group_size!r}.")
  rewards, score_norms = jnp.asarray(rewards), jnp.asarray(score_norms)
  b = rewards.shape[0] if rewards.ndim == 1 else -1
  if b < 0 or b % group_size or tuple(score_norms.shape) != (b,):
    raise ValueError(
      f"`rewards` and `score_norms` must be f32[B] with B a multiple of group_size={group_size}, "
      f"got {tuple(rewards.shape)} and {tuple(score_norms.shape)}."
    )
  for name, x in (("current_logp", current_logp), ("rollout_logp", rollout_logp),
                  ("loss_mask", loss_mask)):  # fmt: skip
    if jnp.ndim(x) != 2 or jnp.shape(x)[0] != b:
      raise ValueError(f"`{name}` must be [B, S] with B = {b} rows, got {jnp.shape(x)}.")
  if not isinstance(score_norms, jax.core.Tracer):
    norms = np.asarray(score_norms, np.float64)
    if not np.all(np.isfinite(norms) & (norms >= 0)):
      bad = np.flatnonzero(~(np.isfinite(norms) & (norms >= 0)))
      raise ValueError(
        f"`score_norms` must be finite and >= 0; rows {bad[:8].tolist()} are "
        f"{norms[bad[:8]].tolist()}."
      )
  weights = objectives.sequence_importance_weights(current_logp, rollout_logp, loss_mask)
  log_w = 2.0 * (jnp.log(weights) + jnp.log(score_norms.astype(jnp.float32)))
  log_w = log_w.reshape(-1, group_size)
  # Under jit a NaN norm is left out of its group's baseline (rlx.objectives.vcpo_baseline).
  top = jnp.max(jnp.where(jnp.isnan(log_w), -jnp.inf, log_w), axis=1, keepdims=True)
  top = jnp.where(jnp.isfinite(top), top, 0.0)  # a group without any weight: all W = 0
  scaled = jnp.exp(log_w - top)  # in [0, 1]; exp(-inf) = 0 for rows without a score gradient
  return objectives.vcpo_advantages(
    rewards.reshape(-1, group_size), jnp.sqrt(scaled), jnp.ones_like(scaled)
  ).reshape(-1)
