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

Runs on CPU with `interpret=pltpu.InterpretParams()` (tests); the Mosaic
lowering is checked on CPU by `jax.export` (tests/kernels_pallas), the TPU
compiler has not run it yet.
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
  *refs,  # k page refs ([page, D]) x ppcb, v page refs x ppcb, o_ref [G, D] f32,
  # then scratch: m [G, 1] f32, l [G, 1] f32, acc [G, D] f32
  sm_scale: float,
  pages_per_compute_block: int,
  num_blocks: int,
  dot_dtype,
):
  ppcb = pages_per_compute_block
  k_refs, v_refs = refs[:ppcb], refs[ppcb : 2 * ppcb]
  o_ref, m_ref, l_ref, acc_ref = refs[2 * ppcb :]
  b, h, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  group, head_dim = q_ref.shape
  page_size = k_refs[0].shape[0]
  length = lengths_ref[b]
  block_start = j * (ppcb * page_size)

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
      logits = jnp.where(col_pos < length, logits * qk_scale, MASK_VALUE)
      m_next = jnp.maximum(m, logits.max(axis=1, keepdims=True))
      correction = jnp.exp(m - m_next)
      p = jnp.exp(logits - m_next)
      denom = denom * correction + p.sum(axis=1, keepdims=True)
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
  interpret,
):  # fmt: skip
  """pallas_call of the TPU kernel.

  Args:
    q: `[B, H, D]`.
    k_pages: `[Hkv, P, page_size, D]`; v_pages the same.
    lengths: i32`[B]`, validated 0 < length <= capacity.
    page_table: i32`[B, pages_per_sequence]`, sanitized (entries in range).
    scales: f32`[Hkv, 2]` (k_scale, v_scale).
    sm_scale: Python float.
    pages_per_compute_block: pages DMA'd per grid step (clipped to the table width).
    interpret: False on TPU, `pltpu.InterpretParams()` on CPU.

  Returns:
    float32 `[B, H, D]`.
  """
  batch, num_heads, head_dim = q.shape
  num_kv_heads, _, page_size, _ = k_pages.shape
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

  page_specs = [pl.BlockSpec((None, None, page_size, head_dim), page_map(i)) for i in range(ppcb)]
  head_spec = pl.BlockSpec((None, None, group, head_dim), lambda b, h, j, *_: (b, h, 0, 0))
  grid_spec = pltpu.PrefetchScalarGridSpec(
    num_scalar_prefetch=2,
    grid=(batch, num_kv_heads, num_blocks),
    in_specs=[
      pl.BlockSpec(memory_space=pltpu.SMEM),  # scales
      head_spec,  # q
      *page_specs,  # k pages
      *page_specs,  # v pages
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
    num_blocks=num_blocks,
    dot_dtype=dot_dtype,
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
  )
  return out.reshape(batch, num_heads, head_dim)
