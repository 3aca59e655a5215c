"""make_mesh validation and the shardings of params, optimizer state and batches."""

import jax
import numpy as np
import pytest
import train_testlib as tl
from jax.sharding import PartitionSpec

from rlx import policy, train


def test_make_mesh_shapes_and_rest_axis():
  m = train.make_mesh(2, 2, 2)
  assert m.axis_names == ("data", "fsdp", "tensor")
  assert dict(m.shape) == {"data": 2, "fsdp": 2, "tensor": 2}
  assert dict(train.make_mesh(fsdp=4).shape) == {"data": 2, "fsdp": 4, "tensor": 1}
  assert dict(train.make_mesh(data=2, fsdp=-1, tensor=2).shape)["fsdp"] == 2
  one = train.make_mesh(1, 1, 1, devices=jax.devices()[:1])
  assert one.devices.size == 1
  assert sorted(d.id for d in train.make_mesh(8).devices.flat) == sorted(
    d.id for d in jax.devices()
  )
  assert train.batch_axis_size(m) == 4


@pytest.mark.parametrize(
  "kwargs, match",
  [
    (dict(data=2, fsdp=2, tensor=1), "= 4 must equal the device count 8"),
    (dict(data=3, fsdp=-1), "do not divide the device count 8"),
    (dict(data=-1, fsdp=-1), "At most one mesh axis may be -1"),
    (dict(data=0), "`data` must be a positive int or -1"),
    (dict(tensor=2.0), "`tensor` must be a positive int or -1"),
  ],
)
def test_make_mesh_errors_name_sizes_and_device_count(kwargs, match):
  with pytest.raises(ValueError, match=match):
    train.make_mesh(**kwargs)


def test_shard_params_and_optimizer_state_follow_partition_rules():
  mc = tl.model_config()
  m = tl.mesh("d2f2t2")
  cfg = tl.train_config()
  state = tl.init_state(m, cfg)
  rules = policy.partition_rules(mc, m)
  specs = jax.tree.leaves(rules, is_leaf=lambda x: isinstance(x, PartitionSpec))
  leaves = jax.tree.leaves(state.params)
  assert any(s != PartitionSpec() for s in specs)  # something is really sharded
  for leaf, spec in zip(leaves, specs, strict=True):
    assert leaf.sharding.is_equivalent_to(jax.sharding.NamedSharding(m, spec), leaf.ndim)
  adam = state.opt_state[1][0]
  for moments in (adam.mu, adam.nu):
    for leaf, param in zip(jax.tree.leaves(moments), leaves, strict=True):
      assert leaf.sharding.is_equivalent_to(param.sharding, leaf.ndim)
      np.testing.assert_array_equal(np.asarray(leaf), 0.0)
  assert adam.count.sharding.is_fully_replicated
  assert state.step.sharding.is_fully_replicated and state.rng.shape == (2,)
  want = train.train_state_shardings(state.params, mc, cfg, m)
  assert jax.tree.structure(want) == jax.tree.structure(state)


def test_shard_params_rejects_wrong_structure():
  with pytest.raises(ValueError, match="does not match the config: missing embed/embedding"):
    train.shard_params({"w": np.zeros(3)}, tl.model_config(), tl.mesh("data8"))


def test_shard_batch_splits_rows_over_data_and_fsdp():
  m = tl.mesh("d2f2t2")
  batch = {"tokens": np.arange(16 * 5).reshape(16, 5), "advantages": np.arange(16.0)}
  out = train.shard_batch(batch, m)
  for key, value in out.items():
    np.testing.assert_array_equal(np.asarray(value), batch[key])
    assert value.sharding.spec[0] == ("data", "fsdp")
    # 4 batch shards of 4 rows; each row block is replicated over "tensor".
    assert {s.data.shape[0] for s in value.addressable_shards} == {4}
  # One process: its local rows are the whole global batch.
  local = train.shard_batch(batch, m, process_local=True)
  np.testing.assert_array_equal(np.asarray(local["tokens"]), batch["tokens"])
  assert local["tokens"].sharding.is_equivalent_to(out["tokens"].sharding, 2)
  with pytest.raises(ValueError, match="divisible by the number of batch shards"):
    train.shard_batch({"tokens": np.zeros((6, 3))}, m)
  with pytest.raises(ValueError, match="same leading batch size"):
    train.shard_batch({"tokens": np.zeros((8, 3)), "advantages": np.zeros(4)}, m)


def test_make_schedule_constant_and_warmup_cosine():
  cfg = tl.train_config()
  cfg.optimizer.learning_rate = 1e-2
  cfg.optimizer.schedule = "constant"
  cfg.optimizer.warmup_steps = 4
  schedule = train.make_schedule(cfg)
  np.testing.assert_allclose([schedule(i) for i in (0, 3, 10)], [2.5e-3, 1e-2, 1e-2], rtol=1e-6)
  cfg.optimizer.schedule = "warmup_cosine"
  cfg.optimizer.decay_steps = 14
  cfg.optimizer.end_lr_ratio = 0.1
  schedule = train.make_schedule(cfg)
  # Warmup 0 -> 1e-2 over 4 updates; cosine to 1e-3 at update 14; halfway (9) is the mean.
  np.testing.assert_allclose(
    [schedule(i) for i in (0, 2, 4, 9, 14)], [0.0, 5e-3, 1e-2, 5.5e-3, 1e-3], rtol=1e-5, atol=1e-9
  )
  cfg.optimizer.decay_steps = 3
  with pytest.raises(ValueError, match="decay_steps"):
    train.make_schedule(cfg)
