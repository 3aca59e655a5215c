"""`rlx.rl.build_model`: every `config.model` field takes effect or is rejected by name."""

import types

import jax
import jax.numpy as jnp
import ml_collections
import pytest

from rlx import policy, rl

_TASK = types.SimpleNamespace(tokenizer=types.SimpleNamespace(vocab_size=48))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
  """A random float32 Qwen2 checkpoint (config.json + safetensors)."""
  directory = tmp_path_factory.mktemp("hf_qwen2")
  mc = policy.ModelConfig.small(vocab_size=48, hidden_size=32, intermediate_size=64, head_dim=8)
  policy.save_hf_checkpoint(directory, mc, policy.init_params(mc, jax.random.PRNGKey(0)))
  return str(directory)


def _dtypes(params):
  return {x.dtype for x in jax.tree.leaves(params)}


@pytest.mark.parametrize(
  "param_dtype, compute_dtype",
  [("bfloat16", "bfloat16"), ("float32", "bfloat16"), ("float32", "float32")],
)
def test_hf_checkpoint_takes_the_config_dtypes(checkpoint, param_dtype, compute_dtype):
  c = rl.get_config()
  c.model.hf_checkpoint = checkpoint
  c.model.param_dtype = param_dtype
  c.model.compute_dtype = compute_dtype
  model_config, params = rl.build_model(c, _TASK)
  assert model_config.param_dtype == param_dtype
  assert model_config.compute_dtype == compute_dtype
  assert _dtypes(params) == {jnp.dtype(param_dtype)}
  policy.check_params(params, model_config)
  assert model_config.hidden_size == 32  # the checkpoint's sizes, not the config's defaults


@pytest.mark.parametrize("hf", [False, True])
@pytest.mark.parametrize("remat", [False, True])
def test_remat_reaches_the_model_config(checkpoint, hf, remat):
  c = rl.get_config()
  c.model.remat = remat
  if hf:
    c.model.hf_checkpoint = checkpoint
  model_config, _ = rl.build_model(c, _TASK)
  assert model_config.remat is remat


def test_a_fresh_model_takes_every_field():
  c = rl.get_config()
  c.model.family = "qwen3"
  c.model.hidden_size = 48
  c.model.num_layers = 3
  c.model.num_heads = 4
  c.model.num_kv_heads = 1
  c.model.head_dim = 8
  c.model.intermediate_size = 80
  c.model.param_dtype = "bfloat16"
  c.model.compute_dtype = "bfloat16"
  model_config, params = rl.build_model(c, _TASK)
  got = {name: getattr(model_config, name) for name in c.model.keys() if name != "hf_checkpoint"}
  assert got == {name: c.model[name] for name in got}
  assert model_config.vocab_size == 48
  assert _dtypes(params) == {jnp.dtype(jnp.bfloat16)}


@pytest.mark.parametrize(
  "name, value",
  [
    ("family", "llama"),
    ("hidden_size", 128),
    ("num_layers", 4),
    ("num_heads", 8),
    ("num_kv_heads", 4),
    ("head_dim", 32),
    ("intermediate_size", 256),
  ],
)
def test_architecture_fields_with_an_hf_checkpoint_are_rejected(checkpoint, name, value):
  c = rl.get_config()
  c.model.hf_checkpoint = checkpoint
  c.model[name] = value
  with pytest.raises(ValueError, match=rf"`config\.model\.{name}`={value!r} is set with"):
    rl.build_model(c, _TASK)


def test_a_remat_that_is_not_a_bool_is_rejected(checkpoint):
  c = rl.get_config()
  c.model = ml_collections.ConfigDict(dict(c.model.to_dict(), remat=1))  # e.g. from a JSON file
  with pytest.raises(ValueError, match=r"`config\.model\.remat` must be a bool, got 1"):
    rl.validate_config(c)
  with pytest.raises(ValueError, match=r"`remat` must be a bool, got 1"):
    policy.load_hf_checkpoint(checkpoint, remat=1)
