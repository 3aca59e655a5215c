"""rlx.rl.run end to end: learning on an easy setting, outputs, SIGKILL + resume == straight."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import warnings

import jax
import numpy as np
import pytest
import rl_test_utils

from rlx import rl, train

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TIME_KEYS = ("time/", "tokens_per_s")


def _rl_records(workdir):
  out = []
  for r in rl.read_metrics(os.path.join(workdir, "metrics.jsonl")):
    if r["phase"] in ("rl", "eval"):
      out.append({k: v for k, v in r.items() if not any(t in k for t in TIME_KEYS)})
  return out


def _final(workdir, config):
  return rl_test_utils.final_checkpoint(config, workdir)


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
  """One straight 12-iteration run (easy digit-first reward, no warm-up)."""
  rl_test_utils.register_test_tasks()
  workdir = str(tmp_path_factory.mktemp("straight"))
  config = rl_test_utils.run_config(**{"log.plots": True})
  summary = rl.run(config, workdir)
  return workdir, config, summary


def test_end_to_end_reward_rises_and_writes_outputs(straight):
  workdir, config, summary = straight
  assert summary["iterations"] == 12 and summary["fused_rl_step"]
  rewards = [r["reward_mean"] for r in _rl_records(workdir) if r["phase"] == "rl"]
  assert len(rewards) == 12
  assert np.mean(rewards[-5:]) > np.mean(rewards[:5]) + 0.05, rewards
  with open(os.path.join(workdir, "summary.json")) as f:
    on_disk = json.load(f)
  for key in ("accuracy_before", "accuracy_after", "wall_time_s", "iterations", "config"):
    assert key in on_disk
  assert on_disk["config"]["rl"]["iterations"] == 12
  assert os.path.getsize(os.path.join(workdir, "plots", "rl_curves.png")) > 10_000
  events = os.listdir(os.path.join(workdir, "tensorboard"))
  assert any(e.startswith("events.out.tfevents") for e in events)
  assert "supervised training" in rl.format_summary(summary)
  restored = _final(workdir, config)
  assert restored.step == 12 and restored.data_cursor["iteration"] == 12
  assert int(train.to_host(restored.state.step)) == 12


def test_sigkill_mid_run_resumes_and_equals_straight(straight, tmp_path):
  """Kill -9 after the iteration-3 checkpoint, restart: same metrics and params as straight."""
  workdir, config, _ = straight
  killed = str(tmp_path / "killed")
  cmd = [
    sys.executable,
    os.path.join(REPO, "experiments", "train_rl.py"),
    f"--config={os.path.join(REPO, 'tests', 'rl', 'tiny_arithmetic_config.py')}",
    f"--workdir={killed}",
    "--config.log.plots=True",
  ]
  # The restarted process reuses the first one's compiled programs (from the
  # session's compilation cache, which tests/conftest.py hands to subprocesses).
  env = dict(os.environ)
  proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
  ckpt_dir = os.path.join(killed, "checkpoints")
  deadline = time.time() + 300
  while time.time() < deadline and proc.poll() is None:
    if os.path.isdir(ckpt_dir) and any(d.isdigit() and int(d) >= 3 for d in os.listdir(ckpt_dir)):
      break
    time.sleep(0.01)
  assert proc.poll() is None, f"the run ended before it was killed: {proc.stderr.read()[-3000:]}"
  proc.send_signal(signal.SIGKILL)
  proc.wait()
  proc.stderr.close()
  assert not os.path.exists(os.path.join(killed, "summary.json"))
  result = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, result.stderr[-3000:]
  with open(os.path.join(killed, "summary.json")) as f:
    summary = json.load(f)
  assert summary["iterations"] == 12 and summary["resumed_from_iteration"] >= 3
  assert _rl_records(killed) == _rl_records(workdir)
  a, b = _final(workdir, config), _final(killed, config)
  assert a.step == b.step == 12
  assert rl_test_utils.params_allclose(a.state.params, b.state.params)
  assert rl_test_utils.params_allclose(a.state.opt_state, b.state.opt_state)


def test_warmup_cap_raises_or_warns(straight):
  _, config, _ = straight
  config = rl_test_utils.tiny_config(**{"warmup.max_steps": 3, "warmup.eval_every": 3})
  task = rl.make_task(config)
  model_config, params = rl.build_model(config, task)
  mesh = rl.build_mesh(config)
  calls = []

  def evaluate(p):
    calls.append(1)
    return 0.0

  kwargs = dict(evaluate=evaluate, seq_len=task.max_prompt_len + task.max_answer_len, seed=0)
  with pytest.raises(rl.WarmupCapError, match="max_steps=3"):
    rl.supervised_warmup(params, model_config, mesh, task, config, **kwargs)
  config.warmup.on_cap = "warn"
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    result = rl.supervised_warmup(params, model_config, mesh, task, config, **kwargs)
  assert result.steps == 3 and not result.reached and len(result.history) == 2
  assert any("max_steps=3" in str(w.message) for w in caught)
  changed = jax.tree.map(
    lambda x, y: bool(np.any(np.asarray(x) != np.asarray(y))), result.params, params
  )
  assert any(jax.tree.leaves(changed)), "the warm-up steps did not train"


def test_a_workdir_keeps_its_record(straight, tmp_path):
  workdir, config, summary = straight
  copy = str(tmp_path / "copy")
  shutil.copytree(workdir, copy)
  with open(os.path.join(copy, "config.json")) as f:
    assert json.load(f)["rl"]["iterations"] == config.rl.iterations
  with open(os.path.join(copy, "summary.json")) as f:
    before = f.read()
  changed = rl_test_utils.run_config(**{"log.plots": True, "rl.temperature": 0.5})
  with pytest.raises(ValueError, match=r"different config \(rl.temperature: 1.0 -> 0.5\)"):
    rl.run(changed, copy)
  with warnings.catch_warnings():
    warnings.simplefilter("error", UserWarning)
    # The same config (log settings aside): the finished run's summary, nothing recomputed.
    # A loss keyword set to its default is the same run too.
    same = rl_test_utils.run_config(**{"log.plots": False, "train.loss_kwargs.clip_low": 0.2})
    again = rl.run(same, copy)
  with open(os.path.join(copy, "summary.json")) as f:
    assert f.read() == before
  assert again == json.loads(before)
  assert again["accuracy_after"] == summary["accuracy_after"]


def test_an_iteration_that_raises_closes_the_checkpointer_and_log(tmp_path, monkeypatch):
  closed = []
  for cls in (train.Checkpointer, rl.MetricsLog):
    original = cls.close

    def close(self, original=original):
      closed.append(str(getattr(self, "directory", type(self).__name__)))
      return original(self)

    monkeypatch.setattr(cls, "close", close)

  def broken_iteration(*args, **kwargs):
    raise RuntimeError("an iteration failed")

  # The fused iteration (the test task has a JAX reward) and the host-driven one.
  monkeypatch.setattr(rl.RLStep, "from_examples", broken_iteration)
  monkeypatch.setattr(rl.Learner, "iteration", broken_iteration)
  rl_test_utils.register_test_tasks()
  with pytest.raises(RuntimeError, match="an iteration failed"):
    rl.run(rl_test_utils.run_config(), str(tmp_path))
  # The run's RL checkpointer (a warm-up has its own) and its metrics log.
  assert closed.count(str(tmp_path / "checkpoints")) == 1 and "MetricsLog" in closed, closed
