"""FP8 rollout in async RL: quantized in the rollout thread, in flight too; scales refreshed."""

import os
import threading
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import rl_test_utils

from rlx import rl, tasks

rl_test_utils.register_test_tasks()
TASK = rl_test_utils.FIRST_TOKEN
FP8 = {"rollout.weight_dtype": "fp8_e4m3", "rollout.kv_dtype": "fp8_e4m3"}


def test_in_flight_updates_of_an_fp8_rollout_are_quantized():
  config = rl_test_utils.tiny_config(
    **{"task.name": TASK, "rl.num_samples": 4, "sampler.steps_per_sync": 1, **FP8}
  )
  task = tasks.make_task(TASK, **config.task.kwargs.to_dict())
  mesh = rl.build_mesh(config)
  model_config, params = rl.build_model(config, task)
  kwargs = rl.sampler_kwargs(config, task, rows=8, greedy=False)
  sampler = rl.make_sampler(model_config, kwargs, mesh)
  prompts = [list(e.prompt_ids) for e in task.split("train")[:8]]

  def collect(params_update):
    rollout = rl.PartialRollout(sampler, num_samples=4, target_groups=2, over_provision=2.0)
    width = kwargs["max_prompt_len"] + kwargs["max_new_tokens"]
    rollout.fp8.calibrate_prompts(params, prompts[:2], num_samples=4, width=width)
    queue = list(enumerate(prompts))
    source = lambda n: [queue.pop(0) for _ in range(n)]  # noqa: E731
    batch, keys = rollout.collect_groups(
      params, source, jax.random.PRNGKey(3), policy_version=0, params_update=params_update
    )
    return batch, keys, rollout

  want, want_keys, _ = collect(None)
  calls = []

  updates = []

  def update():  # the same values as new arrays, once: version 1 from the first window on
    calls.append(1)
    if len(calls) > 1:
      return None
    updates.append(jax.tree.map(jnp.copy, params))
    return updates[0], 1

  got, keys, rollout = collect(update)
  assert len(calls) >= 2 and rollout.last_stats["params_updates"] == 1
  # The update's params were quantized when they arrived: the refresh holds their FP8
  # copy (asking again quantizes nothing), which the sampler then ran.
  (new_params,) = updates
  held = rollout.fp8.params
  assert rollout.fp8.rollout_params(new_params) is held
  # The new arrays were quantized as they arrived (the engine never saw unquantized
  # params), by the one compiled quantization, so the samples are the same.
  assert rollout.fp8.compile_counts() == {"quantize": 1}
  np.testing.assert_array_equal(keys, want_keys)
  np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))
  np.testing.assert_allclose(np.asarray(got.rollout_logp), np.asarray(want.rollout_logp), atol=1e-6)
  versions = np.asarray(got.policy_version)[np.asarray(got.response_mask)]
  assert set(versions.tolist()) <= {0, 1} and 1 in versions


@pytest.mark.parametrize(
  ("devices", "rollout_devices", "over_provision"), [(2, 1, 1.0), (8, 4, 2.0)]
)
def test_async_fp8_run_refreshes_its_scales_in_the_rollout_thread(
  tmp_path, devices, rollout_devices, over_provision
):
  config = rl_test_utils.run_config(
    **FP8,
    **{
      "rl.async_rollout": True,
      "rl.iterations": 4,
      "checkpoint.every": 4,
      "eval.every": 4,
      "mesh.num_devices": devices,
      "mesh.rollout_devices": rollout_devices,
      "rollout.over_provision": over_provision,
      "train.use_rollout_correction": True,
    },
  )
  summary = rl.run(config, str(tmp_path))
  assert summary["iterations"] == 4
  assert (summary["rollout_weight_dtype"], summary["rollout_kv_dtype"]) == ("fp8_e4m3",) * 2
  records = [
    r for r in rl.read_metrics(os.path.join(tmp_path, "metrics.jsonl")) if r["phase"] == "rl"
  ]
  assert all(np.isfinite(r["loss"]) and r["mismatch_k3"] > 0 for r in records)
  refreshes = [r["async/kv_refreshes"] for r in records]
  assert refreshes == sorted(refreshes) and refreshes[-1] >= 1  # scales follow the versions
  extra = rl_test_utils.final_checkpoint(config, str(tmp_path)).extra
  scales = np.asarray(extra["kv_scales"]["k_scale"])
  assert scales.shape == (2, 1) and (scales > 0).all()
  trained = [i for r in records for i in r["async/prompts"]]
  assert len(trained) == len(set(trained)) == 4 * config.rl.prompts_per_iteration


def test_async_settings_still_refused_are_named():
  for overrides, match in (({"rl.staleness": 4}, "controlled staleness"),):
    config = rl_test_utils.tiny_config(**{"rl.async_rollout": True, **FP8, **overrides})
    with pytest.raises(ValueError, match=match):
      rl.validate_config(config)
  rl.validate_config(rl_test_utils.tiny_config(**{"rl.async_rollout": True, **FP8}))


class _Fp8Probe:
  """A static-FP8-KV refresh that records the params it is calibrated with."""

  kv_fp8 = True

  def __init__(self):
    self.calibrated = []
    self.kv_scales = (jnp.ones(2), jnp.ones(2))

  def calibrate(self, params, tokens, mask):
    self.calibrated.append((params, np.asarray(tokens).shape, bool(np.asarray(mask).any())))


class _Collector:
  """`collect` returns a tiny batch with masks; each call waits for one `gate` release."""

  def __init__(self):
    self.fp8 = _Fp8Probe()
    self.gate = threading.Semaphore(0)
    self.collected = []

  def collect(self, params, prompts, rng, *, policy_version):
    self.gate.acquire()
    self.collected.append(policy_version)
    n = len(prompts)
    mask = jnp.ones((n, 3), bool)
    return types.SimpleNamespace(tokens=jnp.ones((n, 3), jnp.int32), prompt_mask=mask,
                                 response_mask=mask)  # fmt: skip


def _pipe(rollout):
  examples = [types.SimpleNamespace(prompt_ids=[i]) for i in range(50)]
  source = rl.PromptSource(examples, batch_size=2, seed=0)
  return rl.AsyncRollout(rollout, source, place=lambda p: p, key=jax.random.PRNGKey(0),
                         queue_size=4)  # fmt: skip


@pytest.mark.parametrize("restored", [False, True], ids=["fresh", "restored"])
def test_the_thread_recalibrates_once_per_newer_version(restored):
  rollout = _Collector()
  pipe = _pipe(rollout)
  pipe.publish("params-v0", 0)
  pipe.start(scales_version=None if restored else -1)
  try:
    for want in (1, 2):  # two collections with version 0
      rollout.gate.release()
      pipe.get()
      assert rollout.collected == [0] * want
    # Calibrated by the caller with version 0: nothing to do. Restored (an older version's
    # scales): recalibrated with version 0 after the first collection, once.
    assert [c[0] for c in rollout.fp8.calibrated] == (["params-v0"] if restored else [])
    pipe.publish("params-v2", 2)
    rollout.gate.release()
    rollout.gate.release()
    pipe.get()
    pipe.get()
  finally:
    rollout.gate.release()
    pipe.stop()
  # The first collection with version 2 waits for its scales, from version 2's params over
  # the last batch collected (2 prompts x 3 tokens, masked); the next one does not.
  names = [c[0] for c in rollout.fp8.calibrated]
  assert names == (["params-v0", "params-v2"] if restored else ["params-v2"])
  assert rollout.fp8.calibrated[-1][1:] == ((2, 3), True)
  assert pipe.kv_refreshes == len(names) and pipe.kv_refresh_s >= 0
