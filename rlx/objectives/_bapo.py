"""BAPO: adaptive clip bounds that balance positive and negative policy-gradient mass."""

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from rlx.objectives import _checks

# BAPO's dual-clip constant c for A < 0 (the reference's `clip_ratio_c`).
BAPO_DUAL_CLIP = 3.0


class BapoClipBounds(NamedTuple):
  """Adapted ratio bounds (float32 scalars, no gradient).

  Attributes:
    c_low: lower ratio bound (PPO's 1 - clip_low).
    c_high: upper ratio bound (PPO's 1 + clip_high).
    positive_share: P / (P + N) at the returned bounds (1 when P + N = 0).
    dual_clip: the dual-clip constant c the bounds were computed with (a
      float32 scalar), or None when disabled.
  """

  c_low: jax.Array
  c_high: jax.Array
  positive_share: jax.Array
  dual_clip: jax.Array | None = None

  def clip_kwargs(self) -> dict[str, jax.Array | None]:
    """The bounds as PPO-convention loss keywords (`PolicyLossSpec.clip_keywords`).

    `{"clip_low": 1 - c_low, "clip_high": c_high - 1, "dual_clip": dual_clip}`,
    so `ratio` is clipped to `[c_low, c_high]` and capped at `c` for A < 0.
    """
    return {
      "clip_low": 1.0 - self.c_low,
      "clip_high": self.c_high - 1.0,
      "dual_clip": self.dual_clip,
    }


def bapo_clip_bounds(
  logp: Float[Array, "B T"],
  old_logp: Float[Array, "B T"],
  advantages: Float[Array, "B T"],
  mask: Float[Array, "B T"],
  *,
  c_low: float = 0.6,
  c_high: float = 1.2,
  c_low_max: float = 0.9,
  c_high_max: float = 3.0,
  delta: float = 0.05,
  rho0: float = 0.5,
  dual_clip: float | None = BAPO_DUAL_CLIP,
) -> BapoClipBounds:
  """BAPO adaptive clip bounds [c_low, c_high] for one batch.

  With r = exp(clamp(logp - old_logp, -20, 20)) and only *gradient-carrying*
  tokens counted under PPO with clamp(r, c_low, c_high) and dual clip c:

    P = sum_{A > 0, r <= c_high}        r * A * m
    N = sum_{A < 0, c_low <= r <= c}    r * |A| * m

  While P / (P + N) < rho0: raise c_low by delta up to c_low_max; once c_low is at
  its max, raise c_high by delta up to c_high_max. The loop is a
  `lax.while_loop`, so the function jits and the bounds come back as traced
  scalars that PPO-style losses accept as clip hyper-parameters, e.g.
  `ppo_clip_loss(..., **b.clip_kwargs())`
  (`clip_low=1 - b.c_low, clip_high=b.c_high - 1, dual_clip=b.dual_clip`).

  Deliberate deviation from the reference implementation: the reference counts
  clipped tokens at their clipped value (min(r, c_high) for A > 0 and
  max(r, c_low) for A < 0), so raising c_low *increases* N. Here tokens that
  carry no gradient (A > 0 with r > c_high; A < 0 with r < c_low or r > c) are not
  counted, so raising c_low removes negative mass and raising c_high adds
  positive mass, both moving P / (P + N) towards rho0 as the method intends.
  P + N = 0 counts as balanced (no adaptation).

  Reference: Xi et al. 2025, "BAPO: Stabilizing Off-Policy Reinforcement Learning
  for LLMs via Balanced Policy Optimization with Adaptive Clipping",
  https://github.com/WooooDyy/BAPO.

  Args:
    logp: current log-probs `[B, T]` (only read; no gradient flows).
    old_logp: behaviour/anchor log-probs `[B, T]`.
    advantages: per-token advantages `[B, T]`.
    mask: response mask `[B, T]`.
    c_low: starting lower ratio bound, 0 < c_low <= c_low_max.
    c_high: starting upper ratio bound, 1 <= c_high <= c_high_max.
    c_low_max: largest lower bound, <= 1.
    c_high_max: largest upper bound, <= dual_clip.
    delta: step > 0 of each raise.
    rho0: target positive share in (0, 1].
    dual_clip: dual-clip constant c for A < 0 (tokens with r > c carry no
      gradient); None disables it.

  Returns:
    `BapoClipBounds(c_low, c_high, positive_share, dual_clip)`, float32
    scalars (`dual_clip` None when disabled).
  """
  _checks.check_token_arrays(logp=logp, old_logp=old_logp, advantages=advantages, mask=mask)
  # Ratio bounds: 0 < c_low <= c_low_max <= 1 <= c_high <= c_high_max <= dual_clip,
  # so the PPO keywords 1 - c_low and c_high - 1 stay in [0, 1) and >= 0.
  _checks.check_range(c_low, "c_low", low=0.0, high=1.0, low_open=True)
  _checks.check_range(c_low_max, "c_low_max", low=0.0, high=1.0, low_open=True)
  _checks.check_interval(c_low, c_low_max, "c_low", "c_low_max")
  _checks.check_range(c_high, "c_high", low=1.0)
  _checks.check_interval(c_high, c_high_max, "c_high", "c_high_max")
  _checks.check_positive(delta, "delta")
  _checks.check_range(rho0, "rho0", low=0.0, high=1.0, low_open=True)
  _checks.check_range(c_high_max, "c_high_max", low=1.0)
  _checks.check_greater(dual_clip, 1.0, "dual_clip", optional=True)
  _checks.check_interval(c_high_max, dual_clip, "c_high_max", "dual_clip")

  valid = _checks.as_mask(mask)
  sg = jax.lax.stop_gradient
  lp = sg(_checks.where_mask(valid, _checks.as_f32(logp)))
  olp = sg(_checks.where_mask(valid, _checks.as_f32(old_logp)))
  adv = sg(_checks.where_mask(valid, _checks.as_f32(advantages)))
  clamp = _checks.LOG_RATIO_CLAMP
  ratio = jnp.exp(jnp.clip(lp - olp, -clamp, clamp))
  pos = valid & (adv > 0)
  neg = valid & (adv < 0)
  pos_mass = jnp.where(pos, ratio * adv, 0.0)
  neg_mass = jnp.where(neg, ratio * -adv, 0.0)
  neg_upper = jnp.inf if dual_clip is None else jnp.float32(dual_clip)

  c_low0 = jnp.float32(c_low)
  c_high0 = jnp.float32(c_high)
  step = jnp.float32(delta)
  # Number of whole steps to each maximum (tolerant of float rounding).
  n_low = jnp.maximum(jnp.floor((jnp.float32(c_low_max) - c_low0) / step + 1e-4), 0)
  n_high = jnp.maximum(jnp.floor((jnp.float32(c_high_max) - c_high0) / step + 1e-4), 0)

  def bounds(k_low, k_high):
    lo = jnp.minimum(c_low0 + k_low * step, jnp.float32(c_low_max))
    hi = jnp.minimum(c_high0 + k_high * step, jnp.float32(c_high_max))
    return lo, hi

  def share(k_low, k_high):
    lo, hi = bounds(k_low, k_high)
    p = jnp.sum(jnp.where(ratio <= hi, pos_mass, 0.0))
    n = jnp.sum(jnp.where((ratio >= lo) & (ratio <= neg_upper), neg_mass, 0.0))
    total = p + n
    return jnp.where(total > 0, p / jnp.where(total > 0, total, 1.0), 1.0)

  def cond(carry):
    k_low, k_high = carry
    can_move = (k_low < n_low) | (k_high < n_high)
    return (share(k_low, k_high) < rho0) & can_move

  def body(carry):
    k_low, k_high = carry
    raise_low = k_low < n_low
    return (jnp.where(raise_low, k_low + 1, k_low), jnp.where(raise_low, k_high, k_high + 1))

  k_low, k_high = jax.lax.while_loop(cond, body, (jnp.float32(0.0), jnp.float32(0.0)))
  lo, hi = bounds(k_low, k_high)
  return BapoClipBounds(
    c_low=lo,
    c_high=hi,
    positive_share=share(k_low, k_high),
    dual_clip=None if dual_clip is None else jnp.float32(dual_clip),
  )
