"""rlx.tasks: verifiable tasks (prompts per split + reward) for RL of language models.

Contract:

  task = make_task("arithmetic", num_digits=3, seed=0)   # or any name in TASKS
  examples = task.split("train")                         # "train" | "dev" | "test"
  ex = examples[0]   # Example(prompt_ids, answer, target_ids, prompt_text)
  rewards = task.reward(examples[:2], completions)        # f32[N], unpadded token ids
  rewards = task.reward_padded(examples[:2], completion, completion_lengths)
  answer_ids, answer_lengths = task.answer_arrays(examples[:2])       # i32[N, A], i32[N]
  rewards = task.jax_reward(answer_ids, answer_lengths, completion, completion_lengths)
  # (jax_reward is None when the reward is not expressible in JAX)

  task.tokenizer, task.stop_token_ids, task.max_prompt_len, task.max_answer_len

`jax_reward` equals `reward` exactly. Completions are response tokens only:
`completion_lengths` counts tokens up to and including a final stop token.
"""

from rlx.tasks._arithmetic import (
  ArithmeticTask,
)
from rlx.tasks._base import (
  SPLITS,
  Example,
  JaxReward,
  Task,
)
from rlx.tasks._exact_match import (
  exact_match,
  exact_match_jax_reward,
  exact_match_rewards,
)
from rlx.tasks._registry import (
  TASKS,
  make_task,
  register_task,
)

register_task("arithmetic", ArithmeticTask)

__all__ = [
  "SPLITS",
  "TASKS",
  "ArithmeticTask",
  "Example",
  "JaxReward",
  "Task",
  "exact_match",
  "exact_match_jax_reward",
  "exact_match_rewards",
  "make_task",
  "register_task",
]
