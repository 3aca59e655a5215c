"""FP8 rollout in the RL loop: config fields, refresh after every update, no recompiles, fused step.

`config.rollout.weight_dtype` / `config.rollout.kv_dtype` switch the rollout
sampler to W8A8 linears / an FP8 KV cache. After each update the rollout
params are re-quantized from the new params and the KV scales recalibrated
from the trainer's forward over the batch just trained on; the trainer's
old_logp stays high precision, so the train step's mismatch_k1 / k3 measure
the FP8 mismatch. The fused `make_rl_step` does the same inside its program.
"""

import functools
import os

import jax
import numpy as np
import pytest
import rl_test_utils

from rlx import policy, rl, sampling, tasks, train

rl_test_utils.register_test_tasks()
TASK = rl_test_utils.FIRST_TOKEN
# Every XLA backend compile of the process (jit cache entries that reuse an
# executable are not compiles).
_COMPILES = []
jax.monitoring.register_event_duration_secs_listener(
  lambda name, *_, **__: (
    _COMPILES.append(name) if name.endswith("backend_compile_duration") else None
  )
)
FP8 = {"rollout.weight_dtype": "fp8_e4m3", "rollout.kv_dtype": "fp8_e4m3"}


def _config(**overrides):
  base = {"task.name": TASK, "rl.prompts_per_iteration": 2, "rl.num_samples": 4, **FP8}
  base.update(overrides)
  return rl_test_utils.tiny_config(**base)


@functools.cache
def _setup():
  config = _config()
  task = tasks.make_task(TASK, **config.task.kwargs.to_dict())
  mesh = rl.build_mesh(config)
  model_config, params = rl.build_model(config, task)
  kwargs = rl.sampler_kwargs(config, task, rows=8, greedy=False)
  sampler = rl.make_sampler(model_config, kwargs, mesh)
  learner = rl.Learner(config, task, model_config, mesh)
  return config, task, mesh, model_config, params, sampler, learner, kwargs


def _state(config, params, model_config, mesh):
  cfg = rl.train_config(config)
  return train.create_train_state(params, model_config, cfg, mesh, rng=jax.random.PRNGKey(1))


def _rollout_for(sampler, kwargs):
  return rl.SyncRollout(
    sampler,
    num_samples=4,
    max_prompt_len=kwargs["max_prompt_len"],
    max_new_tokens=kwargs["max_new_tokens"],
  )


@pytest.mark.parametrize(
  "overrides, match",
  [
    ({"rollout.weight_dtype": "int8"}, "config.rollout.weight_dtype"),
    ({"rollout.weight_dtype": "float32"}, "config.rollout.weight_dtype"),
    ({"rollout.kv_dtype": "fp8"}, "config.rollout.kv_dtype"),
  ],
)
def test_bad_fp8_fields_raise(overrides, match):
  with pytest.raises(ValueError, match=match):
    rl.validate_config(_config(**overrides))


def test_kv_dtype_is_one_field_and_evaluation_stays_high_precision():
  config, task = _config(), _setup()[1]
  assert "kv_dtype" not in rl.get_config().sampler  # one field: rollout.kv_dtype
  roll = rl.sampler_kwargs(config, task, rows=4, greedy=False)
  evaluation = rl.sampler_kwargs(config, task, rows=4, greedy=True)
  assert (roll["weight_dtype"], roll["kv_dtype"]) == ("fp8_e4m3", "fp8_e4m3")
  assert (evaluation["weight_dtype"], evaluation["kv_dtype"]) == ("auto", "auto")
  default = rl_test_utils.tiny_config()
  assert rl.sampler_kwargs(default, task, rows=4, greedy=False)["kv_dtype"] == "float32"
  # A config that still sets the old sampler field is read as rollout.kv_dtype ...
  legacy = rl_test_utils.tiny_config()
  legacy.sampler.kv_dtype = "bfloat16"
  rl.validate_config(legacy)
  assert rl.sampler_kwargs(legacy, task, rows=4, greedy=True)["kv_dtype"] == "bfloat16"
  # ... unless both are set and disagree.
  legacy.rollout.kv_dtype = "fp8_e5m2"
  with pytest.raises(ValueError, match="disagree"):
    rl.validate_config(legacy)


def test_host_iterations_refresh_after_every_update_without_recompiling():
  config, task, mesh, model_config, params, sampler, learner, kwargs = _setup()
  rollout = _rollout_for(sampler, kwargs)
  fp8 = rollout.fp8
  assert isinstance(fp8, rl.Fp8Refresh) and fp8.weight_fp8 and fp8.kv_fp8
  state = _state(config, params, model_config, mesh)
  ref = jax.tree.map(lambda x: x + 0.0, state.params)
  examples = list(task.split("train")[:2])
  for it in range(3):
    compiles = len(_COMPILES)
    state, metrics, batch = learner.iteration(state, ref, rollout, examples, jax.random.PRNGKey(it))
    # The first iteration compiles everything; refreshes and rollouts after it never do.
    assert it == 0 or len(_COMPILES) == compiles, _COMPILES[compiles:]
    assert metrics["time/refresh_s"] > 0
    # The sampler's FP8 log-probs against the trainer's float32 ones: a small, non-zero
    # mismatch (k3 >= 0), reported by the train step.
    assert 0 < metrics["mismatch_k3"] < 0.05 and metrics["mismatch_k1"] != 0
    # The refresh equals quantizing / calibrating the new params directly.
    want = sampling.quantize_params(state.params, sampler.config)
    got = fp8.rollout_params(state.params)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
      np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    mask = np.asarray(batch.prompt_mask | batch.response_mask)
    k_want, v_want = sampling.calibrate_kv_scales(state.params, model_config, batch.tokens, mask)
    np.testing.assert_allclose(np.asarray(fp8.kv_scales[0]), np.asarray(k_want), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(fp8.kv_scales[1]), np.asarray(v_want), rtol=1e-6)
    if it == 0:
      scales0 = np.asarray(fp8.kv_scales[0])
  assert fp8.compile_counts() == {"quantize": 1} and sampler.compile_counts()["decode"] == 1
  assert not np.array_equal(scales0, np.asarray(fp8.kv_scales[0]))  # recalibrated, not frozen
  # The KV scales round-trip through the checkpoint's host arrays.
  restored = rl.Fp8Refresh(sampler)
  restored.load_state_dict(fp8.state_dict())
  np.testing.assert_array_equal(np.asarray(restored.kv_scales[1]), np.asarray(fp8.kv_scales[1]))
  with pytest.raises(ValueError, match="k_scale"):
    restored.load_state_dict({"v_scale": np.ones((2, 1), np.float32)})


def test_fused_fp8_step_equals_host_iteration_and_compiles_once():
  config, task, mesh, model_config, params, sampler, learner, kwargs = _setup()
  examples = list(task.split("train")[:2])
  prompts = [e.prompt_ids for e in examples]
  width = kwargs["max_prompt_len"] + kwargs["max_new_tokens"]
  ref = jax.tree.map(lambda x: x + 0.0, _state(config, params, model_config, mesh).params)
  rollout = _rollout_for(sampler, kwargs)
  rollout.fp8.calibrate_prompts(params, prompts, num_samples=4, width=width)
  rl_step = rl.make_rl_step(learner, sampler)
  rl_step.fp8.calibrate_prompts(params, prompts, num_samples=4, width=width)
  host, fused = (
    _state(config, params, model_config, mesh),
    _state(config, params, model_config, mesh),
  )
  for it in range(2):
    rng = jax.random.PRNGKey(10 + it)
    host, host_metrics, _ = learner.iteration(host, ref, rollout, examples, rng)
    compiles = len(_COMPILES)
    fused, fused_metrics = rl_step.from_examples(fused, ref, examples, rng)
    assert len(_COMPILES) == compiles + (it == 0), "the fused step compiles once"
    fused_metrics = {k: float(v) for k, v in train.to_host(fused_metrics).items()}
    for name in ("reward_mean", "loss", "mismatch_k1", "mismatch_k3", "grad_norm"):
      np.testing.assert_allclose(fused_metrics[name], host_metrics[name], rtol=1e-4, atol=1e-6)
    assert fused_metrics["mismatch_k3"] > 0
    assert rl_test_utils.params_allclose(fused.params, host.params, atol=1e-6)
    for a, b in zip(rl_step.fp8.kv_scales, rollout.fp8.kv_scales, strict=True):
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5)
  fresh = rl.make_rl_step(learner, sampler)
  with pytest.raises(ValueError, match="calibrated scales"):
    fresh.from_examples(_state(config, params, model_config, mesh), ref, examples, rng)


def test_run_with_fp8_and_partial_rollouts_checkpoints_the_scales(tmp_path):
  config = rl_test_utils.run_config(
    **FP8,
    **{
      "rl.iterations": 3,
      "rl.prompts_per_iteration": 4,
      "checkpoint.every": 3,
      "eval.every": 3,
      "rollout.over_provision": 2.0,
      "sampler.max_slots": 8,
      "sampler.max_new_tokens": 6,
      "train.use_rollout_correction": True,
    },
  )
  summary = rl.run(config, str(tmp_path))
  assert summary["iterations"] == 3 and not summary["fused_rl_step"]
  assert (summary["rollout_weight_dtype"], summary["rollout_kv_dtype"]) == ("fp8_e4m3",) * 2
  assert summary["refresh_s_mean"] > 0
  records = [
    r for r in rl.read_metrics(os.path.join(tmp_path, "metrics.jsonl")) if r["phase"] == "rl"
  ]
  assert all(r["time/refresh_s"] > 0 and r["mismatch_k3"] > 0 for r in records)
  assert all("rollout_correction/weight_mean" in r for r in records), sorted(records[0])
  abstract = train.abstract_train_state(*_model_and_train(config), rl.build_mesh(config))
  with train.Checkpointer(os.path.join(tmp_path, "checkpoints")) as ckpt:
    extra = ckpt.restore(abstract).extra
  assert np.asarray(extra["kv_scales"]["k_scale"]).shape == (2, 1)
  assert (np.asarray(extra["kv_scales"]["v_scale"]) > 0).all()


def _model_and_train(config):
  task = rl.make_task(config)
  return rl.build_model(config, task)[0], rl.train_config(config)


@pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 (fake) devices")
def test_rollout_params_are_quantized_into_the_fp8_layout_on_the_mesh():
  config, task, _, model_config, params, _, _, kwargs = _setup()
  mesh = train.make_mesh(2, 2, 2, devices=jax.devices()[:8])
  sampler = rl.make_sampler(model_config, kwargs, mesh)
  fp8 = rl.Fp8Refresh(sampler)
  sharded = train.shard_params(params, model_config, mesh)
  rollout_params = fp8.rollout_params(sharded)
  assert fp8.rollout_params(sharded) is rollout_params  # once per update, not per call
  want = policy.param_shardings(model_config, mesh, fp8_linears=True)
  for (path, leaf), sharding in zip(
    jax.tree_util.tree_leaves_with_path(rollout_params), jax.tree.leaves(want), strict=True
  ):
    assert leaf.sharding.is_equivalent_to(sharding, leaf.ndim), path
  kernel = rollout_params["layers"]["mlp"]["up_proj"]["kernel"]
  assert isinstance(kernel, policy.Fp8Kernel)
  np.testing.assert_array_equal(
    np.asarray(kernel.values, np.float32),
    np.asarray(
      policy.quantize_linears(params)["layers"]["mlp"]["up_proj"]["kernel"].values, np.float32
    ),
  )
  fp8.calibrate_prompts(sharded, [e.prompt_ids for e in task.split("train")[:2]], num_samples=4,
                        width=kwargs["max_prompt_len"] + kwargs["max_new_tokens"])  # fmt: skip
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  assert all(s.sharding.is_equivalent_to(replicated, 2) for s in fp8.kv_scales)


def test_per_token_kv_scales_in_the_loop_need_no_calibration_and_fuse(tmp_path):
  """`rollout.kv_scale_mode = "per_token"`: the sampler scales each token as it writes it,
  so nothing is calibrated or checkpointed; the fused step equals the host iteration,
  and a run with partial rollouts reports the mismatch; per_token without FP8 KV is
  rejected naming the field."""
  with pytest.raises(ValueError, match="config.rollout.kv_scale_mode"):
    rl.validate_config(
      _config(**{"rollout.kv_dtype": "bfloat16", "rollout.kv_scale_mode": "per_token"})
    )
  config = _config(**{"rollout.kv_scale_mode": "per_token"})
  task = tasks.make_task(TASK, **config.task.kwargs.to_dict())
  mesh = rl.build_mesh(config)
  model_config, params = rl.build_model(config, task)
  kwargs = rl.sampler_kwargs(config, task, rows=8, greedy=False)
  assert kwargs["kv_scale_mode"] == "per_token"
  assert rl.sampler_kwargs(config, task, rows=8, greedy=True)["kv_scale_mode"] == "static"
  sampler = rl.make_sampler(model_config, kwargs, mesh)
  learner = rl.Learner(config, task, model_config, mesh)
  rollout = _rollout_for(sampler, kwargs)
  assert rollout.fp8.weight_fp8 and not rollout.fp8.kv_fp8
  assert rollout.fp8.generate_kwargs() == {} and rollout.fp8.state_dict() == {}
  rl_step = rl.make_rl_step(learner, sampler)
  examples = list(task.split("train")[:2])
  ref = jax.tree.map(lambda x: x + 0.0, _state(config, params, model_config, mesh).params)
  host, fused = (_state(config, params, model_config, mesh) for _ in range(2))
  for it in range(2):
    rng = jax.random.PRNGKey(20 + it)
    host, host_metrics, _ = learner.iteration(host, ref, rollout, examples, rng)
    fused, fused_metrics = rl_step.from_examples(fused, ref, examples, rng)
    fused_metrics = {k: float(v) for k, v in train.to_host(fused_metrics).items()}
    for name in ("reward_mean", "loss", "mismatch_k1", "mismatch_k3"):
      np.testing.assert_allclose(fused_metrics[name], host_metrics[name], rtol=1e-4, atol=1e-6)
    assert host_metrics["mismatch_k3"] > 0
  assert sampler.kv_pool().k_scale is not None

  run = rl_test_utils.run_config(
    **FP8,
    **{
      "rollout.kv_scale_mode": "per_token",
      "rl.iterations": 2,
      "rl.prompts_per_iteration": 4,
      "checkpoint.every": 2,
      "eval.every": 2,
      "rollout.over_provision": 2.0,
      "sampler.max_slots": 8,
      "sampler.max_new_tokens": 6,
    },
  )
  summary = rl.run(run, str(tmp_path))
  assert summary["iterations"] == 2 and summary["rollout_kv_scale_mode"] == "per_token"
  records = [
    r for r in rl.read_metrics(os.path.join(tmp_path, "metrics.jsonl")) if r["phase"] == "rl"
  ]
  assert all(r["mismatch_k3"] > 0 for r in records)
  abstract = train.abstract_train_state(*_model_and_train(run), rl.build_mesh(run))
  with train.Checkpointer(os.path.join(tmp_path, "checkpoints")) as ckpt:
    assert "kv_scales" not in (ckpt.restore(abstract).extra or {})
