"""Rollout-training mismatch correction: TIS weights, MIS rejection, veto and AIS mixing.

The sampler's log-probs (`rollout_logp`, FP8, possibly stale) differ from the
trainer's recomputed `old_logp`. Per token, rho = pi_old / pi_rollout and

  log rho_t = clamp(old_logp_t - rollout_logp_t, -20, 20).

Everything here is computed from stop-gradient inputs: the returned weights and
mask carry no gradient. Reference: verl `trainer/ppo/rollout_corr_helper.py`
and its documentation "Rollout Correction" (Yingru Li et al., "When Speed Kills
Stability: Demystifying RL Collapse from the Training-Inference Mismatch",
https://richardli.xyz/rl-collapse).
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from rlx.objectives import _checks

CORRECTION_LEVELS = ("token", "sequence")
REJECTION_LEVELS = ("token", "seq-sum", "seq-mean", "seq-max")
REJECTION_STATISTICS = ("ratio", "k1", "k2", "k3")


class RolloutCorrectionMetrics(NamedTuple):
  """Per-batch mismatch diagnostics, all float32 scalars.

  Attributes:
    mismatch_k1: mean over the input's valid tokens of rollout_logp - old_logp
      (= -log rho), the k1 estimate of KL(pi_rollout || pi_old).
    mismatch_k3: mean over the input's valid tokens of rho - 1 - log rho, the
      (non-negative, low-variance) k3 estimate of the same KL.
    ess: normalised effective sample size (sum w)^2 / (n * sum w^2) of the
      returned weights over the kept units (tokens for level "token",
      sequences for level "sequence"); 1 when every weight is equal or no unit
      is kept.
    ess_raw: the same for the untruncated weights exp(log rho) (or the clamped
      sequence ratio), before truncation, mixing and renormalisation.
    frac_truncated: fraction of kept tokens whose raw weight exceeded `truncate`.
    frac_rejected: fraction of the input's valid tokens removed from the mask
      (rejection and veto together).
    frac_vetoed: fraction of the input's valid tokens removed by the veto alone.
    weight_mean: mean of the returned weights over kept tokens (0 if none).
    weight_max: max of the returned weights over kept tokens (0 if none).
    ais_lambda: the mixing coefficient lambda applied: the AIS value when
      `adaptive=True`, 1 for plain (T)IS weights, 0 when `level=None`.
  """

  mismatch_k1: jax.Array
  mismatch_k3: jax.Array
  ess: jax.Array
  ess_raw: jax.Array
  frac_truncated: jax.Array
  frac_rejected: jax.Array
  frac_vetoed: jax.Array
  weight_mean: jax.Array
  weight_max: jax.Array
  ais_lambda: jax.Array


def _safe_div(num: jax.Array, den: jax.Array, empty: float) -> jax.Array:
  """num / den, or `empty` where den == 0 (NaN-safe)."""
  ok = den > 0
  return jnp.where(ok, num / jnp.where(ok, den, 1.0), jnp.float32(empty))


def _normalized_ess(weights: jax.Array, valid: jax.Array) -> jax.Array:
  """(sum w)^2 / (n sum w^2) over `valid` entries; 1 if there are none.

  The weights are divided by their maximum first (ESS is scale invariant), so
  weights up to e^20 never overflow when squared.
  """
  w = jnp.where(valid, weights, 0.0)
  w = w / jnp.maximum(jnp.max(w), jnp.float32(1e-30))
  n = jnp.sum(valid.astype(jnp.float32))
  total = jnp.sum(w)
  return _safe_div(jnp.square(total), n * jnp.sum(jnp.square(w)), empty=1.0)


def _token_statistic(log_rho: jax.Array, statistic: str) -> jax.Array:
  if statistic == "ratio":
    return log_rho  # compared in log space against log(lo), log(hi)
  if statistic == "k1":
    return -log_rho
  if statistic == "k2":
    return 0.5 * jnp.square(log_rho)
  return jnp.exp(log_rho) - 1.0 - log_rho  # k3


def _log_bound(bound: float | None, statistic: str, default: float) -> jax.Array:
  if bound is None:
    return jnp.float32(default)
  bound = jnp.asarray(bound, jnp.float32)
  return jnp.log(bound) if statistic == "ratio" else bound


def rollout_correction(
  old_logp: Float[Array, "B T"],
  rollout_logp: Float[Array, "B T"],
  mask: Float[Array, "B T"],
  *,
  level: str | None = "token",
  truncate: float | None = 2.0,
  renormalize: bool = False,
  adaptive: bool = False,
  ais_kl_scale: float = 1e-3,
  reject: str | None = None,
  reject_statistic: str = "ratio",
  reject_low: float | None = None,
  reject_high: float | None = None,
  veto_threshold: float | None = None,
) -> tuple[Float[Array, "B T"], Float[Array, "B T"], RolloutCorrectionMetrics]:
  """Importance weights and rejection mask correcting the rollout/trainer mismatch.

  With log rho_t = clamp(old_logp_t - rollout_logp_t, -20, 20) (trainer over sampler)
  the steps are, in order:

  1. Veto (optional, `veto_threshold` = tau, e.g. 1e-4): a sequence with any valid
     token whose rho_t < tau is removed from the mask.
  2. MIS rejection (optional, `reject`): a statistic is computed per token,
       "ratio": rho_t;  "k1": -log rho_t = log(pi_rollout / pi_old);
       "k2": (log rho_t)^2 / 2;  "k3": rho_t - 1 - log rho_t,
     and aggregated per `reject` level over the sequence's valid tokens:
       "token": each token on its own;  "seq-sum": sum over tokens;
       "seq-mean": mean over tokens;  "seq-max": max over tokens.
     For "ratio" the aggregation happens in log space, so "seq-sum" is the sequence
     ratio prod_t rho_t, "seq-mean" its geometric mean and "seq-max" max_t rho_t.
     Tokens (level "token") or whole sequences whose value lies outside the closed
     band [reject_low, reject_high] are masked out, not reweighted. Direction:
     rho and "ratio" bounds are pi_old / pi_rollout; "k1" bounds
     log(pi_rollout / pi_old), i.e. the reverse direction, and is negative where
     the trainer assigns the token more probability than the sampler did.
  3. (T)IS weights at `level`:
       "token":    w_t = min(rho_t, C)
       "sequence": w_i = min(exp(clamp(sum_t m_t log rho_t, -20, 20)), C) for every
                   token of sequence i (over the input mask, rejected tokens included:
                   the sequence was sampled with them)
       None:       w = 1 (rejection only).
     C = `truncate` (upper truncation only; None = untruncated).
  4. AIS mixing (optional, `adaptive=True`): w <- 1 + lambda (w - 1), lambda in [0, 1]
     per batch, interpolating uncorrected (lambda = 0, w = 1, biased, no extra
     variance) and fully IS-weighted (lambda = 1) gradients:
       lambda = severity * reliability * stability
       severity    = 1 - exp(-KL3 / ais_kl_scale)       divergence: KL3 = mean k3
                     mismatch over kept tokens; 0 for identical policies
       reliability = ESS_raw                              normalised ESS of the raw
                     (untruncated) weights over kept units; -> 1/n when one weight
                     dominates
       stability   = 1 / (1 + CV^2(w))                   variance amplification of the
                     truncated weights, CV^2 = var(w) / mean(w)^2 over kept units
     So identical policies give lambda = 0 (and weights of exactly 1 either way);
     degenerate weights drive lambda towards 0, the safe, uncorrected side; a large
     mismatch with well-behaved weights drives it towards 1. lambda is a
     stop-gradient scalar over the whole batch (global under sharding).
  5. Renormalisation (optional, `renormalize=True`): divide by the mean weight over
     kept units (tokens for "token", sequences for "sequence") so it is 1. This
     happens after truncation, so weights may exceed C afterwards.

  Returned weights are 0 wherever the returned mask is 0. Masked positions of the
  inputs are replaced before any arithmetic, so NaN/inf padding is harmless.
  Deviation from verl: per-token log-ratios are clamped to +-20 before the
  sequence sum as well as after it (only matters for a token with rho > e^20).
  The veto and the rejection statistics use the unclamped log rho, so their
  thresholds act as stated even beyond e^+-20.

  Reference: verl `rollout_corr_helper.py` (TIS, MIS/rejection, veto); Yao et al.
  2025 "Your Efficient RL Framework Secretly Brings You Off-Policy RL Training"
  (TIS, https://fengyao.notion.site/off-policy-rl); the AIS formula is rlx's own.

  Args:
    old_logp: trainer log-probs of the sampled tokens, `[B, T]`.
    rollout_logp: sampler log-probs of the same tokens, `[B, T]`.
    mask: response mask `[B, T]` (bool or 0/1).
    level: "token" | "sequence" | None, the IS-weight level.
    truncate: upper truncation C > 0 of the weights, or None.
    renormalize: rescale the weights to mean 1 over the batch.
    adaptive: apply the AIS mixing coefficient (requires a `level`).
    ais_kl_scale: KL scale (> 0) of the AIS severity term.
    reject: None | "token" | "seq-sum" | "seq-mean" | "seq-max", the rejection level.
    reject_statistic: "ratio" | "k1" | "k2" | "k3".
    reject_low: lower edge of the kept band (None: unbounded); needs `reject`.
    reject_high: upper edge of the kept band (None: unbounded); needs `reject`.
    veto_threshold: tau > 0 for the veto, or None to disable it.

  Returns:
    `(is_weights, new_mask, metrics)`: float32 weights `[B, T]` (never
    differentiated), the updated mask `[B, T]` in the dtype of `mask`, and a
    `RolloutCorrectionMetrics`.
  """
  mask = jnp.asarray(mask)
  _checks.check_token_arrays(old_logp=old_logp, rollout_logp=rollout_logp, mask=mask)
  if level is not None:
    _checks.check_choice(level, CORRECTION_LEVELS, "level")
  if reject is not None:
    _checks.check_choice(reject, REJECTION_LEVELS, "reject")
  _checks.check_choice(reject_statistic, REJECTION_STATISTICS, "reject_statistic")
  _checks.check_positive(truncate, "truncate")
  _checks.check_positive(ais_kl_scale, "ais_kl_scale")
  _checks.check_positive(veto_threshold, "veto_threshold")
  if reject is None and (reject_low is not None or reject_high is not None):
    raise ValueError("`reject_low`/`reject_high` were given but `reject` is None; set `reject`.")
  if reject is not None:
    if reject_low is None and reject_high is None:
      raise ValueError(f"`reject`={reject!r} needs `reject_low` and/or `reject_high`.")
    _checks.check_interval(reject_low, reject_high, "reject_low", "reject_high")
    if reject_statistic == "ratio":
      _checks.check_non_negative(reject_low, "reject_low")
  if adaptive and level is None:
    raise ValueError("`adaptive`=True needs `level` 'token' or 'sequence', got None.")

  valid = _checks.as_mask(mask)
  old = jax.lax.stop_gradient(_checks.where_mask(valid, _checks.as_f32(old_logp)))
  rollout = jax.lax.stop_gradient(_checks.where_mask(valid, _checks.as_f32(rollout_logp)))
  clamp = _checks.LOG_RATIO_CLAMP
  # Veto and rejection compare the UNCLAMPED log-ratio (no exp of it is ever
  # summed), so bounds beyond e^+-20 (e.g. a veto threshold of 1e-12) still work.
  log_rho_raw = old - rollout  # 0 at invalid positions
  log_rho = jnp.clip(log_rho_raw, -clamp, clamp)
  rho = jnp.exp(log_rho)
  validf = valid.astype(jnp.float32)
  n_valid = jnp.sum(validf)

  mismatch_k1 = _safe_div(jnp.sum(jnp.where(valid, -log_rho, 0.0)), n_valid, 0.0)
  k3_token = jnp.where(valid, rho - 1.0 - log_rho, 0.0)
  mismatch_k3 = _safe_div(jnp.sum(k3_token), n_valid, 0.0)

  # 1. veto
  keep = valid
  if veto_threshold is not None:
    below = valid & (log_rho_raw < jnp.log(jnp.asarray(veto_threshold, jnp.float32)))
    keep = keep & ~jnp.any(below, axis=1, keepdims=True)
  vetoed = valid & ~keep

  # 2. rejection
  if reject is not None:
    stat = _token_statistic(log_rho_raw, reject_statistic)
    low = _log_bound(reject_low, reject_statistic, -jnp.inf)
    high = _log_bound(reject_high, reject_statistic, jnp.inf)
    if reject == "token":
      value = stat
    elif reject == "seq-sum":
      value = jnp.sum(jnp.where(valid, stat, 0.0), axis=1, keepdims=True)
    elif reject == "seq-mean":
      count = jnp.sum(validf, axis=1, keepdims=True)
      value = jnp.sum(jnp.where(valid, stat, 0.0), axis=1, keepdims=True) / jnp.maximum(count, 1)
    else:  # seq-max
      value = jnp.max(jnp.where(valid, stat, -jnp.inf), axis=1, keepdims=True)
    keep = keep & (value >= low) & (value <= high)

  keep_f = keep.astype(jnp.float32)
  n_keep = jnp.sum(keep_f)

  # 3. (T)IS weights; `units` marks the entries of `raw` that count in batch stats.
  if level is None:
    weights = jnp.ones_like(log_rho)
    truncated = jnp.zeros_like(valid)
    ess = ess_raw = jnp.float32(1.0)
    ais_lambda = jnp.float32(0.0)
  else:
    if level == "token":
      raw = rho
      units = keep
    else:
      log_seq = jnp.clip(jnp.sum(log_rho, axis=1), -clamp, clamp)  # invalid entries are 0
      raw = jnp.exp(log_seq)  # [B]
      units = jnp.any(keep, axis=1)
    weights = raw if truncate is None else jnp.minimum(raw, jnp.float32(truncate))
    ess_raw = _normalized_ess(raw, units)

    # 4. AIS mixing
    if adaptive:
      kl_kept = _safe_div(jnp.sum(jnp.where(keep, k3_token, 0.0)), n_keep, 0.0)
      severity = 1.0 - jnp.exp(-kl_kept / jnp.float32(ais_kl_scale))
      stability = _normalized_ess(weights, units)  # = 1 / (1 + CV^2)
      ais_lambda = jnp.clip(severity * ess_raw * stability, 0.0, 1.0)
      weights = 1.0 + ais_lambda * (weights - 1.0)
    else:
      ais_lambda = jnp.float32(1.0)

    # 5. renormalisation over kept units
    if renormalize:
      count = jnp.sum(units.astype(jnp.float32))
      mean = _safe_div(jnp.sum(jnp.where(units, weights, 0.0)), count, 1.0)
      weights = weights / jnp.where(mean > 0, mean, 1.0)

    unit_weights = jnp.where(units, weights, 0.0)
    ess = _normalized_ess(unit_weights, units)
    if level == "sequence":
      weights = jnp.broadcast_to(weights[:, None], log_rho.shape)
      raw = jnp.broadcast_to(raw[:, None], log_rho.shape)
    truncated = keep & (raw > truncate) if truncate is not None else jnp.zeros_like(valid)

  weights = jnp.where(keep, weights, 0.0)

  metrics = RolloutCorrectionMetrics(
    mismatch_k1=mismatch_k1,
    mismatch_k3=mismatch_k3,
    ess=ess,
    ess_raw=ess_raw,
    frac_truncated=_safe_div(jnp.sum(truncated.astype(jnp.float32)), n_keep, 0.0),
    frac_rejected=_safe_div(n_valid - n_keep, n_valid, 0.0),
    frac_vetoed=_safe_div(jnp.sum(vetoed.astype(jnp.float32)), n_valid, 0.0),
    weight_mean=_safe_div(jnp.sum(weights), n_keep, 0.0),
    weight_max=jnp.max(weights) if weights.size else jnp.float32(0.0),
    ais_lambda=jnp.asarray(ais_lambda, jnp.float32),
  )
  new_mask = keep.astype(mask.dtype)
  return weights, new_mask, metrics
