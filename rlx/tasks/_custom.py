"""Custom tasks from in-memory examples and a Python reward function."""

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from rlx.tasks._base import SPLITS, Example, JaxReward, Task, check_split_name
from rlx.tasks._prompts import (
  decode_completion,
  encode_prompt,
  encode_text,
  resolve_tokenizer,
  stop_ids,
)

RewardFn = Callable[[str, str], float]
"""`reward_fn(completion_text, answer) -> float`, like verl's
`compute_score(solution_str, ground_truth)`."""


class _ExamplesTask(Task):
  """A `Task` over given examples whose reward is `reward_fn` on decoded text."""

  def __init__(
    self,
    name: str,
    splits: Mapping[str, tuple[Example, ...]],
    reward_fn: RewardFn,
    tokenizer: Any,
    stop_token_ids: tuple[int, ...],
    max_answer_len: int,
    jax_reward: JaxReward | None,
  ):
    self.name = name
    self._splits = dict(splits)
    self._reward_fn = reward_fn
    self.tokenizer = tokenizer
    self.stop_token_ids = stop_token_ids
    self.max_answer_len = max_answer_len
    self.max_prompt_len = max(len(e.prompt_ids) for s in self._splits.values() for e in s)
    self.jax_reward = jax_reward

  def split(self, name: str) -> Sequence[Example]:
    check_split_name(self.name, name, self._splits)
    return self._splits[name]

  def score(self, examples: Sequence[Example], completions: list[list[int]]) -> np.ndarray:
    out = []
    for i, (example, completion) in enumerate(zip(examples, completions, strict=True)):
      value = self._reward_fn(decode_completion(self.tokenizer, completion), example.answer)
      if isinstance(value, bool) or not isinstance(value, int | float | np.number):
        raise ValueError(
          f"Task {self.name!r}: reward_fn must return a float, got {type(value).__name__} "
          f"for completion {i}."
        )
      out.append(float(value))
    return np.asarray(out, np.float32)


def _example(
  record: Any,
  index: int,
  split: str,
  *,
  name: str,
  tokenizer: Any,
  chat_template: bool,
  system_prompt: str | None,
  chat_template_kwargs: Mapping[str, Any] | None,
) -> Example:
  if isinstance(record, Example):
    return record
  if not isinstance(record, Mapping):
    raise ValueError(
      f"Task {name!r}: examples[{split!r}][{index}] must be an Example or a mapping with "
      f"'prompt' and 'answer', got {type(record).__name__}."
    )
  for field in ("prompt", "answer"):
    if field not in record:
      raise ValueError(
        f"Task {name!r}: field {field!r} is missing from examples[{split!r}][{index}] "
        f"(its fields are {sorted(record)})."
      )
    if not isinstance(record[field], str):
      raise ValueError(
        f"Task {name!r}: field {field!r} of examples[{split!r}][{index}] must be a str, got "
        f"{type(record[field]).__name__}."
      )
  prompt_ids, text = encode_prompt(
    tokenizer,
    record["prompt"],
    chat_template=chat_template,
    system_prompt=system_prompt,
    chat_template_kwargs=chat_template_kwargs,
    task=name,
  )
  target = record.get("target")
  if target is not None and not isinstance(target, str):
    raise ValueError(
      f"Task {name!r}: field 'target' of examples[{split!r}][{index}] must be a str, got "
      f"{type(target).__name__}."
    )
  if target is None:
    target_ids = ()
  else:
    target_ids = (*encode_text(tokenizer, target, name, add_special_tokens=False), tokenizer.eos_id)
  return Example(prompt_ids, record["answer"], target_ids, text)


def task_from_examples(
  name: str,
  examples: Mapping[str, Sequence[Mapping[str, str] | Example]],
  reward_fn: RewardFn,
  tokenizer: Any,
  *,
  max_answer_len: int | None = None,
  chat_template: bool = False,
  system_prompt: str | None = None,
  chat_template_kwargs: Mapping[str, Any] | None = None,
  stop_token_ids: Sequence[int] | None = None,
  jax_reward: JaxReward | None = None,
) -> Task:
  """A `Task` from examples per split and a reward on decoded completion text.

  Args:
    name: the task name (in every error message).
    examples: split name ("train" / "dev" / "test", "train" required) ->
      records, each a mapping with "prompt" and "answer" strings and an
      optional "target" (the gold completion text, without the stop token),
      or a ready `Example`.
    reward_fn: `reward_fn(completion_text, answer) -> float`; the completion is
      decoded with special tokens (the stop token) removed.
    tokenizer: a tokenizer object (`rlx.policy.Tokenizer` / `CharTokenizer`)
      or an HF checkpoint / tokenizer path.
    max_answer_len: the completion token budget; default the longest target
      (required when no record has a target).
    chat_template: render prompts with the tokenizer's chat template
      (otherwise the prompt text is tokenized with special tokens, e.g. BOS).
    system_prompt: a system message (chat) or a prefix line (plain).
    chat_template_kwargs: extra chat-template variables.
    stop_token_ids: default the tokenizer's `eos_ids` (or `eos_id`).
    jax_reward: an optional JAX version of the reward (must equal it; e.g.
      `exact_match_jax_reward(stop_ids)` for a token exact match).

  Returns:
    The task; `reward` validates shapes and finiteness of `reward_fn`'s values.
  """
  if not isinstance(name, str) or not name:
    raise ValueError(f"Task name must be a non-empty str, got {name!r}.")
  if not callable(reward_fn):
    raise ValueError(f"Task {name!r}: reward_fn must be callable, got {type(reward_fn).__name__}.")
  if not isinstance(examples, Mapping):
    raise ValueError(
      f"Task {name!r}: `examples` must map split names {SPLITS} to records, got "
      f"{type(examples).__name__}."
    )
  unknown = [s for s in examples if s not in SPLITS]
  if unknown:
    raise ValueError(f"Task {name!r}: unknown split names {unknown}; expected some of {SPLITS}.")
  if "train" not in examples:
    raise ValueError(f"Task {name!r}: `examples` has no 'train' split.")
  tokenizer = resolve_tokenizer(tokenizer, name)
  splits = {}
  for split, records in examples.items():
    if isinstance(records, str | Mapping) or not isinstance(records, Sequence):
      raise ValueError(
        f"Task {name!r}: examples[{split!r}] must be a sequence of records, got "
        f"{type(records).__name__}."
      )
    if not records:
      raise ValueError(f"Task {name!r}: split {split!r} is empty.")
    splits[split] = tuple(
      _example(
        r,
        i,
        split,
        name=name,
        tokenizer=tokenizer,
        chat_template=chat_template,
        system_prompt=system_prompt,
        chat_template_kwargs=chat_template_kwargs,
      )
      for i, r in enumerate(records)
    )
  if max_answer_len is None:
    lengths = [len(e.target_ids) for s in splits.values() for e in s if e.target_ids]
    if not lengths:
      raise ValueError(
        f"Task {name!r}: no record has a 'target', so pass `max_answer_len` (the completion "
        "token budget)."
      )
    max_answer_len = max(lengths)
  if not isinstance(max_answer_len, int) or max_answer_len < 1:
    raise ValueError(
      f"Task {name!r}: `max_answer_len` must be an int >= 1, got {max_answer_len!r}."
    )
  stops = stop_ids(tokenizer) if stop_token_ids is None else tuple(int(s) for s in stop_token_ids)
  if not stops:
    raise ValueError(f"Task {name!r}: `stop_token_ids` is empty.")
  if jax_reward is not None and not callable(jax_reward):
    raise ValueError(f"Task {name!r}: jax_reward must be callable or None.")
  return _ExamplesTask(name, splits, reward_fn, tokenizer, stops, max_answer_len, jax_reward)
