"""Rollout-mismatch rejection (MIS): mask out tokens or sequences whose mismatch is out of band."""

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Shaped

from rlx.objectives import _checks, _kl

REJECTION_LEVELS = ("token", "seq-sum", "seq-mean", "seq-max")
REJECTION_STATISTICS = ("ratio", "k1", "k2", "k3")


def _token_statistic(log_rho: jax.Array, statistic: str) -> jax.Array:
  """Per-token statistic of the unclamped `log rho`; "ratio" stays in log space."""
  if statistic == "ratio":
    return log_rho
  # KL(pi_rollout || pi_old) estimators with Delta = rollout - old = -log rho.
  return {"k1": _kl.k1, "k2": _kl.k2, "k3": _kl.k3}[statistic](-log_rho)


def _bound(bound, statistic: str, default: float) -> jax.Array:
  if bound is None:
    return jnp.float32(default)
  bound = jnp.asarray(bound, jnp.float32)
  return jnp.log(bound) if statistic == "ratio" else bound


def rollout_rejection_mask(
  old_logp: Float[Array, "B T"],
  rollout_logp: Float[Array, "B T"],
  mask: Shaped[Array, "B T"],
  *,
  level: str,
  statistic: str = "ratio",
  low: float | Float[Array, ""] | None = None,
  high: float | Float[Array, ""] | None = None,
) -> Bool[Array, "B T"]:
  """Keep-mask of masked importance sampling: reject what lies outside `[low, high]`.

  With the unclamped `log rho_t = old_logp_t - rollout_logp_t`, a per-token
  statistic (`statistic`):

    "ratio": rho_t;   "k1": -log rho_t = log(pi_rollout / pi_old);
    "k2": (log rho_t)^2 / 2;   "k3": rho_t - 1 - log rho_t  (exp of min(log rho, 20))

  is aggregated over each sequence's valid tokens by `level`:

    "token": each token on its own;  "seq-sum": sum;  "seq-mean": mean;
    "seq-max": max.

  For "ratio" the aggregation is in log space, so "seq-sum" is the sequence
  ratio `prod_t rho_t`, "seq-mean" its geometric mean and "seq-max" `max_t rho_t`.
  Tokens ("token") or whole sequences whose value is outside the closed band
  `[low, high]` are masked out, not reweighted. Direction: "ratio" bounds
  pi_old / pi_rollout, "k1" the reverse log-ratio (negative where the trainer
  gives the token more probability than the sampler). The k1/k2/k3 statistics
  are `rlx.objectives.kl_penalty`'s estimators (unclamped). Reference: verl
  `trainer/ppo/rollout_corr_helper.py` (rejection sampling / MIS); Yingru Li et
  al., https://richardli.xyz/rl-collapse.

  Args:
    old_logp: trainer log-probs of the sampled tokens, with shape `[B, T]`.
    rollout_logp: sampler log-probs of the same tokens, with shape `[B, T]`.
    mask: 1/True on the tokens that count, with shape `[B, T]`.
    level: one of `("token", "seq-sum", "seq-mean", "seq-max")`.
    statistic: one of `("ratio", "k1", "k2", "k3")`.
    low: lower edge of the kept band (None: unbounded; >= 0 for "ratio").
    high: upper edge of the kept band (None: unbounded); at least one of
      `low`, `high` is required and `low <= high`.

  Returns:
    bool `[B, T]`, a subset of `mask`. Masked positions never matter.
  """
  _checks.check_token_arrays(old_logp=old_logp, rollout_logp=rollout_logp, mask=mask)
  mask = jnp.asarray(mask)
  _checks.check_choice(level, REJECTION_LEVELS, "level")
  _checks.check_choice(statistic, REJECTION_STATISTICS, "statistic")
  if low is None and high is None:
    raise ValueError(f"rejection at level {level!r} needs `low` and/or `high`, got neither.")
  _checks.check_scalar(low, "low", optional=True)
  _checks.check_scalar(high, "high", optional=True)
  _checks.check_interval(low, high, "low", "high")
  if statistic == "ratio":
    _checks.check_non_negative(low, "low", optional=True)
  valid = _checks.as_mask(mask)
  log_rho = jax.lax.stop_gradient(
    _checks.where_mask(valid, _checks.as_f32(old_logp))
    - _checks.where_mask(valid, _checks.as_f32(rollout_logp))
  )
  stat = _token_statistic(log_rho, statistic)
  if level == "token":
    value = stat
  elif level == "seq-max":
    value = jnp.max(jnp.where(valid, stat, -jnp.inf), axis=1, keepdims=True)
  else:
    value = jnp.sum(jnp.where(valid, stat, 0.0), axis=1, keepdims=True)
    if level == "seq-mean":
      value = value / jnp.maximum(jnp.sum(valid, axis=1, keepdims=True), 1)
  inside = (value >= _bound(low, statistic, -jnp.inf)) & (value <= _bound(high, statistic, jnp.inf))
  return valid & inside
