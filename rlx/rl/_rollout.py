"""The rollout side of the loop: `collect(params, prompts, rng) -> RolloutBatch`.

`SyncRollout` implements it over `rlx.sampling.Sampler.generate` (every
iteration samples fresh from the current params). `PartialRollout` runs
APRIL-style over-provisioning with recycled unfinished groups (Zhou et al.
2025, https://arxiv.org/abs/2509.18521) over `rlx.sampling.RolloutEngine`:
it decides how many prompts it consumes, so it PULLS them from a source
(`collect_groups(params, source, rng, policy_version=v) -> (batch, keys)`)
and its buffer is checkpointed with the data cursor.
"""

import math
from collections.abc import Sequence
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from rlx.rl import _batch


class Rollout(Protocol):
  """A rollout engine: G samples for each prompt, packed as a `RolloutBatch`."""

  def collect(
    self, params: Any, prompts: Sequence[Sequence[int]], rng: jax.Array, *, policy_version: int = 0
  ) -> _batch.RolloutBatch:
    """Samples `num_samples` responses per prompt with `params`.

    Args:
      params: the policy params (a device pytree on the sampler's mesh).
      prompts: N token-id lists.
      rng: PRNG key of this collection.
      policy_version: version number of `params`, recorded per token.

    Returns:
      A `RolloutBatch` of N * num_samples prompt-major rows (rewards NaN).
    """


def sampler_kwargs(
  config: ml_collections.ConfigDict, task: Any, *, rows: int, greedy: bool
) -> dict[str, Any]:
  """The `rlx.sampling.SamplerConfig` fields of a run (rollout or greedy eval).

  Zero pool sizes in `config.sampler` mean "enough for `rows` sequences at full
  length at once": max_slots = rows, num_pages = rows * pages per sequence.

  Args:
    config: the RL config.
    task: the `rlx.tasks.Task` (prompt/answer lengths, stop tokens).
    rows: the largest number of sequences one `generate` call holds.
    greedy: temperature 0 (evaluation) instead of `config.rl.temperature`.

  Returns:
    A dict of SamplerConfig keyword arguments.
  """
  s = config.sampler
  max_new = int(s.max_new_tokens) or int(task.max_answer_len)
  max_prompt = int(task.max_prompt_len)
  slots = int(s.max_slots) or int(rows)
  pages_per_sequence = math.ceil((max_prompt + max_new) / int(s.page_size))
  num_pages = int(s.num_pages) or slots * pages_per_sequence
  return dict(
    max_slots=slots,
    page_size=int(s.page_size),
    num_pages=num_pages,
    max_prompt_len=max_prompt,
    max_new_tokens=max_new,
    kv_dtype=str(s.kv_dtype),
    temperature=0.0 if greedy else float(config.rl.temperature),
    top_k=int(s.top_k),
    top_p=float(s.top_p),
    stop_token_ids=tuple(int(t) for t in task.stop_token_ids),
    steps_per_sync=int(s.steps_per_sync),
  )


def make_sampler(model_config: Any, kwargs: dict[str, Any], mesh: Any) -> Any:
  """`rlx.sampling.Sampler(model_config, SamplerConfig(**kwargs), mesh=mesh)`."""
  from rlx import sampling  # noqa: PLC0415 (the sampler is optional at import time)

  return sampling.Sampler(model_config, sampling.SamplerConfig(**kwargs), mesh=mesh)


def pad_prompts(prompts: Sequence[Sequence[int]], width: int) -> tuple[np.ndarray, np.ndarray]:
  """Prompts as `(tokens i32[N, width] right-padded with 0, lengths i32[N])`."""
  if not len(prompts):
    raise ValueError("`prompts` is empty.")
  lengths = np.asarray([len(p) for p in prompts], np.int32)
  if lengths.min() < 1 or lengths.max() > width:
    bad = [i for i, n in enumerate(lengths) if n < 1 or n > width]
    raise ValueError(f"prompts {bad[:5]} have lengths outside [1, {width}] (max_prompt_len).")
  tokens = np.zeros((len(prompts), width), np.int32)
  for i, p in enumerate(prompts):
    tokens[i, : len(p)] = p
  return tokens, lengths


_build = jax.jit(_batch.build_rollout_batch)


class SyncRollout:
  """Synchronous rollouts: `sampler.generate` with the current params, every call.

  Attributes:
    sampler: an `rlx.sampling.Sampler` (or anything with its `generate`).
    num_samples: K, samples per prompt.
    max_prompt_len, max_new_tokens: the sampler's static lengths; the batch
      width is their sum.
  """

  def __init__(self, sampler: Any, *, num_samples: int, max_prompt_len: int, max_new_tokens: int):
    if num_samples < 1:
      raise ValueError(f"`num_samples` must be >= 1, got {num_samples}.")
    self.sampler = sampler
    self.num_samples = int(num_samples)
    self.max_prompt_len = int(max_prompt_len)
    self.max_new_tokens = int(max_new_tokens)
    self.last_stats: dict[str, Any] = {}

  def collect(
    self, params: Any, prompts: Sequence[Sequence[int]], rng: jax.Array, *, policy_version: int = 0
  ) -> _batch.RolloutBatch:
    """See `Rollout.collect`."""
    prompt_tokens, prompt_lengths = pad_prompts(prompts, self.max_prompt_len)
    out = self.sampler.generate(
      params, [list(p) for p in prompts], num_samples=self.num_samples, rng=rng
    )
    n = len(prompts) * self.num_samples
    tokens = jnp.asarray(out.tokens)
    if tokens.shape != (n, self.max_new_tokens):
      raise ValueError(
        f"The sampler returned tokens of shape {tokens.shape}, expected "
        f"[N * num_samples, max_new_tokens] = {(n, self.max_new_tokens)}."
      )
    group = np.asarray(out.prompt_index, np.int32)
    expected = np.repeat(np.arange(len(prompts), dtype=np.int32), self.num_samples)
    if not np.array_equal(group, expected):
      raise ValueError("The sampler's rows are not prompt-major (row i*G + j = prompt i).")
    stopped = np.asarray([r == "stop" for r in out.finish_reason], bool)
    self.last_stats = dict(out.stats)
    return _build(
      np.repeat(prompt_tokens, self.num_samples, axis=0),
      np.repeat(prompt_lengths, self.num_samples),
      tokens,
      jnp.asarray(out.logprobs, jnp.float32),
      jnp.asarray(out.lengths, jnp.int32),
      stopped,
      group,
      np.int32(policy_version),
    )


def _spread(values: jax.Array, prompt_lengths: jax.Array, width: int, fill: int) -> jax.Array:
  """Per-response-token values [B, T] laid out on the batch's [B, width] sequence positions."""
  b, t = values.shape
  pos = jnp.arange(width, dtype=jnp.int32)[None, :]
  index = jnp.clip(pos - prompt_lengths[:, None], 0, t - 1)
  return jnp.take_along_axis(values, jnp.broadcast_to(index, (b, width)), axis=1)


@jax.jit
def _build_partial(
  prompt_tokens, prompt_lengths, tokens, logprobs, versions, lengths, stopped, group
):
  batch = _batch.build_rollout_batch(
    prompt_tokens, prompt_lengths, tokens, logprobs, lengths, stopped, group, 0
  )
  spread = _spread(versions, batch.prompt_lengths, batch.tokens.shape[1], -1)
  return batch.replace(policy_version=jnp.where(batch.response_mask, spread, -1))


class PartialRollout:
  """APRIL partial rollouts for the loop, over `rlx.sampling.RolloutEngine`.

  Over-provisioning (Zhou et al. 2025, https://arxiv.org/abs/2509.18521):
  `ceil(over_provision * target_groups)` groups share the sampler's slots,
  the collection stops once `target_groups` are complete, and the unfinished
  ones are resumed first at the next collection by the newer policy. The
  batch carries each token's behaviour log-prob and policy version (CoPRIS,
  https://arxiv.org/abs/2511.02755), so the trainer's rollout correction
  weights (old_logp - rollout_logp) see the staleness of recycled tokens.

  Prompt flow: `collect_groups` PULLS prompts from `source(n)` (n `(key,
  prompt ids)` pairs, e.g. the examples' indices in their split): as many as
  it launches, so the source's cursor and `state_dict()` checkpointed
  together resume exactly. It returns the batch and the keys of its groups
  (rows group-major), which the loop maps back to its examples.
  """

  def __init__(
    self,
    sampler: Any,
    *,
    num_samples: int,
    target_groups: int,
    over_provision: float,
  ):
    from rlx import sampling  # noqa: PLC0415 (the sampler is optional at import time)

    self.engine = sampling.RolloutEngine(
      sampler,
      num_samples=num_samples,
      target_groups=target_groups,
      over_provision=over_provision,
    )
    self.num_samples = int(num_samples)
    self.last_stats: dict[str, Any] = {}

  def collect_groups(
    self, params: Any, source: Any, rng: jax.Array, *, policy_version: int
  ) -> tuple[_batch.RolloutBatch, np.ndarray]:
    """One collection: `(RolloutBatch of target_groups * G rows, i64[target_groups] keys)`."""
    out = self.engine.collect(params, source, rng, policy_version=int(policy_version))
    self.last_stats = dict(out.stats)
    batch = _build_partial(
      out.prompt_tokens, out.prompt_lengths, out.tokens, out.logprobs, out.versions,
      out.lengths, out.stopped, out.group_index,
    )  # fmt: skip
    return batch, out.keys

  def metrics(self) -> dict[str, float]:
    """Host floats of the last collection, under `rollout/`."""
    st = self.last_stats
    out = {
      f"rollout/{k}": float(st[k])
      for k in (
        "groups_returned", "groups_recycled", "groups_fresh", "groups_resumed",
        "off_policy_token_fraction", "mean_staleness", "max_staleness",
        "slot_utilisation", "tokens_per_s", "prefill_tokens",
      )
    }  # fmt: skip
    for s, n in st["staleness_histogram"].items():
      out[f"rollout/staleness_{s}_tokens"] = float(n)
    return out

  def state_dict(self) -> dict[str, np.ndarray]:
    """The buffer (see `rlx.sampling.RolloutEngine.state_dict`)."""
    return self.engine.state_dict()

  def load_state_dict(self, state: dict[str, Any]) -> None:
    self.engine.load_state_dict(state)


class Collected:
  """A `Rollout` that hands back an already collected batch (for `Learner.iteration`)."""

  def __init__(self, batch: _batch.RolloutBatch):
    self.batch = batch

  def collect(
    self, params: Any, prompts: Sequence[Sequence[int]], rng: jax.Array, *, policy_version: int = 0
  ) -> _batch.RolloutBatch:
    """Returns the batch (its rows must answer `prompts`, G rows each)."""
    del params, rng, policy_version
    if self.batch.num_rows % max(len(prompts), 1):
      raise ValueError(
        f"{len(prompts)} prompts do not divide the batch's {self.batch.num_rows} rows."
      )
    return self.batch
