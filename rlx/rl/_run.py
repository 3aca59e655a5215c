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

import dataclasses
import json
import math
import os
import time
import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from rlx import objectives, policy, tasks, train
from rlx.rl import (
  _cache,
  _config,
  _driver,
  _evaluate,
  _learner,
  _logging,
  _rollout,
  _spec,
  _staleness,
  _warmstart,
)

SUPERVISED_NOTE = (
  "Note: supervised training on the gold answers alone could also solve this task; the "
  "demo's point is that the policy improves from the reward alone (no gold answers are "
  "used after the warm-up)."
)

# The `config.model` fields that define the architecture (a checkpoint's config.json sets them).
_ARCHITECTURE = tuple(
  "family hidden_size num_layers num_heads num_kv_heads head_dim intermediate_size".split()
)


def build_model(config: ml_collections.ConfigDict, task: Any) -> tuple[Any, Any]:
  """`(model_config, params)`: an HF checkpoint, or a fresh small model for the task.

  Every `config.model` field takes effect: with `hf_checkpoint` the
  architecture comes from its config.json, so an architecture field (family,
  sizes) that differs from its default is a ValueError naming it; the dtypes
  (params converted on load) and `remat` apply to both kinds of model.
  """
  m = config.model
  architecture = {name: m[name] for name in _ARCHITECTURE}
  if m.hf_checkpoint:
    defaults = _config.get_config().model
    for name, value in architecture.items():
      if value != defaults[name]:
        raise ValueError(
          f"`config.model.{name}`={value!r} is set with `config.model.hf_checkpoint`: the "
          f"architecture comes from the checkpoint's config.json; leave it at its default "
          f"{defaults[name]!r}."
        )
    return policy.load_hf_checkpoint(
      m.hf_checkpoint, dtype=m.param_dtype, compute_dtype=m.compute_dtype, remat=m.remat
    )
  model_config = policy.ModelConfig.small(
    vocab_size=int(task.tokenizer.vocab_size),
    **architecture,
    param_dtype=m.param_dtype,
    compute_dtype=m.compute_dtype,
    remat=m.remat,
  )
  key = jax.random.fold_in(jax.random.PRNGKey(config.seed), 0)
  return model_config, policy.init_params(model_config, key)


def _devices(config: ml_collections.ConfigDict) -> tuple[list, list]:
  """(train devices, rollout devices) of `config.mesh` (the rollout ones empty: shared)."""
  devices = jax.devices()
  if config.mesh.num_devices:
    if config.mesh.num_devices > len(devices):
      raise ValueError(
        f"`config.mesh.num_devices`={config.mesh.num_devices} exceeds the {len(devices)} devices."
      )
    devices = devices[: config.mesh.num_devices]
  n = int(config.mesh.get("rollout_devices", 0))
  if n and n >= len(devices):
    raise ValueError(
      f"`config.mesh.rollout_devices`={n} leaves none of the {len(devices)} devices to train."
    )
  return (devices[:-n], devices[-n:]) if n else (devices, [])


def build_mesh(config: ml_collections.ConfigDict) -> Any:
  """The `rlx.train` mesh of `config.mesh` (without `mesh.rollout_devices`' devices)."""
  devices = _devices(config)[0]
  return train.make_mesh(config.mesh.data, config.mesh.fsdp, config.mesh.tensor, devices=devices)


def build_rollout_mesh(config: ml_collections.ConfigDict, train_mesh: Any) -> Any:
  """The rollout sampler's mesh: data-parallel over `mesh.rollout_devices`, else `train_mesh`."""
  devices = _devices(config)[1]
  return train.make_mesh(-1, 1, 1, devices=devices) if devices else train_mesh


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
  defaults = _compared(_config.get_config().to_dict())
  for key in now.keys() - before.keys():
    if key in defaults:
      before[key] = defaults[key]
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
  spec = _spec.RunSpec.from_config(config)  # validates; the loop reads only `spec`
  wall_start = time.perf_counter()
  if spec.compilation_cache_dir:
    _cache.enable_compilation_cache(spec.compilation_cache_dir)
  workdir = os.path.abspath(workdir)
  os.makedirs(workdir, exist_ok=True)
  finished = _check_workdir(config, workdir)
  if finished is not None:
    _logging.note(f"rlx: {workdir} holds this run, finished: returning its saved summary.")
    if spec.print_summary:
      print(format_summary(finished))
    return finished
  notes = spec.progress
  parts = _build(config, spec)
  learner, driver = parts.learner, parts.driver
  abstract = train.abstract_train_state(parts.model_config, learner.train_config, parts.mesh)
  ckpt = train.Checkpointer(os.path.join(workdir, "checkpoints"), max_to_keep=spec.max_to_keep)
  log = None
  try:  # the checkpointer (and metrics log) close even when an iteration raises
    base_key = jax.random.PRNGKey(spec.seed)
    rollout_key = jax.random.fold_in(base_key, 1)
    # The fused RL program compiles in a thread while the warm-up trains.
    driver.compile_ahead(abstract, jax.random.fold_in(rollout_key, 0))

    # --- warm-up (this run's, cached; or reused from another run) ---
    warm = _warmstart.warm_start(
      config,
      workdir,
      init_params=parts.init_params,
      model_config=parts.model_config,
      train_cfg=learner.train_config,
      mesh=parts.mesh,
      task=parts.task,
      abstract=abstract,
      evaluate=parts.evaluate,
      seq_len=driver.width,
      open_log=lambda: _logging.MetricsLog(
        workdir,
        resume_iteration=None,
        tensorboard=spec.tensorboard,
        tensorboard_subdir="warmup",
      ),
      progress=notes,
    )
    ref_params = jax.tree.map(jnp.copy, warm.state.params) if learner.uses_ref else None
    parts.warm_info = warm.info

    # --- RL (resumable) ---
    latest = ckpt.latest_step()
    loop = _Loop(state=warm.state, cursor=RunCursor())
    extra = None
    if latest is not None:
      restored = ckpt.restore(abstract)
      loop = _Loop(state=restored.state, cursor=RunCursor.from_json(restored.data_cursor))
      extra = restored.extra or {}
      loop.best_params = extra.get("best_params")
    del warm
    driver.start(
      loop.state,
      extra,
      loop.cursor.source,
      resumed=latest is not None,
      rollout_key=rollout_key,
      iteration=loop.cursor.iteration,
    )
    driver.wait_ahead(notes)
    start = loop.cursor.iteration
    log = _logging.MetricsLog(workdir, resume_iteration=start, tensorboard=spec.tensorboard)
    elapsed_before = loop.cursor.elapsed_s
    _rl_loop(spec, loop, parts, ref_params, ckpt, log, rollout_key, base_key, wall_start)
  except BaseException:
    if log is not None:
      log.close()
    raise
  finally:
    driver.close()
    ckpt.close()
  summary = _summary(config, spec, workdir, parts, loop, start if latest is not None else None)
  this_process = time.perf_counter() - wall_start
  # Time of earlier processes up to their last checkpoint + this process.
  summary["wall_time_s"] = elapsed_before + this_process
  summary["wall_time_s_this_process"] = this_process
  # TensorBoard: the test accuracy before (at iteration 0) and after, and the
  # run's config with its headline figures in the HParams tab.
  log.scalar("test/accuracy", summary["accuracy_before"], 0)
  log.scalar("test/accuracy", summary["accuracy_after"], summary["iterations"])
  log.hparams(
    {  # every field but the display settings, where user code and the warm-up came from too
      k: v
      for k, v in _flat(json.loads(json.dumps(config.to_dict(), default=str))).items()
      if not k.startswith("log.")
    },
    {k: summary[k] for k in ("accuracy_before", "accuracy_after", "improvement_points")},
  )
  log.close()
  _write_json(os.path.join(workdir, "summary.json"), summary)
  if spec.print_summary:
    print(format_summary(summary))
  return summary


@dataclasses.dataclass
class _Parts:
  """What a run is built from: the task, model, mesh, samplers, learner and rollout driver."""

  task: Any
  mesh: Any
  model_config: Any
  init_params: Any
  dev: list
  test: list
  evaluate: Callable[[Any, Any], float]
  learner: _learner.Learner
  driver: _driver.RolloutDriver
  warm_info: dict = dataclasses.field(default_factory=dict)


def _build(config: ml_collections.ConfigDict, spec: _spec.RunSpec) -> _Parts:
  """The run's task, mesh, model, rollout and evaluation samplers, learner and driver."""
  notes = spec.progress
  task = _config.make_task(config)
  mesh = build_mesh(config)
  model_config, init_params = build_model(config, task)
  rollout_kwargs = _rollout.sampler_kwargs(config, task, rows=spec.rows, greedy=False)
  sampler = _rollout.make_sampler(model_config, rollout_kwargs, build_rollout_mesh(config, mesh))
  # Evaluated every eval.every iterations and every warmup.eval_every steps (dev), twice (test).
  evaluate = _evaluate.GreedyEvaluator(config, task, model_config, mesh, notes=notes)
  dev, test = evaluate.dev, evaluate.test
  learner = _learner.Learner(config, task, model_config, mesh)
  driver = _driver.RolloutDriver(spec, learner, sampler, rollout_kwargs, task.split("train"))
  return _Parts(task, mesh, model_config, init_params, dev, test, evaluate, learner, driver)


@dataclasses.dataclass(frozen=True)
class RunCursor:
  """Where an RL run stands: the data cursor saved with each of its checkpoints.

  Saved as a JSON dict (`to_json`) and read back with `from_json`, which
  names a missing or unknown field.

  Attributes:
    iteration: RL iterations done.
    source: the prompt stream's position (`PromptSource.cursor`); None before the first.
    rl_time_s: seconds spent in RL iterations (their evaluation and logging included).
    elapsed_s: wall-clock seconds of the run's processes up to this checkpoint.
    stop: why the run stopped early (`rl.target_dev_accuracy`, `rl.max_time_s`), else None.
    best_dev_accuracy: the best dev accuracy of an RL evaluation so far (None before one).
    best_iteration: the iteration it was reached at.
  """

  iteration: int = 0
  source: dict | None = None
  rl_time_s: float = 0.0
  elapsed_s: float = 0.0
  stop: str | None = None
  best_dev_accuracy: float | None = None
  best_iteration: int | None = None

  def to_json(self) -> dict[str, Any]:
    """The JSON dict saved as the checkpoint's data cursor."""
    return dataclasses.asdict(self)

  @classmethod
  def from_json(cls, value: dict[str, Any]) -> "RunCursor":
    """The cursor of a checkpoint's data cursor dict."""
    names = {f.name for f in dataclasses.fields(cls)}
    if not isinstance(value, dict) or "iteration" not in value or set(value) - names:
      raise ValueError(
        f"A run checkpoint's data cursor must be a dict with `iteration` and fields from "
        f"{sorted(names)}, got {value!r}."
      )
    return cls(**value)


@dataclasses.dataclass
class _Loop:
  """The RL loop's running state: train state, cursor and best-dev params."""

  state: Any
  cursor: RunCursor
  best_params: Any = None


def _rl_loop(spec, loop, parts, ref_params, ckpt, log, rollout_key, base_key, wall_start):
  """Runs the RL iterations left (evaluating, logging, checkpointing); updates `loop`."""
  driver, cursor = parts.driver, loop.cursor
  iterate = _logging.note_first_call(driver.iteration, driver.what, enabled=spec.progress)
  total = spec.iterations
  iteration, stop, rl_time = cursor.iteration, cursor.stop, cursor.rl_time_s
  bar = None
  if spec.progress and iteration < total and stop is None:
    import tqdm  # noqa: PLC0415

    bar = tqdm.tqdm(total=total, initial=iteration, desc="RL", dynamic_ncols=True)
  dev_accuracy = None
  phase_start = time.perf_counter()
  while stop is None and iteration < total:
    rng = jax.random.fold_in(rollout_key, iteration)
    t0 = time.perf_counter()
    loop.state, metrics = iterate(loop.state, ref_params, rng, t0)
    seconds = time.perf_counter() - t0
    metrics["time/iteration_s"] = seconds
    metrics["response_tokens_per_s"] = metrics["response_tokens"] / max(seconds, 1e-9)
    iteration += 1
    record = {"phase": "rl", "iteration": iteration, **metrics}
    last = iteration == total
    if spec.eval_every and (iteration % spec.eval_every == 0 or last):
      dev_accuracy = parts.evaluate(loop.state.params, parts.dev)
      log.write({"phase": "eval", "iteration": iteration, "dev_accuracy": dev_accuracy})
      record["dev_accuracy"] = dev_accuracy
      best_dev = cursor.best_dev_accuracy
      if best_dev is None or dev_accuracy > best_dev:  # model selection on the dev split
        loop.best_params = jax.tree.map(lambda x: np.array(x, copy=True), loop.state.params)
        cursor = dataclasses.replace(
          cursor, best_dev_accuracy=dev_accuracy, best_iteration=iteration
        )
    log.write(record)
    rl_time += time.perf_counter() - t0
    if spec.target_dev_accuracy and dev_accuracy is not None:
      if dev_accuracy >= spec.target_dev_accuracy:
        stop = f"dev accuracy {dev_accuracy:.3f} >= rl.target_dev_accuracy"
    if spec.max_time_s and time.perf_counter() - phase_start >= spec.max_time_s:
      stop = f"rl.max_time_s={spec.max_time_s} reached"
      warnings.warn(f"Stopping RL after {iteration} iterations: {stop}.", stacklevel=2)
    if bar is not None:
      post = {
        "reward": f"{metrics['reward_mean']:.3f}",
        "tok/s": f"{metrics['response_tokens_per_s']:.0f}",
      }
      if dev_accuracy is not None:
        post["dev_acc"] = f"{dev_accuracy:.3f}"
      bar.set_postfix(post)
      bar.update(1)
    cursor = dataclasses.replace(
      cursor, iteration=iteration, source=driver.source_cursor, rl_time_s=rl_time, stop=stop
    )
    if last or stop is not None or iteration % spec.checkpoint_every == 0:
      # Time of earlier processes up to their last checkpoint + this process.
      elapsed = loop.cursor.elapsed_s + time.perf_counter() - wall_start
      cursor = dataclasses.replace(cursor, elapsed_s=elapsed)
      extra = {"rng": np.asarray(base_key), **driver.state_dict()}
      if loop.best_params is not None:
        extra["best_params"] = loop.best_params
      ckpt.save(iteration, loop.state, data_cursor=cursor.to_json(), extra=extra, force=True)
  if bar is not None:
    bar.close()
  loop.cursor = cursor


def _summary(config, spec, workdir, parts, loop, resumed_from) -> dict[str, Any]:
  """The run's summary (test accuracies, timings, staleness, config); evaluates the test split."""
  state, cursor, driver = loop.state, loop.cursor, parts.driver
  warm_info = parts.warm_info
  accuracy_after = parts.evaluate(state.params, parts.test)
  accuracy_best_dev = accuracy_after
  if loop.best_params is not None and cursor.best_iteration != cursor.iteration:
    best = train.shard_params(loop.best_params, parts.model_config, parts.mesh)
    accuracy_best_dev = parts.evaluate(best, parts.test)
  accuracy_before = float(warm_info["test_accuracy"])
  plots = []
  if spec.plots:
    plots.append(
      _logging.plot_run(
        workdir,
        accuracy_before=accuracy_before,
        accuracy_after=accuracy_after,
        warmup_dev_accuracy=warm_info["dev_accuracy"],
      )
    )
  records = _logging.read_metrics(os.path.join(workdir, "metrics.jsonl"))
  rl_records = [r for r in records if r.get("phase") == "rl"]
  stale_hist = _staleness.merge_histograms([r.get("staleness_hist") or {} for r in rl_records])
  stale_tokens = sum(stale_hist.values())
  refresh_s = [r["time/refresh_s"] for r in rl_records if "time/refresh_s" in r]
  iterations = cursor.iteration
  return {
    "task": parts.task.name,
    "loss": spec.loss,
    "baseline": spec.baseline,
    "accuracy_before": accuracy_before,
    "accuracy_after": accuracy_after,
    "improvement_points": 100.0 * (accuracy_after - accuracy_before),
    # Test accuracy of the RL checkpoint with the best dev accuracy (model
    # selection on the dev split; equals accuracy_after when that is the last).
    "accuracy_best_dev": accuracy_best_dev,
    "improvement_points_best_dev": 100.0 * (accuracy_best_dev - accuracy_before),
    "best_dev_accuracy": cursor.best_dev_accuracy,
    "best_dev_iteration": cursor.best_iteration,
    "iterations": iterations,
    "stop_reason": cursor.stop,
    "warmup_steps": warm_info["steps"],
    "warmup_dev_accuracy": warm_info["dev_accuracy"],
    "warmup_time_s": warm_info["time_s"],
    # The warm-up directory this run's warm-up was reused from (warmup.init_from).
    "warmup_reused_from": warm_info.get("reused_from"),
    "rl_time_s": cursor.rl_time_s,
    "seconds_per_iteration": cursor.rl_time_s / max(iterations, 1),
    "final_reward_mean": rl_records[-1]["reward_mean"] if rl_records else math.nan,
    "fused_rl_step": driver.fused,
    # Mean seconds of the FP8 rollout refresh per update (host-driven path; with
    # the fused step, which refreshes inside its program, the same work timed
    # standalone once; None without FP8).
    "refresh_s_mean": float(np.mean(refresh_s)) if refresh_s else driver.refresh_probe_s,
    "rollout_weight_dtype": driver.rollout_kwargs["weight_dtype"],
    "rollout_kv_dtype": driver.rollout_kwargs["kv_dtype"],
    "rollout_kv_scale_mode": driver.rollout_kwargs["kv_scale_mode"],
    "wall_time_s": None,
    "resumed_from_iteration": resumed_from,
    "plots": plots,
    "workdir": workdir,
    # The embedded arithmetic tasks have gold answers a supervised run could use.
    "note": SUPERVISED_NOTE if isinstance(parts.task, tasks.ArithmeticTask) else None,
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
