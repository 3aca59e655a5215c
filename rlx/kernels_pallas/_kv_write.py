"""Paged KV write: scatter new keys/values into the page pool, quantizing to the page dtype.

Token t of sequence b, at absolute position `pos = positions[b] + t`, is stored
in page `page_table[b, pos // page_size]`, row `pos % page_size`, as

  k_pages[g, page, row] = saturate(k_new[b, t, g] / k_scale[g])   (cast to the page dtype)

which is the inverse of the read convention `K = k_pages.astype(f32) * k_scale`
used by `paged_attention`. FP8 values saturate at the format's max (448 for
e4m3fn) instead of overflowing to inf/NaN (KV scale = amax / headroom, as in
vLLM's FP8 KV cache). `write_kv_pages_per_token` instead gives every token and
KV head its own scale, `amax_d |k_new[b, t, g, :]| / fp8_max`, stored beside
the pages in a float32 pool of the pages' shape without D: each token's
largest element lands exactly on the format's max, nothing saturates and no
calibration is needed (dynamic per-token KV quantization, as KIVI's per-token
value quantization, https://arxiv.org/abs/2402.02750, and TensorRT-LLM's FP8
KV cache do it). A pure-jnp scatter: writing one token per sequence per
decode step is tiny next to the attention read.
"""

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from rlx.kernels_pallas._fp8_quant import fp8_max, is_fp8, saturating_cast

# Smallest amax turned into a per-token scale (an all-zero token gets a tiny positive scale).
_MIN_TOKEN_AMAX = 1e-10


def _check_scale(s, num_kv_heads: int, name: str, page_dtype):
  if s is None:
    if is_fp8(page_dtype):
      raise ValueError(f"`{name}` is required for FP8 pages ({page_dtype}).")
    return jnp.ones((num_kv_heads,), jnp.float32)
  s = jnp.asarray(s)
  if s.shape not in ((), (1,), (num_kv_heads,)):
    raise ValueError(
      f"`{name}` must be a scalar or have shape ({num_kv_heads},), got {tuple(s.shape)}."
    )
  return jnp.broadcast_to(s.astype(jnp.float32).reshape(-1), (num_kv_heads,))


def _validate(k_pages, v_pages, k_new, v_new, positions, page_table, num_new, layer):
  """Checks a write's arguments; returns `(k_new, v_new, num_new)` as `[B, T, Hkv, D]`, i32[B]."""
  stacked = layer is not None
  pool_rank = 5 if stacked else 4
  for name, x, ranks in (
    ("k_pages", k_pages, (pool_rank,)),
    ("v_pages", v_pages, (pool_rank,)),
    ("k_new", k_new, (3, 4)),
    ("v_new", v_new, (3, 4)),
    ("positions", positions, (1,)),
    ("page_table", page_table, (2,)),
  ):
    if np.ndim(x) not in ranks:
      what = " (a stacked [L, Hkv, P, page, D] pool, since `layer` is given)" if stacked else ""
      raise ValueError(f"`{name}` must have rank in {ranks}{what}, got shape {tuple(np.shape(x))}.")
  if v_pages.shape != k_pages.shape or v_pages.dtype != k_pages.dtype:
    raise ValueError(
      f"`v_pages` {v_pages.dtype}{tuple(v_pages.shape)} must match `k_pages` "
      f"{k_pages.dtype}{tuple(k_pages.shape)}."
    )
  if v_new.shape != k_new.shape:
    raise ValueError(f"`v_new` shape {v_new.shape} must equal `k_new` shape {k_new.shape}.")
  num_kv_heads, total_pages, page_size, head_dim = k_pages.shape[-4:]
  if stacked:
    if np.ndim(layer) != 0 or not jnp.issubdtype(jnp.result_type(layer), jnp.integer):
      raise ValueError(f"`layer` must be an integer scalar, got {layer!r}.")
    if not isinstance(layer, jax.core.Tracer) and not 0 <= int(layer) < k_pages.shape[0]:
      raise ValueError(f"`layer` must be in [0, L={k_pages.shape[0]}), got {int(layer)}.")
  if k_new.ndim == 3:
    k_new, v_new = k_new[:, None], v_new[:, None]
  batch, num_tokens, hkv, d = k_new.shape
  if hkv != num_kv_heads or d != head_dim:
    raise ValueError(
      f"`k_new` must be [B, (T,) Hkv={num_kv_heads}, D={head_dim}], got {tuple(k_new.shape)}."
    )
  if positions.shape != (batch,) or not jnp.issubdtype(positions.dtype, jnp.integer):
    raise ValueError(
      f"`positions` must be integer [{batch}], got {positions.dtype}{positions.shape}."
    )
  if page_table.shape[0] != batch or not jnp.issubdtype(page_table.dtype, jnp.integer):
    raise ValueError(
      f"`page_table` must be integer [B={batch}, pages_per_sequence], got "
      f"{page_table.dtype}{tuple(page_table.shape)}."
    )
  if num_new is None:
    num_new = jnp.full((batch,), num_tokens, jnp.int32)
  elif np.shape(num_new) != (batch,) or not jnp.issubdtype(jnp.result_type(num_new), jnp.integer):
    raise ValueError(
      f"`num_new` must be integer with shape ({batch},), got "
      f"{jnp.result_type(num_new)}{tuple(np.shape(num_new))}."
    )
  capacity = page_table.shape[1] * page_size

  concrete = not any(isinstance(x, jax.core.Tracer) for x in (positions, page_table, num_new))
  if concrete:
    pv, tv, nv = np.asarray(positions), np.asarray(page_table), np.asarray(num_new)
    if ((nv < 0) | (nv > num_tokens)).any():
      raise ValueError(f"`num_new` must be in [0, T={num_tokens}], got {nv}.")
    if (pv < 0).any() or ((pv + nv > capacity) & (nv > 0)).any():
      raise ValueError(
        f"Writes must stay within [0, capacity={capacity}): positions {pv}, num_new {nv}."
      )
    for b in range(batch):
      if nv[b] == 0:
        continue
      pages = tv[b, pv[b] // page_size : (pv[b] + nv[b] - 1) // page_size + 1]
      if ((pages < 0) | (pages >= total_pages)).any():
        raise ValueError(f"`page_table[{b}]` has pages outside [0, {total_pages}) where written.")

  return k_new, v_new, num_new


def write_kv_pages(
  k_pages: Float[Array, "*L Hkv P page D"],
  v_pages: Float[Array, "*L Hkv P page D"],
  k_new: Float[Array, "B *T Hkv D"],
  v_new: Float[Array, "B *T Hkv D"],
  positions: Int[Array, " B"],
  page_table: Int[Array, "B pages_per_sequence"],
  *,
  num_new: Int[Array, " B"] | None = None,
  k_scale: Float[Array, "..."] | None = None,
  v_scale: Float[Array, "..."] | None = None,
  layer: int | Int[Array, ""] | None = None,
) -> tuple[Float[Array, "*L Hkv P page D"], Float[Array, "*L Hkv P page D"]]:
  """Writes one decode step (or a prefill chunk) of K/V into the paged pool.

  `k_pages[g, page_table[b, p // page], p % page] = saturate(k_new[b, t, g] / k_scale[g])`
  for `p = positions[b] + t`, `t < num_new[b]` (same for V). Reference: vLLM
  `reshape_and_cache` (PagedAttention, arXiv:2309.06180), FP8 KV with per-tensor
  or per-head scales.

  Layout: new K/V come in the layout of `rlx.policy.layer_qkv` (`[B, T, Hkv, D]`,
  or `[B, Hkv, D]` for one decode token, the same array without the T = 1 axis),
  and the write is one XLA scatter whose update windows are the `[Hkv, D]`
  rows, so no transpose is needed on either side. With `layer`, the pools are
  the stacked `[L, Hkv, P, page_size, D]` pools of a whole model and only layer
  `layer` is written (a scatter into the stacked buffer: under jit inside a
  loop whose carry holds the pool, XLA updates it in place; no per-layer copy).

  Args:
    k_pages: `[Hkv, P, page_size, D]` pool, or `[L, Hkv, P, page_size, D]` with
      `layer` (bf16, f32, float8_e4m3fn, float8_e5m2).
    v_pages: same shape and dtype as `k_pages`.
    k_new: `[B, Hkv, D]` (one decode token per sequence) or `[B, T, Hkv, D]`
      (a chunk of T tokens per sequence), any float dtype.
    v_new: same shape as `k_new`.
    positions: i32`[B]`, absolute position of the first new token of each
      sequence (for decode: the sequence length before the append).
    page_table: i32`[B, pages_per_sequence]`; the pages covering the written
      positions must already be allocated (entries in [0, P)).
    num_new: optional i32`[B]`, how many of the T tokens of each sequence are real
      (0 <= num_new <= T); the rest are not written. Default: all T.
    k_scale: float32 scalar or `[Hkv]` (of the written layer); required for FP8
      pages, None means 1.
    v_scale: same for V.
    layer: None for a `[Hkv, P, page, D]` pool; else the layer (int or traced
      int32 scalar, in [0, L)) of a stacked `[L, Hkv, P, page, D]` pool.

  Returns:
    `(k_pages, v_pages)` updated (functional update; donate the pools under jit
    to update them in place).

  Positions and page indices are checked when concrete (eagerly). Under `jit`
  they cannot be: a write past `pages_per_sequence * page_size` or to a page
  index outside [0, P) is dropped (scatter mode "drop"), never wrapped.
  Two sequences writing the same (page, row) in one call is undefined.
  """
  k_new, v_new, num_new = _validate(
    k_pages, v_pages, k_new, v_new, positions, page_table, num_new, layer
  )
  num_kv_heads = k_pages.shape[-4]
  k_scale = _check_scale(k_scale, num_kv_heads, "k_scale", k_pages.dtype)
  v_scale = _check_scale(v_scale, num_kv_heads, "v_scale", k_pages.dtype)
  layer = jnp.asarray(0 if layer is None else layer, jnp.int32)
  return _scatter(
    k_pages, v_pages, k_new, v_new, positions, page_table, num_new, k_scale, v_scale, layer
  )


def _scatter_indices(page_shape, positions, page_table, num_new, num_tokens, layer):
  """Scatter indices `[B, T, 2 or 3]`: (layer,) page, row per token; dropped ones out of range."""
  stacked = len(page_shape) == 5
  total_pages, page_size = page_shape[-3:-1]
  capacity = page_table.shape[1] * page_size
  t = jnp.arange(num_tokens, dtype=jnp.int32)
  pos = positions.astype(jnp.int32)[:, None] + t[None, :]  # [B, T]
  real = (t[None, :] < num_new.astype(jnp.int32)[:, None]) & (pos >= 0) & (pos < capacity)
  slot = jnp.clip(pos // page_size, 0, page_table.shape[1] - 1)
  page = jnp.take_along_axis(page_table.astype(jnp.int32), slot, axis=1)
  page = jnp.where(real & (page >= 0) & (page < total_pages), page, total_pages)  # OOB -> drop
  index = [page, pos % page_size]
  if stacked:  # operand dims (layer, Hkv, P, page, D): scatter into (layer, P, page)
    index = [jnp.broadcast_to(layer, page.shape), page, pos % page_size]
  return jnp.stack(index, axis=-1)


def _scatter_dims(stacked: bool, window_dims: tuple[int, ...]):
  """Scatter of `[B, T, *window]` updates into (layer,) page, row of a `[(L,) Hkv, P, page, ...]`"""
  first = 1 if stacked else 0
  return jax.lax.ScatterDimensionNumbers(
    update_window_dims=window_dims,
    inserted_window_dims=((0,) if stacked else ()) + (first + 1, first + 2),
    scatter_dims_to_operand_dims=((0,) if stacked else ()) + (first + 1, first + 2),
  )


_DROP = jax.lax.GatherScatterMode.FILL_OR_DROP


@jax.jit
def _scatter(
  k_pages, v_pages, k_new, v_new, positions, page_table, num_new, k_scale, v_scale, layer
):
  """The scatter itself (inputs validated): [B, T, Hkv, D] tokens into the pools."""
  indices = _scatter_indices(k_pages.shape, positions, page_table, num_new, k_new.shape[1], layer)
  dims = _scatter_dims(k_pages.ndim == 5, (2, 3))  # updates [B, T, Hkv, D]: window (Hkv, D)

  def write(pages, new, scale):
    vals = saturating_cast(new.astype(jnp.float32) / scale[None, None, :, None], pages.dtype)
    return jax.lax.scatter(pages, indices, vals, dims, mode=_DROP)

  return write(k_pages, k_new, k_scale), write(v_pages, v_new, v_scale)


@jax.jit
def _scatter_per_token(
  k_pages, v_pages, k_scale, v_scale, k_new, v_new, positions, page_table, num_new, layer
):
  """Per-token quantization and scatter of [B, T, Hkv, D] tokens and their [B, T, Hkv] scales."""
  indices = _scatter_indices(k_pages.shape, positions, page_table, num_new, k_new.shape[1], layer)
  stacked = k_pages.ndim == 5
  page_dims, scale_dims = _scatter_dims(stacked, (2, 3)), _scatter_dims(stacked, (2,))

  def write(pages, scales, new):
    vals, scale = quantize_per_token(new, pages.dtype)  # [B, T, Hkv, D], [B, T, Hkv]
    pages = jax.lax.scatter(pages, indices, vals, page_dims, mode=_DROP)
    return pages, jax.lax.scatter(scales, indices, scale, scale_dims, mode=_DROP)

  (k_pages, k_scale), (v_pages, v_scale) = (
    write(k_pages, k_scale, k_new),
    write(v_pages, v_scale, v_new),
  )
  return k_pages, v_pages, k_scale, v_scale


def quantize_per_token(x: Float[Array, "... D"], dtype) -> tuple[Array, Array]:
  """`(x / scale, scale)` with `scale = max(amax_d |x|, 1e-10) / fp8_max(dtype)` per row.

  What `write_kv_pages_per_token` stores for a token (the values cast to
  `dtype`, the scales float32 of `x.shape[:-1]`).
  """
  x = x.astype(jnp.float32)
  scale = jnp.maximum(jnp.max(jnp.abs(x), axis=-1), _MIN_TOKEN_AMAX) / fp8_max(dtype)
  return saturating_cast(x / scale[..., None], dtype), scale


def write_kv_pages_per_token(
  k_pages: Float[Array, "*L Hkv P page D"],
  v_pages: Float[Array, "*L Hkv P page D"],
  k_scale: Float[Array, "*L Hkv P page"],
  v_scale: Float[Array, "*L Hkv P page"],
  k_new: Float[Array, "B *T Hkv D"],
  v_new: Float[Array, "B *T Hkv D"],
  positions: Int[Array, " B"],
  page_table: Int[Array, "B pages_per_sequence"],
  *,
  num_new: Int[Array, " B"] | None = None,
  layer: int | Int[Array, ""] | None = None,
) -> tuple[Array, Array, Array, Array]:
  """`write_kv_pages` with a dynamic FP8 scale per token and KV head, stored beside the pages.

  For each written token (b, t) and KV head g, at (page, row) as in
  `write_kv_pages`:

    k_scale[g, page, row] = max(amax_d |k_new[b, t, g, :]|, 1e-10) / fp8_max
    k_pages[g, page, row] = k_new[b, t, g] / k_scale[g, page, row]   (cast to FP8)

  (same for V), so `k_pages * k_scale` reads back each token with its largest
  element exact. `paged_attention` and `paged_prefill_attention` read such pools
  when given the scale pools as `k_scale` / `v_scale`.

  Args:
    k_pages, v_pages: FP8 (float8_e4m3fn or float8_e5m2) pools `[Hkv, P, page, D]`,
      or stacked `[L, Hkv, P, page, D]` with `layer`.
    k_scale, v_scale: float32 per-token scale pools, the pools' shape without D.
    k_new, v_new, positions, page_table, num_new, layer: as in `write_kv_pages`.

  Returns:
    `(k_pages, v_pages, k_scale, v_scale)` updated (donate them under jit to
    update them in place). Rows not written keep their scales.
  """
  k_new, v_new, num_new = _validate(
    k_pages, v_pages, k_new, v_new, positions, page_table, num_new, layer
  )
  if not is_fp8(k_pages.dtype):
    raise ValueError(
      f"Per-token KV scales need FP8 pages (float8_e4m3fn or float8_e5m2), got {k_pages.dtype}."
    )
  for name, sc in (("k_scale", k_scale), ("v_scale", v_scale)):
    if np.shape(sc) != k_pages.shape[:-1] or jnp.result_type(sc) != jnp.float32:
      raise ValueError(
        f"`{name}` must be float32 per-token scales of shape {tuple(k_pages.shape[:-1])} (the "
        f"pool's without D), got {jnp.result_type(sc)}{tuple(np.shape(sc))}."
      )
  layer = jnp.asarray(0 if layer is None else layer, jnp.int32)
  return _scatter_per_token(
    k_pages, v_pages, k_scale, v_scale, k_new, v_new, positions, page_table, num_new, layer
  )
