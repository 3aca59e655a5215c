r"""The main job on a rollout-bound task: addition with a scratchpad (long responses).

  python experiments/train_rl.py --config=experiments/configs/arithmetic_scratchpad.py \
      --workdir=/tmp/rlx_arithmetic_scratchpad

The default experiment (experiments/configs/arithmetic.py) with one change of
task: reversed addition of up to 18-digit operands whose digit counts decay
(P(d) ~ 0.8 ** (d - 3), d in [3, 18]; zero-padded to 18 digits in the prompt),
answered with a scratchpad: one "a+b+c=s" step per digit place, then "*" and
the answer at its natural length (`rlx.tasks.ArithmeticTask(scratchpad=True)`).
Responses are 26 to 146 tokens (median 66; 10% at 114 or more): long responses
with a long tail, as in RL on reasoning traces, the setting asynchronous rollout
(`rl.async_rollout`) and partial rollouts (`rollout.over_provision`) are built
for. On a 2-core CPU the rollout is still 23% of a synchronous iteration
(experiments/results/bench_async_cpu.md), and the warm-up to 30% dev accuracy
takes long on CPU. With operands of 2 to 8 digits
(`--config.task.arithmetic.num_digits=8 --config.task.arithmetic.min_digits=2
--config.task.arithmetic.digits_decay=0.7`, responses of about 40 tokens) the
warm-up reaches its target and RL gains +35.1 +/- 5.8 points in 100
iterations over 3 seeds (experiments/results/partial_rollout_learning_scratchpad.md).
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
  c.task.arithmetic.num_digits = 18
  c.task.arithmetic.min_digits = 3
  c.task.arithmetic.digits_decay = 0.8
  c.task.arithmetic.pad_answer = False
  c.task.arithmetic.scratchpad = True
  # Host syncs every 8 decode steps: finished rows free their slots within 8
  # steps of their stop token.
  c.sampler.steps_per_sync = 8
  return c
