"""The public surface of rlx.train."""

import pytest

import rlx.train

PUBLIC = (
  "BATCH_AXES",
  "MESH_AXES",
  "Checkpointer",
  "FsdpGather",
  "ComputeLogprobs",
  "NonFiniteError",
  "Restored",
  "TrainState",
  "TrainStep",
  "abstract_train_state",
  "batch_axis_size",
  "batch_sharding",
  "fsdp_gather_fns",
  "gathered_layer_shardings",
  "gathered_param_shardings",
  "create_train_state",
  "get_config",
  "initialize_distributed",
  "make_compute_logprobs",
  "make_mesh",
  "make_optimizer",
  "make_schedule",
  "make_train_step",
  "opt_state_shardings",
  "param_shardings",
  "replicated",
  "resolve_agg",
  "shard_batch",
  "shard_params",
  "to_host",
  "train_state_shardings",
  "validate_config",
)


def test_public_names_are_exported():
  exported = {n for n in dir(rlx.train) if not n.startswith("_")}
  missing = set(PUBLIC) - exported
  assert not missing
  # Nothing public beyond the list (private modules stay private).
  assert exported - set(PUBLIC) == set()


def test_default_config_validates_and_names_bad_fields():
  config = rlx.train.get_config()
  rlx.train.validate_config(config)
  config.micro_batches = 0
  with pytest.raises(ValueError, match="config.micro_batches"):
    rlx.train.validate_config(config)
  config.micro_batches = 1
  config.nonfinite = "ignore"
  with pytest.raises(ValueError, match="config.nonfinite"):
    rlx.train.validate_config(config)


def test_default_agg_is_the_losses_own_default():
  config = rlx.train.get_config()
  assert config.agg == "default"
  config.loss = "gspo"
  assert rlx.train.resolve_agg(config) == "seq-mean-token-mean"
  config.loss = "ppo"
  assert rlx.train.resolve_agg(config) == "token-mean"
  config.agg = "seq-mean-token-sum-norm"
  assert rlx.train.resolve_agg(config) == "seq-mean-token-sum-norm"
