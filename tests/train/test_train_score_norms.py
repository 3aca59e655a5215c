"""`ComputeLogprobs.score_norms`: per-row score-gradient norms on 1, 2 and 8 devices.

Also its memory: the compiled program holds about one decoder layer's gradient
per row at a time, not a full params-shaped gradient per row.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import train_testlib as tl
from jax.sharding import NamedSharding, PartitionSpec

from rlx import policy, train


def _direct_norms(batch: dict, config: policy.ModelConfig | None = None) -> np.ndarray:
  """||grad sum_s logp[b, s]|| of each row, one unsharded `jax.grad` per row (one program)."""
  config = config or tl.model_config()
  params = policy.init_params(config, jax.random.PRNGKey(0))

  @jax.jit
  def row_norm(p, tokens, mask):
    def sequence_logp(q):
      logp, _ = policy.token_logprobs(q, config, tokens[None], mask[None])
      return jnp.sum(logp)

    grads = jax.grad(sequence_logp)(p)
    return jnp.sqrt(sum(jnp.sum(jnp.square(g.astype(jnp.float32))) for g in jax.tree.leaves(grads)))

  rows = zip(batch["tokens"], batch["loss_mask"] != 0, strict=True)
  return np.asarray([float(row_norm(params, jnp.asarray(t), jnp.asarray(m))) for t, m in rows])


@pytest.mark.parametrize(
  ("layout", "micro_batches"),
  [("single", 1), ("single", 4), ("data2", 2), ("data8", 1), ("fsdp8", 1), ("d2f2t2", 2)],
)
def test_score_norms_equal_one_gradient_per_row(layout, micro_batches):
  m, cfg, _, logprobs = tl.fns(layout, micro_batches=micro_batches)
  state = tl.init_state(m, cfg)
  batch = tl.make_batch(5)
  batch["loss_mask"][3] = 0.0  # a row without loss tokens has no score gradient
  inputs = train.shard_batch({k: batch[k] for k in ("tokens", "loss_mask")}, m)
  got = np.asarray(logprobs.score_norms(state, inputs))
  assert got.shape == (tl.BATCH,) and got.dtype == np.float32
  want = _direct_norms(batch)
  np.testing.assert_allclose(got, want, rtol=2e-4, atol=1e-6)
  assert got[3] == 0.0 and np.all(np.delete(got, 3) > 0)
  # The pure function traced inside another jit gives the same values.
  pure = jax.jit(logprobs.score_norms_fn)(state.params, inputs)
  np.testing.assert_allclose(np.asarray(pure), got, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize(
  ("layout", "model", "overrides"),
  [
    ("single", {"tie_embeddings": True}, {}),
    ("fsdp8", {"tie_embeddings": True}, {}),
    ("d2f2", {"tie_embeddings": True, "remat": True}, {"micro_batches": 2}),
    ("fsdp8", {}, {"gather_fsdp_per_layer": False}),
  ],
)
def test_score_norms_tied_remat_and_whole_model_gather(layout, model, overrides):
  """Tied embedding and LM head (their gradients add up before the norm), remat, one gather."""
  config = dataclasses.replace(tl.model_config(), **model)
  m = tl.mesh(layout)
  logprobs = train.make_compute_logprobs(config, tl.train_config(**overrides), m)
  params = train.shard_params(policy.init_params(config, jax.random.PRNGKey(0)), config, m)
  batch = tl.make_batch(6)
  batch["loss_mask"][5] = 0.0
  inputs = train.shard_batch({k: batch[k] for k in ("tokens", "loss_mask")}, m)
  got = np.asarray(logprobs.score_norms(params, inputs))
  np.testing.assert_allclose(got, _direct_norms(batch, config), rtol=2e-4, atol=1e-6)
  assert got[5] == 0.0


@pytest.mark.parametrize("layout", ["single", "fsdp8"])
def test_score_norms_memory_is_one_layer_per_row_not_one_gradient_per_row(layout):
  """Compiled temp bytes < rows per device x params bytes: no full gradient per row.

  8 layers of about 4 MB each, a small vocabulary (the top-level params are
  2% of the model) and 4 rows per device in one micro-batch. XLA:CPU's
  accounting, same flags as the rest of the suite: the per-row
  `jax.grad(params)` this replaced took 158 MB (single) / 149 MB (fsdp8) of
  temp, over the 128 MB bound; the per-layer taps take 18.5 MB / 23.4 MB
  (the second bound is 35.7 MB).
  """
  config = policy.ModelConfig.small(
    vocab_size=256, hidden_size=256, intermediate_size=1024, num_layers=8, head_dim=64
  )
  m = tl.mesh(layout)
  logprobs = train.make_compute_logprobs(config, tl.train_config(micro_batches=1), m)
  shardings = policy.param_shardings(config, m)
  shapes = jax.eval_shape(lambda: policy.init_params(config, jax.random.PRNGKey(0)))
  params = jax.tree.map(
    lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), shapes, shardings
  )
  rows_per_device, seq = 4, 16
  rows = rows_per_device * m.devices.size
  rows_sharding = NamedSharding(m, PartitionSpec(("data", "fsdp")))
  batch = {
    "tokens": jax.ShapeDtypeStruct((rows, seq), jnp.int32, sharding=rows_sharding),
    "loss_mask": jax.ShapeDtypeStruct((rows, seq), jnp.float32, sharding=rows_sharding),
  }
  memory = logprobs.jitted_score_norms.lower(params, batch).compile().memory_analysis()
  param_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(shapes))
  assert memory.temp_size_in_bytes < rows_per_device * param_bytes
  # About one layer's (plus the top-level params') cotangent per row.
  stacked_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(shapes["layers"]))
  one_layer_and_top = param_bytes - stacked_bytes * 7 // 8  # 8 layers
  assert memory.temp_size_in_bytes < 2 * rows_per_device * one_layer_and_top


def test_score_norms_checks_the_batch():
  m, cfg, _, logprobs = tl.fns("data8")
  state = tl.init_state(m, cfg)
  batch = tl.make_batch(0)
  with pytest.raises(ValueError, match=r"Batch size 12 must be divisible by .* = 8"):
    logprobs.score_norms(state, {k: batch[k][:12] for k in ("tokens", "loss_mask")})
  with pytest.raises(ValueError, match="`batch` needs `tokens` and `loss_mask`"):
    logprobs.score_norms(state, {"tokens": batch["tokens"]})


def test_score_norms_memory_advice_names_its_per_row_gradients_first():
  _, _, _, logprobs = tl.fns("data8")
  advice = logprobs.score_norms_memory_advice(64)
  assert advice[0].startswith("train.micro_batches = ")
  assert "per row of a micro-batch" in advice[0]
  assert advice[1:] == logprobs.memory_advice(64)
