"""experiments/bench_fp8.py runs its three tables end to end on its --smoke setting."""

import os
import subprocess
import sys

import bench_table

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_bench_fp8_smoke(tmp_path):
  out = tmp_path / "table.md"
  proc = subprocess.run(
    [sys.executable, os.path.join(ROOT, "experiments", "bench_fp8.py"), "--smoke", f"--out={out}"],
    env=dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=os.environ.get("RLX_TEST_XLA_FLAGS", "")),
    capture_output=True,
    text=True,
    timeout=600,
  )
  assert proc.returncode == 0, proc.stderr[-4000:]
  table = out.read_text()
  assert table.strip() in proc.stdout
  variants = {"bf16 KV", "fp8 KV", "fp8 W8A8 + KV"}

  capacity = bench_table.rows(table, "## Capacity and decode speed")
  assert set(capacity) == variants
  bf16, fp8 = capacity["bf16 KV"], capacity["fp8 KV"]
  assert int(fp8[0]) * 2 == int(bf16[0])  # KV bytes per token halve
  assert int(fp8[1]) == 2 * int(bf16[1])  # twice the pages in the same bytes
  assert float(fp8[3].rstrip("x")) >= 1.9 and bf16[3] == "1.00x"
  assert all(float(cells[6]) > 0 for cells in capacity.values())  # decode tokens/s
  assert bf16[7] == "1.00x" and all(float(c[7].rstrip("x")) > 0 for c in capacity.values())

  refresh = bench_table.rows(table, "## Refresh after a policy update")
  assert len(refresh) == 3 and all(cells[-1] == "1" for cells in refresh.values()), refresh
  assert all(float(c[0]) > 0 for name, c in refresh.items() if not name.startswith("sampler"))

  mismatch = bench_table.rows(table, "## Rollout-training mismatch")
  assert set(mismatch) == variants
  for cells in mismatch.values():
    assert float(cells[1]) >= 0 and 0 <= float(cells[2]) <= 1  # k3 >= 0, agreement a fraction
  # FP8 KV / weights add mismatch on top of bf16 KV's rounding.
  assert float(mismatch["fp8 W8A8 + KV"][1]) > float(mismatch["bf16 KV"][1])
  assert "Rerun this" in table or "Rerun:" in table
