"""Paged prefill attention: a chunk of new tokens per row over the row's cached pages and itself.

Chunked prefill (Agrawal et al. 2023, Sarathi, https://arxiv.org/abs/2308.16369;
vLLM's chunked prefill over PagedAttention, https://arxiv.org/abs/2309.06180):
row b's chunk holds the tokens at positions `start[b] + [0, num_new[b])`; its
query c attends to the row's cached positions `[0, start[b])`, read from its
pages, and causally to the chunk's own tokens c' <= c, c' < num_new[b]. The
chunk's own K/V come from `k` / `v` rounded through the page dtype and scales
exactly as `write_kv_pages` stores them (the values a later page read returns),
so the chunk may be written to the pages before or after this call.

XLA ops only (this runs once per prompt chunk, not per decode step): the cached
part is one `gather_pages` of the rows' page tables under a `lax.cond` that
skips it when no row of the call starts past 0 (a single-chunk prompt never
does), merged with the chunk's own part by a log-sum-exp; float32 softmax,
masked logits set to the decode kernels' finite `MASK_VALUE`.
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jaxtyping import Array, Float, Int

from rlx.kernels_pallas._common import (
  MASK_VALUE,
  check_kv_scale_pair,
  gather_pages,
  gather_token_scales,
  is_concrete,
)
from rlx.kernels_pallas._fp8_quant import saturating_cast
from rlx.kernels_pallas._kv_write import quantize_per_token
from rlx.kernels_pallas._paged_attention import PAGE_DTYPES, Q_DTYPES


def _as_stored(x, scale, page_dtype):
  """What a page read returns for `x` [B, C, Hkv, D] written with `write_kv_pages` (f32).

  With per-token scales (`scale.ndim > 1`), what `write_kv_pages_per_token` stores.
  """
  if scale.ndim > 1:
    vals, token_scale = quantize_per_token(x, page_dtype)
    return vals.astype(jnp.float32) * token_scale[..., None]
  scale = scale[None, None, :, None]
  return saturating_cast(x.astype(jnp.float32) / scale, page_dtype).astype(jnp.float32) * scale


def _own_mask(c: int, num_new):
  """bool[B, C, C]: query c sees chunk token c' <= c with c' < num_new[b]."""
  ci = jnp.arange(c, dtype=jnp.int32)
  return (ci[None, :] <= ci[:, None])[None] & (ci[None, None, :] < num_new[:, None, None])


# ------------------------------------------------------------------------------------------
# XLA implementation
# ------------------------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("sm_scale",))
def _prefill_attention_xla(
  q, k, v, k_pages, v_pages, start, num_new, page_table, k_scale, v_scale, layer, *, sm_scale
):
  """Inputs validated; pools stacked `[L, Hkv, P, page, D]`; scales f32[Hkv] or per-token."""
  b, c, h, d = q.shape
  hkv = k.shape[2]
  group = h // hkv
  hp = lax.Precision.HIGHEST
  kc = _as_stored(k, k_scale, k_pages.dtype)  # [B, C, Hkv, D]
  vc = _as_stored(v, v_scale, k_pages.dtype)
  qg = q.astype(jnp.float32).reshape(b, c, hkv, group, d) * np.float32(sm_scale)
  own_ok = _own_mask(c, num_new)
  s_own = jnp.einsum("bchgd,bkhd->bhgck", qg, kc, precision=hp)  # [B, Hkv, G, C, C]
  s_own = jnp.where(own_ok[:, None, None], s_own, MASK_VALUE)
  m_own = s_own.max(axis=-1)

  def cached(_):
    total_pages, page_size = k_pages.shape[2], k_pages.shape[3]
    table = jnp.clip(page_table, 0, total_pages - 1)
    capacity = table.shape[1] * page_size
    ok = jnp.arange(capacity, dtype=jnp.int32)[None, :] < start[:, None]  # [B, cap]

    def gather(pages, scale):  # [B, Hkv, cap, D], zero past start
      x = gather_pages(pages, layer, table).astype(jnp.float32)
      if scale.ndim > 1:  # per-token [L, Hkv, P, page]
        x = x * gather_token_scales(scale, layer, table)[..., None]
      else:
        x = x * scale[None, :, None, None]
      return jnp.where(ok[:, None, :, None], x, 0.0)

    kk, vv = gather(k_pages, k_scale), gather(v_pages, v_scale)
    sc = jnp.einsum("bchgd,bhld->bhgcl", qg, kk, precision=hp)
    sc = jnp.where(ok[:, None, None, None], sc, MASK_VALUE)
    m = sc.max(axis=-1)
    p = jnp.where(ok[:, None, None, None], jnp.exp(sc - m[..., None]), 0.0)
    return m, p.sum(axis=-1), jnp.einsum("bhgcl,bhld->bhgcd", p, vv, precision=hp)

  def nothing(_):
    shape = (b, hkv, group, c)
    return (
      jnp.full(shape, MASK_VALUE, jnp.float32),
      jnp.zeros(shape, jnp.float32),
      jnp.zeros((*shape, d), jnp.float32),
    )

  m_c, l_c, acc_c = lax.cond(jnp.any(start > 0), cached, nothing, None)
  m = jnp.maximum(m_own, m_c)
  p_own = jnp.where(own_ok[:, None, None], jnp.exp(s_own - m[..., None]), 0.0)
  w_c = jnp.exp(m_c - m)
  denom = p_own.sum(axis=-1) + l_c * w_c
  acc = jnp.einsum("bhgck,bkhd->bhgcd", p_own, vc, precision=hp) + acc_c * w_c[..., None]
  out = jnp.where(denom[..., None] > 0, acc / jnp.where(denom > 0, denom, 1.0)[..., None], 0.0)
  return out.transpose(0, 3, 1, 2, 4).reshape(b, c, h, d).astype(q.dtype)


# ------------------------------------------------------------------------------------------
# Public wrapper: validation
# ------------------------------------------------------------------------------------------


def _check_array(x, name: str, rank: int):
  if not hasattr(x, "shape") or not hasattr(x, "dtype"):
    raise ValueError(f"`{name}` must be an array, got {type(x).__name__}.")
  if x.ndim != rank:
    raise ValueError(f"`{name}` must have rank {rank}, got shape {tuple(x.shape)}.")


def validate_paged_prefill_inputs(
  q, k, v, k_pages, v_pages, start, num_new, page_table, *, layer, sm_scale, k_scale, v_scale
):
  """Checks shapes, dtypes and (when concrete) positions; shared by the wrapper and reference.

  Returns:
    `(k_pages, v_pages, layer, sm_scale, k_scale, v_scale)`: pools stacked
    `[L, Hkv, P, page, D]` (a `[Hkv, P, page, D]` pool gets L = 1), `layer` an
    int32 scalar, `sm_scale` a Python float, scales float32 `[Hkv]`, or both
    per-token `[L, Hkv, P, page]` (stacked like the pools).

  Raises:
    ValueError naming the offending argument.
  """
  pool_rank = 4 if layer is None else 5
  for name, x, rank in (
    ("q", q, 4), ("k", k, 4), ("v", v, 4), ("k_pages", k_pages, pool_rank),
    ("v_pages", v_pages, pool_rank), ("start", start, 1), ("num_new", num_new, 1),
    ("page_table", page_table, 2),
  ):  # fmt: skip
    _check_array(x, name, rank)
  if layer is None:
    k_pages, v_pages, layer = k_pages[None], v_pages[None], 0
    if np.ndim(k_scale) > 1 and np.ndim(v_scale) > 1:  # per-token [Hkv, P, page]
      k_scale, v_scale = k_scale[None], v_scale[None]
  if np.ndim(layer) != 0 or not jnp.issubdtype(jnp.result_type(layer), jnp.integer):
    raise ValueError(f"`layer` must be an integer scalar or None, got {layer!r}.")
  if is_concrete(layer) and not 0 <= int(layer) < k_pages.shape[0]:
    raise ValueError(f"`layer` must be in [0, L={k_pages.shape[0]}), got {int(layer)}.")
  b, c, h, d = q.shape
  _, hkv, total_pages, page_size, d_pages = k_pages.shape
  if 0 in q.shape or hkv == 0 or total_pages == 0 or page_size == 0:
    raise ValueError(f"Empty `q` {tuple(q.shape)} or page pool {tuple(k_pages.shape)}.")
  if k.shape != (b, c, hkv, d) or v.shape != k.shape:
    raise ValueError(
      f"`k` and `v` must have shape [B, C, Hkv, D] = {(b, c, hkv, d)}, got "
      f"{tuple(k.shape)} and {tuple(v.shape)}."
    )
  if h % hkv:
    raise ValueError(f"Query heads H={h} (q axis 2) must be a multiple of KV heads Hkv={hkv}.")
  if v_pages.shape != k_pages.shape or d_pages != d:
    raise ValueError(
      f"`k_pages` / `v_pages` must both be [..., Hkv, P, page, D={d}], got "
      f"{tuple(k_pages.shape)} and {tuple(v_pages.shape)}."
    )
  if jnp.dtype(q.dtype) not in Q_DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
    raise ValueError(f"`q`, `k`, `v` must share a bfloat16 or float32 dtype, got {q.dtype}.")
  if jnp.dtype(k_pages.dtype) not in PAGE_DTYPES or v_pages.dtype != k_pages.dtype:
    raise ValueError(f"`k_pages` / `v_pages` dtype must be one of {PAGE_DTYPES}.")
  for name, x in (("start", start), ("num_new", num_new)):
    if x.shape != (b,) or x.dtype != jnp.int32:
      raise ValueError(f"`{name}` must be int32 with shape ({b},), got {x.dtype}{x.shape}.")
  if page_table.shape[0] != b or page_table.dtype != jnp.int32:
    raise ValueError(
      f"`page_table` must be int32 [B={b}, pages_per_sequence], got "
      f"{page_table.dtype}{tuple(page_table.shape)}."
    )
  capacity = page_table.shape[1] * page_size
  if is_concrete(start) and is_concrete(num_new):
    s, n = np.asarray(start), np.asarray(num_new)
    bad = np.nonzero((s < 0) | (n < 0) | (n > c) | (s + n > capacity))[0]
    if bad.size:
      raise ValueError(
        f"Row {bad[0]}: need start >= 0, 0 <= num_new <= C={c} and start + num_new <= "
        f"capacity={capacity}; got `start`={s[bad[0]]}, `num_new`={n[bad[0]]}."
      )
  if sm_scale is None:
    sm_scale = 1.0 / math.sqrt(d)
  elif isinstance(sm_scale, bool) or not isinstance(sm_scale, int | float | np.floating):
    raise ValueError(f"`sm_scale` must be a Python float or None, got {sm_scale!r}.")
  k_scale, v_scale = check_kv_scale_pair(k_scale, v_scale, hkv, k_pages.dtype, k_pages.shape)
  return k_pages, v_pages, jnp.asarray(layer, jnp.int32), float(sm_scale), k_scale, v_scale


def paged_prefill_attention(
  q: Float[Array, "B C H D"],
  k: Float[Array, "B C Hkv D"],
  v: Float[Array, "B C Hkv D"],
  k_pages: Float[Array, "... Hkv P page D"],
  v_pages: Float[Array, "... Hkv P page D"],
  start: Int[Array, " B"],
  num_new: Int[Array, " B"],
  page_table: Int[Array, "B pages_per_sequence"],
  *,
  sm_scale: float | None = None,
  k_scale: Float[Array, "..."] | None = None,
  v_scale: Float[Array, "..."] | None = None,
  layer: int | Int[Array, ""] | None = None,
) -> Float[Array, "B C H D"]:
  """Causal grouped-query attention of a chunk over its row's cached pages and itself.

  For row b, query c (position start[b] + c), query head h (KV head g = h // (H / Hkv)):

    keys:  K[t] = k_pages[g, page_table[b, t // page], t % page] * k_scale[g], t < start[b]
           (k_scale[g, page, row] with per-token scales)
           K[start[b] + c'] = round_page(k[b, c', g] / k_scale[g]) * k_scale[g],
                              c' <= c, c' < num_new[b]                     (same for V)
    out[b, c, h] = sum_t softmax_t(sm_scale * q[b, c, h] . K[t]) V[t]

  where round_page is the cast to the page dtype that `write_kv_pages` applies.
  Queries c >= num_new[b] (padding) see the cached keys and the real chunk
  tokens; a row with start = num_new = 0 yields zeros. Positions >= start[b]
  of the cached part are masked with `where` before any dot (stale page
  contents never reach the output). Scales are traced arrays.

  Args:
    q: `[B, C, H, D]` bfloat16 or float32 chunk queries.
    k: `[B, C, Hkv, D]` the chunk's keys (q's dtype).
    v: `[B, C, Hkv, D]` the chunk's values.
    k_pages: `[Hkv, P, page_size, D]` key pool, or stacked `[L, Hkv, P, page_size, D]`
      with `layer`; bfloat16, float32 or FP8.
    v_pages: value pool, same shape and dtype.
    start: i32`[B]`, cached tokens of each row (its chunk's first position).
    num_new: i32`[B]` in [0, C], real tokens of each row's chunk.
    page_table: i32`[B, pages_per_sequence]`; entries past a row's cached pages are
      ignored (out-of-range entries are clamped).
    sm_scale: softmax scale (Python float); None means 1/sqrt(D).
    k_scale: float32 scalar or `[Hkv]` (required for FP8 pages; None means 1), or
      per-token scales of the pool's shape without D (`[Hkv, P, page_size]`, or
      `[L, Hkv, P, page_size]` with `layer`), as `write_kv_pages_per_token` writes
      them; the chunk's own K/V are then rounded with their own per-token scales.
    v_scale: same for V (the same kind as `k_scale`).
    layer: None for `[Hkv, P, page, D]` pools, else the layer of stacked pools (int
      or traced int32 scalar): its pages are gathered straight from the stack.

  Returns:
    `[B, C, H, D]` in q's dtype.
  """
  k_pages, v_pages, layer, sm_scale, k_scale, v_scale = validate_paged_prefill_inputs(
    q, k, v, k_pages, v_pages, start, num_new, page_table, layer=layer, sm_scale=sm_scale,
    k_scale=k_scale, v_scale=v_scale,
  )  # fmt: skip
  return _prefill_attention_xla(
    q, k, v, k_pages, v_pages, start, num_new, page_table, k_scale, v_scale, layer,
    sm_scale=sm_scale,
  )  # fmt: skip


# ------------------------------------------------------------------------------------------
# Reference
# ------------------------------------------------------------------------------------------


def paged_prefill_attention_reference(
  q: Float[Array, "B C H D"],
  k: Float[Array, "B C Hkv D"],
  v: Float[Array, "B C Hkv D"],
  k_pages: Float[Array, "... Hkv P page D"],
  v_pages: Float[Array, "... Hkv P page D"],
  start: Int[Array, " B"],
  num_new: Int[Array, " B"],
  page_table: Int[Array, "B pages_per_sequence"],
  *,
  sm_scale: float | None = None,
  k_scale: Float[Array, "..."] | None = None,
  v_scale: Float[Array, "..."] | None = None,
  layer: int | Int[Array, ""] | None = None,
) -> Float[Array, "B C H D"]:
  """Pure-jnp float32 reference of `paged_prefill_attention` (same formula, same validator).

  Builds every row's dense key/value sequence: the cached `[0, capacity)`
  positions gathered from its pages by plain indexing, then the chunk's own
  (rounded) K/V; one masked softmax over both. Not for production: it
  materialises the dense cache.

  Returns:
    float32 `[B, C, H, D]`.
  """
  k_pages, v_pages, layer, sm_scale, k_scale, v_scale = validate_paged_prefill_inputs(
    q, k, v, k_pages, v_pages, start, num_new, page_table, layer=layer, sm_scale=sm_scale,
    k_scale=k_scale, v_scale=v_scale,
  )  # fmt: skip
  b, c, h, d = q.shape
  hkv = k.shape[2]
  total_pages, page_size = k_pages.shape[2], k_pages.shape[3]
  capacity = page_table.shape[1] * page_size
  table = jnp.clip(page_table, 0, total_pages - 1)
  cached_ok = jnp.arange(capacity)[None, :] < start[:, None]  # [B, cap]

  def dense(pages, new, scale):  # [B, capacity + C, Hkv, D]; zero where not cached
    cached = pages[layer][:, table].astype(jnp.float32)  # [Hkv, B, pps, page, D]
    if scale.ndim > 1:  # per-token [L, Hkv, P, page]
      cached = cached * scale[layer][:, table][..., None]
    else:
      cached = cached * scale[:, None, None, None, None]
    cached = cached.reshape(hkv, b, capacity, d).transpose(1, 2, 0, 3)
    cached = jnp.where(cached_ok[:, :, None, None], cached, 0.0)
    return jnp.concatenate([cached, _as_stored(new, scale, pages.dtype)], axis=1)

  keys, values = dense(k_pages, k, k_scale), dense(v_pages, v, v_scale)
  cached_ok = jnp.broadcast_to(cached_ok[:, None, :], (b, c, capacity))
  valid = jnp.concatenate([cached_ok, _own_mask(c, num_new)], axis=2)  # [B, C, cap + C]
  qf = q.astype(jnp.float32).reshape(b, c, hkv, h // hkv, d)
  hp = lax.Precision.HIGHEST
  logits = jnp.einsum("bchgd,bthd->bhgct", qf, keys, precision=hp) * sm_scale
  logits = jnp.where(valid[:, None, None], logits, -jnp.inf)
  any_valid = valid.any(axis=-1)[:, None, None, :, None]
  probs = jnp.where(any_valid, jax.nn.softmax(jnp.where(any_valid, logits, 0.0), axis=-1), 0.0)
  out = jnp.einsum("bhgct,bthd->bhgcd", probs, values, precision=hp)
  return out.transpose(0, 3, 1, 2, 4).reshape(b, c, h, d)
