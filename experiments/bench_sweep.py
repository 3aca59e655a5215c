r"""Grid wall-clock with and without shared warm-ups, measured side by side in one process.

  python experiments/bench_sweep.py --losses=ppo,cispo --seeds=0,1,2 \
      --config.rl.iterations=100 --out=experiments/results/bench_sweep_cpu.md

Runs the same grid (losses x seeds on the main-job config) twice, each in a
fresh directory: once with every run training its own warm-up (what a sweep
did before runs could share one), once with `rlx.rl.run_sweep`'s default,
where the runs of a seed reuse the first one's warm-up (`warmup.init_from`).
Prints a table of wall-clock per grid and per run, and checks that the shared
grid's results equal the unshared grid's (same warm-up params, so the same
runs).
"""

import os
import shutil
import sys
import tempfile
import time

from absl import app, flags, logging
from ml_collections import config_flags

from rlx import rl

_DEFAULT_CONFIG = os.path.join(
  os.path.dirname(os.path.abspath(__file__)), "configs", "arithmetic.py"
)
_CONFIG = config_flags.DEFINE_config_file(
  "config", _DEFAULT_CONFIG, "Base RL config file.", lock_config=False, accept_new_attributes=True
)
_LOSSES = flags.DEFINE_list("losses", ["ppo", "cispo"], "Losses of the grid (train.loss).")
_SEEDS = flags.DEFINE_list("seeds", ["0", "1", "2"], "Seeds of every grid point.")
_OUT = flags.DEFINE_string("out", "", "Also write the markdown table to this file.")


def _grid(config, share, root):
  """Runs the grid; returns (rows, seconds, mean 1-minute load average while it ran)."""
  loads = [os.getloadavg()[0]]
  t0 = time.perf_counter()
  rows = rl.run_sweep(
    config,
    {"train.loss": list(_LOSSES.value)},
    [int(s) for s in _SEEDS.value],
    root,
    share_warmup=share,
    report=lambda r: (
      loads.append(os.getloadavg()[0]),
      print(("shared   " if share else "unshared ") + rl.format_sweep_row(r), flush=True),
    ),
  )
  return rows, time.perf_counter() - t0, sum(loads) / len(loads)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)
  config = _CONFIG.value
  config.log.progress_bar = False
  config.log.print_summary = False
  config.log.plots = False
  root = tempfile.mkdtemp(prefix="rlx_bench_sweep_")
  try:
    unshared, t_unshared, load_unshared = _grid(config, False, os.path.join(root, "unshared"))
    shared, t_shared, load_shared = _grid(config, True, os.path.join(root, "shared"))
  finally:
    shutil.rmtree(root, ignore_errors=True)
  same = all(
    a["accuracy_after"] == b["accuracy_after"] and a["accuracy_before"] == b["accuracy_before"]
    for a, b in zip(unshared, shared, strict=True)
  )
  n = len(shared)
  reused = sum(bool(r["warmup_reused_from"]) for r in shared)
  warm = [r["warmup_steps"] for r in unshared]
  lines = [
    f"Grid: losses {_LOSSES.value} x seeds {_SEEDS.value} ({n} runs) on "
    f"{os.path.relpath(flags.FLAGS['config'].config_filename)}, rl.iterations = "
    f"{config.rl.iterations}; warm-up steps per seed {sorted(set(warm))}.",
    "",
    "| grid | runs | warm-ups trained | wall-clock (s) | s / run | speed-up | load avg |",
    "|---|---|---|---|---|---|---|",
    f"| every run trains its warm-up | {n} | {n} | {t_unshared:.0f} | {t_unshared / n:.1f} | "
    f"1.00x | {load_unshared:.1f} |",
    f"| runs of a seed share one (default) | {n} | {n - reused} | {t_shared:.0f} | "
    f"{t_shared / n:.1f} | {t_unshared / t_shared:.2f}x | {load_shared:.1f} |",
    "",
    f"load avg: the machine's mean 1-minute load average while the grid ran ({os.cpu_count()} "
    "cores; above the core count other work shared the machine).",
    "",
    f"Same results in both grids (test accuracy before and after, every run): {same}.",
    "",
    "Rerun: python experiments/bench_sweep.py " + " ".join(sys.argv[1:]),
  ]
  table = "\n".join(lines)
  print(table)
  if _OUT.value:
    with open(_OUT.value, "w") as f:
      f.write("# Sweep wall-clock with shared warm-ups (CPU)\n\n" + table + "\n")


if __name__ == "__main__":
  app.run(main)
