"""experiments/bench_sampler_compile.py end to end on a shrunken config (rlx; Tunix if there)."""

import importlib.util
import os
import re
import subprocess
import sys

import bench_table
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "experiments", "bench_sampler_compile.py")
SMALL = [
  "--layers=1",
  "--hidden=32",
  "--intermediate=64",
  "--heads=4",
  "--kv_heads=2",
  "--vocab=32",
  "--batch=4",
  "--prompt_len=4",
  "--new_tokens=4",
  "--page_size=4",
  "--steps_per_sync=4",
  "--compile_rounds=1",
  "--repeats=1",
]


def _run(args, tmp_path, hide_tunix=False):
  out = tmp_path / "table.md"
  # Run as a script; optionally with Tunix made unimportable (its rows must be skipped).
  code = (
    "import runpy, sys\n"
    + ("sys.modules['tunix'] = None\n" if hide_tunix else "")
    + f"sys.argv = {[SCRIPT, *args, f'--out={out}']!r}\n"
    + f"runpy.run_path({SCRIPT!r}, run_name='__main__')\n"
  )
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=os.environ.get("RLX_TEST_XLA_FLAGS", ""))
  proc = subprocess.run(
    [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=900
  )
  assert proc.returncode == 0, proc.stderr[-4000:]
  table = out.read_text()
  assert table.strip() in proc.stdout
  return table


def test_rlx_rows_and_the_message_without_tunix(tmp_path):
  table = _run([*SMALL, "--temperatures=1"], tmp_path, hide_tunix=True)
  assert "Tunix is not installed: its rows are skipped (install: `pip install --no-deps" in table
  compile_rows = bench_table.rows(table, "## Compile")
  assert set(compile_rows) == {"rlx T=1"}
  wall, cpu, xla, programs = (float(x) for x in compile_rows["rlx T=1"][:4])
  assert wall > 0 and cpu > 0 and 0 < xla <= wall and programs >= 2  # prefill + decode
  speed = bench_table.rows(table, "## Steady state")
  assert set(speed) == {"rlx T=1", "rlx T=1, top-k 8 / top-p 0.9"}
  assert float(speed["rlx T=1"][1]) > 0
  assert "sort/top_k primitives in the jaxpr: none (with top-k / top-p: cumsum, top_k)" in table
  rerun = re.findall(r"Rerun: `python \S+bench_sampler_compile.py ([^`]*)`", table)
  assert len(rerun) == 1 and "--batch=4" in rerun[0] and "--out" not in rerun[0]


@pytest.mark.skipif(importlib.util.find_spec("tunix") is None, reason="Tunix not installed")
def test_tunix_rows_agree_with_rlx_greedy(tmp_path):
  table = _run([*SMALL, "--temperatures=0", "--notruncation"], tmp_path)
  compile_rows = bench_table.rows(table, "## Compile")
  assert set(compile_rows) == {"rlx greedy", "tunix greedy"}
  assert compile_rows["rlx greedy"][4].endswith("x")  # rlx / tunix
  speed = bench_table.rows(table, "## Steady state")
  # Same weights, same prompts, float32 greedy: Tunix produces rlx's tokens.
  assert speed["tunix greedy"][-1] == "100%" and speed["rlx greedy"][-1] == "100%"
