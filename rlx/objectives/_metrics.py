"""`PolicyLossMetrics`, the diagnostics every policy loss returns, and their computation."""

from typing import NamedTuple

import jax
import jax.numpy as jnp


class PolicyLossMetrics(NamedTuple):
  """Diagnostics of one policy-loss evaluation (all float32 scalars, no gradient).

  Fractions and means are over the valid tokens of the batch passed in.

  Attributes:
    clip_frac_low: fraction of tokens whose loss is clipped at the lower bound
      (A < 0 and ratio below the lower bound: no gradient), or, for losses that
      clip a detached weight (CISPO), whose weight is truncated from below.
    clip_frac_high: same for the upper bound (A > 0 and ratio above it).
    clip_frac_dual: fraction of tokens (A < 0) capped by the dual clip (ASPO:
      also A > 0 tokens whose flipped weight 1/r is capped).
    approx_kl: `mean(olp - lp)` (k1 estimate of KL(pi_old || pi_theta)) with the
      clamped token log-ratio.
    ratio_mean: mean of the ratio the loss clips (token ratio for PPO, the
      sequence ratio for GSPO, the cumulative ratio for CTPO, ...).
    ratio_max: maximum of that ratio over valid tokens (0 if there are none).
    is_weight_mean: mean of the rollout-correction weights (1.0 when none).
  """

  clip_frac_low: jax.Array
  clip_frac_high: jax.Array
  clip_frac_dual: jax.Array
  approx_kl: jax.Array
  ratio_mean: jax.Array
  ratio_max: jax.Array
  is_weight_mean: jax.Array


def _masked_mean(valid: jax.Array, x: jax.Array) -> jax.Array:
  count = jnp.sum(valid).astype(jnp.float32)
  return jnp.sum(jnp.where(valid, x, 0.0)) / jnp.maximum(count, 1.0)


def policy_loss_metrics(
  valid: jax.Array,
  *,
  log_ratio: jax.Array,
  ratio: jax.Array,
  clipped_low: jax.Array | None = None,
  clipped_high: jax.Array | None = None,
  clipped_dual: jax.Array | None = None,
  is_weights: jax.Array | None = None,
) -> PolicyLossMetrics:
  """Builds the `PolicyLossMetrics` a policy loss returns, from its per-token arrays.

  Every built-in loss and every loss registered with `register_policy_loss`
  returns its metrics through this: fractions and means over the `valid`
  tokens, all detached float32 scalars.

  Args:
    valid: the tokens that count, with shape `[B, T]` (bool, or 0/1 values).
    log_ratio: clamped token log-ratio `lp - olp`, float32 `[B, T]`.
    ratio: the ratio the loss clips, float32 `[B, T]`.
    clipped_low / clipped_high / clipped_dual: bool `[B, T]` (None: never).
    is_weights: rollout-correction weights `[B, T]` or None.

  Returns:
    `PolicyLossMetrics` of stop-gradient float32 scalars.
  """
  valid, log_ratio, ratio = jax.lax.stop_gradient((valid, log_ratio, ratio))
  if valid.dtype != jnp.bool_:
    valid = valid != 0
  if log_ratio.shape != valid.shape or ratio.shape != valid.shape:
    raise ValueError(
      f"`log_ratio` {log_ratio.shape} and `ratio` {ratio.shape} must have the shape of "
      f"`valid` {valid.shape}."
    )

  def frac(flags):
    if flags is None:
      return jnp.zeros((), jnp.float32)
    return _masked_mean(valid, flags.astype(jnp.float32))

  ratio = ratio.astype(jnp.float32)
  ratio_max = jnp.max(jnp.where(valid, ratio, -jnp.inf))
  ratio_max = jnp.where(jnp.any(valid), ratio_max, 0.0)
  if is_weights is None:
    is_weight_mean = jnp.ones((), jnp.float32)
  else:
    is_weight_mean = _masked_mean(valid, jax.lax.stop_gradient(is_weights))
  return PolicyLossMetrics(
    clip_frac_low=frac(clipped_low),
    clip_frac_high=frac(clipped_high),
    clip_frac_dual=frac(clipped_dual),
    approx_kl=_masked_mean(valid, -log_ratio),
    ratio_mean=_masked_mean(valid, ratio),
    ratio_max=ratio_max,
    is_weight_mean=is_weight_mean,
  )
