"""Public surface, registry, custom tasks (the package example), and the shared checks."""

import doctest

import jax.numpy as jnp
import numpy as np
import pytest

import rlx.tasks
from rlx import policy, tasks

PUBLIC = {
  "ALPHABET",
  "ANSWER_SOURCES",
  "INSTRUCTIONS",
  "OPERATIONS",
  "SPLITS",
  "TASKS",
  "ArithmeticTask",
  "Example",
  "ExtractedAnswer",
  "GSM8KTask",
  "JaxReward",
  "RewardFn",
  "Task",
  "exact_match",
  "exact_match_jax_reward",
  "exact_match_rewards",
  "positional_match",
  "positional_match_jax_reward",
  "positional_match_rewards",
  "extract_answer",
  "load_records",
  "make_task",
  "numbers_match",
  "parse_number",
  "reference_answer",
  "register_task",
}


def test_public_surface():
  assert set(tasks.__all__) == PUBLIC
  for name in PUBLIC:
    assert hasattr(tasks, name), name
  assert {"arithmetic", "gsm8k"} <= set(tasks.TASKS)
  with pytest.raises(TypeError):
    tasks.TASKS["x"] = tasks.ArithmeticTask  # read-only view


def test_package_docstring_example_runs():
  result = doctest.testmod(rlx.tasks, raise_on_error=False, verbose=False)
  assert result.attempted >= 8 and result.failed == 0


def test_make_task_and_register_errors():
  with pytest.raises(ValueError, match=r"Unknown task 'nope'.*'arithmetic'.*'gsm8k'"):
    tasks.make_task("nope")
  with pytest.raises(ValueError, match="already registered"):
    tasks.register_task("arithmetic", tasks.ArithmeticTask)
  with pytest.raises(ValueError, match="callable"):
    tasks.register_task("x_not_callable", 3)
  tasks.register_task("x_not_a_task", lambda: object(), overwrite=True)
  with pytest.raises(ValueError, match="'x_not_a_task'.*not a rlx.tasks.Task"):
    tasks.make_task("x_not_a_task")


def test_unknown_split_names_the_task():
  task = tasks.ArithmeticTask(train_size=10, dev_size=1, test_size=1)
  with pytest.raises(ValueError, match=r"Task 'arithmetic' has no split 'valid'.*'train'"):
    task.split("valid")


def _echo_task(reward_fn=None, alphabet="abc:", **kwargs):
  tok = policy.CharTokenizer(alphabet)
  examples = {
    "train": [{"prompt": "ab:", "answer": "ab", "target": "ab"}, {"prompt": "c:", "answer": "c"}],
    "dev": [tasks.Example(prompt_ids=tok.encode("ca:"), answer="ca")],
  }
  reward_fn = reward_fn or (lambda completion, answer: float(completion == answer))
  return tasks.task_from_examples("echo", examples, reward_fn, tok, **kwargs)


def test_custom_task_from_examples():
  task = _echo_task()
  tok = task.tokenizer
  train = task.split("train")
  assert train[0].prompt_ids == tuple(tok.encode("ab:", add_special_tokens=True))
  assert train[0].target_ids == (*tok.encode("ab"), tok.eos_id) and train[1].target_ids == ()
  assert task.max_answer_len == 3 and task.max_prompt_len == 4
  assert task.stop_token_ids == (tok.eos_id,) and task.jax_reward is None
  with pytest.raises(ValueError, match="'echo' has no split 'test'"):
    task.split("test")
  completions = [[*tok.encode("ab"), tok.eos_id], tok.encode("b")]
  assert task.reward(train, completions).tolist() == [1.0, 0.0]
  chat = _echo_task(
    chat_template=True, system_prompt="be brief", max_answer_len=8, alphabet="abc: \nsytemrifun"
  )
  assert chat.split("train")[1].prompt_text == "system: be brief\nuser: c:\nassistant: "
  # An exact-match JAX reward plugs in; it agrees with the host reward.
  jax_task = _echo_task(jax_reward=tasks.exact_match_jax_reward((tok.eos_id,)))
  answer_ids, answer_lengths = jax_task.answer_arrays(train)
  completion, mask = tok.pad(completions, length=4)
  np.testing.assert_array_equal(
    jax_task.jax_reward(answer_ids, answer_lengths, completion, mask.sum(1)),
    jax_task.reward(train, completions),
  )


@pytest.mark.parametrize(
  "value, match",
  [
    (float("nan"), r"'echo': rewards must be finite; entries \[0, 1\]"),
    (float("inf"), "must be finite"),
    ("1.0", "reward_fn must return a float, got str"),
    (None, "reward_fn must return a float, got NoneType"),
  ],
)
def test_bad_reward_values(value, match):
  task = _echo_task(lambda completion, answer: value)
  with pytest.raises(ValueError, match=match):
    task.reward(task.split("train"), [[3], [4]])


class _ShapeTask(tasks.Task):
  """A subclass whose score returns the wrong shape (and documents the subclass route)."""

  def __init__(self, rewards):
    self.name = "shape"
    self.tokenizer = policy.CharTokenizer("ab")
    self.stop_token_ids = (self.tokenizer.eos_id,)
    self.max_prompt_len, self.max_answer_len = 1, 2
    self._rewards = rewards
    self._examples = (tasks.Example(prompt_ids=(3,), answer="a"),) * 2

  def split(self, name):
    return self._examples

  def score(self, examples, completions):
    return self._rewards


@pytest.mark.parametrize(
  "rewards, match",
  [
    (np.zeros((2, 1)), r"'shape': rewards must have shape \(2,\).*\(2, 1\)"),
    (np.zeros(3), r"shape \(3,\)"),
    (1.0, r"shape \(\)"),
    (["a", "b"], "must be numbers"),
  ],
)
def test_reward_shape_checks(rewards, match):
  task = _ShapeTask(rewards)
  with pytest.raises(ValueError, match=match):
    task.reward(task.split("train"), [[3], [4]])
  assert _ShapeTask([1, 0]).reward(task.split("train"), [[3], [4]]).dtype == np.float32


@pytest.mark.parametrize(
  "completions, match",
  [
    ("ab", "must be a sequence of token-id sequences, got str"),
    (None, "got NoneType"),
    (np.zeros((2, 3), np.int32), r"padded array of shape \(2, 3\).*reward_padded"),
    ([[3]], "got 1 completions for 2 examples"),
    ([[3], "a"], r"completions\[1\] is a str"),
    ([[3], 4], r"completions\[1\] must be a sequence of token ids, got int"),
    ([[3], [1.5]], r"completions\[1\] must be a 1-D sequence of ints.*float"),
    ([[3], [[1]]], r"completions\[1\] must be a 1-D sequence of ints"),
    ([[3], [-1]], r"completions\[1\] has negative token ids \[-1\]"),
  ],
)
def test_completion_type_checks(completions, match):
  task = _ShapeTask([1.0, 0.0])
  with pytest.raises(ValueError, match=r"'shape': .*" + match):
    task.reward(task.split("train"), completions)


def test_example_and_padded_input_checks():
  task = _ShapeTask([1.0, 0.0])
  examples = task.split("train")
  assert task.reward(examples, [np.array([3, 2]), ()]).tolist() == [1.0, 0.0]  # arrays and empties
  assert task.reward(examples, [jnp.array([3, 2]), jnp.zeros((0,), jnp.int32)]).shape == (2,)
  with pytest.raises(ValueError, match=r"padded array of shape \(2, 3\)"):
    task.reward(examples, jnp.zeros((2, 3), jnp.int32))
  with pytest.raises(ValueError, match=r"'shape': `examples` must be a sequence of Example"):
    task.reward(examples[0], [[3]])
  with pytest.raises(ValueError, match=r"examples\[1\] must be an Example, got dict"):
    task.reward([examples[0], {}], [[3], [3]])
  with pytest.raises(ValueError, match=r"`completion` must be an integer array \[N, T\]"):
    task.reward_padded(examples, np.zeros(3, np.int32), np.zeros(2, np.int32))
  with pytest.raises(ValueError, match=r"`completion_lengths` must be integers of shape \(2,\)"):
    task.reward_padded(examples, np.zeros((2, 3), np.int32), np.zeros(3, np.int32))
  with pytest.raises(ValueError, match=r"`completion_lengths` must lie in \[0, 3\]"):
    task.reward_padded(examples, np.zeros((2, 3), np.int32), np.array([1, 4]))
  with pytest.raises(ValueError, match=r"`length` must be a positive int, got 0"):
    task.answer_arrays(examples, length=0)
  long = _ShapeTask([1.0])
  long._examples = (tasks.Example(prompt_ids=(3,), answer="abab"),)
  with pytest.raises(
    ValueError, match=r"'shape': answer 'abab' has 4 tokens, more than `length`=2"
  ):
    long.answer_arrays(long.split("train"))
  with pytest.raises(ValueError, match="prompt_ids is empty"):
    tasks.Example(prompt_ids=(), answer="a")
  with pytest.raises(ValueError, match="answer must be a str"):
    tasks.Example(prompt_ids=(1,), answer=1)
  with pytest.raises(ValueError, match="prompt_ids must be a sequence of token ids, got str"):
    tasks.Example(prompt_ids="12", answer="1")
  assert tasks.Example(prompt_ids=np.array([1, 2]), answer="1").prompt_ids == (1, 2)


@pytest.mark.parametrize(
  "examples, match",
  [
    ([], r"'echo': `examples` must map split names"),
    ({"dev": [{"prompt": "a", "answer": "a"}]}, r"'echo': `examples` has no 'train' split"),
    ({"train": [], "dev": []}, r"'echo': split 'train' is empty"),
    ({"train": [{"prompt": "a", "answer": "a"}], "valid": []}, r"unknown split names \['valid'\]"),
    ({"train": [{"prompt": "a"}]}, r"field 'answer' is missing from examples\['train'\]\[0\]"),
    ({"train": [{"prompt": "a", "answer": 1}]}, r"field 'answer' of .* must be a str, got int"),
    ({"train": ["a"]}, r"examples\['train'\]\[0\] must be an Example or a mapping"),
    ({"train": "ab"}, r"examples\['train'\] must be a sequence of records, got str"),
    ({"train": [{"prompt": "a", "answer": "a"}]}, r"no record has a 'target'.*max_answer_len"),
    ({"train": [{"prompt": "a", "answer": "a", "target": 3}]}, r"'target' .* must be a str"),
  ],
)
def test_custom_task_errors(examples, match):
  tok = policy.CharTokenizer("ab")
  with pytest.raises(ValueError, match=match):
    tasks.task_from_examples("echo", examples, lambda c, a: 0.0, tok)


def test_custom_task_argument_errors():
  tok = policy.CharTokenizer("ab")
  ok = {"train": [{"prompt": "a", "answer": "a", "target": "a"}]}
  with pytest.raises(ValueError, match="reward_fn must be callable"):
    tasks.task_from_examples("echo", ok, None, tok)
  with pytest.raises(ValueError, match="non-empty str"):
    tasks.task_from_examples("", ok, lambda c, a: 0.0, tok)
  with pytest.raises(ValueError, match="'echo': `stop_token_ids` is empty"):
    tasks.task_from_examples("echo", ok, lambda c, a: 0.0, tok, stop_token_ids=())
  with pytest.raises(ValueError, match="'echo': `max_answer_len` must be an int >= 1"):
    tasks.task_from_examples("echo", ok, lambda c, a: 0.0, tok, max_answer_len=0)
  bad_prompt = {"train": [{"prompt": "x", "answer": "a"}]}
  with pytest.raises(ValueError, match=r"'echo': cannot tokenize 'x': .*characters \['x'\]"):
    tasks.task_from_examples("echo", bad_prompt, lambda c, a: 0.0, tok, max_answer_len=2)
  with pytest.raises(ValueError, match="'echo': jax_reward must be callable"):
    tasks.task_from_examples("echo", ok, lambda c, a: 0.0, tok, jax_reward=3)
