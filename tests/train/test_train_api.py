"""The public surface of rlx.train and the train config's validation."""

import ml_collections
import numpy as np
import pytest

import rlx.train
from rlx import objectives

PUBLIC = (
  "BATCH_AXES",
  "MESH_AXES",
  "CheckpointError",
  "Checkpointer",
  "FsdpGather",
  "ComputeLogprobs",
  "NonFiniteError",
  "OutOfMemoryError",
  "Restored",
  "StepSpec",
  "ThroughputMeter",
  "TrainState",
  "TrainStep",
  "abstract_train_state",
  "as_step_spec",
  "batch_axis_size",
  "batch_sharding",
  "fsdp_gather_fns",
  "gathered_layer_shardings",
  "gathered_param_shardings",
  "copy_to",
  "create_train_state",
  "explain_out_of_memory",
  "get_config",
  "initialize_distributed",
  "is_out_of_memory",
  "make_compute_logprobs",
  "make_mesh",
  "make_optimizer",
  "make_schedule",
  "make_step_fn",
  "make_train_step",
  "opt_state_shardings",
  "param_shardings",
  "replicated",
  "resolve_agg",
  "schedule_of",
  "shard_batch",
  "shard_params",
  "to_host",
  "train_state_shardings",
  "update_counter",
  "updates_per_step",
  "validate_config",
)


def test_public_names_are_exported_exactly():
  assert sorted(rlx.train.__all__) == sorted(PUBLIC)
  assert len(set(rlx.train.__all__)) == len(rlx.train.__all__)
  exported = {n for n in dir(rlx.train) if not n.startswith("_")}
  # Nothing public beyond __all__ (private modules stay private).
  assert exported == set(PUBLIC)
  for name in PUBLIC:
    assert getattr(rlx.train, name) is not None
  # One sharding rule for the params: the policy's own.
  assert rlx.train.param_shardings is rlx.policy.param_shardings


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


def _set(config, path, value):
  *parents, leaf = path.split(".")
  for part in parents:
    config = config[part]
  config[leaf] = value


def _leaves(config, prefix=""):
  """Dotted paths of the config's values (the keyword sections are empty by default)."""
  for key, value in config.items():
    if isinstance(value, ml_collections.ConfigDict):
      yield from _leaves(value, f"{prefix}{key}.")
    else:
      yield f"{prefix}{key}"


@pytest.mark.parametrize("value", ["not-a-setting", None])
def test_every_field_has_a_rule(value):
  leaves = list(_leaves(rlx.train.get_config()))
  assert {"loss", "optimizer.b1", "report_throughput"} <= set(leaves)  # nested ones too
  for path in leaves:
    config = rlx.train.get_config().to_dict()  # plain dicts: no type coercion
    _set(config, path, value)
    with pytest.raises(ValueError, match=rf"^`config\.{path}` must be"):
      rlx.train.validate_config(ml_collections.ConfigDict(config))


INF, NAN = float("inf"), float("nan")
BAD_VALUES = {
  "temperature": [INF, NAN, 0.0, -1.0, True],
  "kl_coef": [INF, -0.1, NAN],
  "entropy_coef": [INF, -INF],
  "max_grad_norm": [INF, -1.0],
  "logprob_chunk_size": [-1, 2.0, True],
  "unroll_max_layers": [-1, 1.5, True],
  "micro_batches": [True, 0, 2.0],
  "ppo_epochs": [False, 0],
  "mini_batches": [True, -1],
  "optimizer.learning_rate": [INF, NAN, -1e-6],
  "optimizer.b1": [1.5, 1.0, -0.1],
  "optimizer.b2": [-0.1, 1.0],
  "optimizer.eps": [-1e-8, 0.0, INF],
  "optimizer.weight_decay": [-0.1, INF],
  "optimizer.end_lr_ratio": [2.0, -1.0, NAN],
  "optimizer.warmup_steps": [-1, 1.5, True],
  "optimizer.decay_steps": [0, True],
  "use_bapo": [1, "yes"],
  "shuffle": [0],
}


@pytest.mark.parametrize(
  "path, value", [(p, v) for p, values in BAD_VALUES.items() for v in values]
)
def test_out_of_range_or_mistyped_fields_are_named(path, value):
  # Plain dicts skip ml_collections' own type coercion, so every value reaches
  # the validator as given.
  config = rlx.train.get_config().to_dict()
  _set(config, path, value)
  with pytest.raises(ValueError, match=rf"`config\.{path}` must be"):
    rlx.train.validate_config(ml_collections.ConfigDict(config))


@pytest.mark.parametrize(
  "path, value",
  [
    ("max_grad_norm", 0.0),  # off
    ("optimizer.end_lr_ratio", 1.0),
    ("optimizer.b1", 0.0),
    ("optimizer.learning_rate", 0),  # an int for a float field
    ("micro_batches", np.int64(2)),
    ("temperature", np.float32(0.7)),
  ],
)
def test_edge_values_in_range_are_accepted(path, value):
  config = rlx.train.get_config().to_dict()
  _set(config, path, value)
  rlx.train.validate_config(ml_collections.ConfigDict(config))


def test_config_is_locked_against_misspelt_fields():
  config = rlx.train.get_config()
  for name in ("loss_typo", "micro_batch", "kl_coeff"):
    with pytest.raises(AttributeError, match="cannot be added since the config is locked"):
      setattr(config, name, 1)
  with pytest.raises(AttributeError, match="locked"):
    config.optimizer.learning_rat = 1e-3
  # The keyword sections stay open, as fields or as whole dicts.
  config.loss_kwargs.clip_high = 0.28
  config.rollout_correction_kwargs = {"level": "sequence"}
  config.rollout_correction_kwargs.truncate = 4.0
  rlx.train.validate_config(config)
  # An unlocked copy with an extra or a missing field is still rejected by name.
  loose = ml_collections.ConfigDict(config.to_dict())
  loose.loss_typo = "gspo"
  with pytest.raises(ValueError, match=r"unknown fields \['loss_typo'\]"):
    rlx.train.validate_config(loose)
  loose = ml_collections.ConfigDict(config.to_dict())
  del loose.optimizer["b2"]
  with pytest.raises(ValueError, match=r"config.optimizer` has unknown fields \[\] and lacks"):
    rlx.train.validate_config(loose)


@pytest.mark.parametrize(
  "section, key, match",
  [
    ("loss_kwargs", "clip_hgh", r"config.loss_kwargs` has unknown keywords \['clip_hgh'\]"),
    ("loss_kwargs", "agg", r"unknown keywords \['agg'\].*the step passes"),
    ("bapo_kwargs", "rho", r"config.bapo_kwargs` has unknown keywords \['rho'\]"),
    ("m2po_kwargs", "thresh", r"config.m2po_kwargs` has unknown keywords \['thresh'\]"),
    ("rollout_correction_kwargs", "levle", r"unknown keywords \['levle'\]"),
  ],
)
def test_kwargs_sections_name_unknown_keywords(section, key, match):
  config = rlx.train.get_config()
  config[section][key] = 1.0
  with pytest.raises(ValueError, match=match):
    rlx.train.validate_config(config)


def test_aspo_entropy_is_an_extra_input_not_a_keyword():
  config = rlx.train.get_config()
  config.loss = "aspo"
  config.loss_kwargs.entropy = 1.0
  with pytest.raises(ValueError, match=r"unknown keywords \['entropy'\]"):
    rlx.train.validate_config(config)


def test_bapo_owns_the_losses_clip_keywords():
  for loss, spec in objectives.POLICY_LOSS_SPECS.items():
    config = rlx.train.get_config()
    config.loss = loss
    config.use_bapo = True
    if {"clip_low", "clip_high"} <= set(spec.clip_keywords):
      rlx.train.validate_config(config)
      for keyword in spec.clip_keywords:
        config.loss_kwargs = {keyword: 0.3}
        with pytest.raises(ValueError, match=f"sets \\['{keyword}'\\], which BAPO sets"):
          rlx.train.validate_config(config)
    else:
      with pytest.raises(ValueError, match="use_bapo` needs a loss whose registry spec"):
        rlx.train.validate_config(config)
  config = rlx.train.get_config()
  config.loss = "gspo"  # no dual clip in its clip keywords
  config.use_bapo = True
  config.bapo_kwargs.dual_clip = 3.0
  with pytest.raises(ValueError, match="has no dual clip"):
    rlx.train.validate_config(config)


def test_default_agg_is_the_registered_default_of_every_loss():
  config = rlx.train.get_config()
  assert config.agg == "default"
  for loss, spec in objectives.POLICY_LOSS_SPECS.items():
    config.loss = loss
    assert rlx.train.resolve_agg(config) == spec.default_agg
  config.loss = "gspo"
  assert rlx.train.resolve_agg(config) == "seq-mean-token-mean"
  config.loss = "ppo"
  assert rlx.train.resolve_agg(config) == "token-mean"
  config.agg = "seq-mean-token-sum-norm"
  assert rlx.train.resolve_agg(config) == "seq-mean-token-sum-norm"
