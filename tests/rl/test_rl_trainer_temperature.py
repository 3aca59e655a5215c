"""rlx.rl: `train.temperature`, the trainer's softmax temperature apart from the rollout's."""

import functools

import jax
import numpy as np
import pytest
import rl_test_utils

from rlx import objectives, policy, rl, tasks, train

rl_test_utils.register_test_tasks()
TASK = rl_test_utils.FIRST_TOKEN
SAMPLE_T = 0.5


def _config(train_temperature):
  return rl_test_utils.tiny_config(
    **{
      "task.name": TASK,
      "rl.prompts_per_iteration": 2,
      "rl.num_samples": 5,
      "rl.temperature": SAMPLE_T,
      "train.temperature": train_temperature,
      "train.kl_coef": 0.05,
    }
  )


def test_train_temperature_resolves_to_the_rollouts_when_zero():
  assert rl.get_config().train.temperature == 0.0
  assert rl.train_config(_config(0.0)).temperature == SAMPLE_T
  assert rl.train_config(_config(1.0)).temperature == 1.0
  assert rl.train_config(_config(2)).temperature == 2.0


@pytest.mark.parametrize("bad", [-1.0, None])
def test_train_temperature_bad_values_name_the_field(bad):
  config = _config(0.0)
  config.train.temperature = bad
  with pytest.raises(ValueError, match=r"config\.train\.temperature"):
    rl.validate_config(config)


@functools.cache
def _setup():
  config = _config(0.0)
  task = tasks.make_task(TASK, **config.task.kwargs.to_dict())
  mesh = rl.build_mesh(config)
  model_config, params = rl.build_model(config, task)
  kwargs = rl.sampler_kwargs(config, task, rows=10, greedy=False)
  assert kwargs["temperature"] == SAMPLE_T
  sampler = rl.make_sampler(model_config, kwargs, mesh)
  return task, mesh, model_config, params, sampler, kwargs


def _iteration(train_temperature):
  task, mesh, model_config, params, sampler, kwargs = _setup()
  config = _config(train_temperature)
  learner = rl.Learner(config, task, model_config, mesh)
  state = train.create_train_state(
    params, model_config, learner.train_config, mesh, rng=jax.random.PRNGKey(1)
  )
  ref = jax.tree.map(lambda x: x + 0.0, state.params)
  rollout = rl.SyncRollout(
    sampler,
    num_samples=5,
    max_prompt_len=kwargs["max_prompt_len"],
    max_new_tokens=kwargs["max_new_tokens"],
  )
  examples = list(task.split("train")[:2])
  rng = jax.random.PRNGKey(3)
  new_state, metrics, batch = learner.iteration(state, ref, rollout, examples, rng)
  return learner, ref, batch, metrics, new_state, examples, rng


@pytest.mark.parametrize("train_temperature", [0.0, 1.0])
def test_old_logp_at_the_trainers_temperature_rollout_logp_at_the_samplers(train_temperature):
  learner, params, batch, metrics, _, _, _ = _iteration(train_temperature)
  model_config = _setup()[2]
  tb = learner.train_batch(batch)
  mask = np.asarray(tb["loss_mask"]) > 0
  trainer_t = train_temperature or SAMPLE_T
  expected = {}
  for t in (SAMPLE_T, 1.0):  # independent log-probs of the sampled tokens at both temperatures
    logp, _ = policy.token_logprobs(
      params, model_config, tb["tokens"], tb["loss_mask"], temperature=t
    )
    expected[t] = np.asarray(logp)
  old = np.asarray(learner.compute_logprobs(params, tb))
  np.testing.assert_allclose(old[mask], expected[trainer_t][mask], atol=1e-5)
  roll = np.asarray(batch.rollout_logp)
  np.testing.assert_allclose(roll[mask], expected[SAMPLE_T][mask], atol=1e-4)
  # The mismatch metrics are those of the trainer's old_logp against the sampler's.
  k1 = float(objectives.rollout_mismatch_kl(old, roll, mask).k1)
  assert metrics["mismatch_k1"] == pytest.approx(k1, abs=1e-5)
  if train_temperature:
    assert abs(k1) > 1e-3, "T = 1 vs T = 0.5 log-probs of the same tokens differ"
    assert np.abs(old - roll)[mask].max() > 1e-2
  else:
    assert abs(k1) < 1e-5
  assert metrics["ratio_max"] == pytest.approx(1.0, abs=1e-5)  # old_logp is the trainer's own


def test_fused_rl_step_equals_host_iteration_at_another_trainer_temperature():
  learner, ref, _, host_metrics, host_state, examples, rng = _iteration(1.0)
  task, mesh, model_config, params, sampler, _ = _setup()
  state = train.create_train_state(
    params, model_config, learner.train_config, mesh, rng=jax.random.PRNGKey(1)
  )
  fused_state, fused = rl.make_rl_step(learner, sampler).from_examples(state, ref, examples, rng)
  fused = {k: float(v) for k, v in train.to_host(fused).items()}
  for name in ("reward_mean", "loss", "kl_loss", "grad_norm", "mismatch_k1"):
    np.testing.assert_allclose(fused[name], host_metrics[name], rtol=1e-5, atol=1e-6)
  assert rl_test_utils.params_allclose(fused_state.params, host_state.params, atol=1e-6)
