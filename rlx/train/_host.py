"""`TrainStep`: the host side of the train step (checks, placement, dispatch, throughput).

Everything that reads VALUES happens here, on host, before dispatch (token-id
range, finite loss-token values), or after it only where asked for (`nonfinite="raise"`,
`report_throughput=True`); the default call dispatches asynchronously and
returns at once. The pure step itself is `TrainStep.step_fn`.
"""

import dataclasses
import time
from collections.abc import Callable, Mapping
from typing import Any

import jax
import ml_collections
import numpy as np
from jax.sharding import Mesh

from rlx import _memory
from rlx.train import _batch, _distributed, _mesh, _placement, _spec, _state, _throughput
from rlx.train import _memory as _train_memory


class NonFiniteError(FloatingPointError):
  """A train step met a non-finite loss or gradient with `nonfinite="raise"`.

  The update was skipped (params/optimizer state unchanged) before raising;
  `state` and `metrics` hold the step's outputs so a caller can inspect or
  continue.
  """

  def __init__(self, message: str, state: _state.TrainState, metrics: dict):
    super().__init__(message)
    self.state = state
    self.metrics = metrics


@dataclasses.dataclass(frozen=True, eq=False)
class TrainStep:
  """`train_step(state, batch) -> (state, metrics)`, from `make_train_step`.

  Calling it checks the state (structure and shapes) and the batch (keys,
  shapes, dtypes, token ids in [0, vocab), a 0/1 mask, finite advantages and
  log-probabilities <= 0 on loss tokens; `check_values`) on host, places batch arrays not yet
  sharded along the batch axes, and dispatches ONE jitted function
  (`jitted`) with explicit in/out shardings that donates `state`. It returns
  without waiting for the device (asynchronous dispatch), unless:
    - `nonfinite == "raise"`: waits for the `skipped` metric and raises
      `NonFiniteError` if an update was skipped;
    - `report_throughput`: waits for the step and adds host-measured
      `step_time_s` (wall time of the call, batch placement included; the first
      call includes compilation), `tokens_per_second` (B * S /
      step_time_s) and `loss_tokens_per_second` (valid loss tokens /
      step_time_s), numpy float32 scalars.
  Without a per-step wait, `throughput.read()` (a `ThroughputMeter`
  recording every call) gives the same figures over the steps since the last
  read, with one sync.

  For use INSIDE another jitted function (e.g. a whole RL iteration), trace
  `step_fn(state, batch)`: the same pure step, shapes checked at trace time,
  no host checks, no placement, no donation of its own.

  Attributes:
    jitted: the jitted, sharded, donating step.
    step_fn: the pure `step_fn(state, batch) -> (state, metrics)`.
    mesh: the mesh of the state and batch.
    config: the validated train config, as passed (the step reads `spec`).
    spec: its `StepSpec`, resolved when the step was built (the host checks read it).
    vocab_size: the policy's vocabulary size (token ids are checked against it).
    abstract_state: the `TrainState` of `jax.ShapeDtypeStruct`s the step expects.
    nonfinite: "skip" or "raise" (`spec.nonfinite` unless replaced).
    report_throughput: wait for each step and add the host-timed metrics
      (`spec.report_throughput` unless replaced).
    throughput: the `ThroughputMeter` recording every call.
    model_config: the `rlx.policy.ModelConfig` (named in out-of-memory errors).

  A call whose program does not fit in device memory (at compile or at run
  time) raises `rlx.train.OutOfMemoryError`, whose message lists the settings that
  lower it (`memory_advice`).
  """

  jitted: Any
  step_fn: Callable[[_state.TrainState, dict], tuple[_state.TrainState, dict]]
  mesh: Mesh
  config: ml_collections.ConfigDict
  spec: _spec.StepSpec
  vocab_size: int
  abstract_state: _state.TrainState
  nonfinite: str = "skip"
  report_throughput: bool = False
  throughput: _throughput.ThroughputMeter = dataclasses.field(
    default_factory=_throughput.ThroughputMeter
  )
  model_config: Any = None

  def memory_advice(self, rows: int | None = None) -> tuple[str, ...]:
    """The settings that lower this step's device memory, with their current values.

    What the `rlx.train.OutOfMemoryError` of a call that does not fit lists (B = `rows`).
    """
    return _train_memory.train_step_advice(self.model_config, self.spec, self.mesh, rows)

  def __call__(self, state: _state.TrainState, batch: Mapping[str, Any]):
    start = time.perf_counter()
    placed = self.check_and_place(state, batch)
    b, s = placed["tokens"].shape
    with _memory.explain_out_of_memory("train_step", lambda: self.memory_advice(rows=b)):
      state, metrics = self.jitted(state, placed)
    self.throughput.record(positions=b * s, loss_tokens=metrics["tokens"], done=metrics)
    if self.report_throughput:
      jax.block_until_ready(metrics)
      elapsed = max(time.perf_counter() - start, 1e-9)
      loss_tokens = float(_distributed.to_host(metrics["tokens"]))
      metrics = dict(
        metrics,
        step_time_s=np.float32(elapsed),
        tokens_per_second=np.float32(b * s / elapsed),
        loss_tokens_per_second=np.float32(loss_tokens / elapsed),
      )
    if self.nonfinite == "raise":
      skipped = int(_distributed.to_host(metrics["skipped"]))
      if skipped:
        raise NonFiniteError(
          f"{skipped} optimizer update(s) of step {int(_distributed.to_host(metrics['step']))} "
          "had a non-finite loss or gradient and were skipped.",
          state,
          metrics,
        )
    return state, metrics

  def check_and_place(self, state: _state.TrainState, batch: Mapping[str, Any]) -> dict:
    """The host checks of a call, then the batch placed on the mesh (no dispatch)."""
    if not isinstance(state, _state.TrainState):
      raise ValueError(
        f"`state` must be a rlx.train.TrainState (create_train_state), got {type(state).__name__}."
      )
    if not isinstance(batch, Mapping):
      raise ValueError(f"`batch` must be a dict of arrays, got {type(batch).__name__}.")
    _state.check_like(
      state,
      self.abstract_state,
      "state",
      "the step's TrainState (same model config and optimizer?)",
    )
    _batch.check_batch(batch, self.spec, _mesh.batch_axis_size(self.mesh))
    _batch.check_values(batch, self.vocab_size, _batch.FLOAT_KEYS)
    return _placement.place_batch(batch, self.mesh)

  def lower(self, state: _state.TrainState, batch: Mapping[str, Any]):
    """`jax.stages.Lowered` of the step (e.g. to inspect the compiled HLO)."""
    return self.jitted.lower(state, _placement.place_batch(batch, self.mesh))
