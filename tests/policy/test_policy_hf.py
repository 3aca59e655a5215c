"""Parity with HF transformers (PyTorch CPU) and HF checkpoint load/save.

Tiny random Qwen2 / Qwen3 / Llama checkpoints are written once per module by
`transformers` itself, with all weights (norms and biases included) drawn at
O(1) scale so that a wrong transpose, rope layout or norm shows up in the
logits.

bf16 tolerance: both implementations round activations to bf16, at different
points (HF applies RoPE and the residual adds in bf16, rlx rotates in float32
and takes logits with float32 accumulation), so bf16 logits agree only to bf16
resolution. Measured max-abs error on these checkpoints: 0.042 (qwen2, logit
scale 5.2), 0.28 (qwen3, scale 53) and 0.038 (llama, scale 4.7), i.e. 0.5-1%
of the largest logit; the test allows
`BF16_RTOL * (1 + max |logit|)` with BF16_RTOL = 0.05.
"""

import copy
import json
import os
import warnings

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from rlx import policy  # noqa: E402

VOCAB = 128
LENGTHS = (12, 7, 3)
BF16_RTOL = 0.05

_HF_CONFIGS = {
  "qwen2": lambda: transformers.Qwen2Config(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    rope_theta=10000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
  ),
  "qwen3": lambda: transformers.Qwen3Config(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=64,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
    attention_bias=False,
  ),
  "llama": lambda: transformers.LlamaConfig(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    attention_bias=True,
    rope_theta=500000.0,
    rope_scaling={
      "rope_type": "llama3",
      "factor": 8.0,
      "low_freq_factor": 1.0,
      "high_freq_factor": 4.0,
      "original_max_position_embeddings": 64,
    },
  ),
}

_MODEL_CLASSES = {
  "qwen2": "Qwen2ForCausalLM",
  "qwen3": "Qwen3ForCausalLM",
  "llama": "LlamaForCausalLM",
}


def _randomize(model, seed: int) -> None:
  gen = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for name, p in model.named_parameters():
      noise = torch.randn(p.shape, generator=gen)
      if name.endswith("norm.weight"):
        p.copy_(1.0 + 0.2 * noise)
      elif name.endswith("bias"):
        p.copy_(0.2 * noise)
      elif "embed_tokens" in name:
        p.copy_(noise)
      else:
        p.copy_(noise / np.sqrt(p.shape[1]))


def _batch():
  rng = np.random.default_rng(0)
  tokens = np.zeros((len(LENGTHS), max(LENGTHS)), np.int32)
  mask = np.zeros_like(tokens)
  for i, n in enumerate(LENGTHS):
    tokens[i, :n] = rng.integers(1, VOCAB, n)
    mask[i, :n] = 1
  return tokens, mask


def _hf_logits(model, tokens, mask):
  with torch.no_grad():
    out = model(
      input_ids=torch.from_numpy(tokens.astype(np.int64)),
      attention_mask=torch.from_numpy(mask.astype(np.int64)),
    )
  return out.logits.float().numpy()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
  """family -> (directory, hf_model in f32)."""
  out = {}
  for seed, (family, make_config) in enumerate(_HF_CONFIGS.items()):
    hf_config = make_config()
    hf_config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = getattr(transformers, _MODEL_CLASSES[family])(hf_config).eval()
    _randomize(model, seed)
    directory = tmp_path_factory.mktemp(family)
    # The llama checkpoint is written sharded (index + several files).
    shard = "40KB" if family == "llama" else "1GB"
    model.save_pretrained(directory, max_shard_size=shard)
    out[family] = (str(directory), model)
  assert os.path.exists(os.path.join(out["llama"][0], "model.safetensors.index.json"))
  return out


_forward = jax.jit(policy.forward, static_argnums=1)


def _valid_max_abs(a, b, mask):
  return float(np.max(np.abs(a - b)[mask.astype(bool)]))


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "llama"])
def test_config_matches_hf(checkpoints, family):
  directory, _ = checkpoints[family]
  config, params = policy.load_hf_checkpoint(directory)
  assert config.family == family
  assert config.param_dtype == "float32"
  assert config.qk_norm == (family == "qwen3")
  assert config.tie_embeddings == (family == "qwen3")
  assert ("lm_head" in params) == (family != "qwen3")
  if family == "llama":
    assert config.rope_scaling == policy.RopeScaling(8.0, 1.0, 4.0, 64)
    assert config.attention_bias and config.attention_out_bias
  if family == "qwen3":
    assert config.head_dim == 32  # decoupled from hidden_size / num_heads = 16
  policy.check_params(params, config)


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "llama"])
def test_logits_match_hf_float32(checkpoints, family):
  directory, model = checkpoints[family]
  config, params = policy.load_hf_checkpoint(directory)
  tokens, mask = _batch()
  ours = np.asarray(_forward(params, config, jnp.asarray(tokens)))
  ref = _hf_logits(model, tokens, mask)
  assert np.max(np.abs(ref)) > 1.0  # logits are O(1): the comparison is sensitive
  err = _valid_max_abs(ours, ref, mask)
  assert err < 1e-4, f"{family}: max-abs logit error {err}"
  # Segment ids marking the padding give the same logits on real tokens.
  ours_seg = np.asarray(
    _forward(params, config, jnp.asarray(tokens), segment_ids=jnp.asarray(mask))
  )
  assert _valid_max_abs(ours_seg, ref, mask) < 1e-4


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "llama"])
def test_logits_match_hf_bfloat16(checkpoints, family):
  directory, model = checkpoints[family]
  config, params = policy.load_hf_checkpoint(directory, dtype="bfloat16")
  assert config.compute_dtype == "bfloat16"
  assert params["embed"]["embedding"].dtype == jnp.bfloat16
  tokens, mask = _batch()
  ours = np.asarray(_forward(params, config, jnp.asarray(tokens)))
  ref = _hf_logits(copy.deepcopy(model).to(torch.bfloat16), tokens, mask)
  scale = 1.0 + np.max(np.abs(ref))
  err = _valid_max_abs(ours, ref, mask)
  print(f"{family}: bf16 max-abs logit error {err:.4f}, logit scale {scale:.2f}")
  assert err < BF16_RTOL * scale, f"{family}: bf16 max-abs error {err}, logit scale {scale}"


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "llama"])
def test_save_loads_in_transformers(checkpoints, family, tmp_path):
  directory, model = checkpoints[family]
  config, params = policy.load_hf_checkpoint(directory)
  out = tmp_path / "saved"
  policy.save_hf_checkpoint(out, config, params, max_shard_bytes=60_000)
  assert os.path.exists(out / "model.safetensors.index.json")
  reloaded = transformers.AutoModelForCausalLM.from_pretrained(
    out, attn_implementation="eager"
  ).eval()
  ref_state = model.state_dict()
  new_state = reloaded.state_dict()
  assert set(ref_state) == set(new_state)
  for name, tensor in ref_state.items():
    assert torch.equal(tensor, new_state[name]), name
  tokens, mask = _batch()
  ours = np.asarray(_forward(params, config, jnp.asarray(tokens)))
  err = _valid_max_abs(ours, _hf_logits(reloaded, tokens, mask), mask)
  assert err < 1e-4


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_round_trip_is_bitwise(checkpoints, dtype, tmp_path):
  directory, _ = checkpoints["qwen3"]
  config, params = policy.load_hf_checkpoint(directory, dtype=dtype)
  policy.save_hf_checkpoint(tmp_path, config, params)
  config2, params2 = policy.load_hf_checkpoint(tmp_path)
  assert config2 == config
  flat1 = jax.tree_util.tree_leaves_with_path(params)
  flat2 = dict(jax.tree_util.tree_leaves_with_path(params2))
  assert len(flat1) == len(flat2)
  for path, leaf in flat1:
    other = flat2[path]
    assert other.dtype == leaf.dtype
    np.testing.assert_array_equal(
      np.asarray(leaf).view(np.uint8), np.asarray(other).view(np.uint8), err_msg=str(path)
    )


# ----------------------------------------------------------------------------
# Errors.


def _copy_checkpoint(src: str, dst, edit_config=None, edit_tensors=None):
  os.makedirs(dst, exist_ok=True)
  with open(os.path.join(src, "config.json")) as f:
    cfg = json.load(f)
  if edit_config:
    edit_config(cfg)
  with open(os.path.join(dst, "config.json"), "w") as f:
    json.dump(cfg, f)
  tensors = load_file(os.path.join(src, "model.safetensors"))
  if edit_tensors:
    edit_tensors(tensors)
  save_file(tensors, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})


def test_wrong_architecture_is_named(checkpoints, tmp_path):
  src = checkpoints["qwen2"][0]

  def mistral(cfg):
    cfg["model_type"] = "mistral"
    cfg["architectures"] = ["MistralForCausalLM"]

  _copy_checkpoint(src, tmp_path / "a", edit_config=mistral)
  with pytest.raises(ValueError, match="mistral"):
    policy.load_hf_checkpoint(tmp_path / "a")

  def classifier(cfg):
    cfg["architectures"] = ["Qwen2ForSequenceClassification"]

  _copy_checkpoint(src, tmp_path / "b", edit_config=classifier)
  with pytest.raises(ValueError, match="Qwen2ForSequenceClassification"):
    policy.load_hf_checkpoint(tmp_path / "b")


def test_missing_unexpected_and_misshaped_tensors_are_named(checkpoints, tmp_path):
  src = checkpoints["qwen2"][0]

  def edit(tensors):
    del tensors["model.layers.1.self_attn.k_proj.bias"]
    tensors["model.layers.0.mlp.up_proj.weight"] = np.zeros((128, 32), np.float32)
    tensors["model.layers.0.extra.weight"] = np.zeros((3,), np.float32)

  _copy_checkpoint(src, tmp_path, edit_tensors=edit)
  with pytest.raises(ValueError) as info:
    policy.load_hf_checkpoint(tmp_path)
  message = str(info.value)
  assert "missing tensors: model.layers.1.self_attn.k_proj.bias" in message
  assert "model.layers.0.mlp.up_proj.weight has shape (128, 32), expected (128, 64)" in message
  assert "unexpected tensors: model.layers.0.extra.weight" in message


def test_tied_checkpoint_with_redundant_head(checkpoints, tmp_path):
  src = checkpoints["qwen3"][0]

  def add_same_head(tensors):
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].copy()

  _copy_checkpoint(src, tmp_path / "same", edit_tensors=add_same_head)
  policy.load_hf_checkpoint(tmp_path / "same")

  def add_other_head(tensors):
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"] + 1

  _copy_checkpoint(src, tmp_path / "other", edit_tensors=add_other_head)
  with pytest.raises(ValueError, match="lm_head.weight"):
    policy.load_hf_checkpoint(tmp_path / "other")


def test_token_id_out_of_vocab_is_named(checkpoints):
  config, params = policy.load_hf_checkpoint(checkpoints["qwen2"][0])
  tokens = np.array([[1, 2, VOCAB]], np.int32)
  with pytest.raises(ValueError, match=f"token id {VOCAB} outside"):
    policy.forward(params, config, tokens)
  with pytest.raises(ValueError, match="token id -1 outside"):
    policy.token_logprobs(params, config, -np.ones((1, 3), np.int32), np.ones((1, 3)))


def test_bf16_checkpoint_dtype_is_kept(checkpoints, tmp_path):
  src = checkpoints["qwen2"][0]

  def to_bf16(tensors):
    for k, v in tensors.items():
      tensors[k] = v.astype(ml_dtypes.bfloat16)

  def set_dtype(cfg):
    cfg["dtype"] = "bfloat16"

  _copy_checkpoint(src, tmp_path, edit_config=set_dtype, edit_tensors=to_bf16)
  config, params = policy.load_hf_checkpoint(tmp_path)
  assert config.param_dtype == "bfloat16"
  assert all(x.dtype == jnp.bfloat16 for x in jax.tree_util.tree_leaves(params))
  config32, params32 = policy.load_hf_checkpoint(tmp_path, dtype=jnp.float32)
  assert config32.param_dtype == "float32"
  np.testing.assert_array_equal(
    np.asarray(params32["embed"]["embedding"]),
    np.asarray(params["embed"]["embedding"]).astype(np.float32),
  )


def test_transformers_written_configs_load_without_defaulted_fields(checkpoints):
  for directory, _ in checkpoints.values():
    with warnings.catch_warnings():
      warnings.simplefilter("error")
      policy.load_hf_checkpoint(directory)


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "llama"])
def test_absent_fields_resolve_like_transformers(family):
  # A config.json with only the required sizes: rlx and transformers must build the same
  # model (transformers fills absent fields with its config class defaults).
  minimal = dict(
    model_type=family, vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
    num_hidden_layers=2, num_attention_heads=32,
  )  # fmt: skip
  hf = getattr(transformers, _MODEL_CLASSES[family].replace("ForCausalLM", "Config"))(**minimal)
  with pytest.warns(UserWarning, match="num_key_value_heads"):
    ours = policy.ModelConfig.from_hf_config(minimal)
  head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
  assert ours.num_kv_heads == hf.num_key_value_heads
  assert ours.head_dim == head_dim
  assert ours.rms_norm_eps == hf.rms_norm_eps
  assert ours.rope_theta == hf.rope_parameters["rope_theta"]
  assert ours.rope_scaling is None and hf.rope_parameters["rope_type"] == "default"
  assert ours.tie_embeddings == hf.tie_word_embeddings
  assert ours.max_position_embeddings == hf.max_position_embeddings
  if family != "qwen2":
    assert ours.attention_bias == hf.attention_bias
