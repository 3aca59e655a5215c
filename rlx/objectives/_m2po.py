"""M2PO: a second-moment trust region that masks the most off-policy tokens."""

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from rlx.objectives import _checks

# Only guards against inf inputs (see m2po_mask); real log-ratios are far smaller.
_MAX_ABS_LOG_RATIO = 1e6


def m2po_mask(
  old_logp: Float[Array, "B T"],
  rollout_logp: Float[Array, "B T"],
  mask: Float[Array, "B T"],
  *,
  tau: float = 0.04,
) -> Float[Array, "B T"]:
  """M2PO token mask: drop the fewest tokens so the second moment of the log-ratio is <= tau.

  With x_t = (old_logp_t - rollout_logp_t)^2 (not clamped) over the n valid
  tokens of the whole batch, find the smallest k such that removing the k
  largest x_t leaves

    M2 = (sum_t x_t - sum of the k largest) / (n - k) <= tau

  (k = n, the empty set, always qualifies), and mask those k tokens out. Removing
  the current largest value never raises the mean, so the qualifying k form a
  suffix and the first one is the minimum. Ties among equal x_t are broken by
  flat index (earlier tokens are masked first), so exactly k tokens are dropped.
  Implemented with one sort and a cumulative sum, so it jits with static shapes.
  The result carries no gradient.

  Reference: Zheng et al. 2025, "Prosperity before Collapse: How Far Can
  Off-Policy RL Reach with Stale Data on LLMs?" (M2PO),
  https://github.com/Infini-AI-Lab/M2PO.

  Args:
    old_logp: trainer log-probs `[B, T]`.
    rollout_logp: behaviour (sampler or stale-policy) log-probs `[B, T]`.
    mask: response mask `[B, T]`.
    tau: second-moment bound >= 0 (paper: 0.04).

  Returns:
    The new mask `[B, T]` in the dtype of `mask`: `mask` with the selected tokens
    set to 0.
  """
  _checks.check_token_arrays(old_logp=old_logp, rollout_logp=rollout_logp, mask=mask)
  mask = jnp.asarray(mask)
  _checks.check_finite(tau, "tau")
  _checks.check_non_negative(tau, "tau")

  valid = _checks.as_mask(mask)
  old = jax.lax.stop_gradient(_checks.where_mask(valid, _checks.as_f32(old_logp)))
  rollout = jax.lax.stop_gradient(_checks.where_mask(valid, _checks.as_f32(rollout_logp)))
  # No exp here, so no +-20 clamp: an outlier's full (log ratio)^2 counts. The
  # bound 1e6 only keeps inf inputs from making the sums inf - inf = NaN.
  second = jnp.square(jnp.clip(old - rollout, -_MAX_ABS_LOG_RATIO, _MAX_ABS_LOG_RATIO))

  flat_valid = valid.reshape(-1)
  # Invalid entries sort after every valid one (valid values are >= 0).
  flat = jnp.where(flat_valid, second.reshape(-1), -1.0)
  size = flat.shape[0]
  order = jnp.argsort(-flat, stable=True)  # descending, ties by index
  sorted_values = jnp.where(flat[order] >= 0, flat[order], 0.0)
  n = jnp.sum(flat_valid.astype(jnp.int32))
  # kept[k] = sum of all but the k largest, summed from the small end (no
  # cancellation against a large outlier).
  kept = jnp.concatenate([jnp.cumsum(sorted_values[::-1])[::-1], jnp.zeros((1,), jnp.float32)])
  k = jnp.arange(size + 1)
  remaining = jnp.maximum(n - k, 1).astype(jnp.float32)
  fits = (kept / remaining <= jnp.float32(tau)) | (k >= n)
  num_drop = jnp.argmax(fits)  # first k that satisfies the bound

  rank = jnp.zeros((size,), jnp.int32).at[order].set(jnp.arange(size, dtype=jnp.int32))
  drop = (rank < num_drop).reshape(valid.shape) & valid
  return jnp.where(drop, jnp.zeros_like(mask), mask)
