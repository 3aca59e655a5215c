"""Partial rollouts in the RL loop: `config.rollout.over_provision > 1`, resume with a buffer.

A run with over-provisioned rollouts checkpoints its FIFO buffer of
unfinished groups with the train state and the data cursor. A run that
crashes after a checkpoint taken with a non-empty buffer and is restarted
equals the straight run (same metrics, params, optimizer state, buffer), so no
rollout was lost or repeated.
"""

import os
import time

import numpy as np
import pytest
import rl_test_utils

from rlx import rl, train

TIME_KEYS = ("time/", "tokens_per_s")


def _config(**overrides):
  # No warm-up: a random model stops at random, so lengths are long-tailed and
  # collections stop with half-generated groups in flight.
  rl_test_utils.register_test_tasks()
  base = {
    "rl.iterations": 4,
    "rl.prompts_per_iteration": 4,
    "checkpoint.every": 2,
    "eval.every": 0,
    "rollout.over_provision": 2.0,
    # Fewer slots than rows and a longer cap than the answers: rows end at
    # different steps, so each collection stops with samples half generated.
    "sampler.max_slots": 8,
    "sampler.max_new_tokens": 8,
    "sampler.steps_per_sync": 2,
  }
  base.update(overrides)
  return rl_test_utils.run_config(**base)


def _rl_records(workdir):
  return [
    {k: v for k, v in r.items() if not any(t in k for t in TIME_KEYS)}
    for r in rl.read_metrics(os.path.join(workdir, "metrics.jsonl"))
    if r["phase"] == "rl"
  ]


def _restore(workdir, config, step=None):
  task = rl.make_task(config)
  model_config, _ = rl.build_model(config, task)
  abstract = train.abstract_train_state(
    model_config, rl.train_config(config), rl.build_mesh(config)
  )
  with train.Checkpointer(os.path.join(workdir, "checkpoints")) as ckpt:
    return ckpt.restore(abstract, step=step)


def test_over_provision_is_validated():
  for bad in (0.5, 0.99, float("inf"), float("nan")):
    with pytest.raises(ValueError, match="over_provision"):
      rl.validate_config(_config(**{"rollout.over_provision": bad}))


FP8_TIS = {
  "rollout.weight_dtype": "fp8_e4m3",
  "rollout.kv_dtype": "fp8_e4m3",
  "train.use_rollout_correction": True,
  "train.rollout_correction_kwargs.level": "token",
}


@pytest.mark.parametrize("fp8", [False, True], ids=["high_precision", "fp8_tis"])
def test_killed_run_with_a_buffer_resumes_and_loses_nothing(tmp_path, monkeypatch, fp8):
  # With FP8 rollout the restart must also restore the recalibrated KV scales
  # (and re-quantize the weights) exactly, or its rollouts and metrics differ.
  config = _config(**(FP8_TIS if fp8 else {}))
  straight = str(tmp_path / "straight")
  assert rl.run(config, straight)["iterations"] == 4
  records = _rl_records(straight)
  assert [r["iteration"] for r in records] == [1, 2, 3, 4]
  assert all(r["rollout/groups_returned"] == 4 for r in records)
  assert any(r["rollout/groups_resumed"] > 0 for r in records[1:])
  assert any(r["rollout/off_policy_token_fraction"] > 0 for r in records[1:])

  # Crash inside the 4th collection (the iteration-2 checkpoint holds a buffer), restart.
  crashed = str(tmp_path / "crashed")
  original = rl.PartialRollout.collect_groups
  calls = []

  def crashing(self, *args, **kwargs):
    calls.append(1)
    if len(calls) == 4:
      raise KeyboardInterrupt("killed")
    return original(self, *args, **kwargs)

  monkeypatch.setattr(rl.PartialRollout, "collect_groups", crashing)
  with pytest.raises(KeyboardInterrupt):
    rl.run(config, crashed)
  monkeypatch.setattr(rl.PartialRollout, "collect_groups", original)
  deadline = time.time() + 60  # the asynchronous save of step 2 finishes in the background
  while "2" not in os.listdir(os.path.join(crashed, "checkpoints")) and time.time() < deadline:
    time.sleep(0.1)
  buffer = _restore(crashed, config, step=2).extra["rollout_buffer"]
  assert int(buffer["count"]) > 0 and (np.asarray(buffer["lengths"]) > 0).any()

  summary = rl.run(config, crashed)
  assert summary["iterations"] == 4 and summary["resumed_from_iteration"] == 2
  assert _rl_records(crashed) == records
  a, b = _restore(straight, config), _restore(crashed, config)
  assert a.step == b.step == 4
  assert rl_test_utils.params_allclose(a.state.params, b.state.params)
  assert rl_test_utils.params_allclose(a.state.opt_state, b.state.opt_state)
  # Every prompt drawn is in a trained batch or in the buffer: 4 iterations x 4 groups + buffered.
  drawn = a.data_cursor["source"]
  assert drawn["epoch"] == 0 and drawn["index"] == 4 * 4 + int(a.extra["rollout_buffer"]["count"])
  for k, v in a.extra["rollout_buffer"].items():
    np.testing.assert_array_equal(v, b.extra["rollout_buffer"][k], err_msg=k)
  if fp8:
    assert all(r["mismatch_k3"] > 0 for r in records)
    for k, v in a.extra["kv_scales"].items():
      np.testing.assert_array_equal(v, b.extra["kv_scales"][k], err_msg=k)
