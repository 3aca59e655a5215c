"""The embedded arithmetic task: splits, answers, and jax_reward == reward."""

import functools
import types

import jax
import numpy as np
import pytest

from rlx import tasks


@functools.cache
def _task(**kwargs):
  return tasks.ArithmeticTask(**kwargs)


def _key(example):
  a, op, b = _parse(example.prompt_text)
  return (op, min(a, b), max(a, b))


def _parse(prompt_text, reversed_operands=True):
  assert prompt_text.endswith("=")
  for op in tasks.OPERATIONS:
    if op in prompt_text:
      a, b = prompt_text[:-1].split(op)
      if reversed_operands:
        a, b = a[::-1], b[::-1]
      return int(a), op, int(b)
  raise AssertionError(prompt_text)


def test_default_splits_sizes_disjoint_and_deterministic():
  task = _task()
  sizes = {s: len(task.split(s)) for s in tasks.SPLITS}
  assert sizes == {"train": 5000, "dev": 200, "test": 500}
  keys = {s: [_key(e) for e in task.split(s)] for s in tasks.SPLITS}
  for s in tasks.SPLITS:
    assert len(set(keys[s])) == len(keys[s])  # no duplicates within a split
  assert not set(keys["test"]) & set(keys["train"])  # commuted forms included in the key
  assert not set(keys["dev"]) & set(keys["train"])
  assert not set(keys["dev"]) & set(keys["test"])
  assert tasks.ArithmeticTask(seed=0).split("test") == task.split("test")
  assert tasks.ArithmeticTask(seed=1).split("test") != task.split("test")
  # Held-out splits do not depend on train_size.
  smaller = tasks.ArithmeticTask(train_size=100)
  assert smaller.split("test") == task.split("test") and smaller.split("dev") == task.split("dev")
  assert smaller.split("train") == task.split("train")[:100]


def test_examples_are_reversed_fixed_width_sums():
  task = _task()
  tok = task.tokenizer
  assert tok.vocab_size == 17
  assert task.stop_token_ids == (tok.eos_id,)
  assert task.max_prompt_len == 9 and task.max_answer_len == 5
  for example in task.split("dev"):
    a, op, b = _parse(example.prompt_text)
    assert op == "+" and len(example.prompt_text) == 8  # "240+719=" for 42 + 917
    assert example.prompt_text == f"{str(a).zfill(3)[::-1]}+{str(b).zfill(3)[::-1]}="
    assert example.answer == str(a + b).zfill(4)[::-1]
    assert example.prompt_ids == (tok.bos_id, *tok.encode(example.prompt_text))
    assert example.target_ids == (*tok.encode(example.answer), tok.eos_id)
  assert task.reward(task.split("dev"), [e.target_ids for e in task.split("dev")]).min() == 1.0


def test_operations_widths_and_options():
  task = tasks.make_task(
    "arithmetic",
    num_digits=2,
    operations=("+", "-", "*"),
    train_size=300,
    dev_size=20,
    test_size=20,
    seed=3,
  )
  assert task.max_answer_len == 5  # "*": 2 x 2 digits + <eos>
  seen = set()
  for example in task.split("train"):
    a, op, b = _parse(example.prompt_text)
    seen.add(op)
    value = {"+": a + b, "-": a - b, "*": a * b}[op]
    width = {"+": 3, "-": 2, "*": 4}[op]
    assert value >= 0 and example.answer == str(value).zfill(width)[::-1]
  assert seen == {"+", "-", "*"}
  plain = tasks.ArithmeticTask(
    num_digits=2,
    reverse_answer=False,
    reverse_operands=False,
    fixed_width=False,
    add_bos=False,
    train_size=50,
  )
  for example in plain.split("train"):
    a, op, b = _parse(example.prompt_text, reversed_operands=False)
    assert example.prompt_text == f"{a}+{b}=" and example.answer == str(a + b)
    assert example.prompt_ids == tuple(plain.tokenizer.encode(example.prompt_text))


def test_small_problem_space_is_enumerated_and_bounded():
  # 1 digit, 3 ops: 3 x 55 unordered problems; 150 > half of them -> permutation path.
  task = tasks.ArithmeticTask(
    num_digits=1, operations="+-*", train_size=120, dev_size=15, test_size=15
  )
  keys = [_key(e) for s in tasks.SPLITS for e in task.split(s)]
  assert len(keys) == len(set(keys)) == 150
  with pytest.raises(ValueError, match=r"'arithmetic'.*only 55 distinct"):
    tasks.ArithmeticTask(num_digits=1, train_size=50, dev_size=5, test_size=1)


def test_digit_count_distribution_gives_a_long_tail_of_answer_lengths():
  task = tasks.ArithmeticTask(
    num_digits=8, min_digits=2, digits_decay=0.5, pad_answer=False, train_size=3000, seed=2
  )
  assert task.max_prompt_len == 19 and task.max_answer_len == 10  # 9 digits + <eos>
  keys = [_key(e) for s in tasks.SPLITS for e in task.split(s)]
  assert len(keys) == len(set(keys)) == 3700  # distinct across and within splits
  digits = []
  for example in task.split("train"):
    a, op, b = _parse(example.prompt_text)
    # Operands keep their fixed (reversed, zero-padded) positions; the answer
    # has its natural length.
    assert example.prompt_text == f"{str(a).zfill(8)[::-1]}+{str(b).zfill(8)[::-1]}="
    assert example.answer == str(a + b)[::-1]
    digits += [len(str(a)), len(str(b))]
  counts = np.bincount(digits, minlength=9)[2:]
  assert counts.sum() == 6000
  # P(d) ~ 0.5 ** (d - 2) over d in [2, 8]: halves per digit (binomial noise).
  want = 0.5 ** np.arange(7) / (0.5 ** np.arange(7)).sum() * 6000
  np.testing.assert_allclose(counts[:4], want[:4], rtol=0.1)
  lengths = np.array([len(e.target_ids) for e in task.split("train")])
  assert np.median(lengths) <= 5 and lengths.max() >= 9  # most short, a few at the maximum
  # Uniform digit counts, answers padded (pad_answer follows fixed_width); the
  # default task's stream is untouched by the options.
  flat = tasks.ArithmeticTask(num_digits=4, min_digits=1, digits_decay=1.0, train_size=500)
  flat_digits = [len(str(_parse(e.prompt_text)[0])) for e in flat.split("train")]
  assert np.bincount(flat_digits)[1:].min() > 80  # every digit count ~125 times
  assert {len(e.answer) for e in flat.split("train")} == {5}
  assert tasks.ArithmeticTask(min_digits=3).split("test") == _task().split("test")


@pytest.mark.parametrize(
  "kwargs, match",
  [
    ({"min_digits": 0}, "min_digits"),
    ({"min_digits": 4}, "min_digits"),
    ({"min_digits": 1, "digits_decay": 0.0}, "digits_decay"),
    ({"min_digits": 1, "digits_decay": 1.5}, "digits_decay"),
    ({"pad_answer": 1}, "pad_answer"),
    ({"num_digits": 0}, "num_digits"),
    ({"operations": ("/",)}, "operations"),
    ({"operations": ()}, "operations"),
    ({"train_size": 0}, "train_size"),
    ({"dev_size": -1}, "dev_size"),
  ],
)
def test_bad_arguments(kwargs, match):
  with pytest.raises(ValueError, match=f"'arithmetic'.*{match}"):
    tasks.ArithmeticTask(**kwargs)


def _completions(task, examples, rng):
  """Correct, correct-without-stop, stop-then-junk, truncated, wrong-digit and random rows."""
  tok = task.tokenizer
  out = []
  for i, example in enumerate(examples):
    answer = list(tok.encode(example.answer))
    kind = i % 7
    if kind == 0:
      out.append([*answer, tok.eos_id])
    elif kind == 1:
      out.append(answer)
    elif kind == 2:
      out.append([*answer, tok.eos_id, *rng.integers(0, tok.vocab_size, 2).tolist()])
    elif kind == 3:
      out.append(answer[: rng.integers(0, len(answer))])
    elif kind == 4:
      wrong = list(answer)
      wrong[rng.integers(len(wrong))] = tok.encode(str((example.answer.count("1") + 1) % 10))[0]
      out.append([*wrong, tok.eos_id] if wrong != answer else [tok.pad_id])
    elif kind == 5:
      out.append([*answer, tok.pad_id])  # a wrong stop token
    else:
      out.append(rng.integers(0, tok.vocab_size, rng.integers(0, 8)).tolist())
  return out


@pytest.mark.parametrize("require_stop", [True, False])
def test_jax_reward_equals_host_reward(require_stop):
  task = tasks.ArithmeticTask(
    num_digits=2,
    operations="+-*",
    train_size=200,
    dev_size=0,
    test_size=0,
    require_stop=require_stop,
  )
  rng = np.random.default_rng(0)
  examples = task.split("train")[:70]
  completions = _completions(task, examples, rng)
  host = task.reward(examples, completions)
  expected = np.asarray(
    [
      float(
        list(c) == [*task.tokenizer.encode(e.answer), task.tokenizer.eos_id]
        or (not require_stop and list(c) == task.tokenizer.encode(e.answer))
      )
      for e, c in zip(examples, completions, strict=True)
    ],
    np.float32,
  )
  np.testing.assert_array_equal(host, expected)
  assert 0 < host.sum() < len(examples)
  answer_ids, answer_lengths = task.answer_arrays(examples)
  assert answer_ids.shape == (70, task.max_answer_len) and answer_ids.dtype == np.int32
  lengths = np.asarray([len(c) for c in completions], np.int32)
  reward = jax.jit(task.jax_reward)
  for width in (int(lengths.max()), 12):  # tight and loose padding
    padded = np.full((len(examples), width), -7, np.int32)  # junk after each length
    for i, c in enumerate(completions):
      padded[i, : len(c)] = c
    device = np.asarray(reward(answer_ids, answer_lengths, padded, lengths))
    assert device.dtype == np.float32
    np.testing.assert_array_equal(device, host)
    np.testing.assert_array_equal(task.reward_padded(examples, padded.clip(0), lengths), host)
  # Wider answer arrays and a completion narrower than the answer width.
  wide_ids, wide_lengths = task.answer_arrays(examples, length=9)
  np.testing.assert_array_equal(reward(wide_ids, wide_lengths, padded, lengths), host)
  short = padded[:, :2]
  short_lengths = np.minimum(lengths, 2)
  short_host = task.reward(examples, [c[:2] for c in completions])
  np.testing.assert_array_equal(
    reward(answer_ids, answer_lengths, short, short_lengths), short_host
  )


def test_exact_match_helpers():
  assert tasks.exact_match([5, 6], [5, 6, 2], (2,))
  assert not tasks.exact_match([5, 6], [5, 6], (2,))
  assert tasks.exact_match([5, 6], [5, 6], (2,), require_stop=False)
  assert not tasks.exact_match([5, 6], [5, 6, 2, 2], (2,))
  assert tasks.exact_match([5, 6], [5, 6, 9], (2, 9))
  fn = tasks.exact_match_jax_reward((2,), correct=2.5)
  out = fn(np.array([[5, 6]]), np.array([2]), np.array([[5, 6, 2, 0]]), np.array([3]))
  np.testing.assert_array_equal(out, [2.5])
  with pytest.raises(ValueError, match="stop_token_ids"):
    tasks.exact_match_jax_reward(())
  with pytest.raises(ValueError, match="2-D"):
    fn(np.array([5, 6]), np.array([2]), np.array([[5, 6, 2]]), np.array([3]))
  with pytest.raises(ValueError, match="batch sizes"):
    fn(np.array([[5, 6]]), np.array([2]), np.array([[5, 6, 2]] * 2), np.array([3, 3]))


def test_digits_reward_hand_computed_values():
  task = _task(reward="digits")
  assert task.reward_kind == "digits" and _task().reward_kind == "exact"
  tok = task.tokenizer
  example = task.split("dev")[0]
  a, _, b = _parse(example.prompt_text)
  answer = tok.encode(example.answer)
  assert example.answer == str(a + b).zfill(4)[::-1] and len(answer) == 4  # L = 4
  wrong = list(answer)
  wrong[1] = tok.encode(str((int(example.answer[1]) + 1) % 10))[0]
  wrong2 = list(wrong)
  wrong2[3] = tok.encode(str((int(example.answer[3]) + 1) % 10))[0]
  eos, pad = tok.eos_id, tok.pad_id
  cases = [
    ([*answer, eos], 1.0),  # all right
    ([*wrong, eos], 3 / 4),  # one digit wrong
    ([*wrong2, eos], 2 / 4),  # two digits wrong
    (wrong, 3 / 4),  # one digit wrong, no stop
    (answer, 4 / 5),  # every digit right, stop missing: L / (L + 1)
    ([*answer, pad], 4 / 5),  # a wrong stop token
    ([*answer, eos, eos], 4 / 5),  # stop then more tokens
    ([*answer, *answer, eos], 4 / 5),  # too long: tokens past L earn nothing
    ([], 0.0),  # empty
    ([eos], 0.0),
    (answer[:2], 2 / 4),  # short: credit for the positions present
    ([*wrong[:2], eos], 1 / 4),  # short, one of its two right, then a stop
    (answer[::-1] if answer[::-1] != answer else [pad] * 4, None),  # checked below
  ]
  examples = [example] * len(cases)
  completions = [c for c, _ in cases]
  host = task.reward(examples, completions)
  assert host.dtype == np.float32
  want = [np.float32(w) for _, w in cases[:-1]]
  np.testing.assert_array_equal(host[:-1], np.asarray(want, np.float32))
  reversed_hits = sum(x == y for x, y in zip(cases[-1][0], answer, strict=True))
  assert host[-1] == np.float32(min(reversed_hits / 4, 4 / 5))
  # The exact reward of the same completions: 1 only where "digits" gives 1.
  exact = _task().reward(examples, completions)
  np.testing.assert_array_equal(exact, (host == 1.0).astype(np.float32))
  # Without require_stop the bare answer is correct; other values unchanged.
  loose = tasks.ArithmeticTask(reward="digits", require_stop=False).reward(examples, completions)
  np.testing.assert_array_equal(loose, np.where(np.arange(len(cases)) == 4, 1.0, host))
  # The same values on device.
  answer_ids, answer_lengths = task.answer_arrays(examples)
  padded = np.full((len(cases), 10), pad, np.int32)
  for i, c in enumerate(completions):
    padded[i, : len(c)] = c
  lengths = np.asarray([len(c) for c in completions], np.int32)
  device = jax.jit(task.jax_reward)(answer_ids, answer_lengths, padded, lengths)
  np.testing.assert_array_equal(np.asarray(device), host)


def test_digits_reward_unpadded_answers_use_their_natural_length():
  task = tasks.ArithmeticTask(fixed_width=False, num_digits=2, train_size=50, reward="digits")
  tok = task.tokenizer
  example = next(e for e in task.split("train") if len(e.answer) == 2)
  answer = tok.encode(example.answer)
  wrong = [answer[0], tok.encode(str((int(example.answer[1]) + 1) % 10))[0]]
  rewards = task.reward([example] * 3, [[*answer, tok.eos_id], [*wrong, tok.eos_id], answer])
  np.testing.assert_array_equal(rewards, np.asarray([1.0, 1 / 2, 2 / 3], np.float32))


def test_exact_reward_is_the_default_and_unchanged():
  task = tasks.ArithmeticTask(num_digits=2, operations="+-*", train_size=200, dev_size=0)
  explicit = tasks.ArithmeticTask(
    num_digits=2, operations="+-*", train_size=200, dev_size=0, reward="exact"
  )
  examples = task.split("train")[:70]
  completions = _completions(task, examples, np.random.default_rng(1))
  host = task.reward(examples, completions)
  assert set(np.unique(host).tolist()) == {0.0, 1.0}
  np.testing.assert_array_equal(explicit.reward(examples, completions), host)
  np.testing.assert_array_equal(
    host,
    tasks.exact_match_rewards(
      [task.answer_tokens(e) for e in examples], completions, task.stop_token_ids
    ),
  )
  assert explicit.split("test") == task.split("test")


@pytest.mark.parametrize("reward", ["digit", "", None, 1, "EXACT"])
def test_bad_reward_raises(reward):
  with pytest.raises(ValueError, match=r"'arithmetic'.*`reward`.*\('exact', 'digits'\)"):
    tasks.ArithmeticTask(reward=reward)


@pytest.mark.parametrize("require_stop", [True, False])
@pytest.mark.parametrize("fixed_width", [True, False])
def test_digits_jax_reward_equals_host_reward(require_stop, fixed_width):
  task = tasks.ArithmeticTask(
    num_digits=2,
    operations="+-*",
    train_size=200,
    dev_size=0,
    test_size=0,
    fixed_width=fixed_width,
    require_stop=require_stop,
    reward="digits",
  )
  tok = task.tokenizer
  rng = np.random.default_rng(0)
  examples = list(task.split("train")[:70])
  completions = _completions(task, examples, rng)
  # Plus random near-misses: the answer with random digits replaced, random stop/cut.
  for example in task.split("train")[70:140]:
    row = list(tok.encode(example.answer))
    digits = [tok.encode(str(d))[0] for d in rng.integers(0, 10, len(row))]
    flips = rng.random(len(row)) < 0.3
    row = [d if f else t for t, d, f in zip(row, digits, flips, strict=True)]
    row = row[: rng.integers(0, len(row) + 1)] + [tok.eos_id] * int(rng.integers(0, 2))
    examples.append(example)
    completions.append(row)
  host = task.reward(examples, completions)
  assert host.dtype == np.float32 and host.min() >= 0.0 and host.max() == 1.0
  assert len(np.unique(host)) > 4  # graded, not binary
  exact = tasks.ArithmeticTask(
    num_digits=2,
    operations="+-*",
    train_size=200,
    dev_size=0,
    test_size=0,
    fixed_width=fixed_width,
    require_stop=require_stop,
  ).reward(examples, completions)
  np.testing.assert_array_equal(host == 1.0, exact == 1.0)
  answer_ids, answer_lengths = task.answer_arrays(examples)
  lengths = np.asarray([len(c) for c in completions], np.int32)
  reward = jax.jit(task.jax_reward)
  for width, junk in ((int(lengths.max()), -7), (12, tok.pad_id), (12, tok.encode("1")[0])):
    padded = np.full((len(examples), width), junk, np.int32)  # junk after each length
    for i, c in enumerate(completions):
      padded[i, : len(c)] = c
    device = np.asarray(reward(answer_ids, answer_lengths, padded, lengths))
    assert device.dtype == np.float32 and device.shape == (len(examples),)
    np.testing.assert_array_equal(device, host)
    np.testing.assert_array_equal(task.reward_padded(examples, padded.clip(0), lengths), host)
  # Wider answer arrays, and completions narrower than the answer width.
  wide_ids, wide_lengths = task.answer_arrays(examples, length=9)
  np.testing.assert_array_equal(reward(wide_ids, wide_lengths, padded, lengths), host)
  for cut in (0, 1, 2):
    short = padded[:, :cut]
    short_lengths = np.minimum(lengths, cut)
    short_host = task.reward(examples, [c[:cut] for c in completions])
    np.testing.assert_array_equal(
      reward(answer_ids, answer_lengths, short, short_lengths), short_host
    )


def test_accuracy_stays_exact_match_under_the_graded_reward():
  graded, exact = _task(reward="digits"), _task()
  tok = graded.tokenizer
  examples = list(graded.split("dev")[:3])
  answers = [tok.encode(e.answer) for e in examples]
  wrong = list(answers[1])
  wrong[0] = tok.encode(str((int(examples[1].answer[0]) + 1) % 10))[0]
  completions = [[*answers[0], tok.eos_id], [*wrong, tok.eos_id], answers[2]]
  np.testing.assert_allclose(graded.reward(examples, completions), [1.0, 0.75, 0.8])
  for task in (graded, exact):
    assert task.correct(examples, completions).tolist() == [1.0, 0.0, 0.0]

  class Greedy:  # a sampler stand-in that returns the completions above
    def generate(self, params, prompts, num_samples, rng):
      del params, num_samples, rng
      n = len(prompts)
      width = max(len(c) for c in completions)
      tokens = np.zeros((n, width), np.int32)
      for i, c in enumerate(completions[:n]):
        tokens[i, : len(c)] = c
      return types.SimpleNamespace(tokens=tokens, lengths=[len(c) for c in completions[:n]])

  from rlx import rl  # noqa: PLC0415

  acc = rl.greedy_accuracy(Greedy(), None, graded, examples, batch_size=3)
  assert acc == pytest.approx(1 / 3)


def test_rl_config_reward_reaches_the_task():
  from rlx import rl  # noqa: PLC0415

  config = rl.get_config()
  config.task.arithmetic.num_digits = 2
  config.task.arithmetic.train_size = 200
  config.task.arithmetic.reward = "digits"
  rl.validate_config(config)
  assert rl.task_kwargs(config)["reward"] == "digits"
  task = rl.make_task(config)
  assert isinstance(task, tasks.ArithmeticTask) and task.reward_kind == "digits"
  example = task.split("train")[0]
  answer = task.tokenizer.encode(example.answer)  # 3 digits for 2-digit addition
  assert task.reward([example], [answer]).tolist() == [np.float32(3 / 4)]
  ids, lengths = task.answer_arrays([example])
  device = task.jax_reward(ids, lengths, np.asarray([answer]), np.asarray([3]))
  np.testing.assert_array_equal(device, [np.float32(3 / 4)])
  # The default config builds the exact-reward task; a bad value fails at build time.
  assert rl.make_task(rl.get_config()).reward_kind == "exact"
  config.task.arithmetic.reward = "partial"
  with pytest.raises(ValueError, match="`reward` must be one of"):
    rl.make_task(config)


def _column_steps(a, b):
  """The scratchpad written by hand: per place (least significant first) a_i+b_i+carry=s_i."""
  out, carry = "", 0
  da, db = str(a)[::-1], str(b)[::-1]
  for i in range(max(len(da), len(db))):
    x = int(da[i]) if i < len(da) else 0
    y = int(db[i]) if i < len(db) else 0
    out += f"{x}+{y}+{carry}={(x + y + carry) % 10}"
    carry = (x + y + carry) // 10
  return out


def test_scratchpad_targets_are_column_addition_then_the_answer():
  task = tasks.ArithmeticTask(
    num_digits=8, min_digits=2, digits_decay=0.7, pad_answer=False, scratchpad=True,
    train_size=400, dev_size=20, test_size=20,
  )  # fmt: skip
  plain = tasks.ArithmeticTask(
    num_digits=8, min_digits=2, digits_decay=0.7, pad_answer=False,
    train_size=400, dev_size=20, test_size=20,
  )  # fmt: skip
  assert [e.prompt_text for e in task.split("test")] == [e.prompt_text for e in plain.split("test")]
  for e, p in zip(task.split("train"), plain.split("train"), strict=True):
    a, _, b = _parse(e.prompt_text)
    steps, answer = e.answer.split("*")
    assert steps == _column_steps(a, b) and answer == p.answer == str(a + b)[::-1]
    assert len(steps) == 7 * max(len(str(a)), len(str(b)))
  assert task.max_answer_len == plain.max_answer_len + 7 * 8 + 1
  lengths = [len(e.target_ids) for e in task.split("train")]
  assert max(lengths) <= task.max_answer_len and max(lengths) > 2 * min(lengths)
  # 9 + 3 with a carry, by hand: in the 55 one-digit sums (one operand order of each pair).
  assert _column_steps(9, 3) == "9+3+0=2"
  sums = tasks.ArithmeticTask(
    num_digits=1, pad_answer=False, scratchpad=True, operations="+",
    train_size=55, dev_size=0, test_size=0,
  )  # fmt: skip
  (hand,) = [e for e in sums.split("train") if e.prompt_text in ("9+3=", "3+9=")]
  assert hand.answer == hand.prompt_text[:-1] + "+0=2*21"
  # The reward compares the whole target (scratchpad and answer), in JAX as on the host.
  examples = task.split("train")[:3]
  right = [list(e.target_ids) for e in examples]
  wrong_step = [list(e.target_ids) for e in examples]
  tok = task.tokenizer
  digit = examples[0].answer[6]  # the first step's sum digit
  wrong_step[0][6] = tok.encode("1" if digit == "0" else "0")[0]
  assert tok.decode(wrong_step[0][:7]) != examples[0].answer[:7]
  host = task.reward(examples, [right[0], wrong_step[0], right[2]])
  np.testing.assert_array_equal(host, [1.0, 0.0, 1.0])
  ids, lens = task.answer_arrays(examples)
  width = task.max_answer_len
  padded = np.zeros((3, width), np.int32)
  for i, c in enumerate([right[0], wrong_step[0], right[2]]):
    padded[i, : len(c)] = c
  clen = np.asarray([len(c) for c in (right[0], wrong_step[0], right[2])], np.int32)
  np.testing.assert_array_equal(np.asarray(task.jax_reward(ids, lens, padded, clen)), host)


@pytest.mark.parametrize(
  ("kwargs", "match"),
  [({"operations": "+-"}, "column addition"), ({"scratchpad": 1}, "`scratchpad` must be a bool")],
)
def test_scratchpad_bad_arguments(kwargs, match):
  with pytest.raises(ValueError, match=match):
    tasks.ArithmeticTask(scratchpad=kwargs.pop("scratchpad", True), **kwargs)
