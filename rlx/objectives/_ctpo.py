"""CTPO: cumulative-token importance sampling with position-adaptive log-space clipping."""

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Shaped

from rlx.objectives._checks import (
  as_mask,
  check_choice,
  check_finite,
  check_non_negative,
  check_positive,
  check_token_arrays,
  clip,
)
from rlx.objectives._metrics import PolicyLossMetrics
from rlx.objectives._policy_inputs import (
  clipped_loss_result,
  clipped_surrogate,
  dual_clip_tokens,
  prepare_policy_inputs,
)
from rlx.objectives._ratios import masked_log_ratio

CTPO_VARIANTS = ("cumprod", "geomean")
# Default position power per variant: the cumulative product's window widens
# with position (the sqrt(t) growth of the cumulative log-ratio), the geometric
# mean's narrows (its 1/sqrt(t) shrinkage).
_DEFAULT_POSITION_POWER = {"cumprod": 0.5, "geomean": -0.5}
# Upper cap on the log cumulative ratio before exp (as for GSPO).
_MAX_LOG_CUMULATIVE_RATIO = 10.0


def ctpo_clip_scale(
  mask: Shaped[Array, "B T"], *, position_power: float | Float[Array, ""] = 0.5
) -> Float[Array, "B T"]:
  """Position scale `max(t, 1) ** p` of CTPO's log-space clip window.

  `t = cumsum(mask)` is the 1-based index of a token among the VALID tokens of
  its sequence, so masked spans (tool output, observations) do not advance it.
  The clip window of token t is `[exp(-c_low * scale), exp(c_high * scale)]`,
  e.g. ~[0.975, 1.051] at t = 1 and ~[0.78, 1.65] at t = 100 with the defaults
  `c_low = 0.025, c_high = 0.05, p = 0.5`.

  Args:
    mask: 1/True on the tokens that count, with shape `[B, T]`.
    position_power: exponent `p`.

  Returns:
    float32 with shape `[B, T]` (masked positions carry the scale of the last
    valid position before them, or of t = 1).
  """
  check_token_arrays(mask=mask)
  check_finite(position_power, "position_power")
  return _clip_scale(_positions(as_mask(mask)), position_power)


def _positions(valid: jax.Array) -> jax.Array:
  """1-based index among the valid tokens of each sequence, float32 `[B, T]`."""
  return jnp.cumsum(valid, axis=1).astype(jnp.float32)


def _clip_scale(position: jax.Array, position_power) -> jax.Array:
  return jnp.power(jnp.maximum(position, 1.0), position_power)


def ctpo_loss(
  logp: Float[Array, "B T"],
  old_logp: Float[Array, "B T"],
  advantages: Float[Array, "B T"],
  mask: Shaped[Array, "B T"],
  *,
  clip_low: float | Float[Array, ""] = 0.025,
  clip_high: float | Float[Array, ""] = 0.05,
  dual_clip: float | Float[Array, ""] | None = 0.05,
  position_power: float | Float[Array, ""] | None = None,
  variant: str = "cumprod",
  is_weights: Float[Array, "B T"] | None = None,
  agg: str = "token-mean",
  agg_scale: Float[Array, ""] | float | None = None,
) -> tuple[Float[Array, ""], PolicyLossMetrics]:
  """Cumulative Token Policy Optimization loss (reference loss mode "cum-token-cumprod-la").

  With `delta_t = clamp(lp_t - olp_t, -20, 20)` and `t = cumsum(m)` (valid-token
  position, 1-based):
    S_t     = sum_{j<=t} m_j delta_j                  ("cumprod": prod_{j<=t} r_j)
            = (sum_{j<=t} m_j delta_j) / max(t, 1)    ("geomean": geometric mean)
    log R_t = min(sg(S_t) + lp_t - sg(lp_t), 10)      (only the current token
                                                       gets gradient; prefix detached)
    scale_t = max(t, 1) ** p
    R~_t    = exp(clamp(log R_t, -clip_low * scale_t, clip_high * scale_t))
    L_t     = max(-A R_t, -A R~_t)
    L_t     = min(L_t, -A exp(dual_clip * scale_t))   for A < 0 (if dual_clip)
    loss    = aggregate(L * sg(is_weights), mask, agg)
  The cumulative ratio is an unbiased prefix correction for each token's
  gradient term with lower variance than the full-sequence ratio. Zhang et
  al. 2026, "Rethinking Importance Sampling in LLM Policy Optimization: A
  Cumulative Token Perspective", https://arxiv.org/abs/2605.07331; code
  https://github.com/horizon-llm/CTPO (`cum-token-cumprod-la` in its verl
  `core_algos.py`).

  Args:
    logp: current-policy log-probs (differentiated), with shape `[B, T]`.
    old_logp: old-policy log-probs (detached), with shape `[B, T]`.
    advantages: per-token advantages (detached), with shape `[B, T]`.
    mask: 1/True on the tokens that count, with shape `[B, T]`.
    clip_low: `c_low >= 0`, lower log-space clip per unit scale.
    clip_high: `c_high >= 0`, upper log-space clip per unit scale.
    dual_clip: `c_c > 0`, dual-clip threshold `exp(c_c * scale)` for A < 0, or None.
    position_power: `p`; None picks the variant's default (0.5 for "cumprod",
      -0.5 for "geomean").
    variant: "cumprod" (default) or "geomean".
    is_weights: rollout-correction weights (detached), with shape `[B, T]`.
    agg: aggregation mode (see `aggregate`).
    agg_scale: optional denominator for `aggregate` (global batch scale).

  Returns:
    `(loss, metrics)`: float32 scalar and `PolicyLossMetrics` (ratio = `R_t`).
  """
  check_non_negative(clip_low, "clip_low")
  check_non_negative(clip_high, "clip_high")
  check_positive(dual_clip, "dual_clip", optional=True)
  check_finite(position_power, "position_power", optional=True)
  check_choice(variant, CTPO_VARIANTS, "variant")
  x = prepare_policy_inputs(
    logp, old_logp, advantages, mask, is_weights=is_weights, agg=agg, agg_scale=agg_scale
  )
  if position_power is None:
    position_power = _DEFAULT_POSITION_POWER[variant]
  sg = jax.lax.stop_gradient
  adv = x.advantages
  log_ratio = masked_log_ratio(x.logp, x.old_logp, x.valid)
  cumulative = jnp.cumsum(log_ratio, axis=1)
  position = _positions(x.valid)
  if variant == "geomean":
    cumulative = cumulative / jnp.maximum(position, 1.0)
  log_r = clip(sg(cumulative) + x.logp - sg(x.logp), high=_MAX_LOG_CUMULATIVE_RATIO)
  scale = _clip_scale(position, position_power)
  log_low, log_high = -clip_low * scale, clip_high * scale
  ratio = jnp.exp(log_r)
  clipped_ratio = jnp.exp(clip(log_r, log_low, log_high))
  per_token = clipped_surrogate(ratio, clipped_ratio, adv)
  clipped_dual = None
  if dual_clip is not None:
    log_cap = dual_clip * scale
    per_token, clipped_dual = dual_clip_tokens(per_token, adv, jnp.exp(log_cap), log_r > log_cap)
  below, above = log_r < log_low, log_r > log_high
  return clipped_loss_result(
    x, per_token, log_ratio, ratio, below=below, above=above, clipped_dual=clipped_dual
  )
