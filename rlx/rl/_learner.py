"""One RL iteration, host-driven (`Learner.iteration`) or as ONE jitted function (`make_rl_step`).

Iteration (DeepSeekMath GRPO, https://arxiv.org/abs/2402.03300, with the
policy loss chosen from rlx.objectives.POLICY_LOSSES):

  batch      = rollout.collect(params, prompts, rng)        # K samples / prompt
  rewards    = task.jax_reward(...) on device | task.reward(...) on host
  adv, keep  = group advantages (grpo | drgrpo | rloo | median/MC-GRPO; vcpo
               after old_logp, from score-gradient norms and IS weights)
  old_logp   = compute_logprobs(params, batch)              # anchor policy
  ref_logp   = compute_logprobs(ref_params, batch)          # only if kl_coef > 0
  state      = train_step(state, batch)                     # rlx.train, sharded
  params go back to the sampler as the same device arrays (no host copy).

Everything after the rollout and its reward is written once, in
`Learner.update_fn`: the host-driven path (`Learner.update`) runs it with
jitted pieces and times each phase (reward / logp / train); `make_rl_step`
traces it, with the sampler and a JAX reward, into one compiled program (as
in purejaxrl's fully-jitted PPO, https://github.com/luchris429/purejaxrl).
"""

import time
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from rlx import objectives, train
from rlx.rl import _advantages, _batch, _config, _rollout, _staleness


def _rollout_metrics(batch: _batch.RolloutBatch, rewards: jax.Array) -> dict[str, jax.Array]:
  lengths = batch.response_lengths.astype(jnp.float32)
  return {
    "reward_mean": jnp.mean(rewards),
    "reward_std": jnp.std(rewards),
    "response_length": jnp.mean(lengths),
    "stop_fraction": jnp.mean(batch.stopped.astype(jnp.float32)),
    "response_tokens": jnp.sum(lengths),
  }


def _group_metrics(rewards: jax.Array, group_size: int) -> dict[str, jax.Array]:
  grouped = rewards.reshape(-1, group_size)
  solved_any = jnp.any(grouped > 0.5, axis=1)
  solved_all = jnp.all(grouped > 0.5, axis=1)
  return {
    "groups_all_correct": jnp.mean(solved_all.astype(jnp.float32)),
    "groups_mixed": jnp.mean((solved_any & ~solved_all).astype(jnp.float32)),
  }


def offpolicy_metrics(
  current_logp: jax.Array, rollout_logp: jax.Array, loss_mask: jax.Array
) -> dict[str, jax.Array]:
  """How far the policy being trained is from the one that sampled the batch.

  Over the trained tokens (`loss_mask`, f32[B, S]) with the learner's log-probs
  before the update `current_logp` and the sampler's `rollout_logp` (both
  f32[B, S]):
    offpolicy_ess: normalised effective sample size of the sequence likelihood
      ratios `w_i = prod_t pi_current / pi_behaviour`
      (`rlx.objectives.effective_sample_size` of
      `rlx.objectives.sequence_importance_weights`), in [1/B, 1]; 1 = on-policy;
    offpolicy_k3: the k3 estimate of KL(pi_behaviour || pi_current) per token
      (`rlx.objectives.rollout_mismatch_kl`).
  VCPO (https://arxiv.org/abs/2602.17616) tracks the same ESS to detect
  harmful staleness.
  """
  seq_w = objectives.sequence_importance_weights(current_logp, rollout_logp, loss_mask)
  valid = jnp.any(loss_mask != 0, axis=1)
  return {
    "offpolicy_ess": objectives.effective_sample_size(seq_w, valid),
    "offpolicy_k3": objectives.rollout_mismatch_kl(current_logp, rollout_logp, loss_mask).k3,
  }


class Learner:
  """The jitted pieces of an RL iteration on one mesh, shared by both drivers.

  Attributes:
    group_size: K, samples per prompt (G, or G + 1 for the median baseline).
    train_config: the `rlx.train` config (`rlx.rl.train_config`: its temperature is
      `train.temperature`, or the rollout's when that is 0).
    compute_logprobs, train_step: from `rlx.train`.
    uses_ref: whether a reference policy (KL) is needed.
  """

  def __init__(
    self,
    config: ml_collections.ConfigDict,
    task: Any,
    model_config: Any,
    mesh: Any,
    *,
    train_step: Any = None,
    compute_logprobs: Any = None,
  ):
    """Builds (or reuses) the jitted pieces.

    Args:
      config: the RL config.
      task: the `rlx.tasks.Task`.
      model_config: the `rlx.policy.ModelConfig`.
      mesh: the `rlx.train` mesh.
      train_step: an existing `rlx.train.TrainStep` for this config's train
        section (to share one compiled step between learners), else built.
      compute_logprobs: likewise an existing `rlx.train.ComputeLogprobs`.
    """
    _config.validate_config(config)
    self.config = config
    self.task = task
    self.model_config = model_config
    self.mesh = mesh
    self.group_size = _config.samples_per_prompt(config)
    self.baseline = config.rl.baseline
    self.train_config = _config.train_config(config)
    self.compute_logprobs = compute_logprobs or train.make_compute_logprobs(
      model_config, self.train_config, mesh
    )
    self.train_step = train_step or train.make_train_step(model_config, self.train_config, mesh)
    self.uses_ref = float(self.train_config.kl_coef) > 0
    mode = config.rl.reward
    if mode == "jax" and task.jax_reward is None:
      raise ValueError(f"Task {task.name!r} has no jax_reward; set config.rl.reward='host'.")
    self.jax_reward = task.jax_reward if mode in ("auto", "jax") else None
    self._rewards_jax = None if self.jax_reward is None else jax.jit(self._device_rewards)
    # The host-driven path runs the update's pure pieces as their own programs.
    self._host_pieces = UpdatePieces(
      train_batch=jax.jit(self.train_batch),
      place=lambda tb: train.shard_batch(tb, self.mesh),
      logprobs=self.compute_logprobs,
      train=self.train_step,
      batch_metrics=jax.jit(self.batch_metrics),
      offpolicy=jax.jit(offpolicy_metrics),
      score_norms=self.compute_logprobs.score_norms,
      vcpo_advantages=jax.jit(self.vcpo_advantages),
    )

  @property
  def updates_per_iteration(self) -> int:
    """M: optimizer updates of one train step (`train.ppo_epochs x train.mini_batches`)."""
    return train.updates_per_step(self.train_config)

  def version(self, state: train.TrainState) -> int:
    """The policy version of `state.params`: optimizer updates applied (`state.step x M`).

    Rollout batches record it per token (`RolloutBatch.policy_version`), so a
    token's staleness `version(state) - policy_version` is in optimizer
    updates, as M2PO (https://arxiv.org/abs/2510.01161) counts it.
    """
    return int(train.to_host(state.step)) * self.updates_per_iteration

  def _device_rewards(self, batch, answer_ids, answer_lengths):
    completion, lengths = _batch.response_arrays(batch)
    return self.jax_reward(answer_ids, answer_lengths, completion, lengths)

  def rewards(self, batch: _batch.RolloutBatch, examples: Sequence[Any]) -> jax.Array:
    """f32[B] rewards of the rows (examples = one per prompt, rows prompt-major)."""
    k = self.group_size
    if len(examples) * k != batch.num_rows:
      raise ValueError(f"{len(examples)} examples x {k} samples != {batch.num_rows} rollout rows.")
    if self._rewards_jax is not None:
      ids, lengths = self.task.answer_arrays(examples)
      return self._rewards_jax(batch, np.repeat(ids, k, 0), np.repeat(lengths, k))
    repeated = [e for e in examples for _ in range(k)]
    return jnp.asarray(self.task.reward(repeated, batch.responses()))

  def iteration(
    self,
    state: train.TrainState,
    ref_params: Any,
    rollout: Any,
    examples: Sequence[Any],
    rng: jax.Array,
    *,
    rollout_params: Any = None,
    rollout_version: int | None = None,
    proximal_params: Any = None,
  ) -> tuple[train.TrainState, dict[str, float], _batch.RolloutBatch]:
    """One host-driven iteration; returns (state, host metrics, the rollout batch).

    Metrics include the phase times `time/rollout_s`, `time/reward_s`,
    `time/logp_s`, `time/train_s` (each phase waited for on host), and the
    batch's staleness at its first update (`staleness_mean`, `_min`, `_max`,
    `staleness_hist`; `rlx.rl.staleness_metrics`). A rollout
    with a `refresh(params, batch) -> seconds` (FP8 rollout: re-quantize the
    weights, recalibrate the KV scales on this batch) is refreshed with the
    updated params after the train step: `time/refresh_s`.

    Args:
      state: the learner's train state (version = `state.step`).
      ref_params: the KL reference params (None without KL).
      rollout: the rollout engine (`collect(params, prompts, rng, policy_version=)`).
      examples: the N task examples of this batch.
      rng: the rollout key.
      rollout_params: the params that sample the batch (stale ones, e.g. from
        `RolloutParams.select`); None = `state.params`.
      rollout_version: their version (needed with `rollout_params`).
      proximal_params: the proximal params of `rl.old_logp = "ewma"`
      (`ProximalEwma.select`).
    """
    t0 = time.perf_counter()
    if rollout_params is None:
      rollout_params, rollout_version = state.params, self.version(state)
    elif rollout_version is None:
      raise ValueError("`rollout_version` is needed with `rollout_params`.")
    batch = rollout.collect(
      rollout_params, [e.prompt_ids for e in examples], rng, policy_version=int(rollout_version)
    )
    jax.block_until_ready(batch.tokens)
    rollout_metrics = rollout.metrics() if hasattr(rollout, "metrics") else {}
    state, metrics, batch = self.update(
      state,
      ref_params,
      batch,
      examples,
      behaviour_params=rollout_params,
      proximal_params=proximal_params,
      refresh=getattr(rollout, "refresh", None),
      rollout_s=time.perf_counter() - t0,
    )
    return state, {**metrics, **rollout_metrics}, batch

  def train_batch(self, batch: _batch.RolloutBatch) -> dict[str, jax.Array]:
    """The train-step batch of a rewarded rollout batch: group advantages, kept rows. Pure.

    With `rl.baseline = "vcpo"` the advantages are NaN here (the train step
    refuses them): `update_fn` sets them after the log-probs (`vcpo_advantages`).
    """
    if self.baseline == "vcpo":
      ones = jnp.ones_like(batch.rewards, jnp.float32)
      return _batch.train_batch(batch, jnp.nan * ones, ones)
    adv, keep = _advantages.group_advantages(batch.rewards, self.group_size, self.baseline)
    return _batch.train_batch(batch, adv, keep)

  def vcpo_advantages(
    self, rewards: jax.Array, score_norms: jax.Array, current_logp: jax.Array, tb: dict
  ) -> jax.Array:
    """f32[B] advantages of `rl.baseline = "vcpo"` (`rlx.rl.vcpo_row_advantages`). Pure."""
    return _advantages.vcpo_row_advantages(
      rewards, score_norms, current_logp, tb["rollout_logp"], tb["loss_mask"], self.group_size
    )

  def batch_metrics(self, batch: _batch.RolloutBatch) -> dict[str, jax.Array]:
    """Reward, length and group metrics of a rewarded rollout batch (device scalars). Pure."""
    rewards = batch.rewards
    return {**_rollout_metrics(batch, rewards), **_group_metrics(rewards, self.group_size)}

  def update_fn(
    self,
    pieces: "UpdatePieces",
    state: train.TrainState,
    ref_params: Any,
    batch: _batch.RolloutBatch,
    *,
    behaviour_params: Any = None,
    proximal_params: Any = None,
    mark: Any = None,
  ) -> tuple[train.TrainState, dict[str, jax.Array]]:
    """The RL update on a rewarded rollout batch, written once for both paths.

    advantages -> train batch -> old_logp (as `rl.old_logp` says) and the
    off-policy metrics -> ref_logp (with KL) -> the train step -> metrics.
    `make_rl_step` traces it with the pure pieces inside its one program;
    `update` runs it with the jitted, host-checked pieces and a `mark` that
    waits for each phase and times it.

    Args:
      pieces: the `UpdatePieces` to compose.
      state: the learner's train state.
      ref_params: the KL reference params (None without KL).
      batch: the rollout batch with its rewards set.
      behaviour_params: the params that sampled the batch (`rl.old_logp =
        "behaviour"`); None = `state.params`.
      proximal_params: PPO-EWMA's proximal params (`rl.old_logp = "ewma"`).
      mark: `mark(phase, tree) -> tree` at the end of the phases "reward",
        "logp" and "train"; None = no marks.

    Returns:
      (state, metrics as device scalars).
    """
    mark = mark or (lambda phase, tree: tree)
    tb = pieces.place(mark("reward", pieces.train_batch(batch)))
    logprobs = pieces.logprobs
    tb["old_logp"] = self._old_logp(
      state,
      state.params if behaviour_params is None else behaviour_params,
      proximal_params,
      tb,
      logprobs,
    )
    current = self._current_logp(state, tb, logprobs)
    offpolicy = (
      {} if current is None else pieces.offpolicy(current, tb["rollout_logp"], tb["loss_mask"])
    )
    if self.baseline == "vcpo":
      norms = pieces.score_norms(state.params, tb)
      rewards = pieces.place({"rewards": batch.rewards})["rewards"]
      tb["advantages"] = pieces.vcpo_advantages(rewards, norms, current, tb)
    if self.uses_ref:
      tb["ref_logp"] = logprobs(ref_params, tb)
    tb = mark("logp", tb)
    state, train_metrics = pieces.train(state, tb)
    state = mark("train", state)
    return state, {**pieces.batch_metrics(batch), **dict(train_metrics), **offpolicy}

  def update(
    self,
    state: train.TrainState,
    ref_params: Any,
    batch: _batch.RolloutBatch,
    examples: Sequence[Any],
    *,
    behaviour_params: Any = None,
    proximal_params: Any = None,
    refresh: Any = None,
    rollout_s: float = 0.0,
  ) -> tuple[train.TrainState, dict[str, float], _batch.RolloutBatch]:
    """Trains on a collected batch: rewards, then `update_fn` timed by phase, then the refresh.

    What `iteration` does after its rollout, for a driver that collects by
    itself (e.g. partial rollouts, which choose their prompts).

    Args:
      state: the learner's train state.
      ref_params: the KL reference params (None without KL).
      batch: the `RolloutBatch` (N * K prompt-major rows, rewards unset).
      examples: the N task examples its rows answer, K rows each.
      behaviour_params: the single params version that sampled the batch, for
        `rl.old_logp = "behaviour"`; None = `state.params`.
      proximal_params: the proximal params for `rl.old_logp = "ewma"`
        (PPO-EWMA's average, `rlx.rl.ProximalEwma`); needed in that mode.
      refresh: `refresh(params, batch) -> seconds` run after the update (the
        FP8 rollout policy's), or None.
      rollout_s: the seconds the rollout took, reported as `time/rollout_s`.

    Returns:
      (state, host metrics, the batch with its rewards).
    """
    times = [time.perf_counter()]
    version = self.version(state)
    batch = batch.with_rewards(self.rewards(batch, examples))

    def mark(phase, tree):
      jax.block_until_ready(tree)
      times.append(time.perf_counter())
      return tree

    state, device_metrics = self.update_fn(
      self._host_pieces,
      state,
      ref_params,
      batch,
      behaviour_params=behaviour_params,
      proximal_params=proximal_params,
      mark=mark,
    )
    t1, t2, t3, t4 = times
    refresh_s = None if refresh is None else float(refresh(state.params, batch))
    t5 = time.perf_counter()
    metrics = _host_floats(device_metrics)
    metrics.update(_staleness.staleness_metrics(batch.policy_version, batch.response_mask, version))
    metrics.update(
      {
        "time/rollout_s": float(rollout_s),
        "time/reward_s": t2 - t1,
        "time/logp_s": t3 - t2,
        "time/train_s": t4 - t3,
        "time/iteration_s": float(rollout_s) + t5 - t1,
      }
    )
    if refresh_s is not None:
      metrics["time/refresh_s"] = refresh_s
    return state, metrics, batch

  def _current_logp(self, state: train.TrainState, tb: dict, logprobs: Any) -> jax.Array | None:
    """The batch's log-probs under `state.params`, for `offpolicy_metrics` and VCPO.

    Free when old_logp is the current policy's; otherwise (rl.old_logp =
    behaviour or sampler at rl.staleness > 0, ewma, or the VCPO baseline) one
    more log-prob pass; None for an on-policy run that needs none.
    """
    rl_cfg = self.config.rl
    if rl_cfg.old_logp == "current":
      return tb["old_logp"]
    if rl_cfg.staleness > 0 or rl_cfg.old_logp == "ewma" or self.baseline == "vcpo":
      return logprobs(state.params, tb)
    return None

  def _old_logp(
    self,
    state: train.TrainState,
    rollout_params: Any,
    proximal_params: Any,
    tb: dict,
    logprobs: Any,
  ) -> jax.Array:
    """The batch's `old_logp` as `config.rl.old_logp` says (see rlx.rl.get_config)."""
    mode = self.config.rl.old_logp
    if mode == "sampler":
      return tb["rollout_logp"]
    if mode == "ewma":
      if proximal_params is None:
        raise ValueError("`proximal_params` is needed with config.rl.old_logp='ewma'.")
      return logprobs(proximal_params, tb)
    if mode == "behaviour" and rollout_params is not state.params:
      return logprobs(rollout_params, tb)
    return logprobs(state.params, tb)


class UpdatePieces(NamedTuple):
  """The functions `Learner.update_fn` composes.

  Pure inside `make_rl_step`'s program; jitted with host checks (shapes,
  out-of-memory advice, donation) on the host-driven path.

  Attributes:
    train_batch: rewarded `RolloutBatch` -> train batch dict (`Learner.train_batch`).
    place: train batch -> train batch on the mesh (identity inside a jit).
    logprobs: `(params, train batch) -> f32[B, S]` per-token log-probs.
    train: `(state, train batch) -> (state, metrics)`, the train step.
    batch_metrics: rewarded `RolloutBatch` -> metrics (`Learner.batch_metrics`).
    offpolicy: `offpolicy_metrics` (or its jit).
    score_norms: `(params, train batch) -> f32[B]` per-row score-gradient
      norms (`rlx.train.ComputeLogprobs.score_norms`), for `rl.baseline = "vcpo"`.
    vcpo_advantages: `Learner.vcpo_advantages` (or its jit).
  """

  train_batch: Any
  place: Any
  logprobs: Any
  train: Any
  batch_metrics: Any
  offpolicy: Any
  score_norms: Any
  vcpo_advantages: Any


def _host_floats(metrics: dict) -> dict[str, float]:
  out = {}
  for k, v in train.to_host(metrics).items():
    if k in ("step_time_s", "tokens_per_second", "loss_tokens_per_second"):
      continue
    out[k] = float(np.asarray(v))
  return out


class RLStep:
  """`rl_step(state, ref_params, prompt_tokens, prompt_lengths, answer_ids, answer_lengths, rng)`.

  From `make_rl_step`: the whole iteration as one jitted function that
  donates `state`. Returns `(state, metrics)` with device scalar metrics.
  With FP8 KV (`fp8.kv_fp8`) the jitted function also takes this step's KV
  scales and returns the recalibrated ones, kept in `fp8.kv_scales`.
  A call (or `compile_from_examples`) whose program does not fit in device
  memory raises `rlx.train.OutOfMemoryError`, listing the settings that lower
  it (`memory_advice`).
  """

  def __init__(
    self, jitted: Any, learner: Learner, width: int, fp8: Any = None, sampler: Any = None
  ):
    self.jitted = jitted
    self.learner = learner
    self.width = width
    self.fp8 = fp8
    self.sampler = sampler

  def memory_advice(self, prompts: int | None = None) -> tuple[str, ...]:
    """The settings that lower the fused program's memory, with their current values.

    The train step's (for `prompts` x group size rows), the sampler's, and the
    unfused loop, which samples in the sampler's slots instead of every row at once.
    """
    rows = None if prompts is None else prompts * self.learner.group_size
    train_advice = getattr(self.learner.train_step, "memory_advice", None)
    lines = list(train_advice(rows)) if train_advice else []
    if hasattr(self.sampler, "memory_advice"):
      lines += self.sampler.memory_advice()
    lines.append(
      "rl.fused = False (now True): sample in the sampler's slots (sampler.max_slots), reward "
      "and train in separate programs, instead of every row in a slot within one program"
    )
    return tuple(lines)

  def __call__(
    self, state, ref_params, prompt_tokens, prompt_lengths, answer_ids, answer_lengths, rng
  ):
    n = prompt_tokens.shape[0]
    for name, x in (("prompt_lengths", prompt_lengths), ("answer_lengths", answer_lengths)):
      if tuple(np.shape(x)) != (n,):
        raise ValueError(f"`{name}` must have shape [N] = ({n},), got {np.shape(x)}.")
    if np.shape(prompt_tokens)[1] != self.width:
      raise ValueError(
        f"`prompt_tokens` must be [N, max_prompt_len={self.width}], got {np.shape(prompt_tokens)}."
      )
    if np.shape(answer_ids)[0] != n:
      raise ValueError(f"`answer_ids` must have {n} rows, got {np.shape(answer_ids)}.")
    _check_not_aliased(ref_params, state)
    with train.explain_out_of_memory("rl_step", lambda: self.memory_advice(n)):
      if self.fp8 is None:
        return self.jitted(
          state, ref_params, prompt_tokens, prompt_lengths, answer_ids, answer_lengths, rng
        )
      scales = self.fp8.generate_kwargs().get("kv_scales")
      state, metrics, scales = self.jitted(
        state, ref_params, prompt_tokens, prompt_lengths, answer_ids, answer_lengths, rng, scales
      )
    if self.fp8.kv_fp8:
      self.fp8.kv_scales = scales
    return state, metrics

  def from_examples(self, state, ref_params, examples: Sequence[Any], rng):
    """Calls the step on a list of task examples (padding prompts and answers)."""
    return self(state, ref_params, *self._example_arrays(examples), rng)

  def compile_from_examples(self, state, ref_params, examples: Sequence[Any], rng) -> None:
    """Compiles the step for these arguments' shapes without running it (ahead of time).

    `state` and `ref_params` may be trees of `jax.ShapeDtypeStruct` with
    shardings (e.g. `rlx.train.abstract_train_state(...)` and its `.params`),
    so the program can compile while the params it will run on are still
    being trained (the RL loop compiles it during the supervised warm-up, in
    a thread: XLA's compile releases the GIL). A later call with arguments of
    the same shapes, dtypes and shardings runs this executable instead of
    compiling again. With FP8 KV the scales' shapes are read from `self.fp8`,
    which must hold scales already.
    """
    args = (state, ref_params, *self._example_arrays(examples), rng)
    if self.fp8 is not None:
      args = (*args, self.fp8.generate_kwargs().get("kv_scales"))
    with train.explain_out_of_memory("rl_step", lambda: self.memory_advice(len(examples))):
      self.jitted.lower(*args).compile()

  def _example_arrays(self, examples: Sequence[Any]):
    tokens, lengths = _rollout.pad_prompts([e.prompt_ids for e in examples], self.width)
    ids, alen = self.learner.task.answer_arrays(examples)
    return tokens, lengths, ids, alen


def _check_not_aliased(ref_params: Any, state: Any) -> None:
  """Raises ValueError naming a leaf of `ref_params` that shares a device buffer with `state`.

  The step donates `state`; a reference policy that IS the state's params
  (e.g. `ref_params=state.params`) would be read after its buffers were given
  away (XLA refuses the call with a raw INVALID_ARGUMENT error).
  """

  def buffers(x):
    if not isinstance(x, jax.Array) or x.is_deleted():
      return set()
    return {(s.device, s.data.unsafe_buffer_pointer()) for s in x.addressable_shards}

  donated = set().union(*(buffers(x) for x in jax.tree.leaves(state)))
  for path, leaf in jax.tree_util.tree_leaves_with_path(ref_params):
    if buffers(leaf) & donated:
      raise ValueError(
        f"`ref_params{jax.tree_util.keystr(path)}` shares its device buffer with `state`, "
        "which the step donates; pass a copy (e.g. `jax.tree.map(jnp.copy, state.params)`)."
      )


def make_rl_step(learner: Learner, sampler: Any, *, fp8: Any = None) -> RLStep:
  """The whole iteration — sample, JAX reward, advantages, log-probs, update — as ONE jit.

  Needs a task with a `jax_reward` and a batch that fits the sampler's slots
  (N prompts x K samples <= max_slots): `sampler.generate_fn` runs inside
  the same program as the train step, so nothing leaves the device between
  sampling and the update. After the reward it traces `Learner.update_fn`,
  the function the host-driven `Learner.iteration` runs, so with a
  `SyncRollout` over the same sampler and rng both compute the same update.

  FP8 rollout (the sampler's `weight_dtype` / `kv_dtype` FP8): the refresh
  runs inside the same program: the rollout params are quantized from
  `state.params` at the start (`rlx.sampling.quantize_params`), the sampler
  decodes with the KV scales of the previous refresh, and after the update
  the scales are recalibrated from the new params' forward over this batch
  (`rlx.sampling.calibrate_kv_scales`); the same as `Learner.iteration`
  with a `SyncRollout` sharing the `Fp8Refresh`.

  Args:
    learner: the `Learner` (config, train step, log-probs).
    sampler: an `rlx.sampling.Sampler` with `generate_fn(params,
      prompt_tokens i32[N, P], prompt_lengths i32[N], rng) -> (tokens
      i32[N, T], logprobs f32[N, T], lengths i32[N], stopped bool[N])`.
    fp8: the `rlx.rl` `Fp8Refresh` holding the KV scales between steps
      (made from the sampler's config when it is FP8 and none is given; its
      scales must be calibrated before the first call, e.g.
      `fp8.calibrate_prompts`).

  Returns:
    An `RLStep`.
  """
  if learner.jax_reward is None:
    raise ValueError(
      f"make_rl_step needs a JAX reward; task {learner.task.name!r} has none (or "
      "config.rl.reward='host'). Use the host-driven Learner.iteration."
    )
  k = learner.group_size
  width = int(sampler.config.max_prompt_len)
  if fp8 is None:
    fp8 = _rollout.make_fp8_refresh(sampler)
  logprobs_fn = learner.compute_logprobs.logprobs_fn

  def model_inputs(tb):
    return {"tokens": tb["tokens"], "loss_mask": tb["loss_mask"]}

  def logprobs(params, tb):  # the pure functions (no host checks, no nested jit)
    return jax.lax.stop_gradient(logprobs_fn(params, model_inputs(tb)))

  pieces = UpdatePieces(
    train_batch=learner.train_batch,
    place=lambda tb: tb,
    logprobs=logprobs,
    train=learner.train_step.step_fn,
    batch_metrics=learner.batch_metrics,
    offpolicy=offpolicy_metrics,
    score_norms=lambda params, tb: learner.compute_logprobs.score_norms_fn(
      params, model_inputs(tb)
    ),
    vcpo_advantages=learner.vcpo_advantages,
  )

  def step(
    state, ref_params, prompt_tokens, prompt_lengths, answer_ids, answer_lengths, rng, kv_scales
  ):
    n = prompt_tokens.shape[0]
    if n * k > sampler.config.max_slots:
      raise ValueError(
        f"make_rl_step: {n} prompts x {k} samples = {n * k} rows exceed the sampler's "
        f"max_slots={sampler.config.max_slots}."
      )
    pt = jnp.repeat(prompt_tokens, k, axis=0)
    pl = jnp.repeat(prompt_lengths, k)
    params = state.params
    gen_kwargs = {}
    if fp8 is not None:
      from rlx import sampling  # noqa: PLC0415 (the sampler is optional at import time)

      params = sampling.quantize_params(params, sampler.config)
      if fp8.kv_fp8:
        gen_kwargs["kv_scales"] = kv_scales
    tokens, logps, lengths, stopped = sampler.generate_fn(
      params, pt, pl, rng, num_samples=k, **gen_kwargs
    )
    groups = jnp.repeat(jnp.arange(n, dtype=jnp.int32), k)
    version = state.step * learner.updates_per_iteration
    batch = _batch.build_rollout_batch(pt, pl, tokens, logps, lengths, stopped, groups, version)
    completion, clen = _batch.response_arrays(batch)
    rewards = learner.jax_reward(
      jnp.repeat(answer_ids, k, axis=0), jnp.repeat(answer_lengths, k), completion, clen
    )
    batch = batch.with_rewards(rewards)
    state, metrics = learner.update_fn(pieces, state, ref_params, batch)
    if fp8 is None:
      return state, metrics
    if fp8.kv_fp8:
      from rlx import sampling  # noqa: PLC0415

      kv_scales = fp8.place(
        sampling.calibrate_kv_scales(
          state.params, learner.model_config, batch.tokens, batch.prompt_mask | batch.response_mask
        )
      )
    return state, metrics, kv_scales

  if fp8 is None:
    # The high-precision program, exactly as without FP8 support (no scales argument).
    def plain(state, ref_params, prompt_tokens, prompt_lengths, answer_ids, answer_lengths, rng):
      return step(
        state, ref_params, prompt_tokens, prompt_lengths, answer_ids, answer_lengths, rng, None
      )

    return RLStep(jax.jit(plain, donate_argnums=(0,)), learner, width, sampler=sampler)
  return RLStep(jax.jit(step, donate_argnums=(0,)), learner, width, fp8=fp8, sampler=sampler)
