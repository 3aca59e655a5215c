"""`PromptSource`: a seeded, resumable stream of example batches from a split."""

from collections.abc import Sequence
from typing import Any

import numpy as np


class PromptSource:
  """Batches of examples in a fresh seeded permutation every epoch.

  The position is the JSON-serialisable `cursor` ({"epoch", "index"});
  `PromptSource(..., cursor=c)` continues exactly where a source with cursor
  `c` stopped. A batch that crosses an epoch boundary takes the rest of the
  epoch and the start of the next one (no example is skipped).
  """

  def __init__(
    self,
    examples: Sequence[Any],
    *,
    batch_size: int,
    seed: int,
    cursor: dict | None = None,
  ):
    if not len(examples):
      raise ValueError("`examples` is empty: no prompts to draw from.")
    if batch_size < 1:
      raise ValueError(f"`batch_size` must be >= 1, got {batch_size}.")
    self.examples = examples
    self.batch_size = int(batch_size)
    self.seed = int(seed)
    cursor = cursor or {"epoch": 0, "index": 0}
    self.epoch = int(cursor["epoch"])
    self.index = int(cursor["index"])
    self._order = self._permutation(self.epoch)

  def _permutation(self, epoch: int) -> np.ndarray:
    return np.random.default_rng([self.seed, epoch]).permutation(len(self.examples))

  @property
  def cursor(self) -> dict:
    return {"epoch": self.epoch, "index": self.index}

  def next_batch(self) -> list[Any]:
    """The next `batch_size` examples."""
    out = []
    while len(out) < self.batch_size:
      if self.index == len(self.examples):
        self.epoch += 1
        self.index = 0
        self._order = self._permutation(self.epoch)
      take = min(self.batch_size - len(out), len(self.examples) - self.index)
      out.extend(self.examples[int(i)] for i in self._order[self.index : self.index + take])
      self.index += take
    return out
