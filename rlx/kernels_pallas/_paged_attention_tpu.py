"""Paged decode attention: the TPU (Pallas Mosaic) kernel.

Same formula as `paged_attention` in `_paged_attention.py` (which validates the
inputs, sanitizes the page table and dispatches here). The kernel is driven by a
`PrefetchScalarGridSpec`: `lengths` and the flattened page table are prefetched
into SMEM and used by the BlockSpec index maps, so every grid step
(sequence b, KV head h, page block j) DMAs `pages_per_compute_block` pages of K
and of V (one BlockSpec each) into VMEM while the previous step computes; the
pipeline double-buffers them. Blocks past a sequence's length map to its last
used page (so no new DMA is issued) and skip compute with `pl.when`. The online
softmax state (running max, denominator, accumulator) lives in VMEM scratch
across the sequential ("arbitrary") page axis; no split-K (one TensorCore walks
a sequence, the batch and head axes are "parallel" for megacore). The layout
follows JAX's `jax/experimental/pallas/ops/tpu/paged_attention` kernel
(PagedAttention, https://arxiv.org/abs/2309.06180).

Optional per-token scales (`token_scales=(k_token, v_token)`, f32
`[Hkv, P, page_size]`, one scale per stored KV row) multiply the per-head scales:
K[t] = k_pages[g, page, row] * k_scale[g] * k_token[g, page, row] (V likewise).
They are applied to the `[G, page]` logits and probabilities rather than to the
`[page, D]` K/V tiles, and DMA'd in tiles of 8 pages; see `paged_attention_tpu`.

Runs on CPU with `interpret=pltpu.InterpretParams()` (tests); the Mosaic
lowering is checked on CPU by `jax.export` (tests/kernels_pallas), and both the
per-head and the per-token variants compile with the TPU compiler for a
compile-only v5e device (tests/kernels_pallas/
test_kernels_paged_attention_tpu_token.py); not yet run on a TPU chip.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from rlx.kernels_pallas._common import MASK_VALUE


def _paged_attention_tpu_kernel(
  lengths_ref,  # SMEM i32[B] (scalar prefetch)
  page_table_ref,  # SMEM i32[B * pages_per_sequence] (scalar prefetch)
  scales_ref,  # SMEM f32[Hkv * 2]: (k_scale, v_scale) per KV head
  q_ref,  # VMEM [G, D]: query heads of this KV group
  *refs,  # k page refs ([page, D]) x ppcb, v page refs x ppcb, [with token scales:
  # k token-scale refs ([8, page] f32: the 8-page tile holding the page) x ppcb,
  # v token-scale refs x ppcb], o_ref [G, D] f32,
  # then scratch: m [G, 1] f32, l [G, 1] f32, acc [G, D] f32
  sm_scale: float,
  pages_per_compute_block: int,
  pages_per_sequence: int,
  num_blocks: int,
  dot_dtype,
  token_scales: bool,
):
  ppcb = pages_per_compute_block
  k_refs, v_refs = refs[:ppcb], refs[ppcb : 2 * ppcb]
  refs = refs[2 * ppcb :]
  if token_scales:
    ks_refs, vs_refs = refs[:ppcb], refs[ppcb : 2 * ppcb]
    refs = refs[2 * ppcb :]
  o_ref, m_ref, l_ref, acc_ref = refs
  b, h, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  group, head_dim = q_ref.shape
  page_size = k_refs[0].shape[0]
  length = lengths_ref[b]
  block_start = j * (ppcb * page_size)

  def token_scale_row(s_ref, i):
    """[1, page] scales of page i of this block, from its 8-page tile (see the index map)."""
    last_page = jnp.maximum(length - 1, 0) // page_size
    page = page_table_ref[b * pages_per_sequence + jnp.minimum(j * ppcb + i, last_page)]
    return s_ref[pl.ds(page % 8, 1), :]

  @pl.when(j == 0)
  def _init():
    m_ref[...] = jnp.full(m_ref.shape, MASK_VALUE, jnp.float32)
    l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

  @pl.when(block_start < length)
  def _compute():
    q = q_ref[...].astype(dot_dtype)
    qk_scale = sm_scale * scales_ref[2 * h]
    m, denom, acc = m_ref[...], l_ref[...], acc_ref[...]
    for i in range(ppcb):  # static unroll over the pages of this block
      start = block_start + i * page_size
      row_pos = start + lax.broadcasted_iota(jnp.int32, (page_size, head_dim), 0)
      col_pos = start + lax.broadcasted_iota(jnp.int32, (group, page_size), 1)
      # Mask K/V before the dots so garbage past `length` never reaches them.
      k = k_refs[i][...].astype(dot_dtype)
      k = jnp.where(row_pos < length, k, jnp.zeros_like(k))
      logits = lax.dot_general(
        q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32
      )  # [G, page]
      scale = qk_scale
      if token_scales:  # per-token K scale: [1, page], one per logit column, broadcast over G
        scale = qk_scale * token_scale_row(ks_refs[i], i)
      # `where` after the scaling: garbage (NaN / inf) scales past `length` never get through.
      logits = jnp.where(col_pos < length, logits * scale, MASK_VALUE)
      m_next = jnp.maximum(m, logits.max(axis=1, keepdims=True))
      correction = jnp.exp(m - m_next)
      p = jnp.exp(logits - m_next)
      denom = denom * correction + p.sum(axis=1, keepdims=True)  # unscaled p
      if token_scales:  # per-token V scale folded into the PV dot's left operand
        p = jnp.where(col_pos < length, p * token_scale_row(vs_refs[i], i), 0.0)
      v = v_refs[i][...].astype(dot_dtype)
      v = jnp.where(row_pos < length, v, jnp.zeros_like(v))
      pv = lax.dot_general(
        p.astype(dot_dtype), v, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32
      )
      acc = acc * correction + pv
      m = m_next
    m_ref[...], l_ref[...], acc_ref[...] = m, denom, acc

  @pl.when(j == num_blocks - 1)
  def _finish():
    v_scale = scales_ref[2 * h + 1]
    denom = l_ref[...]
    denom = jnp.where(denom > 0, denom, 1.0)  # idle slot (length 0): output 0
    o_ref[...] = acc_ref[...] * (v_scale / denom)


def paged_attention_tpu(
  q, k_pages, v_pages, lengths, page_table, scales, *, sm_scale, pages_per_compute_block,
  interpret, token_scales=None,
):  # fmt: skip
  """pallas_call of the TPU kernel.

  For token t of sequence b, stored at page = page_table[b, t // page_size],
  row = t % page_size, and KV head g:

    K[t] = k_pages[g, page, row] * scales[g, 0] (* k_token[g, page, row])
    V[t] = v_pages[g, page, row] * scales[g, 1] (* v_token[g, page, row])

  the per-token factors only with `token_scales`. They are not applied to the
  `[page, D]` K/V tiles: the K factor multiplies the `[G, page]` logits (one per
  column, broadcast over the G query heads of the group) and the V factor the
  probabilities p before the PV dot (the softmax denominator sums the unscaled
  p); both are masked with `where` past `length`, so NaN / inf there never reach
  the output. That is G * page multiplies per page instead of page * D.

  Token-scale layout: Mosaic needs a block's last two dims divisible by (8, 128)
  or equal to the array's, so a `(1, page_size)` row block of the `[Hkv, P,
  page_size]` array does not compile. Each page's scales therefore come in the
  `(8, page_size)` tile holding that page (block index page // 8, one BlockSpec
  per page of the compute block for K and one for V, like the page BlockSpecs),
  and the kernel takes row page % 8 with a dynamic sublane slice. Cost per page
  and per K (or V): 8 * page_size * 4 bytes of scales DMA'd next to page_size * D
  bytes of FP8 page, i.e. 32 / D of the page bytes (25 % at D = 128). When P is
  not a multiple of 8 the wrapper pads the scale arrays with ones to a multiple
  of 8 pages, which copies them on every call; callers with P % 8 == 0 avoid it.

  JAX's `jax/experimental/pallas/ops/tpu/paged_attention` kernel also takes
  per-token scales, for int8 pages (`quantization_utils.QuantizedTensor(weight,
  scales)`): it broadcasts the scales to the pages' full `[Hkv, P, page_size, D]`
  shape (4x the int8 pages' bytes for f32 scales), DMAs that with the pages and
  dequantizes the `[page, D]` tiles elementwise. Here the scales stay
  `[Hkv, P, page_size]` (8-page tiles as above) and per-head scales are kept.

  Args:
    q: `[B, H, D]`.
    k_pages: `[Hkv, P, page_size, D]`; v_pages the same.
    lengths: i32`[B]`, validated 0 < length <= capacity.
    page_table: i32`[B, pages_per_sequence]`, sanitized (entries in range).
    scales: f32`[Hkv, 2]` (k_scale, v_scale).
    sm_scale: Python float.
    pages_per_compute_block: pages DMA'd per grid step (clipped to the table width).
    interpret: False on TPU, `pltpu.InterpretParams()` on CPU.
    token_scales: None (per-head scales only), or `(k_token, v_token)`, float32
      `[Hkv, P, page_size]` per-token scales, one per stored row of the pools;
      values at rows past a sequence's length are never used (may be garbage).

  Returns:
    float32 `[B, H, D]`.
  """
  batch, num_heads, head_dim = q.shape
  num_kv_heads, total_pages, page_size, _ = k_pages.shape
  if token_scales is not None:
    if not isinstance(token_scales, tuple | list) or len(token_scales) != 2:
      raise ValueError(
        f"`token_scales` must be None or a pair (k_token, v_token), got {type(token_scales)}."
      )
    want = (num_kv_heads, total_pages, page_size)
    for name, x in zip(("k_token", "v_token"), token_scales, strict=True):
      if tuple(x.shape) != want:
        raise ValueError(f"`{name}` must have shape [Hkv, P, page_size] = {want}, got {x.shape}.")
    token_scales = [x.astype(jnp.float32) for x in token_scales]
    pad_pages = pl.cdiv(total_pages, 8) * 8 - total_pages
    if pad_pages:  # a copy of both scale arrays; none when P % 8 == 0
      pad = ((0, 0), (0, pad_pages), (0, 0))
      token_scales = [jnp.pad(x, pad, constant_values=1.0) for x in token_scales]
  pages_per_sequence = page_table.shape[1]
  group = num_heads // num_kv_heads
  ppcb = max(1, min(int(pages_per_compute_block), pages_per_sequence))
  num_blocks = pl.cdiv(pages_per_sequence, ppcb)
  dot_dtype = jnp.float32 if q.dtype == jnp.float32 else jnp.bfloat16

  def page_map(i):
    def index_map(b, h, j, lengths_ref, page_table_ref):
      last_page = jnp.maximum(lengths_ref[b] - 1, 0) // page_size  # length 0 -> page 0
      page = jnp.minimum(j * ppcb + i, last_page)
      return (h, page_table_ref[b * pages_per_sequence + page], 0, 0)

    return index_map

  def token_scale_map(i):  # the (8, page) tile holding page i's row (see the docstring)
    page_index_map = page_map(i)

    def index_map(b, h, j, lengths_ref, page_table_ref):
      _, page, _, _ = page_index_map(b, h, j, lengths_ref, page_table_ref)
      return (h, page // 8, 0)

    return index_map

  page_specs = [pl.BlockSpec((None, None, page_size, head_dim), page_map(i)) for i in range(ppcb)]
  token_scale_specs = []
  if token_scales is not None:
    token_scale_specs = [
      pl.BlockSpec((None, 8, page_size), token_scale_map(i)) for i in range(ppcb)
    ] * 2  # k token scales, v token scales
  head_spec = pl.BlockSpec((None, None, group, head_dim), lambda b, h, j, *_: (b, h, 0, 0))
  grid_spec = pltpu.PrefetchScalarGridSpec(
    num_scalar_prefetch=2,
    grid=(batch, num_kv_heads, num_blocks),
    in_specs=[
      pl.BlockSpec(memory_space=pltpu.SMEM),  # scales
      head_spec,  # q
      *page_specs,  # k pages
      *page_specs,  # v pages
      *token_scale_specs,  # k token scales, v token scales (if any)
    ],
    out_specs=head_spec,
    scratch_shapes=[
      pltpu.VMEM((group, 1), jnp.float32),
      pltpu.VMEM((group, 1), jnp.float32),
      pltpu.VMEM((group, head_dim), jnp.float32),
    ],
  )
  kernel = functools.partial(
    _paged_attention_tpu_kernel,
    sm_scale=sm_scale,
    pages_per_compute_block=ppcb,
    pages_per_sequence=pages_per_sequence,
    num_blocks=num_blocks,
    dot_dtype=dot_dtype,
    token_scales=token_scales is not None,
  )
  out = pl.pallas_call(
    kernel,
    grid_spec=grid_spec,
    out_shape=jax.ShapeDtypeStruct((batch, num_kv_heads, group, head_dim), jnp.float32),
    compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
    interpret=interpret,
    name="rlx_paged_attention_tpu",
  )(
    lengths,
    page_table.reshape(-1),
    scales.reshape(-1),
    q.reshape(batch, num_kv_heads, group, head_dim),
    *([k_pages] * ppcb),
    *([v_pages] * ppcb),
    *([] if token_scales is None else [token_scales[0]] * ppcb + [token_scales[1]] * ppcb),
  )
  return out.reshape(batch, num_heads, head_dim)
