"""Throughput without a per-step sync: the meter's arithmetic, and an asynchronous TrainStep."""

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import train_testlib as tl

from rlx import train


class _Clock:
  def __init__(self):
    self.now = 0.0

  def __call__(self):
    return self.now


def test_meter_times_a_window_from_first_dispatch_to_last_completion():
  clock = _Clock()
  meter = train.ThroughputMeter(clock=clock)
  assert meter.read() is None
  clock.now = 10.0
  meter.record(positions=100, loss_tokens=3, done=None)
  clock.now = 11.0
  meter.record(positions=100, loss_tokens=jnp.asarray(4.0), done=None)
  clock.now = 11.5
  meter.record(positions=50, loss_tokens=np.float32(5), done=jnp.zeros(3))
  assert meter.steps == 3
  clock.now = 15.0  # the last step completes (read waits for it) at t = 15
  got = meter.read()
  assert got == pytest.approx(
    {
      "steps": 3.0,
      "seconds": 5.0,
      "step_time_s": 5.0 / 3,
      "tokens_per_second": 250 / 5.0,
      "loss_tokens_per_second": 12 / 5.0,
    }
  )
  # A new window starts at the next recorded step, not at the read.
  clock.now = 100.0
  meter.record(positions=10, loss_tokens=1, done=None)
  clock.now = 102.0
  assert meter.read()["tokens_per_second"] == pytest.approx(5.0)
  # Many unread steps: the loss-token counts are folded on device, none lost.
  clock.now = 0.0
  meter = train.ThroughputMeter(clock=clock)
  for i in range(100):
    meter.record(positions=1, loss_tokens=jnp.asarray(float(i)), done=None)
  clock.now = 1.0
  assert meter.read()["loss_tokens_per_second"] == pytest.approx(sum(range(100)))


def test_train_step_dispatches_asynchronously_and_reads_throughput_once(monkeypatch):
  m, cfg, step_fn, logprobs = tl.fns("single")
  assert cfg.report_throughput is False and step_fn.report_throughput is False
  state = tl.init_state(m, cfg)
  batches = [tl.prepare(tl.make_batch(i), m, state, logprobs) for i in range(3)]
  state, _ = step_fn(state, batches[0])  # compile outside the measured window
  step_fn.throughput.read()
  waits = []
  real_wait = jax.block_until_ready
  monkeypatch.setattr(jax, "block_until_ready", lambda x: waits.append(1) or real_wait(x))
  start = time.perf_counter()
  tokens = []
  for batch in batches:
    state, metrics = step_fn(state, batch)
    tokens.append(metrics["tokens"])
  assert waits == []  # no host sync inside the calls
  got = step_fn.throughput.read()
  elapsed = time.perf_counter() - start
  assert len(waits) == 1  # one sync, when read
  assert got["steps"] == 3 and 0 < got["seconds"] <= elapsed
  want_loss_tokens = sum(float(t) for t in tokens)
  np.testing.assert_allclose(got["loss_tokens_per_second"] * got["seconds"], want_loss_tokens)
  np.testing.assert_allclose(got["tokens_per_second"] * got["seconds"], 3 * tl.BATCH * tl.SEQ)


def test_report_throughput_waits_for_each_step():
  m, cfg, step_fn, logprobs = tl.fns("single")
  timed = dataclasses.replace(step_fn, report_throughput=True)  # same compiled step
  state = tl.init_state(m, cfg)
  batch = tl.prepare(tl.make_batch(0), m, state, logprobs)
  start = time.perf_counter()
  state, metrics = timed(state, batch)
  elapsed = time.perf_counter() - start
  assert all(x.is_ready() for x in jax.tree.leaves(state))  # returned after the step finished
  assert 0 < metrics["step_time_s"] <= elapsed
  assert {"tokens_per_second", "loss_tokens_per_second"} <= set(metrics)
