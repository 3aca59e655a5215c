"""experiments/check_device.py --smoke runs every section end to end on CPU (tiny shapes).

Run as a subprocess: the script shares experiments/check_kernels.py's absl flags,
which another test loads in its own copy of that module.
"""

import pathlib
import re
import subprocess
import sys

_ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_smoke_run_writes_every_section(tmp_path):
  out = tmp_path / "report.md"
  command = [sys.executable, "experiments/check_device.py", "--smoke", f"--output={out}"]
  done = subprocess.run(command, cwd=_ROOT, capture_output=True, text=True, timeout=900)
  assert done.returncode == 0, done.stderr[-3000:]
  report = out.read_text()
  for heading in ("## kernels vs references", "## sampler", "## train step", "## RL iteration"):
    assert heading in report
  for kernel in ("paged_attention[pallas_gpu]", "paged_attention[pallas_tpu]", "fp8_blockwise"):
    assert f"| {kernel}" in report
  # Both KV dtypes sampled, with a positive throughput.
  sampled = re.findall(r"^\| (float32|fp8_e4m3) \| ([\d,]+) \|", report, flags=re.M)
  assert [d for d, _ in sampled] == ["float32", "fp8_e4m3"]
  assert all(int(tps.replace(",", "")) > 0 for _, tps in sampled)
  assert "n/a (CPU)" in report  # no MFU without a peak
  assert report.rstrip().endswith(
    f"Rerun: `python experiments/check_device.py --smoke --output={out}`"
  )
