"""Out of device memory: `rlx.train.OutOfMemoryError` names what to change.

XLA's RESOURCE_EXHAUSTED status (a compile-time HBM check, an allocation at run
time) is raised by the jitted call; the train step, `compute_logprobs`, the
sampler and the fused RL step re-raise it with the settings that lower their
memory and their current values. Here the jitted function is replaced by one
that raises XLA's error, or (the sampler) its program's compile raises it, from
a `jax.monitoring` listener on the backend compile (a CPU has no HBM limit to
hit); tests/tpu has the TPU compiler's own out-of-memory error on a
compile-only slice.
"""

import contextlib
import dataclasses

import jax
import pytest

from rlx import policy, sampling, train
from tests.train import train_testlib as tl

OOM = (
  "RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO "
  "temporaries (45.03G) exceeds available HBM (31.25G)."
)


def _raises(message):
  def fn(*args, **kwargs):
    raise jax.errors.JaxRuntimeError(message)

  return fn


def test_train_step_out_of_memory_lists_what_to_change():
  m, cfg, step, logprobs = tl.fns("single", micro_batches=2)
  state = tl.init_state(m, cfg)
  batch = tl.prepare(tl.make_batch(0), m, state, logprobs)
  broken = dataclasses.replace(step, jitted=_raises(OOM))
  with pytest.raises(train.OutOfMemoryError) as info:
    broken(state, batch)
  message = str(info.value)
  assert message.startswith("train_step does not fit in device memory: RESOURCE_EXHAUSTED")
  assert "(45.03G) exceeds available HBM (31.25G)" in message
  assert "model.remat = True (now False)" in message
  assert "train.micro_batches (now 2, mini_batches 1, 8 rows per pass of B = 16)" in message
  assert "mesh.fsdp / mesh.tensor (now 1 / 1, with data 1)" in message
  assert "train.logprob_chunk_size" in message
  assert info.value.program == "train_step"
  assert info.value.advice == step.memory_advice(tl.BATCH)
  assert isinstance(info.value.__cause__, jax.errors.JaxRuntimeError)
  assert isinstance(info.value, MemoryError)


def test_remat_is_not_advised_when_on():
  m, cfg, step, _ = tl.fns("single")
  remat = dataclasses.replace(step, model_config=dataclasses.replace(tl.model_config(), remat=True))
  assert not any("remat" in line for line in remat.memory_advice())
  assert any("remat" in line for line in step.memory_advice())


def test_other_runtime_errors_pass_through_unchanged():
  m, cfg, step, logprobs = tl.fns("single")
  state = tl.init_state(m, cfg)
  batch = tl.prepare(tl.make_batch(0), m, state, logprobs)
  broken = dataclasses.replace(step, jitted=_raises("INVALID_ARGUMENT: something else"))
  with pytest.raises(jax.errors.JaxRuntimeError, match="INVALID_ARGUMENT"):
    broken(state, batch)


def test_compute_logprobs_out_of_memory_lists_what_to_change():
  m, cfg, _, logprobs = tl.fns("single")
  state = tl.init_state(m, cfg)
  broken = dataclasses.replace(logprobs, jitted=_raises(OOM))
  with pytest.raises(train.OutOfMemoryError, match="compute_logprobs does not fit") as info:
    broken(state, train.shard_batch(tl.make_batch(0, batch=8), m))
  assert "train.micro_batches (now 1, 8 rows per pass of B = 8)" in str(info.value)


def test_explain_out_of_memory_around_any_code():
  with pytest.raises(train.OutOfMemoryError, match="my_program does not fit") as info:
    with train.explain_out_of_memory("my_program", lambda: ["a = 1"]):
      raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 8GiB")
  assert info.value.advice == ("a = 1",)
  assert str(info.value).endswith("To lower its memory, change one of:\n  - a = 1")
  assert train.is_out_of_memory(info.value.__cause__)
  assert not train.is_out_of_memory(ValueError("RESOURCE_EXHAUSTED"))  # not XLA's


_BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"  # JAX's monitoring event


@contextlib.contextmanager
def _decode_compile_raises(sampler, message):
  """XLA's error `message` from the backend compile of `sampler`'s decode window.

  A `jax.monitoring` listener on JAX's backend-compile event raises it once the decode
  window has traced (`compile_counts`): the compile that follows is the decode's.
  """
  traced = sampler.compile_counts()["decode"]

  def listener(event, duration_secs, **kwargs):
    del duration_secs, kwargs
    if event == _BACKEND_COMPILE and sampler.compile_counts()["decode"] > traced:
      raise jax.errors.JaxRuntimeError(message)

  jax.monitoring.register_event_duration_secs_listener(listener)
  try:
    yield
  finally:
    jax.monitoring.unregister_event_duration_listener(listener)


def test_sampler_out_of_memory_lists_the_pool():
  mc = tl.model_config()
  cfg = sampling.SamplerConfig(max_slots=4, num_pages=32, page_size=4, max_new_tokens=4)
  sampler = sampling.Sampler(mc, cfg)
  if sampler.compile_counts()["decode"]:  # an earlier sampler's programs: compile afresh
    sampling.clear_compile_cache()
    sampler = sampling.Sampler(mc, cfg)
  params = policy.init_params(mc, jax.random.PRNGKey(0))
  with (
    _decode_compile_raises(sampler, OOM),
    pytest.raises(train.OutOfMemoryError, match="the sampler's decode does not fit") as info,
  ):
    sampler.generate(params, [[1, 2, 3]], rng=jax.random.key(0))
  message = str(info.value)
  pool = 2 * mc.num_layers * mc.num_kv_heads * 32 * 4 * mc.head_dim * 4  # float32 pages
  assert sampler.pool_bytes_per_chip() == pool
  assert "sampler.num_pages (now 32 pages of 4 tokens" in message
  assert "sampler.max_slots (now 4)" in message
  assert "rollout.kv_dtype = 'fp8_e4m3' (now float32)" in message
  assert "mesh.tensor (now 1" in message
