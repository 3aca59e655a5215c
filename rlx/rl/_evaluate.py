"""Greedy accuracy of a policy on a task split (the fraction of greedy completions solved)."""

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np


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
