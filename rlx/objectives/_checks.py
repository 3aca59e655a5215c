"""Input validation shared by every objective.

Each public objective validates on entry: ranks and shapes are static under
`jit`, so these checks cost nothing at run time and fail before tracing goes
further. Hyper-parameters must be real scalars (Python/NumPy numbers or 0-d arrays,
also traced ones: their dtype and rank are static); their range is checked
whenever their value is known: Python and NumPy numbers and concrete
(non-traced) `jax.Array`s. Traced values (e.g. adaptive clip bounds computed
inside a jitted step) pass through unchecked. Masks must hold only 0/1 (or
bool) values; that is checked when the mask is concrete (an eager call).
Under `jit` a mask is read as `mask != 0`.
"""

from collections.abc import Iterable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from rlx import _choices

# Log-ratios are clamped to +-LOG_RATIO_CLAMP before `exp` (as verl's
# `compute_policy_loss_vanilla` clamps `log_ratio` to [-20, 20]), so a ratio is at
# most e^20 and its square stays finite in float32.
LOG_RATIO_CLAMP = 20.0


def shape_str(x: Any) -> str:
  return str(tuple(np.shape(x)))


def check_rank(x: Any, rank: int, name: str) -> None:
  """Raises ValueError unless `x` has rank `rank`."""
  if np.ndim(x) != rank:
    raise ValueError(f"`{name}` must have rank {rank}, got shape {shape_str(x)}.")


def check_same_shape(reference_name: str, reference: Any, others: Mapping[str, Any]) -> None:
  """Raises ValueError naming the first array of `others` whose shape differs."""
  want = np.shape(reference)
  for name, x in others.items():
    if x is None:
      continue
    if np.shape(x) != want:
      raise ValueError(
        f"`{name}` must have the shape of `{reference_name}` {tuple(want)}, got {shape_str(x)}."
      )


def check_not_empty(x: Any, name: str, expected: str = "at least one element") -> None:
  """Raises ValueError if `x` has a zero-size dimension (e.g. B = 0 or T = 0)."""
  shape = np.shape(x)
  if 0 in shape:
    raise ValueError(f"`{name}` must be {expected}, got the zero-size shape {tuple(shape)}.")


def _dtype(x: Any) -> np.dtype | None:
  """The dtype of `x` without moving device data (None if it is not array-like)."""
  dtype = getattr(x, "dtype", None)
  if dtype is not None:
    return np.dtype(dtype)
  try:
    return np.asarray(x).dtype
  except (TypeError, ValueError):
    return None


def is_real_dtype(dtype: Any) -> bool:
  """True for bool, integer and floating dtypes (bfloat16/float16 included)."""
  return dtype is not None and (
    jnp.issubdtype(dtype, jnp.bool_)
    or jnp.issubdtype(dtype, jnp.integer)
    or jnp.issubdtype(dtype, jnp.floating)
  )


def check_real_array(x: Any, name: str) -> None:
  """Raises ValueError unless `x` is an array (or nested list) of bool, int or float values."""
  if x is None:
    raise ValueError(f"`{name}` must be an array, got None.")
  if isinstance(x, str | bytes):
    raise ValueError(f"`{name}` must be an array, got the string {x!r}.")
  dtype = _dtype(x)
  if not is_real_dtype(dtype):
    what = f"dtype {dtype}" if dtype is not None else f"a {type(x).__name__}"
    raise ValueError(f"`{name}` must hold real numbers (bool, int or float), got {what}.")


def check_float_array(x: Any, name: str) -> None:
  """Raises ValueError unless `x` is an array (or nested list) of floating values.

  For data that is a real quantity (log-probabilities, advantages, weights):
  an integer or bool array there is a caller bug, and differentiating a loss
  with respect to it would fail only later, inside `jax.grad`.
  """
  check_real_array(x, name)
  dtype = _dtype(x)
  if not jnp.issubdtype(dtype, jnp.floating):
    raise ValueError(
      f"`{name}` must be a floating array (e.g. float32 or bfloat16), got dtype {dtype}."
    )


# `check_token_arrays` names of floating data (besides every name ending in "logp").
FLOAT_DATA_NAMES = ("advantages", "is_weights", "entropy")


def check_mask_values(mask: Any, name: str) -> None:
  """Raises ValueError unless concrete `mask` holds only 0/1 (or bool) values.

  A mask selects tokens; it is not a weight. 0.5, 2, -1 or NaN would be read
  as `mask != 0` (counted with weight 1), so they are refused when the value
  is known. Traced masks are not checked.
  """
  if not is_concrete(mask):
    return
  dtype = _dtype(mask)
  if dtype is not None and jnp.issubdtype(dtype, jnp.bool_):
    return
  values = np.asarray(mask)
  bad = ~((values == 0) | (values == 1))
  if bad.any():
    where = tuple(int(i) for i in np.argwhere(bad)[0])
    raise ValueError(
      f"`{name}` must hold only 0/1 or bool values, got {values[where]} at index {where} "
      f"({int(bad.sum())} such value(s)); a mask selects tokens, pass per-token weights "
      "as `is_weights`."
    )


def check_token_arrays(*, optional: Iterable[str] = (), **arrays: Any) -> None:
  """Checks that the given arrays are real-valued `[B, T]` and share one shape.

  The first keyword is the reference the others are compared to. An array may
  be None only if its name is in `optional`. Arrays whose name ends in "mask"
  must also hold only 0/1 (or bool) values when concrete; log-probabilities
  (names ending in "logp") and `FLOAT_DATA_NAMES` must be floating.
  """
  optional = set(optional)
  for name, x in arrays.items():
    if x is None and name in optional:
      continue
    if name.endswith("logp") or name in FLOAT_DATA_NAMES:
      check_float_array(x, name)
    else:
      check_real_array(x, name)
  items = [(k, v) for k, v in arrays.items() if v is not None]
  if not items:
    return
  ref_name, ref = items[0]
  check_rank(ref, 2, ref_name)
  check_not_empty(ref, ref_name, "[B, T] with B >= 1 sequences and T >= 1 tokens")
  check_same_shape(ref_name, ref, dict(items[1:]))
  for name, x in items:
    if name.endswith("mask"):
      check_mask_values(x, name)


def check_weight_values(weights: Any, valid: Any, name: str) -> None:
  """Raises ValueError if concrete importance `weights` hold a negative or non-finite entry."""
  if not (is_concrete(weights) and (valid is None or is_concrete(valid))):
    return
  w = np.asarray(weights, np.float64)
  keep = np.ones(w.shape, bool) if valid is None else np.asarray(valid) != 0
  bad = keep & ~(np.isfinite(w) & (w >= 0))
  if bad.any():
    where = tuple(int(i) for i in np.argwhere(bad)[0])
    raise ValueError(
      f"`{name}` must be finite and >= 0 (importance weights), got {w[where]} at index {where}."
    )


def checked_weight_mask(weights: jax.Array, valid: Any, name: str) -> jax.Array:
  """The bool mask of the importance `weights` that count: `valid`, or all of them when None.

  `valid` must be a real 0/1 (or bool) array with the shape of `weights`, and
  the weights finite and >= 0 where valid (`check_weight_values`; both checked
  when concrete).
  """
  if valid is None:
    valid = jnp.ones(weights.shape, jnp.bool_)
  else:
    check_real_array(valid, "valid")
    check_same_shape(name, weights, {"valid": valid})
    check_mask_values(valid, "valid")
    valid = as_mask(jnp.asarray(valid))
  check_weight_values(weights, valid, name)
  return valid


def check_flag(value: Any, name: str) -> None:
  """Raises ValueError unless `value` is a concrete bool (it selects code at trace time)."""
  if isinstance(value, jax.core.Tracer):
    raise ValueError(
      f"`{name}` must be a Python bool (it selects the computation at trace time), got a "
      "traced value; mark it static (e.g. `jax.jit(..., static_argnames=...)`)."
    )
  if isinstance(value, bool | np.bool_):
    return
  if isinstance(value, np.ndarray | jax.Array) and value.shape == () and value.dtype == bool:
    return
  raise ValueError(f"`{name}` must be a bool, got {value!r}.")


def check_scalar(value: Any, name: str, *, optional: bool = False) -> None:
  """Raises ValueError unless `value` is a real scalar (or None when `optional`).

  Accepted: Python int/float, NumPy integer/floating scalars and 0-d arrays,
  0-d `jax.Array`s, concrete or traced (their dtype and rank are static).
  Refused: None (unless optional), bools, strings, complex numbers, arrays of
  rank > 0 (a hyper-parameter would silently broadcast per token).
  """
  if value is None:
    if optional:
      return
    raise ValueError(f"`{name}` must be a real number, got None.")
  if isinstance(value, bool | np.bool_):
    raise ValueError(f"`{name}` must be a real number, got the bool {value!r}.")
  if isinstance(value, int | float):
    return
  dtype = getattr(value, "dtype", None)
  if dtype is None or not isinstance(value, np.ndarray | np.generic | jax.Array):
    raise ValueError(f"`{name}` must be a real number, got {type(value).__name__} {value!r}.")
  if not (jnp.issubdtype(dtype, jnp.integer) or jnp.issubdtype(dtype, jnp.floating)):
    raise ValueError(f"`{name}` must be a real number, got dtype {dtype}.")
  if np.ndim(value) != 0:
    raise ValueError(
      f"`{name}` must be a scalar (rank 0), got shape {shape_str(value)}; one value holds "
      "for the whole batch."
    )


check_choice = _choices.check_choice


def is_concrete(x: Any) -> bool:
  """True when the value of `x` is known now: Python/NumPy numbers and arrays, and
  `jax.Array`s that are not tracers (under `jit`/`grad` a traced value is not) and
  whose shards this process holds. Reading a concrete device array syncs with
  the device, so value checks cost a transfer in eager calls only."""
  if isinstance(x, jax.core.Tracer):
    return False
  if isinstance(x, jax.Array) and not x.is_fully_addressable:
    return False  # a multi-process global array: this process cannot read all of it
  return isinstance(x, int | float | np.number | np.ndarray | jax.Array)


def _show(value: Any) -> str:
  return repr(value.tolist() if isinstance(value, jax.Array | np.ndarray) else value)


def check_range(
  value: Any,
  name: str,
  *,
  low: float | None = None,
  high: float | None = None,
  low_open: bool = False,
  high_open: bool = False,
  why: str = "",
  optional: bool = False,
) -> None:
  """Raises ValueError unless concrete `value` lies in the interval (None = unbounded side).

  `value` must be a real scalar (`check_scalar`; None allowed only when
  `optional`). NaN is always out of range. Traced values are not range-checked.
  """
  check_scalar(value, name, optional=optional)
  if value is None or not is_concrete(value):
    return
  bounds = dict(low=low, high=high, low_open=low_open, high_open=high_open)
  if np.all(_in_range(np.asarray(value, np.float64), **bounds)):
    return
  raise ValueError(f"`{name}` must be {_range_text(**bounds)}, got {_show(value)}{why}.")


def _in_range(x: np.ndarray, *, low, high, low_open, high_open) -> np.ndarray:
  """Elementwise membership of the interval (NaN is never inside)."""
  ok = ~np.isnan(x)
  if low is not None:
    ok &= (x > low) if low_open else (x >= low)
  if high is not None:
    ok &= (x < high) if high_open else (x <= high)
  return ok


def _range_text(*, low, high, low_open, high_open) -> str:
  if high is None:
    return f"{'>' if low_open else '>='} {low}"
  if low is None:
    return f"{'<' if high_open else '<='} {high}"
  return f"in {'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"


def check_range_or_token_array(
  value: Any,
  name: str,
  token_shape: tuple[int, ...] | None,
  *,
  token_mask: Any = None,
  reference: str = "logp",
  why: str = "",
  **bounds: Any,
) -> None:
  """`check_range` for a value that may also be a per-token `[B, T]` array.

  A rank-0 value is checked by `check_range`. With `token_shape` given, a
  value of rank > 0 must be a floating array of exactly that shape (the shape
  of the `reference` data array); when concrete, every entry must lie in the
  interval (NaN never does), except at positions where a concrete
  `token_mask` of that shape is 0 (padding, never read). Without
  `token_shape`, arrays are refused as by `check_scalar`.
  """
  if token_shape is None or value is None or np.ndim(value) == 0:
    check_range(value, name, why=why, **bounds)
    return
  check_float_array(value, name)
  if np.shape(value) != tuple(token_shape):
    raise ValueError(
      f"`{name}` must be a scalar (rank 0), got shape {shape_str(value)}; per-token values "
      f"must have the shape of `{reference}` {tuple(token_shape)}."
    )
  if not is_concrete(value):
    return
  full = {"low": None, "high": None, "low_open": False, "high_open": False, **bounds}
  x = np.asarray(value, np.float64)
  bad = ~_in_range(x, **full)
  if token_mask is not None and is_concrete(token_mask) and np.shape(token_mask) == x.shape:
    bad &= np.asarray(token_mask) != 0
  if bad.any():
    where = tuple(int(i) for i in np.argwhere(bad)[0])
    raise ValueError(
      f"`{name}` must be {_range_text(**full)} at every valid token, got {x[where]} at index "
      f"{where} ({int(bad.sum())} such value(s)){why}."
    )


def check_finite(value: Any, name: str, *, optional: bool = False) -> None:
  """Raises ValueError unless concrete `value` is a finite number."""
  check_scalar(value, name, optional=optional)
  if value is not None and is_concrete(value) and not np.isfinite(np.asarray(value, np.float64)):
    raise ValueError(f"`{name}` must be finite, got {_show(value)}.")


def check_non_negative(value: Any, name: str, *, optional: bool = False) -> None:
  check_range(value, name, low=0.0, optional=optional)


def check_positive(value: Any, name: str, *, optional: bool = False) -> None:
  check_range(value, name, low=0.0, low_open=True, optional=optional)


def check_greater(value: Any, bound: float, name: str, *, optional: bool = False) -> None:
  check_range(value, name, low=bound, low_open=True, optional=optional)


def check_interval(low: Any, high: Any, low_name: str, high_name: str) -> None:
  """Raises ValueError if concrete `low > high`."""
  if is_concrete(low) and is_concrete(high) and not np.all(np.asarray(low) <= np.asarray(high)):
    raise ValueError(f"`{low_name}` ({_show(low)}) must be <= `{high_name}` ({_show(high)}).")


def check_agg_scale(scale: Any, name: str) -> None:
  """An optional aggregation denominator: a real scalar in [0, inf) (None: the default)."""
  if scale is not None:
    check_rank(scale, 0, name)
  check_non_negative(scale, name, optional=True)
  check_finite(scale, name, optional=True)


def check_ratio_clips(
  clip_low: Any,
  clip_high: Any,
  dual_clip: Any = None,
  *,
  prefix: str = "",
  dual_clip_optional: bool = True,
  token_shape: tuple[int, ...] | None = None,
  token_mask: Any = None,
) -> None:
  """PPO-convention ratio clip bounds: the ratio is kept in `[1 - clip_low, 1 + clip_high]`.

  `clip_low` in [0, 1) (at >= 1 the lower bound `1 - clip_low <= 0` is below
  every ratio, silently removing the clip), `clip_high >= 0` and `dual_clip > 1`
  (None: off, where `dual_clip_optional`; at <= 1 the cap would lie inside the
  clip window). With `token_shape` (the `[B, T]` shape of `logp`), `clip_low`
  and `clip_high` may also be per-token floating arrays of that shape, every
  entry in range where `token_mask` (the loss's mask) is set (checked when
  concrete); `dual_clip` stays a scalar.
  """
  check_range_or_token_array(
    clip_low,
    f"{prefix}clip_low",
    token_shape,
    token_mask=token_mask,
    low=0.0,
    high=1.0,
    high_open=True,
    why=" (the ratio's lower bound is 1 - clip_low; >= 1 would remove it)",
  )
  check_range_or_token_array(
    clip_high, f"{prefix}clip_high", token_shape, token_mask=token_mask, low=0.0
  )
  check_greater(dual_clip, 1.0, "dual_clip", optional=dual_clip_optional)


def as_f32(x: jax.Array) -> jax.Array:
  return jnp.asarray(x).astype(jnp.float32)


def as_mask(mask: jax.Array) -> jax.Array:
  """Boolean view of a 0/1 (or bool) mask."""
  mask = jnp.asarray(mask)
  return mask if mask.dtype == jnp.bool_ else mask != 0


def where_mask(mask: jax.Array, x: jax.Array, fill: float = 0.0) -> jax.Array:
  """`x` at valid positions, `fill` elsewhere (NaN-safe: never multiplies)."""
  return jnp.where(mask, x, jnp.asarray(fill, x.dtype))


def safe_div(num: jax.Array, den: jax.Array, empty: float) -> jax.Array:
  """`num / den`, or `empty` where `den == 0` (NaN-safe in value and gradient)."""
  ok = den > 0
  return jnp.where(ok, num / jnp.where(ok, den, 1.0), jnp.float32(empty))


def clip(x: jax.Array, low: Any = None, high: Any = None) -> jax.Array:
  """`x` clipped to `[low, high]` (None: unbounded) with gradient 1 on the CLOSED interval.

  Like `torch.clamp`: a value exactly at a bound keeps its full gradient.
  `jnp.clip`/`jnp.minimum` split the gradient 50/50 at a tie, which would give a
  ratio sitting exactly on a clip bound (e.g. ratio 1 with a zero-width window)
  a fraction of its gradient. `high` wins if `low > high`, as in `jnp.clip`.
  """
  if low is not None:
    x = jnp.where(x < low, low, x)
  if high is not None:
    x = jnp.where(x > high, high, x)
  return x
