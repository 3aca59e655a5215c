"""The start of an RL run: its own (cached) warm-up, or one reused from another run.

A warm-up is identified by its key (`warmup_key`): everything it depends on
(seed, task, model, mesh, sampler, the warm-up section and the evaluation
sizes whose greedy accuracies it records). Runs with equal keys warm up to the
same params, so a grid of losses over seeds needs one warm-up per seed
(`warmup.init_from`, set by `rlx.rl.run_sweep`).

Layout of `workdir/warmup/`: an orbax checkpoint (step 0) of the RL start
state without its optimizer state (the RL state is rebuilt from the params,
so a run whose optimizer differs can start from them), its record (steps,
dev and test accuracy, time) as the data cursor, and `warmup_key.json`.
"""

import json
import os
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import ml_collections

from rlx import train
from rlx.rl import _config, _logging, _warmup

KEY_FILE = "warmup_key.json"


class WarmStart(NamedTuple):
  """The RL start state and the warm-up's record.

  Attributes:
    state: the `TrainState` RL starts from (fresh optimizer state).
    info: {"steps", "dev_accuracy", "reached", "test_accuracy", "time_s"} and,
      when reused, "reused_from" (the source directory).
  """

  state: Any
  info: dict


def warmup_key(config: ml_collections.ConfigDict) -> dict[str, Any]:
  """What a run's warm-up depends on, as plain JSON values (equal keys, equal warm-ups)."""
  warm = {k: v for k, v in config.warmup.to_dict().items() if k != "init_from"}
  key = {
    "seed": int(config.seed),
    "task": {"name": config.task.name, "kwargs": _config.task_kwargs(config)},
    "model": config.model.to_dict(),
    "mesh": config.mesh.to_dict(),
    "sampler": config.sampler.to_dict(),
    "warmup": warm,
    "eval": {k: config.eval[k] for k in ("dev_examples", "test_examples")},
  }
  return json.loads(json.dumps(key, default=str))


def resolve_source(init_from: str) -> str:
  """The warm-up checkpoint directory of `warmup.init_from` (a workdir or the directory itself).

  Raises:
    ValueError: naming the path when it holds no warm-up.
  """
  path = os.path.abspath(os.path.expanduser(init_from))
  for candidate in (os.path.join(path, "warmup"), path):
    if os.path.isfile(os.path.join(candidate, KEY_FILE)):
      return candidate
  raise ValueError(
    f"`config.warmup.init_from`={init_from!r} holds no warm-up: expected a run's workdir (with "
    f"warmup/{KEY_FILE}) or its warmup/ directory, looked in {path}."
  )


def read_warmup_key(directory: str) -> dict[str, Any] | None:
  """The `warmup_key` a saved warm-up was trained for (None if `directory` holds none).

  A run saves its warm-up in `<workdir>/warmup` with its key in
  `warmup_key.json`; `warmup.init_from` reuses it only for a config of an
  equal key, so `read_warmup_key(path) == warmup_key(config)` says whether a
  cached warm-up fits a config. A warm-up field added to the config after
  that key was saved had its default then, and is filled in so (the key of a
  default warm-up stays equal).

  Args:
    directory: a warm-up directory (`<workdir>/warmup`).

  Returns:
    The key as plain JSON values, or None if `directory` has no `warmup_key.json`.
  """
  path = os.path.join(directory, KEY_FILE)
  if not os.path.exists(path):
    return None
  with open(path) as f:
    key = json.load(f)
  warm = key.get("warmup") if isinstance(key, dict) else None
  if isinstance(warm, dict):
    for name, value in warmup_key(_config.get_config())["warmup"].items():
      warm.setdefault(name, value)
  return key


def key_differences(a: dict, b: dict, prefix: str = "") -> list[str]:
  """The dotted fields whose values differ between two nested dicts."""
  out = []
  for k in sorted(set(a) | set(b)):
    x, y = a.get(k), b.get(k)
    if isinstance(x, dict) and isinstance(y, dict):
      out += key_differences(x, y, f"{prefix}{k}.")
    elif x != y:
      out.append(f"{prefix}{k}: {y!r} -> {x!r}")
  return out


def warm_start(
  config: ml_collections.ConfigDict,
  workdir: str,
  *,
  init_params: Any,
  model_config: Any,
  train_cfg: ml_collections.ConfigDict,
  mesh: Any,
  task: Any,
  abstract: Any,
  evaluate: Callable[[Any, str], float],
  seq_len: int,
  open_log: Callable[[], _logging.MetricsLog] | None = None,
  progress: bool = False,
) -> WarmStart:
  """This run's warm-up: resumed from `workdir/warmup`, reused (`warmup.init_from`) or trained.

  Args:
    config: the validated RL config.
    workdir: the run's directory.
    init_params: the freshly initialised (or HF) params.
    model_config: the `rlx.policy.ModelConfig`.
    train_cfg: the run's `rlx.train` config (its optimizer makes the start state).
    mesh: the mesh.
    task: the task.
    abstract: the abstract RL `TrainState` (restore target).
    evaluate: `(params, split) -> greedy accuracy`, split "dev" or "test".
    seq_len: the padded sequence width of the warm-up batches.
    open_log: opens the log warm-up records go to (metrics.jsonl, TensorBoard)
      when a warm-up is trained or reused; None: no log.
    progress: show a progress bar and first-compile notes.

  Returns:
    A `WarmStart`.

  Raises:
    ValueError: `warmup.init_from` holds no warm-up, or one of another key.
  """
  directory = os.path.join(workdir, "warmup")
  key = warmup_key(config)
  # The warm-up is saved without an optimizer state: the RL start state is
  # rebuilt from its params, so a run whose optimizer differs can reuse it.
  params_only = abstract.replace(opt_state=())
  ckpt = train.Checkpointer(directory, max_to_keep=1, async_save=False)
  try:
    if ckpt.latest_step() is not None:  # this run's own warm-up (a resumed run)
      saved = read_warmup_key(directory)
      if saved is not None and saved != key:
        raise ValueError(
          f"{directory} holds a warm-up of another config "
          f"({'; '.join(key_differences(key, saved)[:6])}); pass a new workdir."
        )
      restored = ckpt.restore(params_only)
      params, info = restored.state.params, restored.data_cursor
    else:
      log = open_log() if open_log is not None else None
      try:
        if config.warmup.init_from:
          params, info = _reuse(config.warmup.init_from, key, params_only, log)
        else:
          params, info = _train(
            config, init_params, model_config, mesh, task, evaluate, seq_len, log, progress
          )
      finally:
        if log is not None:
          log.close()
    state = train.create_train_state(
      params,
      model_config,
      train_cfg,
      mesh,
      rng=jax.random.fold_in(jax.random.PRNGKey(config.seed), 2),
    )
    if ckpt.latest_step() is None:
      if "test_accuracy" not in info:
        t0 = time.perf_counter()
        info["test_accuracy"] = evaluate(state.params, "test")
        info["time_s"] += time.perf_counter() - t0
      ckpt.save(0, state.replace(opt_state=()), data_cursor=info, force=True)
      ckpt.wait_until_finished()
      with open(os.path.join(directory, KEY_FILE), "w") as f:
        json.dump(key, f, indent=2)
    return WarmStart(state, info)
  finally:
    ckpt.close()


def _train(config, init_params, model_config, mesh, task, evaluate, seq_len, log, progress):
  """Trains the warm-up (if enabled); returns `(params, info)`."""
  t0 = time.perf_counter()
  if not config.warmup.enabled:
    return init_params, {"steps": 0, "dev_accuracy": None, "reached": None, "time_s": 0.0}
  bar = None
  if progress:
    import tqdm  # noqa: PLC0415

    bar = tqdm.tqdm(
      total=int(config.warmup.max_steps), desc="warm-up", unit="step", dynamic_ncols=True
    )

  def record(r):
    if log is not None:
      log.write({"phase": "warmup", **r})
    if bar is not None:
      bar.update(int(r["step"]) - bar.n)
      target = config.warmup.target_dev_accuracy
      bar.set_postfix({"dev_acc": f"{r['dev_accuracy']:.3f}", "target": f"{target:g}"})

  try:
    result = _warmup.supervised_warmup(
      init_params,
      model_config,
      mesh,
      task,
      config,
      evaluate=lambda p: evaluate(p, "dev"),
      seq_len=seq_len,
      seed=int(config.seed),
      log=record,
      wrap_step=lambda f: _logging.note_first_call(f, "the warm-up step", enabled=progress),
    )
  finally:
    if bar is not None:
      bar.close()
  info = {
    "steps": result.steps,
    "dev_accuracy": result.dev_accuracy,
    "reached": result.reached,
    "time_s": time.perf_counter() - t0,
  }
  return result.params, info


def _reuse(
  init_from: str, key: dict, target: Any, log: _logging.MetricsLog | None
) -> tuple[Any, dict]:
  """The params and record of another run's warm-up with the same key."""
  source = resolve_source(init_from)
  saved = read_warmup_key(source)
  if saved != key:
    raise ValueError(
      f"`config.warmup.init_from`={init_from!r} is the warm-up of another config "
      f"({'; '.join(key_differences(key, saved)[:6])}): a warm-up is reused only when its seed, "
      "task, model, mesh, sampler, warm-up and evaluation sizes equal this run's."
    )
  with train.Checkpointer(source, max_to_keep=None, async_save=False) as ckpt:
    restored = ckpt.restore(target)
  info = dict(restored.data_cursor)
  info["reused_from"] = source
  if log is not None:  # the reused warm-up's curve, so this run's log is complete
    for r in _logging.read_metrics(os.path.join(os.path.dirname(source), "metrics.jsonl")):
      if r.get("phase") == "warmup":
        log.write(r)
  return restored.state.params, info
