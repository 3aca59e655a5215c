"""Paged decode attention over bf16/f32 or FP8 KV pages: Pallas GPU kernel + reference.

One query token per sequence attends to that sequence's cached keys/values,
which live in a shared pool of fixed-size pages addressed through a page table
(PagedAttention, Kwon et al. 2023, https://arxiv.org/abs/2309.06180; shapes as
in JAX's `jax/experimental/pallas/ops/gpu/paged_attention.py`):

  K_b = concat_j k_pages[:, page_table[b, j]] * k_scale      (first lengths[b] rows)
  out[b, h] = softmax(sm_scale * q[b, h] . K_b[h // G]^T) V_b[h // G],  G = H / Hkv

File order: constants -> GPU kernel over refs -> its `pallas_call` ->
public jitted wrapper (shared validator, dispatch) -> `paged_attention_reference`.
The TPU (Mosaic) kernel lives in `_paged_attention_tpu.py`.

GPU backend: the kernel is a plain `pl.pallas_call` lowered by the Pallas
*Triton* backend (`jax.experimental.pallas.triton`), which jax 0.10.2 supports
on Hopper (sm_90). Triton dots need both operands in one dtype, so an
FP8 x BF16 mixed dot is not available: FP8 pages are converted to the dot dtype
in-kernel (exact: every e4m3fn/e5m2 value is a bf16 value); the HBM byte saving
of FP8 pages remains, which is what matters for bandwidth-bound decode. The
split-K partitions and their log-sum-exp merge follow Flash-Decoding
(Dao et al. 2023, https://crfm.stanford.edu/2023/10/12/flashdecoding.html) and
vLLM's `paged_attention_v2` (`csrc/attention/paged_attention_v2.cu`).
"""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jaxtyping import Array, Float, Int

from rlx.kernels_pallas import _paged_attention_tpu
from rlx.kernels_pallas._common import (
  MASK_VALUE,
  arrays_platform,
  check_kv_scale_pair,
  gather_pages,
  gather_token_scales,
  is_concrete,
  next_pow2,
  resolve_impl,
)

PAGE_DTYPES = (
  jnp.dtype(jnp.bfloat16),
  jnp.dtype(jnp.float32),
  jnp.dtype(jnp.float8_e4m3fn),
  jnp.dtype(jnp.float8_e5m2),
)
Q_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))
# Streaming multiprocessors of an H100/H200 SXM; only used by the split-K heuristic.
_GPU_NUM_SMS = 132
# Default tokens per online-softmax step when `pages_per_compute_block` is None.
_GPU_TOKENS_PER_BLOCK = 128
_TPU_TOKENS_PER_BLOCK = 512


@dataclasses.dataclass(frozen=True)
class PagedAttentionBlockSizes:
  """Tiling of the paged-attention kernels.

  Attributes:
    pages_per_compute_block: pages loaded and processed per online-softmax step
      (GPU: one gathered `[pages_per_compute_block * page_size, D]` tile per loop
      iteration; TPU: that many page DMAs per grid step). Power of two on GPU.
      `None`: GPU 128 tokens per step (`max(1, 128 // page_size)`), TPU 512
      tokens per step; untuned defaults (no hardware run yet).
    pages_per_split: GPU split-K. The pages of a sequence are cut into
      partitions of this many pages, each handled by its own program (grid
      axis), and combined by a log-sum-exp merge in XLA. `None`: split only
      where it pays, i.e. when batch * kv_heads programs cannot fill the GPU
      (aim: >= 2 programs per SM of an H100/H200, 132 SMs) and each split still
      gets >= 2 compute blocks of pages; so short contexts or big batches get one
      split, long contexts at small batch several. Rounded up to a power of two
      >= `pages_per_compute_block`. TPU: unused (the TPU kernel walks the pages
      of a sequence sequentially).
    min_block_h: GPU only: query heads of one KV group are padded to at least
      this many rows; a power of two >= 16 (Triton `dot` needs M >= 16).
  """

  pages_per_compute_block: int | None = None
  pages_per_split: int | None = None
  min_block_h: int = 16

  def __post_init__(self):
    for name in ("pages_per_compute_block", "pages_per_split", "min_block_h"):
      value = getattr(self, name)
      if value is None and name != "min_block_h":
        continue
      if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
        raise ValueError(
          f"`{name}` must be a positive int{' or None' if name != 'min_block_h' else ''}, "
          f"got {value!r}."
        )
      object.__setattr__(self, name, int(value))


# ------------------------------------------------------------------------------------------
# GPU kernel (Pallas Triton backend)
# ------------------------------------------------------------------------------------------


def _paged_attention_gpu_kernel(
  lengths_ref,  # i32[1]: this sequence's length
  scales_ref,  # f32[2]: (k_scale, v_scale) of this KV head
  page_table_ref,  # i32[pages_per_split]: this split's page indices
  q_ref,  # [block_h, D]: the query heads of this KV group (zero-padded rows)
  k_pages_ref,  # [P, page_size, D]: this KV head's whole page pool
  v_pages_ref,  # [P, page_size, D]
  *refs,  # per-token scales: k, v f32[P, page_size] of this KV head; then the outputs:
  # o_ref f32[block_h, D] (unnormalized sum_t p_t v_t of this split), m_ref f32[block_h]
  # (running max of this split), l_ref f32[block_h] (sum_t p_t of this split)
  sm_scale: float,
  pages_per_compute_block: int,
  dot_dtype,
  per_token: bool,
):
  """One (sequence, KV head, split) program: online softmax over its pages.

  With per-token scales, the logits of token t are multiplied by its K scale and
  p_t by its V scale before the PV dot (the denominator sums the unscaled p_t).
  """
  if per_token:
    k_token_ref, v_token_ref, o_ref, m_ref, l_ref = refs
  else:
    o_ref, m_ref, l_ref = refs
  split = pl.program_id(2)
  block_h, head_dim = q_ref.shape
  page_size = k_pages_ref.shape[1]
  pages_per_split = page_table_ref.shape[0]
  block_tokens = pages_per_compute_block * page_size
  precision = lax.Precision.HIGHEST if dot_dtype == jnp.float32 else None

  length = lengths_ref[0]
  qk_scale = sm_scale * scales_ref[0]
  v_scale = scales_ref[1]
  first_page = split * pages_per_split
  pages_in_split = jnp.clip(pl.cdiv(length, page_size) - first_page, 0, pages_per_split)
  num_blocks = pl.cdiv(pages_in_split, pages_per_compute_block)

  q = q_ref[...].astype(dot_dtype)

  def body(i, carry):
    acc, m_prev, denom_prev = carry
    pages = page_table_ref[pl.ds(i * pages_per_compute_block, pages_per_compute_block)]
    first_token = (first_page + i * pages_per_compute_block) * page_size
    positions = first_token + jnp.arange(block_tokens, dtype=jnp.int32)
    valid = positions < length  # [block_tokens]
    # Mask K/V *before* the dots: garbage (even NaN) past `length` never reaches them.
    k = k_pages_ref[pages].reshape(block_tokens, head_dim).astype(dot_dtype)
    k = jnp.where(valid[:, None], k, jnp.zeros_like(k))
    logits = lax.dot_general(
      q, k, (((1,), (1,)), ((), ())), precision=precision, preferred_element_type=jnp.float32
    )
    logits = logits * qk_scale
    if per_token:
      logits = logits * k_token_ref[pages].reshape(1, block_tokens)
    logits = jnp.where(valid[None, :], logits, MASK_VALUE)  # [block_h, block_tokens]
    m_next = jnp.maximum(m_prev, logits.max(axis=1))
    correction = jnp.exp(m_prev - m_next)
    p = jnp.exp(logits - m_next[:, None])
    denom_next = denom_prev * correction + p.sum(axis=1)
    v = v_pages_ref[pages].reshape(block_tokens, head_dim).astype(dot_dtype)
    v = jnp.where(valid[:, None], v, jnp.zeros_like(v))
    pv_weights = p
    if per_token:  # masked: a garbage scale past `length` must not meet p = 0
      v_token = v_token_ref[pages].reshape(1, block_tokens)
      pv_weights = p * jnp.where(valid[None, :], v_token, 0.0)
    pv = lax.dot_general(
      pv_weights.astype(dot_dtype),
      v,
      (((1,), (0,)), ((), ())),
      precision=precision,
      preferred_element_type=jnp.float32,
    )
    return acc * correction[:, None] + pv, m_next, denom_next

  acc0 = jnp.zeros((block_h, head_dim), jnp.float32)
  m0 = jnp.full((block_h,), MASK_VALUE, jnp.float32)
  denom0 = jnp.zeros((block_h,), jnp.float32)
  acc, m, denom = lax.fori_loop(0, num_blocks, body, (acc0, m0, denom0))
  o_ref[...] = acc * v_scale
  m_ref[...] = m
  l_ref[...] = denom


def _paged_attention_gpu(
  q, k_pages, v_pages, lengths, page_table, scales, *, sm_scale, block_sizes, interpret,
  token_scales=None,
):  # fmt: skip
  """pallas_call of the GPU kernel over (batch, kv_head, split) + split-K merge.

  Shapes: q [B, H, D]; pages [Hkv, P, page, D]; lengths i32[B];
  page_table i32[B, pps] (already sanitized); scales f32[Hkv, 2]; token_scales
  None or (k, v) f32[Hkv, P, page] per-token scales (each head's whole scale pool
  is a block, indexed by the page table like the pages).
  """
  batch, num_heads, head_dim = q.shape
  num_kv_heads, total_pages, page_size, _ = k_pages.shape
  pages_per_sequence = page_table.shape[1]
  group = num_heads // num_kv_heads
  ppcb = block_sizes.pages_per_compute_block
  if ppcb is None:
    ppcb = max(1, _GPU_TOKENS_PER_BLOCK // page_size)
  if ppcb <= 0 or ppcb & (ppcb - 1):
    raise ValueError(f"pages_per_compute_block must be a power of two, got {ppcb}.")
  for name, value in (("page_size", page_size), ("head_dim", head_dim)):
    if value & (value - 1):
      raise ValueError(
        f"The GPU (Triton) paged-attention kernel needs a power-of-two {name}, got {value}."
      )
  # Triton's `tl.dot` needs every operand dim >= 16 (M is padded to block_h >= 16 below).
  # Checked in interpret mode too, which would otherwise run tiles the GPU cannot.
  block_tokens = ppcb * page_size
  for name, value in (
    ("head_dim", head_dim),
    ("pages_per_compute_block * page_size", block_tokens),
  ):
    if value < 16:
      raise ValueError(
        f"The GPU (Triton) paged-attention kernel needs {name} >= 16 (Triton dot), got "
        f"{value}; raise pages_per_compute_block, or use impl='pallas_tpu' or 'xla'."
      )
  pages_per_split = block_sizes.pages_per_split
  if pages_per_split is None:
    # Split-K pays when batch * kv_heads programs cannot fill the SMs: aim for
    # ~2 waves of programs, but give each split >= 2 compute blocks of pages so
    # the merge stays cheap. Short contexts therefore get a single split.
    want_splits = pl.cdiv(2 * _GPU_NUM_SMS, batch * num_kv_heads)
    max_splits = max(1, pages_per_sequence // (2 * ppcb))
    pages_per_split = pl.cdiv(pages_per_sequence, min(want_splits, max_splits))
  pages_per_split = next_pow2(max(pages_per_split, ppcb))  # multiple of ppcb, pow2
  num_splits = pl.cdiv(pages_per_sequence, pages_per_split)
  padded_pages = num_splits * pages_per_split
  page_table = jnp.pad(page_table, ((0, 0), (0, padded_pages - pages_per_sequence)))
  page_table = page_table.reshape(batch, num_splits, pages_per_split)

  min_block_h = block_sizes.min_block_h
  if min_block_h < 16 or min_block_h & (min_block_h - 1):
    raise ValueError(
      f"min_block_h must be a power of two >= 16 (Triton block / dot M), got {min_block_h}."
    )
  block_h = max(min_block_h, next_pow2(group))
  q = q.reshape(batch, num_kv_heads, group, head_dim)
  q = jnp.pad(q, ((0, 0), (0, 0), (0, block_h - group), (0, 0)))
  dot_dtype = jnp.float32 if q.dtype == jnp.float32 else jnp.bfloat16

  kernel = functools.partial(
    _paged_attention_gpu_kernel,
    sm_scale=sm_scale,
    pages_per_compute_block=ppcb,
    dot_dtype=dot_dtype,
    per_token=token_scales is not None,
  )
  grid = (batch, num_kv_heads, num_splits)
  out_shape = (
    jax.ShapeDtypeStruct((batch, num_kv_heads, num_splits, block_h, head_dim), jnp.float32),
    jax.ShapeDtypeStruct((batch, num_kv_heads, num_splits, block_h), jnp.float32),
    jax.ShapeDtypeStruct((batch, num_kv_heads, num_splits, block_h), jnp.float32),
  )
  pool_spec = pl.BlockSpec((None, total_pages, page_size, head_dim), lambda b, h, s: (h, 0, 0, 0))
  token_specs, token_args = [], []
  if token_scales is not None:
    token_spec = pl.BlockSpec((None, total_pages, page_size), lambda b, h, s: (h, 0, 0))
    token_specs, token_args = [token_spec, token_spec], list(token_scales)
  compiler_params = None
  if not interpret:
    from jax.experimental.pallas import triton as plgpu

    num_warps = 4 if ppcb * page_size <= 128 else 8
    compiler_params = plgpu.CompilerParams(num_warps=num_warps, num_stages=2)
  o, m, denom = pl.pallas_call(
    kernel,
    grid=grid,
    in_specs=[
      pl.BlockSpec((None, 1), lambda b, h, s: (b, 0)),  # lengths [B, 1]
      pl.BlockSpec((None, 2), lambda b, h, s: (h, 0)),  # scales [Hkv, 2]
      pl.BlockSpec((None, None, pages_per_split), lambda b, h, s: (b, s, 0)),  # page table
      pl.BlockSpec((None, None, block_h, head_dim), lambda b, h, s: (b, h, 0, 0)),  # q
      pool_spec,  # k_pages
      pool_spec,  # v_pages
      *token_specs,  # per-token k, v scales [Hkv, P, page]
    ],
    out_specs=[
      pl.BlockSpec((None, None, None, block_h, head_dim), lambda b, h, s: (b, h, s, 0, 0)),
      pl.BlockSpec((None, None, None, block_h), lambda b, h, s: (b, h, s, 0)),
      pl.BlockSpec((None, None, None, block_h), lambda b, h, s: (b, h, s, 0)),
    ],
    out_shape=out_shape,
    interpret=interpret,
    compiler_params=compiler_params,
    name="rlx_paged_attention_gpu",
  )(lengths[:, None], scales, page_table, q, k_pages, v_pages, *token_args)

  # Split-K merge (log-sum-exp). A sequence with length >= 1 has tokens in split 0;
  # an idle slot (length 0, only possible under jit) has denominator 0 -> output 0.
  m_all = m.max(axis=2, keepdims=True)
  weight = jnp.exp(m - m_all)  # [B, Hkv, S, block_h]; 0 for empty splits
  denom_all = (denom * weight).sum(axis=2)
  denom_all = jnp.where(denom_all > 0, denom_all, 1.0)
  o = (o * weight[..., None]).sum(axis=2) / denom_all[..., None]
  return o[:, :, :group].reshape(batch, num_heads, head_dim)


# ------------------------------------------------------------------------------------------
# XLA path (CPU): blocked online softmax over the live pages only
# ------------------------------------------------------------------------------------------

# Tokens per block of the XLA path when `pages_per_compute_block` is None: short page
# tables (<= _XLA_MAX_UNROLLED_BLOCKS blocks of _XLA_TOKENS_PER_SHORT_BLOCK) run unrolled
# blocks of 64 tokens, each past the first skipped by a `lax.cond` when no sequence
# reaches it; longer tables loop over blocks of 256 tokens.
_XLA_TOKENS_PER_SHORT_BLOCK = 64
_XLA_TOKENS_PER_BLOCK = 256
_XLA_MAX_UNROLLED_BLOCKS = 8


def _xla_pages_per_block(pages_per_sequence: int, page_size: int) -> int:
  short = max(1, _XLA_TOKENS_PER_SHORT_BLOCK // page_size)
  if -(-pages_per_sequence // short) <= _XLA_MAX_UNROLLED_BLOCKS:
    return short
  return max(1, _XLA_TOKENS_PER_BLOCK // page_size)


def _paged_attention_xla(
  q, k_pages, v_pages, lengths, page_table, k_scale, v_scale, *, sm_scale, pages_per_block,
  layer=None,
):  # fmt: skip
  """Paged attention in XLA ops: a loop over page-table blocks with an online softmax.

  Each step gathers `pages_per_block` pages of every sequence (`[B, Hkv, T, D]`,
  T = pages_per_block * page_size) and folds them into a float32 running max /
  denominator / accumulator (Milakov & Gimelshein, https://arxiv.org/abs/1805.02867),
  the scheme of the Pallas kernels. Blocks past the one holding the longest
  sequence's last token are not computed, so the bytes read follow the live tokens,
  not the page-table width: up to `_XLA_MAX_UNROLLED_BLOCKS` blocks run as
  straight-line code with every block after the first under a `lax.cond` (cheaper
  on CPU than a loop), more as a `fori_loop` that stops there. Positions >= lengths[b]
  are zeroed with `where` before the dots (garbage, even NaN, never reaches the
  output); a row with length 0 yields zeros. With `layer` (int32 scalar), the pools
  are stacked `[L, Hkv, P, page, D]` and the layer index is part of every gather
  index, so no layer slice of the pool is ever materialised (a slice feeding a
  `lax.cond` would be copied whole). Inputs validated; lengths already clamped into
  [0, capacity]; scales f32[Hkv], or per-token f32 scales of the pools' shape without D.
  """
  if layer is None:
    k_pages, v_pages, layer = k_pages[None], v_pages[None], jnp.int32(0)
    if k_scale.ndim > 1:
      k_scale, v_scale = k_scale[None], v_scale[None]
  batch, num_heads, head_dim = q.shape
  _, num_kv_heads, total_pages, page_size, _ = k_pages.shape
  group = num_heads // num_kv_heads
  pages_per_sequence = page_table.shape[1]
  bp = max(1, min(pages_per_block, pages_per_sequence))
  num_blocks = -(-pages_per_sequence // bp)
  tokens = bp * page_size
  table = jnp.clip(page_table, 0, total_pages - 1)
  table = jnp.pad(table, ((0, 0), (0, num_blocks * bp - pages_per_sequence)))
  qf = q.astype(jnp.float32).reshape(batch, num_kv_heads, group, head_dim) * sm_scale
  hp = lax.Precision.HIGHEST
  live_blocks = (jnp.max(lengths) + tokens - 1) // tokens

  # Gather straight into the dots' layout [B, Hkv, T, D] (`gather_pages`: no transpose
  # and no copy of the layer's pool).
  layer = jnp.asarray(layer, jnp.int32)

  def gather(pages, cols, scale, valid):
    x = gather_pages(pages, layer, cols).astype(jnp.float32)  # [B, Hkv, T, D]
    if scale.ndim > 1:  # per-token [L, Hkv, P, page] scales, gathered like the pages
      x = x * gather_token_scales(scale, layer, cols)[..., None]
    else:
      x = x * scale[None, :, None, None]
    return jnp.where(valid[:, None, :, None], x, 0.0)

  def body(j, carry):
    m, denom, acc = carry
    cols = lax.dynamic_slice_in_dim(table, j * bp, bp, axis=1)  # [B, bp]
    valid = (j * tokens + jnp.arange(tokens))[None, :] < lengths[:, None]  # [B, T]
    k = gather(k_pages, cols, k_scale, valid)
    v = gather(v_pages, cols, v_scale, valid)
    logits = jnp.einsum("bhgd,bhtd->bhgt", qf, k, precision=hp)
    logits = jnp.where(valid[:, None, None, :], logits, -jnp.inf)
    m_new = jnp.maximum(m, logits.max(axis=-1))
    m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)  # all masked so far: keep zeros
    p = jnp.exp(logits - m_safe[..., None])
    alpha = jnp.exp(m - m_safe)
    denom = denom * alpha + p.sum(axis=-1)
    acc = acc * alpha[..., None] + jnp.einsum("bhgt,bhtd->bhgd", p, v, precision=hp)
    return m_new, denom, acc

  shape = (batch, num_kv_heads, group)
  init = (
    jnp.full(shape, -jnp.inf, jnp.float32),
    jnp.zeros(shape, jnp.float32),
    jnp.zeros((*shape, head_dim), jnp.float32),
  )
  if num_blocks <= _XLA_MAX_UNROLLED_BLOCKS:  # straight-line blocks, the later ones skippable
    carry = body(0, init)
    for j in range(1, num_blocks):
      carry = lax.cond(j < live_blocks, functools.partial(body, j), lambda c: c, carry)
    _, denom, acc = carry
  else:
    _, denom, acc = lax.fori_loop(0, jnp.minimum(live_blocks, num_blocks), body, init)
  out = jnp.where(denom[..., None] > 0, acc / jnp.where(denom > 0, denom, 1.0)[..., None], 0.0)
  return out.reshape(batch, num_heads, head_dim)


# ------------------------------------------------------------------------------------------
# Public wrapper: validation and dispatch
# ------------------------------------------------------------------------------------------


def validate_paged_attention_inputs(
  q, k_pages, v_pages, lengths, page_table, *, sm_scale=None, k_scale=None, v_scale=None,
  pool_shape=None,
):  # fmt: skip
  """Checks shapes, dtypes and (when concrete) lengths; shared by kernels and reference.

  `pool_shape` is the shape of the pools as passed (the stacked `[L, Hkv, P,
  page, D]` one when `k_pages` stands for one layer of it); per-token scales
  have that shape without D. None: `k_pages.shape`.

  Returns:
    `(sm_scale, k_scale, v_scale)` with `sm_scale` a Python float and the scales
    float32 arrays of shape `[Hkv]` (scalars broadcast; `None` means 1.0 for
    bf16/f32 pages), or both per-token (`pool_shape[:-1]`).

  Raises:
    ValueError naming the offending argument.
  """
  for name, x, rank in (
    ("q", q, 3),
    ("k_pages", k_pages, 4),
    ("v_pages", v_pages, 4),
    ("lengths", lengths, 1),
    ("page_table", page_table, 2),
  ):
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
      raise ValueError(f"`{name}` must be an array, got {type(x).__name__}.")
    if x.ndim != rank:
      raise ValueError(f"`{name}` must have rank {rank}, got shape {tuple(x.shape)}.")
  batch, num_heads, head_dim = q.shape
  num_kv_heads, total_pages, page_size, head_dim_k = k_pages.shape
  if 0 in q.shape:
    raise ValueError(
      f"`q` must be [B, H, D] with B, H, D >= 1, got the zero-size shape {tuple(q.shape)}."
    )
  if num_kv_heads == 0:
    raise ValueError(f"`k_pages` must have Hkv >= 1 KV heads, got shape {tuple(k_pages.shape)}.")
  if v_pages.shape != k_pages.shape:
    raise ValueError(
      f"`v_pages` must have the shape of `k_pages` {tuple(k_pages.shape)}, got "
      f"{tuple(v_pages.shape)}."
    )
  if head_dim_k != head_dim:
    raise ValueError(
      f"`k_pages` head dim (last axis) must equal q's head dim {head_dim}, got {head_dim_k}."
    )
  if num_heads % num_kv_heads:
    raise ValueError(
      f"Number of query heads H={num_heads} (q axis 1) must be a multiple of the number of "
      f"KV heads Hkv={num_kv_heads} (k_pages axis 0)."
    )
  if jnp.dtype(q.dtype) not in Q_DTYPES:
    raise ValueError(f"`q` must be bfloat16 or float32, got {q.dtype}.")
  if jnp.dtype(k_pages.dtype) not in PAGE_DTYPES:
    raise ValueError(f"`k_pages` dtype must be one of {PAGE_DTYPES}, got {k_pages.dtype}.")
  if v_pages.dtype != k_pages.dtype:
    raise ValueError(f"`v_pages` dtype {v_pages.dtype} must equal `k_pages` dtype {k_pages.dtype}.")
  if lengths.shape != (batch,) or lengths.dtype != jnp.int32:
    raise ValueError(
      f"`lengths` must be int32 with shape ({batch},), got {lengths.dtype}{tuple(lengths.shape)}."
    )
  if page_table.shape[0] != batch or page_table.dtype != jnp.int32:
    raise ValueError(
      f"`page_table` must be int32 [B={batch}, pages_per_sequence], got "
      f"{page_table.dtype}{tuple(page_table.shape)}."
    )
  pages_per_sequence = page_table.shape[1]
  if pages_per_sequence == 0 or page_size == 0 or total_pages == 0:
    raise ValueError(
      f"Empty page pool or table: k_pages {tuple(k_pages.shape)}, page_table "
      f"{tuple(page_table.shape)}."
    )
  capacity = pages_per_sequence * page_size

  if is_concrete(lengths):
    lv = np.asarray(lengths)
    bad = np.nonzero((lv <= 0) | (lv > capacity))[0]
    if bad.size:
      raise ValueError(
        f"`lengths` must satisfy 0 < length <= pages_per_sequence * page_size = {capacity}; "
        f"lengths[{bad[0]}] = {lv[bad[0]]}."
      )
    if is_concrete(page_table):
      tv = np.asarray(page_table)
      used = np.arange(pages_per_sequence)[None, :] < -(-lv[:, None] // page_size)
      out_of_range = used & ((tv < 0) | (tv >= total_pages))
      if out_of_range.any():
        b, j = np.argwhere(out_of_range)[0]
        raise ValueError(
          f"`page_table[{b}, {j}]` = {tv[b, j]} is a used page but not in [0, {total_pages})."
        )

  if sm_scale is None:
    sm_scale = 1.0 / math.sqrt(head_dim)
  elif isinstance(sm_scale, (int, float, np.floating, np.integer)) and not isinstance(
    sm_scale, (bool, np.bool_)
  ):
    sm_scale = float(sm_scale)
    if not math.isfinite(sm_scale):
      raise ValueError(f"`sm_scale` must be finite, got {sm_scale}.")
  else:
    raise ValueError(f"`sm_scale` must be a Python float or None, got {type(sm_scale).__name__}.")

  k_scale, v_scale = check_kv_scale_pair(
    k_scale, v_scale, num_kv_heads, k_pages.dtype,
    k_pages.shape if pool_shape is None else pool_shape,
  )  # fmt: skip
  return sm_scale, k_scale, v_scale


def _sanitize_page_table(page_table, lengths, page_size, total_pages):
  """Zeroes entries past each sequence's last used page and clamps the rest in range.

  Unused entries may hold anything (the sampler leaves stale or -1 entries);
  after this no kernel ever reads outside the pool.
  """
  used = jnp.arange(page_table.shape[1])[None, :] < pl.cdiv(lengths, page_size)[:, None]
  return jnp.where(used, jnp.clip(page_table, 0, total_pages - 1), 0)


@functools.partial(jax.jit, static_argnames=("sm_scale", "impl", "interpret", "block_sizes"))
def _paged_attention_jit(
  q,
  k_pages,
  v_pages,
  lengths,
  page_table,
  k_scale,
  v_scale,
  *,
  sm_scale,
  impl,
  interpret,
  block_sizes,
  layer=None,
):
  total_pages, page_size = k_pages.shape[-3:-1]
  # Under jit `lengths` cannot be checked; clamp it into [0, capacity] so that all impls
  # agree and no kernel reads past the page table: otherwise the TPU index maps read
  # SMEM out of bounds (a garbage page index for the DMA) and the GPU kernel attends to
  # its zero-padded table entries as if they were real pages.
  lengths = jnp.clip(lengths, 0, page_table.shape[1] * page_size)
  if impl == "xla":  # same output dtype as the kernels (q's), whatever the backend
    out = _paged_attention_xla(
      q, k_pages, v_pages, lengths, page_table, k_scale, v_scale, sm_scale=sm_scale,
      pages_per_block=block_sizes.pages_per_compute_block
      or _xla_pages_per_block(page_table.shape[1], page_size), layer=layer,
    )  # fmt: skip
    return out.astype(q.dtype)
  per_token = k_scale.ndim > 1
  if layer is not None:  # the kernels take one layer's [Hkv, P, page, D] pools
    k_pages = lax.dynamic_index_in_dim(k_pages, layer, keepdims=False)
    v_pages = lax.dynamic_index_in_dim(v_pages, layer, keepdims=False)
    if per_token:
      k_scale = lax.dynamic_index_in_dim(k_scale, layer, keepdims=False)
      v_scale = lax.dynamic_index_in_dim(v_scale, layer, keepdims=False)
  page_table = _sanitize_page_table(page_table, lengths, page_size, total_pages)
  token_scales = None
  if per_token:  # static factors 1, the per-token [Hkv, P, page] scales beside the pages
    token_scales = (k_scale, v_scale)
    scales = jnp.ones((k_pages.shape[0], 2), jnp.float32)
  else:
    scales = jnp.stack([k_scale, v_scale], axis=1)  # [Hkv, 2]
  if impl == "pallas_gpu":
    out = _paged_attention_gpu(
      q, k_pages, v_pages, lengths, page_table, scales, sm_scale=sm_scale,
      block_sizes=block_sizes, interpret=interpret, token_scales=token_scales,
    )  # fmt: skip
  else:
    out = _paged_attention_tpu.paged_attention_tpu(
      q, k_pages, v_pages, lengths, page_table, scales, sm_scale=sm_scale,
      pages_per_compute_block=block_sizes.pages_per_compute_block
      or max(1, _TPU_TOKENS_PER_BLOCK // page_size),
      interpret=interpret, token_scales=token_scales,
    )  # fmt: skip
  return out.astype(q.dtype)


def paged_attention(
  q: Float[Array, "B H D"],
  k_pages: Float[Array, "Hkv P page D"],
  v_pages: Float[Array, "Hkv P page D"],
  lengths: Int[Array, " B"],
  page_table: Int[Array, "B pages_per_sequence"],
  *,
  sm_scale: float | None = None,
  k_scale: Float[Array, "..."] | None = None,
  v_scale: Float[Array, "..."] | None = None,
  impl: str = "auto",
  interpret=False,
  block_sizes: PagedAttentionBlockSizes = PagedAttentionBlockSizes(),
  layer: int | Int[Array, ""] | None = None,
) -> Float[Array, "B H D"]:
  """Paged grouped-query decode attention with float32 online softmax.

  For sequence b and query head h (KV head g = h // (H / Hkv)), with
  t < lengths[b] and token t stored at `page_table[b, t // page]`, row `t % page`:

    K[t] = k_pages[g, page_table[b, t // page], t % page] * k_scale[g]   (same for V)
    out[b, h] = sum_t softmax_t(sm_scale * q[b, h] . K[t]) V[t]

  or, with per-token scales (one per KV head and cached token, stored beside
  the pages in the pool's layout without D, as `write_kv_pages_per_token`
  writes them), `K[t] = k_pages[g, page, row] * k_scale[g, page, row]`. The
  kernels then multiply the logits by the K scales and p by the V scales
  rather than dequantizing K/V (one multiply per token instead of per element).

  References: Kwon et al., "Efficient Memory Management for Large Language Model
  Serving with PagedAttention" (https://arxiv.org/abs/2309.06180; vLLM); online
  softmax: Milakov & Gimelshein 2018 (https://arxiv.org/abs/1805.02867) and
  FlashAttention (https://arxiv.org/abs/2205.14135); split-K: Flash-Decoding.
  Public kernels with the same layout: JAX `pallas/ops/gpu/paged_attention.py`
  and `pallas/ops/tpu/paged_attention`.

  Implementations (`impl`), chosen by where the inputs live (under `jit`, the
  platform of the mesh the inputs are sharded on; else the concrete arrays'
  devices; else the default device / backend, see `_common.arrays_platform`):
    "auto": Pallas on GPU ("pallas_gpu") and TPU ("pallas_tpu"); elsewhere (CPU)
      the XLA path ("xla").
    "pallas": the Pallas kernel of that platform; on CPU the GPU-style kernel
      with `interpret=True`, the TPU kernel with
      `interpret=pltpu.InterpretParams()`.
    "pallas_gpu": Pallas Triton kernel (grid over batch x KV head x split-K
      partitions, `pages_per_compute_block` pages gathered per loop step; the
      split partial results are merged with a log-sum-exp in XLA). Needs a
      power-of-two page_size and D, with D >= 16 and `pages_per_compute_block *
      page_size` >= 16 (Triton block and dot sizes). Runs on CPU with
      `interpret=True`.
    "pallas_tpu": Pallas Mosaic kernel (`PrefetchScalarGridSpec`: lengths and
      page table are scalar-prefetched into SMEM and drive the BlockSpec index
      maps, so each grid step DMAs `pages_per_compute_block` pages). Runs on
      CPU with `interpret=pltpu.InterpretParams()`.
    "xla": XLA ops, float32: blocks of `pages_per_compute_block` pages
      (default 64 tokens for page tables of up to 512 tokens, else 256) with an
      online softmax, each gathering one block of every sequence in the dots'
      `[B, Hkv, T, D]` layout; blocks after the longest sequence's last one are
      skipped, so a step's bytes follow the live tokens rather than the
      page-table width (the CPU path; equal to `paged_attention_reference` up
      to float32 rounding).
  K/V positions >= lengths[b] (and pages past the last used one) are masked with
  `where` before any dot, so garbage there, even NaN, never reaches the output.
  Under `jit` lengths cannot be checked; a row with length 0 (an idle sampler
  slot) then yields zeros, a length above capacity is clamped to capacity, and
  used page-table entries outside [0, P) are clamped into range (all checked
  eagerly when concrete).
  Scales are traced arrays: changing their values never recompiles.

  Args:
    q: `[B, H, D]` bfloat16 or float32 queries (one decode token per sequence).
    k_pages: `[Hkv, P, page_size, D]` key page pool; bfloat16, float32,
      float8_e4m3fn or float8_e5m2.
    v_pages: `[Hkv, P, page_size, D]` value page pool, same dtype as `k_pages`.
    lengths: i32`[B]`, number of cached tokens per sequence, 0 < length <=
      pages_per_sequence * page_size (checked when concrete).
    page_table: i32`[B, pages_per_sequence]`, page indices into P; entries past a
      sequence's last used page are ignored.
    sm_scale: softmax scale (Python float); None means 1/sqrt(D).
    k_scale: float32 scalar or `[Hkv]` dequantization scale of K (required for
      FP8 pages; None means 1 otherwise), or per-token scales `[Hkv, P,
      page_size]` (`[L, Hkv, P, page_size]` with `layer`); past a sequence's
      length they are masked like the pages (may hold anything).
    v_scale: same for V.
    impl: "auto" | "pallas" | "pallas_gpu" | "pallas_tpu" | "xla".
    interpret: Pallas interpret mode (True, or `pltpu.InterpretParams()` for the
      TPU kernel on CPU).
    block_sizes: kernel tiling, see `PagedAttentionBlockSizes`.
    layer: None for `[Hkv, P, page_size, D]` pools; else the layer (int or traced
      int32 scalar in [0, L)) of stacked `[L, Hkv, P, page_size, D]` pools (as
      `write_kv_pages(..., layer=i)` writes them). The XLA path then gathers the
      layer's pages straight from the stacked pools (no copy of a layer's pool);
      the Pallas kernels get the layer's pools sliced out.

  Returns:
    `[B, H, D]` attention output in q's dtype.
  """
  if layer is not None:
    for name, x in (("k_pages", k_pages), ("v_pages", v_pages)):
      if np.ndim(x) != 5:
        raise ValueError(
          f"`{name}` must be a stacked [L, Hkv, P, page, D] pool since `layer` is given, "
          f"got shape {tuple(np.shape(x))}."
        )
    if np.ndim(layer) != 0 or not jnp.issubdtype(jnp.result_type(layer), jnp.integer):
      raise ValueError(f"`layer` must be an integer scalar, got {layer!r}.")
    if is_concrete(layer) and not 0 <= int(layer) < k_pages.shape[0]:
      raise ValueError(f"`layer` must be in [0, L={k_pages.shape[0]}), got {int(layer)}.")
    if v_pages.shape != k_pages.shape:
      raise ValueError(
        f"`v_pages` must have the shape of `k_pages` {tuple(k_pages.shape)}, got "
        f"{tuple(v_pages.shape)}."
      )
    one_layer = jax.ShapeDtypeStruct(k_pages.shape[1:], k_pages.dtype)
    sm_scale, k_scale, v_scale = validate_paged_attention_inputs(
      q, one_layer, jax.ShapeDtypeStruct(v_pages.shape[1:], v_pages.dtype), lengths,
      page_table, sm_scale=sm_scale, k_scale=k_scale, v_scale=v_scale,
      pool_shape=k_pages.shape,
    )  # fmt: skip
    layer = jnp.asarray(layer, jnp.int32)
  else:
    sm_scale, k_scale, v_scale = validate_paged_attention_inputs(
      q, k_pages, v_pages, lengths, page_table, sm_scale=sm_scale, k_scale=k_scale,
      v_scale=v_scale,
    )  # fmt: skip
  if not isinstance(block_sizes, PagedAttentionBlockSizes):
    raise ValueError(
      f"`block_sizes` must be a PagedAttentionBlockSizes, got {type(block_sizes).__name__}."
    )
  platform = arrays_platform(q, k_pages, v_pages, lengths, page_table)
  impl = resolve_impl(impl, interpret, platform)
  return _paged_attention_jit(
    q, k_pages, v_pages, lengths, page_table, k_scale, v_scale, sm_scale=sm_scale, impl=impl,
    interpret=interpret, block_sizes=block_sizes, layer=layer,
  )  # fmt: skip


# ------------------------------------------------------------------------------------------
# Reference
# ------------------------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("sm_scale",))
def _reference_math(q, k_pages, v_pages, lengths, page_table, k_scale, v_scale, sm_scale):
  """float32 paged attention in jnp; inputs validated, scales f32[Hkv] or per-token."""
  batch, num_heads, head_dim = q.shape
  num_kv_heads, total_pages, page_size, _ = k_pages.shape
  group = num_heads // num_kv_heads
  capacity = page_table.shape[1] * page_size
  table = jnp.clip(page_table, 0, total_pages - 1)
  valid = jnp.arange(capacity)[None, :] < lengths[:, None]  # [B, L]

  def gather(pages, scale):
    x = pages[:, table].astype(jnp.float32)  # [Hkv, B, pps, page, D]
    if scale.ndim > 1:  # per-token [Hkv, P, page]
      x = x * scale[:, table][..., None]
    else:
      x = x * scale[:, None, None, None, None]
    x = x.reshape(num_kv_heads, batch, capacity, head_dim)
    return jnp.where(valid[None, :, :, None], x, 0.0)

  k = gather(k_pages, k_scale)
  v = gather(v_pages, v_scale)
  qf = q.astype(jnp.float32).reshape(batch, num_kv_heads, group, head_dim)
  hp = lax.Precision.HIGHEST
  logits = jnp.einsum("bhgd,hbld->bhgl", qf, k, precision=hp) * sm_scale
  logits = jnp.where(valid[:, None, None, :], logits, -jnp.inf)
  probs = jax.nn.softmax(logits, axis=-1)
  probs = jnp.where(lengths[:, None, None, None] > 0, probs, 0.0)  # idle slot -> 0, not NaN
  out = jnp.einsum("bhgl,hbld->bhgd", probs, v, precision=hp)
  return out.reshape(batch, num_heads, head_dim)


def paged_attention_reference(
  q: Float[Array, "B H D"],
  k_pages: Float[Array, "Hkv P page D"],
  v_pages: Float[Array, "Hkv P page D"],
  lengths: Int[Array, " B"],
  page_table: Int[Array, "B pages_per_sequence"],
  *,
  sm_scale: float | None = None,
  k_scale: Float[Array, "..."] | None = None,
  v_scale: Float[Array, "..."] | None = None,
) -> Float[Array, "B H D"]:
  """Pure-jnp float32 reference of `paged_attention` (same formula, same validator).

  Gathers every sequence's pages into a dense `[Hkv, B, capacity, D]` float32
  tensor, multiplies by the scales, zeroes positions >= length with `where`, and
  applies a masked softmax. Not for production: it materializes the dense cache.

  Args:
    q: `[B, H, D]` queries.
    k_pages: `[Hkv, P, page_size, D]`.
    v_pages: `[Hkv, P, page_size, D]`.
    lengths: i32`[B]`.
    page_table: i32`[B, pages_per_sequence]`.
    sm_scale: None means 1/sqrt(D).
    k_scale: float32 scalar or `[Hkv]` (None: 1, not allowed for FP8 pages), or
      per-token `[Hkv, P, page_size]`.
    v_scale: same for V (the same kind as `k_scale`).

  Returns:
    float32 `[B, H, D]`.
  """
  sm_scale, k_scale, v_scale = validate_paged_attention_inputs(
    q, k_pages, v_pages, lengths, page_table, sm_scale=sm_scale, k_scale=k_scale, v_scale=v_scale
  )
  return _reference_math(
    q, k_pages, v_pages, lengths, page_table, k_scale, v_scale, sm_scale=sm_scale
  )
