"""experiments/bench_logprobs.py runs end to end on a shrunken problem."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_bench_logprobs_main_runs(tmp_path):
  out = tmp_path / "table.md"
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=os.environ.get("RLX_TEST_XLA_FLAGS", ""))
  result = subprocess.run(
    [
      sys.executable,
      os.path.join(ROOT, "experiments", "bench_logprobs.py"),
      "--vocab=512",
      "--seq=32",
      "--hidden=32",
      "--chunk_size=8",
      "--repeats=1",
      "--modes=value+grad",
      "--rss=false",
      f"--out={out}",
    ],
    capture_output=True,
    text=True,
    env=env,
    timeout=300,
  )
  assert result.returncode == 0, result.stderr[-2000:]
  table = out.read_text()
  assert "| value+grad | naive |" in table and "| value+grad | chunked |" in table
  assert "Rerun: `python experiments/bench_logprobs.py --vocab=512 --seq=32" in table
