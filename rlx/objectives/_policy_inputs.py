"""Validation and sanitising of the data arrays every policy loss takes."""

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from rlx.objectives._aggregate import AGG_MODES
from rlx.objectives._checks import (
  as_f32,
  as_mask,
  check_agg_scale,
  check_choice,
  check_token_arrays,
  where_mask,
)


class PolicyInputs(NamedTuple):
  """Float32 `[B, T]` loss inputs, 0 at masked positions.

  Only `logp` carries gradient; `old_logp`, `advantages` and `is_weights` are
  detached, so a loss never differentiates through them.
  """

  logp: jax.Array
  old_logp: jax.Array
  advantages: jax.Array
  valid: jax.Array  # bool [B, T]
  is_weights: jax.Array | None


def prepare_policy_inputs(
  logp,
  old_logp,
  advantages,
  mask,
  *,
  is_weights=None,
  agg: str,
  agg_scale=None,
  **extra,
) -> PolicyInputs:
  """Checks shapes / `agg` / `agg_scale` and returns sanitised float32 inputs.

  `extra` names further optional `[B, T]` arrays (e.g. `entropy`) that must
  share the shape of `logp` when given. Masked positions are replaced by 0 with
  `where` BEFORE any arithmetic, so NaN/inf padding never reaches a value or a
  gradient.
  """
  check_token_arrays(
    logp=logp,
    old_logp=old_logp,
    advantages=advantages,
    mask=mask,
    is_weights=is_weights,
    **extra,
    optional=("is_weights", *extra),
  )
  check_choice(agg, AGG_MODES, "agg")
  check_agg_scale(agg_scale, "agg_scale")
  valid = as_mask(mask)
  sg = jax.lax.stop_gradient

  def clean(x):
    return where_mask(valid, as_f32(x))

  return PolicyInputs(
    logp=clean(logp),
    old_logp=sg(clean(old_logp)),
    advantages=sg(clean(advantages)),
    valid=valid,
    is_weights=None if is_weights is None else sg(clean(is_weights)),
  )


def token_clip_bound(value, valid: jax.Array):
  """A clip bound as the loss uses it: a scalar unchanged, a `[B, T]` array detached float32.

  Scalars are returned as given, so scalar-bound losses compute exactly what
  they always did; per-token arrays (already shape-checked) are cast to
  float32, stop-gradient, and set to 0 at masked positions, so NaN padding
  never reaches a value or a gradient.
  """
  if np.ndim(value) == 0:
    return value
  return jax.lax.stop_gradient(where_mask(valid, as_f32(value)))


def apply_is_weights(per_token: jax.Array, is_weights: jax.Array | None) -> jax.Array:
  """Multiplies the per-token loss by the (detached) correction weights, if any."""
  return per_token if is_weights is None else per_token * is_weights


def clipped_surrogate(
  ratio: jax.Array, clipped_ratio: jax.Array, advantages: jax.Array
) -> jax.Array:
  """PPO pessimistic surrogate `max(-A * r, -A * clip(r))` (per token).

  At a tie (ratio exactly on a bound) the unclipped term is taken, so its
  gradient flows (torch semantics; `jnp.maximum` would halve it).
  """
  unclipped = -advantages * ratio
  clipped = -advantages * clipped_ratio
  return jnp.where(unclipped >= clipped, unclipped, clipped)


def apply_dual_clip(per_token: jax.Array, advantages: jax.Array, bound: jax.Array) -> jax.Array:
  """Dual clip for A < 0: `min(L, -A * c)` (Ye et al. 2020, https://arxiv.org/abs/1912.09729).

  At a tie `L` is kept (its gradient flows), as for the clip bounds.
  """
  cap = -advantages * bound
  return jnp.where((advantages < 0) & (per_token > cap), cap, per_token)
