"""experiments/bench_sampler.py runs every table end to end on a shrunken config."""

import os
import re
import subprocess
import sys

import bench_table
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_bench_sampler_runs_every_table(tmp_path):
  out = tmp_path / "table.md"
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=os.environ.get("RLX_TEST_XLA_FLAGS", ""))
  proc = subprocess.run(
    [
      sys.executable,
      os.path.join(ROOT, "experiments", "bench_sampler.py"),
      "--layers=1",
      "--hidden=32",
      "--intermediate=64",
      "--heads=4",
      "--kv_heads=2",
      "--vocab=64",
      "--batch=4",
      "--min_prompt=2",
      "--max_prompt=6",
      "--new_tokens=8",
      "--short_new_tokens=4",
      "--page_size=4",
      "--steps_per_sync=4",
      "--torch_threads=1",
      "--dense_layers=unroll",
      "--tail_requests=8",
      "--tail_stop_ids=8",
      "--prefix_prompts=2",
      "--prefix_len=9",
      "--group=2",
      "--repeats=1",
      "--notail_transformers",
      f"--out={out}",
    ],
    env=env,
    capture_output=True,
    text=True,
    timeout=600,
  )
  assert proc.returncode == 0, proc.stderr[-4000:]
  table = out.read_text()
  assert table.strip() in proc.stdout

  speed = bench_table.rows(table, "## Tokens/s")
  assert set(speed) == {"rlx", "dense JAX (unroll)", "transformers (threads=1)"}
  # Greedy float32 on the same weights: every sampler produces rlx's tokens.
  assert all(cells[-1] == "100%" for cells in speed.values()), speed
  assert all(float(cells[1]) > 0 for cells in speed.values())

  step = bench_table.rows(table, "## Decode step time")
  assert step["matmul floor (GEMMs only)"][-1] == "1.00"
  assert {"rlx", "dense JAX (unroll)", "transformers (threads=1)"} <= set(step)
  assert "3x transformers needs a step of" in table and "1.3x dense JAX needs a step of" in table

  tail = bench_table.rows(table, "## Long tail")
  assert {"rlx continuous", "rlx static", "dense JAX static (unroll)"} <= set(tail)
  assert tail["rlx static"][3] == "1.00x" and tail["rlx static"][5] == "1.00x"

  prefix = bench_table.rows(table, "## Prefix sharing")
  shared, unshared = prefix["G=2 (shared prompt pages)"], prefix["G=1, each prompt repeated 2x"]
  # 2 prompts of 9 tokens: 8 cached prompt tokens = 2 full pages of 4, held once per prompt.
  assert int(shared[0]) < int(unshared[0])
  assert int(shared[1]) < int(unshared[1])  # the prompt is prefilled once per group

  pool = bench_table.rows(table, "## Pool size")
  assert len(pool) == 2

  profile = bench_table.rows(table, "## Where the time goes")
  assert float(profile["**all device ops**"][0]) > 0
  assert float(profile["GEMMs (q/k/v/o, MLP, LM head)"][0]) > 0
  assert float(profile["attention: paged (page gather, mask, softmax, dots)"][0]) > 0
  assert float(profile["attention: dense cache (mask, softmax, dots)"][1]) > 0

  reruns = re.findall(r"Rerun this table: `python \S+bench_sampler.py ([^`]*)`", table)
  assert len(reruns) == 6 and all("--batch=4" in r and "--out" not in r for r in reruns)
  assert "--tables=tail" in reruns[2]
