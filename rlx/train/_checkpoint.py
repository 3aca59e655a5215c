"""Orbax checkpoints of a run: train state, data cursor and an opaque extra pytree.

One checkpoint step directory holds three items:
  state   the whole `TrainState` (step, params, optimizer state, rng, skipped),
          as sharded arrays (each process writes its shards);
  cursor  the data cursor, any JSON value (e.g. `{"epoch": 1, "index": 96}`);
  extra   optional host pytree of arrays, e.g. the partial-rollout buffer.
Together they are everything needed to resume a run bit-exactly: the step
draws its randomness from `fold_in(state.rng, state.step)` and the data
pipeline restarts from the cursor.
"""

import dataclasses
import os
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from rlx.train import _state


@dataclasses.dataclass(frozen=True)
class Restored:
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
      directory: where step sub-directories are written (absolute path).
      max_to_keep: keep only the newest N checkpoints (None = keep all).
      save_interval_steps: `save` only writes steps divisible by this (unless
        `force=True`).
      async_save: write files in a background thread.
    """
    if max_to_keep is not None and max_to_keep < 1:
      raise ValueError(f"`max_to_keep` must be >= 1 or None, got {max_to_keep}.")
    if save_interval_steps < 1:
      raise ValueError(f"`save_interval_steps` must be >= 1, got {save_interval_steps}.")
    self.directory = os.path.abspath(os.fspath(directory))
    self._manager = ocp.CheckpointManager(
      self.directory,
      options=ocp.CheckpointManagerOptions(
        max_to_keep=max_to_keep,
        save_interval_steps=save_interval_steps,
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
      step: the checkpoint number (usually `int(state.step)`).
      state: the `TrainState` to save (any sharding).
      data_cursor: JSON-serialisable position of the data pipeline.
      extra: optional pytree of host arrays / numbers (e.g. the partial-rollout
        buffer); numpy leaves restore as numpy.
      force: save even if `step` is not a multiple of `save_interval_steps`.

    Returns:
      Whether a save was started.
    """
    if not isinstance(state, _state.TrainState):
      raise ValueError(f"`state` must be a TrainState, got {type(state)}.")
    items = {
      "state": ocp.args.StandardSave(state),
      "cursor": ocp.args.JsonSave({"data_cursor": data_cursor}),
    }
    if extra is not None:
      if not jax.tree.leaves(extra):
        raise ValueError("`extra` has no array leaves; pass None to save no extra item.")
      items["extra"] = ocp.args.StandardSave(extra)
    return self._manager.save(int(step), args=ocp.args.Composite(**items), force=force)

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
      step: which checkpoint (default: the latest).
      extra_target: optional target pytree for `extra` (shapes/shardings);
        without it the extra pytree is restored as saved (numpy on host).

    Returns:
      A `Restored(step, state, data_cursor, extra)`.

    Raises:
      FileNotFoundError: no checkpoint (or not that step) exists.
    """
    self._manager.wait_until_finished()
    if step is None:
      step = self._manager.latest_step()
      if step is None:
        raise FileNotFoundError(f"No checkpoint found in {self.directory}.")
    elif step not in self._manager.all_steps():
      raise FileNotFoundError(
        f"No checkpoint for step {step} in {self.directory}; have {self.all_steps()}."
      )
    abstract = jax.tree.map(_as_abstract, target)
    items = {
      "state": ocp.args.StandardRestore(abstract),
      "cursor": ocp.args.JsonRestore(),
    }
    has_extra = os.path.isdir(os.path.join(self.directory, str(step), "extra"))
    if has_extra:
      items["extra"] = ocp.args.StandardRestore(extra_target)
    restored = self._manager.restore(int(step), args=ocp.args.Composite(**items))
    return Restored(
      step=int(step),
      state=restored["state"],
      data_cursor=restored["cursor"]["data_cursor"],
      extra=restored["extra"] if has_extra else None,
    )

  def latest_step(self) -> int | None:
    """The newest saved step (None if there is none)."""
    return self._manager.latest_step()

  def all_steps(self) -> list[int]:
    """All kept steps, ascending."""
    return sorted(self._manager.all_steps())

  def wait_until_finished(self) -> None:
    """Blocks until pending asynchronous saves are written."""
    self._manager.wait_until_finished()

  def close(self) -> None:
    """Waits for pending saves and releases the manager."""
    self._manager.wait_until_finished()
    self._manager.close()

  def __enter__(self) -> "Checkpointer":
    return self

  def __exit__(self, *exc: Any) -> None:
    self.close()


def _as_abstract(x: Any) -> Any:
  if isinstance(x, jax.ShapeDtypeStruct):
    return x
  if isinstance(x, jax.Array):
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
  x = np.asarray(x)
  return jax.ShapeDtypeStruct(x.shape, x.dtype)
