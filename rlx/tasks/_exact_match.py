"""Token-level exact match: the host rule and the same rule in JAX.

A completion is correct when its tokens are exactly the answer's tokens
followed by one stop token (or, with `require_stop=False`, also the answer's
tokens alone, e.g. a completion cut at `max_new_tokens`). Anything after the
stop token is padding and never looked at.
"""

from collections.abc import Sequence

import jax.numpy as jnp
import numpy as np

from rlx.tasks._base import JaxReward


def exact_match(
  answer: Sequence[int],
  completion: Sequence[int],
  stop_token_ids: Sequence[int],
  *,
  require_stop: bool = True,
) -> bool:
  """Host rule: `completion == answer + [stop]` (or `== answer` if not `require_stop`)."""
  answer, completion = list(answer), list(completion)
  n = len(answer)
  if completion[:n] != answer:
    return False
  if len(completion) == n + 1:
    return completion[n] in stop_token_ids
  return len(completion) == n and not require_stop


def exact_match_jax_reward(
  stop_token_ids: Sequence[int], *, require_stop: bool = True, correct: float = 1.0
) -> JaxReward:
  """A `JaxReward` equal to `exact_match` on every valid input.

  Args:
    stop_token_ids: the tokens that may end a completion.
    require_stop: whether a completion without its stop token can be correct.
    correct: the reward of a correct completion (others get 0).

  Returns:
    `fn(answer_ids i32[N, A], answer_lengths i32[N], completion i32[N, T],
    completion_lengths i32[N]) -> f32[N]`, pure and jittable; `completion`
    is right-padded, `completion_lengths` counts tokens including the stop
    token and entries past it are ignored.
  """
  stops = tuple(int(s) for s in stop_token_ids)
  if not stops:
    raise ValueError("`stop_token_ids` must name at least one token.")

  def reward(answer_ids, answer_lengths, completion, completion_lengths):
    answer_ids = jnp.asarray(answer_ids, jnp.int32)
    completion = jnp.asarray(completion, jnp.int32)
    answer_lengths = jnp.asarray(answer_lengths, jnp.int32)
    completion_lengths = jnp.asarray(completion_lengths, jnp.int32)
    if answer_ids.ndim != 2 or completion.ndim != 2:
      raise ValueError(
        f"answer_ids [N, A] and completion [N, T] must be 2-D, got {answer_ids.shape=} "
        f"{completion.shape=}."
      )
    num = answer_ids.shape[0]
    if (
      completion.shape[0] != num
      or answer_lengths.shape != (num,)
      or completion_lengths.shape != (num,)
    ):
      raise ValueError(
        f"Inconsistent batch sizes: {answer_ids.shape=} {answer_lengths.shape=} "
        f"{completion.shape=} {completion_lengths.shape=}."
      )
    # One common width W > A so that position answer_lengths (<= A) exists.
    width = max(answer_ids.shape[1] + 1, completion.shape[1])
    pos = jnp.arange(width)[None, :]
    comp = jnp.pad(completion, ((0, 0), (0, width - completion.shape[1])), constant_values=-1)
    comp = jnp.where(pos < completion_lengths[:, None], comp, -1)
    ans = jnp.pad(answer_ids, ((0, 0), (0, width - answer_ids.shape[1])), constant_values=-1)
    prefix_ok = jnp.all((pos >= answer_lengths[:, None]) | (comp == ans), axis=1)
    after = jnp.take_along_axis(comp, answer_lengths[:, None], axis=1)[:, 0]
    is_stop = jnp.isin(after, jnp.asarray(stops, jnp.int32))
    ok = prefix_ok & is_stop & (completion_lengths == answer_lengths + 1)
    if not require_stop:
      ok = ok | (prefix_ok & (completion_lengths == answer_lengths))
    return jnp.where(ok, jnp.float32(correct), jnp.float32(0.0))

  return reward


def exact_match_rewards(
  answers: Sequence[Sequence[int]],
  completions: Sequence[Sequence[int]],
  stop_token_ids: Sequence[int],
  *,
  require_stop: bool = True,
  correct: float = 1.0,
) -> np.ndarray:
  """Host batch of `exact_match`: float32[N] of `correct` / 0."""
  return np.asarray(
    [
      correct if exact_match(a, c, stop_token_ids, require_stop=require_stop) else 0.0
      for a, c in zip(answers, completions, strict=True)
    ],
    np.float32,
  )
