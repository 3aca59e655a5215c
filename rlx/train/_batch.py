"""The train batch contract: keys, shapes, divisibility, token-id range and a 0/1 mask.

`check_batch` reads only shapes and dtypes, so it runs at trace time inside a
jitted step as well as on host. `check_values` reads values and runs on host
before dispatch (under jit an id outside [0, vocab) would not raise: the
embedding lookup clamps or fills it and the step trains on a wrong token or
skips a NaN update).
"""

import weakref
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from rlx.train import _distributed, _placement

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


def check_batch(batch: Mapping[str, Any], cfg: ml_collections.ConfigDict, num_shards: int) -> None:
  """Validates keys, shapes and dtypes of a train batch (no values are read).

  Args:
    batch: the batch dict (see `make_train_step`).
    cfg: the train config.
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
  adv_shape = tuple(np.shape(batch["advantages"]))
  if adv_shape not in (shape, shape[:1]):
    raise ValueError(
      f"`advantages` must have shape [B, S] = {shape} or [B] = {shape[:1]}, got {adv_shape}."
    )
  parts = cfg.mini_batches * cfg.micro_batches * num_shards
  if shape[0] % parts:
    raise ValueError(
      f"Batch size {shape[0]} must be divisible by mini_batches ({cfg.mini_batches}) x "
      f"micro_batches ({cfg.micro_batches}) x data x fsdp ({num_shards}) = {parts}."
    )
  needs_rollout = cfg.use_rollout_correction or cfg.use_m2po or cfg.use_vcpo
  if needs_rollout and "rollout_logp" not in batch:
    raise ValueError("`rollout_logp` is required by use_rollout_correction / use_m2po / use_vcpo.")
  if cfg.kl_coef > 0 and "ref_logp" not in batch:
    raise ValueError("`ref_logp` is required when kl_coef > 0 (see compute_logprobs).")


def check_token_shaped(batch: Mapping[str, Any], keys: tuple[str, ...]) -> tuple[int, int]:
  """Checks `tokens` is a non-empty int `[B, S]` and each of `keys` in `batch` has its shape.

  Returns:
    The shape `(B, S)` of `tokens`.
  """
  tokens = batch["tokens"]
  shape = tuple(np.shape(tokens))
  dtype = getattr(tokens, "dtype", None) or np.asarray(tokens).dtype
  if len(shape) != 2 or not jnp.issubdtype(dtype, jnp.integer):
    raise ValueError(f"`tokens` must be an int array [B, S], got {dtype}{list(shape)}.")
  _placement.check_not_empty(shape, "batch['tokens']")
  for key in keys:
    if key in batch and tuple(np.shape(batch[key])) != shape:
      raise ValueError(
        f"`{key}` must have the shape of `tokens` {shape}, got {np.shape(batch[key])}."
      )
  return shape


def check_values(batch: Mapping[str, Any], vocab_size: int) -> None:
  """Raises ValueError if a token id is outside [0, vocab_size) or `loss_mask` is not 0/1.

  Under jit neither would raise: an id outside the vocabulary is clamped or
  filled by the embedding lookup (training on another token, or a NaN and a
  skipped update), and a mask value such as 0.5 would silently count as 1.

  Host (numpy) arrays are checked with numpy (free). Device arrays are
  checked by one small jitted reduction whose three numbers the host fetches:
  that waits until the device reaches it (after work already queued, e.g. the
  previous step) and gives every process of a multi-process run the same
  answer. The last device batch checked is remembered, so the same batch
  passed to `compute_logprobs` and then to the train step is reduced once.
  Pass host arrays, or trace `step_fn` in your own jit, to avoid the wait.
  Padding must use a valid id too (e.g. 0 or the pad id): every position goes
  through the embedding.

  Args:
    batch: dict with `tokens` (int `[B, S]`) and `loss_mask` (`[B, S]`).
    vocab_size: the policy's vocabulary size.
  """
  global _last_checked
  tokens, mask = batch["tokens"], batch["loss_mask"]
  key = (tokens, mask)
  if any(isinstance(x, jax.Array) for x in key):
    last = _last_checked
    same = last is not None and all(r() is x for r, x in zip(last[0], key, strict=True))
    if same and last[1] == vocab_size:
      return
    low, high, non_binary = (int(v) for v in _distributed.to_host(_summary(tokens, mask)))
  else:
    host_tokens, host_mask = np.asarray(tokens), np.asarray(mask)
    low, high = int(host_tokens.min()), int(host_tokens.max())
    non_binary = int(np.sum((host_mask != 0) & (host_mask != 1)))
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
  if all(isinstance(x, jax.Array) for x in key):
    _last_checked = (tuple(weakref.ref(x) for x in key), vocab_size)


# (weak references to the last device (tokens, loss_mask) found valid, its vocab_size)
_last_checked: tuple[tuple[weakref.ref, weakref.ref], int] | None = None


@jax.jit
def _summary(tokens: jax.Array, mask: jax.Array) -> jax.Array:
  mask = jnp.asarray(mask)
  non_binary = jnp.sum((mask != 0) & (mask != 1))
  return jnp.stack([jnp.min(tokens), jnp.max(tokens), non_binary]).astype(jnp.int32)
