"""Hostile HF configs and checkpoint files: every bad field or file gives an error naming it.

Config cases run `ModelConfig.from_hf_config` on edited `config.json` dicts
(no torch); file cases write a tiny checkpoint with `save_hf_checkpoint` and
then damage it (truncated safetensors, broken index, duplicated tensors).
"""

import json
import math
import os
import warnings

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from rlx import policy

ModelConfig = policy.ModelConfig


def _hf(family="llama", **edits):
  config = (
    ModelConfig.small(
      family,
      rope_scaling=policy.RopeScaling(8.0, 1.0, 4.0, 64),
      attention_bias=True,
      attention_out_bias=True,
    )
    if family == "llama"
    else ModelConfig.small(family)
  )
  hf = config.to_hf_config()
  for key, value in edits.items():
    if value is _DELETE:
      del hf[key]
    else:
      hf[key] = value
  return hf


_DELETE = object()


def _from_hf(hf):
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # a defaulted field would warn: not expected here
    return ModelConfig.from_hf_config(hf)


# ----------------------------------------------------------------------------
# Contradicting fields.


def test_both_rope_layouts_must_agree():
  for family in ("qwen2", "qwen3", "llama"):  # to_hf_config writes both, consistent
    assert _from_hf(_hf(family)) == ModelConfig.from_hf_config(_hf(family))
  hf = _hf("qwen2", rope_theta=5e5)  # rope_parameters still holds 1e4
  with pytest.raises(ValueError, match="rope_theta=500000.0 and rope_parameters.rope_theta"):
    ModelConfig.from_hf_config(hf)
  hf = _hf("llama")
  hf["rope_scaling"] = dict(hf["rope_scaling"], factor=4.0)
  with pytest.raises(ValueError, match="rope_scaling.factor=4.0 and rope_parameters.factor=8.0"):
    ModelConfig.from_hf_config(hf)
  with pytest.raises(ValueError, match="rope_scaling.rope_type='default'"):
    ModelConfig.from_hf_config(_hf("llama", rope_scaling=None))  # null: no scaling
  hf = _hf("llama", rope_parameters=_DELETE)
  hf["rope_scaling"] = dict(hf["rope_scaling"], rope_theta=1.0)
  with pytest.raises(ValueError, match="rope_theta=10000.0 and rope_scaling.rope_theta=1.0"):
    ModelConfig.from_hf_config(hf)
  hf = _hf("llama", rope_parameters=_DELETE)
  hf["rope_scaling"] = dict(hf["rope_scaling"], type="linear")
  with pytest.raises(ValueError, match="type='linear' and rope_type='llama3'"):
    ModelConfig.from_hf_config(hf)


def test_rope_parameters_alone_and_legacy_alone_are_read():
  want = _from_hf(_hf("llama"))
  assert _from_hf(_hf("llama", rope_theta=_DELETE, rope_scaling=_DELETE)) == want
  assert _from_hf(_hf("llama", rope_parameters=_DELETE)) == want
  # transformers 5 layout keyed by layer type.
  hf = _hf("qwen3", rope_theta=_DELETE, rope_scaling=_DELETE)
  hf["rope_parameters"] = {"full_attention": hf["rope_parameters"]}
  assert _from_hf(hf) == _from_hf(_hf("qwen3"))


@pytest.mark.parametrize(
  ("rope", "match"),
  [
    ({"rope_type": "default", "rope_theta": 1e4, "mrope_section": [1]}, "mrope_section"),
    ({"rope_type": "default", "rope_theta": 1e4, "factor": 2.0}, "takes no scaling"),
    ({"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0}, "missing fields"),
    ({"rope_type": "yarn", "rope_theta": 1e4, "factor": 8.0}, "'yarn'"),
    ({"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}, "partial"),
    ("default", "rope_parameters must be a dict"),
  ],
)
def test_rope_parameter_dict_is_checked(rope, match):
  hf = _hf("qwen2", rope_theta=_DELETE, rope_scaling=_DELETE, rope_parameters=rope)
  with pytest.raises(ValueError, match=match):
    ModelConfig.from_hf_config(hf)


def test_dtype_and_torch_dtype_must_agree():
  with pytest.raises(ValueError, match="dtype='bfloat16' and torch_dtype='float16' disagree"):
    ModelConfig.from_hf_config(_hf(dtype="bfloat16", torch_dtype="float16"))
  with pytest.raises(ValueError, match="torch_dtype='float8_e4m3fn'"):
    ModelConfig.from_hf_config(_hf(dtype=_DELETE, torch_dtype="float8_e4m3fn"))
  c = _from_hf(_hf(dtype=_DELETE, torch_dtype="bfloat16"))
  assert c.param_dtype == c.compute_dtype == "bfloat16"
  c = _from_hf(_hf(dtype=None, torch_dtype=None))
  assert c.param_dtype == "float32"


# ----------------------------------------------------------------------------
# Absent fields: transformers' default of the model type, with a warning naming them.


def test_absent_kv_heads_take_the_transformers_default_with_a_warning():
  with pytest.warns(UserWarning, match="num_key_value_heads \\(using num_attention_heads = 4\\)"):
    c = ModelConfig.from_hf_config(_hf("llama", num_key_value_heads=_DELETE))
  assert c.num_kv_heads == 4  # LlamaConfig: multi-head attention
  # Qwen2Config's default is 32 KV heads, which 4 query heads cannot use: named error.
  with pytest.warns(UserWarning, match="num_key_value_heads \\(using 32\\)"):
    with pytest.raises(ValueError, match="num_heads.*multiple of `num_kv_heads` \\(32\\)"):
      ModelConfig.from_hf_config(_hf("qwen2", num_key_value_heads=_DELETE))
  c = _from_hf(_hf("qwen2", num_key_value_heads=None))  # explicit null: as many as heads
  assert c.num_kv_heads == 4


def test_head_dim_rules():
  # Absent for qwen2 / llama: hidden / heads, which must divide.
  assert _from_hf(_hf("qwen2", head_dim=_DELETE)).head_dim == 16
  with pytest.raises(ValueError, match="hidden_size=66 is not a multiple of num_attention_heads"):
    ModelConfig.from_hf_config(_hf("llama", head_dim=None, hidden_size=66))
  # Qwen3Config's default head_dim is 128 (not hidden / heads).
  with pytest.warns(UserWarning, match="head_dim \\(using 128\\)"):
    assert ModelConfig.from_hf_config(_hf("qwen3", head_dim=_DELETE)).head_dim == 128
  # Explicit values may differ from hidden / heads (Qwen3, Llama decouple them).
  assert _from_hf(_hf("llama", head_dim=32)).head_dim == 32


def test_absent_eps_and_theta_are_named():
  hf = _hf("qwen2", rms_norm_eps=_DELETE, rope_parameters=_DELETE, rope_theta=_DELETE)
  with pytest.warns(UserWarning, match="rms_norm_eps \\(using 1e-06\\).*rope_theta"):
    c = ModelConfig.from_hf_config(hf)
  assert (c.rms_norm_eps, c.rope_theta) == (1e-6, 10000.0)


@pytest.mark.parametrize(
  "field",
  ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"],
)
def test_absent_size_field_is_an_error(field):
  with pytest.raises(ValueError, match=f"lacks the required field '{field}'"):
    ModelConfig.from_hf_config(_hf(**{field: _DELETE}))


# ----------------------------------------------------------------------------
# Every field read: wrong type or range -> an error naming the field.

_BAD_VALUES = [
  # sizes: non-positive, fractional, string and bool values were int()-coerced or crashed
  *[
    (field, value)
    for field in (
      "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
      "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings",
    )
    for value in (0, -2, 2.5, "64", True)
  ],
  # num_key_value_heads = 0 / head_dim = 0 fell back silently to the defaults
  ("rms_norm_eps", 0.0), ("rms_norm_eps", -1e-6), ("rms_norm_eps", math.nan),
  ("rms_norm_eps", math.inf), ("rms_norm_eps", "1e-6"), ("rms_norm_eps", None),
  ("rope_theta", 0.0), ("rope_theta", -1e4), ("rope_theta", math.nan), ("rope_theta", "1e4"),
  ("tie_word_embeddings", "false"), ("tie_word_embeddings", 1), ("tie_word_embeddings", None),
  ("attention_bias", "true"), ("attention_bias", 0),
  ("hidden_act", "gelu"), ("use_sliding_window", True), ("mlp_bias", True),
  ("attention_dropout", 0.1), ("use_mrope", True), ("quantization_config", {"bits": 8}),
  ("partial_rotary_factor", 0.5), ("layer_types", ["full_attention"]), ("layer_types", "x"),
  ("eos_token_id", 128), ("eos_token_id", "1"), ("eos_token_id", [1, 2.0]),
  ("bos_token_id", -1), ("pad_token_id", 1.5), ("architectures", "LlamaForCausalLM"),
]  # fmt: skip


@pytest.mark.parametrize(("field", "value"), _BAD_VALUES)
def test_bad_field_value_is_named(field, value):
  edits = {field: value}
  if field == "rope_theta":  # in both layouts, so they agree
    hf = _hf("llama", **edits)
    hf["rope_parameters"]["rope_theta"] = value
  else:
    hf = _hf("llama", **edits)
  with pytest.raises(ValueError, match=field):
    ModelConfig.from_hf_config(hf)


def test_qwen2_attention_bias_false_is_rejected():
  # transformers' Qwen2Attention always has q/k/v biases whatever this field says.
  with pytest.raises(ValueError, match="attention_bias=False"):
    ModelConfig.from_hf_config(_hf("qwen2", attention_bias=False))
  assert _from_hf(_hf("qwen2", attention_bias=True)).attention_bias


@pytest.mark.parametrize(
  ("edit", "match"),
  [
    ({"factor": 0.0}, "factor"),
    ({"factor": math.inf}, "factor"),
    ({"low_freq_factor": 4.0, "high_freq_factor": 1.0}, "high_freq_factor > low_freq_factor"),
    ({"high_freq_factor": 1.0}, "high_freq_factor > low_freq_factor"),
    ({"original_max_position_embeddings": 0}, "original_max_position_embeddings"),
    ({"original_max_position_embeddings": 64.5}, "original_max_position_embeddings"),
  ],
)
def test_llama3_rope_scaling_values_are_checked(edit, match):
  hf = _hf("llama", rope_theta=_DELETE, rope_scaling=_DELETE)
  hf["rope_parameters"].update(edit)
  with pytest.raises(ValueError, match=match):
    ModelConfig.from_hf_config(hf)


def test_model_config_rejects_non_positive_eps_and_theta():
  # These give NaN / inf only later, in the logits (rsqrt(var + 0) on a zero row, 0 ** -x).
  for kwargs in (
    dict(rms_norm_eps=0.0),
    dict(rms_norm_eps=-1.0),
    dict(rope_theta=0.0),
    dict(rope_theta=-10.0),
    dict(rope_theta=math.nan),
  ):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
      ModelConfig.small("qwen2", **kwargs)
  with pytest.raises(ValueError, match="tie_embeddings"):
    ModelConfig.small("qwen2", tie_embeddings=1)
  with pytest.raises(ValueError, match="max_position_embeddings"):
    ModelConfig.small("qwen2", max_position_embeddings=0)


# ----------------------------------------------------------------------------
# Files: errors name the file.


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  """A tiny qwen2 checkpoint written twice: one file, and sharded with an index."""
  config = ModelConfig.small("qwen2")
  params = policy.init_params(config, jax.random.key(0))
  single = tmp_path_factory.mktemp("single")
  policy.save_hf_checkpoint(single, config, params)
  sharded = tmp_path_factory.mktemp("sharded")
  policy.save_hf_checkpoint(sharded, config, params, max_shard_bytes=60_000)
  assert os.path.exists(sharded / "model.safetensors.index.json")
  return config, single, sharded


def _copy(src, dst):
  os.makedirs(dst, exist_ok=True)
  for name in os.listdir(src):
    with open(src / name, "rb") as f, open(dst / name, "wb") as g:
      g.write(f.read())
  return dst


@pytest.mark.parametrize("keep", [4, 30, -100])  # header too small, bad header, data cut short
def test_truncated_safetensors_names_the_file(saved, tmp_path, keep):
  _, single, sharded = saved
  for src in (single, sharded):
    d = _copy(src, tmp_path / src.name)
    file = sorted(f for f in os.listdir(d) if f.endswith(".safetensors"))[-1]
    data = (d / file).read_bytes()
    (d / file).write_bytes(data[:keep])
    with pytest.raises(ValueError, match=f"Cannot read safetensors file .*{file}"):
      policy.load_hf_checkpoint(d)


def test_index_without_weight_map_names_the_file(saved, tmp_path):
  _, _, sharded = saved
  d = _copy(sharded, tmp_path / "a")
  index = d / "model.safetensors.index.json"
  for content in ({"metadata": {}}, {"weight_map": {}}, {"weight_map": ["x"]}, ["x"]):
    index.write_text(json.dumps(content))
    with pytest.raises(ValueError, match="model.safetensors.index.json has no `weight_map`"):
      policy.load_hf_checkpoint(d)
  index.write_text("{not json")
  with pytest.raises(ValueError, match="model.safetensors.index.json is not valid JSON"):
    policy.load_hf_checkpoint(d)
  index.write_text(json.dumps({"weight_map": {"model.norm.weight": "../model.safetensors"}}))
  with pytest.raises(ValueError, match="invalid shard file names"):
    policy.load_hf_checkpoint(d)


def test_tensor_stored_twice_names_both_files(saved, tmp_path):
  _, single, _ = saved
  d = _copy(single, tmp_path / "a")  # no index: every *.safetensors file is read
  os.rename(d / "model.safetensors", d / "a.safetensors")
  name = "model.norm.weight"
  save_file({name: load_file(d / "a.safetensors")[name]}, d / "b.safetensors")
  with pytest.raises(ValueError, match=f"{name} is stored twice, in .*a.safetensors and in "):
    policy.load_hf_checkpoint(d)


def test_index_and_shards_must_agree(saved, tmp_path):
  _, _, sharded = saved
  d = _copy(sharded, tmp_path / "a")
  index = d / "model.safetensors.index.json"
  content = json.loads(index.read_text())
  weight_map = content["weight_map"]
  name = "model.norm.weight"
  first, holder = sorted(set(weight_map.values()))[0], weight_map[name]
  assert first != holder
  weight_map[name] = first  # the index places it in a shard that does not hold it
  index.write_text(json.dumps(content))
  with pytest.raises(ValueError, match=f"{holder} holds tensor {name}, which .* places in {first}"):
    policy.load_hf_checkpoint(d)
  del weight_map[name]  # not listed at all
  index.write_text(json.dumps(content))
  with pytest.raises(ValueError, match=f"{holder} holds tensor {name}, which .* places nowhere"):
    policy.load_hf_checkpoint(d)
  weight_map[name] = holder
  weight_map["model.extra.weight"] = first  # listed, but no shard holds it
  index.write_text(json.dumps(content))
  with pytest.raises(ValueError, match=f"do not hold: model.extra.weight \\({first}\\)"):
    policy.load_hf_checkpoint(d)


def test_bad_config_json_names_the_file(saved, tmp_path):
  _, single, _ = saved
  d = _copy(single, tmp_path / "a")
  (d / "config.json").write_text("{")
  with pytest.raises(ValueError, match="config.json is not valid JSON"):
    policy.load_hf_checkpoint(d)
  hf = _hf("qwen2", rms_norm_eps=0.0)
  (d / "config.json").write_text(json.dumps(hf))
  with pytest.raises(ValueError, match=f"{d}/config.json: .*rms_norm_eps"):
    policy.load_hf_checkpoint(d)


def test_non_float_tensor_is_named(saved, tmp_path):
  _, single, _ = saved
  d = _copy(single, tmp_path / "a")
  tensors = load_file(d / "model.safetensors")
  tensors["model.norm.weight"] = np.ones(tensors["model.norm.weight"].shape, np.int32)
  save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
  with pytest.raises(ValueError, match="model.norm.weight with non-float dtype int32"):
    policy.load_hf_checkpoint(d)


def test_untied_config_without_head_names_the_tie_flag(saved, tmp_path):
  _, single, _ = saved
  d = _copy(single, tmp_path / "a")
  tensors = load_file(d / "model.safetensors")
  del tensors["lm_head.weight"]
  save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
  with pytest.raises(ValueError, match="missing tensors: lm_head.weight .*tie_word_embeddings"):
    policy.load_hf_checkpoint(d)


def test_numpy_numbers_are_accepted_and_stored_as_python_numbers():
  config = ModelConfig.small("qwen2", vocab_size=np.int64(128), rope_theta=np.float32(1e4))
  assert config == ModelConfig.small("qwen2") and type(config.vocab_size) is int
  assert hash(config) == hash(ModelConfig.small("qwen2"))
  with pytest.raises(ValueError, match="`vocab_size` must be a positive int"):
    ModelConfig.small("qwen2", vocab_size=np.float32(128))


def test_checkpoint_paths_are_checked(saved, tmp_path):
  _, single, _ = saved
  config, params = policy.load_hf_checkpoint(single)
  for bad in (None, 3, b"dir"):
    with pytest.raises(ValueError, match="`path` must be a str or os.PathLike"):
      policy.load_hf_checkpoint(bad)
    with pytest.raises(ValueError, match="`path` must be a str or os.PathLike"):
      policy.save_hf_checkpoint(bad, config, params)
  with pytest.raises(ValueError, match="`path` .*nope does not exist"):
    policy.load_hf_checkpoint(tmp_path / "nope")
  with pytest.raises(ValueError, match="`path` .*config.json is not a directory"):
    policy.load_hf_checkpoint(single / "config.json")
  with pytest.raises(ValueError, match="`path` .*config.json exists and is not a directory"):
    policy.save_hf_checkpoint(single / "config.json", config, params)
  with pytest.raises(ValueError, match="`config` must be a rlx.policy.ModelConfig"):
    policy.save_hf_checkpoint(tmp_path / "out", "qwen2", params)
  with pytest.raises(ValueError, match="`max_shard_bytes` must be a positive int"):
    policy.save_hf_checkpoint(tmp_path / "out", config, params, max_shard_bytes="1GB")
