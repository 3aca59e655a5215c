"""Tokenizers with one interface: `Tokenizer` (HF `tokenizers`) and `CharTokenizer`.

Shared interface:
  vocab_size, pad_id, eos_id, bos_id (int | None), eos_ids (tuple of stop ids)
  encode(text, *, add_special_tokens=False) -> list[int]
  decode(ids, *, skip_special_tokens=True) -> str
  encode_batch(texts, ...) -> list[list[int]];  decode_batch(batch, ...) -> list[str]
  pad(sequences, *, length=None) -> (ids i32[B, L], mask i32[B, L])  (right padding)
  apply_chat_template(messages, *, add_generation_prompt=True, **kwargs) -> str
  has_chat_template

Chat templates are the checkpoint's Jinja template rendered with `jinja2` in a
sandbox, with the same globals HF transformers provides (`raise_exception`,
`strftime_now`, `bos_token`, `eos_token`, ...).
"""

import abc
import datetime
import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import tokenizers


def _token_content(value: Any) -> str | None:
  if value is None:
    return None
  if isinstance(value, Mapping):
    return value.get("content")
  return str(value)


def _token_ids(ids: Any, name: str) -> list[int]:
  """`ids` (a 1-D sequence or array of integers) as a list of Python ints.

  Floats, bools, strings and nested sequences are a ValueError naming `name`:
  `int(1.5)` would silently truncate.
  """
  if isinstance(ids, str | bytes | Mapping) or not hasattr(ids, "__len__"):
    raise ValueError(f"`{name}` must be a 1-D sequence of int token ids, got {ids!r:.80}.")
  array = np.asarray(ids) if not isinstance(ids, list | tuple) else None
  if array is not None:
    if array.ndim != 1:
      raise ValueError(f"`{name}` must be 1-D token ids, got an array of shape {array.shape}.")
    if array.size and not np.issubdtype(array.dtype, np.integer):
      raise ValueError(f"`{name}` must hold int token ids, got dtype {array.dtype}.")
    return [int(i) for i in array]
  out = []
  for k, i in enumerate(ids):
    if isinstance(i, bool | np.bool_) or not isinstance(i, int | np.integer):
      raise ValueError(f"`{name}` must hold int token ids, got {i!r:.40} at index {k}.")
    out.append(int(i))
  return out


def _pad(sequences: Sequence[Sequence[int]], pad_id: int, length: int | None):
  if isinstance(sequences, str | bytes) or not isinstance(sequences, Sequence | np.ndarray):
    raise ValueError(f"`sequences` must be a list of token-id lists, got {sequences!r:.80}.")
  if len(sequences) == 0:
    raise ValueError("`sequences` must hold at least one sequence (B >= 1), got none.")
  if length is not None and (
    isinstance(length, bool) or not isinstance(length, int | np.integer) or length < 0
  ):
    raise ValueError(f"`length` must be None or an int >= 0, got {length!r}.")
  sequences = [_token_ids(s, f"sequences[{i}]") for i, s in enumerate(sequences)]
  lengths = [len(s) for s in sequences]
  longest = max(lengths, default=0)
  if length is None:
    length = longest
  elif longest > length:
    too_long = [i for i, n in enumerate(lengths) if n > length]
    raise ValueError(
      f"`length`={length} is shorter than sequences {too_long} (longest {longest}); "
      "nothing is truncated silently."
    )
  ids = np.full((len(sequences), length), pad_id, np.int32)
  mask = np.zeros((len(sequences), length), np.int32)
  for i, seq in enumerate(sequences):
    ids[i, : len(seq)] = np.asarray(seq, np.int32)
    mask[i, : len(seq)] = 1
  return ids, mask


class _Base(abc.ABC):
  """Methods shared by both tokenizers (subclasses provide encode/decode/ids)."""

  pad_id: int
  eos_id: int

  @abc.abstractmethod
  def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
    """Token ids of `text`."""

  @abc.abstractmethod
  def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
    """Text of `ids`."""

  def encode_batch(
    self, texts: Sequence[str], *, add_special_tokens: bool = False
  ) -> list[list[int]]:
    """`[encode(t) for t in texts]`."""
    if isinstance(texts, str):
      raise ValueError("`texts` must be a sequence of strings, got a single str.")
    if not isinstance(texts, Sequence):
      raise ValueError(f"`texts` must be a sequence of strings, got {type(texts).__name__}.")
    return [self.encode(t, add_special_tokens=add_special_tokens) for t in texts]

  def decode_batch(
    self, batch: Sequence[Sequence[int]], *, skip_special_tokens: bool = True
  ) -> list[str]:
    """`[decode(ids) for ids in batch]` (rows of an array are accepted)."""
    flat = hasattr(batch, "__len__") and len(batch) and np.isscalar(batch[0])
    if isinstance(batch, str | bytes) or not hasattr(batch, "__len__") or flat:
      raise ValueError(
        "`batch` must be a sequence of token-id sequences (use `decode` for one), got "
        f"{batch!r:.80}."
      )
    return [
      self.decode(_token_ids(ids, f"batch[{i}]"), skip_special_tokens=skip_special_tokens)
      for i, ids in enumerate(batch)
    ]

  def pad(
    self, sequences: Sequence[Sequence[int]], *, length: int | None = None
  ) -> tuple[np.ndarray, np.ndarray]:
    """Right-pads id lists with `pad_id`.

    Args:
      sequences: B lists of token ids.
      length: L, padded length; default the longest sequence. A sequence
        longer than `length` is an error (never truncated).

    Returns:
      (ids i32[B, L], mask i32[B, L]) with mask 1 on real tokens.
    """
    return _pad(sequences, self.pad_id, length)


def _check_messages(messages: Any) -> list[Mapping[str, Any]]:
  """`messages` as a list of dicts with a str "role" each, else a ValueError naming it."""
  if isinstance(messages, str | bytes | Mapping) or not isinstance(messages, Sequence):
    raise ValueError(
      f"`messages` must be a list of {{'role': ..., 'content': ...}} dicts, got {messages!r:.80}."
    )
  for i, m in enumerate(messages):
    if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
      raise ValueError(f"`messages[{i}]` must be a dict with a str 'role', got {m!r:.80}.")
  return list(messages)


def _render_chat_template(template: str, messages: Any, **context: Any) -> str:
  import jinja2
  from jinja2.sandbox import ImmutableSandboxedEnvironment

  def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)

  def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(
      x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )

  def strftime_now(fmt):
    return datetime.datetime.now().strftime(fmt)

  env = ImmutableSandboxedEnvironment(
    trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
  )
  env.filters["tojson"] = tojson
  env.globals["raise_exception"] = raise_exception
  env.globals["strftime_now"] = strftime_now
  return env.from_string(template).render(messages=messages, **context)


class Tokenizer(_Base):
  """A Hugging Face tokenizer directory (tokenizer.json + tokenizer_config.json).

  Special tokens come from tokenizer_config.json (`bos_token`, `eos_token`,
  `pad_token`) with generation_config.json's `eos_token_id` added to
  `eos_ids`; `pad_id` falls back to `eos_id` when the tokenizer has no pad
  token (Llama 3). The chat template is tokenizer_config.json's
  `chat_template` or a `chat_template.jinja` file.
  """

  def __init__(self, path: str | os.PathLike):
    if not isinstance(path, str | os.PathLike):
      raise ValueError(f"`path` must be a str or os.PathLike, got {path!r}.")
    path = os.fspath(path)
    file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
    if not os.path.exists(file):
      raise ValueError(f"No tokenizer.json at {path}.")
    directory = os.path.dirname(file)
    self._tok = tokenizers.Tokenizer.from_file(file)
    cfg: dict[str, Any] = {}
    cfg_file = os.path.join(directory, "tokenizer_config.json")
    if os.path.exists(cfg_file):
      with open(cfg_file) as f:
        cfg = json.load(f)
    self.bos_token = _token_content(cfg.get("bos_token"))
    self.eos_token = _token_content(cfg.get("eos_token"))
    self.pad_token = _token_content(cfg.get("pad_token"))
    if self.eos_token is None:
      raise ValueError(f"tokenizer_config.json in {directory} defines no eos_token.")
    self.eos_id = self._token_id(self.eos_token, "eos_token")
    self.bos_id = self._token_id(self.bos_token, "bos_token") if self.bos_token else None
    self.pad_id = self._token_id(self.pad_token, "pad_token") if self.pad_token else self.eos_id
    eos_ids = [self.eos_id]
    gen_file = os.path.join(directory, "generation_config.json")
    if os.path.exists(gen_file):
      with open(gen_file) as f:
        gen_eos = json.load(f).get("eos_token_id")
      for i in [gen_eos] if isinstance(gen_eos, int) else gen_eos or []:
        if i not in eos_ids:
          eos_ids.append(int(i))
    self.eos_ids = tuple(eos_ids)
    template = cfg.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
      named = {t["name"]: t["template"] for t in template}
      template = named.get("default")
    jinja_file = os.path.join(directory, "chat_template.jinja")
    if template is None and os.path.exists(jinja_file):
      with open(jinja_file) as f:
        template = f.read()
    self.chat_template: str | None = template

  def _token_id(self, token: str, field: str) -> int:
    token_id = self._tok.token_to_id(token)
    if token_id is None:
      raise ValueError(f"{field} {token!r} is not in the tokenizer vocabulary.")
    return token_id

  @property
  def vocab_size(self) -> int:
    """Number of token ids, added tokens included (may be < the model's padded V)."""
    return self._tok.get_vocab_size(with_added_tokens=True)

  def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
    """Token ids of `text` (`add_special_tokens` applies the post-processor, e.g. BOS)."""
    if not isinstance(text, str):
      raise ValueError(f"`text` must be a str, got {type(text).__name__}.")
    return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

  def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
    """Text of `ids`; ids outside the vocabulary are an error."""
    ids = _token_ids(ids, "ids")
    bad = [i for i in ids if not 0 <= i < self.vocab_size]
    if bad:
      raise ValueError(f"`ids` holds token ids {bad[:8]} outside [0, {self.vocab_size}).")
    return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

  @property
  def has_chat_template(self) -> bool:
    return self.chat_template is not None

  def apply_chat_template(
    self,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool = True,
    **kwargs: Any,
  ) -> str:
    """Renders `messages` ([{"role", "content"}, ...]) with the checkpoint's Jinja template.

    Extra keyword arguments (e.g. `enable_thinking=False` for Qwen3, `tools`)
    are passed to the template.
    """
    if self.chat_template is None:
      raise ValueError("This tokenizer has no chat template (tokenizer_config.json).")
    context = dict(
      bos_token=self.bos_token or "",
      eos_token=self.eos_token,
      pad_token=self.pad_token,
      add_generation_prompt=add_generation_prompt,
    )
    context.update(kwargs)
    return _render_chat_template(self.chat_template, _check_messages(messages), **context)


class CharTokenizer(_Base):
  """A character-level tokenizer for embedded tasks (same interface as `Tokenizer`).

  Ids: 0 = `<pad>`, 1 = `<bos>`, 2 = `<eos>`, then one id per character of
  `alphabet` in order. Characters outside the alphabet are an error. The chat
  template is a fixed "role: content\\n" format.
  """

  PAD, BOS, EOS = "<pad>", "<bos>", "<eos>"

  def __init__(self, alphabet: str):
    if not isinstance(alphabet, str) or not alphabet:
      raise ValueError("`alphabet` must be a non-empty str.")
    if len(set(alphabet)) != len(alphabet):
      dupes = sorted({c for c in alphabet if alphabet.count(c) > 1})
      raise ValueError(f"`alphabet` has repeated characters {dupes}.")
    self.alphabet = alphabet
    self.pad_id, self.bos_id, self.eos_id = 0, 1, 2
    self.eos_ids = (self.eos_id,)
    self.bos_token, self.eos_token, self.pad_token = self.BOS, self.EOS, self.PAD
    self._specials = (self.PAD, self.BOS, self.EOS)
    self._ids = {c: i + len(self._specials) for i, c in enumerate(alphabet)}

  @property
  def vocab_size(self) -> int:
    return len(self._specials) + len(self.alphabet)

  def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
    """One id per character; `add_special_tokens` prepends `<bos>`."""
    if not isinstance(text, str):
      raise ValueError(f"`text` must be a str, got {type(text).__name__}.")
    unknown = sorted({c for c in text if c not in self._ids})
    if unknown:
      raise ValueError(f"`text` has characters {unknown} not in the alphabet {self.alphabet!r}.")
    ids = [self._ids[c] for c in text]
    return [self.bos_id, *ids] if add_special_tokens else ids

  def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
    """Text of `ids`; special tokens are dropped or rendered as `<pad>`/`<bos>`/`<eos>`."""
    out = []
    for i in _token_ids(ids, "ids"):
      if not 0 <= i < self.vocab_size:
        raise ValueError(f"`ids` holds token id {i}, outside [0, {self.vocab_size}).")
      if i < len(self._specials):
        if not skip_special_tokens:
          out.append(self._specials[i])
      else:
        out.append(self.alphabet[i - len(self._specials)])
    return "".join(out)

  @property
  def has_chat_template(self) -> bool:
    return True

  def apply_chat_template(
    self,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool = True,
    **kwargs: Any,
  ) -> str:
    """`"".join(f"{role}: {content}\\n")` plus `"assistant: "` as generation prompt."""
    del kwargs
    messages = _check_messages(messages)
    for i, m in enumerate(messages):
      if not isinstance(m.get("content"), str):
        raise ValueError(f"`messages[{i}]['content']` must be a str, got {m.get('content')!r:.80}.")
    text = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
    return text + ("assistant: " if add_generation_prompt else "")
