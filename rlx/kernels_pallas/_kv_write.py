"""Paged KV write: scatter new keys/values into the page pool, quantizing to the page dtype.

Token t of sequence b, at absolute position `pos = positions[b] + t`, is stored
in page `page_table[b, pos // page_size]`, row `pos % page_size`, as

  k_pages[g, page, row] = saturate(k_new[b, g, t] / k_scale[g])   (cast to the page dtype)

which is the inverse of the read convention `K = k_pages.astype(f32) * k_scale`
used by `paged_attention`. FP8 values saturate at the format's max (448 for
e4m3fn) instead of overflowing to inf/NaN (REFERENCE.md "FP8 rollout": KV scale
= amax / headroom). A pure-jnp scatter: writing one token per sequence per
decode step is tiny next to the attention read.
"""

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from rlx.kernels_pallas._fp8_quant import is_fp8, saturating_cast


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


def write_kv_pages(
  k_pages: Float[Array, "Hkv P page D"],
  v_pages: Float[Array, "Hkv P page D"],
  k_new: Float[Array, "B Hkv *T D"],
  v_new: Float[Array, "B Hkv *T D"],
  positions: Int[Array, " B"],
  page_table: Int[Array, "B pages_per_sequence"],
  *,
  num_new: Int[Array, " B"] | None = None,
  k_scale: Float[Array, "..."] | None = None,
  v_scale: Float[Array, "..."] | None = None,
) -> tuple[Float[Array, "Hkv P page D"], Float[Array, "Hkv P page D"]]:
  """Writes one decode step (or a prefill chunk) of K/V into the paged pool.

  `k_pages[g, page_table[b, p // page], p % page] = saturate(k_new[b, g, t] / k_scale[g])`
  for `p = positions[b] + t`, `t < num_new[b]` (same for V). Reference: vLLM
  `reshape_and_cache` (PagedAttention, arXiv:2309.06180), FP8 KV with per-tensor
  or per-head scales.

  Args:
    k_pages: `[Hkv, P, page_size, D]` pool (bf16, f32, float8_e4m3fn, float8_e5m2).
    v_pages: same shape and dtype as `k_pages`.
    k_new: `[B, Hkv, D]` (one decode token per sequence) or `[B, Hkv, T, D]`
      (a chunk of T tokens per sequence), any float dtype.
    v_new: same shape as `k_new`.
    positions: i32`[B]`, absolute position of the first new token of each
      sequence (for decode: the sequence length before the append).
    page_table: i32`[B, pages_per_sequence]`; the pages covering the written
      positions must already be allocated (entries in [0, P)).
    num_new: optional i32`[B]`, how many of the T tokens of each sequence are real
      (0 <= num_new <= T); the rest are not written. Default: all T.
    k_scale: float32 scalar or `[Hkv]`; required for FP8 pages, None means 1.
    v_scale: same for V.

  Returns:
    `(k_pages, v_pages)` updated (functional update; donate the pools under jit
    to update them in place).

  Positions and page indices are checked when concrete (eagerly). Under `jit`
  they cannot be: a write past `pages_per_sequence * page_size` or to a page
  index outside [0, P) is dropped (scatter mode "drop"), never wrapped.
  Two sequences writing the same (page, row) in one call is undefined.
  """
  for name, x, ranks in (
    ("k_pages", k_pages, (4,)),
    ("v_pages", v_pages, (4,)),
    ("k_new", k_new, (3, 4)),
    ("v_new", v_new, (3, 4)),
    ("positions", positions, (1,)),
    ("page_table", page_table, (2,)),
  ):
    if np.ndim(x) not in ranks:
      raise ValueError(f"`{name}` must have rank in {ranks}, got shape {tuple(np.shape(x))}.")
  if v_pages.shape != k_pages.shape or v_pages.dtype != k_pages.dtype:
    raise ValueError(
      f"`v_pages` {v_pages.dtype}{tuple(v_pages.shape)} must match `k_pages` "
      f"{k_pages.dtype}{tuple(k_pages.shape)}."
    )
  if v_new.shape != k_new.shape:
    raise ValueError(f"`v_new` shape {v_new.shape} must equal `k_new` shape {k_new.shape}.")
  num_kv_heads, total_pages, page_size, head_dim = k_pages.shape
  decode = k_new.ndim == 3
  if decode:
    k_new, v_new = k_new[:, :, None], v_new[:, :, None]
  batch, hkv, num_tokens, d = k_new.shape
  if hkv != num_kv_heads or d != head_dim:
    raise ValueError(
      f"`k_new` must be [B, Hkv={num_kv_heads}, (T,) D={head_dim}], got {tuple(k_new.shape)}."
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
  k_scale = _check_scale(k_scale, num_kv_heads, "k_scale", k_pages.dtype)
  v_scale = _check_scale(v_scale, num_kv_heads, "v_scale", k_pages.dtype)

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

  return _scatter(k_pages, v_pages, k_new, v_new, positions, page_table, num_new, k_scale, v_scale)


@jax.jit
def _scatter(k_pages, v_pages, k_new, v_new, positions, page_table, num_new, k_scale, v_scale):
  """The scatter itself (inputs validated): [B, Hkv, T, D] tokens into the pools."""
  _, total_pages, page_size, _ = k_pages.shape
  num_tokens = k_new.shape[2]
  capacity = page_table.shape[1] * page_size
  t = jnp.arange(num_tokens, dtype=jnp.int32)
  pos = positions.astype(jnp.int32)[:, None] + t[None, :]  # [B, T]
  real = (t[None, :] < num_new.astype(jnp.int32)[:, None]) & (pos >= 0) & (pos < capacity)
  slot = jnp.clip(pos // page_size, 0, page_table.shape[1] - 1)
  page = jnp.take_along_axis(page_table.astype(jnp.int32), slot, axis=1)
  page = jnp.where(real & (page >= 0) & (page < total_pages), page, total_pages)  # OOB -> drop
  row = pos % page_size

  def write(pages, new, scale):
    vals = new.astype(jnp.float32) / scale[None, :, None, None]  # [B, Hkv, T, D]
    vals = saturating_cast(vals, pages.dtype).transpose(1, 0, 2, 3)  # [Hkv, B, T, D]
    return pages.at[:, page, row].set(vals, mode="drop")

  return write(k_pages, k_new, k_scale), write(v_pages, v_new, v_scale)
