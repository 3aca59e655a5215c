"""`AsyncRollout`: rollout in its own thread, on its own devices, ahead of the learner.

Asynchronous RL (as in AReaL, https://arxiv.org/abs/2505.24298, and
PipelineRL, https://arxiv.org/abs/2509.19128): the sampler keeps generating
while the learner trains, so neither side waits for the other. Here both run
in one process:

  rollout thread   params_v, v = latest published       (on the rollout mesh)
                   prompts     = source.next_batch()
                   batch       = rollout.collect(params_v, prompts, rng_i, policy_version=v)
                   queue.put(Item(i, batch, examples, v, source cursor after it))
  learner          item  = queue.get()                  (blocks while the queue is empty)
                   state = update(state, item.batch)    (on the train mesh)
                   publish(state.params, version(state))

The queue holds at most `queue_size` finished batches; the thread then waits,
so it never runs more than `queue_size` + 1 batches ahead. A published
version is copied onto the rollout mesh's devices (`rlx.train.copy_to`: a
device-to-device transfer where the meshes differ, new buffers where they
coincide), so the learner's donating train step never frees params the
sampler reads.

Every token records the version that sampled it (`RolloutBatch.policy_version`),
so the learner sees each batch's staleness. The run's data cursor is the
source position after the last batch the LEARNER took (`consumed_cursor`),
not after the last one sampled: a run killed with batches in the queue, or a
batch in flight, samples those prompts again on resume, so no prompt is lost
or trained twice.

Which log-probs enter which term (decoupled PPO, Hilton et al. 2021,
https://arxiv.org/abs/2110.00641, as AReaL uses it), per token of a batch
sampled by version v and trained by the learner at version u >= v:

  behaviour  mu        = pi_v, its log-probs `rollout_logp`, recorded by the sampler
  proximal   pi_prox   = `old_logp`: with `rl.old_logp = "current"` (default) the
                         learner's params before this update, pi_u (one forward pass);
                         "sampler": mu itself; "ewma": PPO-EWMA's average of past params
  policy     pi_theta  = `logp`, differentiated

  loss = -w * min(r * A, clip(r, 1 - eps_low, 1 + eps_high) * A),  r = pi_theta / pi_prox,
  w    = truncated (TIS) or masked (MIS) pi_prox / mu with train.use_rollout_correction
         (rlx.objectives.rollout_correction; w = 1 without it).

So the clip bounds each update's step from the proximal policy however stale
the batch is, and the behaviour -> proximal gap is corrected by the weight
alone. The batch's staleness u - v is logged per token (`staleness_mean`,
`staleness_max`, `staleness_hist`).

With partial rollouts (`rlx.rl.PartialRollout`, APRIL) the thread pulls its
prompts one by one and the weights are updated in flight (PipelineRL): at
every scheduling point of a collection the sampler takes the newest
published params, the samples in flight continue with them (their K/V
cached by older params stays in place), and every token records the version
that generated it, so one sample may span several versions. An item's
`version` is then the newest version of its collection (`rl.max_staleness`
bounds that lag; recycled tokens can be older and are reported per token),
and it carries the partial-rollout buffer after it, which the learner's
checkpoint saves with the cursor (`consumed_buffer`): a resumed run re-pulls
and re-generates what was queued or in flight, so no group is lost or
trained twice.

FP8 rollout (the sampler's FP8 `weight_dtype` / `kv_dtype`) runs on the
rollout side, in the thread: the engine's `Fp8Refresh` quantizes each
version's params when the thread takes them (in flight too, with partial
rollouts), and with static FP8 KV scales the thread recalibrates them, from
the new version's forward over the last batch it collected, before the first
collection with a newer version (`rlx.sampling.calibrate_kv_scales`; its
seconds are `kv_refresh_s`). The learner calibrates or restores the scales
before `start` and afterwards only reads them (a checkpoint), so nothing
races; a collection keeps the scales it started with (its cached K/V were
written with them), in-flight versions included. Restored scales were
calibrated with some older version: `start(scales_version=None)` has the
thread recalibrate after its first collection.
"""

import dataclasses
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import jax

from rlx.rl import _batch, _data


@dataclasses.dataclass(frozen=True)
class Item:
  """One batch of the queue.

  Attributes:
    index: the batch's number in the run's stream (its rng is `fold_in(key, index)`).
    batch: the `RolloutBatch` (rewards unset).
    examples: the N task examples it answers.
    version: the policy version that sampled it.
    cursor: the prompt source's cursor after its prompts.
    rollout_s: the seconds its collection took.
    metrics: the rollout engine's `metrics()` of its collection ({} if it has none).
    buffer: with partial rollouts, the rollout buffer (`state_dict()`) after it; else None.
    params: with `keep_params`, the params that sampled it (version `version`, on
      the rollout side), for a learner that recomputes the behaviour log-probs; else None.
  """

  index: int
  batch: _batch.RolloutBatch
  examples: list
  version: int
  cursor: dict
  rollout_s: float
  metrics: dict = dataclasses.field(default_factory=dict)
  buffer: dict | None = None
  params: Any = None


class AsyncRollout:
  """A rollout thread that fills a bounded queue from the latest published params.

  Args:
    rollout: the rollout engine over a sampler on the rollout mesh: a
      `rlx.rl.SyncRollout` (`collect`), or a `rlx.rl.PartialRollout`
      (`collect_groups`: prompts pulled one by one, weights updated in flight).
    source: the `PromptSource` of the train prompts (the thread owns it once
      started; batch_size 1 with a `PartialRollout`).
    place: `place(params) -> params` on the rollout mesh, in new buffers.
    key: the rollout key; batch i is sampled with `jax.random.fold_in(key, i)`.
    queue_size: the most finished batches waiting for the learner (>= 1).
    first_index: the number of the first batch (the iterations already done on resume).
    keep_params: each queued item carries the params that sampled it (`Item.params`;
      up to queue_size + 2 versions stay alive on the rollout devices), e.g. for
      `rl.old_logp = "behaviour"`. Not with a `PartialRollout`, whose batches mix versions.
  """

  def __init__(
    self,
    rollout: Any,
    source: _data.PromptSource,
    *,
    place: Callable[[Any], Any],
    key: jax.Array,
    queue_size: int,
    first_index: int = 0,
    keep_params: bool = False,
  ):
    if queue_size < 1:
      raise ValueError(f"`queue_size` must be >= 1, got {queue_size}.")
    if keep_params and hasattr(rollout, "collect_groups"):
      raise ValueError(
        "`keep_params` needs one params version per batch; a PartialRollout's batches mix them."
      )
    self.keep_params = bool(keep_params)
    self.rollout = rollout
    self.source = source
    self.place = place
    self.key = key
    self.queue: queue.Queue[Item] = queue.Queue(maxsize=int(queue_size))
    self.partial = hasattr(rollout, "collect_groups")
    if self.partial and source.batch_size != 1:
      raise ValueError(
        f"A PartialRollout pulls prompts one by one: `source.batch_size` must be 1, got "
        f"{source.batch_size}."
      )
    self.consumed_cursor = source.cursor
    # The partial-rollout buffer after the last batch the learner took (what a resume loads).
    self.consumed_buffer = rollout.state_dict() if self.partial else None
    self._index_of = {id(e): i for i, e in enumerate(source.examples)} if self.partial else {}
    self._next_index = int(first_index)
    self._latest: tuple[Any, int] | None = None
    self._lock = threading.Lock()
    self._stop = threading.Event()
    self._error: BaseException | None = None
    self._thread: threading.Thread | None = None
    self.busy_s = 0.0  # the thread's seconds collecting (its idle time is the rest)
    # FP8 KV scales: the version they were last calibrated with, and the recalibrations.
    self._scales_version: int | None = None
    self._last_batch: _batch.RolloutBatch | None = None
    self.kv_refreshes = 0
    self.kv_refresh_s = 0.0

  def publish(self, params: Any, version: int) -> None:
    """Makes `params` (policy version `version`) the ones the next collections sample with.

    Raises:
      ValueError: `version` is older than the last published one.
    """
    with self._lock:
      last = None if self._latest is None else self._latest[1]
    if last is not None and int(version) < last:
      raise ValueError(f"`version` {version} is older than the last published {last}.")
    placed = self.place(params)
    with self._lock:
      self._latest = (placed, int(version))

  def start(self, *, scales_version: int | None = -1) -> None:
    """Starts the thread (after the first `publish`).

    Args:
      scales_version: the version the engine's static FP8 KV scales were
        calibrated with: -1 (default) = the published one; None = unknown
        (e.g. restored from a checkpoint): recalibrated after the first collection.
    """
    if self._latest is None:
      raise ValueError("`publish` the first params before `start`.")
    self._scales_version = self._latest[1] if scales_version == -1 else scales_version
    self._thread = threading.Thread(target=self._run, name="rlx-rollout", daemon=True)
    self._thread.start()

  def _pull(self, n: int) -> list[tuple[int, Any]]:
    """The next n prompts of the source as (index in its examples, prompt ids)."""
    examples = [self.source.next_batch()[0] for _ in range(n)]
    return [(self._index_of[id(e)], e.prompt_ids) for e in examples]

  def _newer_than(self, version: int) -> Callable[[], tuple[Any, int] | None]:
    """An in-flight `params_update`: the latest published params once newer than seen."""
    seen = [version]

    def update() -> tuple[Any, int] | None:
      with self._lock:
        params, latest = self._latest
      if latest <= seen[0]:
        return None
      seen[0] = latest
      return params, latest

    return update

  def _collect(self, params: Any, version: int, rng: jax.Array) -> tuple[Any, list, int]:
    """One collection: (batch, its examples, the newest version that sampled it)."""
    if not self.partial:
      examples = self.source.next_batch()
      prompts = [e.prompt_ids for e in examples]
      return self.rollout.collect(params, prompts, rng, policy_version=version), examples, version
    batch, keys = self.rollout.collect_groups(
      params, self._pull, rng, policy_version=version, params_update=self._newer_than(version)
    )
    examples = [self.source.examples[int(k)] for k in keys]
    return batch, examples, int(self.rollout.last_stats["policy_version"])

  def _recalibrate(self, params: Any, version: int) -> None:
    """Static FP8 KV scales from `params` over the last collected batch, once per new version."""
    fp8 = getattr(self.rollout, "fp8", None)
    if fp8 is None or not fp8.kv_fp8 or self._last_batch is None:
      return
    if version == self._scales_version:
      return
    t0 = time.perf_counter()
    batch = self._last_batch
    fp8.calibrate(params, batch.tokens, batch.prompt_mask | batch.response_mask)
    jax.block_until_ready(fp8.kv_scales)
    self._scales_version = version
    self.kv_refreshes += 1
    self.kv_refresh_s += time.perf_counter() - t0

  def _run(self) -> None:
    try:
      while not self._stop.is_set():
        with self._lock:
          params, version = self._latest
        t0 = time.perf_counter()
        self._recalibrate(params, version)
        index = self._next_index
        batch, examples, version = self._collect(
          params, version, jax.random.fold_in(self.key, index)
        )
        jax.block_until_ready(batch.tokens)
        self._last_batch = batch
        seconds = time.perf_counter() - t0
        self.busy_s += seconds
        self._next_index += 1
        counts = self.rollout.metrics() if hasattr(self.rollout, "metrics") else {}
        buffer = self.rollout.state_dict() if self.partial else None
        kept = params if self.keep_params else None
        item = Item(
          index, batch, examples, version, self.source.cursor, seconds, counts, buffer, kept
        )
        while not self._stop.is_set():
          try:
            self.queue.put(item, timeout=0.05)
            break
          except queue.Full:
            continue
    except BaseException as e:  # noqa: BLE001 (re-raised in the learner's thread by `get`)
      self._error = e

  def get(self) -> tuple[Item, float]:
    """The next batch, and the seconds the learner waited for it.

    Raises:
      RuntimeError: the rollout thread failed (chained to its exception).
    """
    t0 = time.perf_counter()
    while True:
      try:
        item = self.queue.get(timeout=0.05)
        break
      except queue.Empty:
        if self._error is not None:  # what it queued before it failed was taken first
          raise RuntimeError("The rollout thread failed.") from self._error
        if self._thread is None or not self._thread.is_alive():
          raise RuntimeError("The rollout thread is not running: `start` it first.") from None
    self.consumed_cursor = item.cursor
    self.consumed_buffer = item.buffer
    return item, time.perf_counter() - t0

  def stop(self) -> None:
    """Stops the thread (after its batch in flight) and drops what the queue holds."""
    self._stop.set()
    if self._thread is not None:
      self._thread.join()
      self._thread = None
    while not self.queue.empty():
      self.queue.get_nowait()
