"""rlx.rl.run end to end: learning on an easy setting, outputs, resume == straight, SIGKILL."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import rl_test_utils

from rlx import rl, tasks, train

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TIME_KEYS = ("time/", "tokens_per_s", "step_time_s")


def _rl_records(workdir):
  records = rl.read_metrics(os.path.join(workdir, "metrics.jsonl"))
  out = []
  for r in records:
    if r["phase"] in ("rl", "eval"):
      out.append({k: v for k, v in r.items() if not any(t in k for t in TIME_KEYS)})
  return out


def _final_params(workdir, config):
  task = tasks.make_task(config.task.name, **config.task.kwargs.to_dict())
  model_config, _ = rl.build_model(config, task)
  mesh = rl.build_mesh(config)
  abstract = train.abstract_train_state(model_config, rl.train_config(config), mesh)
  with train.Checkpointer(os.path.join(workdir, "checkpoints")) as ckpt:
    restored = ckpt.restore(abstract)
  return restored.step, restored.state.params


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
  """One straight run (warm-up + 20 iterations) whose warm-up the other tests reuse."""
  workdir = str(tmp_path_factory.mktemp("straight"))
  config = rl_test_utils.run_config(**{"log.plots": True, "log.print_summary": True})
  summary = rl.run(config, workdir)
  return workdir, config, summary


def _copy_warmup(src, dst):
  os.makedirs(dst, exist_ok=True)
  shutil.copytree(os.path.join(src, "warmup"), os.path.join(dst, "warmup"))
  records = [
    r for r in rl.read_metrics(os.path.join(src, "metrics.jsonl")) if r["phase"] == "warmup"
  ]
  with open(os.path.join(dst, "metrics.jsonl"), "w") as f:
    f.writelines(json.dumps(r) + "\n" for r in records)


def test_end_to_end_learns_and_writes_outputs(straight):
  workdir, config, summary = straight
  assert summary["iterations"] == 20
  assert summary["warmup_dev_accuracy"] >= config.warmup.target_dev_accuracy
  rewards = [r["reward_mean"] for r in _rl_records(workdir) if r["phase"] == "rl"]
  assert len(rewards) == 20
  # Reward rises from the reward alone (an easy 2-digit setting, lr 1e-3).
  assert np.mean(rewards[-5:]) > np.mean(rewards[:5]) + 0.05, rewards
  with open(os.path.join(workdir, "summary.json")) as f:
    on_disk = json.load(f)
  for key in ("accuracy_before", "accuracy_after", "wall_time_s", "iterations", "config"):
    assert key in on_disk
  assert on_disk["config"]["rl"]["iterations"] == 20
  assert os.path.getsize(os.path.join(workdir, "plots", "rl_curves.png")) > 10_000
  events = os.listdir(os.path.join(workdir, "tensorboard"))
  assert any(e.startswith("events.out.tfevents") for e in events)
  assert "supervised training" in rl.format_summary(summary)


def test_resume_equals_straight_run(straight, tmp_path):
  workdir, config, _ = straight
  resumed = str(tmp_path / "resumed")
  _copy_warmup(workdir, resumed)
  first = rl.run(rl_test_utils.run_config(**{"rl.iterations": 10}), resumed)
  assert first["iterations"] == 10
  second = rl.run(config, resumed)
  assert second["resumed_from_iteration"] == 10 and second["iterations"] == 20
  assert _rl_records(resumed) == _rl_records(workdir)
  step_a, params_a = _final_params(workdir, config)
  step_b, params_b = _final_params(resumed, config)
  assert step_a == step_b == 20
  assert rl_test_utils.params_allclose(params_a, params_b)


def test_sigkill_mid_run_then_resume_finishes(straight, tmp_path):
  workdir, config, _ = straight
  killed = str(tmp_path / "killed")
  _copy_warmup(workdir, killed)
  cmd = [
    sys.executable,
    os.path.join(REPO, "experiments", "train_rl.py"),
    f"--config={os.path.join(REPO, 'tests', 'rl', 'tiny_arithmetic_config.py')}",
    f"--workdir={killed}",
  ]
  proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
  ckpt_dir = os.path.join(killed, "checkpoints")
  deadline = time.time() + 240
  while time.time() < deadline and proc.poll() is None:
    if os.path.isdir(ckpt_dir) and any(d.isdigit() and int(d) >= 4 for d in os.listdir(ckpt_dir)):
      break
    time.sleep(0.02)
  assert proc.poll() is None, f"the run ended before it was killed: {proc.stderr.read()[-2000:]}"
  proc.send_signal(signal.SIGKILL)
  proc.wait()
  assert not os.path.exists(os.path.join(killed, "summary.json"))
  result = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, result.stderr[-3000:]
  with open(os.path.join(killed, "summary.json")) as f:
    summary = json.load(f)
  assert summary["iterations"] == 20 and summary["resumed_from_iteration"] >= 4
  assert _rl_records(killed) == _rl_records(workdir)
