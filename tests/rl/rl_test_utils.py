"""Shared tiny configs for the rlx.rl tests (one small compiled model for all)."""

import os

import jax
import numpy as np

from rlx import rl, train


def tiny_config(**overrides):
  """A seconds-sized run: 2-digit addition, a 2-layer width-32 model, 8 prompts x G = 4."""
  c = rl.get_config()
  c.seed = 0
  c.task.kwargs.num_digits = 2
  c.task.kwargs.train_size = 2000
  c.task.kwargs.dev_size = 64
  c.task.kwargs.test_size = 64
  c.model.hidden_size = 32
  c.model.num_layers = 2
  c.model.num_heads = 2
  c.model.num_kv_heads = 1
  c.model.head_dim = 16
  c.model.intermediate_size = 64
  c.mesh.num_devices = 1
  c.train.optimizer.learning_rate = 1e-3
  c.rl.iterations = 4
  c.rl.prompts_per_iteration = 8
  c.rl.num_samples = 4
  c.warmup.target_dev_accuracy = 0.2
  c.warmup.learning_rate = 3e-3
  c.warmup.batch_size = 64
  c.warmup.eval_every = 20
  c.warmup.max_steps = 1500
  c.eval.every = 2
  c.eval.dev_examples = 64
  c.eval.test_examples = 64
  c.checkpoint.every = 2
  c.log.progress_bar = False
  c.log.print_summary = False
  c.log.plots = False
  for key, value in overrides.items():
    node = c
    *parents, leaf = key.split(".")
    for p in parents:
      node = node[p]
    node[leaf] = value
  return c


def params_allclose(a, b, atol=0.0):
  """Whether two param pytrees are equal (within atol)."""
  la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
  return len(la) == len(lb) and all(
    np.allclose(np.asarray(x), np.asarray(y), atol=atol, rtol=0)
    for x, y in zip(la, lb, strict=True)
  )


def _make_task(name, jax_ok, host_ok, **kwargs):
  """An ArithmeticTask whose reward is 1 where `jax_ok` / `host_ok` hold (they agree)."""
  import jax.numpy as jnp  # noqa: PLC0415

  from rlx import tasks  # noqa: PLC0415

  class _Task(tasks.ArithmeticTask):
    def __init__(self, **kw):
      super().__init__(name=name, **kw)

      def jax_reward(answer_ids, answer_lengths, completion, completion_lengths):
        del answer_lengths
        ok = jax_ok(answer_ids, completion) & (completion_lengths > 0)
        return jnp.where(ok, 1.0, 0.0).astype(jnp.float32)

      self.jax_reward = jax_reward

    def score(self, examples, completions):
      return np.asarray(
        [
          float(bool(c) and host_ok(self.answer_tokens(e), c))
          for e, c in zip(examples, completions, strict=True)
        ],
        np.float32,
      )

  return _Task(**kwargs)


FIRST_TOKEN = "test_first_token"  # reward: the first response token is the answer's first
DIGIT_FIRST = "test_digit_first"  # reward: the first response token is a digit (easy)


def register_test_tasks():
  """Registers two cheap test tasks: non-zero reward without any warm-up."""
  from rlx import tasks  # noqa: PLC0415

  digits = tasks.ArithmeticTask(train_size=1, dev_size=0, test_size=0).tokenizer.encode(
    "0123456789"
  )
  lo, hi = min(digits), max(digits)
  tasks.register_task(
    FIRST_TOKEN,
    lambda **kw: _make_task(
      FIRST_TOKEN, lambda a, c: c[:, 0] == a[:, 0], lambda a, c: c[0] == a[0], **kw
    ),
    overwrite=True,
  )
  tasks.register_task(
    DIGIT_FIRST,
    lambda **kw: _make_task(
      DIGIT_FIRST,
      lambda a, c: (c[:, 0] >= lo) & (c[:, 0] <= hi),
      lambda a, c: lo <= c[0] <= hi,
      **kw,
    ),
    overwrite=True,
  )


def run_config(**overrides):
  """The end-to-end test run: the easy digit-first reward, no warm-up, 12 iterations of 16 x 4."""
  base = {
    "task.name": DIGIT_FIRST,
    "warmup.enabled": False,
    "rl.iterations": 12,
    "checkpoint.every": 3,
    "eval.every": 6,
    "eval.dev_examples": 32,
    "eval.test_examples": 32,
    "train.optimizer.learning_rate": 3e-3,
    "rl.prompts_per_iteration": 16,
  }
  base.update(overrides)
  return tiny_config(**base)


def final_checkpoint(config, workdir):
  """The last checkpoint (`TrainState` and `extra`) of the run of `config` in `workdir`."""
  task = rl.make_task(config)
  model_config, _ = rl.build_model(config, task)
  mesh = rl.build_mesh(config)
  abstract = train.abstract_train_state(model_config, rl.train_config(config), mesh)
  with train.Checkpointer(os.path.join(workdir, "checkpoints")) as ckpt:
    return ckpt.restore(abstract)
