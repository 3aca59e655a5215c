r"""RL of a language model with verifiable rewards: warm-up, GRPO-family RL, evaluation.

The default runs the embedded tiny-arithmetic experiment on CPU in minutes:

  python experiments/train_rl.py
  python experiments/train_rl.py --config=experiments/configs/arithmetic.py \
      --workdir=/tmp/rlx_arithmetic --config.seed=1 --config.rl.num_samples=4

Flags: `--config` (an ml_collections config file, default
experiments/configs/arithmetic.py; any field can be overridden as
`--config.<field>=<value>`, and any keyword of the chosen loss or task as
`--config.train.loss_kwargs.<kw>=` / `--config.task.kwargs.<kw>=`) and
`--workdir` (default /tmp/rlx_arithmetic; re-running on the same workdir
resumes from its last checkpoint, a finished one returns its summary, and one
of another config is refused). Your own loss or task: a file that calls
`rlx.objectives.register_policy_loss` / `rlx.tasks.register_task`, named by
`--config.imports=my_loss.py` (comma-separated files or modules). Everything
else is `rlx.rl.run`.
"""

import os

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
  "config", _DEFAULT_CONFIG, "RL config file.", lock_config=False, accept_new_attributes=True
)
_WORKDIR = flags.DEFINE_string(
  "workdir", "/tmp/rlx_arithmetic", "Output directory (checkpoints, metrics, plots, summary)."
)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)  # orbax logs every checkpoint at INFO
  rl.run(_CONFIG.value, _WORKDIR.value)


if __name__ == "__main__":
  app.run(main)
