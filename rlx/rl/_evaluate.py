"""Greedy accuracy of a policy on a task split (the fraction of greedy completions solved)."""

from collections.abc import Sequence
from typing import Any

import jax
import ml_collections
import numpy as np

from rlx import train
from rlx.rl import _logging, _rollout


def greedy_accuracy(
  sampler: Any, params: Any, task: Any, examples: Sequence[Any], *, batch_size: int
) -> float:
  """The fraction of greedy completions solved (`task.correct`; the mean reward by default).

  Args:
    sampler: an `rlx.sampling.Sampler` built with temperature 0.
    params: the policy params.
    task: the `rlx.tasks.Task` whose `correct` scores the completions.
    examples: the examples to evaluate (e.g. `task.split("test")`).
    batch_size: prompts per `generate` call.

  Returns:
    The mean of `task.correct` over `examples` (a Python float).
  """
  if not len(examples):
    raise ValueError(f"Task {task.name!r}: no examples to evaluate.")
  if batch_size < 1:
    raise ValueError(f"`batch_size` must be >= 1, got {batch_size}.")
  total = 0.0
  for start in range(0, len(examples), batch_size):
    chunk = list(examples[start : start + batch_size])
    out = sampler.generate(
      params, [list(e.prompt_ids) for e in chunk], num_samples=1, rng=jax.random.PRNGKey(0)
    )
    tokens = np.asarray(out.tokens)
    lengths = np.asarray(out.lengths)
    completions = [tokens[i, : int(n)].tolist() for i, n in enumerate(lengths)]
    total += float(np.sum(task.correct(chunk, completions)))
  return total / len(examples)


class GreedyEvaluator:
  """The run's greedy evaluation: `evaluator(params, "dev" | "test" | examples) -> accuracy`.

  As `rlx.rl.run` evaluates: the dev and test splits cut to `eval.dev_examples` /
  `eval.test_examples` (0 = the whole split), one greedy sampler sized for the
  dev set (at most 512 rows; its cost grows with its slots), its slots rounded up
  to a multiple of the mesh's batch axes; the test set runs in chunks of that size.

  Args:
    config: the RL config (`rollout`, `rl` and `eval` sections).
    task: the `rlx.tasks.Task`.
    model_config: the policy's `ModelConfig`.
    mesh: the train mesh (the evaluation runs on it).
    notes: note on stderr when the first call compiles the sampler.

  Attributes:
    dev, test: the examples evaluated for "dev" and "test".
    batch_size: prompts per `generate` call.
    sampler: the greedy `rlx.sampling.Sampler`.
  """

  def __init__(
    self,
    config: ml_collections.ConfigDict,
    task: Any,
    model_config: Any,
    mesh: Any,
    *,
    notes: bool = False,
  ):
    self.task = task
    self.dev = _subset(task.split("dev"), int(config.eval.dev_examples))
    self.test = _subset(task.split("test"), int(config.eval.test_examples))
    self.batch_size = min(max(len(self.dev) or len(self.test), 1), 512)
    kwargs = _rollout.sampler_kwargs(config, task, rows=self.batch_size, greedy=True)
    shards = train.batch_axis_size(mesh)
    kwargs["max_slots"] = -(-min(kwargs["max_slots"], self.batch_size) // shards) * shards
    self.sampler = _rollout.make_sampler(model_config, kwargs, mesh)
    self._accuracy = _logging.note_first_call(
      greedy_accuracy, "the greedy evaluation sampler", enabled=notes
    )

  def __call__(self, params: Any, examples: str | Sequence[Any]) -> float:
    """Greedy accuracy of `params` on "dev", "test" or a list of examples."""
    if isinstance(examples, str):
      if examples not in ("dev", "test"):
        raise ValueError(f"`examples` must be 'dev', 'test' or examples, got {examples!r}.")
      examples = self.dev if examples == "dev" else self.test
    return self._accuracy(self.sampler, params, self.task, examples, batch_size=self.batch_size)


def _subset(examples: Sequence[Any], n: int) -> Sequence[Any]:
  """The first n examples (all of them for n = 0)."""
  return examples if not n else examples[: min(n, len(examples))]
