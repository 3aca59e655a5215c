"""Reduction of a per-token loss matrix to a scalar (verl `agg_loss` conventions).

Every mode is `numerator(values, mask) / denominator`, and the denominator can
be replaced by `scale`. With gradient accumulation, compute
`scale = aggregate_scale(full_mask, mode)` once for the whole batch, pass it to
every micro-batch and SUM the micro-batch losses: the result (and its gradient)
equals the full-batch loss, for every mode.
"""

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Shaped

from rlx.objectives._checks import (
  as_f32,
  as_mask,
  check_agg_scale,
  check_choice,
  check_token_arrays,
  safe_div,
  where_mask,
)

AGG_MODES = (
  "token-mean",
  "seq-mean-token-sum",
  "seq-mean-token-mean",
  "seq-mean-token-sum-norm",
)


def _default_scale(valid: jax.Array, mode: str) -> jax.Array:
  if mode == "token-mean":
    return jnp.sum(valid).astype(jnp.float32)
  num_sequences = jnp.sum(jnp.any(valid, axis=1)).astype(jnp.float32)
  if mode in ("seq-mean-token-sum", "seq-mean-token-mean"):
    return num_sequences
  return num_sequences * jnp.float32(valid.shape[1])


def aggregate_scale(mask: Shaped[Array, "B T"], mode: str) -> Float[Array, ""]:
  """The default denominator that `aggregate` divides by for `mode`.

  - token-mean: number of valid tokens `sum m`.
  - seq-mean-token-sum, seq-mean-token-mean: number of sequences with at least
    one valid token.
  - seq-mean-token-sum-norm: `|V| * T`, the number of sequences with at least
    one valid token times the padded length `T` of `mask`.

  Args:
    mask: 1/True on the tokens that count, with shape `[B, T]` (the FULL batch
      when used for gradient accumulation).
    mode: one of `AGG_MODES`.

  Returns:
    float32 scalar.
  """
  check_choice(mode, AGG_MODES, "mode")
  check_token_arrays(mask=mask)
  return _default_scale(as_mask(mask), mode)


def aggregate(
  values: Float[Array, "B T"],
  mask: Shaped[Array, "B T"],
  mode: str,
  *,
  scale: Float[Array, ""] | float | None = None,
) -> Float[Array, ""]:
  """Aggregates a per-token matrix `L` into a scalar (verl `agg_loss`).

  With `n_i = sum_t m_it` and `V = {i : n_i > 0}` (sequences without valid
  tokens are excluded from every sequence mean):
  - "token-mean":              `sum_it L m / sum_it m`
  - "seq-mean-token-sum":      `sum_{i in V} (sum_t L m) / |V|`
  - "seq-mean-token-mean":     `sum_{i in V} (sum_t L m / n_i) / |V|`
  - "seq-mean-token-sum-norm": `sum_{i in V} (sum_t L m / T) / |V|`
    `= sum_it L m / (|V| T)`, the mean over sequences of the token sum divided
    by the constant `T` = padded length (Dr.GRPO, Liu et al. 2025,
    https://arxiv.org/abs/2503.20783: the `1/G` stays, only `1/|o_i|` becomes
    the constant; verl `agg_loss` with `loss_scale_factor = T`, TRL's
    "dr_grpo" loss `sum L m / (B T)`). For a fixed-length normaliser other
    than the padded length (e.g. the maximum response length, so that it
    stays constant throughout training), pass `scale = |V| * L_max`.

  verl's `agg_loss` divides the sequence modes by the global batch size,
  which counts sequences whose mask is all zero; rlx excludes them (`|V|`),
  so a padded row never dilutes the mean. With every row valid the two agree.

  A zero denominator (no valid token at all, or `scale = 0`) gives 0, never NaN. Masked values
  are removed with `where`, so NaN/inf there never reaches the result or its
  gradient.

  Args:
    values: per-token values `L`, with shape `[B, T]` (any float dtype;
      computed in float32).
    mask: 1/True on the tokens that count, with shape `[B, T]`.
    mode: one of `AGG_MODES`.
    scale: optional scalar replacing the denominator (`sum m`, `|V|` or `|V| T`),
      e.g. `aggregate_scale(full_batch_mask, mode)` for micro-batching. A real
      scalar, finite and >= 0 when concrete.

  Returns:
    float32 scalar.
  """
  check_choice(mode, AGG_MODES, "mode")
  check_token_arrays(values=values, mask=mask)
  check_agg_scale(scale, "scale")
  valid = as_mask(mask)
  v = where_mask(valid, as_f32(values))
  if mode == "seq-mean-token-mean":
    lengths = jnp.sum(valid, axis=1).astype(jnp.float32)
    numerator = jnp.sum(jnp.sum(v, axis=1) / jnp.maximum(lengths, 1.0))
  else:
    numerator = jnp.sum(v)
  denominator = _default_scale(valid, mode) if scale is None else as_f32(scale)
  return safe_div(numerator, denominator, 0.0)
