"""Importance ratios between the current and the old (anchor) policy, in log space.

Notation: lp = log pi_theta (current), olp = log pi_old, m = mask, and
delta_t = clamp(lp_t - olp_t, -20, 20) the clamped token log-ratio. Every
function sanitises masked positions with `where` before any arithmetic, so NaN
or inf in padding never reaches a value or a gradient. All results are float32.
"""

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Shaped

from rlx.objectives._checks import (
  LOG_RATIO_CLAMP,
  as_f32,
  as_mask,
  check_flag,
  check_token_arrays,
  clip,
  where_mask,
)


def masked_log_ratio(logp: jax.Array, old_logp: jax.Array, valid: jax.Array) -> jax.Array:
  """Clamped token log-ratio on validated float32 inputs; 0 where `valid` is False.

  Internal building block (no validation): `logp`, `old_logp` float32 `[B, T]`,
  `valid` bool `[B, T]`.
  """
  logp = where_mask(valid, logp)
  old_logp = where_mask(valid, old_logp)
  return clip(logp - old_logp, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def token_log_ratio(
  logp: Float[Array, "B T"],
  old_logp: Float[Array, "B T"],
  mask: Shaped[Array, "B T"],
) -> Float[Array, "B T"]:
  """Clamped token log-ratio `delta_t = clamp(lp_t - olp_t, -20, 20)`.

  The token importance ratio of PPO is `exp(delta_t)` (Schulman et al. 2017,
  https://arxiv.org/abs/1707.06347; clamp as in verl `compute_policy_loss_vanilla`).

  Args:
    logp: log-probs of the current policy, with shape `[B, T]`.
    old_logp: log-probs of the old policy, with shape `[B, T]`.
    mask: 1/True on the tokens that count, with shape `[B, T]`.

  Returns:
    `delta` float32 with shape `[B, T]`; 0 wherever `mask` is 0.
  """
  check_token_arrays(logp=logp, old_logp=old_logp, mask=mask)
  valid = as_mask(mask)
  return where_mask(valid, masked_log_ratio(as_f32(logp), as_f32(old_logp), valid))


def cumulative_log_ratio(
  logp: Float[Array, "B T"],
  old_logp: Float[Array, "B T"],
  mask: Shaped[Array, "B T"],
) -> Float[Array, "B T"]:
  """Cumulative (prefix-inclusive) log-ratio `S_t = sum_{j<=t} m_j * delta_j`.

  `exp(S_t)` is the cumulative token ratio `prod_{j<=t} r_j` of CTPO (Zhang et
  al. 2026, "Rethinking Importance Sampling in LLM Policy Optimization: A
  Cumulative Token Perspective", https://arxiv.org/abs/2605.07331; code
  https://github.com/horizon-llm/CTPO):
  the prefix correction times the token's own ratio. Masked positions
  contribute 0 to the sum, so tokens after a masked span (tool output,
  observations) keep accumulating from where the last valid token left off.

  Args:
    logp: log-probs of the current policy, with shape `[B, T]`.
    old_logp: log-probs of the old policy, with shape `[B, T]`.
    mask: 1/True on the tokens that count, with shape `[B, T]`.

  Returns:
    `S` float32 with shape `[B, T]`; 0 wherever `mask` is 0. Differentiable
    with respect to both log-prob arrays (losses detach it themselves).
  """
  check_token_arrays(logp=logp, old_logp=old_logp, mask=mask)
  valid = as_mask(mask)
  delta = masked_log_ratio(as_f32(logp), as_f32(old_logp), valid)
  return where_mask(valid, jnp.cumsum(delta, axis=1))


def sequence_log_ratio(
  logp: Float[Array, "B T"],
  old_logp: Float[Array, "B T"],
  mask: Shaped[Array, "B T"],
) -> Float[Array, " B"]:
  """Length-normalised sequence log-ratio `s_i = sum_t m_it (lp_it - olp_it) / max(n_i, 1)`.

  `exp(s_i)` is the GSPO sequence importance ratio, the geometric mean of the
  token ratios (Zheng et al. 2025, https://arxiv.org/abs/2507.18071; verl
  `compute_policy_loss_gspo`). As in the reference there is no per-token clamp
  before the mean; callers clamp the result before `exp`.

  Args:
    logp: log-probs of the current policy, with shape `[B, T]`.
    old_logp: log-probs of the old policy, with shape `[B, T]`.
    mask: 1/True on the tokens that count, with shape `[B, T]`.

  Returns:
    `s` float32 with shape `[B]`; 0 for sequences without valid tokens.
  """
  check_token_arrays(logp=logp, old_logp=old_logp, mask=mask)
  return masked_sequence_log_ratio(as_f32(logp), as_f32(old_logp), as_mask(mask))


def masked_sequence_log_ratio(logp: jax.Array, old_logp: jax.Array, valid: jax.Array) -> jax.Array:
  """`sequence_log_ratio` on validated float32 inputs (internal, no validation).

  `logp`, `old_logp` float32 `[B, T]`, `valid` bool `[B, T]`; returns `[B]`.
  """
  diff = where_mask(valid, logp) - where_mask(valid, old_logp)
  lengths = jnp.sum(valid, axis=1).astype(jnp.float32)
  return jnp.sum(diff, axis=1) / jnp.maximum(lengths, 1.0)


def min_prefix_log_ratio(
  logp: Float[Array, "B T"],
  old_logp: Float[Array, "B T"],
  mask: Shaped[Array, "B T"],
  *,
  inclusive: bool = False,
) -> Float[Array, "B T"]:
  """Log of the minimum token ratio over the valid prefix: `min_{j<t, m_j=1} delta_j`.

  MinPRO's non-cumulative surrogate for the prefix ratio `prod_{j<t} r_j`
  (Lei et al. 2026, "A Step Back: Prefix Importance Ratio Stabilizes Policy
  Optimization", https://arxiv.org/abs/2601.22718; no public code was found).
  Ratios are
  `exp(delta_j)` with the clamped token log-ratio `delta_j`.

  Args:
    logp: log-probs of the current policy, with shape `[B, T]`.
    old_logp: log-probs of the old policy, with shape `[B, T]`.
    mask: 1/True on the tokens that count, with shape `[B, T]`.
    inclusive: if False (default) the prefix is strict (`j < t`); if True it
      includes the token itself (`j <= t`).

  Returns:
    float32 with shape `[B, T]`: the minimum log-ratio over the prefix, 0
    (ratio 1) where the prefix has no valid token, and 0 wherever `mask` is 0.
  """
  check_token_arrays(logp=logp, old_logp=old_logp, mask=mask)
  check_flag(inclusive, "inclusive")
  valid = as_mask(mask)
  delta = masked_log_ratio(as_f32(logp), as_f32(old_logp), valid)
  return masked_min_prefix(delta, valid, inclusive=inclusive)


def masked_min_prefix(log_ratio: jax.Array, valid: jax.Array, *, inclusive: bool) -> jax.Array:
  """Running minimum of clamped `log_ratio` over the valid prefix (internal, no validation).

  `log_ratio` float32 `[B, T]` already clamped to +-20, `valid` bool `[B, T]`.
  Returns 0 where the prefix is empty and wherever `valid` is False.
  """
  # Masked positions are filled with the clamp bound, which never lowers a minimum.
  filled = jnp.where(valid, log_ratio, LOG_RATIO_CLAMP)
  running_min = jax.lax.cummin(filled, axis=1)
  count = jnp.cumsum(valid.astype(jnp.int32), axis=1)
  if not inclusive:
    pad = jnp.full_like(running_min[:, :1], LOG_RATIO_CLAMP)
    running_min = jnp.concatenate([pad, running_min[:, :-1]], axis=1)
    count = count - valid.astype(jnp.int32)
  return jnp.where(valid & (count > 0), running_min, 0.0)
