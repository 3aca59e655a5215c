"""The train-step benchmark's main path runs on a shrunken config."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_bench_train_step_runs_and_prints_the_table(tmp_path):
  out = tmp_path / "table.md"
  env = dict(os.environ)
  env["XLA_FLAGS"] = (
    "--xla_force_host_platform_device_count=2 " + os.environ.get("RLX_TEST_XLA_FLAGS", "")
  ).strip()
  env["JAX_PLATFORMS"] = "cpu"
  proc = subprocess.run(
    [
      sys.executable,
      os.path.join(ROOT, "experiments", "bench_train_step.py"),
      "--layouts=1x2x1",
      "--layers=1",
      "--hidden=32",
      "--heads=4",
      "--kv_heads=2",
      "--vocab=64",
      "--batch=4",
      "--seq=16",
      "--prompt=4",
      "--steps=1",
      "--gather_modes=layer,model",
      f"--out={out}",
    ],
    env=env,
    capture_output=True,
    text=True,
    timeout=600,
  )
  assert proc.returncode == 0, proc.stderr[-4000:]
  table = out.read_text()
  assert "| 1x2x1 | layer |" in table and "| 1x2x1 | model |" in table
  assert "n/a (CPU)" in table
  assert "Rerun: `python " in table and "--layouts=1x2x1" in table
  assert "--gather_modes=layer,model" in table
  assert table in proc.stdout
