"""experiments/fp8_mismatch.py runs its fake-quantization tables end to end on --smoke."""

import math
import os
import subprocess
import sys

import bench_table

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_fp8_mismatch_smoke(tmp_path):
  out = tmp_path / "table.md"
  proc = subprocess.run(
    [
      sys.executable,
      os.path.join(ROOT, "experiments", "fp8_mismatch.py"),
      "--smoke",
      "--seeds=0",
      "--prompts=2",
      f"--workdir={tmp_path / 'work'}",
      f"--out={out}",
    ],
    env=dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=os.environ.get("RLX_TEST_XLA_FLAGS", "")),
    capture_output=True,
    text=True,
    timeout=600,
  )
  assert proc.returncode == 0, proc.stderr[-4000:]
  table = out.read_text()
  assert table.strip() in proc.stdout
  k3 = bench_table.rows(table, "## k3 per variant")
  assert {"e4m3 / head", "e4m3 / token", "int8 / head", "e4m3 / head, K only"} <= set(k3)
  for cells in k3.values():
    assert cells[0] == "0.35"  # the main job's temperature
    assert all(math.isfinite(float(x)) and float(x) >= 0 for x in cells[1:])  # k3 >= 0
  # Rounding adds mismatch: nonzero, but small on the random-weight model.
  assert 0 < float(k3["e4m3 / head"][1]) < 1e-2
  sharp = bench_table.rows(table, "## Sharpness")
  assert {"L0 RMS score", "logit std at T", "KL, final hidden x (1 + 2^-5 N)"} <= set(sharp)
  assert "Rerun: `python experiments/fp8_mismatch.py --smoke" in table
