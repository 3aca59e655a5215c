"""experiments/fp8_partial_learning.py --table_only: every table number comes from the runs."""

import json
import os
import pathlib
import subprocess
import sys

_ROOT = pathlib.Path(__file__).resolve().parents[2]


def _fake_run(workdir: pathlib.Path, *, after: float, rollout: list[float], partial: bool):
  """A finished run's summary.json, metrics.jsonl and load.json (4 RL iterations)."""
  workdir.mkdir(parents=True)
  summary = {
    "accuracy_before": 0.5,
    "accuracy_after": after,
    "accuracy_best_dev": after,
    "rl_time_s": 10.0 * sum(rollout),
    "seconds_per_iteration": 1.0,
    "wall_time_s": 20.0,
    "iterations": len(rollout),
    "fused_rl_step": False,
    "warmup_dev_accuracy": 0.4,
  }
  (workdir / "summary.json").write_text(json.dumps(summary))
  records = []
  for i, r in enumerate(rollout, start=1):
    rec = {
      "phase": "rl",
      "iteration": i,
      "time/rollout_s": r,
      "time/reward_s": 0.0,
      "time/logp_s": 0.1,
      "time/train_s": 0.2,
      "time/iteration_s": r + 0.3,
      "response_length": 5.0,
      "stop_fraction": 1.0,
      "mismatch_k1": 0.0,
      "mismatch_k3": 0.0,
    }
    if partial:
      rec.update({"rollout/prefill_tokens": 100.0 * i, "rollout/groups_resumed": 2.0})
    records.append(rec)
  records.append({"phase": "eval", "iteration": len(rollout), "dev_accuracy": after})
  (workdir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
  (workdir / "load.json").write_text(json.dumps({"start": 1.25, "end": 2.5, "cores": 2}))


def _table_only(args: list[str], out: pathlib.Path) -> str:
  """Runs the script with `args` and --table_only; returns the table it wrote to `out`."""
  proc = subprocess.run(
    [sys.executable, "experiments/fp8_partial_learning.py", *args, "--table_only"],
    cwd=_ROOT,
    env=dict(os.environ, JAX_PLATFORMS="cpu"),
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  return out.read_text()


def test_table_only_computes_the_phase_medians_and_the_comparison(tmp_path):
  _fake_run(tmp_path / "sync_host_s0", after=0.75, rollout=[0.1, 0.2, 0.3, 0.9], partial=False)
  _fake_run(tmp_path / "partial_s0", after=0.8, rollout=[0.2, 0.2, 0.2, 5.0], partial=True)
  out = tmp_path / "table.md"
  args = [
    "--config=experiments/configs/arithmetic_tail.py",
    "--config.model.family=qwen2",
    f"--workdir={tmp_path}",
    "--runs=sync_host:0,partial:0",
    f"--out={out}",
  ]
  table = _table_only(args, out)
  assert "overrides `--config.model.family=qwen2`" in table
  assert "| 1.2-2.5 / 2 |" in table  # the recorded load averages
  # Medians per iteration: rollout, logp, train, iteration, rollout share, prefill, resumed.
  assert "| sync_host (seed 0) | 0.250 | 0.100 | 0.200 | 0.550 | 45% | - | - |" in table
  assert "| partial (seed 0) | 0.200 | 0.100 | 0.200 | 0.500 | 40% | 250 | 2.0 |" in table
  # Partial runs are paired with the synchronous run of the same seed: 30 - 25 points.
  assert "| +30.0 | - | +5.0 (n = 1) vs sync_host |" in table
  assert (
    "partial vs sync_host (seed 0): test accuracy after RL 0.800 vs 0.750; "
    "RL time 56 s vs 15 s (3.73x)"
  ) in table
  rerun = "Rerun: `python experiments/fp8_partial_learning.py " + " ".join(args) + "`"
  assert rerun in table  # without --table_only: the command that makes the runs


def test_table_pairs_per_token_runs_with_their_static_counterparts(tmp_path):
  afters = {"hp": (0.9, 0.8), "fp8_tis": (0.85, 0.8), "fp8tok_tis": (0.9, 0.83)}
  for variant, values in afters.items():
    for seed, after in enumerate(values):
      _fake_run(tmp_path / f"{variant}_s{seed}", after=after, rollout=[0.1] * 4, partial=False)
  out = tmp_path / "table.md"
  runs = ",".join(f"{v}:{s}" for v in afters for s in (0, 1))
  table = _table_only([f"--workdir={tmp_path}", f"--runs={runs}", f"--out={out}"], out)
  # fp8tok_tis - fp8_tis: +5.0 and +3.0 points -> +4.0 ± 1.4 (n = 2); vs hp: 0 and +3.
  assert "| +1.5 ± 2.1 (n = 2) | +4.0 ± 1.4 (n = 2) vs fp8_tis |" in table
  assert "| fp8_tis | 2 | 0.825 ± 0.035 | +32.5 ± 3.5 | -2.5 ± 3.5 (n = 2) | - |" in table


def test_table_puts_async_runs_beside_the_synchronous_run_of_their_seed(tmp_path):
  _fake_run(tmp_path / "sync_host_s0", after=0.75, rollout=[0.1, 0.2, 0.3, 0.9], partial=False)
  _fake_run(tmp_path / "async_tis_s0", after=0.7, rollout=[0.2, 0.2, 0.2, 0.2], partial=False)
  summary_path = tmp_path / "async_tis_s0" / "summary.json"
  summary = json.loads(summary_path.read_text()) | {"staleness_mean": 1.5, "staleness_max": 3}
  summary_path.write_text(json.dumps(summary))
  metrics = tmp_path / "async_tis_s0" / "metrics.jsonl"
  records = [json.loads(line) for line in metrics.read_text().splitlines()]
  waits = iter([0.0, 0.4, 0.1, 0.3])
  for r in records:
    if r["phase"] == "rl":
      r["time/learner_wait_s"] = next(waits)
  metrics.write_text("".join(json.dumps(r) + "\n" for r in records))
  out = tmp_path / "table.md"
  runs = "--runs=sync_host:0,async_tis:0"
  table = _table_only([f"--workdir={tmp_path}", runs, f"--out={out}"], out)
  # Paired with the synchronous run: 20 - 25 points.
  assert "| async_tis | 1 | 0.700 | +20.0 | - | -5.0 (n = 1) vs sync_host |" in table
  # Median iteration 0.2 + 0.3, rollout 0.2, learner busy median of 0.5 - waits = 0.3,
  # wait (0.1 + 0.3) / 2; the slower sync side is its learner, 0.0 + 0.1 + 0.2 (rollout
  # median 0.25): 0.5 / 0.3 = 1.67x; staleness from the summary.
  assert (
    "| async_tis (seed 0) | 0.500 | 0.700 | +20.0 | 8 | 0.500 | 0.200 | 0.300 | 0.200 | 1.67x "
    "| 1.50 | 3 | - |"
  ) in table
  assert (
    "| sync_host (seed 0) | 0.500 | 0.750 | +25.0 | 15 | 0.550 | 0.250 | 0.300 | - | - |" in table
  )
  assert "async_tis vs sync_host (seed 0): test accuracy after RL 0.700 vs 0.750" in table
