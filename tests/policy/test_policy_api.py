"""Guards the public surface of rlx.policy (names the train step and sampler rely on)."""

import inspect

from rlx import policy

PUBLIC = (
  "AttentionFn",
  "Fp8Kernel",
  "LINEAR_KERNELS",
  "CacheAttentionFn",
  "CharTokenizer",
  "DEFAULT_CHUNK_SIZE",
  "DEFAULT_MAX_SHARD_BYTES",
  "FAMILIES",
  "LayerParamsFn",
  "ModelConfig",
  "Params",
  "RopeScaling",
  "Tokenizer",
  "apply_rope",
  "check_params",
  "check_tokens",
  "default_attention_fn",
  "dense_causal_attention",
  "embed",
  "final_norm",
  "forward",
  "get_layer",
  "hf_tensor_shapes",
  "init_params",
  "kv_absmax",
  "layer_finish",
  "layer_qkv",
  "layer_scan",
  "linear",
  "lm_head_kernel",
  "load_hf_checkpoint",
  "logits_from_hidden",
  "logprobs_from_logits",
  "param_shapes",
  "param_shardings",
  "partition_rules",
  "positions_from_segments",
  "quantize_linears",
  "rms_norm",
  "rope_inv_freq",
  "save_hf_checkpoint",
  "token_logprobs",
)


def test_public_names():
  exported = {n for n in dir(policy) if not n.startswith("_")}
  assert exported == set(PUBLIC)
  assert set(policy.__all__) == set(PUBLIC) and len(policy.__all__) == len(PUBLIC)


def test_contract_signatures():
  fwd = inspect.signature(policy.forward)
  assert list(fwd.parameters)[:4] == ["params", "config", "tokens", "positions"]
  for name in ("segment_ids", "attention_fn", "return_hidden", "layer_params_fn", "unroll"):
    assert fwd.parameters[name].kind is inspect.Parameter.KEYWORD_ONLY
  assert fwd.parameters["layer_params_fn"].default is None
  lp = inspect.signature(policy.token_logprobs)
  assert list(lp.parameters)[:4] == ["params", "config", "tokens", "mask"]
  for name in (
    "positions",
    "segment_ids",
    "temperature",
    "chunk_size",
    "layer_params_fn",
    "unroll",
  ):
    assert lp.parameters[name].kind is inspect.Parameter.KEYWORD_ONLY
  assert lp.parameters["layer_params_fn"].default is None
  assert fwd.parameters["unroll"].default is False and lp.parameters["unroll"].default is False
  rules = inspect.signature(policy.partition_rules).parameters
  assert list(rules) == ["config", "mesh", "fp8_linears"]
  assert rules["fp8_linears"].kind is inspect.Parameter.KEYWORD_ONLY
  assert list(inspect.signature(policy.init_params).parameters) == ["config", "rng"]
  for tok in (policy.Tokenizer, policy.CharTokenizer):
    methods = ("encode", "decode", "encode_batch", "decode_batch", "pad", "apply_chat_template")
    for method in methods:
      assert callable(getattr(tok, method))
