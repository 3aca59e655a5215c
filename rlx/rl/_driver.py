"""The rollout driver of `rlx.rl.run`: how each RL iteration gets its batch and trains on it.

One object behind the loop, whatever the rollout is:

  fused     the whole iteration as ONE jitted program (`make_rl_step`): a task
            with a JAX reward, on-policy, every row in the sampler's slots;
  sync      `SyncRollout.collect` + the host-driven `Learner.iteration`;
  partial   APRIL partial rollouts (`PartialRollout`, `rollout.over_provision`
            > 1), which pull as many prompts as they need;
  stale     any of the host-driven ones with `rl.staleness` > 0: the batch is
            sampled by a held param version (`RolloutParams`); with
            `rl.old_logp = "ewma"` the driver also holds PPO-EWMA's proximal
            params (`ProximalEwma`);
  async     `rl.async_rollout`: a rollout thread (`AsyncRollout`) samples
            ahead with the latest published params; `Learner.update` trains
            on what it queued, dropping (or keeping) batches older than
            `rl.max_staleness`, and publishes the new params after each update.
            With partial rollouts too, the thread's samples in flight take the
            published params at their next scheduling point (PipelineRL).

The loop only calls `iteration(state, ref_params, rng)` and checkpoints
`state_dict()` (the partial-rollout buffer, the FP8 KV scales, the held
versions, the proximal average and the data cursor live here, so a resumed
synchronous run continues exactly; an asynchronous one loses nothing and
trains nothing twice).
"""

import concurrent.futures
import time
import warnings
from typing import Any

import jax

from rlx import policy, train
from rlx.rl import _async, _data, _learner, _logging, _rollout, _spec, _staleness


class RolloutDriver:
  """The rollout side of a run and the iteration it drives.

  Attributes:
    fused: whether iterations run as the one fused program.
    partial: whether APRIL partial rollouts are on.
    fp8: the `Fp8Refresh` of an FP8 rollout sampler, else None.
    what: a description of the first iteration's compile (for the note).
    refresh_probe_s: the fused FP8 refresh timed standalone (None otherwise).
    rollout_params: the `RolloutParams` of `rl.staleness`.
  """

  def __init__(
    self,
    spec: _spec.RunSpec,
    learner: _learner.Learner,
    sampler: Any,
    rollout_kwargs: dict[str, Any],
    train_examples: list[Any],
  ):
    self.spec = spec
    self.learner = learner
    self.sampler = sampler
    self.rollout_kwargs = rollout_kwargs
    self.train_examples = train_examples
    self.num_prompts = spec.prompts_per_iteration
    self.k = learner.group_size
    self.width = rollout_kwargs["max_prompt_len"] + rollout_kwargs["max_new_tokens"]
    self.partial = spec.partial
    self.fp8 = _rollout.make_fp8_refresh(sampler)
    self.fused = bool(
      not self.partial
      and not spec.async_rollout
      and spec.staleness == 0
      and spec.old_logp not in ("sampler", "ewma")
      and spec.fused
      and learner.jax_reward is not None
      and hasattr(sampler, "generate_fn")
      and self.num_prompts * self.k <= rollout_kwargs["max_slots"]
    )
    self.rl_step = _learner.make_rl_step(learner, sampler, fp8=self.fp8) if self.fused else None
    self.what = (
      "the fused RL iteration (sampler + reward + train step)"
      if self.fused
      else "the RL iteration (sampler, log-probs, train step)"
    )
    self.refresh_probe_s = None
    self.rollout_params = _staleness.RolloutParams(
      spec.staleness,
      spec.staleness_mode,
      updates_per_iteration=learner.updates_per_iteration,
      place=spec.staleness_ring,
      put=lambda tree: train.shard_params(tree, learner.model_config, learner.mesh),
    )
    self.proximal = (
      _staleness.ProximalEwma(
        spec.ewma_decay,
        put=lambda tree: train.shard_params(tree, learner.model_config, learner.mesh),
      )
      if spec.old_logp == "ewma"
      else None
    )
    self._ahead = None
    self.source = None
    self.rollout = None
    self.partial_rollout = None
    self.async_rollout = None
    self._async_counts = {"dropped_total": 0, "stale_kept_total": 0}

  def _first_prompts(self) -> list[Any]:
    return [e.prompt_ids for e in self.train_examples[: self.num_prompts]]

  def compile_ahead(self, abstract: Any, rng: jax.Array) -> None:
    """Starts compiling the fused program in a thread (its input shapes are known already).

    Called before the warm-up, so the first RL iteration runs the program
    instead of compiling it (XLA's compile releases the GIL). Not with FP8 KV,
    whose scales exist only after the warm-up, nor for the host-driven paths.
    """
    if not self.fused or (self.fp8 is not None and self.fp8.kv_fp8):
      return
    pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="rlx-compile")
    self._ahead = pool.submit(
      self.rl_step.compile_from_examples,
      abstract,
      abstract.params if self.learner.uses_ref else None,
      self.train_examples[: self.num_prompts],
      rng,
    )
    pool.shutdown(wait=False)  # the thread ends with its one task

  def wait_ahead(self, notes: bool) -> None:
    """Waits for `compile_ahead`'s program; a failure only warns (the first call compiles)."""
    if self._ahead is None:
      return
    waited = time.perf_counter()
    try:
      self._ahead.result()
    except Exception as e:  # noqa: BLE001 (the first call compiles it and raises what is wrong)
      warnings.warn(
        f"Compiling {self.what} ahead of time failed ({type(e).__name__}: {e}); it compiles "
        "at its first call instead.",
        stacklevel=2,
      )
    else:
      if notes:
        _logging.note(
          f"rlx: {self.what} compiled during the warm-up (waited "
          f"{time.perf_counter() - waited:.1f} s more for it)"
        )
    self._ahead = None

  def start(
    self,
    state: train.TrainState,
    extra: dict | None,
    cursor: Any,
    resumed: bool,
    *,
    rollout_key: jax.Array | None = None,
    iteration: int = 0,
  ) -> None:
    """Builds the rollouts from the RL start state, or from a checkpoint's `extra` and cursor.

    With `rl.async_rollout` it also publishes `state.params` and starts the
    rollout thread, which samples batch i with `fold_in(rollout_key, i)` from
    i = `iteration` on.
    """
    extra = extra or {}
    self.source = _data.PromptSource(
      self.train_examples,
      # Partial rollouts pull a varying number of prompts one by one (the same stream).
      batch_size=1 if self.partial else self.num_prompts,
      seed=self.spec.seed + 1,
      cursor=cursor,
    )
    fp8 = self.fp8
    if fp8 is not None and fp8.kv_fp8:
      if extra.get("kv_scales"):
        fp8.load_state_dict(extra["kv_scales"])
      else:  # before the first update: the trainer's forward over the first train prompts
        fp8.calibrate_prompts(
          state.params, self._first_prompts(), num_samples=self.k, width=self.width
        )
    self.rollout = _rollout.SyncRollout(
      self.sampler,
      num_samples=self.k,
      max_prompt_len=self.rollout_kwargs["max_prompt_len"],
      max_new_tokens=self.rollout_kwargs["max_new_tokens"],
      fp8=fp8,
    )
    if self.partial:
      self.partial_rollout = _rollout.PartialRollout(
        self.sampler,
        num_samples=self.k,
        target_groups=self.num_prompts,
        over_provision=self.spec.over_provision,
        fp8=fp8,
      )
      self._restore(self.partial_rollout, extra, "rollout_buffer", resumed, "a rollout buffer")
    if self.spec.staleness:
      self._restore(self.rollout_params, extra, "staleness", resumed, "held param versions")
    if self.proximal is not None:
      self._restore(self.proximal, extra, "proximal", resumed, "PPO-EWMA proximal params")
    if self.spec.async_rollout:
      if rollout_key is None:
        raise ValueError("`rollout_key` is needed to start an asynchronous rollout.")
      self._async_counts.update(extra.get("async") or {})
      shardings = policy.param_shardings(self.learner.model_config, self.sampler.mesh)
      self.async_rollout = _async.AsyncRollout(
        self.partial_rollout if self.partial else self.rollout,
        self.source,
        place=lambda params: train.copy_to(params, shardings),
        key=rollout_key,
        queue_size=self.spec.async_queue_size,
        first_index=iteration,
        keep_params=self.spec.old_logp == "behaviour",
      )
      self.async_rollout.kv_refreshes = int(self._async_counts.get("kv_refreshes", 0))
      self.async_rollout.publish(state.params, self.learner.version(state))
      # Scales restored from a checkpoint were calibrated with an older version.
      restored = fp8 is not None and fp8.kv_fp8 and bool(extra.get("kv_scales"))
      self.async_rollout.start(scales_version=None if restored else -1)
    if self.fused and fp8 is not None:  # refreshed inside the fused program: time it standalone
      self.refresh_probe_s = fp8.time_refresh(
        state.params, self._first_prompts(), num_samples=self.k, width=self.width
      )

  @staticmethod
  def _restore(target: Any, extra: dict, key: str, resumed: bool, what: str) -> None:
    if extra.get(key) is not None:
      target.load_state_dict(extra[key])
    elif resumed:
      warnings.warn(
        f"Resuming from a checkpoint without {what}: starting from an empty one.", stacklevel=3
      )

  def _index(self, example: Any) -> int:
    """The example's index in the train split."""
    if not hasattr(self, "_index_of"):
      self._index_of = {id(e): i for i, e in enumerate(self.train_examples)}
    return self._index_of[id(example)]

  def _pull(self, n: int) -> list[tuple[int, list[int]]]:
    """The next n fresh prompts as (index in the train split, prompt ids)."""
    out = []
    for _ in range(n):
      e = self.source.next_batch()[0]
      out.append((self._index(e), e.prompt_ids))
    return out

  def iteration(
    self, state: train.TrainState, ref_params: Any, rng: jax.Array, t0: float
  ) -> tuple[train.TrainState, dict[str, Any]]:
    """One RL iteration from `state`; returns the new state and host metrics."""
    learner = self.learner
    if self.fused:  # on-policy: the batch's tokens have staleness 0
      examples = self.source.next_batch()
      state, device_metrics = self.rl_step.from_examples(state, ref_params, examples, rng)
      metrics = _learner._host_floats(device_metrics)
      metrics["time/fused_s"] = time.perf_counter() - t0
      n = int(metrics["response_tokens"])
      metrics.update(
        staleness_mean=0.0, staleness_min=0.0, staleness_max=0.0, staleness_hist={"0": n}
      )
      return state, metrics
    if self.async_rollout is not None:
      return self._async_iteration(state, ref_params)
    params, version = self.rollout_params.select(state.params, learner.version(state))
    proximal = None if self.proximal is None else self.proximal.select(state.params)
    if self.partial:
      pr = self.partial_rollout
      batch, keys = pr.collect_groups(params, self._pull, rng, policy_version=version)
      examples = [self.train_examples[int(i)] for i in keys]
      state, metrics, _ = learner.update(
        state,
        ref_params,
        batch,
        examples,
        proximal_params=proximal,
        refresh=pr.refresh,
        rollout_s=time.perf_counter() - t0,
      )
      metrics.update(pr.metrics())
    else:
      examples = self.source.next_batch()
      state, metrics, _ = learner.iteration(
        state,
        ref_params,
        self.rollout,
        examples,
        rng,
        rollout_params=params,
        rollout_version=version,
        proximal_params=proximal,
      )
    if self.proximal is not None:
      self.proximal.update(state.params)
    return state, metrics

  def _async_iteration(
    self, state: train.TrainState, ref_params: Any
  ) -> tuple[train.TrainState, dict[str, Any]]:
    """Trains on the rollout thread's next batch within `rl.max_staleness`; publishes the result."""
    learner, spec, counts = self.learner, self.spec, self._async_counts
    version, waited = learner.version(state), 0.0
    while True:
      item, wait_s = self.async_rollout.get()
      waited += wait_s
      lag = version - item.version
      if not spec.max_staleness or lag <= spec.max_staleness:
        break
      if spec.stale_batches == "keep":
        counts["stale_kept_total"] += 1
        break
      counts["dropped_total"] += 1
    proximal = None if self.proximal is None else self.proximal.select(state.params)
    behaviour = None  # rl.old_logp = "behaviour": the sampling version, back on the train mesh
    if item.params is not None and item.version != version:
      shardings = policy.param_shardings(learner.model_config, learner.mesh)
      behaviour = train.copy_to(item.params, shardings)
    state, metrics, _ = learner.update(
      state, ref_params, item.batch, item.examples, proximal_params=proximal,
      behaviour_params=behaviour, rollout_s=item.rollout_s,
    )  # fmt: skip
    self.async_rollout.publish(state.params, learner.version(state))
    if self.proximal is not None:
      self.proximal.update(state.params)
    metrics.update(item.metrics)
    counts["kv_refreshes"] = self.async_rollout.kv_refreshes  # checkpointed with the counts
    metrics.update(
      {
        "time/learner_wait_s": waited,
        "async/batch_index": item.index,
        # The train-split indices of the batch's prompts (what a resume must not lose or repeat).
        "async/prompts": [self._index(e) for e in item.examples],
        "async/queue_size": self.async_rollout.queue.qsize(),
        "async/rollout_busy_s": self.async_rollout.busy_s,
        "async/kv_refresh_s": self.async_rollout.kv_refresh_s,
        **{f"async/{k}": v for k, v in counts.items()},
      }
    )
    return state, metrics

  @property
  def source_cursor(self) -> dict:
    """The prompt stream's position after the last batch trained on (what a resume continues).

    With `rl.async_rollout` that is the learner's, not the rollout thread's:
    batches queued or in flight at a checkpoint are sampled again on resume.
    """
    if self.async_rollout is not None:
      return self.async_rollout.consumed_cursor
    return self.source.cursor

  def close(self) -> None:
    """Stops the rollout thread, if any (its queued batches are dropped)."""
    if self.async_rollout is not None:
      self.async_rollout.stop()
      self.async_rollout = None

  def state_dict(self) -> dict[str, Any]:
    """What the checkpoint's `extra` holds for the rollouts (buffer, KV scales, held versions)."""
    extra = {}
    if self.partial and self.async_rollout is not None:  # as of the last batch trained on
      extra["rollout_buffer"] = self.async_rollout.consumed_buffer
    elif self.partial:
      extra["rollout_buffer"] = self.partial_rollout.state_dict()
    if self.fp8 is not None and self.fp8.kv_scales is not None:
      extra["kv_scales"] = self.fp8.state_dict()
    held = self.rollout_params.state_dict()
    if held:
      extra["staleness"] = held
    if self.proximal is not None and self.proximal.params is not None:
      extra["proximal"] = self.proximal.state_dict()
    if self.spec.async_rollout:
      extra["async"] = dict(self._async_counts)
    return extra
