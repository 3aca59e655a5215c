r"""Runs a grid of configs x seeds sequentially and writes one comparison table and plot.

  python experiments/sweep.py --config=experiments/configs/arithmetic.py \
      --grid="train.loss=ppo,cispo;rl.baseline=grpo,median" --seeds=0,1 \
      --workdir=/tmp/rlx_sweep

`--grid` is `field=v1,v2;field=v1,...` over config fields (the product is
run); `--config.<field>=...` overrides the base config (`--config.imports=`
brings in your own losses and tasks, as for train_rl.py). Each run has its own
workdir under `--workdir` (re-running resumes unfinished runs and reads
finished ones back when their recorded config equals the requested one; a
different one is refused). Runs of a seed share one warm-up. One line is
printed per finished run; the table goes to stdout and `<workdir>/sweep.md`,
the plot to `<workdir>/sweep.png`, the rows to `<workdir>/sweep.json`.
"""

import json
import os
import shlex
import shutil
import sys

from absl import app, flags, logging
from ml_collections import config_flags

from rlx import rl

_DEFAULT_CONFIG = os.path.join(
  os.path.dirname(os.path.abspath(__file__)), "configs", "arithmetic.py"
)
# New keys are accepted on the command line (a loss's or a task's keyword
# arguments: --config.train.loss_kwargs.dual_clip=3.0); rlx.rl.validate_config
# checks each against the function it feeds and names any misspelt field.
_CONFIG = config_flags.DEFINE_config_file(
  "config", _DEFAULT_CONFIG, "Base RL config file.", lock_config=False, accept_new_attributes=True
)
_GRID = flags.DEFINE_string("grid", "train.loss=ppo,cispo", "field=v1,v2;field=v1,... grid.")
_SEEDS = flags.DEFINE_list("seeds", ["0"], "Seeds of every grid point.")
_WORKDIR = flags.DEFINE_string("workdir", "/tmp/rlx_sweep", "Root output directory.")
_OUT = flags.DEFINE_string(
  "out", "", "Also write the table (with the rerun command) to this markdown file, the plot beside."
)
_NOTE = flags.DEFINE_string(
  "note",
  "",
  "A paragraph of prose for the --out file (not a setting, not in the rerun command; "
  "state no numbers the script does not compute: the header reports the load it measures).",
)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)
  config = _CONFIG.value
  config.log.progress_bar = False
  config.log.print_summary = False
  rows = rl.run_sweep(
    config, rl.parse_grid(_GRID.value), [int(s) for s in _SEEDS.value], _WORKDIR.value
  )
  table = rl.sweep_table(rows)
  plot = rl.plot_sweep(rows, os.path.join(_WORKDIR.value, "sweep.png"))
  with open(os.path.join(_WORKDIR.value, "sweep.md"), "w") as f:
    f.write(table + "\n")
  with open(os.path.join(_WORKDIR.value, "sweep.json"), "w") as f:
    json.dump(rows, f, indent=2)
  args = [a for a in sys.argv[1:] if not a.startswith(("--note=", "-note="))]  # not a setting
  rerun = "python experiments/sweep.py " + shlex.join(args)
  print(table)
  print(f"plot: {plot}")
  print(f"Rerun: {rerun}")
  if _OUT.value:
    out_plot = os.path.splitext(_OUT.value)[0] + ".png"
    shutil.copyfile(plot, out_plot)
    load = os.getloadavg()[0]
    with open(_OUT.value, "w") as f:
      f.write(
        f"# Sweep: {_GRID.value or 'the base config'} x seeds {','.join(_SEEDS.value)}\n\n"
        f"Config {os.path.relpath(flags.FLAGS['config'].config_filename)}; wall time per run "
        f"as `rlx.rl.run` reports it; 1-minute load average at the end {load:.1f} on "
        f"{os.cpu_count()} cores. Plot: {os.path.basename(out_plot)}.\n\n"
        + (f"{_NOTE.value}\n\n" if _NOTE.value else "")
        + f"{table}\n\nRerun: `{rerun}`\n"
      )


if __name__ == "__main__":
  app.run(main)
