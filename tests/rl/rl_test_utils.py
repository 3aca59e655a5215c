"""Shared tiny configs for the rlx.rl tests (one small compiled model for all)."""

import jax
import numpy as np

from rlx import rl


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


class FirstTokenTask:
  """Builds an arithmetic task whose reward is 1 when the first response token is right.

  A random policy earns it now and then, so advantages are non-zero without a
  warm-up (cheap loop tests); `jax_reward` equals the host reward exactly.
  """

  name = "arithmetic_first_token"

  @staticmethod
  def make(**kwargs):
    import jax.numpy as jnp  # noqa: PLC0415

    from rlx import tasks  # noqa: PLC0415

    class _Task(tasks.ArithmeticTask):
      def __init__(self, **kw):
        super().__init__(name=FirstTokenTask.name, **kw)

        def jax_reward(answer_ids, answer_lengths, completion, completion_lengths):
          del answer_lengths
          ok = (completion[:, 0] == answer_ids[:, 0]) & (completion_lengths > 0)
          return jnp.where(ok, 1.0, 0.0).astype(jnp.float32)

        self.jax_reward = jax_reward

      def score(self, examples, completions):
        return np.asarray(
          [
            float(bool(c) and c[0] == self.answer_tokens(e)[0])
            for e, c in zip(examples, completions, strict=True)
          ],
          np.float32,
        )

    return _Task(**kwargs)


def register_first_token_task():
  from rlx import tasks  # noqa: PLC0415

  tasks.register_task(FirstTokenTask.name, FirstTokenTask.make, overwrite=True)
  return FirstTokenTask.name


def run_config(**overrides):
  """The end-to-end test run: tiny_config with 20 RL iterations, checkpoints every 4."""
  base = {
    "rl.iterations": 20,
    "checkpoint.every": 4,
    "eval.every": 10,
    "train.optimizer.learning_rate": 1e-3,
  }
  base.update(overrides)
  return tiny_config(**base)
