"""Normalised effective sample size of importance weights."""

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Shaped

from rlx.objectives import _checks


def effective_sample_size(
  weights: Float[Array, "..."],
  valid: Shaped[Array, "..."] | None = None,
) -> Float[Array, ""]:
  """Normalised effective sample size `(sum_i w_i)^2 / (n * sum_i w_i^2)` in `[1/n, 1]`.

  Over the `n` entries where `valid` is True (all entries when `valid` is
  None). It is 1 when every weight is equal and `1/n` when one entry carries
  all the weight (Kong 1992; Owen, "Monte Carlo theory, methods and examples",
  ch. 9, https://artowen.su.domains/mc/Ch-var-is.pdf). Equivalently
  `1 / (1 + CV^2(w))` with the population coefficient of variation over the
  valid entries. With no valid entry, or all valid weights 0, it is undefined
  and returned as 1.

  ESS is scale invariant, so the weights are divided by their largest absolute
  value first: weights up to e^20 never overflow when squared. Invalid entries
  are replaced before any arithmetic (NaN/inf there are harmless); nothing is
  differentiated (the inputs are detached).

  Args:
    weights: importance weights, any shape (e.g. `[B]` sequence weights or
      `[B, T]` token weights), any float dtype; finite and >= 0 where valid
      (checked when concrete).
    valid: optional bool or 0/1 array with the shape of `weights`.

  Returns:
    float32 scalar.
  """
  _checks.check_real_array(weights, "weights")
  weights = jnp.asarray(weights)
  _checks.check_not_empty(weights, "weights")
  valid = _checks.checked_weight_mask(weights, valid, "weights")
  w = jax.lax.stop_gradient(jnp.where(valid, _checks.as_f32(weights), 0.0))
  w = w / jnp.maximum(jnp.max(jnp.abs(w), initial=0.0), jnp.float32(1e-30))
  n = jnp.sum(valid.astype(jnp.float32))
  return _checks.safe_div(jnp.square(jnp.sum(w)), n * jnp.sum(jnp.square(w)), 1.0)
