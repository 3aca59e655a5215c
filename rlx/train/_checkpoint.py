"""Orbax checkpoints of a run: train state, data cursor and an opaque extra pytree.

One checkpoint step holds three items:
  state   the whole `TrainState` (step, params, optimizer state, rng, skipped),
          as sharded arrays (each process writes its shards);
  cursor  the data cursor, any JSON value (e.g. `{"epoch": 1, "index": 96}`);
  extra   optional host pytree of arrays, e.g. the partial-rollout buffer.
Together they are everything needed to resume a run bit-exactly: the step
draws its randomness from `fold_in(state.rng, state.step)` and the data
pipeline restarts from the cursor.

Built on `orbax.checkpoint.CheckpointManager`
(https://orbax.readthedocs.io/en/latest/guides/checkpoint/api_refactor.html):
paths are `etils.epath.Path`s (local or cloud, e.g. `gs://`), steps and items
come from the manager's own `all_steps` / `item_metadata`, and each save is
written to a temporary directory that orbax renames (or, on object stores,
marks committed) only once complete, so a run killed mid-save leaves no step
that the manager lists.
"""

import asyncio
import contextlib
import json
import os
import re
import threading
import warnings
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from rlx.train import _state

# Longest part of an underlying (orbax / TensorStore) error quoted in messages.
_CAUSE_CHARS = 300
# Longest wait, in seconds, for the reads still running when a restore fails.
_DRAIN_TIMEOUT_S = 60.0


class CheckpointError(RuntimeError):
  """A checkpoint step that cannot be read, or a save that was not performed.

  Attributes:
    step: the checkpoint step concerned (None if none).
    directory: the checkpoint directory.
  """

  def __init__(self, message: str, *, step: int | None, directory: Any):
    super().__init__(message)
    self.step = step
    self.directory = directory


class Restored(NamedTuple):
  """What `Checkpointer.restore` returns.

  Attributes:
    step: the checkpoint's step number.
    state: the restored `TrainState`, sharded like the restore target.
    data_cursor: the JSON value saved as the data cursor (None if none saved).
    extra: the extra pytree (None if none saved).
  """

  step: int
  state: _state.TrainState
  data_cursor: Any
  extra: Any


class Checkpointer:
  """Asynchronous, keep-last-N orbax checkpointing of a training run.

  Example:
    ckpt = Checkpointer(workdir + "/ckpt", max_to_keep=3)
    ckpt.save(step, state, data_cursor={"index": i}, extra=buffer)
    ...
    restored = ckpt.restore(abstract_train_state(model_cfg, train_cfg, mesh))

  Saving is asynchronous: `save` returns once the arrays are copied off the
  devices, so the next (donating) train step may run while files are written.
  Call `wait_until_finished()` (or `close()`) before reading the files from
  another process. Every process of a multi-process run must call `save` and
  `restore` (collectively), with the same `directory`.

  Faults:
    - `restore()` of the latest step falls back to the newest READABLE step:
      a step whose files are truncated or corrupt is skipped with a warning
      naming it (`restore(step=n)` of such a step raises `CheckpointError`
      naming it). A restore target of another shape (model or optimizer
      config) is a `ValueError` naming the mismatching leaves, not a fallback.
    - A save that is not performed raises `CheckpointError` (except the
      documented `save_interval_steps` skip, which returns False).
    - Retention keeps the newest `max_to_keep` steps not known to be broken,
      and never deletes the newest step known to be good (saved or restored
      by this `Checkpointer`). It runs once a save has finished (at the next
      `save`, `wait_until_finished` or `close`), so up to `max_to_keep + 1`
      steps exist while a save is being written. Known-broken steps are
      deleted by retention, and by a `save` of the same step number.
  """

  def __init__(
    self,
    directory: str | os.PathLike,
    *,
    max_to_keep: int | None = 3,
    save_interval_steps: int = 1,
    async_save: bool = True,
  ):
    """Opens (or creates) a checkpoint directory.

    Args:
      directory: where step sub-directories are written: a local path
        (relative paths are made absolute) or a cloud URL such as
        `gs://bucket/run/ckpt` (`etils.epath.Path`).
      max_to_keep: keep only the newest N good checkpoints (None = keep all).
      save_interval_steps: `save` only writes steps divisible by this (unless
        `force=True`).
      async_save: write files in a background thread.
    """
    if max_to_keep is not None and (not isinstance(max_to_keep, int) or max_to_keep < 1):
      raise ValueError(f"`max_to_keep` must be an int >= 1 or None, got {max_to_keep!r}.")
    if not isinstance(save_interval_steps, int) or save_interval_steps < 1:
      raise ValueError(f"`save_interval_steps` must be an int >= 1, got {save_interval_steps!r}.")
    path = epath.Path(directory)
    self.directory = path if path.is_absolute() else path.absolute()
    if self.directory.exists() and not self.directory.is_dir():
      raise ValueError(f"`directory` {self.directory} exists and is not a directory.")
    self._max_to_keep = max_to_keep
    self._save_interval_steps = save_interval_steps
    self._good: set[int] = set()  # steps saved or restored by this Checkpointer
    self._broken: set[int] = set()  # steps found unreadable
    self._pending: int | None = None  # step whose async save may still run
    self._manager = ocp.CheckpointManager(
      self.directory,
      item_handlers={
        "state": ocp.StandardCheckpointHandler(),
        "cursor": ocp.JsonCheckpointHandler(),
        "extra": ocp.StandardCheckpointHandler(),
      },
      options=ocp.CheckpointManagerOptions(
        max_to_keep=None,  # retention is `_apply_retention` (never evicts the last good step)
        enable_async_checkpointing=async_save,
      ),
    )

  def save(
    self,
    step: int,
    state: _state.TrainState,
    *,
    data_cursor: Any = None,
    extra: Any = None,
    force: bool = False,
  ) -> bool:
    """Starts saving checkpoint `step` (asynchronously).

    Args:
      step: the checkpoint number (usually `int(state.step)`), newer than every
        kept readable step.
      state: the `TrainState` to save (any sharding).
      data_cursor: JSON-serialisable position of the data pipeline.
      extra: optional pytree of host arrays / numbers (e.g. the partial-rollout
        buffer); numpy leaves restore as numpy.
      force: save even if `step` is not a multiple of `save_interval_steps`.

    Returns:
      True if a save was started; False only when `step` is skipped by
      `save_interval_steps` (and not `force`).

    Raises:
      ValueError: bad arguments, or `step` is not newer than the newest kept step.
      CheckpointError: orbax declined or failed the save (e.g. a previous
        asynchronous save failed, or the directory is read-only).
    """
    if not isinstance(state, _state.TrainState):
      raise ValueError(f"`state` must be a TrainState, got {type(state).__name__}.")
    if isinstance(step, bool) or not isinstance(step, int | np.integer) or step < 0:
      raise ValueError(f"`step` must be an int >= 0, got {step!r}.")
    step = int(step)
    if not force and step % self._save_interval_steps:
      return False
    self._finish_pending()
    for broken in sorted(s for s in self._broken if s >= step and s in self._steps()):
      warnings.warn(
        f"Deleting unreadable checkpoint step {broken} in {self.directory} before saving "
        f"step {step}.",
        stacklevel=2,
      )
      self._delete(broken)
    existing = self._steps()
    if step in existing:
      raise ValueError(f"Checkpoint step {step} already exists in {self.directory}.")
    if existing and step < max(existing):
      raise ValueError(
        f"Checkpoint step {step} is older than the newest kept step {max(existing)} in "
        f"{self.directory}; steps must increase."
      )
    try:
      json.dumps(data_cursor)
    except (TypeError, ValueError) as e:
      raise ValueError(
        f"`data_cursor` must be JSON-serialisable (ints, strings, lists, dicts), got "
        f"{type(data_cursor).__name__}: {e}"
      ) from None
    if extra is not None:
      for path, leaf in jax.tree_util.tree_leaves_with_path(extra):
        dtype = getattr(leaf, "dtype", None) or np.asarray(leaf).dtype
        # jnp.issubdtype knows the ml_dtypes floats (bfloat16 has NumPy kind "V").
        if not (jnp.issubdtype(dtype, jnp.number) or jnp.issubdtype(dtype, jnp.bool_)):
          raise ValueError(
            f"`extra{jax.tree_util.keystr(path)}` must be a numeric array or number, got "
            f"{type(leaf).__name__}."
          )
    items = {
      "state": ocp.args.StandardSave(state),
      # `has_extra` lets restore tell a missing extra item (damage) from none saved.
      "cursor": ocp.args.JsonSave({"data_cursor": data_cursor, "has_extra": extra is not None}),
    }
    if extra is not None:
      if not jax.tree.leaves(extra):
        raise ValueError("`extra` has no array leaves; pass None to save no extra item.")
      items["extra"] = ocp.args.StandardSave(extra)
    try:
      started = self._manager.save(step, args=ocp.args.Composite(**items), force=True)
    except (ValueError, TypeError):
      raise
    except Exception as e:
      raise CheckpointError(
        f"Saving checkpoint step {step} in {self.directory} failed: {_cause(e)}",
        step=step,
        directory=self.directory,
      ) from e
    if not started:
      raise CheckpointError(
        f"orbax declined to save checkpoint step {step} in {self.directory} (read-only "
        "directory, or a step that is not newer than the latest).",
        step=step,
        directory=self.directory,
      )
    self._pending = step
    return True

  def restore(
    self,
    target: _state.TrainState,
    *,
    step: int | None = None,
    extra_target: Any = None,
  ) -> Restored:
    """Restores a checkpoint onto the shardings of `target`.

    Args:
      target: a `TrainState` of `jax.ShapeDtypeStruct`s with shardings
        (`abstract_train_state(model_config, train_config, mesh)`) or of
        arrays; the checkpoint is re-sharded onto its shardings, so a
        checkpoint written on one mesh restores onto any other.
      step: which checkpoint; default: the newest readable one (a newer
        unreadable step is skipped with a warning naming it).
      extra_target: optional target pytree for `extra` (shapes/shardings);
        without it the extra pytree is restored as saved (numpy on host).

    Returns:
      A `Restored(step, state, data_cursor, extra)`.

    Raises:
      FileNotFoundError: no checkpoint (or not that step) exists.
      CheckpointError: the requested step (or, without `step`, every step)
        cannot be read; the message names the step(s).
      ValueError: `target` does not have the checkpoint's structure or shapes.
    """
    self._finish_pending()
    self._manager.reload()
    steps = self._steps()
    if step is not None:
      if step not in steps:
        raise FileNotFoundError(f"No checkpoint for step {step} in {self.directory}; have {steps}.")
      return self._restore_step(int(step), target, extra_target)
    if not steps:
      raise FileNotFoundError(f"No checkpoint found in {self.directory}.")
    unreadable = []
    for candidate in reversed(steps):
      try:
        restored = self._restore_step(candidate, target, extra_target)
      except CheckpointError as e:
        unreadable.append(candidate)
        warnings.warn(f"{e} Trying the next older step.", stacklevel=2)
        continue
      if unreadable:
        warnings.warn(
          f"Restored checkpoint step {candidate} from {self.directory}: the newer step(s) "
          f"{sorted(unreadable)} cannot be read.",
          stacklevel=2,
        )
      return restored
    raise CheckpointError(
      f"No readable checkpoint in {self.directory}: steps {sorted(unreadable)} all failed "
      "to load (see the warnings).",
      step=None,
      directory=self.directory,
    )

  def latest_step(self) -> int | None:
    """The newest saved step (None if there is none)."""
    steps = self._steps()
    return steps[-1] if steps else None

  def all_steps(self) -> list[int]:
    """All kept steps, ascending."""
    return self._steps()

  def wait_until_finished(self) -> None:
    """Blocks until pending asynchronous saves are written, then applies retention."""
    self._finish_pending()

  def close(self) -> None:
    """Waits for pending saves, applies retention and releases the manager."""
    self._finish_pending()
    self._manager.close()

  def __enter__(self) -> "Checkpointer":
    return self

  def __exit__(self, *exc: Any) -> None:
    self.close()

  # --- internals ---

  def _steps(self) -> list[int]:
    return sorted(int(s) for s in self._manager.all_steps())

  def _finish_pending(self) -> None:
    """Waits for the in-flight save; marks it good (or raises), then applies retention."""
    self._manager.wait_until_finished()
    pending, self._pending = self._pending, None
    if pending is not None:
      try:
        self._manager.check_for_errors()
      except Exception as e:
        raise CheckpointError(
          f"The asynchronous save of checkpoint step {pending} in {self.directory} failed: "
          f"{_cause(e)}",
          step=pending,
          directory=self.directory,
        ) from e
      self._good.add(pending)
      self._broken.discard(pending)
      self._apply_retention()

  def _apply_retention(self) -> None:
    if self._max_to_keep is None:
      return
    steps = self._steps()
    readable = [s for s in steps if s not in self._broken]
    keep = set(readable[-self._max_to_keep :])
    good = [s for s in steps if s in self._good]
    if good:
      keep.add(good[-1])  # never delete the newest step known to be good
    newest_kept = max(keep) if keep else None
    for s in steps:
      if s in keep:
        continue
      if s in self._broken and (newest_kept is None or s > newest_kept):
        continue  # an unreadable step newer than every good one: left for inspection
      self._delete(s)

  def _delete(self, step: int) -> None:
    self._manager.delete(step)
    self._good.discard(step)
    self._broken.discard(step)

  def _restore_step(self, step: int, target: Any, extra_target: Any) -> Restored:
    """Restores one step; unreadable files raise CheckpointError naming it."""
    try:
      with _draining_event_loops():
        metadata = self._manager.item_metadata(step)
      items = set(metadata.keys())
      saved_state = metadata["state"]
    except Exception as e:
      raise self._unreadable(step, e) from e
    if "state" not in items or saved_state is None:
      raise self._unreadable(step, KeyError("no `state` item"))
    abstract = jax.tree.map(_as_abstract, target)
    _check_matches(saved_state, abstract, step, self.directory, "target")
    args = {
      "state": ocp.args.StandardRestore(abstract),
      "cursor": ocp.args.JsonRestore(),
    }
    has_extra = "extra" in items and metadata["extra"] is not None
    if has_extra:
      if extra_target is not None:
        extra_abstract = jax.tree.map(_as_abstract, extra_target)
        _check_matches(metadata["extra"], extra_abstract, step, self.directory, "extra_target")
      args["extra"] = ocp.args.StandardRestore(extra_target)
    try:
      with _draining_event_loops():
        restored = self._manager.restore(step, args=ocp.args.Composite(**args))
      cursor = restored["cursor"]["data_cursor"]
      saved_extra = restored["cursor"].get("has_extra", has_extra)
    except Exception as e:
      raise self._unreadable(step, e) from e
    if saved_extra and not has_extra:
      raise self._unreadable(step, FileNotFoundError("the saved `extra` item is missing"))
    self._good.add(step)
    self._broken.discard(step)
    return Restored(
      step=step,
      state=restored["state"],
      data_cursor=cursor,
      extra=restored["extra"] if has_extra else None,
    )

  def _unreadable(self, step: int, error: Exception) -> CheckpointError:
    self._broken.add(step)
    return CheckpointError(
      f"Checkpoint step {step} in {self.directory} cannot be read (truncated or corrupt "
      f"files?): {_cause(error)}.",
      step=step,
      directory=self.directory,
    )


class _DrainingEventLoop(asyncio.SelectorEventLoop):
  """An event loop that, when closed, first lets the tasks still on it finish.

  Orbax reads the arrays of a restore as concurrent TensorStore reads on a
  fresh loop and closes that loop as soon as one read fails; the other reads
  then complete on a closed loop and each prints an "Event loop is closed"
  traceback. Draining them first (their results and errors are dropped)
  makes a failed restore end quietly, with every read finished.
  """

  def close(self) -> None:
    if not self.is_running() and not self.is_closed():
      pending = [t for t in asyncio.all_tasks(self) if not t.done()]
      if pending:
        done, late = self.run_until_complete(asyncio.wait(pending, timeout=_DRAIN_TIMEOUT_S))
        for task in late:
          task.cancel()
        for task in done:
          if not task.cancelled():
            task.exception()  # retrieved: no "exception was never retrieved" log
    super().close()


class _DrainingPolicy(asyncio.DefaultEventLoopPolicy):
  def new_event_loop(self) -> asyncio.AbstractEventLoop:
    return _DrainingEventLoop()


_POLICY_LOCK = threading.Lock()


@contextlib.contextmanager
def _draining_event_loops() -> Iterator[None]:
  """New event loops drain their tasks on close while inside (the policy is restored after)."""
  with _POLICY_LOCK:
    previous = asyncio.get_event_loop_policy()
    asyncio.set_event_loop_policy(_DrainingPolicy())
    try:
      yield
    finally:
      asyncio.set_event_loop_policy(previous)


def _as_abstract(x: Any) -> Any:
  if isinstance(x, jax.ShapeDtypeStruct):
    return x
  if isinstance(x, jax.Array):
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
  x = np.asarray(x)
  return jax.ShapeDtypeStruct(x.shape, x.dtype)


def _path_names(path: Sequence[Any]) -> tuple[str, ...]:
  """A pytree key path as plain names (dict keys, attribute names and indices alike)."""
  names = []
  for key in path:
    for attr in ("key", "name", "idx"):
      if hasattr(key, attr):
        names.append(str(getattr(key, attr)))
        break
    else:
      names.append(str(key))
  return tuple(names)


def _check_matches(saved: Any, abstract: Any, step: int, directory: Any, name: str) -> None:
  """Raises ValueError if a saved item's leaves (orbax metadata) differ from the target's."""
  tree = getattr(saved, "tree", saved)
  have = {
    _path_names(p): tuple(leaf.shape)
    for p, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]
    if hasattr(leaf, "shape")
  }
  want = {
    _path_names(p): tuple(leaf.shape)
    for p, leaf in jax.tree_util.tree_flatten_with_path(abstract)[0]
  }
  problems = [f"missing {'/'.join(k)}" for k in sorted(set(want) - set(have))]
  problems += [f"unexpected {'/'.join(k)}" for k in sorted(set(have) - set(want))]
  problems += [
    f"{'/'.join(k)} is {list(have[k])}, target {list(want[k])}"
    for k in sorted(set(want) & set(have))
    if have[k] != want[k]
  ]
  if problems:
    shown = "; ".join(problems[:6]) + (
      f"; ... ({len(problems)} in all)" if len(problems) > 6 else ""
    )
    raise ValueError(
      f"Checkpoint step {step} in {directory} holds an item that does not match `{name}` "
      f"(another model config or optimizer?): {shown}."
    )


def _cause(error: BaseException) -> str:
  """The root cause of `error`: `[array `name`: ]Type: first line`, shortened.

  Orbax wraps a failed TensorStore read in a generic "Encountered error while
  reading array index ..." exception; the innermost error of the chain is the
  one that names the array (its TensorStore key) and what was wrong with the
  file. Spec dumps and the (already reported) local file paths are dropped.
  """
  seen = {id(error)}
  while True:
    inner = error.__cause__ or (None if error.__suppress_context__ else error.__context__)
    if inner is None or id(inner) in seen:
      break
    seen.add(id(inner))
    error = inner
  lines = str(error).strip().splitlines()
  text = re.sub(r"\s*\[tensorstore_spec=.*$", "", lines[0] if lines else "")
  text = re.sub(r' (in OCDBT database at|of) local file "[^"]*"', "", text)
  if len(text) > _CAUSE_CHARS:
    text = text[: _CAUSE_CHARS // 2] + " ... " + text[-_CAUSE_CHARS // 2 :]
  array = re.search(r'Error reading "([^"/]+)/', text)
  where = f"array `{array.group(1)}`: " if array else ""
  return f"{where}{type(error).__name__}: {text}"
