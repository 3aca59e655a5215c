"""`rl.baseline = "vcpo"`: VCPO's minimum-variance baseline inside the loop, on 1, 2 and 8 devices.

The update is re-derived independently: each response's score-gradient norm
by its own `jax.grad` of the unsharded policy, the sequence IS weight and the
baseline in NumPy from the formula of Huang et al. 2026
(https://arxiv.org/abs/2602.17616), then one plain train step on those
advantages must give the loop's params.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import rl_test_utils

from rlx import policy, rl, tasks, train

rl_test_utils.register_test_tasks()
TASK = rl_test_utils.FIRST_TOKEN


def test_vcpo_row_advantages_by_hand():
  # Two groups of two; one token per row. Group 0: rewards 1, 0; score norms 1, 2;
  # log-ratios 0 and ln 2 -> w = 1, 2 -> W = 1 * 1, 4 * 4 = 1, 16.
  rewards = jnp.array([1.0, 0.0, 3.0, 1.0])
  norms = jnp.array([1.0, 2.0, 1.0, 1.0])
  current = jnp.array([[0.0], [np.log(2.0)], [0.0], [0.0]])
  rollout = jnp.zeros((4, 1))
  mask = jnp.ones((4, 1))
  adv = np.asarray(rl.vcpo_row_advantages(rewards, norms, current, rollout, mask, 2))
  b0 = (1 * 1.0 + 16 * 0.0) / (17 + 1e-8)  # group 0 baseline; reward std 0.5
  b1 = (3.0 + 1.0) / (2 + 1e-8)  # equal weights: the mean; reward std 1
  np.testing.assert_allclose(adv, [(1 - b0) / 0.5, (0 - b0) / 0.5, 3 - b1, 1 - b1], rtol=1e-5)
  with pytest.raises(ValueError, match="multiple of group_size=3"):
    rl.vcpo_row_advantages(rewards, norms, current, rollout, mask, 3)
  with pytest.raises(ValueError, match="`group_size` must be an int >= 1, got 0"):
    rl.vcpo_row_advantages(rewards, norms, current, rollout, mask, 0)
  with pytest.raises(ValueError, match=r"`current_logp` must be \[B, S\] with B = 4 rows"):
    rl.vcpo_row_advantages(rewards, norms, current[:2], rollout, mask, 2)
  with pytest.raises(ValueError, match=r"`score_norms` must be finite and >= 0; rows \[1\]"):
    rl.vcpo_row_advantages(rewards, norms.at[1].set(-1.0), current, rollout, mask, 2)


def test_vcpo_row_advantages_do_not_depend_on_the_weights_scale():
  rng = np.random.default_rng(0)
  rewards = jnp.asarray([1.0, 1.0, 1.0, 1.0, 1.0, 0.0, 1.0, 0.0])
  norms = jnp.asarray(rng.uniform(0.5, 2.0, 8), jnp.float32)
  rollout = jnp.asarray(rng.normal(size=(8, 3)), jnp.float32)
  mask = jnp.ones((8, 3))
  adv = lambda n, c: np.asarray(rl.vcpo_row_advantages(rewards, n, c, rollout, mask, 4))  # noqa: E731
  base = adv(norms, rollout + 0.1)
  # Scaling every norm, or making every row equally less likely now, scales W alone.
  np.testing.assert_allclose(adv(1e-5 * norms, rollout + 0.1), base, atol=1e-5)
  np.testing.assert_allclose(adv(norms, rollout - 16.0 / 3), base, atol=1e-5)
  # The all-correct group (rows 0-3) gets 0 however unlikely its rows became, never R / sigma.
  np.testing.assert_array_equal(adv(norms, rollout - 16.0 / 3)[:4], 0.0)
  # w = e^20 and a norm of 1e11 (W = e^40 * 1e22, past float32) stay finite and dominate.
  big = adv(norms.at[4].set(1e11), rollout.at[4].add(20.0 / 3))
  assert np.all(np.isfinite(big))
  sigma = float(np.std(np.asarray(rewards[4:])))
  np.testing.assert_allclose(big[4:], (np.asarray(rewards[4:]) - float(rewards[4])) / sigma)
  with pytest.raises(ValueError, match="needs each row's score-gradient norm"):
    rl.group_advantages(rewards, 2, "vcpo")


def _config(devices: int, **overrides):
  return rl_test_utils.tiny_config(
    **{
      "task.name": TASK,
      "rl.baseline": "vcpo",
      "rl.num_samples": 4,
      "rl.prompts_per_iteration": 2,
      "mesh.num_devices": devices,
      **overrides,
    }
  )


def _setup(config):
  task = tasks.make_task(TASK, **config.task.kwargs.to_dict())
  mesh = rl.build_mesh(config)
  model_config, params = rl.build_model(config, task)
  kwargs = rl.sampler_kwargs(config, task, rows=8, greedy=False)
  sampler = rl.make_sampler(model_config, kwargs, mesh)
  rollout = rl.SyncRollout(
    sampler,
    num_samples=4,
    max_prompt_len=kwargs["max_prompt_len"],
    max_new_tokens=kwargs["max_new_tokens"],
  )
  learner = rl.Learner(config, task, model_config, mesh)
  return task, mesh, model_config, params, sampler, rollout, learner


def _state(config, params, model_config, mesh):
  cfg = rl.train_config(config)
  return train.create_train_state(params, model_config, cfg, mesh, rng=jax.random.PRNGKey(1))


def _expected_advantages(batch, params, model_config, temperature, group_size):
  """NumPy VCPO advantages from per-row `jax.grad`s of the unsharded policy."""
  tokens = np.asarray(batch.tokens)
  mask = np.asarray(batch.response_mask, np.float32)

  @jax.jit
  def row(p, t, m):  # the row's score-gradient norm and per-token log-probs, one program
    def sequence_logp(q):
      logp, _ = policy.token_logprobs(q, model_config, t[None], m[None], temperature=temperature)
      return jnp.sum(logp), logp[0]

    grads, logp = jax.grad(sequence_logp, has_aux=True)(p)
    sq = sum(jnp.sum(jnp.square(g.astype(jnp.float32))) for g in jax.tree.leaves(grads))
    return jnp.sqrt(sq), logp

  host_params = jax.tree.map(jnp.asarray, jax.device_get(params))
  norms, current = [], []
  for t, m in zip(tokens, mask, strict=True):
    norm, logp = row(host_params, jnp.asarray(t), jnp.asarray(m))
    norms.append(float(norm))
    current.append(np.asarray(logp, np.float64))
  log_w = np.sum((np.asarray(current) - np.asarray(batch.rollout_logp, np.float64)) * mask, axis=1)
  weight = (np.exp(log_w) * np.asarray(norms)) ** 2
  rewards = np.asarray(batch.rewards, np.float64).reshape(-1, group_size)
  weight = weight.reshape(-1, group_size)
  baseline = (weight * rewards).sum(1, keepdims=True) / (weight.sum(1, keepdims=True) + 1e-8)
  std = rewards.std(1, keepdims=True)
  adv = np.where(std > 1e-8, (rewards - baseline) / np.where(std > 0, std, 1), rewards - baseline)
  return adv.reshape(-1), np.asarray(norms), np.exp(log_w)


@pytest.mark.parametrize("devices", [1, 2, 8])
def test_vcpo_update_equals_an_independent_derivation(devices):
  config = _config(devices)
  task, mesh, model_config, params, sampler, rollout, learner = _setup(config)
  examples = list(task.split("train")[:2])
  state0 = _state(config, params, model_config, mesh)
  # A stale batch (sampled by other params), so the IS weights are not all 1.
  behaviour = jax.tree.map(
    lambda x: x + 0.05 * jax.random.normal(jax.random.PRNGKey(3), x.shape, x.dtype), state0.params
  )
  state, metrics, batch = learner.iteration(
    state0,
    None,
    rollout,
    examples,
    jax.random.PRNGKey(7),
    rollout_params=behaviour,
    rollout_version=0,
  )
  assert 0 < metrics["reward_mean"] < 1, "the test needs mixed groups"
  assert np.isfinite(metrics["offpolicy_ess"]) and metrics["offpolicy_ess"] < 1
  temperature = float(learner.train_config.temperature)
  adv, norms, w = _expected_advantages(batch, params, model_config, temperature, 4)
  assert np.ptp(w) > 1e-3 and np.all(norms[np.asarray(batch.response_lengths) > 0] > 0)
  # The loop's advantages differ from GRPO's here: the weighted baseline is not the mean.
  grpo, _ = rl.group_advantages(batch.rewards, 4, "grpo")
  assert np.max(np.abs(adv - np.asarray(grpo))) > 1e-3
  # One plain train step on the re-derived advantages gives the loop's params.
  tb = learner.train_batch(batch)
  assert np.all(np.isnan(np.asarray(tb["advantages"])))  # set by the update, not here
  tb["advantages"] = jnp.asarray(adv, jnp.float32)
  tb = train.shard_batch(tb, mesh)
  fresh = _state(config, params, model_config, mesh)
  tb["old_logp"] = learner.compute_logprobs(fresh, tb)
  want, _ = learner.train_step(fresh, tb)
  assert rl_test_utils.params_allclose(state.params, want.params, atol=2e-5)
  assert not rl_test_utils.params_allclose(state.params, params, atol=1e-6)


def test_vcpo_fused_step_equals_host_iteration():
  config = _config(1)
  task, mesh, model_config, params, sampler, rollout, learner = _setup(config)
  examples = list(task.split("train")[:2])
  rng = jax.random.PRNGKey(7)
  host_state, host_metrics, _ = learner.iteration(
    _state(config, params, model_config, mesh), None, rollout, examples, rng
  )
  assert 0 < host_metrics["reward_mean"] < 1
  fused_state, fused_metrics = rl.make_rl_step(learner, sampler).from_examples(
    _state(config, params, model_config, mesh), None, examples, rng
  )
  fused_metrics = train.to_host(fused_metrics)
  for name in ("loss", "grad_norm", "offpolicy_ess"):
    np.testing.assert_allclose(float(fused_metrics[name]), host_metrics[name], rtol=1e-5, atol=1e-6)
  assert rl_test_utils.params_allclose(fused_state.params, host_state.params, atol=1e-6)


def test_vcpo_config_rules():
  with pytest.raises(ValueError, match=r"num_samples.*>= 2 for the 'vcpo' baseline"):
    rl.validate_config(_config(1, **{"rl.num_samples": 1}))
  rl.validate_config(_config(1, **{"rl.staleness": 4, "rl.old_logp": "sampler"}))
