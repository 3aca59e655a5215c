"""FP8 rollout: re-quantizing the weights and recalibrating the KV scales after each update.

The rollout policy of an FP8 sampler is the trainer's policy with (1) every
decoder linear quantized to 128x128 FP8 blocks (`quantize_params`, run W8A8
by the policy's own decoder) and (2) K/V stored in FP8 pages with per-layer
(or per-KV-head) scales recalibrated from the trainer's forward
(`calibrate_kv_scales`, `kv_scales_from_absmax`). Both are refreshed after
every policy update, on device, jitted once: params and scales are traced
values, so neither refresh nor recalibration recompiles the sampler.

KV scale convention (vLLM's FP8 KV cache, `calculate_kv_scales`; the
"per-step QKV scale recalibration" of FP8 RL rollouts): `k_scale = amax(|K|)
/ k_headroom`, `v_scale = amax(|V|) / v_headroom` with the defaults of vLLM
(K 200, V 100), so the calibration amax maps to 200 (resp. 100) of
float8_e4m3fn's 448 and larger rollout values still fit before saturating.
References: DeepSeek-V3 (https://arxiv.org/abs/2412.19437) Sec. 3.3 for the
blockwise weights; vLLM (https://github.com/vllm-project/vllm,
`vllm/attention/layer.py` `calc_kv_scales`) for the KV scales.
"""

import collections
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from rlx import policy
from rlx._jit import counted_jit
from rlx.sampling._config import SamplerConfig

K_HEADROOM = 200.0
V_HEADROOM = 100.0
# Smallest amax turned into a scale (an all-zero head gets a tiny positive scale, never 0).
_AMAX_FLOOR = 1e-10


_TRACES = collections.Counter()  # programs traced by the two jitted functions below


def _quantize_impl(linears, dtype: str):
  """`quantize_linears` on a tree holding only the decoder linear kernels."""
  return policy.quantize_linears(linears, dtype)


_quantize = counted_jit(_quantize_impl, _TRACES, "quantize_params", static_argnames=("dtype",))


def _quantize_linears_only(params, dtype: str):
  """Quantizes the linear kernels in one jitted call; every other leaf is passed as is (no copy)."""
  layers = params["layers"]
  for group, name in policy.LINEAR_KERNELS:
    if name not in layers.get(group, {}) or "kernel" not in layers[group][name]:
      raise ValueError(f"`params` has no layers/{group}/{name}/kernel (not policy params).")
  linears = {"layers": {g: {} for g, _ in policy.LINEAR_KERNELS}}
  for group, name in policy.LINEAR_KERNELS:
    linears["layers"][group][name] = {"kernel": layers[group][name]["kernel"]}
  quantized = _quantize(linears, dtype)["layers"]
  new_layers = dict(layers)
  for group, name in policy.LINEAR_KERNELS:
    new_layers[group] = dict(new_layers[group])
    new_layers[group][name] = {**layers[group][name], "kernel": quantized[group][name]["kernel"]}
  return {**params, "layers": new_layers}


def _has_dense_linears(params) -> bool:
  layers = params.get("layers", {}) if isinstance(params, dict) else {}
  for group, name in policy.LINEAR_KERNELS:
    kernel = layers.get(group, {}).get(name, {}).get("kernel")
    if kernel is not None and not isinstance(kernel, policy.Fp8Kernel):
      return True
  return False


def quantize_params(params: policy.Params, config: SamplerConfig) -> policy.Params:
  """The rollout params of a sampler with `config`: FP8 decoder linears when it asks for them.

  `config.weight_dtype` "fp8_e4m3" / "fp8_e5m2": every dense decoder linear
  kernel becomes an `rlx.policy.Fp8Kernel` (`rlx.policy.quantize_linears`,
  one jitted call on device over the kernels only; compiled once per
  parameter shape, so calling it after every policy update never
  recompiles). Embeddings, LM head, norms and biases are the same arrays as
  in `params` (not copied). "auto" / None: `params` are
  returned as they are. Kernels that already are `Fp8Kernel`s are kept, so
  this is idempotent. Works inside `jax.jit` too.

  Args:
    params: the policy params (e.g. `train_state.params` after an update).
    config: the sampler's `SamplerConfig`.

  Returns:
    The params the sampler runs (the input is not modified).
  """
  if not isinstance(config, SamplerConfig):
    raise ValueError(f"`config` must be a SamplerConfig, got {type(config).__name__}.")
  if config.weight_dtype in (None, "auto") or not _has_dense_linears(params):
    return params
  return _quantize_linears_only(params, config.weight_dtype)


def fp8_compile_counts() -> dict[str, int]:
  """Programs compiled so far by the jitted calls of `quantize_params` and `calibrate_kv_scales`.

  Both compile once per parameter (and token) shape, so refreshing the rollout
  params or recalibrating the KV scales after a policy update leaves these
  counts unchanged.

  Returns:
    {"quantize_params": n, "calibrate_kv_scales": n}, over all samplers.
  """
  return {name: _TRACES[name] for name in ("quantize_params", "calibrate_kv_scales")}


def _positive(value, name: str) -> float:
  if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
    raise ValueError(f"`{name}` must be a positive finite float, got {value!r}.")
  if value <= 0:
    raise ValueError(f"`{name}` must be > 0, got {value!r}.")
  return float(value)


def kv_scales_from_absmax(
  k_amax: jax.Array,
  v_amax: jax.Array,
  *,
  k_headroom: float = K_HEADROOM,
  v_headroom: float = V_HEADROOM,
  per_head: bool = True,
) -> tuple[jax.Array, jax.Array]:
  """`(k_scale, v_scale) = (max(k_amax, 1e-10) / k_headroom, max(v_amax, 1e-10) / v_headroom)`.

  Args:
    k_amax: f32 `[L, Hkv]` (or `[L]`) abs-max of K, e.g. from `rlx.policy.kv_absmax`.
    v_amax: same for V.
    k_headroom: calibration amax maps to this FP8 value (vLLM: 200; must be
      below the format max, 448 for e4m3, for values above the calibration
      amax to fit).
    v_headroom: same for V (vLLM: 100).
    per_head: True: one scale per layer and KV head `[L, Hkv]`; False: one
      per layer `[L]` (max over heads).

  Returns:
    float32 scales in the shape above, the `kv_scales` of `Sampler.generate`
    (traced there: new values never recompile).
  """
  k_headroom = _positive(k_headroom, "k_headroom")
  v_headroom = _positive(v_headroom, "v_headroom")
  if not isinstance(per_head, bool):
    raise ValueError(f"`per_head` must be a bool, got {per_head!r}.")
  out = []
  for name, amax, headroom in (("k_amax", k_amax, k_headroom), ("v_amax", v_amax, v_headroom)):
    if np.ndim(amax) not in (1, 2) or not jnp.issubdtype(jnp.result_type(amax), jnp.floating):
      raise ValueError(
        f"`{name}` must be a float [L] or [L, Hkv] array, got "
        f"{jnp.result_type(amax)}{tuple(np.shape(amax))}."
      )
    amax = jnp.asarray(amax, jnp.float32)
    if not per_head and amax.ndim == 2:
      amax = jnp.max(amax, axis=1)
    out.append(jnp.maximum(amax, _AMAX_FLOOR) / np.float32(headroom))
  if np.shape(out[0])[:1] != np.shape(out[1])[:1]:
    raise ValueError(
      f"`k_amax` and `v_amax` need the same number of layers, got {np.shape(k_amax)} and "
      f"{np.shape(v_amax)}."
    )
  return out[0], out[1]


def _kv_absmax_impl(params, model_config, tokens, mask, positions, segment_ids):
  return policy.kv_absmax(
    params, model_config, tokens, mask, positions=positions, segment_ids=segment_ids
  )


_kv_absmax = counted_jit(_kv_absmax_impl, _TRACES, "calibrate_kv_scales", static_argnums=(1,))


def calibrate_kv_scales(
  params: policy.Params,
  model_config: policy.ModelConfig,
  tokens: Any,
  mask: Any = None,
  *,
  positions: Any = None,
  segment_ids: Any = None,
  k_headroom: float = K_HEADROOM,
  v_headroom: float = V_HEADROOM,
  per_head: bool = True,
) -> tuple[jax.Array, jax.Array]:
  """FP8 KV scales from one forward of the trainer's policy over `tokens`.

  `rlx.policy.kv_absmax` (jitted; compiled once per token shape) over the
  valid tokens, then `kv_scales_from_absmax`. Call it after every policy
  update, with the trainer's params on a batch it already has (e.g. the last
  rollout batch, prompt + completion), and pass the result as
  `Sampler.generate(..., kv_scales=...)`.

  Args:
    params: the trainer's params (dense; FP8 rollout params work too).
    model_config: the policy config.
    tokens: i32[B, S] token ids.
    mask: [B, S] nonzero on tokens that count (default: all, or `segment_ids != 0`).
    positions, segment_ids: as in `rlx.policy.forward`.
    k_headroom, v_headroom, per_head: as in `kv_scales_from_absmax`.

  Returns:
    (k_scale, v_scale) float32 `[L, Hkv]` (or `[L]` when not `per_head`).
  """
  if not isinstance(model_config, policy.ModelConfig):
    raise ValueError(
      f"`model_config` must be an rlx.policy.ModelConfig, got {type(model_config).__name__}."
    )
  policy.check_tokens(tokens, model_config.vocab_size)
  if mask is None:
    mask = jnp.ones(np.shape(tokens), bool) if segment_ids is None else segment_ids
  if np.shape(mask) != np.shape(tokens):
    raise ValueError(
      f"`mask` must have the shape of `tokens` {np.shape(tokens)}, got {np.shape(mask)}."
    )
  k_amax, v_amax = _kv_absmax(params, model_config, tokens, mask, positions, segment_ids)
  return kv_scales_from_absmax(
    k_amax, v_amax, k_headroom=k_headroom, v_headroom=v_headroom, per_head=per_head
  )
