"""The task interface: a dataset of prompts (train/dev/test) and a reward function.

A `Task` holds tokenized `Example`s per split and scores completions. The host
`reward` validates its inputs and outputs around a subclass's `score`; tasks
whose reward is expressible in JAX also set `jax_reward`, a pure function the
RL loop can run on device (and inside one jitted iteration), which must agree
with `reward` exactly.
"""

import abc
import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import numpy as np

SPLITS = ("train", "dev", "test")

JaxReward = Callable[[Any, Any, Any, Any], Any]
"""`jax_reward(answer_ids i32[N, A], answer_lengths i32[N], completion i32[N, T],
completion_lengths i32[N]) -> f32[N]`; `completion` is right-padded and
`completion_lengths` counts its tokens including a final stop token."""


class TokenizerLike(Protocol):
  """What a task needs from a tokenizer (`rlx.policy.Tokenizer` / `CharTokenizer`)."""

  vocab_size: int
  pad_id: int
  eos_id: int

  def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]: ...

  def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str: ...


def _int_tuple(value: Any, field: str) -> tuple[int, ...]:
  if isinstance(value, str | bytes):
    raise ValueError(
      f"Example.{field} must be a sequence of token ids, got {type(value).__name__}."
    )
  array = np.asarray(value)
  if array.size == 0:
    return ()
  if array.ndim != 1 or not np.issubdtype(array.dtype, np.integer):
    raise ValueError(
      f"Example.{field} must be a 1-D sequence of ints, got shape {array.shape} "
      f"dtype {array.dtype}."
    )
  return tuple(int(i) for i in array)


@dataclasses.dataclass(frozen=True)
class Example:
  """One prompt with its reference answer.

  Attributes:
    prompt_ids: the tokenized prompt, exactly what the sampler gets (chat
      template and BOS applied if the task uses them).
    answer: the reference answer the reward checks against.
    target_ids: the gold completion tokens INCLUDING the stop token, for a
      supervised warm-up; `()` when the task has no gold completion text.
    prompt_text: the human-readable prompt (for logs and plots).
  """

  prompt_ids: tuple[int, ...]
  answer: str
  target_ids: tuple[int, ...] = ()
  prompt_text: str = ""

  def __post_init__(self):
    object.__setattr__(self, "prompt_ids", _int_tuple(self.prompt_ids, "prompt_ids"))
    object.__setattr__(self, "target_ids", _int_tuple(self.target_ids, "target_ids"))
    if not self.prompt_ids:
      raise ValueError("Example.prompt_ids is empty.")
    if not isinstance(self.answer, str):
      raise ValueError(f"Example.answer must be a str, got {type(self.answer).__name__}.")
    if not isinstance(self.prompt_text, str):
      raise ValueError(f"Example.prompt_text must be a str, got {type(self.prompt_text).__name__}.")


class Task(abc.ABC):
  """A dataset of prompts per split plus a verifiable reward.

  Subclasses set the attributes below (usually in `__init__`) and implement
  `split` and `score`; `reward` wraps `score` with input/output checks, so
  override `score`, not `reward`. Set `jax_reward` when the reward can be
  written in JAX (it must equal `reward` exactly on every input).

  Attributes:
    name: the task's name, used in every error message.
    tokenizer: has `encode(str) -> list[int]`, `decode(ids) -> str`,
      `vocab_size`, `pad_id`, `eos_id`.
    stop_token_ids: tokens that end a completion (the sampler's stop set).
    max_prompt_len: the longest `prompt_ids` over all splits.
    max_answer_len: completions longer than this cannot be correct (a
      sensible `max_new_tokens`; includes the stop token).
    jax_reward: a `JaxReward` or None.
  """

  name: str
  tokenizer: Any
  stop_token_ids: tuple[int, ...]
  max_prompt_len: int
  max_answer_len: int
  jax_reward: JaxReward | None = None

  @abc.abstractmethod
  def split(self, name: str) -> Sequence[Example]:
    """The examples of split `name` ("train" | "dev" | "test")."""

  @abc.abstractmethod
  def score(self, examples: Sequence[Example], completions: list[list[int]]) -> Any:
    """Rewards f32[N] for validated, unpadded completions (called by `reward`)."""

  def reward(self, examples: Sequence[Example], completions: Sequence[Sequence[int]]) -> np.ndarray:
    """Host reward of each completion.

    Args:
      examples: N examples (from `split`).
      completions: N response token-id sequences WITHOUT padding (a stop token
        may be last), e.g. lists or 1-D integer arrays. A padded 2-D array is
        refused: use `reward_padded`. Ids at or above the tokenizer's
        `vocab_size` (a model's padded vocabulary rows) are allowed: they have
        no text, and no task's answer contains them.

    Returns:
      float32[N] rewards, checked finite.
    """
    examples = self._check_examples(examples)
    completions = self._check_completions(completions, len(examples))
    return self.check_rewards(self.score(examples, completions), len(examples))

  def correct(
    self, examples: Sequence[Example], completions: Sequence[Sequence[int]]
  ) -> np.ndarray:
    """What accuracy averages: 1.0 for a solved completion, 0.0 otherwise.

    Defaults to `reward` (an exact-match task's reward already is this). A
    task with a graded reward overrides it, so that the greedy accuracy
    (`rlx.rl.greedy_accuracy`) stays the fraction solved. Same inputs and
    output as `reward`.
    """
    return self.reward(examples, completions)

  def reward_padded(
    self, examples: Sequence[Example], completion, completion_lengths
  ) -> np.ndarray:
    """`reward` for right-padded completions, the same inputs as `jax_reward`.

    Args:
      examples: N examples.
      completion: i32[N, T] right-padded response tokens.
      completion_lengths: i32[N] tokens of each row (including a final stop
        token), each in [0, T].

    Returns:
      float32[N] rewards.
    """
    completion = np.asarray(completion)
    lengths = np.asarray(completion_lengths)
    if completion.ndim != 2 or not np.issubdtype(completion.dtype, np.integer):
      raise ValueError(
        f"Task {self.name!r}: `completion` must be an integer array [N, T], got shape "
        f"{completion.shape} dtype {completion.dtype}."
      )
    if lengths.shape != (completion.shape[0],) or not np.issubdtype(lengths.dtype, np.integer):
      raise ValueError(
        f"Task {self.name!r}: `completion_lengths` must be integers of shape "
        f"({completion.shape[0]},), got shape {lengths.shape} dtype {lengths.dtype}."
      )
    if np.any(lengths < 0) or np.any(lengths > completion.shape[1]):
      raise ValueError(
        f"Task {self.name!r}: `completion_lengths` must lie in [0, {completion.shape[1]}], got "
        f"{lengths.tolist()}."
      )
    rows = [completion[i, : int(n)].tolist() for i, n in enumerate(lengths)]
    return self.reward(examples, rows)

  def answer_arrays(
    self, examples: Sequence[Example], *, length: int | None = None
  ) -> tuple[np.ndarray, np.ndarray]:
    """The reference answers as token arrays, the first inputs of `jax_reward`.

    Args:
      examples: N examples.
      length: A, the padded width; default `max_answer_len` (one static shape
        for every batch of the task). An answer longer than A is an error.

    Returns:
      (answer_ids i32[N, A] right-padded with `pad_id`, answer_lengths i32[N]).
    """
    examples = self._check_examples(examples)
    width = self.max_answer_len if length is None else length
    if not isinstance(width, int | np.integer) or width < 1:
      raise ValueError(f"Task {self.name!r}: `length` must be a positive int, got {width!r}.")
    ids = np.full((len(examples), int(width)), self.tokenizer.pad_id, np.int32)
    lengths = np.zeros((len(examples),), np.int32)
    for i, example in enumerate(examples):
      tokens = self.answer_tokens(example)
      if len(tokens) > width:
        raise ValueError(
          f"Task {self.name!r}: answer {example.answer!r} has {len(tokens)} tokens, more than "
          f"`length`={width}; nothing is truncated silently."
        )
      ids[i, : len(tokens)] = tokens
      lengths[i] = len(tokens)
    return ids, lengths

  def answer_tokens(self, example: Example) -> list[int]:
    """Token ids of `example.answer` as compared by `jax_reward` (no stop token)."""
    return self.tokenizer.encode(example.answer)

  def check_rewards(self, rewards: Any, num: int) -> np.ndarray:
    """`rewards` as float32[num], or a ValueError naming the task (wrong shape, NaN/inf)."""
    try:
      array = np.asarray(rewards, dtype=np.float32)
    except (TypeError, ValueError) as e:
      raise ValueError(
        f"Task {self.name!r}: rewards must be numbers, got {type(rewards).__name__}: {e}"
      ) from e
    if array.shape != (num,):
      raise ValueError(
        f"Task {self.name!r}: rewards must have shape ({num},), one per completion, got shape "
        f"{array.shape}."
      )
    bad = np.flatnonzero(~np.isfinite(array))
    if bad.size:
      raise ValueError(
        f"Task {self.name!r}: rewards must be finite; entries {bad[:8].tolist()} are "
        f"{array[bad[:8]].tolist()}."
      )
    return array

  def _check_examples(self, examples: Sequence[Example]) -> Sequence[Example]:
    if isinstance(examples, Example) or not isinstance(examples, Sequence):
      raise ValueError(
        f"Task {self.name!r}: `examples` must be a sequence of Example, got "
        f"{type(examples).__name__}."
      )
    for i, example in enumerate(examples):
      if not isinstance(example, Example):
        raise ValueError(
          f"Task {self.name!r}: examples[{i}] must be an Example, got {type(example).__name__}."
        )
    return examples

  def _check_completions(self, completions: Any, num: int) -> list[list[int]]:
    name = self.name
    if isinstance(completions, str | bytes) or not (
      isinstance(completions, Sequence) or _is_array(completions)
    ):
      raise ValueError(
        f"Task {name!r}: `completions` must be a sequence of token-id sequences, got "
        f"{type(completions).__name__}."
      )
    if _is_array(completions) and completions.ndim != 1:
      raise ValueError(
        f"Task {name!r}: `completions` is a padded array of shape {completions.shape}; pass "
        "unpadded token-id lists, or use `reward_padded(examples, completion, lengths)`."
      )
    if len(completions) != num:
      raise ValueError(
        f"Task {name!r}: got {len(completions)} completions for {num} examples; expected one "
        "completion per example."
      )
    out = []
    for i, completion in enumerate(completions):
      if isinstance(completion, str | bytes):
        raise ValueError(
          f"Task {name!r}: completions[{i}] is a {type(completion).__name__}; completions are "
          "token ids (decode happens inside the task)."
        )
      if not (isinstance(completion, Sequence) or _is_array(completion)):
        raise ValueError(
          f"Task {name!r}: completions[{i}] must be a sequence of token ids, got "
          f"{type(completion).__name__}."
        )
      array = np.asarray(completion)
      if array.size and (array.ndim != 1 or not np.issubdtype(array.dtype, np.integer)):
        raise ValueError(
          f"Task {name!r}: completions[{i}] must be a 1-D sequence of ints, got shape "
          f"{array.shape} dtype {array.dtype}."
        )
      tokens = array.reshape(-1).tolist()
      negative = [t for t in tokens if t < 0]
      if negative:
        raise ValueError(f"Task {name!r}: completions[{i}] has negative token ids {negative[:8]}.")
      out.append(tokens)
    return out


def _is_array(value: Any) -> bool:
  """numpy, JAX and other arrays (anything with `__array__` and `ndim`)."""
  return hasattr(value, "__array__") and hasattr(value, "ndim")


def check_split_name(task_name: str, split: Any, available: Mapping[str, Any]) -> None:
  """Raises a ValueError naming the task when `split` is not a key of `available`."""
  if not isinstance(split, str) or split not in available:
    raise ValueError(
      f"Task {task_name!r} has no split {split!r}; available splits: {list(available)}."
    )
