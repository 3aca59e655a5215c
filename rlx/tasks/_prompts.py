"""Prompt tokenization shared by the file-backed and custom tasks."""

import os
from collections.abc import Mapping
from typing import Any

from rlx.policy import Tokenizer


def resolve_tokenizer(tokenizer: Any, task: str) -> Any:
  """`tokenizer` itself, or `rlx.policy.Tokenizer(path)` for a checkpoint / tokenizer path."""
  if isinstance(tokenizer, str | os.PathLike):
    return Tokenizer(tokenizer)
  missing = [
    a for a in ("encode", "decode", "vocab_size", "pad_id", "eos_id") if not hasattr(tokenizer, a)
  ]
  if missing:
    raise ValueError(
      f"Task {task!r}: `tokenizer` must be a path or a tokenizer with encode/decode/vocab_size/"
      f"pad_id/eos_id (e.g. rlx.policy.Tokenizer), got {type(tokenizer).__name__} "
      f"lacking {missing}."
    )
  return tokenizer


def stop_ids(tokenizer: Any) -> tuple[int, ...]:
  """The tokenizer's stop set: `eos_ids` when it has them (HF generation config), else eos."""
  ids = getattr(tokenizer, "eos_ids", None) or (tokenizer.eos_id,)
  return tuple(int(i) for i in ids)


def encode_prompt(
  tokenizer: Any,
  content: str,
  *,
  chat_template: bool | None,
  system_prompt: str | None,
  chat_template_kwargs: Mapping[str, Any] | None,
  task: str,
) -> tuple[tuple[int, ...], str]:
  """Token ids and text of one prompt.

  With a chat template (`chat_template=True`, or None and the tokenizer has
  one) the prompt is the template rendered over `[system?, user]` with the
  generation prompt, tokenized WITHOUT extra special tokens (the template
  writes them), as HF `apply_chat_template(tokenize=True)` does; otherwise the
  raw text tokenized with special tokens (e.g. BOS).
  """
  has_template = bool(getattr(tokenizer, "has_chat_template", False))
  use_template = has_template if chat_template is None else bool(chat_template)
  if use_template:
    if not has_template:
      raise ValueError(f"Task {task!r}: chat_template=True but the tokenizer has no chat template.")
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    messages.append({"role": "user", "content": content})
    text = tokenizer.apply_chat_template(
      messages, add_generation_prompt=True, **dict(chat_template_kwargs or {})
    )
    ids = encode_text(tokenizer, text, task, add_special_tokens=False)
  else:
    text = f"{system_prompt}\n\n{content}" if system_prompt else content
    ids = encode_text(tokenizer, text, task, add_special_tokens=True)
  if not ids:
    raise ValueError(f"Task {task!r}: the prompt {text!r} has no tokens.")
  return tuple(int(i) for i in ids), text


def encode_text(tokenizer: Any, text: str, task: str, *, add_special_tokens: bool) -> list[int]:
  """`tokenizer.encode(text)`, its errors re-raised naming the task and the text."""
  try:
    return tokenizer.encode(text, add_special_tokens=add_special_tokens)
  except ValueError as e:
    raise ValueError(f"Task {task!r}: cannot tokenize {text[:120]!r}: {e}") from e


def decode_completion(tokenizer: Any, completion: list[int]) -> str:
  """Text of a completion; ids at or above `vocab_size` (padded model rows) have no text."""
  vocab = tokenizer.vocab_size
  return tokenizer.decode([t for t in completion if t < vocab], skip_special_tokens=True)
