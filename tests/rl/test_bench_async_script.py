"""experiments/bench_async.py: its per-side times by hand, its mode configs and its table."""

import importlib.util
import os

import pytest

from rlx import rl

_PATH = os.path.join(
  os.path.dirname(__file__), os.pardir, os.pardir, "experiments", "bench_async.py"
)


def _module():
  spec = importlib.util.spec_from_file_location("bench_async", _PATH)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_side_times_by_hand():
  bench = _module()
  sync = [
    {"time/iteration_s": t, "time/rollout_s": r, "time/reward_s": 0.1, "time/logp_s": 0.2,
     "time/train_s": 0.3, "response_length": 10.0}
    for t, r in ((9.0, 9.0), (2.0, 1.0), (3.0, 2.0))
  ]  # fmt: skip
  got = bench.side_times(sync, skip=1)  # the first (compiling) iteration left out
  assert got["iteration_s"] == pytest.approx(2.5)
  assert got["rollout_busy_s"] == pytest.approx(1.5)
  assert got["learner_busy_s"] == pytest.approx(0.6)
  assert got["rollout_idle"] == pytest.approx(1 - 1.5 / 2.5)
  assert got["learner_idle"] == pytest.approx(1 - 0.6 / 2.5)
  # Async: the thread's running busy total over the window; the learner = iteration - wait.
  asyn = [
    {"time/iteration_s": t, "time/learner_wait_s": w, "async/rollout_busy_s": b,
     "response_length": 12.0}
    for t, w, b in ((5.0, 4.0, 4.0), (1.0, 0.2, 5.0), (1.0, 0.0, 5.5))
  ]  # fmt: skip
  got = bench.side_times(asyn, skip=1)
  assert got["iteration_s"] == pytest.approx(1.0)
  assert got["rollout_busy_s"] == pytest.approx((5.5 - 4.0) / 2)
  assert got["learner_busy_s"] == pytest.approx((0.8 + 1.0) / 2)
  assert got["learner_idle"] == pytest.approx(0.1)
  with pytest.raises(ValueError, match="--skip"):
    bench.side_times(asyn, skip=0)


def test_mode_configs_validate_and_differ_only_in_the_rollout():
  bench = _module()
  base = bench.load_config(bench.TASKS["scratchpad"])
  configs = {
    m: bench.mode_config(base, m, iterations=6, devices=2, rollout_devices=1) for m in bench.MODES
  }
  for c in configs.values():
    rl.validate_config(c)
    assert c.rl.iterations == 6 and not c.rl.fused and c.mesh.num_devices == 2
  assert not configs["sync"].rl.async_rollout
  assert (
    configs["async shared"].rl.async_rollout and configs["async shared"].mesh.rollout_devices == 0
  )
  assert configs["async split"].mesh.rollout_devices == 1
  assert not configs["async split"].train.use_rollout_correction
  tis = configs["async split + TIS"]
  assert tis.mesh.rollout_devices == 1 and tis.train.use_rollout_correction
  assert tis.rollout.over_provision == 1.0
  partial = configs["async split + partial"]
  assert partial.rollout.over_provision == 2.0 and partial.train.use_rollout_correction
  assert partial.mesh.rollout_devices == 1 and partial.rl.async_rollout
  assert base.rl.iterations != 6  # the base config is left as it was
  assert base.task.arithmetic.scratchpad


def test_table_rows_and_rerun_command():
  bench = _module()
  row = {
    "task": "scratchpad", "mode": "async split", "response_length": 60.0, "iteration_s": 1.0,
    "rollout_busy_s": 0.9, "rollout_idle": 0.1, "learner_busy_s": 0.5, "learner_idle": 0.5,
    "rollout_share_sync": 0.6, "staleness_mean": 1.5, "accuracy_after": 0.25,
    "vs_slower_sync_side": 1.11,
  }  # fmt: skip
  args = {"devices": 2, "iterations": 12, "skip": 4, "rollout_devices": 1}
  lines = bench.table([row], args, "python experiments/bench_async.py --x=1")
  assert "| scratchpad | async split | 60.0 | 1.000 | 0.900 | 10% | 0.500 | 50% | 60% |" in (
    "\n".join(lines)
  )
  assert (
    lines[-2] == "python experiments/bench_async.py --x=1" and "means over the last 8" in lines[2]
  )
