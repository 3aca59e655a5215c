"""The embedded arithmetic task: splits, answers, and jax_reward == reward."""

import functools

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
