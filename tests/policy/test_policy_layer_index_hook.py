"""`layer_params_fn(layer, *, layer_index)`: the per-layer hook that also gets the block's index."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlx import policy

LAYERS = 3


@pytest.fixture(scope="module")
def model():
  config = policy.ModelConfig.small(vocab_size=53, num_layers=LAYERS)
  params = policy.init_params(config, jax.random.key(0))
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 53, (2, 7)), jnp.int32)
  return config, params, tokens


def _factor(index):
  return 1.0 + 0.25 * index.astype(jnp.float32)


def _scale_kernels(tree, factor):
  return jax.tree_util.tree_map_with_path(
    lambda path, x: x * factor if path[-1].key == "kernel" else x, tree
  )


@pytest.mark.parametrize("unroll", [False, True])
def test_hook_gets_the_index_of_each_layer(model, unroll):
  """Scaling layer i's kernels by f(i) in the hook == scaling the stacked kernels beforehand."""
  config, params, tokens = model

  def hook(layer, layer_index=None):  # a defaulted keyword parameter counts too
    assert layer_index.dtype == jnp.int32 and layer_index.shape == ()
    return _scale_kernels(layer, _factor(layer_index))

  forward = jax.jit(policy.forward, static_argnums=1, static_argnames=("layer_params_fn", "unroll"))
  got = forward(params, config, tokens, layer_params_fn=hook, unroll=unroll)
  factors = _factor(jnp.arange(LAYERS))
  scaled = jax.tree_util.tree_map_with_path(
    lambda path, x: (
      x * factors.reshape((-1,) + (1,) * (x.ndim - 1)) if path[-1].key == "kernel" else x
    ),
    params["layers"],
  )
  want = forward(dict(params, layers=scaled), config, tokens)
  assert float(jnp.max(jnp.abs(want - forward(params, config, tokens)))) > 1e-3  # it matters
  np.testing.assert_allclose(got, want, atol=1e-5)


def test_hook_without_layer_index_gets_the_layer_only(model):
  config, params, tokens = model
  calls = []

  def plain(layer, *args, **kwargs):  # no parameter named `layer_index`: not passed
    calls.append((args, kwargs))
    return layer

  for unroll in (False, True):
    jax.eval_shape(
      lambda p, u=unroll: policy.forward(p, config, tokens, layer_params_fn=plain, unroll=u),
      params,
    )
  assert len(calls) >= 2 and all(call == ((), {}) for call in calls)  # traced, maybe cached


def test_index_aware_hook_output_is_checked(model):
  config, params, tokens = model

  def truncating(layer, *, layer_index):
    del layer_index
    q = dict(layer["attn"]["q_proj"], kernel=layer["attn"]["q_proj"]["kernel"][:2])
    return dict(layer, attn=dict(layer["attn"], q_proj=q))

  with pytest.raises(ValueError, match="changed the shape of layers/attn/q_proj/kernel"):
    jax.eval_shape(lambda p: policy.forward(p, config, tokens, layer_params_fn=truncating), params)
