"""The train batch contract: keys, shapes, dtypes, divisibility and values.

`check_batch` reads only shapes and dtypes, so it runs at trace time inside a
jitted step as well as on host. `check_values` reads values (token ids in
[0, vocab), a 0/1 mask, finite advantages and log-probabilities <= 0 on loss
tokens) and runs on host before dispatch: under jit none of these would
raise, and the step would train on a wrong token or skip a NaN update.
"""

import weakref
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from rlx.train import _distributed, _placement, _spec

REQUIRED_KEYS = ("tokens", "loss_mask", "advantages", "old_logp")
OPTIONAL_KEYS = ("rollout_logp", "ref_logp", "positions", "segment_ids")
TOKEN_SHAPED_KEYS = (
  "loss_mask",
  "old_logp",
  "rollout_logp",
  "ref_logp",
  "positions",
  "segment_ids",
)
# Keys that must hold real floating values, and keys that must hold integers.
FLOAT_KEYS = ("advantages", "old_logp", "rollout_logp", "ref_logp")
INT_KEYS = ("tokens", "positions", "segment_ids")


def check_batch(batch: Mapping[str, Any], spec: _spec.StepSpec, num_shards: int) -> None:
  """Validates keys, shapes and dtypes of a train batch (no values are read).

  Args:
    batch: the batch dict (see `make_train_step`).
    spec: the resolved train config (batching counts, what needs rollout/ref log-probs).
    num_shards: batch shards of the mesh (`batch_axis_size`).

  Raises:
    ValueError: naming the key and the expected shape.
  """
  unknown = sorted(set(batch) - set(REQUIRED_KEYS) - set(OPTIONAL_KEYS))
  missing = [k for k in REQUIRED_KEYS if k not in batch]
  if unknown or missing:
    raise ValueError(
      f"Batch keys: missing {missing}, unknown {unknown}; required {REQUIRED_KEYS}, "
      f"optional {OPTIONAL_KEYS}."
    )
  shape = check_token_shaped(batch, TOKEN_SHAPED_KEYS)
  for key in FLOAT_KEYS:
    if key in batch and not jnp.issubdtype(dtype_of(batch[key]), jnp.floating):
      raise ValueError(
        f"`batch['{key}']` must be a floating array (e.g. float32), got dtype "
        f"{dtype_of(batch[key])}."
      )
  adv_shape = tuple(np.shape(batch["advantages"]))
  if adv_shape not in (shape, shape[:1]):
    raise ValueError(
      f"`advantages` must have shape [B, S] = {shape} or [B] = {shape[:1]}, got {adv_shape}."
    )
  parts = spec.mini_batches * spec.micro_batches * num_shards
  if shape[0] % parts:
    raise ValueError(
      f"Batch size {shape[0]} must be divisible by mini_batches ({spec.mini_batches}) x "
      f"micro_batches ({spec.micro_batches}) x data x fsdp ({num_shards}) = {parts}."
    )
  needs_rollout = spec.use_rollout_correction or spec.use_m2po or spec.use_vcpo
  if needs_rollout and "rollout_logp" not in batch:
    raise ValueError("`rollout_logp` is required by use_rollout_correction / use_m2po / use_vcpo.")
  if spec.kl_coef > 0 and "ref_logp" not in batch:
    raise ValueError("`ref_logp` is required when kl_coef > 0 (see compute_logprobs).")


def check_token_shaped(batch: Mapping[str, Any], keys: tuple[str, ...]) -> tuple[int, int]:
  """Checks `tokens` is a non-empty int `[B, S]` and each of `keys` in `batch` has its shape.

  Also checks the dtypes of `loss_mask` (bool, int or float) and of `positions`
  / `segment_ids` (int) where present.

  Returns:
    The shape `(B, S)` of `tokens`.
  """
  tokens = batch["tokens"]
  shape = tuple(np.shape(tokens))
  dtype = dtype_of(tokens)
  if len(shape) != 2 or not jnp.issubdtype(dtype, jnp.integer):
    raise ValueError(f"`tokens` must be an int array [B, S], got {dtype}{list(shape)}.")
  _placement.check_not_empty(shape, "batch['tokens']")
  for key in keys:
    if key in batch and tuple(np.shape(batch[key])) != shape:
      raise ValueError(
        f"`{key}` must have the shape of `tokens` {shape}, got {np.shape(batch[key])}."
      )
  for key in INT_KEYS[1:]:
    if key in batch and not jnp.issubdtype(dtype_of(batch[key]), jnp.integer):
      raise ValueError(f"`batch['{key}']` must be an int array, got dtype {dtype_of(batch[key])}.")
  if "loss_mask" in batch:
    mask_dtype = dtype_of(batch["loss_mask"])
    kinds = (jnp.bool_, jnp.integer, jnp.floating)
    if not any(jnp.issubdtype(mask_dtype, kind) for kind in kinds):
      raise ValueError(
        f"`batch['loss_mask']` must be a bool, int or float array, got dtype {mask_dtype}."
      )
  return shape


def dtype_of(x: Any) -> np.dtype:
  """The dtype of an array, tracer or array-like (lists are read with numpy)."""
  dtype = getattr(x, "dtype", None)
  return np.dtype(dtype) if dtype is not None else np.asarray(x).dtype


def check_values(
  batch: Mapping[str, Any], vocab_size: int, float_keys: tuple[str, ...] = ()
) -> None:
  """Raises ValueError naming the key of a batch value the step would silently mistrain on.

  Checked: token ids in [0, vocab_size), `loss_mask` 0/1, and on loss tokens
  (`loss_mask != 0`; for `advantages` of shape [B], rows with a loss token)
  each of `float_keys` in `batch` finite, and the log-probabilities among them
  (`LOGP_KEYS`) <= `LOGP_TOLERANCE`. Under jit none would raise: an id outside
  the vocabulary is clamped or filled by the embedding lookup (training on
  another token, or a NaN and a skipped update), a mask value such as 0.5
  would silently count as 1, and a NaN advantage or log-probability on one
  loss token makes the loss NaN, so the whole update is skipped. Padding
  (`loss_mask == 0`) may hold any float, NaN included (the step masks it out).

  Host (numpy) arrays are checked with numpy (free). Device arrays are
  checked by ONE small jitted reduction whose few numbers the host fetches:
  that waits until the device reaches it (after work already queued, e.g. the
  previous step) and gives every process of a multi-process run the same
  answer. The device arrays last found valid are remembered, so the same
  batch passed to `compute_logprobs` and then to the train step reduces its
  tokens and mask once, and the train step reduces only the float arrays
  added since (e.g. `old_logp`). Pass host arrays, or trace `step_fn` in
  your own jit, to avoid the wait. Padding must use a valid id too (e.g. 0 or
  the pad id): every position goes through the embedding.

  Args:
    batch: dict with `tokens` (int `[B, S]`) and `loss_mask` (`[B, S]`), whose
      shapes and dtypes were checked (`check_batch` / `check_token_shaped`).
    vocab_size: the policy's vocabulary size.
    float_keys: the float keys of `batch` to check (those absent are skipped).
  """
  global _last_checked
  tokens, mask = batch["tokens"], batch["loss_mask"]
  floats = {k: batch[k] for k in float_keys if k in batch}
  on_device = any(isinstance(x, jax.Array) for x in (tokens, mask, *floats.values()))
  base_same = False
  if on_device:
    last = _last_checked
    base_same = (
      last is not None and last[0]() is tokens and last[1]() is mask and last[2] == vocab_size
    )
    if base_same and all(k in last[3] and last[3][k]() is v for k, v in floats.items()):
      return
    numbers = _distributed.to_host(_device_summary(tokens, mask, floats))
  else:
    numbers = _summary(np, np.asarray(tokens), np.asarray(mask), _as_numpy(floats))
  _raise_on_bad_values(
    [int(v) for v in numbers],
    {k: np.ndim(floats[k]) for k in sorted(floats)},
    int(np.shape(tokens)[1]),
    vocab_size,
  )
  if isinstance(tokens, jax.Array) and isinstance(mask, jax.Array):
    done = {k: weakref.ref(v) for k, v in floats.items() if isinstance(v, jax.Array)}
    if base_same:
      done = {k: r for k, r in _last_checked[3].items() if r() is not None} | done
    _last_checked = (weakref.ref(tokens), weakref.ref(mask), vocab_size, done)


# Float keys whose values are log-probabilities (must be <= LOGP_TOLERANCE on
# loss tokens), and the slack allowed for rounding.
LOGP_KEYS = ("old_logp", "rollout_logp", "ref_logp")
LOGP_TOLERANCE = 1e-6

# (weak references to the last device tokens and loss_mask found valid, its
# vocab_size, {float key: weak reference to its array found valid with them})
_last_checked: tuple[weakref.ref, weakref.ref, int, dict[str, weakref.ref]] | None = None


def _as_numpy(floats: dict[str, Any]) -> dict[str, np.ndarray]:
  return {k: np.asarray(v) for k, v in floats.items()}


def _summary(xp: Any, tokens: Any, mask: Any, floats: dict[str, Any]) -> Any:
  """int32 [3 + 2 per float key (+ 2 per log-prob key)] of counts and first flat indices.

  `xp` is numpy (host arrays) or jax.numpy (inside `_device_summary`); float
  keys in sorted order, each: (number non-finite, first index), and for log-prob
  keys also (number > LOGP_TOLERANCE, first index), on loss tokens.
  """
  on = mask != 0
  rows_on = xp.any(on, axis=1)
  out = [xp.min(tokens), xp.max(tokens), xp.sum((mask != 0) & (mask != 1))]

  def count_and_first(bad):
    flat = bad.reshape(-1)
    return [xp.sum(flat), xp.where(xp.any(flat), xp.argmax(flat), -1)]

  for key in sorted(floats):
    x = floats[key]
    selected = on if x.ndim == 2 else rows_on
    out += count_and_first(selected & ~xp.isfinite(x))
    if key in LOGP_KEYS:
      out += count_and_first(selected & (x > LOGP_TOLERANCE))
  return xp.stack([xp.asarray(v).astype(xp.int64 if xp is np else xp.int32) for v in out])


@jax.jit
def _device_summary(tokens: jax.Array, mask: jax.Array, floats: dict[str, jax.Array]) -> jax.Array:
  return _summary(jnp, jnp.asarray(tokens), jnp.asarray(mask), floats)


def _raise_on_bad_values(
  numbers: list[int], float_ndims: dict[str, int], seq_len: int, vocab_size: int
) -> None:
  """Raises for the first bad value `_summary` counted; `float_ndims` in sorted key order."""
  low, high, non_binary, *rest = numbers
  if low < 0 or high >= vocab_size:
    raise ValueError(
      f"`batch['tokens']` ids must be in [0, vocab_size={vocab_size}), got min {low} and max "
      f"{high} (pad with a valid id such as 0; -1 or ids >= vocab_size would silently train on "
      "another token or give NaN under jit)."
    )
  if non_binary:
    raise ValueError(
      f"`batch['loss_mask']` must be bool or 0/1, got {non_binary} other value(s) (a "
      "fractional mask would count as 1; per-token weights are not a mask)."
    )
  for key, ndim in float_ndims.items():
    count, first, *rest = rest
    where = f"[{first // seq_len}, {first % seq_len}]" if ndim == 2 else f"row {first}"
    if count:
      raise ValueError(
        f"`batch['{key}']` must be finite on loss tokens (loss_mask != 0), got {count} "
        f"non-finite value(s), the first at {where} (NaN or inf on one loss token "
        "would make the loss non-finite and skip the whole update; padding may hold any value)."
      )
    if key in LOGP_KEYS:
      count, first, *rest = rest
      where = f"[{first // seq_len}, {first % seq_len}]"
      if count:
        raise ValueError(
          f"`batch['{key}']` is a log-probability and must be <= 0 on loss tokens "
          f"(loss_mask != 0), got {count} positive value(s) (> {LOGP_TOLERANCE:g}), the first "
          f"at {where}."
        )
