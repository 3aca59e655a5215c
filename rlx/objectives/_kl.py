"""Per-token KL-divergence estimators against a reference policy (verl `kl_penalty`)."""

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from rlx.objectives import _checks

KL_KINDS = ("k1", "abs", "k2", "k3", "low_var_kl", "k3+")

# verl clamps the k3 estimate to this range.
_K3_CLAMP = 10.0


# The three estimators of KL(p || q) from samples of p, as functions of the
# per-sample log-ratio Delta = log p - log q (Schulman 2020). Shared by
# `kl_penalty` and the rollout-mismatch statistics; no masking, no validation.


def k1(delta: jax.Array) -> jax.Array:
  """k1 = Delta (unbiased, high variance, can be negative)."""
  return delta


def k2(delta: jax.Array) -> jax.Array:
  """k2 = Delta^2 / 2 (biased, low variance, >= 0)."""
  return 0.5 * jnp.square(delta)


def k3(delta: jax.Array) -> jax.Array:
  """k3 = e^x - x - 1 with x = min(-Delta, 20) (unbiased, low variance, >= 0).

  Only the upper side is clamped (so `exp` stays finite and the value is at
  most e^20 - 21); for `x < -20` the value `-x - 1 + e^x` is exact, so large
  negative log-ratios are not under-reported. Not clamped to +-10 (see
  `kl_penalty`).
  """
  x = jnp.minimum(-delta, _checks.LOG_RATIO_CLAMP)
  return jnp.exp(x) - x - 1.0


def _k3_clamped(delta: jax.Array) -> jax.Array:
  """verl's k3: `k3(Delta)` clamped to +-10 (no gradient outside)."""
  return _checks.clip(k3(delta), -_K3_CLAMP, _K3_CLAMP)


def kl_penalty(
  logp: Float[Array, "B T"],
  ref_logp: Float[Array, "B T"],
  kind: str,
  *,
  mask: Float[Array, "B T"] | None = None,
) -> Float[Array, "B T"]:
  """Per-token estimate of KL(pi_theta || pi_ref) from samples of pi_theta.

  With Delta = logp - ref_logp (per token):
    "k1":                 Delta
    "abs":                |Delta|
    "k2":                 Delta^2 / 2
    "k3" / "low_var_kl":  clamp(e^x - x - 1, -10, 10) with x = min(-Delta, 20)
                          (verl's clamp; no gradient where it is active)
    "k3+":                the value of k3 with the gradient of k2 (straight-through:
                          k2 - sg(k2) + sg(k3))

  Gradients flow into `logp` (and `ref_logp`, should it be traced; callers
  normally pass a constant reference). The caller aggregates, e.g. with
  `aggregate(kl, mask, ...)`.

  References: J. Schulman, "Approximating KL Divergence" (2020),
  http://joschu.net/blog/kl-approx.html; verl `core_algos.kl_penalty`.

  Args:
    logp: log-probs of the sampled tokens under the current policy, `[B, T]`.
    ref_logp: log-probs of the same tokens under the reference policy, `[B, T]`.
    kind: one of "k1", "abs", "k2", "k3", "low_var_kl", "k3+".
    mask: optional `[B, T]` mask. When given, masked positions are replaced by 0
      before any arithmetic and the output is 0 there, so NaN/inf padding never
      reaches a value or a gradient. Without it every position is computed.

  Returns:
    float32 per-token KL estimates with shape `[B, T]`.
  """
  _checks.check_choice(kind, KL_KINDS, "kind")
  _checks.check_token_arrays(logp=logp, ref_logp=ref_logp, mask=mask, optional=("mask",))
  logp = _checks.as_f32(logp)
  ref_logp = _checks.as_f32(ref_logp)
  valid = None
  if mask is not None:
    valid = _checks.as_mask(mask)
    logp = _checks.where_mask(valid, logp)
    ref_logp = _checks.where_mask(valid, ref_logp)

  delta = logp - ref_logp
  if kind == "k1":
    kl = k1(delta)
  elif kind == "abs":
    kl = jnp.abs(delta)
  elif kind == "k2":
    kl = k2(delta)
  elif kind in ("k3", "low_var_kl"):
    kl = _k3_clamped(delta)
  else:  # "k3+"
    sq = k2(delta)
    kl = sq - jax.lax.stop_gradient(sq) + jax.lax.stop_gradient(_k3_clamped(delta))

  if valid is not None:
    kl = _checks.where_mask(valid, kl)
  return kl
