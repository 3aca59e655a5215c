"""FP8 blockwise-scaled matmul (DeepSeek-V3 / DeepGEMM convention): Pallas kernels + reference.

With activations quantized per token and 128-wide K group (`x_scale[m, kb]`) and
weights per 128x128 block (`w_scale[kb, nb]`):

  out[m, n] = sum_kb x_scale[m, kb] * w_scale[kb, n // 128]
                     * sum_{k in block kb} x_q[m, k] * w_q[k, n]

each inner 128-long sum accumulated in float32 and scaled before it is added
to the float32 accumulator (DeepSeek-V3, https://arxiv.org/abs/2412.19437,
Sec. 3.3 "fine-grained quantization"; public kernels: DeepGEMM,
https://github.com/deepseek-ai/DeepGEMM, and vLLM's `w8a8_block_fp8_matmul`).

Shapes not divisible by 128 are supported by zero padding (documented choice):
K is padded with zeros in both operands (zeros add nothing, so the result is
exact), M and N are padded up to the tile sizes and the result is sliced back.

Two kernels, one formula:
  * GPU (Pallas Triton): grid (M tiles, N tiles); each program loops over the
    K blocks in-kernel and Triton software-pipelines the loop's loads through
    shared memory (`num_stages`), as in the Triton matmul tutorial and JAX's
    `pallas/ops/gpu` kernels. Triton grid programs run in parallel, so K cannot
    be a grid axis there.
  * TPU (Pallas Mosaic): grid (M tiles, N tiles, K steps) with K sequential
    ("arbitrary") and a float32 VMEM accumulator scratch that is zeroed at the
    first K step and written out at the last (the TPU matmul pattern of the
    Pallas docs): each step DMAs one `[block_m, block_k]` / `[block_k, 128]` pair
    of FP8 tiles, double-buffered, so large-K layers never hold a whole K strip
    in VMEM.

File order: constants -> kernels over refs -> `pallas_call`s -> public wrapper
(shared validator, dispatch) -> `fp8_blockwise_matmul_reference`.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as plgpu
from jax.sharding import PartitionSpec
from jaxtyping import Array, Float

from rlx.kernels_pallas._common import (
  arrays_platform,
  check_float_array,
  is_concrete,
  next_pow2,
  resolve_impl,
)
from rlx.kernels_pallas._fp8_quant import is_fp8

BLOCK = 128  # quantization block along K (and along N for the weight scales)
# TPU kernel: K columns per grid step when `block_k` is not given (4 quantization blocks).
DEFAULT_BLOCK_K = 512


def _fp8_matmul_gpu_kernel(
  x_ref,  # [block_m, Kp] FP8 activations (this row tile, all of K)
  x_scale_ref,  # f32[block_m, num_k_blocks_padded]
  w_ref,  # [Kp, BLOCK] FP8 weights (this column tile, all of K)
  w_scale_ref,  # f32[num_k_blocks_padded, BLOCK]: the tile's block scale per column
  o_ref,  # [block_m, BLOCK] out_dtype
  *,
  num_k_blocks: int,
  dot_dtype,
):
  """One [block_m, 128] output tile: loop over K blocks, scale each partial product."""
  block_m = x_ref.shape[0]

  def body(kb, acc):
    k0 = pl.multiple_of(kb * BLOCK, BLOCK)
    x = x_ref[:, pl.ds(k0, BLOCK)].astype(dot_dtype)
    w = w_ref[pl.ds(k0, BLOCK), :].astype(dot_dtype)
    part = lax.dot_general(x, w, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
    xs = x_scale_ref[:, pl.ds(kb, 1)]  # [block_m, 1]
    ws = w_scale_ref[pl.ds(kb, 1), :]  # [1, BLOCK]
    return acc + part * xs * ws

  acc = lax.fori_loop(0, num_k_blocks, body, jnp.zeros((block_m, BLOCK), jnp.float32))
  o_ref[...] = acc.astype(o_ref.dtype)


def _fp8_matmul_tpu_kernel(
  x_ref,  # VMEM [block_m, block_k] FP8 activations of this (row tile, K step)
  x_scale_ref,  # VMEM f32[block_m, num_k_blocks_padded]: all K scales of the row tile
  w_ref,  # VMEM [block_k, BLOCK] FP8 weights of this (K step, column tile)
  w_scale_ref,  # VMEM f32[num_k_blocks_padded, BLOCK]: all K scales of the column tile
  o_ref,  # VMEM [block_m, BLOCK] out_dtype, written at the last K step
  acc_ref,  # VMEM scratch f32[block_m, BLOCK], carried across the K steps
  *,
  k_blocks_per_step: int,
  dot_dtype,
):
  """One (row tile, column tile, K step): add this step's scaled 128-long partial dots."""
  k_step = pl.program_id(2)
  block_m = x_ref.shape[0]
  num_kb_padded = x_scale_ref.shape[1]

  @pl.when(k_step == 0)
  def _init():
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

  # Scales are picked by a mask-and-sum over the lane axis: no dynamic lane slicing.
  x_scales = x_scale_ref[...]
  w_scales = w_scale_ref[...]
  lane = lax.broadcasted_iota(jnp.int32, (block_m, num_kb_padded), 1)
  sublane = lax.broadcasted_iota(jnp.int32, (num_kb_padded, BLOCK), 0)
  acc = acc_ref[...]
  for i in range(k_blocks_per_step):  # static unroll over the 128-wide K blocks
    kb = k_step * k_blocks_per_step + i
    x = x_ref[:, i * BLOCK : (i + 1) * BLOCK].astype(dot_dtype)
    w = w_ref[i * BLOCK : (i + 1) * BLOCK, :].astype(dot_dtype)
    part = lax.dot_general(x, w, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
    xs = jnp.sum(jnp.where(lane == kb, x_scales, 0.0), axis=1, keepdims=True)  # [block_m, 1]
    ws = jnp.sum(jnp.where(sublane == kb, w_scales, 0.0), axis=0, keepdims=True)  # [1, BLOCK]
    acc = acc + part * xs * ws
  acc_ref[...] = acc

  @pl.when(k_step == pl.num_programs(2) - 1)
  def _finish():
    o_ref[...] = acc_ref[...].astype(o_ref.dtype)


def _fp8_matmul_pallas(x_q, x_scale, w_q, w_scale, *, out_dtype, block_m, block_k, tpu, interpret):
  """Pads to the tiles, runs the GPU or TPU `pallas_call`, slices the result back."""
  m, k = x_q.shape
  n = w_q.shape[1]
  nk = -(-k // BLOCK)
  # TPU: K steps of `k_blocks_per_step` quantization blocks; GPU: one step holding all of K.
  k_blocks_per_step = min(block_k // BLOCK, nk) if tpu else nk
  num_k_steps = -(-nk // k_blocks_per_step)
  nk_full = num_k_steps * k_blocks_per_step
  nk_padded = next_pow2(nk_full)  # scale columns (Triton blocks are powers of two)
  block_m = min(block_m, max(16, next_pow2(m)))
  mp = -(-m // block_m) * block_m
  np_ = -(-n // BLOCK) * BLOCK
  kp = nk_full * BLOCK
  x_q = jnp.pad(x_q, ((0, mp - m), (0, kp - k)))
  w_q = jnp.pad(w_q, ((0, kp - k), (0, np_ - n)))
  x_scale = jnp.pad(x_scale.astype(jnp.float32), ((0, mp - m), (0, nk_padded - nk)))
  w_scale_cols = jnp.repeat(w_scale.astype(jnp.float32), BLOCK, axis=1)  # [nk, Np]
  w_scale_cols = jnp.pad(w_scale_cols, ((0, nk_padded - nk), (0, 0)))
  # Triton supports FP8 x FP8 dots on Hopper when both operands share the format;
  # TPU v5e/v6e have no FP8 MXU path, so the TPU kernel upcasts to bf16 (exact).
  dot_dtype = x_q.dtype if (x_q.dtype == w_q.dtype and not tpu) else jnp.bfloat16
  out_shape = jax.ShapeDtypeStruct((mp, np_), out_dtype)
  if tpu:
    block_k = k_blocks_per_step * BLOCK
    kernel = functools.partial(
      _fp8_matmul_tpu_kernel, k_blocks_per_step=k_blocks_per_step, dot_dtype=dot_dtype
    )
    out = pl.pallas_call(
      kernel,
      grid=(mp // block_m, np_ // BLOCK, num_k_steps),
      in_specs=[
        pl.BlockSpec((block_m, block_k), lambda i, j, s: (i, s)),
        pl.BlockSpec((block_m, nk_padded), lambda i, j, s: (i, 0)),
        pl.BlockSpec((block_k, BLOCK), lambda i, j, s: (s, j)),
        pl.BlockSpec((nk_padded, BLOCK), lambda i, j, s: (0, j)),
      ],
      out_specs=pl.BlockSpec((block_m, BLOCK), lambda i, j, s: (i, j)),
      out_shape=out_shape,
      scratch_shapes=[pltpu.VMEM((block_m, BLOCK), jnp.float32)],
      compiler_params=pltpu.CompilerParams(
        dimension_semantics=("parallel", "parallel", "arbitrary")
      ),
      interpret=interpret,
      name="rlx_fp8_blockwise_matmul_tpu",
    )(x_q, x_scale, w_q, w_scale_cols)
    return out[:m, :n]
  kernel = functools.partial(_fp8_matmul_gpu_kernel, num_k_blocks=nk, dot_dtype=dot_dtype)
  out = pl.pallas_call(
    kernel,
    grid=(mp // block_m, np_ // BLOCK),
    in_specs=[
      pl.BlockSpec((block_m, kp), lambda i, j: (i, 0)),
      pl.BlockSpec((block_m, nk_padded), lambda i, j: (i, 0)),
      pl.BlockSpec((kp, BLOCK), lambda i, j: (0, j)),
      pl.BlockSpec((nk_padded, BLOCK), lambda i, j: (0, j)),
    ],
    out_specs=pl.BlockSpec((block_m, BLOCK), lambda i, j: (i, j)),
    out_shape=out_shape,
    interpret=interpret,
    # Explicit Triton params: with None, jax 0.10 may pick the Mosaic GPU backend.
    compiler_params=plgpu.CompilerParams(num_warps=8, num_stages=3),
    name="rlx_fp8_blockwise_matmul",
  )(x_q, x_scale, w_q, w_scale_cols)
  return out[:m, :n]


def validate_fp8_matmul_inputs(x_q, x_scale, w_q, w_scale):
  """Checks ranks, dtypes and scale shapes; shared by the kernels and the reference.

  Raises:
    ValueError naming the offending argument.
  """
  for name, x in (("x_q", x_q), ("x_scale", x_scale), ("w_q", w_q), ("w_scale", w_scale)):
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
      raise ValueError(f"`{name}` must be an array, got {type(x).__name__}.")
    if np.ndim(x) != 2:
      raise ValueError(f"`{name}` must have rank 2, got shape {tuple(np.shape(x))}.")
  m, k = x_q.shape
  k2, n = w_q.shape
  if k != k2:
    raise ValueError(f"Contracting dims differ: `x_q` is [M={m}, K={k}], `w_q` is [K={k2}, N={n}].")
  if 0 in (m, k, n):
    raise ValueError(f"Empty operands: `x_q` is [M={m}, K={k}], `w_q` is [K={k2}, N={n}].")
  for name, x in (("x_q", x_q), ("w_q", w_q)):
    if not is_fp8(x.dtype):
      raise ValueError(f"`{name}` must be float8_e4m3fn or float8_e5m2, got {x.dtype}.")
  nk, nn = -(-k // BLOCK), -(-n // BLOCK)
  if tuple(x_scale.shape) != (m, nk):
    raise ValueError(
      f"`x_scale` must be [M, ceil(K/{BLOCK})] = {(m, nk)}, got {tuple(x_scale.shape)}."
    )
  if tuple(w_scale.shape) != (nk, nn):
    raise ValueError(
      f"`w_scale` must be [ceil(K/{BLOCK}), ceil(N/{BLOCK})] = {(nk, nn)}, got "
      f"{tuple(w_scale.shape)}."
    )
  check_float_array(x_scale, "x_scale")
  check_float_array(w_scale, "w_scale")


def _check_out_dtype(out_dtype):
  try:
    dtype = jnp.dtype(out_dtype)
  except (TypeError, ValueError) as e:
    raise ValueError(f"`out_dtype` must be a float dtype, got {out_dtype!r}.") from e
  if not jnp.issubdtype(dtype, jnp.floating) or is_fp8(dtype):
    raise ValueError(f"`out_dtype` must be a float dtype (e.g. bfloat16, float32), got {dtype}.")


@functools.partial(
  jax.jit, static_argnames=("out_dtype", "impl", "interpret", "block_m", "block_k")
)
def _fp8_matmul_jit(x_q, x_scale, w_q, w_scale, *, out_dtype, impl, interpret, block_m, block_k):
  if impl == "xla":
    return _reference_math(x_q, x_scale, w_q, w_scale).astype(out_dtype)
  return _fp8_matmul_pallas(
    x_q, x_scale, w_q, w_scale, out_dtype=out_dtype, block_m=block_m, block_k=block_k,
    tpu=impl == "pallas_tpu", interpret=interpret,
  )  # fmt: skip


def _multi_device_mesh(x):
  """The mesh `x` is laid out on (a tracer's abstract mesh, an array's `NamedSharding`
  mesh) when it spans more than one device, else None. None inside a `shard_map` body
  (manual mesh axes): there the kernel already runs per device."""
  sharding = getattr(x if is_concrete(x) else jax.typeof(x), "sharding", None)
  mesh = getattr(sharding, "mesh", None)
  if mesh is None or getattr(mesh, "empty", False) or mesh.size <= 1:
    return None
  if any(t == jax.sharding.AxisType.Manual for t in getattr(mesh, "axis_types", ())):
    return None
  return mesh


def _row_axes(mesh, rows: int) -> tuple[str, ...]:
  """Mesh axes, in mesh order, that split `rows` evenly (each kept while the product divides)."""
  axes, size = [], 1
  for name in mesh.axis_names:
    n = mesh.shape[name]
    if n > 1 and rows % (size * n) == 0:
      axes.append(name)
      size *= n
  return tuple(axes)


def fp8_blockwise_matmul(
  x_q: Float[Array, "M K"],
  x_scale: Float[Array, "M Kb"],
  w_q: Float[Array, "K N"],
  w_scale: Float[Array, "Kb Nb"],
  *,
  out_dtype=jnp.bfloat16,
  impl: str = "auto",
  interpret=False,
  block_m: int = 128,
  block_k: int = DEFAULT_BLOCK_K,
) -> Float[Array, "M N"]:
  """FP8 x FP8 matmul with per-(token, 128-K-group) and per-128x128-block scales.

  `out[m, n] = sum_kb x_scale[m, kb] * w_scale[kb, n // 128] * (x_q[m, kb] . w_q[kb, n])`,
  each 128-long partial dot accumulated in float32 (DeepSeek-V3,
  https://arxiv.org/abs/2412.19437, Sec. 3.3; DeepGEMM,
  https://github.com/deepseek-ai/DeepGEMM). Inputs come from
  `quantize_fp8_per_token_group(x, 128)` and `quantize_fp8_blockwise(w, (128, 128))`.

  Kernels (see the module doc): on GPU a Pallas Triton kernel over
  [block_m, 128] output tiles with an in-kernel, software-pipelined loop over
  the K blocks and a native FP8 x FP8 dot (both operands the same format; mixed
  formats upcast to bf16); on TPU a Pallas Mosaic kernel whose grid has a
  sequential K axis of `block_k`-wide steps with a float32 VMEM accumulator, the
  dot in bf16 (exact for FP8 inputs; v5e/v6e have no FP8 MXU).
  K, M, N need not be multiples of 128: zero padding (exact), see module doc.

  On a mesh of more than one device (the inputs sharded over it, e.g. inside
  a `jit` of the sampler), a Pallas kernel runs per device in a `shard_map`,
  as Pallas kernels cannot be partitioned by XLA: the rows are split over
  every mesh axis that divides M and the weights and their scales are
  replicated (gathered onto each device). The XLA path is partitioned by XLA.

  Args:
    x_q: `[M, K]` FP8 activations.
    x_scale: float32 `[M, ceil(K/128)]`.
    w_q: `[K, N]` FP8 weights.
    w_scale: float32 `[ceil(K/128), ceil(N/128)]`.
    out_dtype: output dtype (default bfloat16).
    impl: "auto" (the Pallas kernel of the platform the inputs live on, the XLA
      reference math on CPU) | "pallas" (that platform's kernel; on CPU chosen
      by `interpret`) | "pallas_gpu" | "pallas_tpu" | "xla" (reference math).
    interpret: Pallas interpret mode (True runs the GPU kernel on CPU,
      `pltpu.InterpretParams()` the TPU kernel).
    block_m: rows per output tile (power of two >= 16; shrunk for small M).
    block_k: TPU kernel: K columns per grid step, a positive multiple of 128
      (shrunk to K); the GPU kernel loops over all of K in one program.

  Returns:
    `[M, N]` in `out_dtype`.
  """
  validate_fp8_matmul_inputs(x_q, x_scale, w_q, w_scale)
  _check_out_dtype(out_dtype)
  if (
    isinstance(block_m, bool)
    or not isinstance(block_m, int | np.integer)
    or block_m < 16
    or (block_m & (block_m - 1))
  ):
    raise ValueError(f"`block_m` must be a power of two >= 16, got {block_m!r}.")
  if (
    isinstance(block_k, bool)
    or not isinstance(block_k, int | np.integer)
    or block_k <= 0
    or block_k % BLOCK
  ):
    raise ValueError(f"`block_k` must be a positive multiple of {BLOCK}, got {block_k!r}.")
  block_m, block_k = int(block_m), int(block_k)
  platform = arrays_platform(x_q, x_scale, w_q, w_scale)
  impl = resolve_impl(impl, interpret, platform)
  matmul = functools.partial(
    _fp8_matmul_jit, out_dtype=jnp.dtype(out_dtype), impl=impl, interpret=interpret,
    block_m=block_m, block_k=block_k,
  )  # fmt: skip
  mesh = _multi_device_mesh(x_q) if impl != "xla" else None
  if mesh is None:
    return matmul(x_q, x_scale, w_q, w_scale)
  rows = PartitionSpec(_row_axes(mesh, x_q.shape[0]) or None)
  return jax.shard_map(
    matmul,
    mesh=mesh,
    in_specs=(rows, rows, PartitionSpec(), PartitionSpec()),
    out_specs=rows,
    check_vma=False,
  )(x_q, x_scale, w_q, w_scale)


@jax.jit
def _reference_math(x_q, x_scale, w_q, w_scale):
  """float32 blockwise-scaled product via a scan over K blocks (no [nk, M, N] temp)."""
  m, k = x_q.shape
  n = w_q.shape[1]
  nk = -(-k // BLOCK)
  kp = nk * BLOCK
  x = jnp.pad(x_q.astype(jnp.float32), ((0, 0), (0, kp - k))).reshape(m, nk, BLOCK)
  w = jnp.pad(w_q.astype(jnp.float32), ((0, kp - k), (0, 0))).reshape(nk, BLOCK, n)
  ws = jnp.repeat(w_scale.astype(jnp.float32), BLOCK, axis=1)[:, :n]  # [nk, N]
  xs = x_scale.astype(jnp.float32).T  # [nk, M]

  def step(acc, blk):
    xb, wb, xsb, wsb = blk
    part = jnp.dot(xb, wb, precision=lax.Precision.HIGHEST)
    return acc + part * xsb[:, None] * wsb[None, :], None

  acc, _ = lax.scan(step, jnp.zeros((m, n), jnp.float32), (x.transpose(1, 0, 2), w, xs, ws))
  return acc


def fp8_blockwise_matmul_reference(
  x_q: Float[Array, "M K"],
  x_scale: Float[Array, "M Kb"],
  w_q: Float[Array, "K N"],
  w_scale: Float[Array, "Kb Nb"],
  *,
  out_dtype=jnp.float32,
) -> Float[Array, "M N"]:
  """Pure-jnp float32 reference of `fp8_blockwise_matmul` (same formula and validator).

  Args:
    x_q: `[M, K]` FP8; x_scale: f32 `[M, ceil(K/128)]`.
    w_q: `[K, N]` FP8; w_scale: f32 `[ceil(K/128), ceil(N/128)]`.
    out_dtype: result dtype (default float32).

  Returns:
    `[M, N]` in `out_dtype`.
  """
  validate_fp8_matmul_inputs(x_q, x_scale, w_q, w_scale)
  _check_out_dtype(out_dtype)
  return _reference_math(x_q, x_scale, w_q, w_scale).astype(out_dtype)
