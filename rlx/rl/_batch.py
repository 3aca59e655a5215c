"""`RolloutBatch`: what a rollout engine hands the learner, and the train batch built from it."""

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

FINISH_REASONS = ("length", "stop")  # index = the `stopped` flag


@flax.struct.dataclass
class RolloutBatch:
  """One batch of rollouts, sequence-major (B = rows, S = max_prompt_len + max_new_tokens).

  Row b holds prompt b // K's tokens followed directly by its response and
  right padding (K = samples per prompt, rows prompt-major), so the train
  step's default positions 0..S-1 are the positions the sampler used.

  Attributes:
    tokens: i32[B, S] prompt + response + 0 padding.
    prompt_mask: bool[B, S] True on prompt tokens.
    response_mask: bool[B, S] True on response tokens (a final stop token
      included).
    rollout_logp: f32[B, S] the sampler's log-prob of each response token
      (log softmax(logits / temperature)), 0 elsewhere: the behaviour policy.
    policy_version: i32[B, S] version of the params that sampled each
      response token (-1 off the response); a partial-rollout engine mixes
      versions inside one row.
    stopped: bool[B] True if the row ended on a stop token, False if it hit
      max_new_tokens (`finish_reasons` gives the strings).
    group_ids: i32[B] the prompt (group) each row belongs to, 0..num_groups-1.
    prompt_lengths: i32[B] prompt tokens per row.
    response_lengths: i32[B] response tokens per row (stop token included).
    rewards: f32[B] scalar reward per row (NaN until `with_rewards`).
  """

  tokens: Int[Array, "B S"]
  prompt_mask: Bool[Array, "B S"]
  response_mask: Bool[Array, "B S"]
  rollout_logp: Float[Array, "B S"]
  policy_version: Int[Array, "B S"]
  stopped: Bool[Array, " B"]
  group_ids: Int[Array, " B"]
  prompt_lengths: Int[Array, " B"]
  response_lengths: Int[Array, " B"]
  rewards: Float[Array, " B"]

  @property
  def num_rows(self) -> int:
    return int(self.tokens.shape[0])

  @property
  def finish_reasons(self) -> list[str]:
    """Per row: "stop" or "length" (host list)."""
    return [FINISH_REASONS[int(s)] for s in np.asarray(self.stopped)]

  def responses(self) -> list[list[int]]:
    """Response token ids per row without padding (host lists; stop token kept)."""
    tokens = np.asarray(self.tokens)
    starts = np.asarray(self.prompt_lengths)
    lengths = np.asarray(self.response_lengths)
    return [
      tokens[b, s : s + n].tolist() for b, (s, n) in enumerate(zip(starts, lengths, strict=True))
    ]

  def with_rewards(self, rewards: Any) -> "RolloutBatch":
    """A copy with `rewards` (f32[B]) set; checks the shape and finiteness where concrete."""
    rewards = jnp.asarray(rewards, jnp.float32)
    if rewards.shape != (self.tokens.shape[0],):
      raise ValueError(
        f"`rewards` must have shape [B] = ({self.tokens.shape[0]},), got {rewards.shape}."
      )
    if not isinstance(rewards, jax.core.Tracer):  # concrete: name the rows that are not finite
      bad = np.flatnonzero(~np.isfinite(np.asarray(rewards)))
      if bad.size:
        raise ValueError(
          f"`rewards` must be finite; rows {bad[:8].tolist()} are not "
          f"({np.asarray(rewards)[bad[:8]].tolist()})."
        )
    return self.replace(rewards=rewards)


def build_rollout_batch(
  prompt_tokens: Int[Array, "B P"],
  prompt_lengths: Int[Array, " B"],
  response_tokens: Int[Array, "B T"],
  response_logp: Float[Array, "B T"],
  response_lengths: Int[Array, " B"],
  stopped: Bool[Array, " B"],
  group_ids: Int[Array, " B"],
  policy_version: Int[Array, ""] | int,
) -> RolloutBatch:
  """Packs per-row prompts and responses into a `RolloutBatch` (traceable, no host work).

  tokens[b] = prompt_tokens[b, :P_b] ++ response_tokens[b, :L_b] ++ 0 ... of
  width S = P + T, with the masks, log-probs and version laid out alike.

  Args:
    prompt_tokens: i32[B, P] prompts, left-aligned and right-padded.
    prompt_lengths: i32[B] in [1, P].
    response_tokens: i32[B, T] sampled tokens, right-padded.
    response_logp: f32[B, T] their sampling log-probs.
    response_lengths: i32[B] in [0, T].
    stopped: bool[B] whether each row ended on a stop token.
    group_ids: i32[B] prompt index of each row.
    policy_version: the params version that sampled the batch (scalar).

  Returns:
    A `RolloutBatch` with `rewards` NaN.
  """
  b, p = prompt_tokens.shape
  if response_tokens.shape[0] != b or response_logp.shape != response_tokens.shape:
    raise ValueError(
      f"`response_tokens` {response_tokens.shape} and `response_logp` {response_logp.shape} "
      f"must be [B, T] with B = {b} (the rows of `prompt_tokens` {prompt_tokens.shape})."
    )
  for name, x in (
    ("prompt_lengths", prompt_lengths),
    ("response_lengths", response_lengths),
    ("stopped", stopped),
    ("group_ids", group_ids),
  ):
    if tuple(x.shape) != (b,):
      raise ValueError(f"`{name}` must have shape [B] = ({b},), got {tuple(x.shape)}.")
  t = response_tokens.shape[1]
  s = p + t
  pos = jnp.arange(s, dtype=jnp.int32)[None, :]
  plen = jnp.asarray(prompt_lengths, jnp.int32)[:, None]
  rlen = jnp.asarray(response_lengths, jnp.int32)[:, None]
  prompt_mask = pos < plen
  response_mask = (pos >= plen) & (pos < plen + rlen)
  prompt_part = jnp.take_along_axis(
    jnp.asarray(prompt_tokens, jnp.int32), jnp.clip(pos, 0, p - 1).repeat(b, 0), axis=1
  )
  resp_index = jnp.clip(pos - plen, 0, t - 1)
  resp_part = jnp.take_along_axis(jnp.asarray(response_tokens, jnp.int32), resp_index, axis=1)
  resp_logp = jnp.take_along_axis(jnp.asarray(response_logp, jnp.float32), resp_index, axis=1)
  tokens = jnp.where(prompt_mask, prompt_part, jnp.where(response_mask, resp_part, 0))
  version = jnp.asarray(policy_version, jnp.int32)
  return RolloutBatch(
    tokens=tokens,
    prompt_mask=prompt_mask,
    response_mask=response_mask,
    rollout_logp=jnp.where(response_mask, resp_logp, 0.0),
    policy_version=jnp.where(response_mask, version, -1),
    stopped=jnp.asarray(stopped, bool),
    group_ids=jnp.asarray(group_ids, jnp.int32),
    prompt_lengths=jnp.asarray(prompt_lengths, jnp.int32),
    response_lengths=jnp.asarray(response_lengths, jnp.int32),
    rewards=jnp.full((b,), jnp.nan, jnp.float32),
  )


def response_arrays(batch: RolloutBatch) -> tuple[Int[Array, "B T"], Int[Array, " B"]]:
  """The responses as `(completion i32[B, S], lengths i32[B])`.

  Each row's response tokens shifted to column 0 and right-padded with 0 (the
  layout `Task.jax_reward` takes); traceable.
  """
  s = batch.tokens.shape[1]
  index = jnp.arange(s, dtype=jnp.int32)[None, :] + batch.prompt_lengths[:, None]
  shifted = jnp.take_along_axis(batch.tokens, jnp.clip(index, 0, s - 1), axis=1)
  valid = jnp.arange(s)[None, :] < batch.response_lengths[:, None]
  return jnp.where(valid, shifted, 0), batch.response_lengths


def train_batch(
  batch: RolloutBatch,
  advantages: Float[Array, " B"],
  keep: Float[Array, " B"],
) -> dict[str, jax.Array]:
  """The `rlx.train` batch of a rollout batch: tokens, loss_mask, advantages, rollout_logp.

  loss_mask = response_mask * keep (keep = 0 drops a whole row, e.g. the
  MC-GRPO pivot). `old_logp` / `ref_logp` are added by the learner.

  Args:
    batch: the rollout batch (B rows).
    advantages: f32[B] per-row advantages.
    keep: f32[B] 1 to train on the row, 0 to drop it.

  Returns:
    dict with tokens i32[B, S], loss_mask f32[B, S], advantages f32[B],
    rollout_logp f32[B, S].
  """
  b = batch.tokens.shape[0]
  for name, x in (("advantages", advantages), ("keep", keep)):
    if tuple(x.shape) != (b,):
      raise ValueError(f"`{name}` must have shape [B] = ({b},), got {tuple(x.shape)}.")
  mask = batch.response_mask & (jnp.asarray(keep)[:, None] != 0)
  return {
    "tokens": batch.tokens,
    "loss_mask": mask.astype(jnp.float32),
    "advantages": jnp.asarray(advantages, jnp.float32),
    "rollout_logp": batch.rollout_logp,
  }
