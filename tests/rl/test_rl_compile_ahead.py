"""rlx.rl.run compiles ahead: the warm-up step beside the first dev evaluation, the fused RL
iteration during the warm-up, each in a thread, and never again at the first call."""

import logging

import jax
import rl_test_utils

from rlx import rl


class _Compiles(logging.Handler):
  def __init__(self):
    super().__init__()
    self.records = []

  def emit(self, record):
    message = record.getMessage()
    if message.startswith("Finished XLA compilation of "):
      self.records.append((record.threadName, message.split()[4]))


def test_the_warmup_step_and_the_fused_iteration_compile_in_a_thread_once(tmp_path):
  # A model size of its own: no other test's compiled programs can be reused here.
  config = rl_test_utils.tiny_config(
    **{"rl.iterations": 2, "train.kl_coef": 0.05, "model.intermediate_size": 48}
  )
  handler = _Compiles()
  logger = logging.getLogger("jax")
  level = logger.level
  logger.addHandler(handler)
  logger.setLevel(logging.WARNING)
  jax.config.update("jax_log_compiles", True)
  try:
    summary = rl.run(config, str(tmp_path / "run"))
  finally:
    jax.config.update("jax_log_compiles", False)
    logger.removeHandler(handler)
    logger.setLevel(level)
  assert summary["fused_rl_step"] and summary["warmup_steps"] > 0 and summary["iterations"] == 2
  by_name = {}
  for thread, name in handler.records:
    by_name.setdefault(name, []).append(thread)
  # jit(step): the warm-up's SFT step; jit(plain): the fused RL iteration.
  for name in ("jit(step)", "jit(plain)"):
    threads = by_name.get(name, [])
    assert len(threads) == 1 and threads[0].startswith("rlx-compile"), (name, by_name)
