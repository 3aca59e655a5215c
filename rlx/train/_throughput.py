"""Throughput of asynchronously dispatched steps, with one host sync per read.

JAX dispatches a jitted step and returns at once (asynchronous dispatch,
https://jax.readthedocs.io/en/latest/async_dispatch.html); waiting for every
step to time it would stall the host work an RL loop overlaps with the device.
A `ThroughputMeter` records each step at dispatch (a clock reading and
references to two scalars of its output) and blocks only when `read()`: the
window runs from the dispatch of its first step to the completion of its last,
so with the device kept busy it measures the steps' own throughput (any host
gap between steps where the device idles is counted too, as the loop's
throughput should be).
"""

import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from rlx.train import _distributed

# Loss-token counts kept per window before they are summed on device (keeps
# the list short in a loop that rarely reads; the sum is asynchronous).
_MAX_PENDING = 32


class ThroughputMeter:
  """Tokens per second over a window of steps, synced only when read.

  Example:
    meter = ThroughputMeter()
    for batch in batches:
      state, metrics = step(state, batch)
      meter.record(positions=batch["tokens"].size, loss_tokens=metrics["tokens"], done=metrics)
    print(meter.read())  # {"steps": ..., "tokens_per_second": ...}

  `TrainStep` holds one as `train_step.throughput` and records every call.
  """

  def __init__(self, clock: Callable[[], float] = time.perf_counter):
    """Args: clock: a monotonic clock in seconds (injectable for tests)."""
    self._clock = clock
    self._reset()

  def _reset(self) -> None:
    self._start: float | None = None
    self._steps = 0
    self._positions = 0
    self._loss_tokens: list[Any] = []
    self._done: Any = None

  def record(self, *, positions: int, loss_tokens: Any, done: Any) -> None:
    """Records one dispatched step (no sync).

    Args:
      positions: token positions the step processes (B * S).
      loss_tokens: its number of valid loss tokens (a scalar; a device array
        is not read until `read`).
      done: a pytree of the step's outputs; the step counts as finished when
        these are ready (e.g. its metrics).
    """
    if self._start is None:
      self._start = self._clock()
    self._steps += 1
    self._positions += int(positions)
    self._loss_tokens.append(loss_tokens)
    if len(self._loss_tokens) > _MAX_PENDING:
      self._loss_tokens = [jnp.sum(jnp.stack([jnp.asarray(x) for x in self._loss_tokens]))]
    self._done = done

  @property
  def steps(self) -> int:
    """Steps recorded in the current window."""
    return self._steps

  def read(self) -> dict[str, float] | None:
    """Waits for the window's last step, returns its throughput and starts a new window.

    Returns:
      None if no step was recorded since the last read, else a dict of
      floats: steps, seconds (dispatch of the first step to completion of the
      last), step_time_s (seconds / steps), tokens_per_second (positions /
      seconds) and loss_tokens_per_second (valid loss tokens / seconds).
    """
    if not self._steps:
      return None
    jax.block_until_ready(self._done)
    seconds = max(self._clock() - self._start, 1e-9)
    loss_tokens = float(sum(float(_distributed.to_host(x)) for x in self._loss_tokens))
    out = {
      "steps": float(self._steps),
      "seconds": seconds,
      "step_time_s": seconds / self._steps,
      "tokens_per_second": self._positions / seconds,
      "loss_tokens_per_second": loss_tokens / seconds,
    }
    self._reset()
    return out
