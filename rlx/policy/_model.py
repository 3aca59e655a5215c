"""Decoder-only transformer (Qwen2 / Qwen3 / Llama) as pure functions over a dict.

Why pure functions rather than Flax modules: the parameters must be a plain
pytree at every jit boundary (train step, sampler, checkpoints, partition
rules), and the paged-KV sampler must drive each layer's projections with its
own cache and kernels. With functions over a nested dict there is no
module/state split to keep in sync, the per-layer pieces (`embed`,
`layer_qkv`, `layer_finish`, `final_norm`, `logits_from_hidden`) are exported
as they are, and the dict keys map one-to-one onto HF tensor names. The
layers are stacked on a leading `[L]` axis and run with `lax.scan`, so
compile time does not grow with depth.

Parameter tree (shapes; `Hq = H * Dh`, `Hk = Hkv * Dh`, `I` = MLP width):

  embed/embedding                 [V, D]
  layers/input_norm/scale         [L, D]
  layers/attn/q_proj/kernel       [L, D, Hq]    (+ bias [L, Hq] if attention_bias)
  layers/attn/k_proj/kernel       [L, D, Hk]    (+ bias [L, Hk])
  layers/attn/v_proj/kernel       [L, D, Hk]    (+ bias [L, Hk])
  layers/attn/o_proj/kernel       [L, Hq, D]    (+ bias [L, D] if attention_out_bias)
  layers/attn/q_norm/scale        [L, Dh]       (qk_norm only)
  layers/attn/k_norm/scale        [L, Dh]       (qk_norm only)
  layers/post_attn_norm/scale     [L, D]
  layers/mlp/gate_proj/kernel     [L, D, I]
  layers/mlp/up_proj/kernel       [L, D, I]
  layers/mlp/down_proj/kernel     [L, I, D]
  final_norm/scale                [D]
  lm_head/kernel                  [D, V]        (absent when tie_embeddings)

One decoder. One block is

  q, k, v = layer_qkv(layer, config, x, positions)       # norm, proj, qk-norm, RoPE
  out     = attention(q, k, v)                           # anything: dense, paged, FP8
  x       = layer_finish(layer, config, x, out)          # o_proj, residual, MLP

and `layer_scan` is the single loop over the stacked blocks used by the
training `forward`, `kv_absmax` and the paged-KV sampler (rlx.sampling) for
prefill and decode. Its attention hook `attention_fn(layer_index, q, k, v,
cache, *, positions, segment_ids) -> (out, cache)` receives and returns the
cache state, which travels in the scan carry: a sampler carries its stacked
page pool `[L, Hkv, P, page, D]` and updates layer `layer_index` in place.
`forward(..., attention_fn=f)` takes the cache-free form `f(layer_index, q, k,
v, *, positions, segment_ids) -> out`. K/V layout everywhere: `[B, S, Hkv,
Dh]` as `layer_qkv` returns it (`rlx.kernels_pallas.write_kv_pages` takes new
K/V in that layout; for a decode step `[B, Hkv, Dh]` is the same array
without the S = 1 axis, and the query `[B, H, Dh]` of `paged_attention` too).

FP8 linears (W8A8). A decoder linear's `kernel` leaf is either a dense
`[L, K, N]` array or an `Fp8Kernel(values, scale)`: FP8 values `[L, K, N]`
with float32 scales `[L, ceil(K/128), ceil(N/128)]`, one per 128x128 block
(`quantize_linears`; DeepSeek-V3, https://arxiv.org/abs/2412.19437, Sec. 3.3).
`linear` is the one dispatch point: a dense kernel runs an einsum in the
compute dtype, an `Fp8Kernel` quantizes the activations per token and
128-wide K group on the fly and runs `rlx.kernels_pallas.fp8_blockwise_matmul`
(as vLLM's `W8A8BlockFp8LinearOp`). An `Fp8Kernel` is a registered pytree
(its values and scale are ordinary leaves, so params stay a plain pytree at
jit boundaries and the layer scan slices it like any other leaf), but it
refuses to become an array (`jnp.asarray`, `np.asarray`, `.astype`), so
FP8 values can never be used as a dense kernel without their scales.
Embeddings, the LM head, norms and biases always stay dense.

Per-layer parameter hook (FSDP / ZeRO-3). `forward(..., layer_params_fn=g)`
applies `g(layer) -> layer` to each block's parameter slice INSIDE the layer
scan, right before the block uses it. A sharded train step passes a function
that all-gathers one layer's FSDP-sharded weights
(`jax.lax.with_sharding_constraint`), so only one gathered layer exists at a
time instead of the whole gathered stack; the gather's gradient is a
reduce-scatter of that layer's gradient. With a hook (and `remat` off) each
block is wrapped in `jax.checkpoint` with the `dots_saveable` policy: matmul
outputs (activations) are saved for the backward pass, everything else is
recomputed, so the backward pass re-runs the hook (re-gathers one layer)
instead of keeping every gathered layer alive as a residual. (A policy that
saves "everything but the hook's outputs" would still save the gathered
weights: the values they are computed from, e.g. the sharding constraint's
output or a dtype cast, would be saved in their place.)
"""

import dataclasses
import functools
import inspect
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from rlx import _choices, kernels_pallas
from rlx.policy._config import ModelConfig

Params = dict[str, Any]
AttentionFn = Callable[..., Array]
CacheAttentionFn = Callable[..., tuple[Array, Any]]
LayerParamsFn = Callable[[Params], Params]


# ----------------------------------------------------------------------------
# FP8 linear kernels.

# The decoder linears (paths under params["layers"]) whose kernels may be FP8.
LINEAR_KERNELS = (
  ("attn", "q_proj"),
  ("attn", "k_proj"),
  ("attn", "v_proj"),
  ("attn", "o_proj"),
  ("mlp", "gate_proj"),
  ("mlp", "up_proj"),
  ("mlp", "down_proj"),
)
# Weight block (and activation group) of the FP8 linears, fixed by `fp8_blockwise_matmul`.
FP8_BLOCK = 128
FP8_FORMATS = _choices.FP8_DTYPES  # format name -> dtype


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Fp8Kernel:
  """An FP8 linear kernel: blockwise-quantized values with their float32 block scales.

  `kernel ~= values.astype(f32) * scale` repeated over 128x128 blocks (the
  convention of `rlx.kernels_pallas.quantize_fp8_blockwise`). Stands in for a
  dense `kernel` leaf of a decoder linear; `linear` runs it as W8A8 with
  dynamic 1x128 activation scales. A registered pytree with two array leaves
  (`values`, `scale`), so it passes jit, `lax.scan` slicing and `tree_map`
  like any parameter, but it refuses every conversion to a plain array: the
  FP8 values are never used without their scales. Use `dequantize()` for an
  explicit float32 copy.

  Attributes:
    values: `[..., K, N]` float8_e4m3fn or float8_e5m2.
    scale: float32 `[..., ceil(K/128), ceil(N/128)]`.
  """

  values: Array
  scale: Array

  @property
  def shape(self) -> tuple[int, ...]:
    """The shape of the dense kernel this stands for (`values.shape`)."""
    return tuple(np.shape(self.values))

  def dequantize(self) -> Array:
    """float32 `values * scale` (block scales repeated), same shape as `values`."""
    *lead, k, n = self.shape
    s = jnp.repeat(jnp.repeat(self.scale.astype(jnp.float32), FP8_BLOCK, -2), FP8_BLOCK, -1)
    return self.values.astype(jnp.float32) * s[..., :k, :n]

  def _refuse(self, *args, **kwargs):
    raise TypeError(
      "An Fp8Kernel (FP8 values + block scales) cannot be used as a dense array; "
      "rlx.policy runs it through fp8_blockwise_matmul, or call .dequantize()."
    )

  __array__ = _refuse
  __jax_array__ = _refuse
  astype = _refuse


def _is_fp8_dtype(dtype: Any) -> bool:
  try:
    return jnp.dtype(dtype) in (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))
  except TypeError:
    return False


def _is_fp8_kernel(x: Any) -> bool:
  return isinstance(x, Fp8Kernel)


def _check_fp8_kernel(kernel: Fp8Kernel, want: tuple[int, ...], name: str) -> list[str]:
  """Problems of an FP8 kernel standing for a dense kernel of shape `want`."""
  problems = []
  values, scale = kernel.values, kernel.scale
  if not _is_fp8_dtype(getattr(values, "dtype", None)):
    problems.append(f"{name} is an Fp8Kernel with values of dtype {getattr(values, 'dtype', None)}")
  if tuple(np.shape(values)) != tuple(want):
    problems.append(f"{name} has shape {tuple(np.shape(values))}, expected {tuple(want)}")
  blocks = (*want[:-2], -(-want[-2] // FP8_BLOCK), -(-want[-1] // FP8_BLOCK))
  if tuple(np.shape(scale)) != blocks or getattr(scale, "dtype", None) != jnp.float32:
    problems.append(
      f"{name} scale is {getattr(scale, 'dtype', None)}{tuple(np.shape(scale))}, expected "
      f"float32{blocks} (one per {FP8_BLOCK}x{FP8_BLOCK} block)"
    )
  return problems


def quantize_linears(params: Params, dtype: Any = jnp.float8_e4m3fn) -> Params:
  """Replaces every decoder linear kernel by its blockwise FP8 `Fp8Kernel` (W8A8 rollout).

  Each `layers/{attn,mlp}/*_proj/kernel` `[L, K, N]` becomes `Fp8Kernel(values
  [L, K, N], scale f32[L, ceil(K/128), ceil(N/128)])` via
  `rlx.kernels_pallas.quantize_fp8_blockwise` per layer (128x128 blocks, scale
  = max(amax, 1e-10) / fmax; edge blocks of widths that are not multiples of
  128 are scaled over their real elements). Embeddings, the LM head, norms
  and biases are returned unchanged (the same arrays). Kernels that already are
  `Fp8Kernel`s are kept. Reference: DeepSeek-V3
  (https://arxiv.org/abs/2412.19437) Sec. 3.3; vLLM's blockwise FP8 linear
  (`Fp8LinearMethod` with `weight_block_size=[128, 128]`).

  Pure and jittable (the sampler re-quantizes with it after every policy update).

  Args:
    params: the parameter tree (dense decoder kernels).
    dtype: jnp.float8_e4m3fn (default) or jnp.float8_e5m2 (also "fp8_e4m3" / "fp8_e5m2").

  Returns:
    A new parameter tree (the input is not modified).
  """
  if isinstance(dtype, str):
    if dtype not in FP8_FORMATS:
      raise ValueError(f"`dtype` must be one of {tuple(FP8_FORMATS)}, got {dtype!r}.")
    dtype = FP8_FORMATS[dtype]
  if not _is_fp8_dtype(dtype):
    raise ValueError(f"`dtype` must be float8_e4m3fn or float8_e5m2, got {dtype!r}.")
  if not isinstance(params, dict) or not isinstance(params.get("layers"), dict):
    raise ValueError("`params` must be the policy parameter dict (with a 'layers' entry).")
  quantize = jax.vmap(
    functools.partial(
      kernels_pallas.quantize_fp8_blockwise, block=(FP8_BLOCK, FP8_BLOCK), dtype=dtype
    )
  )
  layers = dict(params["layers"])
  for group, name in LINEAR_KERNELS:
    if name not in layers.get(group, {}):
      raise ValueError(f"`params` has no layers/{group}/{name} (not a policy parameter tree).")
    linear = dict(layers[group][name])
    kernel = linear["kernel"]
    if not _is_fp8_kernel(kernel):
      if np.ndim(kernel) != 3:
        raise ValueError(
          f"`params` layers/{group}/{name}/kernel must be [L, K, N], got {np.shape(kernel)}."
        )
      linear["kernel"] = Fp8Kernel(*quantize(jnp.asarray(kernel)))
    layers[group] = {**layers[group], name: linear}
  return {**params, "layers": layers}


# ----------------------------------------------------------------------------
# Parameter structure.


def param_shapes(config: ModelConfig) -> Params:
  """The parameter tree of `config` with shape tuples as leaves (see module doc)."""
  L, D, V = config.num_layers, config.hidden_size, config.vocab_size
  hq = config.num_heads * config.head_dim
  hk = config.num_kv_heads * config.head_dim
  inner = config.intermediate_size

  def linear(d_in: int, d_out: int, bias: bool) -> dict[str, tuple[int, ...]]:
    out = {"kernel": (L, d_in, d_out)}
    if bias:
      out["bias"] = (L, d_out)
    return out

  attn = {
    "q_proj": linear(D, hq, config.attention_bias),
    "k_proj": linear(D, hk, config.attention_bias),
    "v_proj": linear(D, hk, config.attention_bias),
    "o_proj": linear(hq, D, config.attention_out_bias),
  }
  if config.qk_norm:
    attn["q_norm"] = {"scale": (L, config.head_dim)}
    attn["k_norm"] = {"scale": (L, config.head_dim)}
  shapes: Params = {
    "embed": {"embedding": (V, D)},
    "layers": {
      "input_norm": {"scale": (L, D)},
      "attn": attn,
      "post_attn_norm": {"scale": (L, D)},
      "mlp": {
        "gate_proj": linear(D, inner, False),
        "up_proj": linear(D, inner, False),
        "down_proj": linear(inner, D, False),
      },
    },
    "final_norm": {"scale": (D,)},
  }
  if not config.tie_embeddings:
    shapes["lm_head"] = {"kernel": (D, V)}
  return shapes


def _is_shape(x: Any) -> bool:
  return isinstance(x, tuple) and all(isinstance(d, int) for d in x)


def init_params(config: ModelConfig, rng: Array) -> Params:
  """Random parameters: N(0, 0.02) kernels/embeddings, unit norms, zero biases.

  Args:
    config: the model config.
    rng: a `jax.random` key.

  Returns:
    The parameter tree (module docstring), leaves of dtype `config.param_dtype`.
  """
  return _init_params(config, rng)


# Below this many random elements `init_params` draws them with one normal call
# (threefry compiles per call site, so this keeps small-model init fast to compile).
_FLAT_INIT_MAX_ELEMENTS = 2**26


@functools.partial(jax.jit, static_argnums=0)
def _init_params(config: ModelConfig, rng: Array) -> Params:
  shapes = param_shapes(config)
  paths_and_shapes, treedef = jax.tree_util.tree_flatten_with_path(shapes, is_leaf=_is_shape)
  dtype = jnp.dtype(config.param_dtype)
  random = [shape for path, shape in paths_and_shapes if path[-1].key in ("kernel", "embedding")]
  sizes = [math.prod(shape) for shape in random]
  if sum(sizes) <= _FLAT_INIT_MAX_ELEMENTS:
    flat = jax.random.normal(rng, (sum(sizes),), jnp.float32)
    offsets = np.cumsum([0, *sizes])
    draws = [flat[offsets[i] : offsets[i + 1]].reshape(s) for i, s in enumerate(random)]
  else:
    keys = jax.random.split(rng, len(random))
    draws = [jax.random.normal(k, s, jnp.float32) for k, s in zip(keys, random, strict=True)]
  draws = iter(draws)
  leaves = []
  for path, shape in paths_and_shapes:
    name = path[-1].key
    if name == "scale":
      leaves.append(jnp.ones(shape, dtype))
    elif name == "bias":
      leaves.append(jnp.zeros(shape, dtype))
    else:
      leaves.append((0.02 * next(draws)).astype(dtype))
  return jax.tree_util.tree_unflatten(treedef, leaves)


def check_params(
  params: Params, config: ModelConfig, name: str = "params", *, allow_fp8: bool = False
) -> None:
  """Raises ValueError naming every missing, unexpected or mis-shaped parameter.

  With `allow_fp8`, the decoder linear kernels (`LINEAR_KERNELS`) may be
  `Fp8Kernel`s (values of the dense shape, FP8 dtype; float32 block scales);
  anywhere else, or without `allow_fp8` (e.g. for training), an `Fp8Kernel`
  is an error.
  """
  want = {
    "/".join(p.key for p in path): shape
    for path, shape in jax.tree_util.tree_flatten_with_path(
      param_shapes(config), is_leaf=_is_shape
    )[0]
  }
  try:
    flat = jax.tree_util.tree_flatten_with_path(params, is_leaf=_is_fp8_kernel)[0]
  except Exception as e:  # pragma: no cover - exotic containers
    raise ValueError(f"`{name}` must be a nested dict of arrays.") from e
  have, problems = {}, []
  fp8_ok = {f"layers/{g}/{n}/kernel" for g, n in LINEAR_KERNELS} if allow_fp8 else set()
  for path, x in flat:
    key = "/".join(str(getattr(p, "key", p)) for p in path)
    if _is_fp8_kernel(x):
      if key not in fp8_ok:
        problems.append(f"{key} is an Fp8Kernel but must be a dense array")
      elif key in want:
        problems += _check_fp8_kernel(x, want[key], key)
      have[key] = want.get(key, x.shape)
    else:
      have[key] = np.shape(x)
  problems += [f"missing {k} {want[k]}" for k in sorted(set(want) - set(have))]
  problems += [f"unexpected {k} {have[k]}" for k in sorted(set(have) - set(want))]
  problems += [
    f"{k} has shape {have[k]}, expected {want[k]}"
    for k in sorted(set(want) & set(have))
    if tuple(have[k]) != tuple(want[k])
  ]
  if problems:
    where = "" if allow_fp8 else " (FP8 kernels are for the sampler and forward, not training)"
    if not any("Fp8Kernel" in p for p in problems):
      where = ""
    raise ValueError(f"`{name}` does not match the config: " + "; ".join(problems) + f".{where}")


def get_layer(params: Params, layer_index: int | Int[Array, ""]) -> Params:
  """Slices decoder block `layer_index` out of the stacked `params["layers"]`."""
  return jax.tree_util.tree_map(lambda a: a[layer_index], params["layers"])


# ----------------------------------------------------------------------------
# Building blocks.


def rms_norm(x: Float[Array, "... D"], scale: Float[Array, " D"], eps: float) -> Array:
  """RMSNorm: `scale * x / sqrt(mean(x^2) + eps)`, statistics in float32.

  Reference: Zhang & Sennrich 2019, https://arxiv.org/abs/1910.07467. Like HF,
  the normalised activations are cast back to `x.dtype` before the scale.
  """
  x32 = x.astype(jnp.float32)
  normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  return scale.astype(x.dtype) * normed.astype(x.dtype)


def rope_inv_freq(config: ModelConfig) -> np.ndarray:
  """Inverse RoPE frequencies `theta^(-2i/Dh)`, i < Dh/2, with llama3 scaling.

  Computed in float32 with the same operation order as HF transformers.
  Llama 3.1 scaling (https://github.com/meta-llama/llama-models): wavelengths
  `2 pi / f` above `orig / low_freq_factor` are divided by `factor`, below
  `orig / high_freq_factor` kept, and interpolated with
  `s = (orig / wavelen - low) / (high - low)` in between.

  Returns:
    f32[Dh / 2].
  """
  dim = config.head_dim
  exponents = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)
  inv_freq = (np.float32(1.0) / (np.float32(config.rope_theta) ** exponents)).astype(np.float32)
  scaling = config.rope_scaling
  if scaling is None:
    return inv_freq
  factor = np.float32(scaling.factor)
  orig = scaling.original_max_position_embeddings
  low_wavelen = orig / scaling.low_freq_factor
  high_wavelen = orig / scaling.high_freq_factor
  wavelen = (np.float32(2 * np.pi) / inv_freq).astype(np.float32)
  scaled = np.where(wavelen > low_wavelen, inv_freq / factor, inv_freq).astype(np.float32)
  smooth = (
    (orig / wavelen - scaling.low_freq_factor)
    / (scaling.high_freq_factor - scaling.low_freq_factor)
  ).astype(np.float32)
  smoothed = ((1 - smooth) * scaled / factor + smooth * scaled).astype(np.float32)
  medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
  return np.where(medium, smoothed, scaled).astype(np.float32)


def apply_rope(
  x: Float[Array, "B S N Dh"], positions: Int[Array, "B S"], inv_freq: np.ndarray
) -> Float[Array, "B S N Dh"]:
  """Rotary embedding (Su et al. 2021, https://arxiv.org/abs/2104.09864), HF half layout.

  `x * cos(p f) + rotate_half(x) * sin(p f)` with `rotate_half([a, b]) = [-b, a]`
  over the two halves of the head dim; computed in float32.
  """
  freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)  # [B, S, Dh/2]
  angles = jnp.concatenate([freqs, freqs], axis=-1)[:, :, None, :]  # [B, S, 1, Dh]
  x32 = x.astype(jnp.float32)
  half = x.shape[-1] // 2
  rotated = jnp.concatenate([-x32[..., half:], x32[..., :half]], axis=-1)
  return (x32 * jnp.cos(angles) + rotated * jnp.sin(angles)).astype(x.dtype)


def _fp8_linear(kernel: Fp8Kernel, x: Array, dtype: Any) -> Array:
  """W8A8: `x` quantized per token and 128-wide K group, times the FP8 block kernel."""
  values, scale = kernel.values, kernel.scale
  if np.ndim(values) != 2 or not _is_fp8_dtype(values.dtype):
    raise ValueError(
      f"An Fp8Kernel in a layer must hold FP8 values [K, N], got {values.dtype}{values.shape} "
      "(was it cast by a parameter hook?)."
    )
  k, n = values.shape
  if x.shape[-1] != k:
    raise ValueError(f"Linear input has width {x.shape[-1]}, the FP8 kernel expects K={k}.")
  lead = x.shape[:-1]
  x_q, x_scale = kernels_pallas.quantize_fp8_per_token_group(
    x.reshape(-1, k), FP8_BLOCK, dtype=values.dtype
  )
  y = kernels_pallas.fp8_blockwise_matmul(x_q, x_scale, values, scale, out_dtype=dtype)
  return y.reshape(*lead, n)


def linear(p: Params, x: Array, dtype: Any) -> Array:
  """A decoder linear layer, `y = x @ kernel (+ bias)`: the one dispatch point of the linears.

  A dense kernel runs a matmul in `dtype`; an `Fp8Kernel` runs W8A8 (dynamic
  1x128 activation scales, `rlx.kernels_pallas.fp8_blockwise_matmul`; module doc).

  Args:
    p: one linear's params, `{"kernel": [in, out] array or Fp8Kernel, "bias"?: [out]}`.
    x: activations with shape `[..., in]`.
    dtype: the compute dtype (e.g. `config.compute_dtype`).

  Returns:
    `[..., out]` in `dtype`.
  """
  kernel = p["kernel"]
  if _is_fp8_kernel(kernel):
    y = _fp8_linear(kernel, x, dtype)
  else:
    # A 2-D [tokens, in] @ [in, out] dot: the same forward values as the einsum
    # over [..., in], but XLA:CPU then computes the weight gradient without
    # materialising strided transposes of the [..., out] cotangent (4x faster
    # backward on CPU for small models).
    lead = x.shape[:-1]
    y = jnp.dot(x.reshape(-1, x.shape[-1]), kernel.astype(dtype)).reshape(*lead, kernel.shape[-1])
  if "bias" in p:
    y = y + p["bias"].astype(dtype)
  return y


def embed(params: Params, config: ModelConfig, tokens: Int[Array, "B S"]) -> Array:
  """Embedding lookup: `x[b, s] = E[tokens[b, s]]`.

  Args:
    params: model parameters.
    config: model config.
    tokens: i32[B, S] token ids in [0, V).

  Returns:
    [B, S, D] activations in `config.compute_dtype`; NaN rows for ids outside
    [0, V) (only reachable under `jit`, where ids cannot be checked), never
    another token's row (no wrapping of -1 to V - 1, no clamping).
  """
  table = params["embed"]["embedding"]
  rows = table.at[tokens].get(mode="fill", fill_value=jnp.nan, wrap_negative_indices=False)
  return rows.astype(config.compute_dtype)


def layer_qkv(
  layer: Params,
  config: ModelConfig,
  x: Float[Array, "B S D"],
  positions: Int[Array, "B S"],
) -> tuple[Float[Array, "B S H Dh"], Float[Array, "B S Hkv Dh"], Float[Array, "B S Hkv Dh"]]:
  """First half of a decoder block: input RMSNorm, q/k/v projections, q/k norm, RoPE.

  Args:
    layer: one block's parameters (`get_layer(params, i)`).
    config: model config.
    x: [B, S, D] residual stream (compute dtype).
    positions: i32[B, S] RoPE positions.

  Returns:
    (q [B, S, H, Dh], k [B, S, Hkv, Dh], v [B, S, Hkv, Dh]); q and k are rotated.
  """
  dtype = jnp.dtype(config.compute_dtype)
  b, s, _ = x.shape
  attn = layer["attn"]
  h = rms_norm(x, layer["input_norm"]["scale"], config.rms_norm_eps)
  q = linear(attn["q_proj"], h, dtype).reshape(b, s, config.num_heads, config.head_dim)
  k = linear(attn["k_proj"], h, dtype).reshape(b, s, config.num_kv_heads, config.head_dim)
  v = linear(attn["v_proj"], h, dtype).reshape(b, s, config.num_kv_heads, config.head_dim)
  if config.qk_norm:
    q = rms_norm(q, attn["q_norm"]["scale"], config.rms_norm_eps)
    k = rms_norm(k, attn["k_norm"]["scale"], config.rms_norm_eps)
  inv_freq = rope_inv_freq(config)
  return apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq), v


def layer_finish(
  layer: Params,
  config: ModelConfig,
  x: Float[Array, "B S D"],
  attn_out: Float[Array, "B S H Dh"],
) -> Float[Array, "B S D"]:
  """Second half of a decoder block: output projection + residual, RMSNorm, SwiGLU + residual.

  `x' = x + attn_out W_o`;  `y = x' + W_down(silu(W_gate h) * W_up h)`, `h = norm(x')`
  (SwiGLU: Shazeer 2020, https://arxiv.org/abs/2002.05202).

  Args:
    layer: one block's parameters.
    config: model config.
    x: [B, S, D] residual stream that went into `layer_qkv`.
    attn_out: [B, S, H, Dh] attention output (per query head).

  Returns:
    [B, S, D] the block's output.
  """
  dtype = jnp.dtype(config.compute_dtype)
  b, s, _ = x.shape
  want = (b, s, config.num_heads, config.head_dim)
  if attn_out.shape != want:
    raise ValueError(f"`attn_out` must have shape {want}, got {attn_out.shape}.")
  attn_out = attn_out.astype(dtype).reshape(b, s, config.num_heads * config.head_dim)
  x = x + linear(layer["attn"]["o_proj"], attn_out, dtype)
  h = rms_norm(x, layer["post_attn_norm"]["scale"], config.rms_norm_eps)
  mlp = layer["mlp"]
  gated = jax.nn.silu(linear(mlp["gate_proj"], h, dtype)) * linear(mlp["up_proj"], h, dtype)
  return x + linear(mlp["down_proj"], gated, dtype)


def final_norm(params: Params, config: ModelConfig, x: Float[Array, "B S D"]) -> Array:
  """The final RMSNorm; its output is what the LM head multiplies ("hidden states")."""
  return rms_norm(x, params["final_norm"]["scale"], config.rms_norm_eps)


def lm_head_kernel(params: Params, config: ModelConfig) -> Float[Array, "D V"]:
  """The [D, V] output matrix (the transposed embedding when tied)."""
  if config.tie_embeddings:
    return params["embed"]["embedding"].T
  return params["lm_head"]["kernel"]


def logits_from_hidden(
  params: Params, config: ModelConfig, hidden: Float[Array, "... D"]
) -> Float[Array, "... V"]:
  """`logits = hidden @ W_head` with compute-dtype inputs and float32 accumulation/output."""
  dtype = jnp.dtype(config.compute_dtype)
  kernel = lm_head_kernel(params, config).astype(dtype)
  return jnp.einsum(
    "...d,dv->...v", hidden.astype(dtype), kernel, preferred_element_type=jnp.float32
  )


def dense_causal_attention(
  q: Float[Array, "B S H Dh"],
  k: Float[Array, "B S Hkv Dh"],
  v: Float[Array, "B S Hkv Dh"],
  segment_ids: Int[Array, "B S"] | None = None,
) -> Float[Array, "B S H Dh"]:
  """Causal grouped-query softmax attention over one packed/padded block.

  `out_i = sum_j softmax_j(q_i . k_j / sqrt(Dh)) v_j` over `j <= i` with
  `segment_ids[j] == segment_ids[i]` (Vaswani et al. 2017; GQA: Ainslie et al.
  2023, https://arxiv.org/abs/2305.13245). Query head `h` reads KV head
  `h // (H / Hkv)`. Scores and softmax are float32; padding (segment 0)
  attends only to padding, so every row is finite.

  Args:
    q: [B, S, H, Dh] rotated queries.
    k: [B, S, Hkv, Dh] rotated keys.
    v: [B, S, Hkv, Dh] values.
    segment_ids: i32[B, S] or None (one segment).

  Returns:
    [B, S, H, Dh] in the dtype of `q`.
  """
  b, s, h, d = q.shape
  hkv = k.shape[2]
  if k.shape != (b, s, hkv, d) or v.shape != k.shape or h % hkv:
    raise ValueError(f"Incompatible attention shapes: q {q.shape}, k {k.shape}, v {v.shape}.")
  qg = q.reshape(b, s, hkv, h // hkv, d)
  scores = jnp.einsum("bqhgd,bkhd->bhgqk", qg, k, preferred_element_type=jnp.float32)
  scores = scores * np.float32(1.0 / np.sqrt(d))
  allowed = jnp.tril(jnp.ones((s, s), bool))[None]
  if segment_ids is not None:
    allowed = allowed & (segment_ids[:, :, None] == segment_ids[:, None, :])
  scores = jnp.where(allowed[:, None, None], scores, jnp.finfo(jnp.float32).min)
  probs = jax.nn.softmax(scores, axis=-1).astype(q.dtype)
  out = jnp.einsum("bhgqk,bkhd->bqhgd", probs, v, preferred_element_type=jnp.float32)
  return out.reshape(b, s, h, d).astype(q.dtype)


def default_attention_fn(
  layer_index: Int[Array, ""],
  q: Float[Array, "B S H Dh"],
  k: Float[Array, "B S Hkv Dh"],
  v: Float[Array, "B S Hkv Dh"],
  *,
  positions: Int[Array, "B S"],
  segment_ids: Int[Array, "B S"] | None,
) -> Float[Array, "B S H Dh"]:
  """The `attention_fn` used by `forward` by default: `dense_causal_attention`."""
  del layer_index, positions
  return dense_causal_attention(q, k, v, segment_ids)


# ----------------------------------------------------------------------------
# Training forward.


def check_tokens(tokens: Any, vocab_size: int, name: str = "tokens") -> None:
  """Checks `tokens` is an integer `[B, S]` array; ids in [0, V) when concrete."""
  if np.ndim(tokens) != 2:
    raise ValueError(f"`{name}` must have shape [B, S], got {np.shape(tokens)}.")
  if not jnp.issubdtype(jnp.result_type(tokens), jnp.integer):
    raise ValueError(f"`{name}` must be an integer array, got dtype {jnp.result_type(tokens)}.")
  if isinstance(tokens, jax.core.Tracer):
    return
  if isinstance(tokens, jax.Array) and not tokens.is_fully_addressable:
    return
  arr = np.asarray(tokens)
  if arr.size and (arr.min() < 0 or arr.max() >= vocab_size):
    bad = arr.max() if arr.max() >= vocab_size else arr.min()
    raise ValueError(f"`{name}` contains token id {int(bad)} outside [0, vocab_size={vocab_size}).")


def positions_from_segments(segment_ids: Int[Array, "B S"]) -> Int[Array, "B S"]:
  """Positions restarting at 0 at each segment start: `pos[s] = s - start(segment(s))`."""
  s = segment_ids.shape[1]
  idx = jnp.arange(s, dtype=jnp.int32)[None, :]
  starts = jnp.concatenate(
    [jnp.ones_like(segment_ids[:, :1], bool), segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1
  )
  start_idx = jax.lax.cummax(jnp.where(starts, idx, 0), axis=1)
  return (idx - start_idx).astype(jnp.int32)


def _check_aux(x: Any, tokens: Any, name: str) -> None:
  if x is None:
    return
  if np.shape(x) != np.shape(tokens):
    raise ValueError(
      f"`{name}` must have the shape of `tokens` {np.shape(tokens)}, got {np.shape(x)}."
    )
  if not jnp.issubdtype(jnp.result_type(x), jnp.integer):
    raise ValueError(f"`{name}` must be an integer array, got dtype {jnp.result_type(x)}.")


def forward(
  params: Params,
  config: ModelConfig,
  tokens: Int[Array, "B S"],
  positions: Int[Array, "B S"] | None = None,
  *,
  segment_ids: Int[Array, "B S"] | None = None,
  attention_fn: AttentionFn | None = None,
  return_hidden: bool = False,
  layer_params_fn: LayerParamsFn | None = None,
  unroll: bool = False,
) -> Float[Array, "B S V"] | Float[Array, "B S D"]:
  """Causal language-model forward pass (training path).

  `logits[b, s] = W_head · norm(block_L(... block_1(E[tokens[b, :s+1]])))`: position
  s sees tokens 0..s of its own segment. Same numerics as HF transformers'
  Qwen2/Qwen3/LlamaForCausalLM (tests/policy: float32 max-abs logit error
  < 1e-4 on CPU). On GPU/TPU, float32 matmuls default to reduced precision
  (TF32 / bf16 passes); wrap in `jax.default_matmul_precision("highest")`
  for float32 parity.

  Args:
    params: parameter tree (module docstring).
    config: model config (static under jit).
    tokens: i32[B, S] token ids in [0, V) (padding must use a valid id too).
    positions: i32[B, S] RoPE positions. Default: `0..S-1` per row, or, when
      `segment_ids` is given, restarting at 0 at every segment start.
    segment_ids: i32[B, S] or None. Tokens attend only to earlier tokens with
      the same id (packing); use 0 for padding. None = one segment per row
      (right padding needs no segment ids: real tokens never see later ones).
    attention_fn: optional replacement of the attention core,
      `attention_fn(layer_index, q, k, v, *, positions, segment_ids) -> out`
      with q [B, S, H, Dh], k/v [B, S, Hkv, Dh] (post-RoPE), out [B, S, H, Dh];
      `layer_index` is a traced int32 scalar. Default `default_attention_fn`.
    return_hidden: return the final-norm hidden states instead of logits.
    layer_params_fn: optional `f(layer) -> layer` applied to each decoder
      block's parameter slice (the tree of `get_layer(params, i)`, leaves
      without the `[L]` axis) inside the layer scan, before the block runs;
      it must return the same tree structure and shapes (dtypes may differ:
      outputs are cast to the compute dtype). If it has a keyword parameter
      named `layer_index` it is called as `f(layer, layer_index=i)` with the
      block's index i, an int32 scalar array (traced: in the scan, and under
      the block's `jax.checkpoint` with `unroll` too). Meant for per-layer FSDP
      gathering (`jax.lax.with_sharding_constraint`) or similar per-layer
      transforms. With it (and `config.remat` off) each block is
      rematerialised with `jax.checkpoint_policies.dots_saveable`, so its
      outputs are recomputed rather than stored for the backward pass
      (module docstring); the forward values are unchanged. The non-layer
      params (embedding, final norm, LM head) are used as passed. Default
      None = no hook, no remat.
    unroll: run the layers as an unrolled Python loop instead of one
      `lax.scan` (`layer_scan(unroll=True)`): the same values, but a
      differentiated forward of a shallow model skips the scan's stacked
      residual buffers (the train step does this up to
      `unroll_max_layers`). Default False.

  Returns:
    f32[B, S, V] logits, or [B, S, D] hidden states (compute dtype) when
    `return_hidden`.
  """
  hidden = _decoder(
    params, config, tokens, positions, segment_ids, attention_fn, layer_params_fn, unroll=unroll
  )
  if return_hidden:
    return hidden
  return logits_from_hidden(params, config, hidden)


def _takes_layer_index(layer_params_fn: LayerParamsFn) -> bool:
  """Whether a `layer_params_fn` accepts a keyword parameter `layer_index`."""
  try:
    parameters = inspect.signature(layer_params_fn).parameters
  except (TypeError, ValueError):  # no introspectable signature (some builtins)
    return False
  param = parameters.get("layer_index")
  return param is not None and param.kind in (
    inspect.Parameter.POSITIONAL_OR_KEYWORD,
    inspect.Parameter.KEYWORD_ONLY,
  )


def _layer_params_hook(
  layer_params_fn: LayerParamsFn, config: ModelConfig
) -> Callable[[Params, Int[Array, ""]], Params]:
  """Wraps a user `layer_params_fn` as `hook(layer, index)`: checks its output, casts it.

  The index is passed on as `layer_params_fn(layer, layer_index=index)` when
  the function has a `layer_index` keyword parameter (looked up once here,
  outside the traced block), else the call is `layer_params_fn(layer)`.
  """
  if not callable(layer_params_fn):
    raise ValueError(f"`layer_params_fn` must be callable, got {type(layer_params_fn).__name__}.")
  dtype = jnp.dtype(config.compute_dtype)
  takes_index = _takes_layer_index(layer_params_fn)

  def hook(layer: Params, index: Int[Array, ""]) -> Params:
    out = layer_params_fn(layer, layer_index=index) if takes_index else layer_params_fn(layer)
    want = jax.tree.structure(layer)
    if jax.tree.structure(out) != want:
      raise ValueError(
        f"`layer_params_fn` must return the tree structure of its input {want}, "
        f"got {jax.tree.structure(out)}."
      )
    paths_and_leaves = jax.tree_util.tree_flatten_with_path(layer)[0]
    for (path, a), b in zip(paths_and_leaves, jax.tree.leaves(out), strict=True):
      if np.shape(a) != np.shape(b):
        name = "/".join(str(getattr(p, "key", p)) for p in path)
        raise ValueError(
          f"`layer_params_fn` changed the shape of layers/{name} from {np.shape(a)} to "
          f"{np.shape(b)}."
        )
    # FP8 kernels pass unchanged (casting their values would drop the FP8 format).
    return jax.tree.map(
      lambda x: x if _is_fp8_kernel(x) else jnp.asarray(x, dtype), out, is_leaf=_is_fp8_kernel
    )

  return hook


def layer_scan(
  params: Params,
  config: ModelConfig,
  x: Float[Array, "B S D"],
  positions: Int[Array, "B S"],
  *,
  attention_fn: CacheAttentionFn,
  cache: Any = None,
  segment_ids: Int[Array, "B S"] | None = None,
  layer_params_fn: LayerParamsFn | None = None,
  unroll: bool = False,
) -> tuple[Float[Array, "B S D"], Any]:
  """The decoder blocks, one `lax.scan` over the stacked layers; the one layer loop of rlx.

  Training (`forward`, `token_logprobs`), `kv_absmax` and the paged-KV sampler's
  prefill and decode steps all run this scan. Per layer i:

    q, k, v      = layer_qkv(layer_i, config, x, positions)
    out, cache   = attention_fn(i, q, k, v, cache, positions=..., segment_ids=...)
    x            = layer_finish(layer_i, config, x, out)

  `cache` is any pytree carried from layer to layer in the scan CARRY (never
  as scan inputs/outputs), e.g. a stacked KV page pool `[L, Hkv, P, page, D]`:
  the hook updates layer i in place with dynamic-update / scatter ops at the
  traced `layer_index` and reads only what it needs (a gather of the pages its
  sequences use), so no per-layer copy of the pool is ever made (XLA fuses
  `pool[i]` into the consuming gather and updates carried buffers in place).
  With `layer_params_fn` (and `config.remat` off) each block is
  rematerialised with `dots_saveable`, as documented in `forward`.

  Args:
    params: parameter tree (module docstring); only `params["layers"]` is used.
    config: model config.
    x: [B, S, D] residual stream entering the first block (e.g. `embed(...)`).
    positions: i32[B, S] RoPE positions.
    attention_fn: `attention_fn(layer_index, q, k, v, cache, *, positions,
      segment_ids) -> (out, cache)` with q [B, S, H, Dh], k/v [B, S, Hkv, Dh]
      (post-RoPE), out [B, S, H, Dh]; `layer_index` is a traced int32 scalar
      and the returned cache must have the structure, shapes and dtypes of
      the one it received.
    cache: the initial cache pytree (None: no cache).
    segment_ids: i32[B, S] or None, handed to `attention_fn`.
    layer_params_fn: optional per-layer parameter hook, as in `forward`:
      `f(layer) -> layer`, or `f(layer, *, layer_index) -> layer` (a keyword
      parameter of that name, detected once by `inspect.signature`) to get
      the block's index, the int32 scalar `attention_fn` gets.
    unroll: False: one `lax.scan` (one traced block, fast compiles; training).
      True: a Python loop over the static layer indices (L traced blocks; the
      index handed to `attention_fn` and `layer_params_fn` is a constant int32
      scalar). Each block then reads static slices of the stacked weights,
      which XLA can hoist out of an enclosing loop (e.g. the sampler's decode
      `while_loop`) instead of copying every layer's weights out of the stack
      with dynamic slices on every step. Same math either way. With unroll=True, `params["layers"]`
      may also be a list of the L per-layer trees (e.g. sliced once before a
      decode loop, so the loop body reads them in place).

  Returns:
    (x [B, S, D] after the last block, before the final norm; the final cache).
  """
  if not isinstance(unroll, (bool, np.bool_)):
    raise ValueError(f"`unroll` must be a bool, got {type(unroll).__name__}.")
  hook = _layer_params_hook(layer_params_fn, config) if layer_params_fn is not None else None

  def block(carry, inputs):
    x, cache = carry
    layer, index = inputs
    if hook is not None:
      layer = hook(layer, index)
    q, k, v = layer_qkv(layer, config, x, positions)
    out, cache = attention_fn(index, q, k, v, cache, positions=positions, segment_ids=segment_ids)
    return (layer_finish(layer, config, x, out), cache), None

  if config.remat:
    block = jax.checkpoint(block, prevent_cse=False)
  elif hook is not None:
    # Save only matmul outputs: the hook's outputs (e.g. gathered weights) and
    # everything computed from them without a matmul are recomputed.
    block = jax.checkpoint(block, prevent_cse=False, policy=jax.checkpoint_policies.dots_saveable)
  layers = params["layers"]
  if isinstance(layers, (list, tuple)):
    if not unroll or len(layers) != config.num_layers:
      raise ValueError(
        f"`params['layers']` as a list of per-layer trees needs unroll=True and "
        f"{config.num_layers} entries, got {len(layers)} with unroll={unroll}."
      )
  if unroll:
    carry = (x, cache)
    for i in range(config.num_layers):
      if isinstance(layers, (list, tuple)):
        layer = layers[i]
      else:
        layer = jax.tree.map(lambda a, i=i: a[i], layers)
      carry, _ = block(carry, (layer, jnp.int32(i)))
    return carry
  indices = jnp.arange(config.num_layers, dtype=jnp.int32)
  (x, cache), _ = jax.lax.scan(block, (x, cache), (params["layers"], indices))
  return x, cache


def _prepare(params, config, tokens, positions, segment_ids):
  """Validates the decoder inputs; returns int32 (tokens, positions, segment_ids)."""
  check_params(params, config, allow_fp8=True)
  check_tokens(tokens, config.vocab_size)
  _check_aux(positions, tokens, "positions")
  _check_aux(segment_ids, tokens, "segment_ids")
  tokens = jnp.asarray(tokens, jnp.int32)
  b, s = tokens.shape
  if segment_ids is not None:
    segment_ids = jnp.asarray(segment_ids, jnp.int32)
  if positions is None:
    if segment_ids is None:
      positions = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
    else:
      positions = positions_from_segments(segment_ids)
  return tokens, jnp.asarray(positions, jnp.int32), segment_ids


def _decoder(
  params, config, tokens, positions, segment_ids, attention_fn, layer_params_fn=None, unroll=False
):
  """Validated embedding + layer scan (no cache) + final norm."""
  tokens, positions, segment_ids = _prepare(params, config, tokens, positions, segment_ids)
  attend = attention_fn if attention_fn is not None else default_attention_fn

  def hook(index, q, k, v, cache, *, positions, segment_ids):
    return attend(index, q, k, v, positions=positions, segment_ids=segment_ids), cache

  x, _ = layer_scan(
    params,
    config,
    embed(params, config, tokens),
    positions,
    attention_fn=hook,
    segment_ids=segment_ids,
    layer_params_fn=layer_params_fn,
    unroll=unroll,
  )
  return final_norm(params, config, x)


def kv_absmax(
  params: Params,
  config: ModelConfig,
  tokens: Int[Array, "B S"],
  mask: Array | None = None,
  *,
  positions: Int[Array, "B S"] | None = None,
  segment_ids: Int[Array, "B S"] | None = None,
  layer_params_fn: LayerParamsFn | None = None,
) -> tuple[Float[Array, "L Hkv"], Float[Array, "L Hkv"]]:
  """Per-layer, per-KV-head `max |K|` and `max |V|` over the valid tokens of a forward pass.

  For FP8 KV-cache scale recalibration from the trainer's forward
  (`k_scale = amax / headroom`; vLLM's FP8 KV cache uses headroom 200 for K
  and 100 for V). K is taken after RoPE (and q/k norm), exactly what a KV
  cache stores. Runs the same `layer_scan` as `forward`, with the `[L, Hkv]`
  abs-max arrays as the scan's cache (row i written at layer i).

  Args:
    params: parameter tree.
    config: model config.
    tokens: i32[B, S] token ids.
    mask: [B, S], nonzero on tokens that count (default: all tokens, or
      `segment_ids != 0` when segment ids are given).
    positions: as in `forward`.
    segment_ids: as in `forward`.
    layer_params_fn: optional per-layer parameter hook, as in `forward`.

  Returns:
    (k_amax f32[L, Hkv], v_amax f32[L, Hkv]).
  """
  if mask is None:
    mask = jnp.ones(np.shape(tokens), bool) if segment_ids is None else segment_ids
  if np.shape(mask) != np.shape(tokens):
    raise ValueError(
      f"`mask` must have the shape of `tokens` {np.shape(tokens)}, got {np.shape(mask)}."
    )
  tokens, positions, segment_ids = _prepare(params, config, tokens, positions, segment_ids)
  valid = (jnp.asarray(mask) != 0)[:, :, None, None]

  def hook(index, q, k, v, cache, *, positions, segment_ids):
    del positions
    amax = tuple(
      jnp.max(jnp.where(valid, jnp.abs(t.astype(jnp.float32)), 0.0), axis=(0, 1, 3)) for t in (k, v)
    )
    cache = tuple(c.at[index].set(a) for c, a in zip(cache, amax, strict=True))
    return dense_causal_attention(q, k, v, segment_ids), cache

  zeros = jnp.zeros((config.num_layers, config.num_kv_heads), jnp.float32)
  _, (k_amax, v_amax) = layer_scan(
    params,
    config,
    embed(params, config, tokens),
    positions,
    attention_fn=hook,
    cache=(zeros, zeros),
    segment_ids=segment_ids,
    layer_params_fn=layer_params_fn,
  )
  return k_amax, v_amax
