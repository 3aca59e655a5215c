"""FP8 quantizers: 128x128 weight blocks and dynamic 1x128 activation groups.

Convention (DeepSeek-V3, https://arxiv.org/abs/2412.19437, Sec. 3.3; DeepGEMM,
https://github.com/deepseek-ai/DeepGEMM; vLLM's `per_token_group_quant_fp8`): a
block of values `x` is stored as `x_q = saturate(x / s)` in an FP8 format with the float32
scale `s = max(amax(|x|), 1e-10) / fmax`, where `fmax` is the format's largest
finite value (448 for float8_e4m3fn, 57344 for float8_e5m2). Dequantization is
`x ~= x_q.astype(float32) * s`. `saturate` clamps to [-fmax, fmax] before the
cast, so values far beyond range become +-fmax instead of inf/NaN.

Shapes that are not multiples of the block size are allowed: the last (partial)
block gets its own scale computed over its real elements only.

Non-finite inputs are not saturated: a block holding +-inf gets scale inf (its
finite values quantize to 0 and the inf to NaN), a block holding NaN gets scale
NaN, so the whole block dequantizes to NaN and the problem stays visible instead
of being clamped into plausible numbers. Signed zeros are kept (-0 -> -0).
"""

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

# Smallest amax used for a scale, so all-zero blocks get a finite, non-zero scale.
AMAX_FLOOR = 1e-10
FP8_DTYPES = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))


def as_dtype(dtype, name: str = "dtype") -> jnp.dtype:
  """`jnp.dtype(dtype)`, or a ValueError naming `name` for something that is no dtype."""
  try:
    return jnp.dtype(dtype)
  except (TypeError, ValueError) as e:
    raise ValueError(f"`{name}` must be a dtype, got {dtype!r}.") from e


def is_fp8(dtype) -> bool:
  """True for the two FP8 formats rlx supports (float8_e4m3fn, float8_e5m2)."""
  return as_dtype(dtype) in FP8_DTYPES


def fp8_max(dtype) -> float:
  """Largest finite value of an FP8 dtype (448.0 for e4m3fn, 57344.0 for e5m2)."""
  dtype = as_dtype(dtype)
  if not is_fp8(dtype):
    raise ValueError(f"`dtype` must be float8_e4m3fn or float8_e5m2, got {dtype}.")
  return float(jnp.finfo(dtype).max)


def saturating_cast(x: Array, dtype) -> Array:
  """Casts `x` to `dtype`, clamping to the finite range of FP8 dtypes first.

  For non-FP8 `dtype` this is a plain `astype`. NaN stays NaN.
  """
  dtype = as_dtype(dtype)
  x = jnp.asarray(x)
  if is_fp8(dtype):
    fmax = fp8_max(dtype)
    x = jnp.clip(x.astype(jnp.float32), -fmax, fmax)
  return x.astype(dtype)


def _check_fp8_dtype(dtype) -> jnp.dtype:
  dtype = as_dtype(dtype)
  if not is_fp8(dtype):
    raise ValueError(f"`dtype` must be float8_e4m3fn or float8_e5m2, got {dtype}.")
  return dtype


def _check_block(block, name: str) -> int:
  if not isinstance(block, (int, np.integer)) or isinstance(block, bool) or block <= 0:
    raise ValueError(f"`{name}` must be a positive int, got {block!r}.")
  return int(block)


def _check_matrix(x, name: str, dims: str) -> None:
  """Checks that `x` is a non-empty rank-2 array of a real (float or int) dtype."""
  if not hasattr(x, "shape") or not hasattr(x, "dtype"):
    raise ValueError(f"`{name}` must be an array, got {type(x).__name__}.")
  if np.ndim(x) != 2:
    raise ValueError(f"`{name}` must have rank 2 {dims}, got shape {tuple(np.shape(x))}.")
  if 0 in x.shape:
    raise ValueError(f"`{name}` must be a non-empty {dims} matrix, got shape {tuple(x.shape)}.")
  if not (jnp.issubdtype(x.dtype, jnp.floating) or jnp.issubdtype(x.dtype, jnp.integer)):
    raise ValueError(f"`{name}` must hold real numbers, got dtype {x.dtype}.")


def _check_matrix_and_block_pair(x, name: str, block) -> tuple[int, int]:
  """Checks that `x` is `[K, N]` and `block` a pair of positive ints; returns the pair."""
  if np.ndim(x) != 2:
    raise ValueError(f"`{name}` must have rank 2 [K, N], got shape {tuple(np.shape(x))}.")
  if not isinstance(block, (tuple, list)) or len(block) != 2:
    raise ValueError(f"`block` must be a pair (bk, bn), got {block!r}.")
  return _check_block(block[0], "block[0]"), _check_block(block[1], "block[1]")


def _pad_to(x: Array, multiples: tuple[int, int]) -> Array:
  pads = [(0, -s % m) for s, m in zip(x.shape, multiples, strict=True)]
  return jnp.pad(x, pads)


def quantize_fp8_blockwise(
  w: Float[Array, "K N"],
  block: tuple[int, int] = (128, 128),
  dtype=jnp.float8_e4m3fn,
) -> tuple[Float[Array, "K N"], Float[Array, "Kb Nb"]]:
  """Quantizes a weight matrix to FP8 with one float32 scale per 2-D block.

  For block (i, j) covering rows [i*bk, (i+1)*bk) and columns [j*bn, (j+1)*bn):
  `s_ij = max(amax|w_block|, 1e-10) / fmax`, `w_q = clip(w / s_ij, -fmax, fmax)`
  cast to `dtype`. A block holding inf or NaN gets a non-finite scale, so its
  whole dequantized block is NaN: never clamped into plausible finite numbers.
  Reference: DeepSeek-V3 technical report (https://arxiv.org/abs/2412.19437),
  Sec. 3.3 "fine-grained quantization" (128x128 weight blocks).

  Args:
    w: weights with shape `[K, N]`, any float dtype (computed in float32).
    block: `(bk, bn)` block shape; K and N need not be multiples of it (the last
      partial block is scaled over its real elements).
    dtype: float8_e4m3fn (default) or float8_e5m2.

  Returns:
    `(w_q, w_scale)`: `w_q` `[K, N]` in `dtype`, `w_scale` float32
    `[ceil(K/bk), ceil(N/bn)]`, so that `w ~= w_q * w_scale` repeated per block.
  """
  dtype = _check_fp8_dtype(dtype)
  _check_matrix(w, "w", "[K, N]")
  bk, bn = _check_matrix_and_block_pair(w, "w", block)
  k, n = w.shape
  kb, nb = -(-k // bk), -(-n // bn)
  fmax = fp8_max(dtype)
  wp = _pad_to(w.astype(jnp.float32), (bk, bn)).reshape(kb, bk, nb, bn)
  amax = jnp.max(jnp.abs(wp), axis=(1, 3))
  scale = jnp.maximum(amax, AMAX_FLOOR) / fmax  # [kb, nb]
  wq = saturating_cast(wp / scale[:, None, :, None], dtype)
  wq = wq.reshape(kb * bk, nb * bn)[:k, :n]
  return wq, scale


def quantize_fp8_per_token_group(
  x: Float[Array, "M K"], group: int = 128, dtype=jnp.float8_e4m3fn
) -> tuple[Float[Array, "M K"], Float[Array, "M Kg"]]:
  """Dynamically quantizes activations to FP8 with one scale per token and K-group.

  For row m and group g covering columns [g*group, (g+1)*group):
  `s_mg = max(amax|x[m, group g]|, 1e-10) / fmax`, `x_q = clip(x / s_mg, +-fmax)`
  (a group holding inf or NaN dequantizes to NaN, as in `quantize_fp8_blockwise`).
  Reference: DeepSeek-V3 (https://arxiv.org/abs/2412.19437) Sec. 3.3, 1x128
  activation tiles.

  Args:
    x: activations `[M, K]`, any float dtype (computed in float32).
    group: group width along K; K need not be a multiple of it.
    dtype: float8_e4m3fn (default) or float8_e5m2.

  Returns:
    `(x_q, x_scale)`: `x_q` `[M, K]` in `dtype`, `x_scale` float32 `[M, ceil(K/group)]`.
  """
  dtype = _check_fp8_dtype(dtype)
  _check_matrix(x, "x", "[M, K]")
  group = _check_block(group, "group")
  m, k = x.shape
  kg = -(-k // group)
  fmax = fp8_max(dtype)
  xp = _pad_to(x.astype(jnp.float32), (1, group)).reshape(m, kg, group)
  amax = jnp.max(jnp.abs(xp), axis=2)
  scale = jnp.maximum(amax, AMAX_FLOOR) / fmax  # [m, kg]
  xq = saturating_cast(xp / scale[:, :, None], dtype).reshape(m, kg * group)[:, :k]
  return xq, scale


def dequantize_fp8_blockwise(
  w_q: Float[Array, "K N"], w_scale: Float[Array, "Kb Nb"], block: tuple[int, int] = (128, 128)
) -> Float[Array, "K N"]:
  """Inverse of `quantize_fp8_blockwise`: `w_q.astype(f32) * w_scale` per block.

  Args:
    w_q: `[K, N]` FP8 (or any) values.
    w_scale: float32 `[ceil(K/bk), ceil(N/bn)]`.
    block: `(bk, bn)` used at quantization.

  Returns:
    float32 `[K, N]`.
  """
  bk, bn = _check_matrix_and_block_pair(w_q, "w_q", block)
  w_scale = jnp.asarray(w_scale)
  k, n = w_q.shape
  want = (-(-k // bk), -(-n // bn))
  if tuple(np.shape(w_scale)) != want:
    raise ValueError(f"`w_scale` must have shape {want} for w_q {w_q.shape} and block {block}.")
  full = jnp.repeat(jnp.repeat(w_scale.astype(jnp.float32), bk, axis=0), bn, axis=1)
  return w_q.astype(jnp.float32) * full[:k, :n]
