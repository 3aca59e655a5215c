"""Merging the step's metrics: micro-batches into an update, updates into a step.

Loss terms of a micro-batch already carry the mini-batch denominator, so they
are summed; per-token means are re-weighted by each micro-batch's valid-token
count; maxima (`MAX_METRICS`) are maxima. Across the optimizer updates of a
step every metric is the mean over updates, except maxima and the counts
named in `SUM_METRICS`.
"""

import jax
import jax.numpy as jnp

# Combined by max, not mean (across micro-batches and updates).
MAX_METRICS = ("ratio_max",)
# Summed across the updates of a step.
SUM_METRICS = ("skipped",)
_LOSS_TERMS = ("loss", "policy_loss", "kl_loss", "entropy_loss")


def merge_micro_metrics(aux: dict) -> dict:
  """Per-micro-batch `aux` of `make_loss_fn` (stacked on axis 0) -> one update's metrics."""
  n = aux["n_tokens"]
  safe_total = jnp.maximum(jnp.sum(n), 1.0)
  out = {name: jnp.sum(aux[name]) for name in _LOSS_TERMS}
  out["entropy"] = jnp.sum(aux["entropy"]) / safe_total
  for name, value in aux["policy_metrics"].items():
    value = jnp.asarray(value, jnp.float32)
    out[name] = jnp.max(value) if name in MAX_METRICS else jnp.sum(value * n) / safe_total
  return out


def merge_update_metrics(per_update: dict) -> dict:
  """Metrics stacked over a step's updates (any leading dims) -> one f32 scalar each."""

  def merge(name: str, value: jax.Array) -> jax.Array:
    if name in MAX_METRICS:
      return jnp.max(value)
    if name in SUM_METRICS:
      return jnp.sum(value)
    return jnp.mean(value)

  return {name: merge(name, value).astype(jnp.float32) for name, value in per_update.items()}
