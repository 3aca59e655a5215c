"""Pieces shared by the rlx.kernels_pallas kernels: constants, backend dispatch, scale checks,
the page gather of the XLA attention paths.

Dispatch follows where the input arrays live: `impl="auto"` picks the Pallas
kernel of the platform holding the inputs, so arrays placed on the CPU of a GPU
host take the XLA path, as `jax.jit` would run them there. Under tracing, a
tracer whose sharding names a mesh (a `jit` over `NamedSharding`-ed arrays or
`jax.ShapeDtypeStruct`s, a `shard_map` body) carries that mesh's platform, so a
program traced for a TPU mesh picks the Mosaic kernel even when compiled on a
CPU-only host against compile-only devices
(`jax.experimental.topologies.get_topology_desc`). Where no input names a
platform, the abstract mesh's device, then `jax.default_device`, then
`jax.default_backend()` decide.
"""

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from rlx._choices import ATTENTION_IMPLS, check_choice
from rlx.kernels_pallas._fp8_quant import is_fp8

# Finite "minus infinity" for masked logits and running maxima: exp(MASK_VALUE - m)
# underflows to 0 and MASK_VALUE - MASK_VALUE stays finite (no inf - inf = NaN), as in
# JAX's `pallas.ops.gpu.paged_attention` (`DEFAULT_MASK_VALUE`).
MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)

# Device.platform spellings -> jax.default_backend() spellings.
_PLATFORM_ALIASES = {"cuda": "gpu", "rocm": "gpu"}


def next_pow2(n: int) -> int:
  """Smallest power of two >= n (1 for n <= 1)."""
  return 1 << max(0, (int(n) - 1).bit_length())


def is_concrete(x) -> bool:
  """True unless `x` is a tracer (its values can be read on the host)."""
  return not isinstance(x, jax.core.Tracer)


def default_platform() -> str:
  """Platform that traced (placement-unknown) inputs run on.

  The platform of the abstract mesh's device when tracing under a mesh context
  (`jax.sharding.use_abstract_mesh`, e.g. of an `AbstractMesh` whose
  `abstract_device` names a platform this host lacks, to export for it), else
  the platform of `jax.default_device`, else `jax.default_backend()`.
  """
  mesh = jax.sharding.get_abstract_mesh()
  device = getattr(mesh, "abstract_device", None)
  platform = getattr(device, "platform", None)
  if platform is None:
    device = jax.config.jax_default_device
    platform = device if isinstance(device, str) else getattr(device, "platform", None)
  if platform is None:
    platform = jax.default_backend()
  return _PLATFORM_ALIASES.get(platform, platform)


def _traced_platform(x) -> str | None:
  """Platform named by a tracer's sharding (its mesh's device), None when it names none."""
  sharding = getattr(jax.typeof(x), "sharding", None)
  device = getattr(getattr(sharding, "mesh", None), "abstract_device", None)
  platform = getattr(device, "platform", None)
  return None if platform is None else _PLATFORM_ALIASES.get(platform, platform)


def _placed_platforms(x) -> set[str]:
  """Platforms of a concrete `jax.Array`'s devices, or of a `jax.ShapeDtypeStruct`'s sharding."""
  if isinstance(x, jax.Array):
    devices = x.sharding.device_set
  elif isinstance(x, jax.ShapeDtypeStruct) and x.sharding is not None:
    mesh = getattr(x.sharding, "mesh", None)
    device = getattr(mesh, "abstract_device", None)
    if device is not None:  # a NamedSharding over an AbstractMesh
      return {_PLATFORM_ALIASES.get(device.platform, device.platform)}
    devices = getattr(x.sharding, "device_set", None) or ()
  else:
    return set()
  return {_PLATFORM_ALIASES.get(d.platform, d.platform) for d in devices}


def arrays_platform(*arrays) -> str:
  """Platform ("cpu", "gpu", "tpu") on which `arrays` live, i.e. where the kernel will run.

  In order:
    1. Tracers whose sharding names a mesh give that mesh's platform: the
       program is being traced for those devices (a `jit` with sharded inputs,
       `jax.ShapeDtypeStruct`s included, or a `shard_map` body), and concrete
       arrays closed over are moved there.
    2. Concrete `jax.Array`s give their devices' platform (the union over their
       shardings' device sets); a `jax.ShapeDtypeStruct` with a sharding gives
       the platform of that sharding.
    3. Otherwise (NumPy arrays, `None`, tracers without a mesh, e.g. under a
       `jit` of single-device arrays) `default_platform()`.

  Raises:
    ValueError: when the inputs of the deciding kind live on more than one platform.
  """
  traced = {p for x in arrays if not is_concrete(x) and (p := _traced_platform(x)) is not None}
  placed = set()
  if not traced:
    for x in arrays:
      if is_concrete(x):
        placed |= _placed_platforms(x)
  platforms = traced or placed
  if len(platforms) > 1:
    raise ValueError(f"Inputs live on several platforms {sorted(platforms)}; put them on one.")
  return platforms.pop() if platforms else default_platform()


def resolve_impl(impl: str, interpret, platform: str) -> str:
  """Maps `impl` to "pallas_gpu" | "pallas_tpu" | "xla" for inputs living on `platform`.

  "auto" is the platform's Pallas kernel (XLA reference math on any other
  platform); "pallas" the platform's kernel, off GPU/TPU the TPU kernel when
  `interpret` is a `pltpu.InterpretParams` and the GPU kernel otherwise.

  Raises:
    ValueError: for an unknown `impl`, or a Pallas kernel off its hardware
      without interpret mode (True for the GPU kernel, `pltpu.InterpretParams()`
      for the TPU kernel).
  """
  from jax.experimental.pallas import tpu as pltpu

  check_choice(impl, ATTENTION_IMPLS, "impl")
  if impl == "auto":
    return {"gpu": "pallas_gpu", "tpu": "pallas_tpu"}.get(platform, "xla")
  if impl == "pallas":
    if platform in ("gpu", "tpu"):
      return f"pallas_{platform}"
    return "pallas_tpu" if isinstance(interpret, pltpu.InterpretParams) else "pallas_gpu"
  if impl == "pallas_gpu" and platform != "gpu" and interpret is False:
    raise ValueError(
      f"impl='pallas_gpu' with inputs on {platform!r} (not a GPU) needs interpret=True (got "
      "interpret=False); use impl='auto' or 'xla' for the reference path."
    )
  if impl == "pallas_tpu" and platform != "tpu" and interpret is False:
    raise ValueError(
      f"impl='pallas_tpu' with inputs on {platform!r} (not a TPU) needs "
      "interpret=pltpu.InterpretParams() (got interpret=False)."
    )
  return impl


def check_float_array(x, name: str) -> None:
  """Raises a ValueError naming `name` unless `x` is an array of a floating dtype."""
  dtype = getattr(x, "dtype", None)
  if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
    raise ValueError(
      f"`{name}` must be a float array, got {dtype if dtype is not None else type(x).__name__}."
    )


def check_kv_scale(scale, num_kv_heads: int, name: str, page_dtype, pool_shape=None) -> jax.Array:
  """Normalizes a KV dequantization scale: static float32 `[num_kv_heads]`, or per-token.

  The read convention of the paged pool is `K = k_pages.astype(f32) * k_scale[g]`
  for KV head g (vLLM's FP8 KV cache, per-tensor or per-head scales), or, with
  per-token scales stored beside the pages (one float per KV head, page and
  row: the pool's shape without its head-dim axis),
  `K[g, page, row] = k_pages[g, page, row].astype(f32) * k_scale[g, page, row]`.

  Args:
    scale: None, a float scalar, a float array of shape `[1]` or
      `[num_kv_heads]`, or (with `pool_shape`) per-token scales of shape
      `pool_shape[:-1]`.
    num_kv_heads: Hkv.
    name: argument name used in errors ("k_scale", "v_scale").
    page_dtype: dtype of the page pool; FP8 pools require a scale.
    pool_shape: the page pool's shape (`[..., Hkv, P, page, D]`); None accepts
      static scales only.

  Returns:
    float32 `[num_kv_heads]` (ones when `scale` is None for bf16/f32 pools), or
    the float32 per-token scales of shape `pool_shape[:-1]` (traced or not,
    their values are not checked: past a sequence's length they may hold
    anything, and the kernels mask them there).

  Raises:
    ValueError: missing scale for FP8 pages, wrong shape, a non-float dtype,
      or a concrete static value that is not finite and > 0 (traced scales
      are not checked).
  """
  if scale is None:
    if is_fp8(page_dtype):
      raise ValueError(
        f"`{name}` is required for FP8 pages ({jnp.dtype(page_dtype)}): "
        f"values are pages.astype(float32) * {name}."
      )
    return jnp.ones((num_kv_heads,), jnp.float32)
  if isinstance(scale, (float, np.floating)):
    scale = np.float32(scale)
  scale = scale if hasattr(scale, "dtype") else np.asarray(scale)
  token_shape = None if pool_shape is None else tuple(pool_shape[:-1])
  if token_shape is not None and tuple(np.shape(scale)) == token_shape:
    check_float_array(scale, name)
    return jnp.asarray(scale).astype(jnp.float32)
  if np.shape(scale) not in ((), (1,), (num_kv_heads,)):
    per_token = "" if token_shape is None else f", or {token_shape} (one per token)"
    raise ValueError(
      f"`{name}` must be a scalar or have shape ({num_kv_heads},) (one per KV head)"
      f"{per_token}, got shape {tuple(np.shape(scale))}."
    )
  check_float_array(scale, name)
  if is_concrete(scale):
    values = np.asarray(scale, np.float32).reshape(-1)
    bad = ~(np.isfinite(values) & (values > 0))
    if bad.any():
      raise ValueError(
        f"`{name}` must be finite and > 0 (a dequantization scale), got {values.tolist()}."
      )
  scale = jnp.asarray(scale)
  return jnp.broadcast_to(scale.astype(jnp.float32).reshape(-1), (num_kv_heads,))


def check_kv_scale_pair(k_scale, v_scale, num_kv_heads: int, page_dtype, pool_shape):
  """`check_kv_scale` of K and V, which must be of one kind (both static or both per-token)."""
  k_scale = check_kv_scale(k_scale, num_kv_heads, "k_scale", page_dtype, pool_shape)
  v_scale = check_kv_scale(v_scale, num_kv_heads, "v_scale", page_dtype, pool_shape)
  if k_scale.ndim != v_scale.ndim:
    raise ValueError(
      f"`k_scale` {tuple(k_scale.shape)} and `v_scale` {tuple(v_scale.shape)} must both be "
      "static ([Hkv] or scalar) or both per-token (the pool's shape without D)."
    )
  return k_scale, v_scale


def gather_token_scales(scales: jax.Array, layer: jax.Array, cols: jax.Array) -> jax.Array:
  """Row b's per-token scales of pages `cols[b]` of a stacked `[L, Hkv, P, page]` scale pool.

  Returns:
    float32 `[B, Hkv, n * page_size]`, laid out as `gather_pages` lays out the pages.
  """
  return gather_pages(scales[..., None], layer, cols)[..., 0]


# Gather of [1, Hkv, 1, page, D] slices of a stacked [L, Hkv, P, page, D] pool, one per
# (layer, page) index, laid out [B, Hkv, n, page, D] (batch dims leading, as the dots use).
_PAGE_GATHER_DIMS = lax.GatherDimensionNumbers(
  offset_dims=(1, 3, 4), collapsed_slice_dims=(0, 2), start_index_map=(0, 2)
)


def gather_pages(pages: jax.Array, layer: jax.Array, cols: jax.Array) -> jax.Array:
  """Row b's pages `cols[b]` of layer `layer` of a stacked pool, in attention layout.

  One `[1, Hkv, 1, page, D]` slice per (layer, page) index: no layer slice of the
  pool is ever materialised (the layer index is part of every gather index), and
  no transpose follows.

  Args:
    pages: `[L, Hkv, P, page_size, D]` stacked page pool (any dtype).
    layer: int32 scalar in [0, L).
    cols: i32`[B, n]` page indices, in [0, P) (not checked: clamp them first).

  Returns:
    `[B, Hkv, n * page_size, D]` in the pool's dtype: row b's n pages in order.
  """
  _, num_kv_heads, _, page_size, head_dim = pages.shape
  batch, n = cols.shape
  index = jnp.stack([jnp.broadcast_to(jnp.asarray(layer, jnp.int32), cols.shape), cols], -1)
  x = lax.gather(
    pages, index, _PAGE_GATHER_DIMS, (1, num_kv_heads, 1, page_size, head_dim),
    mode=lax.GatherScatterMode.PROMISE_IN_BOUNDS,
  )  # fmt: skip
  return x.reshape(batch, num_kv_heads, n * page_size, head_dim)
