"""GSM8K-format task: JSONL / Parquet loading, chat template, reward, every error."""

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rlx import policy, tasks

COUNTS = range(40, 52, 2)
QUESTIONS = [
  f"Natalia sold clips to {n} of her friends in April, and then she sold half as many "
  "clips in May. How many clips did Natalia sell altogether?"
  for n in COUNTS
]


def _solution(n):
  return f"In May she sold {n}/2 = <<{n}/2={n // 2}>>{n // 2} clips.\n#### {n + n // 2:,}"


RECORDS = [{"question": q, "answer": _solution(n)} for q, n in zip(QUESTIONS, COUNTS, strict=True)]


def _jsonl(path, records):
  path.write_text("".join(json.dumps(r) + "\n" for r in records))
  return path


@pytest.fixture(scope="module")
def files(tmp_path_factory):
  d = tmp_path_factory.mktemp("data")
  train = _jsonl(d / "train.jsonl", RECORDS[:5])
  test = _jsonl(d / "test.jsonl", RECORDS[5:])
  renamed = [
    {"problem": r["question"], "solution": r["answer"], "id": i} for i, r in enumerate(RECORDS)
  ]
  pq.write_table(pa.Table.from_pylist(renamed[:5]), d / "train.parquet")
  return {"train": train, "test": test, "train_parquet": d / "train.parquet", "dir": d}


@pytest.fixture(scope="module")
def tok(hf_tokenizer_dir):
  return policy.Tokenizer(hf_tokenizer_dir)


def _completion(tok, text, stop=True):
  return [*tok.encode(text), tok.eos_id] if stop else tok.encode(text)


def test_jsonl_splits_prompts_and_targets(files, tok, hf_tokenizer_dir):
  task = tasks.make_task(
    "gsm8k",
    tokenizer=hf_tokenizer_dir,
    train_path=files["train"],
    test_path=files["test"],
    dev_size=2,
    seed=0,
  )
  assert isinstance(task.tokenizer, policy.Tokenizer)
  train, dev, test = (task.split(s) for s in tasks.SPLITS)
  assert (len(train), len(dev), len(test)) == (3, 2, 1)
  questions = {s: {e.prompt_text for e in task.split(s)} for s in tasks.SPLITS}
  assert not questions["train"] & questions["dev"]
  assert len(questions["train"] | questions["dev"]) == 5
  assert task.stop_token_ids == tok.eos_ids
  assert task.jax_reward is None and task.max_answer_len == 512
  (example,) = test
  assert example.answer == "75"
  content = QUESTIONS[5] + " " + tasks.INSTRUCTIONS["####"]
  text = tok.apply_chat_template([{"role": "user", "content": content}])
  assert example.prompt_text == text and text.startswith("<|im_start|>user\n")
  assert example.prompt_ids == tuple(tok.encode(text))
  assert task.max_prompt_len == max(len(e.prompt_ids) for s in tasks.SPLITS for e in task.split(s))
  target = tok.decode(example.target_ids)
  assert target == "In May she sold 50/2 = 25 clips.\n#### 75"  # calculator annotation dropped
  assert example.target_ids[-1] == tok.eos_id
  assert task.reward(test, [example.target_ids]).tolist() == [1.0]
  # Deterministic by seed; another seed draws another dev split.
  again = tasks.GSM8KTask(
    tokenizer=tok, train_path=files["train"], test_path=files["test"], dev_size=2
  )
  assert [e.split(s) for e in (again,) for s in tasks.SPLITS] == [train, dev, test]
  other = [
    tasks.GSM8KTask(
      tokenizer=tok, train_path=files["train"], test_path=files["test"], dev_size=2, seed=s
    ).split("dev")
    for s in range(1, 6)
  ]
  assert any(d != dev for d in other)


def test_parquet_with_field_names_matches_jsonl(files, tok):
  kwargs = dict(tokenizer=tok, dev_size=1, test_size=1, seed=4)
  from_jsonl = tasks.GSM8KTask(train_path=files["train"], **kwargs)
  from_parquet = tasks.GSM8KTask(
    train_path=files["train_parquet"], question_field="problem", answer_field="solution", **kwargs
  )
  for split in tasks.SPLITS:
    assert from_parquet.split(split) == from_jsonl.split(split)
  # a .json file holding one array of records
  array = files["dir"] / "train_array.json"
  array.write_text(json.dumps(RECORDS[:5]))
  assert tasks.GSM8KTask(train_path=array, **kwargs).split("train") == from_jsonl.split("train")


def test_reward_extraction_strict_and_format_reward(files, tok):
  task = tasks.GSM8KTask(
    tokenizer=tok, train_path=files["train"], test_path=files["test"], dev_size=1
  )
  examples = task.split("test") * 7
  texts = [
    ("so 25 + 50 = 75.\n#### 75", True),
    ("#### 75", False),  # no stop token (cut at max_answer_len): still read
    ("the answer is \\boxed{75}", True),
    ("she sold 75 clips", True),  # last number
    ("#### 74", True),
    ("#### 75.0", True),
    ("no idea", True),
  ]
  completions = [_completion(tok, t, stop) for t, stop in texts]
  np.testing.assert_array_equal(task.reward(examples, completions), [1, 1, 1, 1, 0, 1, 0])
  strict = tasks.GSM8KTask(
    tokenizer=tok,
    train_path=files["train"],
    test_path=files["test"],
    dev_size=1,
    strict=True,
    format_reward=0.1,
  )
  np.testing.assert_allclose(
    strict.reward(examples, completions), [1.1, 1.1, 0, 0, 0.1, 1.1, 0], rtol=1e-6
  )
  # Padded ids past the tokenizer's vocabulary (a model's padded rows) carry no text.
  padded_row = [*tok.encode("#### 75"), tok.vocab_size + 3, tok.eos_id]
  assert task.reward(examples[:1], [padded_row]).tolist() == [1.0]
  completion, lengths = tok.pad(completions)
  np.testing.assert_array_equal(
    task.reward_padded(examples, completion, lengths.sum(1)), task.reward(examples, completions)
  )


def test_boxed_format_system_prompt_and_plain_tokenizer(files, tok, plain_tokenizer_dir):
  task = tasks.GSM8KTask(
    tokenizer=tok,
    train_path=files["test"],
    dev_size=0,
    test_size=0,
    answer_format="boxed",
    system_prompt="You are a careful solver.",
  )
  (example,) = task.split("train")
  assert example.prompt_text.startswith("<|im_start|>system\nYou are a careful solver.<|im_end|>")
  assert "\\boxed{}" in example.prompt_text
  assert tok.decode(example.target_ids).endswith("The final answer is \\boxed{75}.")
  assert task.reward([example], [example.target_ids]).tolist() == [1.0]
  assert task.split("dev") == () and task.split("test") == ()
  plain = tasks.GSM8KTask(
    tokenizer=plain_tokenizer_dir,
    train_path=files["test"],
    dev_size=0,
    test_size=0,
    prompt_template="Q: {question}\nA:",
  )
  (example,) = plain.split("train")
  assert example.prompt_text == f"Q: {QUESTIONS[5]}\nA:"  # no template: the raw text
  with pytest.raises(ValueError, match="'gsm8k'.*no chat template"):
    tasks.GSM8KTask(
      tokenizer=plain_tokenizer_dir,
      train_path=files["test"],
      dev_size=0,
      test_size=0,
      chat_template=True,
    )


def test_bare_number_and_boxed_references(tmp_path, tok):
  path = _jsonl(
    tmp_path / "refs.jsonl",
    [
      {"question": "How many?", "answer": 42},
      {"question": "How many more?", "answer": "1,234"},
      {"question": "What fraction?", "answer": "so it is \\boxed{\\frac{3}{4}}"},
    ],
  )
  task = tasks.GSM8KTask(tokenizer=tok, train_path=path, dev_size=0, test_size=0, seed=1)
  answers = sorted(e.answer for e in task.split("train"))
  assert answers == ["1,234", "3/4", "42"]
  for example in task.split("train"):
    assert tok.decode(example.target_ids).endswith(f"#### {example.answer}")
  assert tasks.reference_answer("blah #### 7") == "7"
  assert tasks.reference_answer("no final answer") is None


def _error(tmp_path, tok, records=None, *, text=None, name="bad.jsonl", **kwargs):
  path = tmp_path / name
  if text is not None:
    path.write_text(text)
  else:
    _jsonl(path, records)
  kwargs.setdefault("dev_size", 0)
  kwargs.setdefault("test_size", 0)
  return lambda: tasks.GSM8KTask(tokenizer=tok, train_path=path, **kwargs)


@pytest.mark.parametrize(
  "case, match",
  [
    (dict(records=[{"question": "q?"}]), r"field 'answer' is missing from record 1 of .*bad.jsonl"),
    (
      dict(records=[{"question": "q?", "answer": "#### 1"}, {"answer": "#### 2"}]),
      r"field 'question' is missing from record 2",
    ),
    (
      dict(records=[{"prompt": "q?", "answer": "1"}], question_field="problem"),
      r"field 'problem' is missing",
    ),
    (dict(text=""), r"bad.jsonl is empty"),
    (dict(text="\n\n"), r"is empty"),
    (dict(text='{"question": "q", "answer": "1"}\n{oops\n'), r"line 2 of .*not valid JSON"),
    (dict(text="[1, 2]", name="bad.json"), r"record 1 of .*bad.json is a int"),
    (dict(text="a,b\n", name="bad.csv"), r"cannot read .*bad.csv"),
    (dict(records=[{"question": "q?", "answer": None}]), r"field 'answer' is null in record 1"),
    (dict(records=[{"question": "q?", "answer": "no number"}]), r"record 1 .* no final answer"),
    (dict(records=[{"question": "", "answer": "1"}]), r"'question' of record 1 .* non-empty str"),
    (dict(records=[{"question": "q?", "answer": ["1"]}]), r"'answer' of record 1 .* a str or"),
    (dict(records=[{"question": "q?", "answer": "1"}], dev_size=1), r"cannot draw dev_size=1"),
    (dict(records=[{"question": "q?", "answer": "1"}], max_prompt_len=3), r"max_prompt_len=3"),
    (dict(records=[{"question": "q?", "answer": "1"}], answer_format="xml"), r"answer_format"),
    (dict(records=[{"question": "q?", "answer": "1"}], prompt_template="Q:"), r"\{question\}"),
    (dict(records=[{"question": "q?", "answer": "1"}], max_answer_len=0), r"max_answer_len"),
    (dict(records=[{"question": "q?", "answer": "1"}], rtol=-1.0), r"rtol"),
  ],
)
def test_errors_name_the_task_and_file(tmp_path, tok, case, match):
  with pytest.raises(ValueError, match=r"'gsm8k'.*" + match if "'gsm8k'" not in match else match):
    _error(tmp_path, tok, **case)()


def test_file_level_errors(tmp_path, tok):
  with pytest.raises(ValueError, match=r"'gsm8k': no file .*missing.jsonl"):
    tasks.GSM8KTask(tokenizer=tok, train_path=tmp_path / "missing.jsonl")
  empty = tmp_path / "empty.parquet"
  schema = pa.schema([("question", pa.string()), ("answer", pa.string())])
  pq.write_table(pa.Table.from_pylist([], schema=schema), empty)
  with pytest.raises(ValueError, match=r"'gsm8k': .*empty.parquet is empty"):
    tasks.GSM8KTask(tokenizer=tok, train_path=empty)
  (tmp_path / "zero.parquet").write_bytes(b"")
  with pytest.raises(ValueError, match=r"zero.parquet is empty"):
    tasks.GSM8KTask(tokenizer=tok, train_path=tmp_path / "zero.parquet")
  (tmp_path / "junk.parquet").write_bytes(b"not parquet at all")
  with pytest.raises(ValueError, match=r"junk.parquet is not a Parquet file"):
    tasks.GSM8KTask(tokenizer=tok, train_path=tmp_path / "junk.parquet")
  pq.write_table(pa.Table.from_pylist([{"question": "q?"}]), tmp_path / "cols.parquet")
  with pytest.raises(ValueError, match=r"field 'answer' is missing from .*cols.parquet"):
    tasks.GSM8KTask(tokenizer=tok, train_path=tmp_path / "cols.parquet")
  with pytest.raises(ValueError, match=r"'gsm8k'.*tokenizer"):
    tasks.GSM8KTask(tokenizer=object(), train_path=tmp_path / "cols.parquet")
