"""Input validation shared by every objective.

Each public objective validates on entry: ranks and shapes are static under
`jit`, so these checks cost nothing at run time and fail before tracing goes
further. Hyper-parameters are checked whenever their value is known: Python
and NumPy numbers and concrete (non-traced) `jax.Array`s. Traced values (e.g.
adaptive clip bounds computed inside a jitted step) pass through unchecked.
"""

from collections.abc import Iterable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

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


def check_token_arrays(**arrays: Any) -> None:
  """Checks that all given (non-None) arrays are `[B, T]` and share one shape.

  The first keyword is the reference the others are compared to.
  """
  items = [(k, v) for k, v in arrays.items() if v is not None]
  if not items:
    return
  ref_name, ref = items[0]
  check_rank(ref, 2, ref_name)
  check_not_empty(ref, ref_name, "[B, T] with B >= 1 sequences and T >= 1 tokens")
  check_same_shape(ref_name, ref, dict(items[1:]))


def check_choice(value: Any, choices: Iterable[str], name: str) -> None:
  choices = tuple(choices)
  if value not in choices:
    raise ValueError(f"`{name}` must be one of {choices}, got {value!r}.")


def is_concrete(x: Any) -> bool:
  """True when the value of `x` is known now: Python/NumPy numbers and arrays, and
  `jax.Array`s that are not tracers (under `jit`/`grad` a traced value is not)."""
  if isinstance(x, jax.core.Tracer):
    return False
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
) -> None:
  """Raises ValueError unless concrete `value` lies in the interval (None = unbounded side).

  NaN is always out of range. Traced values are not checked.
  """
  if value is None or not is_concrete(value):
    return
  x = np.asarray(value, np.float64)
  ok = ~np.isnan(x)
  if low is not None:
    ok &= (x > low) if low_open else (x >= low)
  if high is not None:
    ok &= (x < high) if high_open else (x <= high)
  if np.all(ok):
    return
  if high is None:
    want = f"{'>' if low_open else '>='} {low}"
  elif low is None:
    want = f"{'<' if high_open else '<='} {high}"
  else:
    want = f"in {'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"
  raise ValueError(f"`{name}` must be {want}, got {_show(value)}{why}.")


def check_finite(value: Any, name: str) -> None:
  """Raises ValueError unless concrete `value` is a finite number."""
  check_range(value, name, low=-np.inf, high=np.inf, low_open=True, high_open=True)


def check_non_negative(value: Any, name: str) -> None:
  check_range(value, name, low=0.0)


def check_positive(value: Any, name: str) -> None:
  check_range(value, name, low=0.0, low_open=True)


def check_greater(value: Any, bound: float, name: str) -> None:
  check_range(value, name, low=bound, low_open=True)


def check_interval(low: Any, high: Any, low_name: str, high_name: str) -> None:
  """Raises ValueError if concrete `low > high`."""
  if is_concrete(low) and is_concrete(high) and not np.all(np.asarray(low) <= np.asarray(high)):
    raise ValueError(f"`{low_name}` ({_show(low)}) must be <= `{high_name}` ({_show(high)}).")


def check_ratio_clips(
  clip_low: Any, clip_high: Any, dual_clip: Any = None, *, prefix: str = ""
) -> None:
  """PPO-convention ratio clip bounds: the ratio is kept in `[1 - clip_low, 1 + clip_high]`.

  `clip_low` in [0, 1) (at >= 1 the lower bound `1 - clip_low <= 0` is below
  every ratio, silently removing the clip), `clip_high >= 0` and `dual_clip > 1`
  (None: off; at <= 1 the cap would lie inside the clip window).
  """
  check_range(
    clip_low,
    f"{prefix}clip_low",
    low=0.0,
    high=1.0,
    high_open=True,
    why=" (the ratio's lower bound is 1 - clip_low; >= 1 would remove it)",
  )
  check_non_negative(clip_high, f"{prefix}clip_high")
  check_greater(dual_clip, 1.0, "dual_clip")


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
