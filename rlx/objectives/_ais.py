"""Adaptive importance sampling (AIS): how far to trust the rollout-correction weights."""

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Shaped

from rlx.objectives import _checks
from rlx.objectives._ess import effective_sample_size


def adaptive_is_lambda(
  raw_weights: Float[Array, "..."],
  weights: Float[Array, "..."],
  valid: Shaped[Array, "..."],
  *,
  mismatch_kl: Float[Array, ""] | float,
  kl_scale: float | Float[Array, ""] = 1e-3,
) -> Float[Array, ""]:
  """Mixing coefficient `lambda` in [0, 1] of `w <- 1 + lambda (w - 1)`.

    lambda      = clip(severity * reliability * stability, 0, 1)
    severity    = 1 - exp(-KL / kl_scale)      the mismatch is large enough to matter;
                                               0 for identical policies
    reliability = ESS(raw_weights)             normalised ESS of the untruncated
                                               weights; -> 1/n when one dominates
    stability   = ESS(weights) = 1 / (1 + CV^2(weights))
                                               variance amplification of the
                                               (truncated) weights

  over the `valid` units (tokens or sequences), with `KL` the mismatch (e.g.
  `rollout_mismatch_kl(...).k3` over the kept tokens). `lambda` interpolates
  the uncorrected gradient (0: biased, no extra variance) and the fully
  importance-weighted one (1): degenerate weights drive it to the safe side, a
  large mismatch with well-behaved weights towards 1. It is one
  stop-gradient scalar for the batch. This rule is rlx's own (no published
  reference); its parts are the normalised ESS of Kong 1992 (see
  `effective_sample_size`) and the exponential KL severity.

  Args:
    raw_weights: untruncated importance weights (`[B]` or `[B, T]`).
    weights: the weights to be mixed (e.g. truncated), shape of `raw_weights`.
    valid: bool or 0/1 units that count, shape of `raw_weights`.
    mismatch_kl: KL estimate >= 0 (float32 scalar).
    kl_scale: `> 0`, the KL at which severity is `1 - 1/e`.

  Returns:
    float32 scalar in [0, 1]; never differentiated.
  """
  for name, x in (("raw_weights", raw_weights), ("weights", weights), ("valid", valid)):
    _checks.check_real_array(x, name)
  _checks.check_same_shape("raw_weights", raw_weights, {"weights": weights, "valid": valid})
  _checks.check_mask_values(valid, "valid")
  _checks.check_rank(mismatch_kl, 0, "mismatch_kl")
  _checks.check_non_negative(mismatch_kl, "mismatch_kl")
  _checks.check_positive(kl_scale, "kl_scale")
  kl = jax.lax.stop_gradient(_checks.as_f32(mismatch_kl))
  severity = 1.0 - jnp.exp(-kl / jnp.asarray(kl_scale, jnp.float32))
  reliability = effective_sample_size(raw_weights, valid)
  stability = effective_sample_size(weights, valid)
  return jnp.clip(severity * reliability * stability, 0.0, 1.0)
