r"""The main job on a task with a long tail of response lengths (for partial rollouts).

  python experiments/train_rl.py --config=experiments/configs/arithmetic_tail.py \
      --workdir=/tmp/rlx_arithmetic_tail

The default experiment (experiments/configs/arithmetic.py) with one change of
task: 10-digit reversed addition whose operands have a decaying number of
digits (P(d) ~ 0.6 ** (d - 2), d in [2, 10], zero-padded to 10 digits in the
prompt so every answer digit keeps its fixed offset to its operand digits) and
answers written at their natural length. Most answers are 3-5 digits and a few
are 10-11, so a synchronous rollout waits on the few long groups: the setting
partial rollouts (APRIL, rollout.over_provision > 1) are built for.
"""

import importlib.util
import os


def _base():
  path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "arithmetic.py")
  spec = importlib.util.spec_from_file_location("arithmetic_base", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config()


def get_config():
  c = _base()
  c.task.arithmetic.num_digits = 10
  c.task.arithmetic.min_digits = 2
  c.task.arithmetic.digits_decay = 0.6
  c.task.arithmetic.pad_answer = False
  # Host syncs every 4 decode steps: a partial collection can stop within 4
  # steps of its target (answers are <= 12 tokens).
  c.sampler.steps_per_sync = 4
  return c
