"""rlx.tasks: verifiable tasks (prompts per split + a reward) for RL of language models.

Contract:

  task = make_task("arithmetic", num_digits=3, seed=0)   # any name in TASKS
  examples = task.split("train")                         # "train" | "dev" | "test"
  ex = examples[0]        # Example(prompt_ids, answer, target_ids, prompt_text)
  rewards = task.reward(examples, completions)           # f32[N]; unpadded token ids
  rewards = task.reward_padded(examples, completion, completion_lengths)  # i32[N, T], i32[N]
  answer_ids, answer_lengths = task.answer_arrays(examples)               # i32[N, A], i32[N]
  rewards = task.jax_reward(answer_ids, answer_lengths, completion, completion_lengths)
  task.tokenizer, task.stop_token_ids, task.max_prompt_len, task.max_answer_len

`jax_reward` (None when the reward is not expressible in JAX) equals `reward`
exactly. Completions are response tokens only; `completion_lengths` counts
tokens up to and including a final stop token. Every error names the task.

Built-in tasks (`TASKS`):
  "arithmetic"  embedded, no download: reversed-digit multi-digit arithmetic,
                character tokenizer, token exact match in JAX (`ArithmeticTask`)
  "gsm8k"       GSM8K-format JSONL/Parquet for HF checkpoints: chat template,
                "####" / \\boxed{} / last-number extraction, numeric check,
                optional format reward (`GSM8KTask`)

Custom tasks: subclass `Task` (set `name`, `tokenizer`, `stop_token_ids`,
`max_prompt_len`, `max_answer_len`, optionally `jax_reward`; implement
`split(name)` and `score(examples, completions)`), or build one from records
and a reward on the decoded text, and register it so configs can name it:

>>> from rlx import policy, tasks
>>> def reward_fn(completion: str, answer: str) -> float:
...   return float(completion.strip() == answer)
>>> task = tasks.task_from_examples(
...   "echo",
...   {"train": [{"prompt": "ab:", "answer": "ab", "target": "ab"}],
...    "test": [{"prompt": "ba:", "answer": "ba"}]},
...   reward_fn,
...   policy.CharTokenizer("ab:"),
... )
>>> test = task.split("test")
>>> tok = task.tokenizer
>>> task.reward(test, [tok.encode("ba") + [tok.eos_id]]).tolist()
[1.0]
>>> task.reward(test, [tok.encode("ab")]).tolist()
[0.0]
>>> task.max_answer_len  # the longest target, "ab" + <eos>
3
>>> tasks.register_task("echo", lambda: task, overwrite=True)
>>> tasks.make_task("echo").name
'echo'
"""

from rlx.tasks._arithmetic import (
  ALPHABET,
  OPERATIONS,
  ArithmeticTask,
)
from rlx.tasks._base import (
  SPLITS,
  Example,
  JaxReward,
  Task,
)
from rlx.tasks._custom import (
  RewardFn,
  task_from_examples,
)
from rlx.tasks._data import (
  load_records,
)
from rlx.tasks._exact_match import (
  exact_match,
  exact_match_jax_reward,
  exact_match_rewards,
  positional_match,
  positional_match_jax_reward,
  positional_match_rewards,
)
from rlx.tasks._gsm8k import (
  INSTRUCTIONS,
  GSM8KTask,
  reference_answer,
)
from rlx.tasks._math_answers import (
  ANSWER_SOURCES,
  ExtractedAnswer,
  extract_answer,
  numbers_match,
  parse_number,
)
from rlx.tasks._registry import (
  TASKS,
  make_task,
  register_task,
)

register_task("arithmetic", ArithmeticTask)
register_task("gsm8k", GSM8KTask)

__all__ = [
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
]
