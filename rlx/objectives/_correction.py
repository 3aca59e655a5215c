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
import numpy as np
from jaxtyping import Array, Float

from rlx.objectives import _checks
from rlx.objectives._ais import adaptive_is_lambda
from rlx.objectives._ess import effective_sample_size
from rlx.objectives._is_weights import (
  renormalize_weights,
  sequence_importance_weights,
  token_importance_weights,
)
from rlx.objectives._mismatch import rollout_mismatch_kl
from rlx.objectives._rejection import (
  REJECTION_LEVELS,
  REJECTION_STATISTICS,
  rollout_rejection_mask,
)
from rlx.objectives._veto import rollout_veto_mask

CORRECTION_LEVELS = ("token", "sequence")


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
  sampled_mask: Float[Array, "B T"] | None = None,
) -> tuple[Float[Array, "B T"], Float[Array, "B T"], RolloutCorrectionMetrics]:
  """Importance weights and rejection mask correcting the rollout/trainer mismatch.

  With log rho_t = clamp(old_logp_t - rollout_logp_t, -20, 20) (trainer over sampler)
  the steps are, in order, each a public function with its own formula:

  1. Veto (`veto_threshold` = tau, e.g. 1e-4; `rollout_veto_mask`): a sequence
     with any valid token whose rho_t < tau is removed from the mask.
  2. MIS rejection (`reject`; `rollout_rejection_mask` with `level=reject`,
     `statistic=reject_statistic`, `low=reject_low`, `high=reject_high`): tokens
     or whole sequences whose ratio / k1 / k2 / k3 statistic lies outside the
     closed band are masked out, not reweighted. Veto and rejection read the
     UNclamped log rho, so their thresholds act as stated beyond e^+-20.
  3. (T)IS weights at `level`, C = `truncate` (upper truncation; None = none):
       "token":    w_t = min(rho_t, C)                 (`token_importance_weights`)
       "sequence": w_i = min(prod_t rho_it, C) on every token of sequence i
                   (`sequence_importance_weights` over `sampled_mask`, default
                   the input mask: the sequence was sampled with its rejected
                   tokens, and with tokens an earlier filter such as
                   `m2po_mask` removed from `mask`)
       None:       w = 1 (rejection only).
  4. AIS mixing (`adaptive=True`; `adaptive_is_lambda`): w <- 1 + lambda (w - 1)
     with lambda in [0, 1] from the k3 mismatch over the kept tokens, the ESS of
     the raw weights and the ESS of the truncated ones, over the kept units.
     Identical policies give lambda = 0; degenerate weights drive it towards 0
     (uncorrected, the safe side); a large mismatch with well-behaved weights
     towards 1. lambda is one stop-gradient scalar for the batch.
  5. Renormalisation (`renormalize=True`; `renormalize_weights`): divide by the
     mean weight over the kept units (tokens or sequences), after truncation,
     so weights may exceed C afterwards.

  Units: kept tokens for level "token", sequences with a kept token for
  "sequence"; `effective_sample_size` gives `ess` / `ess_raw` over them.
  Returned weights are 0 wherever the returned mask is 0. Masked positions of
  the inputs are replaced before any arithmetic, so NaN/inf padding is
  harmless. Deviation from verl: per-token log-ratios are clamped to +-20
  before the sequence sum as well as after it (only matters for a token with
  rho > e^20).

  Reference: verl `trainer/ppo/rollout_corr_helper.py` (TIS, MIS/rejection,
  veto); Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You
  Off-Policy RL Training" (TIS, https://fengyao.notion.site/off-policy-rl);
  the AIS rule is rlx's own (see `adaptive_is_lambda`).

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
    sampled_mask: optional `[B, T]` mask of the tokens the sampler produced,
      a superset of `mask` (e.g. the response mask before `m2po_mask`); the
      sequence-level weights are the ratio of the sampled sequence, so they
      sum over it. None: `mask`. Only read for `level="sequence"`.

  Returns:
    `(is_weights, new_mask, metrics)`: float32 weights `[B, T]` (never
    differentiated), the updated mask `[B, T]` in the dtype of `mask`, and a
    `RolloutCorrectionMetrics`.
  """
  _checks.check_token_arrays(old_logp=old_logp, rollout_logp=rollout_logp, mask=mask)
  mask = jnp.asarray(mask)
  if level is not None:
    _checks.check_choice(level, CORRECTION_LEVELS, "level")
  if reject is not None:
    _checks.check_choice(reject, REJECTION_LEVELS, "reject")
  _checks.check_choice(reject_statistic, REJECTION_STATISTICS, "reject_statistic")
  _checks.check_positive(truncate, "truncate", optional=True)
  _checks.check_positive(ais_kl_scale, "ais_kl_scale")
  _checks.check_positive(veto_threshold, "veto_threshold", optional=True)
  _checks.check_scalar(reject_low, "reject_low", optional=True)
  _checks.check_scalar(reject_high, "reject_high", optional=True)
  _checks.check_flag(renormalize, "renormalize")
  _checks.check_flag(adaptive, "adaptive")
  if reject is None and (reject_low is not None or reject_high is not None):
    raise ValueError("`reject_low`/`reject_high` were given but `reject` is None; set `reject`.")
  if reject is not None:
    if reject_low is None and reject_high is None:
      raise ValueError(f"`reject`={reject!r} needs `reject_low` and/or `reject_high`.")
    _checks.check_interval(reject_low, reject_high, "reject_low", "reject_high")
    if reject_statistic == "ratio":
      _checks.check_non_negative(reject_low, "reject_low", optional=True)
  if adaptive and level is None:
    raise ValueError("`adaptive`=True needs `level` 'token' or 'sequence', got None.")
  if sampled_mask is not None:
    _checks.check_real_array(sampled_mask, "sampled_mask")
    sampled_mask = jnp.asarray(sampled_mask)
    _checks.check_same_shape("mask", mask, {"sampled_mask": sampled_mask})
    _checks.check_mask_values(sampled_mask, "sampled_mask")
    sampled = _checks.as_mask(sampled_mask)
    if _checks.is_concrete(mask) and _checks.is_concrete(sampled_mask):
      outside = np.argwhere(np.asarray(_checks.as_mask(mask) & ~sampled))
      if outside.size:
        raise ValueError(
          f"`sampled_mask` must cover `mask`: token {tuple(int(i) for i in outside[0])} "
          "is in `mask` but not in `sampled_mask`."
        )
  else:
    sampled = None

  valid = _checks.as_mask(mask)
  n_valid = jnp.sum(valid.astype(jnp.float32))
  mismatch = rollout_mismatch_kl(old_logp, rollout_logp, valid)

  # 1. veto, 2. rejection: both only remove tokens from the mask.
  keep = valid
  if veto_threshold is not None:
    keep = rollout_veto_mask(old_logp, rollout_logp, valid, threshold=veto_threshold)
  vetoed = valid & ~keep
  if reject is not None:
    keep = keep & rollout_rejection_mask(
      old_logp,
      rollout_logp,
      valid,
      level=reject,
      statistic=reject_statistic,
      low=reject_low,
      high=reject_high,
    )
  n_keep = jnp.sum(keep.astype(jnp.float32))

  # 3. (T)IS weights over `units` (kept tokens, or sequences with a kept token).
  if level is None:
    weights = jnp.ones(valid.shape, jnp.float32)
    truncated = jnp.zeros_like(valid)
    ess = ess_raw = jnp.float32(1.0)
    ais_lambda = jnp.float32(0.0)
  else:
    if level == "token":
      raw = token_importance_weights(old_logp, rollout_logp, valid)
      units = keep
    else:
      # Over the sampled tokens: the sequence was sampled with its rejected ones.
      seq_mask = valid if sampled is None else sampled
      raw = sequence_importance_weights(old_logp, rollout_logp, seq_mask)  # [B]
      units = jnp.any(keep, axis=1)
    weights = raw if truncate is None else jnp.minimum(raw, jnp.float32(truncate))
    ess_raw = effective_sample_size(raw, units)
    # 4. AIS mixing.
    if adaptive:
      kl_kept = rollout_mismatch_kl(old_logp, rollout_logp, keep).k3
      ais_lambda = adaptive_is_lambda(
        raw, weights, units, mismatch_kl=kl_kept, kl_scale=ais_kl_scale
      )
      weights = 1.0 + ais_lambda * (weights - 1.0)
    else:
      ais_lambda = jnp.float32(1.0)
    # 5. renormalisation over the kept units.
    if renormalize:
      weights = renormalize_weights(weights, units)
    ess = effective_sample_size(jnp.where(units, weights, 0.0), units)
    if level == "sequence":
      weights = jnp.broadcast_to(weights[:, None], valid.shape)
      raw = jnp.broadcast_to(raw[:, None], valid.shape)
    truncated = keep & (raw > truncate) if truncate is not None else jnp.zeros_like(valid)

  weights = jnp.where(keep, weights, 0.0)
  safe_div = _checks.safe_div
  metrics = RolloutCorrectionMetrics(
    mismatch_k1=mismatch.k1,
    mismatch_k3=mismatch.k3,
    ess=ess,
    ess_raw=ess_raw,
    frac_truncated=safe_div(jnp.sum(truncated.astype(jnp.float32)), n_keep, 0.0),
    frac_rejected=safe_div(n_valid - n_keep, n_valid, 0.0),
    frac_vetoed=safe_div(jnp.sum(vetoed.astype(jnp.float32)), n_valid, 0.0),
    weight_mean=safe_div(jnp.sum(weights), n_keep, 0.0),
    weight_max=jnp.max(weights, initial=0.0),
    ais_lambda=jnp.asarray(ais_lambda, jnp.float32),
  )
  return weights, keep.astype(mask.dtype), metrics
