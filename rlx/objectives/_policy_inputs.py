"""Validation and sanitising of the data arrays every policy loss takes."""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from rlx.objectives._aggregate import AGG_MODES, aggregate
from rlx.objectives._checks import (
  as_f32,
  as_mask,
  check_agg_scale,
  check_choice,
  check_token_arrays,
  where_mask,
)
from rlx.objectives._metrics import PolicyLossMetrics, policy_loss_metrics


class PolicyInputs(NamedTuple):
  """Float32 `[B, T]` loss inputs, 0 at masked positions, and the checked aggregation.

  Only `logp` carries gradient; `old_logp`, `advantages` and `is_weights` are
  detached, so a loss never differentiates through them.
  """

  logp: jax.Array
  old_logp: jax.Array
  advantages: jax.Array
  valid: jax.Array  # bool [B, T]
  is_weights: jax.Array | None
  agg: str
  agg_scale: Any


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
    agg=agg,
    agg_scale=agg_scale,
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


def dual_clip_tokens(
  per_token: jax.Array, advantages: jax.Array, bound: jax.Array, over: jax.Array
) -> tuple[jax.Array, jax.Array]:
  """`apply_dual_clip` at `bound`, and the tokens it reports as capped: `A < 0` and `over`."""
  return apply_dual_clip(per_token, advantages, bound), (advantages < 0) & over


def policy_loss_result(
  x: PolicyInputs,
  per_token: jax.Array,
  log_ratio: jax.Array,
  ratio: jax.Array,
  *,
  clipped_low: jax.Array | None = None,
  clipped_high: jax.Array | None = None,
  clipped_dual: jax.Array | None = None,
) -> tuple[jax.Array, PolicyLossMetrics]:
  """A policy loss's `(loss, metrics)` from its per-token loss `L` on inputs `x`.

  `loss = aggregate(L * sg(is_weights), mask, x.agg, scale=x.agg_scale)`; the
  metrics are `policy_loss_metrics` over `x.valid` with `x.is_weights`, from
  `log_ratio` (the clamped token log-ratio), `ratio` (the ratio the loss clips;
  both float32 `[B, T]`) and the clip flags (bool `[B, T]`, None: never).
  """
  per_token = apply_is_weights(per_token, x.is_weights)
  loss = aggregate(per_token, x.valid, x.agg, scale=x.agg_scale)
  metrics = policy_loss_metrics(
    x.valid,
    log_ratio=log_ratio,
    ratio=ratio,
    clipped_low=clipped_low,
    clipped_high=clipped_high,
    clipped_dual=clipped_dual,
    is_weights=x.is_weights,
  )
  return loss, metrics


def clipped_loss_result(
  x: PolicyInputs,
  per_token: jax.Array,
  log_ratio: jax.Array,
  ratio: jax.Array,
  *,
  below: jax.Array,
  above: jax.Array,
  clipped_dual: jax.Array | None = None,
) -> tuple[jax.Array, PolicyLossMetrics]:
  """`policy_loss_result` of a clipped surrogate, whose clip fractions depend on the sign of A.

  `below` / `above` (bool `[B, T]`) mark the tokens outside the clip window; a
  token counts as clipped low where `A < 0` and below, clipped high where `A > 0`
  and above (there the clipped term wins and the token has no gradient).
  """
  low, high = (x.advantages < 0) & below, (x.advantages > 0) & above
  return policy_loss_result(
    x, per_token, log_ratio, ratio, clipped_low=low, clipped_high=high, clipped_dual=clipped_dual
  )
