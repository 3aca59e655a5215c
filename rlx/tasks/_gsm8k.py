"""GSM8K-format math word problems for real (HF) models, from JSONL or Parquet.

Each record has a question and a reference solution whose final answer is
marked "#### 42" (GSM8K, Cobbe et al. 2021, https://arxiv.org/abs/2110.14168)
or `\\boxed{42}`, or is a bare number. The prompt is the question plus an
instruction, rendered with the checkpoint's chat template; the reward is
numeric agreement of the completion's extracted final answer with the
reference (see `extract_answer` for the extraction order), plus an optional
format term. Prompts and the reward follow verl's GSM8K recipe
(examples/data_preprocess/gsm8k.py, verl/utils/reward_score/gsm8k.py).

Splits: "train" from `train_path` (shuffled by `seed`); "dev" from `dev_path`
or, when it is None, `dev_size` records drawn from the training file by
`seed`; "test" from `test_path` or, when it is None, `test_size` records drawn
likewise. Drawn records leave the training split, so splits never share a row.
"""

import os
import re
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from rlx.tasks._base import Example, Task, check_split_name
from rlx.tasks._data import load_records
from rlx.tasks._math_answers import ANSWER_SOURCES, extract_answer, numbers_match, parse_number
from rlx.tasks._prompts import (
  decode_completion,
  encode_prompt,
  encode_text,
  resolve_tokenizer,
  stop_ids,
)

INSTRUCTIONS = {
  "####": 'Let\'s think step by step and output the final answer after "####".',
  "boxed": "Please reason step by step, and put your final answer within \\boxed{}.",
}
"""The instruction appended to each question, per `answer_format` (verl's GSM8K
prompt; the Qwen2.5-Math / DeepSeek-R1 boxed prompt)."""

_CALCULATOR = re.compile(r"<<[^<>]*>>")


def reference_answer(solution: str) -> str | None:
  """The final answer of a reference solution: "#### x", else `\\boxed{x}`, else a bare number."""
  found = extract_answer(solution, sources=("####", "boxed"))
  if found is not None:
    return found.text
  value = parse_number(solution)
  return None if value is None else solution.strip()


class GSM8KTask(Task):
  """GSM8K-format math from JSONL or Parquet files, numeric-answer reward.

  Args:
    tokenizer: an `rlx.policy.Tokenizer` (or anything with its interface), or
      the path of an HF checkpoint / tokenizer directory.
    train_path: the training file (.jsonl / .json / .parquet).
    dev_path, test_path: files for "dev" / "test", or None to draw
      `dev_size` / `test_size` records from the training file.
    dev_size, test_size: records drawn from the training file when the
      corresponding path is None (0 leaves that split empty).
    question_field, answer_field: the record keys of the question and the
      reference solution (or bare answer).
    prompt_template: the user message, with "{question}" where the question
      goes; default the question plus `INSTRUCTIONS[answer_format]`.
    system_prompt: an optional system message.
    chat_template: apply the tokenizer's chat template (None: when it has one).
    chat_template_kwargs: extra template variables (e.g. `enable_thinking`).
    answer_format: the expected final-answer format, "####" or "boxed".
    strict: only an answer in `answer_format` counts (no fallback to the
      other marker or the last number).
    format_reward: added to the reward when the completion states its answer
      in `answer_format` (right or wrong); 0 disables it.
    rtol, atol: the numeric tolerance of `numbers_match`.
    max_answer_len: completion token budget (sampler `max_new_tokens`).
    max_prompt_len: if set, a prompt longer than this is an error (nothing is
      dropped silently).
    strip_calculator_annotations: drop GSM8K's "<<48/2=24>>" from gold targets.
    seed: seeds the shuffle of train and the draw of dev/test.
    name: the task name in messages.
  """

  def __init__(
    self,
    *,
    tokenizer: Any,
    train_path: str | os.PathLike,
    dev_path: str | os.PathLike | None = None,
    test_path: str | os.PathLike | None = None,
    dev_size: int = 200,
    test_size: int = 500,
    question_field: str = "question",
    answer_field: str = "answer",
    prompt_template: str | None = None,
    system_prompt: str | None = None,
    chat_template: bool | None = None,
    chat_template_kwargs: Mapping[str, Any] | None = None,
    answer_format: str = "####",
    strict: bool = False,
    format_reward: float = 0.0,
    rtol: float = 1e-6,
    atol: float = 1e-9,
    max_answer_len: int = 512,
    max_prompt_len: int | None = None,
    strip_calculator_annotations: bool = True,
    seed: int = 0,
    name: str = "gsm8k",
  ):
    self.name = name
    if answer_format not in INSTRUCTIONS:
      raise ValueError(
        f"Task {name!r}: `answer_format` must be one of {list(INSTRUCTIONS)}, got "
        f"{answer_format!r}."
      )
    if prompt_template is None:
      prompt_template = "{question} " + INSTRUCTIONS[answer_format]
    if not isinstance(prompt_template, str) or "{question}" not in prompt_template:
      raise ValueError(
        f"Task {name!r}: `prompt_template` must be a str containing '{{question}}', got "
        f"{prompt_template!r}."
      )
    if not isinstance(max_answer_len, int) or max_answer_len < 1:
      raise ValueError(
        f"Task {name!r}: `max_answer_len` must be an int >= 1, got {max_answer_len!r}."
      )
    if not np.isfinite(format_reward):
      raise ValueError(f"Task {name!r}: `format_reward` must be finite, got {format_reward}.")
    for label, size in (("dev_size", dev_size), ("test_size", test_size)):
      if not isinstance(size, int) or size < 0:
        raise ValueError(f"Task {name!r}: `{label}` must be an int >= 0, got {size!r}.")
    if not (rtol >= 0 and atol >= 0):
      raise ValueError(f"Task {name!r}: `rtol` and `atol` must be >= 0, got {rtol=} {atol=}.")
    self.tokenizer = resolve_tokenizer(tokenizer, name)
    self.stop_token_ids = stop_ids(self.tokenizer)
    self.max_answer_len = max_answer_len
    self.jax_reward = None
    self.answer_format = answer_format
    self.format_reward = float(format_reward)
    self.rtol, self.atol = rtol, atol
    self.sources = (answer_format,) if strict else ANSWER_SOURCES
    self._format_source = answer_format
    self._prompt = dict(
      template=prompt_template,
      system_prompt=system_prompt,
      chat_template=chat_template,
      chat_template_kwargs=chat_template_kwargs,
    )
    self._strip = strip_calculator_annotations
    self._fields = (question_field, answer_field)

    rng = np.random.default_rng(seed)
    train = self._load(train_path)
    drawn = {}
    for split, path, size in (("dev", dev_path, dev_size), ("test", test_path, test_size)):
      if path is not None:
        drawn[split] = self._load(path)
        continue
      if size >= len(train):
        raise ValueError(
          f"Task {name!r}: cannot draw {split}_size={size} records from the {len(train)} of "
          f"{os.fspath(train_path)} and keep a training split; pass a smaller size or a "
          f"{split}_path."
        )
      picked = set(rng.choice(len(train), size=size, replace=False).tolist())
      drawn[split] = [r for i, r in enumerate(train) if i in picked]
      train = [r for i, r in enumerate(train) if i not in picked]
    order = rng.permutation(len(train))
    self._splits = {
      "train": tuple(train[i] for i in order),
      "dev": tuple(drawn["dev"]),
      "test": tuple(drawn["test"]),
    }
    every = [e for split in self._splits.values() for e in split]
    self.max_prompt_len = max(len(e.prompt_ids) for e in every)
    if max_prompt_len is not None and self.max_prompt_len > max_prompt_len:
      long = next(e for e in every if len(e.prompt_ids) > max_prompt_len)
      raise ValueError(
        f"Task {name!r}: a prompt has {len(long.prompt_ids)} tokens, more than "
        f"max_prompt_len={max_prompt_len}: {long.prompt_text[:200]!r}"
      )

  def _load(self, path: str | os.PathLike) -> list[Example]:
    question_field, answer_field = self._fields
    records = load_records(path, self._fields, task=self.name)
    examples = []
    for row, record in enumerate(records, start=1):
      question, solution = record[question_field], record[answer_field]
      if not isinstance(question, str) or not question.strip():
        raise ValueError(
          f"Task {self.name!r}: field {question_field!r} of record {row} of {os.fspath(path)} "
          f"must be a non-empty str, got {question!r}."
        )
      if isinstance(solution, int | float) and not isinstance(solution, bool):
        solution = str(solution)
      if not isinstance(solution, str):
        raise ValueError(
          f"Task {self.name!r}: field {answer_field!r} of record {row} of {os.fspath(path)} "
          f"must be a str or a number, got {type(solution).__name__}."
        )
      answer = reference_answer(solution)
      if answer is None:
        raise ValueError(
          f"Task {self.name!r}: field {answer_field!r} of record {row} of {os.fspath(path)} "
          f"has no final answer ('#### x', '\\boxed{{x}}' or a bare number): {solution[-200:]!r}"
        )
      examples.append(self._example(question, solution, answer))
    return examples

  def _example(self, question: str, solution: str, answer: str) -> Example:
    content = self._prompt["template"].replace("{question}", question)
    prompt_ids, text = encode_prompt(
      self.tokenizer,
      content,
      chat_template=self._prompt["chat_template"],
      system_prompt=self._prompt["system_prompt"],
      chat_template_kwargs=self._prompt["chat_template_kwargs"],
      task=self.name,
    )
    target = solution.strip()
    if self._strip:
      target = _CALCULATOR.sub("", target)
    if self.answer_format == "boxed" and "####" in target:
      head, tail = target.rsplit("####", 1)
      target = f"{head.rstrip()}\nThe final answer is \\boxed{{{tail.strip()}}}."
    elif self.answer_format == "####" and "####" not in target:
      target = f"{target}\n#### {answer}" if target != answer else f"#### {answer}"
    target_ids = (
      *encode_text(self.tokenizer, target, self.name, add_special_tokens=False),
      self.tokenizer.eos_id,
    )
    return Example(prompt_ids=prompt_ids, answer=answer, target_ids=target_ids, prompt_text=text)

  def split(self, name: str) -> Sequence[Example]:
    """The examples of "train", "dev" or "test"."""
    check_split_name(self.name, name, self._splits)
    return self._splits[name]

  def score(self, examples: Sequence[Example], completions: list[list[int]]) -> np.ndarray:
    """1 if the extracted answer equals the reference (numerically), + `format_reward`."""
    out = np.zeros((len(examples),), np.float32)
    for i, (example, completion) in enumerate(zip(examples, completions, strict=True)):
      text = decode_completion(self.tokenizer, completion)
      found = extract_answer(text, sources=self.sources)
      correct = found is not None and numbers_match(
        found.value, example.answer, rtol=self.rtol, atol=self.atol
      )
      formatted = (
        self.format_reward != 0.0
        and extract_answer(text, sources=(self._format_source,)) is not None
      )
      out[i] = float(correct) + (self.format_reward if formatted else 0.0)
    return out
