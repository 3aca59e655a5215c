"""rlx.rl: one iteration for every loss x baseline, and make_rl_step == the host iteration."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import rl_test_utils

from rlx import objectives, rl, tasks, train

rl_test_utils.register_test_tasks()
TASK = rl_test_utils.FIRST_TOKEN


@functools.cache
def _setup():
  """One tiny task / model / mesh / sampler shared by every test here."""
  config = rl_test_utils.tiny_config(**{"task.name": TASK, "rl.prompts_per_iteration": 2})
  task = tasks.make_task(TASK, **config.task.kwargs.to_dict())
  mesh = rl.build_mesh(config)
  model_config, params = rl.build_model(config, task)
  kwargs = rl.sampler_kwargs(config, task, rows=10, greedy=False)
  sampler = rl.make_sampler(model_config, kwargs, mesh)
  logprobs = train.make_compute_logprobs(model_config, rl.train_config(config), mesh)
  return config, task, mesh, model_config, params, sampler, logprobs, kwargs


_STEPS = {}


def _config(loss="ppo", baseline="grpo"):
  """Tiny loop config; G = 5 (or G + 1 = 5 for median): one batch shape for every test."""
  return rl_test_utils.tiny_config(
    **{
      "task.name": TASK,
      "train.loss": loss,
      "train.kl_coef": 0.05,
      "rl.baseline": baseline,
      "rl.num_samples": 4 if baseline == "median" else 5,
    }
  )


def _learner(config, task, model_config, mesh, logprobs):
  """A Learner sharing one compiled train step per loss across tests."""
  learner = rl.Learner(
    config,
    task,
    model_config,
    mesh,
    train_step=_STEPS.get(config.train.loss),
    compute_logprobs=logprobs,
  )
  _STEPS[config.train.loss] = learner.train_step
  return learner


def _state(config, params, model_config, mesh):
  cfg = rl.train_config(config)
  return train.create_train_state(params, model_config, cfg, mesh, rng=jax.random.PRNGKey(1))


@pytest.mark.parametrize("loss", sorted(objectives.POLICY_LOSSES))
def test_every_loss_and_baseline_runs_one_iteration(loss):
  config0, task, mesh, model_config, params, sampler, logprobs, kwargs = _setup()
  examples = list(task.split("train")[:2])
  for baseline in rl.BASELINES:
    config = _config(loss, baseline)
    learner = _learner(config, task, model_config, mesh, logprobs)
    k = learner.group_size
    rollout = rl.SyncRollout(
      sampler,
      num_samples=k,
      max_prompt_len=kwargs["max_prompt_len"],
      max_new_tokens=kwargs["max_new_tokens"],
    )
    state = _state(config, params, model_config, mesh)
    ref = jax.tree.map(lambda x: x + 0.0, state.params)
    state, metrics, batch = learner.iteration(state, ref, rollout, examples, jax.random.PRNGKey(2))
    assert k == 5 and batch.num_rows == 10
    assert int(train.to_host(state.step)) == 1
    for name in ("loss", "kl_loss", "reward_mean", "grad_norm", "time/rollout_s", "time/train_s"):
      assert np.isfinite(metrics[name]), (loss, baseline, name, metrics[name])
    assert metrics["skipped"] == 0


def _check_batch_independently(batch, examples, task, learner, params, kwargs):
  """Numpy re-derivation of one iteration's training signal from the raw rollout batch."""
  k, n = learner.group_size, len(examples)
  tokens = np.asarray(batch.tokens)
  plen, rlen = np.asarray(batch.prompt_lengths), np.asarray(batch.response_lengths)
  np.testing.assert_array_equal(np.asarray(batch.group_ids), np.repeat(np.arange(n), k))
  stop = set(task.stop_token_ids)
  responses = []
  for b in range(n * k):
    e = examples[b // k]
    np.testing.assert_array_equal(tokens[b, : plen[b]], e.prompt_ids)  # prompt-major rows
    resp = tokens[b, plen[b] : plen[b] + rlen[b]].tolist()
    assert not (tokens[b, plen[b] + rlen[b] :]).any(), "padding after the response"
    if bool(batch.stopped[b]):
      assert resp[-1] in stop and not stop & set(resp[:-1]), "stop token ends the response"
    else:
      assert rlen[b] == kwargs["max_new_tokens"] and not stop & set(resp)
    responses.append(resp)
  # Reward = the task's host reward of the decoded response (the JAX reward agrees).
  host = np.asarray(task.reward([e for e in examples for _ in range(k)], responses), np.float32)
  np.testing.assert_array_equal(np.asarray(batch.rewards), host)
  adv, keep = (np.asarray(x) for x in rl.group_advantages(batch.rewards, k, learner.baseline))
  grouped = host.reshape(n, k)
  std = grouped.std(1, ddof=1, keepdims=True)  # unbiased, as verl; a constant group -> 1
  expected = (grouped - grouped.mean(1, keepdims=True)) / (np.where(std > 0, std, 1.0) + 1e-6)
  np.testing.assert_allclose(adv.reshape(n, k), expected, atol=1e-4)
  tb = learner.train_batch(batch)
  mask = np.asarray(tb["loss_mask"])
  s = np.arange(tokens.shape[1])[None]
  np.testing.assert_array_equal(mask, (s >= plen[:, None]) & (s < (plen + rlen)[:, None]))
  # The trainer's log-probs of the sampled tokens equal the sampler's (same temperature,
  # positions and layout): old_logp == rollout_logp on-policy.
  old = np.asarray(learner.compute_logprobs(params, tb))
  roll = np.asarray(batch.rollout_logp)
  assert np.max(np.abs(old - roll)[mask > 0]) < 1e-4
  assert not roll[mask == 0].any() and (roll[mask > 0] <= 0).all()


def test_rl_step_equals_host_iteration():
  config, task, mesh, model_config, params, sampler, logprobs, kwargs = _setup()
  config = _config()
  learner = _learner(config, task, model_config, mesh, logprobs)
  examples = list(task.split("train")[:2])
  rng = jax.random.PRNGKey(7)
  ref = jax.tree.map(lambda x: x + 0.0, _state(config, params, model_config, mesh).params)
  rollout = rl.SyncRollout(
    sampler,
    num_samples=5,
    max_prompt_len=kwargs["max_prompt_len"],
    max_new_tokens=kwargs["max_new_tokens"],
  )
  host_state, host_metrics, batch = learner.iteration(
    _state(config, params, model_config, mesh), ref, rollout, examples, rng
  )
  assert 0 < host_metrics["reward_mean"] < 1, "the test needs non-zero advantages"
  # The sampler's counts of the collection are logged with the iteration.
  rlen = np.asarray(batch.response_lengths)
  assert host_metrics["rollout/generated_tokens"] == rlen.sum()
  assert rlen.max() <= host_metrics["rollout/decode_steps"] <= kwargs["max_new_tokens"]
  # Prefill caches every prompt token but the last (the first decode step's input), once
  # per prompt: its G samples share those pages.
  assert host_metrics["rollout/prefill_tokens"] == sum(len(e.prompt_ids) - 1 for e in examples)
  assert host_metrics["rollout/preemptions"] == 0 and host_metrics["rollout/syncs"] >= 1
  _check_batch_independently(batch, examples, task, learner, ref, kwargs)
  assert host_metrics["ratio_max"] == pytest.approx(1.0, abs=1e-5)  # on-policy first update
  assert abs(host_metrics["mismatch_k1"]) < 1e-5
  rl_step = rl.make_rl_step(learner, sampler)
  fused_state, fused_metrics = rl_step.from_examples(
    _state(config, params, model_config, mesh), ref, examples, rng
  )
  fused_metrics = {k: float(v) for k, v in train.to_host(fused_metrics).items()}
  for name in ("reward_mean", "response_length", "loss", "kl_loss", "grad_norm", "entropy"):
    np.testing.assert_allclose(fused_metrics[name], host_metrics[name], rtol=1e-5, atol=1e-6)
  # One update function behind both: the fused program reports every metric the host path
  # does, the host's phase times, staleness and sampler counts aside (off-policy ESS / k3
  # included).
  timing = {"step_time_s", "tokens_per_second", "loss_tokens_per_second"}
  host_only = {k for k in host_metrics if k.startswith(("time/", "staleness", "rollout/"))}
  assert set(fused_metrics) - timing == set(host_metrics) - host_only
  for name in ("offpolicy_ess", "offpolicy_k3", "groups_mixed", "stop_fraction"):
    np.testing.assert_allclose(fused_metrics[name], host_metrics[name], rtol=1e-5, atol=1e-5)
  assert not rl_test_utils.params_allclose(host_state.params, params)
  assert rl_test_utils.params_allclose(fused_state.params, host_state.params, atol=1e-6)


def test_rl_step_bad_inputs():
  config, task, mesh, model_config, params, sampler, logprobs, kwargs = _setup()
  config = _config()
  learner = _learner(config, task, model_config, mesh, logprobs)
  rl_step = rl.make_rl_step(learner, sampler)
  state = _state(config, params, model_config, mesh)
  tokens, lengths = rl.pad_prompts([e.prompt_ids for e in task.split("train")[:2]], rl_step.width)
  ids, alen = task.answer_arrays(task.split("train")[:2])
  with pytest.raises(ValueError, match="prompt_lengths"):
    rl_step(state, None, tokens, lengths[:1], ids, alen, jax.random.PRNGKey(0))
  with pytest.raises(ValueError, match="max_prompt_len"):
    rl_step(state, None, tokens[:, :-1], lengths, ids, alen, jax.random.PRNGKey(0))
  # The step donates `state`: its own params cannot be the reference policy.
  with pytest.raises(ValueError, match=r"`ref_params\['embed'\]\['embedding'\]` shares its"):
    rl_step(state, state.params, tokens, lengths, ids, alen, jax.random.PRNGKey(0))
  assert not any(x.is_deleted() for x in jax.tree.leaves(state))  # nothing ran
  # Out of device memory: rlx's error lists the train step's, the sampler's and the
  # unfused loop's settings (the jitted program replaced by one raising XLA's error).
  ref = jax.tree.map(jnp.copy, state.params)

  def out_of_memory(*args):
    raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 9.9G")

  rl_step.jitted, jitted = out_of_memory, rl_step.jitted
  with pytest.raises(train.OutOfMemoryError, match="rl_step does not fit") as info:
    rl_step(state, ref, tokens, lengths, ids, alen, jax.random.PRNGKey(0))
  rl_step.jitted = jitted
  advice = "\n".join(info.value.advice)
  assert f"B = {2 * learner.group_size}" in advice and "sampler.num_pages" in advice
  assert "rl.fused = False (now True)" in advice
  host_config = rl_test_utils.tiny_config(**{"task.name": TASK, "rl.reward": "host"})
  host_learner = rl.Learner(host_config, task, model_config, mesh, compute_logprobs=logprobs)
  with pytest.raises(ValueError, match="needs a JAX reward"):
    rl.make_rl_step(host_learner, sampler)
