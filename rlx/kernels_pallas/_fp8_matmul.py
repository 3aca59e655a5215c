"""FP8 blockwise-scaled matmul (DeepSeek-V3 / DeepGEMM convention): Pallas kernel + reference.

With activations quantized per token and 128-wide K group (`x_scale[m, kb]`) and
weights per 128x128 block (`w_scale[kb, nb]`):

  out[m, n] = sum_kb x_scale[m, kb] * w_scale[kb, n // 128]
                     * sum_{k in block kb} x_q[m, k] * w_q[k, n]

each inner 128-long sum accumulated in float32 and scaled before it is added
to the float32 accumulator (DeepSeek-V3, arXiv:2412.19437, Sec. 3.3; DeepGEMM).

Shapes not divisible by 128 are supported by zero padding (documented choice):
K is padded with zeros in both operands (zeros add nothing, so the result is
exact), M and N are padded up to the tile sizes and the result is sliced back.

File order: constants -> kernel over refs -> `pallas_call` -> public wrapper
(shared validator) -> `fp8_blockwise_matmul_reference`.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as plgpu
from jaxtyping import Array, Float

from rlx.kernels_pallas._fp8_quant import is_fp8

BLOCK = 128  # quantization block along K (and along N for the weight scales)
IMPLS = ("auto", "pallas", "pallas_gpu", "pallas_tpu", "xla")


def _fp8_matmul_kernel(
  x_ref,  # [block_m, Kp] FP8 activations (this row tile, all of K)
  x_scale_ref,  # f32[block_m, num_k_blocks_padded]
  w_ref,  # [Kp, BLOCK] FP8 weights (this column tile, all of K)
  w_scale_ref,  # f32[num_k_blocks_padded, BLOCK]: the tile's block scale per column
  o_ref,  # [block_m, BLOCK] out_dtype
  *,
  num_k_blocks: int,
  dot_dtype,
  select_scales_by_mask: bool,
):
  """One [block_m, 128] output tile: loop over K blocks, scale each partial product."""
  block_m = x_ref.shape[0]
  num_kb_padded = x_scale_ref.shape[1]
  if select_scales_by_mask:  # TPU-friendly: no dynamic lane slicing
    x_scales = x_scale_ref[...]
    w_scales = w_scale_ref[...]
    lane = lax.broadcasted_iota(jnp.int32, (block_m, num_kb_padded), 1)
    sublane = lax.broadcasted_iota(jnp.int32, (num_kb_padded, BLOCK), 0)

  def body(kb, acc):
    k0 = pl.multiple_of(kb * BLOCK, BLOCK)
    x = x_ref[:, pl.ds(k0, BLOCK)].astype(dot_dtype)
    w = w_ref[pl.ds(k0, BLOCK), :].astype(dot_dtype)
    part = lax.dot_general(x, w, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
    if select_scales_by_mask:
      xs = jnp.sum(jnp.where(lane == kb, x_scales, 0.0), axis=1, keepdims=True)
      ws = jnp.sum(jnp.where(sublane == kb, w_scales, 0.0), axis=0, keepdims=True)
    else:  # GPU: load the one column/row of scales
      xs = x_scale_ref[:, pl.ds(kb, 1)]  # [block_m, 1]
      ws = w_scale_ref[pl.ds(kb, 1), :]  # [1, BLOCK]
    return acc + part * xs * ws

  acc = lax.fori_loop(0, num_k_blocks, body, jnp.zeros((block_m, BLOCK), jnp.float32))
  o_ref[...] = acc.astype(o_ref.dtype)


def _next_pow2(n: int) -> int:
  return 1 << max(0, (int(n) - 1).bit_length())


def _fp8_matmul_pallas(x_q, x_scale, w_q, w_scale, *, out_dtype, block_m, tpu, interpret):
  m, k = x_q.shape
  n = w_q.shape[1]
  nk = -(-k // BLOCK)
  nk_padded = _next_pow2(nk)
  block_m = min(block_m, max(16, _next_pow2(m)))
  mp = -(-m // block_m) * block_m
  np_ = -(-n // BLOCK) * BLOCK
  kp = nk * BLOCK
  x_q = jnp.pad(x_q, ((0, mp - m), (0, kp - k)))
  w_q = jnp.pad(w_q, ((0, kp - k), (0, np_ - n)))
  x_scale = jnp.pad(x_scale.astype(jnp.float32), ((0, mp - m), (0, nk_padded - nk)))
  w_scale_cols = jnp.repeat(w_scale.astype(jnp.float32), BLOCK, axis=1)  # [nk, Np]
  w_scale_cols = jnp.pad(w_scale_cols, ((0, nk_padded - nk), (0, 0)))
  # Triton supports FP8 x FP8 dots on Hopper when both operands share the format;
  # TPU v5e/v6e have no FP8 MXU path, so the TPU kernel upcasts to bf16 (exact).
  dot_dtype = x_q.dtype if (x_q.dtype == w_q.dtype and not tpu) else jnp.bfloat16
  kernel = functools.partial(
    _fp8_matmul_kernel,
    num_k_blocks=nk,
    dot_dtype=dot_dtype,
    select_scales_by_mask=tpu,
  )
  if tpu:
    compiler_params = pltpu.CompilerParams(dimension_semantics=("parallel", "parallel"))
  else:  # explicit Triton params: with None, jax 0.10 may pick the Mosaic GPU backend
    compiler_params = plgpu.CompilerParams(num_warps=8, num_stages=3)
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
    out_shape=jax.ShapeDtypeStruct((mp, np_), out_dtype),
    interpret=interpret,
    compiler_params=compiler_params,
    name="rlx_fp8_blockwise_matmul",
  )(x_q, x_scale, w_q, w_scale_cols)
  return out[:m, :n]


def validate_fp8_matmul_inputs(x_q, x_scale, w_q, w_scale):
  """Checks ranks, dtypes and scale shapes; shared by the kernel and the reference."""
  for name, x in (("x_q", x_q), ("x_scale", x_scale), ("w_q", w_q), ("w_scale", w_scale)):
    if np.ndim(x) != 2:
      raise ValueError(f"`{name}` must have rank 2, got shape {tuple(np.shape(x))}.")
  m, k = x_q.shape
  k2, n = w_q.shape
  if k != k2:
    raise ValueError(f"Contracting dims differ: `x_q` is [M={m}, K={k}], `w_q` is [K={k2}, N={n}].")
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
  for name, s in (("x_scale", x_scale), ("w_scale", w_scale)):
    if not jnp.issubdtype(s.dtype, jnp.floating):
      raise ValueError(f"`{name}` must be a float array, got {s.dtype}.")


def _check_out_dtype(out_dtype):
  if not jnp.issubdtype(jnp.dtype(out_dtype), jnp.floating) or is_fp8(out_dtype):
    raise ValueError(
      f"`out_dtype` must be a float dtype (e.g. bfloat16, float32), got {jnp.dtype(out_dtype)}."
    )


@functools.partial(jax.jit, static_argnames=("out_dtype", "impl", "interpret", "block_m"))
def _fp8_matmul_jit(x_q, x_scale, w_q, w_scale, *, out_dtype, impl, interpret, block_m):
  if impl == "xla":
    return _reference_math(x_q, x_scale, w_q, w_scale).astype(out_dtype)
  return _fp8_matmul_pallas(
    x_q, x_scale, w_q, w_scale, out_dtype=out_dtype, block_m=block_m,
    tpu=impl == "pallas_tpu", interpret=interpret,
  )  # fmt: skip


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
) -> Float[Array, "M N"]:
  """FP8 x FP8 matmul with per-(token, 128-K-group) and per-128x128-block scales.

  `out[m, n] = sum_kb x_scale[m, kb] * w_scale[kb, n // 128] * (x_q[m, kb] . w_q[kb, n])`,
  each 128-long partial dot accumulated in float32 (DeepSeek-V3, arXiv:2412.19437;
  DeepGEMM). Inputs come from `quantize_fp8_per_token_group(x, 128)` and
  `quantize_fp8_blockwise(w, (128, 128))`.

  Kernel: a `pl.pallas_call` over [block_m, 128] output tiles with an in-kernel
  loop over K blocks; on GPU it lowers through the Pallas Triton backend with a
  native FP8 x FP8 dot (both operands the same format; mixed formats upcast to
  bf16); on TPU the dot runs in bf16 (exact for FP8 inputs; v5e/v6e have no FP8
  MXU). `impl="auto"`: Pallas on GPU/TPU, XLA reference on CPU.
  K, M, N need not be multiples of 128: zero padding (exact), see module doc.

  Args:
    x_q: `[M, K]` FP8 activations.
    x_scale: float32 `[M, ceil(K/128)]`.
    w_q: `[K, N]` FP8 weights.
    w_scale: float32 `[ceil(K/128), ceil(N/128)]`.
    out_dtype: output dtype (default bfloat16).
    impl: "auto" | "pallas" (the kernel of the current backend; on CPU chosen by
      `interpret`) | "pallas_gpu" | "pallas_tpu" | "xla" (reference math).
    interpret: Pallas interpret mode (True runs the GPU kernel on CPU,
      `pltpu.InterpretParams()` the TPU variant).
    block_m: rows per output tile (power of two >= 16; shrunk for small M).

  Returns:
    `[M, N]` in `out_dtype`.
  """
  validate_fp8_matmul_inputs(x_q, x_scale, w_q, w_scale)
  _check_out_dtype(out_dtype)
  if impl not in IMPLS:
    raise ValueError(f"`impl` must be one of {IMPLS}, got {impl!r}.")
  if block_m < 16 or block_m & (block_m - 1):
    raise ValueError(f"`block_m` must be a power of two >= 16, got {block_m}.")
  backend = jax.default_backend()
  if impl == "auto":
    impl = {"gpu": "pallas_gpu", "tpu": "pallas_tpu"}.get(backend, "xla")
  elif impl == "pallas":
    tpu = backend == "tpu" or isinstance(interpret, pltpu.InterpretParams)
    impl = "pallas_tpu" if tpu else "pallas_gpu"
  if impl != "xla" and backend not in ("gpu", "tpu") and interpret is False:
    raise ValueError(
      f"impl={impl!r} off GPU/TPU needs interpret=True (GPU kernel) or "
      "interpret=pltpu.InterpretParams() (TPU kernel)."
    )
  return _fp8_matmul_jit(
    x_q, x_scale, w_q, w_scale, out_dtype=jnp.dtype(out_dtype), impl=impl, interpret=interpret,
    block_m=block_m,
  )  # fmt: skip


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
