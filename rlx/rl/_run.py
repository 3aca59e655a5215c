"""`run(config, workdir) -> summary`: warm-up, RL, evaluation, logs, checkpoints, plots.

Workdir layout:
  warmup/        orbax checkpoint of the warmed-up policy (reused on resume)
  checkpoints/   orbax checkpoints of the RL run (params, optimizer, rng, data cursor,
                 the partial-rollout buffer, the FP8 KV scales)
  metrics.jsonl  one JSON record per warm-up evaluation / RL iteration / dev evaluation
  tensorboard/   TensorBoard event files (tensorboardX)
  plots/         PNG learning curves, written at the end
  summary.json   accuracy_before, accuracy_after, wall_time_s, iterations, config, ...
"""

import concurrent.futures
import json
import math
import os
import time
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from rlx import objectives, policy, tasks, train
from rlx.rl import (
  _cache,
  _config,
  _data,
  _evaluate,
  _learner,
  _logging,
  _rollout,
  _staleness,
  _warmstart,
)

SUPERVISED_NOTE = (
  "Note: supervised training on the gold answers alone could also solve this task; the "
  "demo's point is that the policy improves from the reward alone (no gold answers are "
  "used after the warm-up)."
)


def build_model(config: ml_collections.ConfigDict, task: Any) -> tuple[Any, Any]:
  """`(model_config, params)`: an HF checkpoint, or a fresh small model for the task.

  Every `config.model` field takes effect: with `hf_checkpoint` the
  architecture comes from its config.json, so an architecture field (family,
  sizes) that differs from its default is a ValueError naming it; the dtypes
  (params converted on load) and `remat` apply to both kinds of model.
  """
  m = config.model
  if m.hf_checkpoint:
    defaults = _config.get_config().model
    for name in (
      "family",
      "hidden_size",
      "num_layers",
      "num_heads",
      "num_kv_heads",
      "head_dim",
      "intermediate_size",
    ):
      if m[name] != defaults[name]:
        raise ValueError(
          f"`config.model.{name}`={m[name]!r} is set with `config.model.hf_checkpoint`: the "
          f"architecture comes from the checkpoint's config.json; leave it at its default "
          f"{defaults[name]!r}."
        )
    return policy.load_hf_checkpoint(
      m.hf_checkpoint, dtype=m.param_dtype, compute_dtype=m.compute_dtype, remat=m.remat
    )
  model_config = policy.ModelConfig.small(
    family=m.family,
    vocab_size=int(task.tokenizer.vocab_size),
    hidden_size=m.hidden_size,
    num_layers=m.num_layers,
    num_heads=m.num_heads,
    num_kv_heads=m.num_kv_heads,
    head_dim=m.head_dim,
    intermediate_size=m.intermediate_size,
    param_dtype=m.param_dtype,
    compute_dtype=m.compute_dtype,
    remat=m.remat,
  )
  key = jax.random.fold_in(jax.random.PRNGKey(config.seed), 0)
  return model_config, policy.init_params(model_config, key)


def build_mesh(config: ml_collections.ConfigDict) -> Any:
  """The `rlx.train` mesh of `config.mesh`."""
  devices = jax.devices()
  if config.mesh.num_devices:
    if config.mesh.num_devices > len(devices):
      raise ValueError(
        f"`config.mesh.num_devices`={config.mesh.num_devices} exceeds the {len(devices)} devices."
      )
    devices = devices[: config.mesh.num_devices]
  return train.make_mesh(config.mesh.data, config.mesh.fsdp, config.mesh.tensor, devices=devices)


def _subset(examples, n):
  return examples if not n else examples[: min(n, len(examples))]


def _write_json(path: str, value: Any) -> None:
  """Strict JSON (non-finite floats as null), written atomically."""
  tmp = path + ".tmp"
  with open(tmp, "w") as f:
    json.dump(_logging.finite_or_none(value), f, indent=2, default=float, allow_nan=False)
  os.replace(tmp, path)


def _flat(tree: Any, prefix: str = "") -> dict[str, Any]:
  if not isinstance(tree, dict):
    return {prefix: tree}
  out = {}
  for key, value in tree.items():
    out.update(_flat(value, f"{prefix}.{key}" if prefix else str(key)))
  return out


def _compared(config_dict: dict) -> dict[str, Any]:
  """The flattened config fields that define what a run computes (`NOT_COMPARED` left out).

  The loss's keywords count with their defaults filled in, so setting one to
  its default is the same run.
  """
  config_dict = json.loads(json.dumps(config_dict, default=str))
  train_dict = config_dict.get("train", {})
  if isinstance(train_dict, dict) and train_dict.get("loss") in objectives.POLICY_LOSS_SPECS:
    filled = ml_collections.ConfigDict({"train": {"loss": train_dict["loss"], "loss_kwargs": {}}})
    filled.train.loss_kwargs.update(train_dict.get("loss_kwargs") or {})
    train_dict["loss_kwargs"] = json.loads(
      json.dumps(_config.loss_kwargs_with_defaults(filled), default=str)
    )
  flat = _flat(config_dict)
  return {k: v for k, v in flat.items() if not k.startswith(_config.NOT_COMPARED)}


def _holds_a_run(workdir: str) -> bool:
  """Whether anything of a run was saved in `workdir` (a warm-up, an RL checkpoint, a summary)."""
  if os.path.exists(os.path.join(workdir, "summary.json")):
    return True
  for sub in ("warmup", "checkpoints"):
    path = os.path.join(workdir, sub)
    if os.path.isdir(path) and any(name.isdigit() for name in os.listdir(path)):
      return True
  return False


def _check_workdir(config: ml_collections.ConfigDict, workdir: str) -> dict[str, Any] | None:
  """Records the run's config in `workdir/config.json`; refuses a workdir of another config.

  Returns:
    The saved summary if the workdir holds this run, finished; else None.

  Raises:
    ValueError: the workdir holds a run of a different config (its fields
      named), which this run would otherwise overwrite or continue.
  """
  current = json.loads(json.dumps(config.to_dict(), default=str))
  saved = None
  for name in ("config.json", "summary.json"):
    path = os.path.join(workdir, name)
    if os.path.exists(path):
      with open(path) as f:
        value = json.load(f)
      saved = value if name == "config.json" else value.get("config")
      if saved is not None:
        break
  if saved is None or not _holds_a_run(workdir):
    # Nothing was saved yet (or a start failed before anything was): this config's workdir.
    _write_json(os.path.join(workdir, "config.json"), current)
    return None
  now, before = _compared(current), _compared(saved)
  # A field added to the config after that run was recorded had its default then.
  for key, value in _compared(_config.get_config().to_dict()).items():
    before.setdefault(key, value)
  changed = sorted(k for k in now.keys() | before.keys() if now.get(k) != before.get(k))
  if changed:
    shown = ", ".join(f"{k}: {before.get(k)!r} -> {now.get(k)!r}" for k in changed[:8])
    more = f" and {len(changed) - 8} more" if len(changed) > 8 else ""
    raise ValueError(
      f"{workdir} holds a run of a different config ({shown}{more}); its record is kept "
      "as it is. Pass a new --workdir to run this config (or remove the old one)."
    )
  summary_path = os.path.join(workdir, "summary.json")
  if os.path.exists(summary_path):
    with open(summary_path) as f:
      return json.load(f)
  return None


def run(config: ml_collections.ConfigDict, workdir: str) -> dict[str, Any]:
  """Runs (or resumes) a whole experiment in `workdir` and returns its summary.

  Warm-up (if `config.warmup.enabled`) until the dev greedy accuracy reaches
  `warmup.target_dev_accuracy`, then `rl.iterations` RL iterations, then the
  held-out test greedy accuracy. Re-running on the same workdir resumes from
  the last checkpoint, and a finished run returns its saved summary without
  computing anything. A workdir started with a different config
  (`workdir/config.json`; `config.log`, `imports` and `warmup.init_from`
  aside) is refused with a ValueError naming the fields, so a run's record is
  never rewritten under another config. `config.imports` are imported first.
  With `config.compilation_cache_dir` (or `$RLX_COMPILATION_CACHE_DIR`) set,
  JAX's persistent compilation cache is turned on for the process first.

  Args:
    config: the RL config (`rlx.rl.get_config()` or an experiments config).
    workdir: output directory (created).

  Returns:
    The summary dict (also written to `workdir/summary.json`).
  """
  _config.validate_config(config)
  wall_start = time.perf_counter()
  cache_dir = _cache.compilation_cache_dir(config.get("compilation_cache_dir", ""))
  if cache_dir:
    _cache.enable_compilation_cache(cache_dir)
  workdir = os.path.abspath(workdir)
  os.makedirs(workdir, exist_ok=True)
  finished = _check_workdir(config, workdir)
  if finished is not None:
    _logging.note(f"rlx: {workdir} holds this run, finished: returning its saved summary.")
    if config.log.print_summary:
      print(format_summary(finished))
    return finished
  notes = bool(config.log.progress_bar)
  task = _config.make_task(config)
  mesh = build_mesh(config)
  model_config, init_params = build_model(config, task)
  k = _config.samples_per_prompt(config)
  rows = int(config.rl.prompts_per_iteration) * k
  rollout_kwargs = _rollout.sampler_kwargs(config, task, rows=rows, greedy=False)
  dev = _subset(task.split("dev"), config.eval.dev_examples)
  test = _subset(task.split("test"), config.eval.test_examples)
  # The greedy sampler is sized for the dev set, evaluated every eval.every
  # iterations and every warmup.eval_every steps (its cost grows with its
  # slots); the test set, evaluated twice, runs in chunks of that size.
  eval_batch = min(max(len(dev) or len(test), 1), 512)
  eval_kwargs = _rollout.sampler_kwargs(config, task, rows=eval_batch, greedy=True)
  # Slots are split over the mesh's batch axes: round up to a multiple of them.
  shards = train.batch_axis_size(mesh)
  eval_kwargs["max_slots"] = -(-min(eval_kwargs["max_slots"], eval_batch) // shards) * shards
  sampler = _rollout.make_sampler(model_config, rollout_kwargs, mesh)
  eval_sampler = _rollout.make_sampler(model_config, eval_kwargs, mesh)
  seq_len = rollout_kwargs["max_prompt_len"] + rollout_kwargs["max_new_tokens"]

  greedy = _logging.note_first_call(
    _evaluate.greedy_accuracy, "the greedy evaluation sampler", enabled=notes
  )

  def evaluate(params, examples):
    if isinstance(examples, str):
      examples = dev if examples == "dev" else test
    return greedy(eval_sampler, params, task, examples, batch_size=eval_batch)

  learner = _learner.Learner(config, task, model_config, mesh)
  train_cfg = learner.train_config
  abstract = train.abstract_train_state(model_config, train_cfg, mesh)
  ckpt = train.Checkpointer(
    os.path.join(workdir, "checkpoints"), max_to_keep=config.checkpoint.max_to_keep
  )
  base_key = jax.random.PRNGKey(config.seed)
  rollout_key = jax.random.fold_in(base_key, 1)

  partial = float(config.rollout.over_provision) > 1.0
  # FP8 rollout: one refresh object (rollout params + KV scales) for every path.
  fp8 = _rollout.make_fp8_refresh(sampler)
  staleness = int(config.rl.staleness)
  fused = bool(
    not partial
    and staleness == 0
    and config.rl.old_logp != "sampler"
    and config.rl.fused
    and learner.jax_reward is not None
    and hasattr(sampler, "generate_fn")
    and rows <= rollout_kwargs["max_slots"]
  )
  rl_step = _learner.make_rl_step(learner, sampler, fp8=fp8) if fused else None
  train_examples = task.split("train")
  # The fused RL program compiles in a thread while the warm-up trains (its
  # inputs' shapes and shardings are known before the params are): the first
  # RL iteration then runs it instead of compiling. Not with FP8 KV, whose
  # scales exist only after the warm-up.
  ahead = None
  if fused and (fp8 is None or not fp8.kv_fp8):
    pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="rlx-compile")
    ahead = pool.submit(
      rl_step.compile_from_examples,
      abstract,
      abstract.params if learner.uses_ref else None,
      train_examples[: int(config.rl.prompts_per_iteration)],
      jax.random.fold_in(rollout_key, 0),
    )
    pool.shutdown(wait=False)  # the thread ends with its one task

  # --- warm-up (this run's, cached; or reused from another run) ---
  warm = _warmstart.warm_start(
    config,
    workdir,
    init_params=init_params,
    model_config=model_config,
    train_cfg=train_cfg,
    mesh=mesh,
    task=task,
    abstract=abstract,
    evaluate=evaluate,
    seq_len=seq_len,
    open_log=lambda: _logging.MetricsLog(
      workdir,
      resume_iteration=None,
      tensorboard=config.log.tensorboard,
      tensorboard_subdir="warmup",
    ),
    progress=notes,
  )
  start_state, warm_info = warm.state, warm.info
  ref_params = None
  if learner.uses_ref:
    ref_params = jax.tree.map(jnp.copy, start_state.params)

  # --- RL (resumable) ---
  latest = ckpt.latest_step()
  if latest is not None:
    restored = ckpt.restore(abstract)
    state, cursor = restored.state, restored.data_cursor
    rollout_buffer = (restored.extra or {}).get("rollout_buffer")
    best_params = (restored.extra or {}).get("best_params")
    kv_state = (restored.extra or {}).get("kv_scales")
    stale_state = (restored.extra or {}).get("staleness")
  else:
    stale_state = None
    rollout_buffer = None
    best_params = None
    kv_state = None
    state = start_state
    cursor = {
      "source": None,
      "iteration": 0,
      "rl_time_s": 0.0,
      "elapsed_s": 0.0,
      "stop": None,
    }
  del start_state
  start = int(cursor["iteration"])
  elapsed_before = float(cursor.get("elapsed_s", 0.0))
  source = _data.PromptSource(
    train_examples,
    # Partial rollouts pull a varying number of prompts one by one (the same stream).
    batch_size=1 if partial else int(config.rl.prompts_per_iteration),
    seed=int(config.seed) + 1,
    cursor=cursor["source"],
  )
  if fp8 is not None and fp8.kv_fp8:
    if kv_state:
      fp8.load_state_dict(kv_state)
    else:  # before the first update: the trainer's forward over the first train prompts
      fp8.calibrate_prompts(
        state.params,
        [e.prompt_ids for e in train_examples[: int(config.rl.prompts_per_iteration)]],
        num_samples=k,
        width=seq_len,
      )
  rollout = _rollout.SyncRollout(
    sampler,
    num_samples=k,
    max_prompt_len=rollout_kwargs["max_prompt_len"],
    max_new_tokens=rollout_kwargs["max_new_tokens"],
    fp8=fp8,
  )
  partial_rollout = None
  if partial:
    partial_rollout = _rollout.PartialRollout(
      sampler,
      num_samples=k,
      target_groups=int(config.rl.prompts_per_iteration),
      over_provision=float(config.rollout.over_provision),
      fp8=fp8,
    )
    if rollout_buffer is not None:
      partial_rollout.load_state_dict(rollout_buffer)
    elif latest is not None:
      warnings.warn(
        "Resuming with partial rollouts from a checkpoint without a rollout buffer: "
        "starting with an empty buffer.",
        stacklevel=2,
      )
  rollout_params = _staleness.RolloutParams(
    staleness,
    config.rl.staleness_mode,
    updates_per_iteration=train.updates_per_step(train_cfg),
    place=config.rl.staleness_ring,
    put=lambda tree: train.shard_params(tree, model_config, mesh),
  )
  if stale_state:
    rollout_params.load_state_dict(stale_state)
  elif latest is not None and staleness:
    warnings.warn(
      "Resuming with rl.staleness > 0 from a checkpoint without held param versions: the "
      "ring starts again from the current params.",
      stacklevel=2,
    )
  index_of = {id(e): i for i, e in enumerate(train_examples)}

  def pull(n):  # the next n fresh prompts as (index in the train split, prompt ids)
    out = []
    for _ in range(n):
      e = source.next_batch()[0]
      out.append((index_of[id(e)], e.prompt_ids))
    return out

  # One note per first compile: the first RL iteration compiles the rollout,
  # log-prob and train programs (or the one fused program).
  what = "the fused RL iteration (sampler + reward + train step)"
  if not fused:
    what = "the RL iteration (sampler, log-probs, train step)"
  refresh_probe_s = None
  if fused and fp8 is not None:  # refreshed inside the fused program: time the work standalone
    refresh_probe_s = fp8.time_refresh(
      state.params,
      [e.prompt_ids for e in train_examples[: int(config.rl.prompts_per_iteration)]],
      num_samples=k,
      width=seq_len,
    )

  def one_iteration(state, rng, t0):
    if fused:  # on-policy: the batch's tokens have staleness 0
      examples = source.next_batch()
      state, device_metrics = rl_step.from_examples(state, ref_params, examples, rng)
      metrics = _learner._host_floats(device_metrics)
      metrics["time/fused_s"] = time.perf_counter() - t0
      n = int(metrics["response_tokens"])
      metrics.update(
        staleness_mean=0.0, staleness_min=0.0, staleness_max=0.0, staleness_hist={"0": n}
      )
      return state, metrics
    params, version = rollout_params.select(state.params, learner.version(state))
    if partial:
      batch, keys = partial_rollout.collect_groups(params, pull, rng, policy_version=version)
      examples = [train_examples[int(i)] for i in keys]
      t_rollout = time.perf_counter() - t0
      state, metrics, _ = learner.iteration(
        state, ref_params, _rollout.Collected(batch, refresh=partial_rollout.refresh), examples, rng
      )
      metrics["time/rollout_s"] += t_rollout
      metrics.update(partial_rollout.metrics())
    else:
      examples = source.next_batch()
      state, metrics, _ = learner.iteration(
        state, ref_params, rollout, examples, rng, rollout_params=params, rollout_version=version
      )
    return state, metrics

  if ahead is not None:
    waited = time.perf_counter()
    try:
      ahead.result()
    except Exception as e:  # noqa: BLE001 (the first call compiles it and raises what is wrong)
      warnings.warn(
        f"Compiling {what} ahead of time failed ({type(e).__name__}: {e}); it compiles at "
        "its first call instead.",
        stacklevel=2,
      )
    else:
      if notes:
        _logging.note(
          f"rlx: {what} compiled during the warm-up (waited "
          f"{time.perf_counter() - waited:.1f} s more for it)"
        )
    ahead = None
  iterate = _logging.note_first_call(one_iteration, what, enabled=notes)
  log = _logging.MetricsLog(workdir, resume_iteration=start, tensorboard=config.log.tensorboard)
  total = int(config.rl.iterations)
  stop_reason = cursor.get("stop")
  bar = None
  if config.log.progress_bar and start < total and stop_reason is None:
    import tqdm  # noqa: PLC0415

    bar = tqdm.tqdm(total=total, initial=start, desc="RL", dynamic_ncols=True)
  rl_time = float(cursor["rl_time_s"])
  dev_accuracy = None
  iteration = start
  phase_start = time.perf_counter()
  while stop_reason is None and iteration < total:
    rng = jax.random.fold_in(rollout_key, iteration)
    t0 = time.perf_counter()
    state, metrics = iterate(state, rng, t0)
    seconds = time.perf_counter() - t0
    metrics["time/iteration_s"] = seconds
    metrics["response_tokens_per_s"] = metrics["response_tokens"] / max(seconds, 1e-9)
    iteration += 1
    record = {"phase": "rl", "iteration": iteration, **metrics}
    last = iteration == total
    if config.eval.every and (iteration % config.eval.every == 0 or last):
      dev_accuracy = evaluate(state.params, dev)
      log.write({"phase": "eval", "iteration": iteration, "dev_accuracy": dev_accuracy})
      record["dev_accuracy"] = dev_accuracy
      best_dev = cursor.get("best_dev_accuracy")
      if best_dev is None or dev_accuracy > best_dev:  # model selection on the dev split
        best_params = jax.tree.map(lambda x: np.array(x, copy=True), state.params)
        cursor = {**cursor, "best_dev_accuracy": dev_accuracy, "best_iteration": iteration}
    log.write(record)
    rl_time += time.perf_counter() - t0
    if config.rl.target_dev_accuracy and dev_accuracy is not None:
      if dev_accuracy >= config.rl.target_dev_accuracy:
        stop_reason = f"dev accuracy {dev_accuracy:.3f} >= rl.target_dev_accuracy"
    if config.rl.max_time_s and time.perf_counter() - phase_start >= config.rl.max_time_s:
      stop_reason = f"rl.max_time_s={config.rl.max_time_s} reached"
      warnings.warn(f"Stopping RL after {iteration} iterations: {stop_reason}.", stacklevel=2)
    done = last or stop_reason is not None
    if bar is not None:
      post = {
        "reward": f"{metrics['reward_mean']:.3f}",
        "tok/s": f"{metrics['response_tokens_per_s']:.0f}",
      }
      if dev_accuracy is not None:
        post["dev_acc"] = f"{dev_accuracy:.3f}"
      bar.set_postfix(post)
      bar.update(1)
    if done or iteration % config.checkpoint.every == 0:
      cursor = {
        "source": source.cursor,
        "iteration": iteration,
        "rl_time_s": rl_time,
        "elapsed_s": elapsed_before + time.perf_counter() - wall_start,
        "stop": stop_reason,
        "best_dev_accuracy": cursor.get("best_dev_accuracy"),
        "best_iteration": cursor.get("best_iteration"),
      }
      extra = {"rng": np.asarray(base_key)}
      if best_params is not None:
        extra["best_params"] = best_params
      if partial:
        extra["rollout_buffer"] = partial_rollout.state_dict()
      if fp8 is not None and fp8.kv_scales is not None:
        extra["kv_scales"] = fp8.state_dict()
      if rollout_params.state_dict():
        extra["staleness"] = rollout_params.state_dict()
      ckpt.save(iteration, state, data_cursor=cursor, extra=extra, force=True)
  if bar is not None:
    bar.close()
  ckpt.close()

  accuracy_after = evaluate(state.params, test)
  accuracy_best_dev = accuracy_after
  if best_params is not None and cursor.get("best_iteration") != int(cursor["iteration"]):
    accuracy_best_dev = evaluate(train.shard_params(best_params, model_config, mesh), test)
  accuracy_before = float(warm_info["test_accuracy"])
  plots = []
  if config.log.plots:
    plots.append(
      _logging.plot_run(
        workdir,
        accuracy_before=accuracy_before,
        accuracy_after=accuracy_after,
        warmup_dev_accuracy=warm_info["dev_accuracy"],
      )
    )
  summary_path = os.path.join(workdir, "summary.json")
  records = _logging.read_metrics(os.path.join(workdir, "metrics.jsonl"))
  rl_records = [r for r in records if r.get("phase") == "rl"]
  stale_hist = _staleness.merge_histograms([r.get("staleness_hist") or {} for r in rl_records])
  stale_tokens = sum(stale_hist.values())
  summary = {
    "task": task.name,
    "loss": config.train.loss,
    "baseline": config.rl.baseline,
    "accuracy_before": accuracy_before,
    "accuracy_after": accuracy_after,
    "improvement_points": 100.0 * (accuracy_after - accuracy_before),
    # Test accuracy of the RL checkpoint with the best dev accuracy (model
    # selection on the dev split; equals accuracy_after when that is the last).
    "accuracy_best_dev": accuracy_best_dev,
    "improvement_points_best_dev": 100.0 * (accuracy_best_dev - accuracy_before),
    "best_dev_accuracy": cursor.get("best_dev_accuracy"),
    "best_dev_iteration": cursor.get("best_iteration"),
    "iterations": int(cursor["iteration"]),
    "stop_reason": stop_reason,
    "warmup_steps": warm_info["steps"],
    "warmup_dev_accuracy": warm_info["dev_accuracy"],
    "warmup_time_s": warm_info["time_s"],
    # The warm-up directory this run's warm-up was reused from (warmup.init_from).
    "warmup_reused_from": warm_info.get("reused_from"),
    "rl_time_s": rl_time,
    "seconds_per_iteration": rl_time / max(int(cursor["iteration"]), 1),
    "final_reward_mean": rl_records[-1]["reward_mean"] if rl_records else math.nan,
    "fused_rl_step": fused,
    # Mean seconds of the FP8 rollout refresh per update (host-driven path; with
    # the fused step, which refreshes inside its program, the same work timed
    # standalone once; None without FP8).
    "refresh_s_mean": (
      float(np.mean([r["time/refresh_s"] for r in rl_records if "time/refresh_s" in r]))
      if any("time/refresh_s" in r for r in rl_records)
      else refresh_probe_s
    ),
    "rollout_weight_dtype": rollout_kwargs["weight_dtype"],
    "rollout_kv_dtype": rollout_kwargs["kv_dtype"],
    "wall_time_s": None,
    "resumed_from_iteration": start if latest is not None else None,
    "plots": plots,
    "workdir": workdir,
    # The embedded arithmetic tasks have gold answers a supervised run could use.
    "note": SUPERVISED_NOTE if isinstance(task, tasks.ArithmeticTask) else None,
    # Optimizer updates skipped for a non-finite loss or gradient (train.nonfinite).
    "skipped_updates": int(rl_records[-1].get("skipped_total") or 0) if rl_records else 0,
    # Staleness of the trained tokens at their batch's first update, in optimizer
    # updates (rl.staleness; partial rollouts' recycled tokens), over the run.
    "staleness_mean": (
      sum(int(s) * c for s, c in stale_hist.items()) / stale_tokens if stale_tokens else 0.0
    ),
    "staleness_max": max((int(s) for s in stale_hist), default=0),
    "staleness_hist": stale_hist,
    "config": config.to_dict(),
  }
  this_process = time.perf_counter() - wall_start
  # Time of earlier processes up to their last checkpoint + this process.
  summary["wall_time_s"] = elapsed_before + this_process
  summary["wall_time_s_this_process"] = this_process
  # TensorBoard: the test accuracy before (at iteration 0) and after, and the
  # run's config with its headline figures in the HParams tab.
  log.scalar("test/accuracy", accuracy_before, 0)
  log.scalar("test/accuracy", accuracy_after, int(cursor["iteration"]))
  log.hparams(
    {  # every field but the display settings, where user code and the warm-up came from too
      k: v
      for k, v in _flat(json.loads(json.dumps(config.to_dict(), default=str))).items()
      if not k.startswith("log.")
    },
    {k: summary[k] for k in ("accuracy_before", "accuracy_after", "improvement_points")},
  )
  log.close()
  _write_json(summary_path, summary)
  if config.log.print_summary:
    print(format_summary(summary))
  return summary


def _fmt(value: Any) -> str:
  return f"{value:.3f}" if isinstance(value, float) else str(value)


def format_summary(summary: dict[str, Any]) -> str:
  """The before/after table printed at the end of a run."""
  rows = [
    ("held-out greedy accuracy, after warm-up (before RL)", f"{summary['accuracy_before']:.3f}"),
    ("held-out greedy accuracy, after RL", f"{summary['accuracy_after']:.3f}"),
    ("improvement (points)", f"{summary['improvement_points']:+.1f}"),
    (
      f"held-out accuracy, best-dev RL checkpoint (iter {summary['best_dev_iteration']})",
      f"{summary['accuracy_best_dev']:.3f}",
    ),
    (
      "warm-up steps (dev accuracy reached)",
      f"{summary['warmup_steps']} ({_fmt(summary['warmup_dev_accuracy'])})",
    ),
    ("RL iterations", f"{summary['iterations']}"),
    ("seconds / RL iteration", f"{summary['seconds_per_iteration']:.3f}"),
    ("wall time (s)", f"{summary['wall_time_s']:.1f}"),
  ]
  width = max(len(r[0]) for r in rows)
  title = f"rlx RL run on task {summary['task']!r}"
  if "loss" in summary:
    title += f": loss {summary['loss']!r}, baseline {summary['baseline']!r}"
  lines = ["", title, "-" * (width + 14)]
  lines += [f"{name:<{width}}  {value:>10}" for name, value in rows]
  lines.append("-" * (width + 14))
  for p in summary["plots"]:
    lines.append(f"plots:    {p}")
  lines.append(
    f"metrics:  {os.path.join(summary['workdir'], 'metrics.jsonl')} (TensorBoard: tensorboard/)"
  )
  lines.append(f"summary:  {os.path.join(summary['workdir'], 'summary.json')}")
  if summary.get("skipped_updates"):
    lines.append(
      f"Warning: {summary['skipped_updates']} optimizer updates were skipped for a non-finite "
      "loss or gradient (metric skipped_total)."
    )
  if summary.get("note"):
    lines.append(summary["note"])
  return "\n".join(lines)
