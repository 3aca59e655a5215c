"""The sampler on the rlx.train mesh of 8 fake CPU devices equals the single-device run.

tests/conftest.py requests 8 host devices before JAX is imported. Params come
straight from a sharded `TrainState` (FSDP over "fsdp", Megatron over
"tensor"); slots are split over ("data", "fsdp"), KV heads over "tensor".
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rlx.train
from rlx import policy, sampling

MODEL = policy.ModelConfig.small(
  "qwen3", vocab_size=64, hidden_size=32, intermediate_size=64, head_dim=8
)
CFG = sampling.SamplerConfig(
  max_slots=4,
  page_size=4,
  num_pages=6,  # tight: preemption happens on the mesh too
  max_prompt_len=8,
  max_new_tokens=6,
  steps_per_sync=3,
  prefill_chunk=8,
  temperature=0.8,
)
PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8], [9], [10, 11, 12], [13, 14, 15, 16, 17]]


@pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 (fake) devices")
def test_eight_devices_equal_one():
  rng = np.random.default_rng(0)
  params = jax.tree.map(
    lambda x: x + jnp.asarray(0.3 * rng.normal(size=x.shape), x.dtype),
    policy.init_params(MODEL, jax.random.key(0)),
  )
  single = sampling.Sampler(MODEL, CFG).generate(
    params, PROMPTS, num_samples=2, rng=jax.random.key(1)
  )

  mesh = rlx.train.make_mesh(data=2, fsdp=2, tensor=2)
  state = rlx.train.create_train_state(
    params, MODEL, rlx.train.get_config(), mesh, rng=jax.random.key(0)
  )
  sharded_leaf = state.params["layers"]["mlp"]["up_proj"]["kernel"]
  assert not sharded_leaf.sharding.is_fully_replicated
  sampler = sampling.Sampler(MODEL, CFG, mesh=mesh)
  out = sampler.generate(state.params, PROMPTS, num_samples=2, rng=jax.random.key(1))
  np.testing.assert_array_equal(out.tokens, single.tokens)
  np.testing.assert_allclose(out.logprobs, single.logprobs, atol=1e-5)
  assert out.stats["preemptions"] == single.stats["preemptions"] > 0
  assert out.stats["pages_in_use_at_end"] == 0

  greedy = dataclasses.replace(CFG, temperature=0.0)
  a = sampling.Sampler(MODEL, greedy, mesh=mesh).generate(
    state.params, PROMPTS, rng=jax.random.key(0)
  )
  b = sampling.Sampler(MODEL, greedy).generate(params, PROMPTS, rng=jax.random.key(0))
  np.testing.assert_array_equal(a.tokens, b.tokens)

  with pytest.raises(ValueError, match="max_slots"):
    sampling.Sampler(MODEL, dataclasses.replace(CFG, max_slots=6), mesh=mesh)


@pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 (fake) devices")
@pytest.mark.parametrize(
  "devices, axes",
  [(1, dict(data=1)), (2, dict(data=1, tensor=2)), (8, dict(data=2, fsdp=2, tensor=2))],
)
def test_per_token_fp8_kv_on_meshes_equals_one_device(devices, axes):
  """Per-token FP8 scale pools shard like the pages (KV heads over "tensor"); with
  preemption (6-page pool) the rows equal the single-device run on 1, 2 and 8 devices."""
  rng = np.random.default_rng(0)
  params = jax.tree.map(
    lambda x: x + jnp.asarray(0.3 * rng.normal(size=x.shape), x.dtype),
    policy.init_params(MODEL, jax.random.key(0)),
  )
  cfg = dataclasses.replace(CFG, kv_dtype="fp8_e4m3", kv_scale_mode="per_token")
  single = sampling.Sampler(MODEL, cfg).generate(
    params, PROMPTS, num_samples=2, rng=jax.random.key(1)
  )
  mesh = rlx.train.make_mesh(**axes, devices=jax.devices()[:devices])
  state = rlx.train.create_train_state(
    params, MODEL, rlx.train.get_config(), mesh, rng=jax.random.key(0)
  )
  sampler = sampling.Sampler(MODEL, cfg, mesh=mesh)
  out = sampler.generate(state.params, PROMPTS, num_samples=2, rng=jax.random.key(1))
  np.testing.assert_array_equal(out.tokens, single.tokens)
  np.testing.assert_allclose(out.logprobs, single.logprobs, atol=1e-5)
  assert out.stats["preemptions"] == single.stats["preemptions"] > 0
  pool = sampler.kv_pool()
  assert tuple(pool.k_scale.sharding.spec) == tuple(pool.k.sharding.spec)[:2]  # (None, tensor)
