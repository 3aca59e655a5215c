"""M2PO: a second-moment trust region, as a token mask or as batch-wide clip radii."""

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Shaped

from rlx.objectives import _checks
from rlx.objectives._metrics import PolicyLossMetrics
from rlx.objectives._policy_inputs import prepare_policy_inputs
from rlx.objectives._ppo import clipped_policy_loss

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


class M2poClipBounds(NamedTuple):
  """M2PO's batch-wide clip radii and their diagnostics (float32 scalars, no gradient).

  Attributes:
    clip_low: lower radius (the ratio is kept above `1 - clip_low`; 1 = no
      lower bound).
    clip_high: upper radius (kept below `1 + clip_high`; inf = no upper bound).
    m2: the second moment of the log-ratio over the harmful tokens.
    m2_after: the same with every |log-ratio| capped at the threshold tau.
  """

  clip_low: jax.Array
  clip_high: jax.Array
  m2: jax.Array
  m2_after: jax.Array


def m2po_clip_bounds(
  logp: Float[Array, "B T"],
  old_logp: Float[Array, "B T"],
  advantages: Float[Array, "B T"],
  mask: Shaped[Array, "B T"],
  *,
  m2_budget: float = 0.04,
  min_clip_low: float = 0.3,
  min_clip_high: float = 0.5,
) -> M2poClipBounds:
  """M2PO's trust region as its public code computes it: clip radii from a second-moment budget.

  With `d_t = sg(old_logp_t - logp_t)` (behaviour over current, so the ratio
  is `r_t = exp(-d_t)`), the harmful tokens are the valid ones that the
  update pushes further off-policy: `A_t > 0 and r_t > 1`, or `A_t < 0 and
  r_t < 1`. Over their n values `v = d^2`:
    - if `mean(v) <= m2_budget`, no clip (radii 1 and inf);
    - else the threshold is the largest sorted value `v_(j)` such that capping
      every v at it keeps `sum min(v, v_(j)) < m2_budget * n` (0 if none), tau
      = sqrt of it, and the radii are `max(1 - e^-tau, min_clip_low)` and
      `max(e^tau - 1, min_clip_high)`.
  Computed over the tokens passed in: the loss's global micro-batch (the
  mini-batch with `train.micro_batches = 1`); the reference computes it per
  GPU over each of its dynamic micro-batches. Reference: Zheng et al. 2025,
  "Prosperity before Collapse" (https://arxiv.org/abs/2510.01161), code
  https://github.com/Infini-AI-Lab/M2PO (read at commit af54a3e),
  `verl/trainer/ppo/core_algos.py` (`kpo_clip_harmful_tokens`,
  `compute_m2po_policy_loss`; its scripts set the budget 0.04). The floors'
  defaults 0.3 / 0.5 are that function's; its actor passes the config's
  `miniclip_low` / `miniclip_high`, which no released script sets, so the
  released runs clip without floors: `min_clip_low = min_clip_high = 0`
  reproduces them. With the floors the budget binds only once tau exceeds
  ln 1.5 (upper radius) or -ln 0.7 (lower). Small differences that remain:
  the reference takes the advantage's sign per sequence and tau^2 = v_(j) -
  1e-12. `m2po_mask` is the other form of the same trust region (mask the
  tokens instead).

  Args:
    logp: current-policy log-probs `[B, T]` (detached here).
    old_logp: behaviour log-probs `[B, T]`.
    advantages: per-token advantages `[B, T]`.
    mask: response mask `[B, T]`.
    m2_budget: the second-moment budget >= 0.
    min_clip_low: the lower radius's floor, in [0, 1].
    min_clip_high: the upper radius's floor, >= 0.

  Returns:
    `M2poClipBounds`.
  """
  _checks.check_token_arrays(logp=logp, old_logp=old_logp, advantages=advantages, mask=mask)
  for value, name in ((m2_budget, "m2_budget"), (min_clip_low, "min_clip_low")):
    _checks.check_finite(value, name)
    _checks.check_non_negative(value, name)
  _checks.check_range(min_clip_low, "min_clip_low", low=0.0, high=1.0)
  _checks.check_finite(min_clip_high, "min_clip_high")
  _checks.check_non_negative(min_clip_high, "min_clip_high")
  valid = _checks.as_mask(jnp.asarray(mask))
  d = jax.lax.stop_gradient(
    _checks.where_mask(valid, _checks.as_f32(old_logp) - _checks.as_f32(logp))
  )
  d = jnp.clip(d, -_MAX_ABS_LOG_RATIO, _MAX_ABS_LOG_RATIO)
  adv = jax.lax.stop_gradient(_checks.where_mask(valid, _checks.as_f32(advantages)))
  harmful = valid & (((adv > 0) & (d < 0)) | ((adv < 0) & (d > 0)))
  flat_h = harmful.reshape(-1)
  v = jnp.where(flat_h, jnp.square(d).reshape(-1), jnp.inf)
  ordered = jnp.sort(v)  # harmful values ascending, then inf
  n = jnp.sum(flat_h.astype(jnp.int32))
  nf = jnp.maximum(n, 1).astype(jnp.float32)
  finite = jnp.where(jnp.arange(ordered.shape[0]) < n, ordered, 0.0)
  csum = jnp.cumsum(finite)
  target = jnp.float32(m2_budget) * n.astype(jnp.float32)
  m2 = jnp.where(n > 0, csum[-1] / nf, 0.0)
  # Capping every value at ordered[j] gives csum[j] + ordered[j] * (n - j - 1).
  j = jnp.arange(ordered.shape[0])
  capped = csum + finite * (n - j - 1).astype(jnp.float32)
  reaches = (capped >= target) & (j < n)
  first = jnp.argmax(reaches)  # the first breakpoint whose capped sum reaches the budget
  tau_sq = jnp.where(first > 0, finite[jnp.maximum(first - 1, 0)], 0.0)
  need = (n > 0) & (m2 > jnp.float32(m2_budget))
  tau = jnp.sqrt(tau_sq)
  clip_low = jnp.where(need, jnp.maximum(1.0 - jnp.exp(-tau), min_clip_low), 1.0)
  clip_high = jnp.where(need, jnp.maximum(jnp.expm1(tau), min_clip_high), jnp.inf)
  m2_after = jnp.where(need, (csum[jnp.maximum(first - 1, 0)] + tau_sq * (n - first)) / nf, m2)
  m2_after = jnp.where(need & (first == 0), 0.0, m2_after)
  return M2poClipBounds(clip_low.astype(jnp.float32), clip_high.astype(jnp.float32), m2, m2_after)


def m2po_loss(
  logp: Float[Array, "B T"],
  old_logp: Float[Array, "B T"],
  advantages: Float[Array, "B T"],
  mask: Shaped[Array, "B T"],
  *,
  m2_budget: float = 0.04,
  min_clip_low: float = 0.3,
  min_clip_high: float = 0.5,
  is_weights: Float[Array, "B T"] | None = None,
  agg: str = "token-mean",
  agg_scale: Float[Array, ""] | float | None = None,
) -> tuple[Float[Array, ""], PolicyLossMetrics]:
  """M2PO's policy loss: PPO's clipped surrogate with the radii of `m2po_clip_bounds`.

    (eps_low, eps_high) = m2po_clip_bounds(logp, old_logp, advantages, mask)
    L_t  = max(-A r_t, -A clip(r_t, 1 - eps_low, 1 + eps_high))   (no dual clip)
    loss = aggregate(L * sg(is_weights), mask, agg)
  with `r = exp(clamp(lp - olp, -20, 20))` and `old_logp` the behaviour
  policy's log-probs (on stale data: `rl.old_logp = "behaviour"` or
  "sampler"). As the reference's `compute_m2po_policy_loss`
  (https://github.com/Infini-AI-Lab/M2PO); Zheng et al. 2025,
  https://arxiv.org/abs/2510.01161. The radii come from the batch passed in,
  so splitting it into micro-batches can change the loss.

  Args:
    logp: current-policy log-probs (differentiated), `[B, T]`.
    old_logp: behaviour log-probs (detached), `[B, T]`.
    advantages: per-token advantages (detached), `[B, T]`.
    mask: 1/True on the tokens that count, `[B, T]`.
    m2_budget / min_clip_low / min_clip_high: see `m2po_clip_bounds`.
    is_weights: rollout-correction weights (detached), `[B, T]`.
    agg: aggregation mode (see `aggregate`).
    agg_scale: optional denominator for `aggregate`.

  Returns:
    `(loss, metrics)` (clip fractions count the tokens outside the radii).
  """
  x = prepare_policy_inputs(
    logp, old_logp, advantages, mask, is_weights=is_weights, agg=agg, agg_scale=agg_scale
  )
  bounds = m2po_clip_bounds(
    x.logp,
    x.old_logp,
    x.advantages,
    x.valid,
    m2_budget=m2_budget,
    min_clip_low=min_clip_low,
    min_clip_high=min_clip_high,
  )
  return clipped_policy_loss(
    x, clip_low=bounds.clip_low, clip_high=bounds.clip_high, dual_clip=None
  )
