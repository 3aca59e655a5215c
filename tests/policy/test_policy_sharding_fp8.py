"""partition_rules(fp8_linears=True): FP8 rollout params on meshes of the 8 fake CPU devices.

tests/conftest.py requests 8 host devices before JAX is imported. The FP8
values of every decoder linear take the dense kernel's spec; a block-scale
dim follows the same axis only where each shard holds whole 128-blocks.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from rlx import policy

# D = 256 (two 128-blocks), q: 4 x 64 = 256 outputs, k/v: 2 x 64 = 128, I = 512.
CONFIG = policy.ModelConfig.small(
  "qwen2", vocab_size=64, hidden_size=256, num_heads=4, num_kv_heads=2, head_dim=64,
  intermediate_size=512, num_layers=2,
)  # fmt: skip
needs_8 = pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 (fake) devices")


def _mesh(data, fsdp, tensor):
  devices = np.asarray(jax.devices()[: data * fsdp * tensor]).reshape(data, fsdp, tensor)
  return Mesh(devices, ("data", "fsdp", "tensor"))


def _is_spec(x):
  return isinstance(x, P)


@pytest.fixture(scope="module")
def params():
  rng = np.random.default_rng(0)
  base = policy.init_params(CONFIG, jax.random.key(0))
  return jax.tree.map(lambda x: x + jnp.asarray(0.05 * rng.normal(size=x.shape), x.dtype), base)


@needs_8
def test_fp8_specs_by_hand():
  dense = policy.partition_rules(CONFIG, _mesh(1, 2, 4))
  specs = policy.partition_rules(CONFIG, _mesh(1, 2, 4), fp8_linears=True)
  attn, mlp = specs["layers"]["attn"], specs["layers"]["mlp"]
  for group, name in policy.LINEAR_KERNELS:
    kernel = specs["layers"][group][name]["kernel"]
    assert isinstance(kernel, policy.Fp8Kernel)
    assert kernel.values == dense["layers"][group][name]["kernel"], name
  # q [L, 256, 256]: values (None, fsdp, tensor); D = 256 / 2 = 128 per fsdp shard (whole
  # blocks): the scale's K dim follows fsdp; 256 / 4 = 64 outputs per tensor shard: replicated.
  assert attn["q_proj"]["kernel"].values == P(None, "fsdp", "tensor")
  assert attn["q_proj"]["kernel"].scale == P(None, "fsdp", None)
  # o [L, 256, 256]: values (None, tensor, fsdp).
  assert attn["o_proj"]["kernel"].scale == P(None, None, "fsdp")
  # up [L, 256, 512]: 512 / 4 = 128 per tensor shard: both block dims follow the values.
  assert mlp["up_proj"]["kernel"].scale == P(None, "fsdp", "tensor")
  assert mlp["down_proj"]["kernel"].scale == P(None, "tensor", "fsdp")
  # Everything else is the dense layout.
  assert specs["embed"] == dense["embed"] and specs["lm_head"] == dense["lm_head"]
  assert attn["q_proj"]["bias"] == dense["layers"]["attn"]["q_proj"]["bias"]
  one = policy.partition_rules(CONFIG, _mesh(1, 1, 1), fp8_linears=True)
  assert all(s == P(*[None] * len(s)) for s in jax.tree.leaves(one, is_leaf=_is_spec))
  with pytest.raises(ValueError, match="fp8_linears"):
    policy.partition_rules(CONFIG, _mesh(1, 1, 1), fp8_linears="yes")


@needs_8
@pytest.mark.parametrize("shape", [(1, 2, 4), (1, 1, 8)])
def test_fp8_params_on_the_mesh_equal_unsharded(params, shape):
  mesh = _mesh(*shape)
  shardings = policy.param_shardings(CONFIG, mesh, fp8_linears=True)
  dense_shardings = policy.param_shardings(CONFIG, mesh)
  fp8 = policy.quantize_linears(params)
  assert jax.tree.structure(shardings) == jax.tree.structure(fp8)
  # Quantizing the sharded train params on device, straight into the FP8 layout.
  quantize = jax.jit(policy.quantize_linears, out_shardings=shardings)
  sharded = quantize(jax.device_put(params, dense_shardings))
  for (path, leaf), want, ref in zip(
    jax.tree_util.tree_leaves_with_path(sharded),
    jax.tree.leaves(shardings),
    jax.tree.leaves(fp8),
    strict=True,
  ):
    assert leaf.sharding.is_equivalent_to(want, leaf.ndim), path
    np.testing.assert_array_equal(
      np.asarray(leaf, np.float32), np.asarray(ref, np.float32), err_msg=str(path)
    )
  tokens = jnp.asarray(np.random.default_rng(1).integers(0, 64, (8, 8)), jnp.int32)
  fwd = jax.jit(policy.forward, static_argnums=1)
  ref = fwd(fp8, CONFIG, tokens)
  out = fwd(sharded, CONFIG, jax.device_put(tokens, NamedSharding(mesh, P(("data", "fsdp")))))
  out, ref = np.asarray(out), np.asarray(ref)
  fp8_error = np.abs(np.asarray(fwd(params, CONFIG, tokens)) - ref)
  assert 0.01 < fp8_error.mean() and fp8_error.max() < 0.5  # FP8 approximates the dense model
  diff = np.abs(out - ref)
  if shape[1] == 1:  # no FSDP split of the contraction dims: the same sums
    np.testing.assert_allclose(out, ref, atol=2e-5)
  else:
    # FSDP splits the contractions, so float32 activations differ by ulps and a few
    # dynamic FP8 activation roundings flip (a 1/16 relative step): rare, tiny on average.
    assert np.mean(diff > 1e-4) < 0.05 and diff.mean() < 0.01 * fp8_error.mean()
