"""rlx.rl.RunSpec (the run's config, resolved once) and rlx.rl.RunCursor (where a run stands)."""

import dataclasses

import pytest

from rlx import rl


def test_run_spec_resolves_the_config_once_into_plain_values():
  config = rl.get_config()
  config.rl.prompts_per_iteration = 6
  config.rl.num_samples = 4
  config.rl.baseline = "median"  # G + 1 rows per prompt
  config.rollout.over_provision = 1.5
  config.eval.every = 3
  spec = rl.RunSpec.from_config(config)
  assert spec.prompts_per_iteration == 6 and spec.samples_per_prompt == 5 and spec.rows == 30
  assert spec.partial and spec.over_provision == 1.5 and spec.eval_every == 3
  assert spec.loss == config.train.loss and spec.baseline == "median"
  for field in dataclasses.fields(spec):  # plain Python values, never config nodes
    assert type(getattr(spec, field.name)) in (int, float, bool, str), field.name
  # Frozen, and independent of the config it came from.
  with pytest.raises(dataclasses.FrozenInstanceError):
    spec.iterations = 1
  config.rl.prompts_per_iteration = 7
  assert spec.prompts_per_iteration == 6
  assert rl.RunSpec.from_config(config) != spec
  config.rl.prompts_per_iteration = 6
  assert rl.RunSpec.from_config(config) == spec  # equal configs, equal specs


def test_run_spec_validates_first():
  config = rl.get_config()
  config.rl.staleness_mode = "fixd"
  with pytest.raises(ValueError, match="config.rl.staleness_mode"):
    rl.RunSpec.from_config(config)


def test_run_cursor_round_trips_and_names_bad_fields():
  cursor = rl.RunCursor(
    iteration=12,
    source={"epoch": 1, "index": 8},
    rl_time_s=3.5,
    elapsed_s=9.0,
    best_dev_accuracy=0.75,
    best_iteration=10,
  )
  assert rl.RunCursor.from_json(cursor.to_json()) == cursor
  assert rl.RunCursor.from_json({"iteration": 0}) == rl.RunCursor()
  with pytest.raises(ValueError, match="best_iteration"):  # the message lists the fields
    rl.RunCursor.from_json({"iteration": 3, "best_iter": 2})
  with pytest.raises(ValueError, match="`iteration`"):
    rl.RunCursor.from_json({"source": None})
