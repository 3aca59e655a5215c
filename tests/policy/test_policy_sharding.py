"""partition_rules on 1 device and on meshes of the 8 fake CPU devices (tests/conftest.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from rlx import policy

CONFIG = policy.ModelConfig.small("qwen2")  # D=64, H=4, Hkv=2, I=128, V=128, L=2


def _mesh(data, fsdp, tensor):
  devices = np.asarray(jax.devices()[: data * fsdp * tensor]).reshape(data, fsdp, tensor)
  return Mesh(devices, ("data", "fsdp", "tensor"))


@pytest.fixture(scope="module")
def params():
  return policy.init_params(CONFIG, jax.random.key(0))


def test_specs_by_hand():
  specs = policy.partition_rules(CONFIG, _mesh(1, 2, 4))
  assert specs["embed"]["embedding"] == P("tensor", "fsdp")
  assert specs["lm_head"]["kernel"] == P("fsdp", "tensor")
  attn = specs["layers"]["attn"]
  assert attn["q_proj"]["kernel"] == P(None, "fsdp", "tensor")
  assert attn["q_proj"]["bias"] == P(None, "tensor")
  # 2 KV heads cannot be split 4 ways: replicated on "tensor", still fsdp on D.
  assert attn["k_proj"]["kernel"] == P(None, "fsdp", None)
  assert attn["v_proj"]["bias"] == P(None, None)
  assert attn["o_proj"]["kernel"] == P(None, "tensor", "fsdp")
  mlp = specs["layers"]["mlp"]
  assert mlp["gate_proj"]["kernel"] == P(None, "fsdp", "tensor")
  assert mlp["down_proj"]["kernel"] == P(None, "tensor", "fsdp")
  assert specs["layers"]["input_norm"]["scale"] == P(None, None)
  assert specs["final_norm"]["scale"] == P(None)


def test_size_one_missing_and_non_divisible_axes_replicate():
  one = policy.partition_rules(CONFIG, _mesh(1, 1, 1))
  assert all(s == P(*[None] * len(s)) for s in jax.tree_util.tree_leaves(one, is_leaf=_is_spec))
  # A mesh without a "tensor" axis.
  fsdp_only = Mesh(np.asarray(jax.devices()[:8]), ("fsdp",))
  specs = policy.partition_rules(CONFIG, fsdp_only)
  assert specs["embed"]["embedding"] == P(None, "fsdp")
  # vocab 100 is not divisible by 8: the vocab dim replicates.
  odd = policy.ModelConfig.small("llama", vocab_size=100)
  specs = policy.partition_rules(odd, _mesh(1, 1, 8))
  assert specs["embed"]["embedding"] == P(None, None)
  assert specs["layers"]["mlp"]["up_proj"]["kernel"] == P(None, None, "tensor")
  with pytest.raises(ValueError, match="mesh"):
    policy.partition_rules(CONFIG, {"fsdp": 2})


def _is_spec(x):
  return isinstance(x, P)


@pytest.mark.parametrize("shape", [(1, 1, 1), (1, 2, 4), (2, 2, 2), (1, 8, 1)])
def test_sharded_forward_equals_unsharded(params, shape):
  mesh = _mesh(*shape)
  shardings = policy.param_shardings(CONFIG, mesh)
  assert jax.tree_util.tree_structure(shardings) == jax.tree_util.tree_structure(params)
  sharded = jax.device_put(params, shardings)
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 128, (8, 8)), jnp.int32)
  tokens = jax.device_put(tokens, NamedSharding(mesh, P(("data", "fsdp"), None)))
  ref = jax.jit(policy.forward, static_argnums=1)(params, CONFIG, np.asarray(tokens))
  out = jax.jit(policy.forward, static_argnums=1)(sharded, CONFIG, tokens)
  np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=1e-5)


def test_load_checkpoint_directly_into_shardings(params, tmp_path):
  policy.save_hf_checkpoint(tmp_path, CONFIG, params)
  mesh = _mesh(1, 2, 4)
  shardings = policy.param_shardings(CONFIG, mesh)
  _, loaded = policy.load_hf_checkpoint(tmp_path, shardings=shardings)
  for (path, leaf), want in zip(
    jax.tree_util.tree_leaves_with_path(loaded), jax.tree_util.tree_leaves(shardings), strict=True
  ):
    assert leaf.sharding == want, path
  np.testing.assert_array_equal(
    np.asarray(loaded["layers"]["attn"]["q_proj"]["kernel"]),
    np.asarray(params["layers"]["attn"]["q_proj"]["kernel"]),
  )


def test_config_must_be_a_model_config():
  mesh = _mesh(1, 1, 1)
  with pytest.raises(ValueError, match="`config` must be a rlx.policy.ModelConfig"):
    policy.partition_rules("qwen2", mesh)
  with pytest.raises(ValueError, match="`config` must be a rlx.policy.ModelConfig"):
    policy.hf_tensor_shapes({"model_type": "qwen2"})
