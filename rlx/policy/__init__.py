"""rlx.policy: the Qwen2 / Qwen3 / Llama policy model, HF checkpoints, token log-probs.

Contract (see each function's docstring for shapes):

  config, params = load_hf_checkpoint(path)            # or init_params(config, rng)
  logits = forward(params, config, tokens, positions=None, *, segment_ids=None,
                   attention_fn=None, return_hidden=False,
                   layer_params_fn=None)                          # f32[B, S, V]
  logp, entropy = token_logprobs(params, config, tokens, mask, *, positions=None,
                                 segment_ids=None, temperature=1.0, chunk_size=128,
                                 layer_params_fn=None)
  specs = partition_rules(config, mesh)                 # PartitionSpec per param
  save_hf_checkpoint(path, config, params)

`config` is a frozen, hashable `ModelConfig`: pass it as a static jit argument.
Parameters are a plain nested dict with the decoder layers stacked on a
leading `[L]` axis (tree in `rlx.policy._model`; `param_shapes(config)`).

One decoder: one block is `layer_qkv` (norm, projections, q/k norm, RoPE) ->
attention -> `layer_finish` (output projection, residual, MLP), and
`layer_scan(params, config, x, positions, *, attention_fn, cache=None, ...)`
is the single scan over the stacked blocks that `forward`, `kv_absmax` and
the rlx.sampling prefill/decode steps all run. Its hook
`attention_fn(layer_index, q, k, v, cache, *, positions, segment_ids) ->
(out, cache)` gets and returns the cache carried through the scan (e.g. a
stacked KV page pool, updated in place at `layer_index`);
`forward(..., attention_fn=f)` takes the cache-free form
`f(layer_index, q, k, v, *, positions, segment_ids) -> out`.
`kv_absmax` gives per-layer K/V abs-max from a training forward (FP8 KV scales).

FP8 linears: `quantize_linears(params, dtype)` replaces every decoder linear
kernel by an `Fp8Kernel(values, scale)` (128x128 blocks); the same decoder
then runs those layers W8A8 (dynamic 1x128 activation scales,
`rlx.kernels_pallas.fp8_blockwise_matmul`), chosen per leaf at one dispatch
point, `linear(p, x, dtype)` (every decoder linear layer). Embeddings, LM
head, norms and biases stay dense. `check_params(..., allow_fp8=True)` accepts
such trees (training does not).

Per-layer parameter hook: `layer_params_fn(layer) -> layer` runs on each
block's parameter slice inside the layer scan (rlx.train uses it to all-gather
one FSDP-sharded layer at a time); its outputs are recomputed, not stored, for
the backward pass (the block is rematerialised saving only matmul outputs).
A hook with a keyword parameter `layer_index`, `layer_params_fn(layer, *,
layer_index) -> layer`, also gets the block's index as an int32 scalar array
(in the scan and with `unroll=True` alike), e.g. to tap each layer's gradient
separately (`rlx.train.ComputeLogprobs.score_norms`).
"""

from rlx.policy._checkpoint import (
  DEFAULT_MAX_SHARD_BYTES,
  hf_tensor_shapes,
  load_hf_checkpoint,
  save_hf_checkpoint,
)
from rlx.policy._config import (
  FAMILIES,
  ModelConfig,
  RopeScaling,
)
from rlx.policy._logprobs import (
  DEFAULT_CHUNK_SIZE,
  logprobs_from_logits,
  token_logprobs,
)
from rlx.policy._model import (
  LINEAR_KERNELS,
  AttentionFn,
  CacheAttentionFn,
  Fp8Kernel,
  LayerParamsFn,
  Params,
  apply_rope,
  check_params,
  check_tokens,
  default_attention_fn,
  dense_causal_attention,
  embed,
  final_norm,
  forward,
  get_layer,
  init_params,
  kv_absmax,
  layer_finish,
  layer_qkv,
  layer_scan,
  linear,
  lm_head_kernel,
  logits_from_hidden,
  param_shapes,
  positions_from_segments,
  quantize_linears,
  rms_norm,
  rope_inv_freq,
)
from rlx.policy._sharding import (
  param_shardings,
  partition_rules,
)
from rlx.policy._tokenizer import (
  CharTokenizer,
  Tokenizer,
)

__all__ = (
  "DEFAULT_MAX_SHARD_BYTES",
  "hf_tensor_shapes",
  "load_hf_checkpoint",
  "save_hf_checkpoint",
  "FAMILIES",
  "ModelConfig",
  "RopeScaling",
  "DEFAULT_CHUNK_SIZE",
  "logprobs_from_logits",
  "token_logprobs",
  "LINEAR_KERNELS",
  "AttentionFn",
  "CacheAttentionFn",
  "Fp8Kernel",
  "LayerParamsFn",
  "Params",
  "apply_rope",
  "check_params",
  "check_tokens",
  "default_attention_fn",
  "dense_causal_attention",
  "embed",
  "final_norm",
  "forward",
  "get_layer",
  "init_params",
  "kv_absmax",
  "layer_finish",
  "layer_qkv",
  "layer_scan",
  "linear",
  "lm_head_kernel",
  "logits_from_hidden",
  "param_shapes",
  "positions_from_segments",
  "quantize_linears",
  "rms_norm",
  "rope_inv_freq",
  "param_shardings",
  "partition_rules",
  "CharTokenizer",
  "Tokenizer",
)
