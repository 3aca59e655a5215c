"""`RolloutEngine`: active partial rollouts (APRIL) with per-token behaviour log-probs (CoPRIS).

APRIL (Zhou et al. 2025, https://arxiv.org/abs/2509.18521; slime's
`--partial-rollout` / `--over-sampling-batch-size`,
https://github.com/THUDM/slime): launch more groups than a training batch
needs, stop as soon as `target_groups` groups are complete (a group = all G
samples of one prompt finished), and recycle every unfinished group (its
finished members included) into a FIFO buffer that is resumed FIRST at the
next collection, continued by the newer policy. CoPRIS (Qu et al. 2025,
https://arxiv.org/abs/2511.02755) keeps the behaviour log-prob and the policy
version of every token, so a recycled sample's tokens carry the log-prob of
the policy that generated them and the trainer's importance weights
(`rlx.objectives.rollout_correction`, CTPO / cumulative losses) apply per token.

Prompt flow (the data cursor stays exact on resume): the engine PULLS fresh
prompts from a `source(n)` callable, exactly as many as it launches: at a
collection with b groups in the buffer it pulls `launch - b` prompts
(`launch = ceil(over_provision * target_groups)`), so after the first
collection it pulls `target_groups` per collection on average, and every
pulled prompt is either returned in a batch or held in the buffer. A run
checkpoints its prompt source's cursor AND `engine.state_dict()` together;
restoring both resumes with nothing lost or repeated. Each prompt comes with
the caller's integer key (e.g. the example's index in its split), stored in
the buffer, so the caller can find the example (answer, metadata) of every
returned group after a restore.

Each collection returns exactly `target_groups` complete groups (a fixed
batch shape, so the train step never recompiles), oldest first; groups that
completed beyond the target stay in the buffer (in order) and are returned
first next time, with no further generation. `over_provision=1.0` is
synchronous: every launched group completes and the buffer stays empty.

Sampling randomness: sample j of the group with engine id u draws its t-th
token (t counts its prefix) from `fold_in(fold_in(fold_in(rng, u), j), t)`
with the `rng` of the collection that generates it (`Sampler.generate_requests`).
"""

import dataclasses
import math
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np

# Finish codes of a buffered sample.
_RUNNING, _STOP, _LENGTH = 0, 1, 2
_FINISH = {"stop": _STOP, "length": _LENGTH}


class PartialRollouts(NamedTuple):
  """`target_groups` complete groups of G samples; rows group-major (row g * G + j).

  Attributes:
    keys: i64[N] the caller's key of each group's prompt (N = target_groups).
    prompt_tokens: i32[N * G, max_prompt_len] each row's prompt, right-padded with 0.
    prompt_lengths: i32[N * G].
    tokens: i32[N * G, max_new_tokens] response tokens, right-padded with 0.
    logprobs: f32[N * G, max_new_tokens] the behaviour log-prob of each
      token, recorded by the policy version that generated it (0 on padding).
    versions: i32[N * G, max_new_tokens] that version per token (-1 on padding).
    lengths: i32[N * G] response tokens per row.
    stopped: bool[N * G] True: ended with a stop token; False: max_new_tokens.
    group_index: i32[N * G] the row's group, 0..N-1.
    staleness: i32[N * G, max_new_tokens] `policy_version - versions` on the
      response tokens, 0 on padding.
    stats: per-collection figures (`RolloutEngine.collect`).
  """

  keys: np.ndarray
  prompt_tokens: np.ndarray
  prompt_lengths: np.ndarray
  tokens: np.ndarray
  logprobs: np.ndarray
  versions: np.ndarray
  lengths: np.ndarray
  stopped: np.ndarray
  group_index: np.ndarray
  staleness: np.ndarray
  stats: dict[str, Any]


@dataclasses.dataclass
class _Group:
  uid: int
  key: int
  prompt: np.ndarray  # i32[n]
  tokens: list  # G lists of ints
  logprobs: list  # G lists of floats
  versions: list  # G lists of ints
  finish: list  # G finish codes

  @property
  def complete(self) -> bool:
    return all(f != _RUNNING for f in self.finish)


class RolloutEngine:
  """APRIL-style partial rollouts over a `Sampler` (module docstring).

  Args:
    sampler: an `rlx.sampling.Sampler`; its `max_slots` are the fixed
      concurrent slots the launched groups share.
    num_samples: G, samples per prompt (group size).
    target_groups: complete groups each `collect` returns.
    over_provision: >= 1; `ceil(over_provision * target_groups)` groups are in
      flight per collection (buffered ones first). 1.0 = synchronous.

  Raises:
    ValueError: bad arguments.
  """

  def __init__(
    self, sampler: Any, *, num_samples: int, target_groups: int, over_provision: float = 1.0
  ):
    if not hasattr(sampler, "generate_requests") or not hasattr(sampler, "config"):
      raise ValueError(f"`sampler` must be an rlx.sampling.Sampler, got {type(sampler).__name__}.")
    for name, v in (("num_samples", num_samples), ("target_groups", target_groups)):
      if not isinstance(v, int | np.integer) or isinstance(v, bool) or v < 1:
        raise ValueError(f"`{name}` must be an int >= 1, got {v!r}.")
    op = over_provision
    if isinstance(op, bool) or not isinstance(op, int | float) or not math.isfinite(op) or op < 1:
      raise ValueError(f"`over_provision` must be a finite number >= 1, got {op!r}.")
    self.sampler = sampler
    self.num_samples = int(num_samples)
    self.target_groups = int(target_groups)
    self.over_provision = float(op)
    self.launch_groups = math.ceil(self.over_provision * self.target_groups - 1e-9)
    self.max_prompt_len = int(sampler.config.max_prompt_len)
    self.max_new_tokens = int(sampler.config.max_new_tokens)
    self._buffer: list[_Group] = []
    self._next_uid = 0
    self.last_stats: dict[str, Any] = {}

  # ------------------------------------------------------------------------------------
  # Buffer.

  @property
  def buffered_groups(self) -> int:
    """Groups held for the next collection (unfinished, or complete beyond the target)."""
    return len(self._buffer)

  def buffer_keys(self) -> list[int]:
    """The caller's keys of the buffered groups, FIFO order."""
    return [g.key for g in self._buffer]

  def state_dict(self) -> dict[str, np.ndarray]:
    """The buffer as a fixed-shape pytree of numpy arrays (for an orbax checkpoint).

    Shapes depend only on the engine's settings (C = launch_groups slots, G,
    max_prompt_len, max_new_tokens), so `state_dict()` of a fresh engine is a
    valid restore target. `count` groups are valid, FIFO order.
    """
    c, g, m, p = self.launch_groups, self.num_samples, self.max_new_tokens, self.max_prompt_len
    out = {
      "count": np.asarray(len(self._buffer), np.int32),
      "next_uid": np.asarray(self._next_uid, np.int64),
      "uid": np.zeros((c,), np.int64),
      "key": np.zeros((c,), np.int64),
      "prompt": np.zeros((c, p), np.int32),
      "prompt_len": np.zeros((c,), np.int32),
      "tokens": np.zeros((c, g, m), np.int32),
      "logprobs": np.zeros((c, g, m), np.float32),
      "versions": np.full((c, g, m), -1, np.int32),
      "lengths": np.zeros((c, g), np.int32),
      "finish": np.zeros((c, g), np.int32),
    }
    for i, grp in enumerate(self._buffer):
      out["uid"][i], out["key"][i] = grp.uid, grp.key
      out["prompt"][i, : grp.prompt.size] = grp.prompt
      out["prompt_len"][i] = grp.prompt.size
      for j in range(g):
        n = len(grp.tokens[j])
        out["tokens"][i, j, :n] = grp.tokens[j]
        out["logprobs"][i, j, :n] = grp.logprobs[j]
        out["versions"][i, j, :n] = grp.versions[j]
        out["lengths"][i, j] = n
        out["finish"][i, j] = grp.finish[j]
    return out

  def load_state_dict(self, state: dict[str, Any]) -> None:
    """Restores the buffer from `state_dict()` output (e.g. an orbax checkpoint's extra item).

    Raises:
      ValueError: missing keys or shapes of another engine configuration.
    """
    ref = self.state_dict()
    if not isinstance(state, dict) or set(state) != set(ref):
      got = sorted(state) if isinstance(state, dict) else type(state).__name__
      raise ValueError(f"`state` must have the keys {sorted(ref)}, got {got}.")
    arrays = {k: np.asarray(v) for k, v in state.items()}
    for k, v in arrays.items():
      if v.shape != ref[k].shape:
        raise ValueError(
          f"`state[{k!r}]` has shape {v.shape}, expected {ref[k].shape} (launch_groups="
          f"{self.launch_groups}, num_samples={self.num_samples}, max_prompt_len="
          f"{self.max_prompt_len}, max_new_tokens={self.max_new_tokens})."
        )
    count = int(arrays["count"])
    if not 0 <= count <= self.launch_groups:
      raise ValueError(f"`state['count']`={count} outside [0, {self.launch_groups}].")
    groups = []
    for i in range(count):
      n = arrays["lengths"][i]
      groups.append(
        _Group(
          uid=int(arrays["uid"][i]),
          key=int(arrays["key"][i]),
          prompt=arrays["prompt"][i, : arrays["prompt_len"][i]].astype(np.int32),
          tokens=[arrays["tokens"][i, j, : n[j]].tolist() for j in range(self.num_samples)],
          logprobs=[arrays["logprobs"][i, j, : n[j]].tolist() for j in range(self.num_samples)],
          versions=[arrays["versions"][i, j, : n[j]].tolist() for j in range(self.num_samples)],
          finish=[int(f) for f in arrays["finish"][i]],
        )
      )
    self._buffer = groups
    self._next_uid = int(arrays["next_uid"])

  # ------------------------------------------------------------------------------------
  # collect.

  def _fresh(self, source: Callable[[int], Sequence[Any]], n: int) -> list[_Group]:
    items = list(source(n)) if n else []
    if len(items) != n:
      raise ValueError(f"`source({n})` returned {len(items)} prompts, expected {n}.")
    out = []
    g = self.num_samples
    for i, item in enumerate(items):
      if not (isinstance(item, tuple | list) and len(item) == 2):
        raise ValueError(
          f"`source` item {i} must be a (key, prompt token ids) pair, got {item!r:.80}."
        )
      key, prompt = item
      if not isinstance(key, int | np.integer) or isinstance(key, bool):
        raise ValueError(f"`source` item {i}: the key must be an int, got {key!r}.")
      prompt = np.asarray(prompt)
      if prompt.ndim != 1 or not prompt.size or not np.issubdtype(prompt.dtype, np.integer):
        raise ValueError(f"`source` item {i}: the prompt must be a non-empty 1-D int sequence.")
      if prompt.size > self.max_prompt_len:
        raise ValueError(
          f"`source` item {i}: prompt of {prompt.size} tokens > "
          f"max_prompt_len={self.max_prompt_len}."
        )
      empty = [[[] for _ in range(g)] for _ in range(3)]
      out.append(_Group(self._next_uid, int(key), prompt.astype(np.int32), *empty, [_RUNNING] * g))
      self._next_uid += 1
    if self._next_uid >= 2**31:
      raise ValueError("The engine ran out of group ids (2**31).")
    return out

  def collect(
    self,
    params: Any,
    source: Callable[[int], Sequence[tuple[int, Sequence[int]]]],
    rng: jax.Array,
    *,
    policy_version: int,
    kv_scales: tuple[Any, Any] | None = None,
    params_update: Callable[[], tuple[Any, int] | None] | None = None,
  ) -> PartialRollouts:
    """One collection: resume the buffer, top up with fresh prompts, stop at the target.

    Args:
      params: the current policy params (version `policy_version`).
      source: `source(n)` returns n `(key, prompt token ids)` pairs, the next
        fresh prompts (called once, possibly with n = 0 not at all).
      rng: PRNG key of this collection.
      policy_version: version of `params`, recorded on every token generated now.
      kv_scales: passed to `Sampler.generate_requests`.
      params_update: optional in-flight weight update (PipelineRL), passed to
        `Sampler.generate_requests`: `f() -> None | (params, version)` at every
        scheduling point; the samples in flight continue with the newer
        params and their tokens record its version. The batch's staleness is
        then measured from the newest version the collection reached
        (`stats["policy_version"]`).

    Returns:
      `PartialRollouts` of `target_groups` complete groups, oldest first.
      `stats`: groups_returned, groups_recycled (buffered after the call),
      groups_fresh (prompts pulled), groups_resumed (buffered before),
      off_policy_token_fraction (returned response tokens of an older
      version), staleness_histogram ({staleness: tokens}), max_staleness,
      mean_staleness, generated_tokens, tokens_per_s, slot_utilisation
      (generated tokens / (decode steps * slots)), decode_steps, syncs,
      prefill_tokens (prompt and recycled prefixes recomputed), preemptions,
      params_updates (in-flight), policy_version (the newest version that
      generated tokens in it: the staleness reference), wall_s.
    """
    if not isinstance(policy_version, int | np.integer) or isinstance(policy_version, bool):
      raise ValueError(f"`policy_version` must be an int, got {policy_version!r}.")
    if policy_version < 0:
      raise ValueError(f"`policy_version` must be >= 0, got {policy_version}.")
    version = int(policy_version)
    newest = max((max(v) for g in self._buffer for v in g.versions if v), default=-1)
    if newest > version:
      raise ValueError(
        f"`policy_version`={version} is older than a buffered token's version {newest}; "
        "versions must not decrease."
      )
    t0 = time.perf_counter()
    resumed = len(self._buffer)
    fresh = self._fresh(source, self.launch_groups - resumed)
    groups = self._buffer + fresh
    # Pulled prompts are buffered at once: a collection interrupted in the sampler
    # (members are only updated after it returns) loses nothing.
    self._buffer = list(groups)
    complete0 = sum(g.complete for g in groups)
    rows = [(gi, j) for gi, grp in enumerate(groups) for j in range(self.num_samples)
            if grp.finish[j] == _RUNNING]  # fmt: skip
    passed = (
      "decode_steps", "generated_tokens", "syncs", "prefill_tokens", "preemptions",
      "params_updates",
    )  # fmt: skip
    stats: dict[str, Any] = dict.fromkeys(passed, 0)
    if rows and complete0 < self.target_groups:
      row_group = np.asarray([gi for gi, _ in rows], np.int64)
      need = np.bincount(row_group, minlength=len(groups))
      has_rows = need > 0
      target = self.target_groups

      def stop_when(done: np.ndarray) -> bool:
        got = np.bincount(row_group, weights=done, minlength=len(groups))
        return complete0 + int(((got == need) & has_rows).sum()) >= target

      out = self.sampler.generate_requests(
        params,
        [groups[gi].prompt for gi, _ in rows],
        prompt_index=[groups[gi].uid for gi, _ in rows],
        sample_index=[j for _, j in rows],
        prefix_tokens=[groups[gi].tokens[j] for gi, j in rows],
        prefix_logprobs=[groups[gi].logprobs[j] for gi, j in rows],
        rng=rng,
        # With no spare group every launched group must finish: no early stop to check.
        stop_when=stop_when if len(groups) > self.target_groups else None,
        kv_scales=kv_scales,
        policy_version=version,
        params_update=params_update,
      )
      for r, (gi, j) in enumerate(rows):
        grp = groups[gi]
        n = int(out.lengths[r])
        old = len(grp.tokens[j])
        if n < old or out.tokens[r, :old].tolist() != grp.tokens[j]:
          raise RuntimeError("internal: the sampler changed a resumed sample's prefix")
        grp.tokens[j] = out.tokens[r, :n].tolist()
        grp.logprobs[j] = grp.logprobs[j] + out.logprobs[r, old:n].tolist()
        grp.versions[j] = grp.versions[j] + out.versions[r, old:n].tolist()
        grp.finish[j] = _FINISH.get(out.finish_reason[r], _RUNNING)
      stats.update({k: out.stats[k] for k in passed})
      version = max(version, int(out.versions.max(initial=version)))
    done = [g for g in groups if g.complete][: self.target_groups]
    if len(done) < self.target_groups:
      raise RuntimeError(
        f"internal: {len(done)} complete groups after generation, expected {self.target_groups}"
      )
    done_ids = {id(g) for g in done}
    self._buffer = [g for g in groups if id(g) not in done_ids]
    result = self._pack(done, version)
    wall = time.perf_counter() - t0
    mask = np.arange(self.max_new_tokens)[None, :] < result.lengths[:, None]
    stale = result.staleness[mask]
    hist = np.bincount(stale) if stale.size else np.zeros((1,), np.int64)
    slots = int(self.sampler.config.max_slots)
    steps = int(stats["decode_steps"])
    stats.update(
      {
        "groups_returned": len(done),
        "groups_recycled": len(self._buffer),
        "groups_recycled_complete": sum(g.complete for g in self._buffer),
        "groups_fresh": len(fresh),
        "groups_resumed": resumed,
        "response_tokens": int(stale.size),
        "off_policy_token_fraction": float((stale > 0).mean()) if stale.size else 0.0,
        "staleness_histogram": {int(s): int(c) for s, c in enumerate(hist) if c},
        "max_staleness": int(stale.max()) if stale.size else 0,
        "mean_staleness": float(stale.mean()) if stale.size else 0.0,
        "policy_version": version,
        "tokens_per_s": stats["generated_tokens"] / wall if wall > 0 else float("inf"),
        "slot_utilisation": stats["generated_tokens"] / (steps * slots) if steps else 0.0,
        "wall_s": wall,
      }
    )
    self.last_stats = stats
    return result._replace(stats=stats)

  def _pack(self, groups: list[_Group], version: int) -> PartialRollouts:
    g, m, p = self.num_samples, self.max_new_tokens, self.max_prompt_len
    b = len(groups) * g
    prompt_tokens = np.zeros((b, p), np.int32)
    prompt_lengths = np.zeros((b,), np.int32)
    tokens = np.zeros((b, m), np.int32)
    logprobs = np.zeros((b, m), np.float32)
    versions = np.full((b, m), -1, np.int32)
    lengths = np.zeros((b,), np.int32)
    stopped = np.zeros((b,), bool)
    for gi, grp in enumerate(groups):
      for j in range(g):
        r = gi * g + j
        n = len(grp.tokens[j])
        prompt_tokens[r, : grp.prompt.size] = grp.prompt
        prompt_lengths[r] = grp.prompt.size
        tokens[r, :n] = grp.tokens[j]
        logprobs[r, :n] = grp.logprobs[j]
        versions[r, :n] = grp.versions[j]
        lengths[r] = n
        stopped[r] = grp.finish[j] == _STOP
    staleness = np.where(versions >= 0, version - versions, 0).astype(np.int32)
    return PartialRollouts(
      keys=np.asarray([grp.key for grp in groups], np.int64),
      prompt_tokens=prompt_tokens,
      prompt_lengths=prompt_lengths,
      tokens=tokens,
      logprobs=logprobs,
      versions=versions,
      lengths=lengths,
      stopped=stopped,
      group_index=np.repeat(np.arange(len(groups), dtype=np.int32), g),
      staleness=staleness,
      stats={},
    )
