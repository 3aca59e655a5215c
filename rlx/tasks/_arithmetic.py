"""The embedded default task: multi-digit arithmetic with reversed digits.

A prompt is `"<bos>240+719="` and its target `"9590<eos>"`: 42 + 917 = 959,
every number written with a fixed width (num_digits for the operands,
num_digits + 1 for a sum) and its digits reversed, least significant first.
Character tokens (`rlx.policy.CharTokenizer` over "0123456789+-*=", 17 ids
with the specials) keep the vocabulary tiny, and the reward is token exact
match, in JAX as well as on the host; `reward="digits"` grades it instead
(partial credit per answer digit, see `ArithmeticTask`).

Why reversed and fixed-width: a causal model that writes the least
significant digit first computes each output digit from the two operand
digits at that place and the carry of the digit it has just written; in the
usual order the first digit it writes depends on the carries of every lower
place, which it has not written yet. Small transformers learn addition from
far fewer examples in reversed order (Lee et al., "Teaching Arithmetic to
Small Transformers", 2023, https://arxiv.org/abs/2307.03381). Zero-padding
puts every digit at a fixed position, and reversing the operands as well puts
each answer digit at one fixed distance from the operand digits it needs, an
offset that relative position encodings (RoPE) express directly (McLeish et
al., "Transformers Can Do Arithmetic with the Right Embeddings", 2024,
https://arxiv.org/abs/2405.17399, reverse operands and answers alike). In a
supervised check (2-layer width-64 RoPE model, 100k parameters, Adam 1e-3,
batch 64, 3-digit addition) dev exact match passed 30% after 900-1400 steps
with reversed operands and after 3800 steps with operands in the usual order.
All three choices are on by default and each can be turned off
(`reverse_operands`, `reverse_answer`, `fixed_width`).

Splits are drawn from one seeded stream in the order test, dev, train, so the
held-out problems do not depend on `train_size`; no problem appears in two
splits, and for `+` and `*` neither does its commuted form (`a+b` vs `b+a`).
"""

from collections.abc import Sequence

import numpy as np

from rlx.policy import CharTokenizer
from rlx.tasks._base import SPLITS, Example, Task, check_split_name
from rlx.tasks._exact_match import (
  exact_match_jax_reward,
  exact_match_rewards,
  positional_match_jax_reward,
  positional_match_rewards,
)

ALPHABET = "0123456789+-*="
OPERATIONS = ("+", "-", "*")
REWARDS = ("exact", "digits")
_ENUMERATE_BELOW = 50_000  # problem spaces up to this size are permuted whole
_CHUNK = 4096


_STEP_TOKENS = 7  # one scratchpad step: "{a_i}+{b_i}+{c_i}={s_i}"


def _column_addition(a: int, b: int) -> str:
  """The scratchpad of a + b: one `"{a_i}+{b_i}+{c_i}={s_i}"` per digit place, least
  significant first, over the longer operand's digits (c_i: the carry into place i)."""
  steps, carry = [], 0
  for i in range(max(len(str(a)), len(str(b)))):
    x, y = (a // 10**i) % 10, (b // 10**i) % 10
    total = x + y + carry
    steps.append(f"{x}+{y}+{carry}={total % 10}")
    carry = total // 10
  return "".join(steps)


def _answer_width(op: str, num_digits: int) -> int:
  return {"+": num_digits + 1, "-": num_digits, "*": 2 * num_digits}[op]


class ArithmeticTask(Task):
  """Multi-digit `a op b =` problems with an exact-match or graded reward (JAX and host).

  Args:
    num_digits: operands are uniform in [0, 10**num_digits).
    operations: a subset of ("+", "-", "*"), each problem draws one uniformly.
      Subtraction puts the larger operand first (answers are never negative).
    reverse_answer: write the answer least significant digit first.
    reverse_operands: write the operands least significant digit first too
      (then every answer digit sits at one fixed distance from its operand
      digits, which suits relative position encodings such as RoPE).
    fixed_width: zero-pad operands to `num_digits` and the answer to its
      operation's width (digits + 1 for "+", digits for "-", 2 x digits for
      "*"); False writes numbers without leading zeros.
    min_digits: None (default) draws operands uniformly in [0, 10**num_digits).
      An int in [1, num_digits) draws each operand's digit count d from
      [min_digits, num_digits] with P(d) proportional to digits_decay**(d -
      min_digits), then the operand uniformly among the d-digit numbers
      (d = 1: 0-9). With decay < 1 most problems are short and a few are long,
      so unpadded answers have a long tail of lengths: the length profile of
      RL rollouts that partial rollouts (APRIL) target.
    digits_decay: the ratio above, in (0, 1] (1: digit counts uniform).
    pad_answer: zero-pad the answer to its operation's width; None (default)
      follows `fixed_width`. With `fixed_width=True, pad_answer=False` the
      operands keep their fixed positions (one fixed offset per answer digit)
      while the answer has its natural length.
    train_size, dev_size, test_size: problems per split (disjoint).
    seed: the seed of the split generator.
    add_bos: start each prompt with `<bos>`.
    require_stop: a correct completion must end with `<eos>` (False also
      accepts the bare answer, e.g. a completion cut at `max_answer_len`).
    reward: "exact" (default): 1 for a correct completion (the answer's tokens,
      then `<eos>` as `require_stop` asks), else 0. "digits": partial credit,
      for baselines that need non-binary rewards, e.g. the median baseline of
      MC-GRPO (Kim et al., median-centred GRPO,
      https://github.com/lotusroot-kim/MC-GRPO; with 0/1 rewards a group's
      median is 0 or 1 and every sample equal to it gets a zero advantage). With
      L the answer's width in tokens (its operation's width when the answer
      is padded, else its natural length) and m the positions i < L at which
      the completion's token i equals the answer's token i (the answer as
      written, reversed by default): 1 for a correct completion, else
      min(m / L, L / (L + 1)). So every reward is in [0, 1], 1 only when
      "exact" gives 1, and a completion with every digit right but no `<eos>`
      (under `require_stop`), a wrong stop token or extra tokens gets
      L / (L + 1) (0.8 for 3-digit addition).
      Tokens after the first L earn nothing; a short completion earns only for
      the positions it has. `jax_reward` computes the same values. `correct`
      (what the greedy accuracy averages) stays exact match under either.
    scratchpad: the completion writes the column addition first, one step per
      digit place from the least significant: `"{a_i}+{b_i}+{c_i}={s_i}"`
      (operand digits, carry in, sum digit; 7 tokens), over the longer
      operand's digit count, then `"*"` and the answer as above. So the
      response length grows with the operands (8 d + 3 tokens for d-digit
      operands with their natural-length answer), and with `min_digits` has a
      long tail: a rollout-bound task, as RL on reasoning traces is. The
      reward (either kind) compares the whole target, scratchpad and answer.
      Addition only. See Nye et al., "Show Your Work: Scratchpads for
      Intermediate Computation with Language Models", 2021,
      https://arxiv.org/abs/2112.00114.
    name: the task name in messages.
  """

  def __init__(
    self,
    *,
    num_digits: int = 3,
    operations: Sequence[str] = ("+",),
    reverse_answer: bool = True,
    reverse_operands: bool = True,
    fixed_width: bool = True,
    train_size: int = 5000,
    dev_size: int = 200,
    test_size: int = 500,
    seed: int = 0,
    add_bos: bool = True,
    require_stop: bool = True,
    min_digits: int | None = None,
    digits_decay: float = 0.5,
    pad_answer: bool | None = None,
    reward: str = "exact",
    scratchpad: bool = False,
    name: str = "arithmetic",
  ):
    self.name = name
    if not isinstance(reward, str) or reward not in REWARDS:
      raise ValueError(f"Task {name!r}: `reward` must be one of {REWARDS}, got {reward!r}.")
    if not isinstance(num_digits, int) or not 1 <= num_digits <= 18:
      raise ValueError(
        f"Task {name!r}: `num_digits` must be an int in [1, 18], got {num_digits!r}."
      )
    if min_digits is not None and (
      isinstance(min_digits, bool)
      or not isinstance(min_digits, int)
      or not 1 <= min_digits <= num_digits
    ):
      raise ValueError(
        f"Task {name!r}: `min_digits` must be None or an int in [1, num_digits={num_digits}], "
        f"got {min_digits!r}."
      )
    if not isinstance(digits_decay, (int, float)) or not 0.0 < float(digits_decay) <= 1.0:
      raise ValueError(f"Task {name!r}: `digits_decay` must be in (0, 1], got {digits_decay!r}.")
    if pad_answer is not None and not isinstance(pad_answer, bool):
      raise ValueError(f"Task {name!r}: `pad_answer` must be None or a bool, got {pad_answer!r}.")
    if isinstance(operations, str):
      operations = tuple(operations)
    operations = tuple(operations)
    if not isinstance(scratchpad, bool):
      raise ValueError(f"Task {name!r}: `scratchpad` must be a bool, got {scratchpad!r}.")
    if scratchpad and operations != ("+",):
      raise ValueError(
        f"Task {name!r}: `scratchpad` writes column addition; `operations` must be ('+',), "
        f"got {operations}."
      )
    bad = [op for op in operations if op not in OPERATIONS]
    if not operations or bad or len(set(operations)) != len(operations):
      raise ValueError(
        f"Task {name!r}: `operations` must be distinct entries of {OPERATIONS}, got {operations}."
      )
    sizes = {"train": train_size, "dev": dev_size, "test": test_size}
    for split, size in sizes.items():
      if not isinstance(size, int) or size < 0:
        raise ValueError(f"Task {name!r}: `{split}_size` must be an int >= 0, got {size!r}.")
    if train_size == 0:
      raise ValueError(f"Task {name!r}: `train_size` must be > 0 (an empty train split).")
    self.num_digits = num_digits
    self.operations = operations
    self.reverse_answer = reverse_answer
    self.reverse_operands = reverse_operands
    self.fixed_width = fixed_width
    self.min_digits = min_digits
    self.digits_decay = float(digits_decay)
    self.pad_answer = fixed_width if pad_answer is None else pad_answer
    self.scratchpad = scratchpad
    self.seed = seed
    self.add_bos = add_bos
    self.require_stop = require_stop
    self.tokenizer = CharTokenizer(ALPHABET)
    self.stop_token_ids = (self.tokenizer.eos_id,)
    # `reward_kind`, not `reward`: `Task.reward` is the host reward method.
    self.reward_kind = reward
    jax_reward = positional_match_jax_reward if reward == "digits" else exact_match_jax_reward
    self.jax_reward = jax_reward(self.stop_token_ids, require_stop=require_stop)

    problems = self._draw(sizes)
    self._splits = {split: tuple(self._example(*p) for p in problems[split]) for split in SPLITS}
    every = [e for split in SPLITS for e in self._splits[split]]
    self.max_prompt_len = max(len(e.prompt_ids) for e in every)
    self.max_answer_len = max(_answer_width(op, num_digits) for op in operations) + 1
    if scratchpad:  # 7 tokens per digit place, then "*"
      self.max_answer_len += _STEP_TOKENS * num_digits + 1

  def _draw(self, sizes: dict[str, int]) -> dict[str, list[tuple[str, int, int]]]:
    """Distinct problems per split; keys are (op, min, max) so commuted forms collide."""
    total = sum(sizes.values())
    if self.min_digits is not None and self.min_digits < self.num_digits:
      return self._split_draw(self._draw_by_digits(total), sizes)
    m = 10**self.num_digits
    per_op = m * (m + 1) // 2  # unordered operand pairs
    space = per_op * len(self.operations)
    self._check_space(total, space, f"num_digits={self.num_digits}")
    rng = np.random.default_rng(self.seed)
    drawn: list[tuple[str, int, int]] = []
    # The draw is a prefix of one fixed stream (enumerated when the space is
    # small, else fixed-size chunks), so smaller sizes give prefixes of it.
    if space <= _ENUMERATE_BELOW:
      keys = [(op, lo, hi) for op in self.operations for hi in range(m) for lo in range(hi + 1)]
      order = rng.permutation(len(keys))[:total]
      flips = rng.random(len(keys))[:total] < 0.5
      for index, flip in zip(order, flips, strict=True):
        op, lo, hi = keys[index]
        drawn.append((op, hi, lo) if flip or op == "-" else (op, lo, hi))
    else:
      seen = set()
      while len(drawn) < total:
        ops = rng.integers(0, len(self.operations), size=_CHUNK)
        a = rng.integers(0, m, size=_CHUNK, dtype=np.int64)
        b = rng.integers(0, m, size=_CHUNK, dtype=np.int64)
        self._add_distinct(ops, a, b, seen, drawn, total)
    return self._split_draw(drawn, sizes)

  def _check_space(self, total: int, space: int, what: str) -> None:
    if total > space:
      raise ValueError(
        f"Task {self.name!r}: {total} problems requested but only {space} distinct ones exist "
        f"with {what} and operations={self.operations}."
      )

  def _add_distinct(self, ops, a, b, seen: set, drawn: list, total: int) -> None:
    """Appends the problems `(ops[i], a[i], b[i])` not `seen` yet (commuted forms
    collide; "-" puts the larger operand first) until `drawn` holds `total`."""
    for o, x, y in zip(ops.tolist(), a.tolist(), b.tolist(), strict=True):
      op = self.operations[o]
      key = (op, min(x, y), max(x, y))
      if key in seen:
        continue
      seen.add(key)
      drawn.append((op, max(x, y), min(x, y)) if op == "-" else (op, x, y))
      if len(drawn) == total:
        return

  @staticmethod
  def _split_draw(drawn, sizes):
    out, start = {}, 0
    for split in ("test", "dev", "train"):
      out[split] = drawn[start : start + sizes[split]]
      start += sizes[split]
    return out

  def _draw_by_digits(self, total: int) -> list[tuple[str, int, int]]:
    """`total` distinct problems whose operands' digit counts follow `digits_decay`."""
    lo_d, hi_d = self.min_digits, self.num_digits
    counts = np.arange(lo_d, hi_d + 1)
    p = self.digits_decay ** (counts - lo_d).astype(np.float64)
    p /= p.sum()
    values = 10**hi_d - (10 ** (lo_d - 1) if lo_d > 1 else 0)
    space = values * (values + 1) // 2 * len(self.operations)
    self._check_space(total, space, f"min_digits={lo_d}, num_digits={hi_d}")
    rng = np.random.default_rng(self.seed)
    drawn: list[tuple[str, int, int]] = []
    seen = set()
    for _ in range(max(64, 64 * total // _CHUNK)):
      ops = rng.integers(0, len(self.operations), size=_CHUNK)
      pair = []
      for _operand in range(2):
        d = rng.choice(counts, size=_CHUNK, p=p)
        low = np.where(d == 1, 0, 10 ** (d - 1).astype(np.int64))
        pair.append(low + np.floor(rng.random(_CHUNK) * (10**d - low)).astype(np.int64))
      self._add_distinct(ops, pair[0], pair[1], seen, drawn, total)
      if len(drawn) == total:
        return drawn
    raise ValueError(
      f"Task {self.name!r}: could not draw {total} distinct problems with min_digits={lo_d} and "
      f"digits_decay={self.digits_decay} (the likely digit counts hold too few problems); "
      f"raise min_digits or digits_decay, or request fewer problems."
    )

  def _number(self, value: int, width: int) -> str:
    return str(value).zfill(width) if self.fixed_width else str(value)

  def _example(self, op: str, a: int, b: int) -> Example:
    value = {"+": a + b, "-": a - b, "*": a * b}[op]
    left, right = self._number(a, self.num_digits), self._number(b, self.num_digits)
    if self.reverse_operands:
      left, right = left[::-1], right[::-1]
    prompt = f"{left}{op}{right}="
    width = _answer_width(op, self.num_digits) if self.pad_answer else 0
    answer = str(value).zfill(width)
    if self.reverse_answer:
      answer = answer[::-1]
    if self.scratchpad:
      answer = _column_addition(a, b) + "*" + answer
    tok = self.tokenizer
    return Example(
      prompt_ids=tuple(tok.encode(prompt, add_special_tokens=self.add_bos)),
      answer=answer,
      target_ids=(*tok.encode(answer), tok.eos_id),
      prompt_text=prompt,
    )

  def split(self, name: str) -> Sequence[Example]:
    """The examples of "train", "dev" or "test" (a tuple, in generation order)."""
    check_split_name(self.name, name, self._splits)
    return self._splits[name]

  def score(self, examples: Sequence[Example], completions: list[list[int]]) -> np.ndarray:
    """1.0 when the completion is exactly the answer's tokens then `<eos>`; otherwise 0.0
    ("exact") or min(m / L, L / (L + 1)) for m of the L answer digits right ("digits")."""
    answers = [self.answer_tokens(e) for e in examples]
    rewards = positional_match_rewards if self.reward_kind == "digits" else exact_match_rewards
    return rewards(answers, completions, self.stop_token_ids, require_stop=self.require_stop)

  def correct(
    self, examples: Sequence[Example], completions: Sequence[Sequence[int]]
  ) -> np.ndarray:
    """Exact match (1.0 / 0.0) under either reward: the fraction solved is the accuracy."""
    examples = self._check_examples(examples)
    completions = self._check_completions(completions, len(examples))
    answers = [self.answer_tokens(e) for e in examples]
    return exact_match_rewards(
      answers, completions, self.stop_token_ids, require_stop=self.require_stop
    )
