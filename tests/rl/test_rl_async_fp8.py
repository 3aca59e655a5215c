"""FP8 rollout in async RL: quantized in the rollout thread, in flight too; scales refreshed."""

import os

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

  def update():  # the same values as new arrays, once: version 1 from the first window on
    calls.append(1)
    return (jax.tree.map(jnp.copy, params), 1) if len(calls) == 1 else None

  got, keys, rollout = collect(update)
  assert len(calls) >= 2 and rollout.last_stats["params_updates"] == 1
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
  for overrides, match in (
    ({"rl.staleness": 4}, "controlled staleness"),
    ({"rl.old_logp": "behaviour"}, "'behaviour'"),
  ):
    config = rl_test_utils.tiny_config(**{"rl.async_rollout": True, **FP8, **overrides})
    with pytest.raises(ValueError, match=match):
      rl.validate_config(config)
  rl.validate_config(rl_test_utils.tiny_config(**{"rl.async_rollout": True, **FP8}))
