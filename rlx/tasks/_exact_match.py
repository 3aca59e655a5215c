"""Token-level exact match: the host rule and the same rule in JAX.

A completion is correct when its tokens are exactly the answer's tokens
followed by one stop token (or, with `require_stop=False`, also the answer's
tokens alone, e.g. a completion cut at `max_new_tokens`). Anything after the
stop token is padding and never looked at.

`positional_match` is the graded counterpart (partial credit per answer
position, 1 exactly when `exact_match` holds), also on the host and in JAX.
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


def _graded(matches: int, length: int) -> np.float32:
  """The reward of a completion that is not an exact match: min(m / L, L / (L + 1)) in f32."""
  if length <= 0:
    return np.float32(0.0)
  frac = np.float32(matches) / np.float32(length)
  return min(frac, np.float32(length) / np.float32(length + 1))


def positional_match(
  answer: Sequence[int],
  completion: Sequence[int],
  stop_token_ids: Sequence[int],
  *,
  require_stop: bool = True,
) -> float:
  """Host rule: partial credit for the answer positions a completion gets right.

  With L = len(answer) and m the number of positions i < min(L, len(completion))
  where `completion[i] == answer[i]`:

    1.0                        if exact_match(answer, completion, ...) holds,
    min(m / L, L / (L + 1))    otherwise (0 when L == 0).

  So the reward is the fraction of answer positions right, and exactly 1 only
  for a completion `exact_match` accepts; one with every answer token right
  that is still wrong (its stop token missing under `require_stop`, a wrong
  stop token, or extra tokens after the answer) gets L / (L + 1). Tokens past
  position L - 1 earn nothing; a short completion is scored on the positions
  it has. The value is computed in float32 exactly as `positional_match_jax_reward`.
  """
  answer, completion = list(answer), list(completion)
  if exact_match(answer, completion, stop_token_ids, require_stop=require_stop):
    return 1.0
  matches = sum(a == c for a, c in zip(answer, completion, strict=False))
  return float(_graded(matches, len(answer)))


def positional_match_rewards(
  answers: Sequence[Sequence[int]],
  completions: Sequence[Sequence[int]],
  stop_token_ids: Sequence[int],
  *,
  require_stop: bool = True,
) -> np.ndarray:
  """Host batch of `positional_match`: float32[N] in [0, 1]."""
  return np.asarray(
    [
      positional_match(a, c, stop_token_ids, require_stop=require_stop)
      for a, c in zip(answers, completions, strict=True)
    ],
    np.float32,
  )


def positional_match_jax_reward(
  stop_token_ids: Sequence[int], *, require_stop: bool = True
) -> JaxReward:
  """A `JaxReward` equal to `positional_match` on every valid input (bit for bit).

  Args:
    stop_token_ids: the tokens that may end a completion.
    require_stop: whether a completion without its stop token can be correct.

  Returns:
    `fn(answer_ids i32[N, A], answer_lengths i32[N], completion i32[N, T],
    completion_lengths i32[N]) -> f32[N]`, pure and jittable, with the inputs
    of `exact_match_jax_reward`: `completion` is right-padded, entries at or
    past `completion_lengths` are ignored, as are `answer_ids` entries at or
    past `answer_lengths`. The graded values min(m / L, L / (L + 1)) come from
    a float32 table built on the host with `positional_match`'s arithmetic, so
    device and host agree exactly whatever the backend's division.
  """
  exact = exact_match_jax_reward(stop_token_ids, require_stop=require_stop)

  def reward(answer_ids, answer_lengths, completion, completion_lengths):
    ok = exact(answer_ids, answer_lengths, completion, completion_lengths) > 0
    answer_ids = jnp.asarray(answer_ids, jnp.int32)
    completion = jnp.asarray(completion, jnp.int32)
    answer_lengths = jnp.asarray(answer_lengths, jnp.int32)
    completion_lengths = jnp.asarray(completion_lengths, jnp.int32)
    a = answer_ids.shape[1]
    # The completion's first A positions (padded with -1, which no answer holds).
    comp = completion[:, :a]
    comp = jnp.pad(comp, ((0, 0), (0, a - comp.shape[1])), constant_values=-1)
    pos = jnp.arange(a)[None, :]
    hit = (pos < answer_lengths[:, None]) & (pos < completion_lengths[:, None])
    matches = jnp.sum(hit & (comp == answer_ids), axis=1)
    table = jnp.asarray(
      np.asarray([[_graded(m, n) for m in range(a + 1)] for n in range(a + 1)], np.float32)
    )
    graded = table[jnp.clip(answer_lengths, 0, a), matches]
    return jnp.where(ok, jnp.float32(1.0), graded)

  return reward
