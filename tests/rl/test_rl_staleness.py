"""Controlled staleness (rl.staleness): the version ring, its metrics, old_logp modes, resume."""

import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import rl_test_utils

from rlx import policy, rl, train

TIME_KEYS = ("time/", "tokens_per_s")


def _tree(value):
  return {"w": jnp.full((2, 3), float(value)), "b": jnp.full((3,), float(value))}


def _value(tree):
  return float(np.asarray(tree["w"])[0, 0])


@pytest.mark.parametrize(
  "mode,k,m,expected",
  [
    # fixed: version u - k once k updates have happened (the oldest held before).
    ("fixed", 4, 2, [0, 0, 0, 2, 4, 6]),
    ("fixed", 2, 1, [0, 0, 0, 1, 2, 3]),
    # periodic: refreshed every k updates.
    ("periodic", 4, 2, [0, 0, 4, 4, 8, 8]),
    ("periodic", 3, 1, [0, 0, 0, 3, 3, 3]),
  ],
)
def test_select_returns_the_version_k_updates_back(mode, k, m, expected):
  held = rl.RolloutParams(k, mode, updates_per_iteration=m)
  got = []
  for i in range(6):
    u = i * m
    params, version = held.select(_tree(u), u)
    assert _value(params) == version  # the params OF that version, not the current ones
    got.append(version)
    assert len(held.versions) <= (k // m + 1 if mode == "fixed" else 1)
  assert got == expected
  stale = [i * m - v for i, v in enumerate(got)]
  assert max(stale) <= (k if mode == "fixed" else k - m)


def test_staleness_zero_is_the_live_params_without_a_copy():
  held = rl.RolloutParams(0)
  tree = _tree(1)
  params, version = held.select(tree, 7)
  assert params is tree and version == 7 and held.state_dict() == {}


def test_held_versions_survive_donation_and_round_trip_through_state_dict():
  held = rl.RolloutParams(2, "fixed", updates_per_iteration=1)
  trees = [_tree(v) for v in range(3)]
  for v, t in enumerate(trees):
    held.select(t, v)
  for t in trees:  # the train step donates the live params: the held copies stay
    jax.tree.map(lambda x: x.delete(), t)
  state = held.state_dict()
  assert list(state["versions"]) == [0, 1, 2]
  restored = rl.RolloutParams(2, "fixed", updates_per_iteration=1, put=lambda t: t)
  restored.load_state_dict(json.loads(json.dumps(state, default=lambda a: a.tolist())))
  for a in (held, restored):
    params, version = a.select(_tree(3), 3)
    assert version == 1 and _value(params) == 1.0


def test_host_ring_puts_each_version_back_on_the_device():
  puts = []
  held = rl.RolloutParams(
    1, "fixed", place="host", put=lambda t: puts.append(1) or jax.tree.map(jnp.asarray, t)
  )
  held.select(_tree(0), 0)
  params, version = held.select(_tree(1), 1)
  assert version == 0 and _value(params) == 0.0 and len(puts) == 2
  assert all(isinstance(x, jax.Array) for x in jax.tree.leaves(params))


@pytest.mark.parametrize("devices", [1, 2, 8])
def test_held_version_keeps_the_params_sharding(devices):
  model_config = policy.ModelConfig.small(
    vocab_size=64,
    hidden_size=32,
    num_layers=1,
    num_heads=2,
    num_kv_heads=1,
    head_dim=16,
    intermediate_size=64,
  )
  mesh = train.make_mesh(-1, 1, 1, devices=jax.devices()[:devices])
  live = train.shard_params(
    policy.init_params(model_config, jax.random.PRNGKey(0)), model_config, mesh
  )
  expected = jax.tree.map(np.asarray, live)
  held = rl.RolloutParams(2, "fixed", put=lambda t: train.shard_params(t, model_config, mesh))
  held.select(live, 0)
  shardings = jax.tree.map(lambda x: x.sharding, live)
  jax.tree.map(lambda x: x.delete(), live)
  params, version = held.select(jax.tree.map(jnp.zeros_like, expected), 2)
  assert version == 0
  assert jax.tree.map(lambda x: x.sharding, params) == shardings
  assert rl_test_utils.params_allclose(params, expected)
  again = rl.RolloutParams(2, "fixed", put=lambda t: train.shard_params(t, model_config, mesh))
  again.load_state_dict(held.state_dict())
  restored, _ = again.select(jax.tree.map(jnp.zeros_like, expected), 2)
  assert jax.tree.map(lambda x: x.sharding, restored) == shardings
  assert rl_test_utils.params_allclose(restored, expected)


@pytest.mark.parametrize("devices", [1, 2, 8])
def test_proximal_ewma_keeps_the_params_sharding_and_never_donates_the_callers(devices):
  model_config = policy.ModelConfig.small(
    vocab_size=64,
    hidden_size=32,
    num_layers=1,
    num_heads=2,
    num_kv_heads=1,
    head_dim=16,
    intermediate_size=64,
  )
  mesh = train.make_mesh(-1, 1, 1, devices=jax.devices()[:devices])

  def put(t):
    return train.shard_params(t, model_config, mesh)

  first = put(policy.init_params(model_config, jax.random.PRNGKey(0)))
  second = put(policy.init_params(model_config, jax.random.PRNGKey(1)))
  shardings = jax.tree.map(lambda x: x.sharding, first)
  a, b = jax.tree.map(np.asarray, first), jax.tree.map(np.asarray, second)
  ewma = rl.ProximalEwma(0.5, put=put)
  ewma.select(first)
  jax.tree.map(lambda x: x.delete(), first)  # the average is a copy: the live params may go
  ewma.update(second)  # donates the average's old buffers, never the caller's
  assert rl_test_utils.params_allclose(second, b)
  expected = jax.tree.map(lambda x, y: (0.5 * x + y) / 1.5, a, b)
  assert jax.tree.map(lambda x: x.sharding, ewma.params) == shardings
  assert rl_test_utils.params_allclose(ewma.params, expected, atol=1e-6)
  again = rl.ProximalEwma(0.5, put=put)
  again.load_state_dict(ewma.state_dict())
  assert jax.tree.map(lambda x: x.sharding, again.params) == shardings
  assert rl_test_utils.params_allclose(again.params, expected, atol=1e-6)


@pytest.mark.parametrize(
  "kwargs,match",
  [
    (dict(staleness=3, mode="fixed", updates_per_iteration=2), "multiple of the 2"),
    (dict(staleness=-1, mode="fixed"), "int >= 0"),
    (dict(staleness=True, mode="fixed"), "int >= 0"),
    (dict(staleness=2, mode="ring"), "staleness_mode"),
    (dict(staleness=2, mode="fixed", place="disk"), "staleness_ring"),
    (dict(staleness=2, mode="fixed", place="host"), "`put`"),
  ],
)
def test_bad_settings_are_named(kwargs, match):
  with pytest.raises(ValueError, match=match):
    rl.RolloutParams(**kwargs)


def test_versions_must_not_go_back():
  held = rl.RolloutParams(2)
  held.select(_tree(0), 4)
  with pytest.raises(ValueError, match="older than the newest held"):
    held.select(_tree(0), 3)


def test_staleness_metrics_by_hand():
  versions = np.array([[-1, 3, 3, -1], [-1, 1, 2, 2]])
  mask = versions >= 0
  m = rl.staleness_metrics(versions, mask, 4)
  # staleness 1, 1, 3, 2, 2
  assert m["staleness_mean"] == pytest.approx(9 / 5)
  assert (m["staleness_min"], m["staleness_max"]) == (1.0, 3.0)
  assert m["staleness_hist"] == {"1": 2, "2": 2, "3": 1}
  with pytest.raises(ValueError, match="newer than the learner"):
    rl.staleness_metrics(versions, mask, 2)
  with pytest.raises(ValueError, match="same"):
    rl.staleness_metrics(versions, mask[:, :2], 4)


def test_offpolicy_metrics_by_hand():
  # Row 0: log-ratios 0.5 and -0.25 -> w0 = e^0.25; row 1: one token at -1.0 ->
  # w1 = e^-1; row 2 has no trained token and does not count.
  current = np.array([[0.0, -1.0, -0.5], [-2.0, 0.0, 0.0], [-1.0, -1.0, 0.0]], np.float32)
  behaviour = np.array([[-0.5, -0.75, -9.0], [-1.0, 0.0, 0.0], [0.0, 0.0, 0.0]], np.float32)
  mask = np.array([[1, 1, 0], [1, 0, 0], [0, 0, 0]], np.float32)
  m = rl.offpolicy_metrics(current, behaviour, mask)
  w = np.exp([0.25, -1.0])
  assert float(m["offpolicy_ess"]) == pytest.approx(w.sum() ** 2 / (2 * (w**2).sum()), rel=1e-6)
  d = np.array([0.5, -0.25, -1.0])  # current - behaviour on the 3 trained tokens
  k3 = np.mean(np.exp(d) - 1 - d)
  assert float(m["offpolicy_k3"]) == pytest.approx(k3, rel=1e-5)
  same = rl.offpolicy_metrics(current, current, mask)
  assert float(same["offpolicy_ess"]) == pytest.approx(1.0)
  assert float(same["offpolicy_k3"]) == pytest.approx(0.0, abs=1e-7)


def test_config_validation_names_the_fields():
  c = rl_test_utils.tiny_config(**{"rl.staleness": 3, "train.mini_batches": 2})
  with pytest.raises(ValueError, match=r"config.rl.staleness`=3 must be a multiple of the 2"):
    rl.validate_config(c)
  c = rl_test_utils.tiny_config(**{"rl.old_logp": "behaviour", "rollout.over_provision": 2.0})
  with pytest.raises(ValueError, match="old_logp`='behaviour'.*partial rollouts"):
    rl.validate_config(c)
  c = rl_test_utils.tiny_config(**{"rl.old_logp": "proximal"})
  with pytest.raises(ValueError, match="config.rl.old_logp"):
    rl.validate_config(c)


def _records(workdir):
  out = []
  for r in rl.read_metrics(os.path.join(workdir, "metrics.jsonl")):
    if r["phase"] in ("rl", "eval"):
      out.append({k: v for k, v in r.items() if not any(t in k for t in TIME_KEYS)})
  return out


def _config(**overrides):
  base = {
    "rl.iterations": 6,
    "checkpoint.every": 2,
    "eval.every": 3,
    "rl.staleness": 2,
    # A reward-free gradient too, so that every update moves the params.
    "train.entropy_coef": 0.01,
  }
  base.update(overrides)
  return rl_test_utils.run_config(**base)


@pytest.fixture(scope="module")
def stale_run(tmp_path_factory):
  rl_test_utils.register_test_tasks()
  workdir = str(tmp_path_factory.mktemp("stale"))
  config = _config()
  return workdir, config, rl.run(config, workdir)


def test_run_trains_each_batch_k_updates_stale(stale_run):
  workdir, _, summary = stale_run
  rl_records = [r for r in _records(workdir) if r["phase"] == "rl"]
  assert [r["staleness_max"] for r in rl_records] == [0, 1, 2, 2, 2, 2]
  assert [r["staleness_min"] for r in rl_records] == [0, 1, 2, 2, 2, 2]
  assert not summary["fused_rl_step"]
  tokens = sum(r["response_tokens"] for r in rl_records)
  assert sum(summary["staleness_hist"].values()) == tokens
  assert summary["staleness_max"] == 2
  by_hand = sum(r["staleness_mean"] * r["response_tokens"] for r in rl_records) / tokens
  assert summary["staleness_mean"] == pytest.approx(by_hand)
  # The behaviour policy is 2 updates behind the proximal one: a measurable mismatch.
  assert all(r["mismatch_k3"] > 1e-7 for r in rl_records[2:])
  # ... which the off-policy diagnostics report (old_logp is the current policy's here).
  for r in rl_records[2:]:
    assert r["offpolicy_k3"] == pytest.approx(r["mismatch_k3"], rel=1e-4, abs=1e-9)
    assert 0.0 < r["offpolicy_ess"] < 1.0


def _kill_then_resume(config, workdir, monkeypatch):
  """Runs `config` in `workdir`, killed in its 5th iteration (after the iteration-4
  checkpoint), then reruns it; returns the rerun's summary."""
  original = rl.Learner.iteration
  calls = []

  def dying(self, *args, **kwargs):
    calls.append(1)
    if len(calls) == 5:
      raise KeyboardInterrupt("killed")
    return original(self, *args, **kwargs)

  monkeypatch.setattr(rl.Learner, "iteration", dying)
  with pytest.raises(KeyboardInterrupt):
    rl.run(config, workdir)
  monkeypatch.setattr(rl.Learner, "iteration", original)
  # The asynchronous save of step 4 finishes in the background (the interrupted
  # run does not wait for it); a quick restart could otherwise find only step 2.
  deadline = time.time() + 60
  while "4" not in os.listdir(os.path.join(workdir, "checkpoints")) and time.time() < deadline:
    time.sleep(0.1)
  return rl.run(config, workdir)


def _final_checkpoints(config, *workdirs):
  """The last checkpoint (state and extra) of each workdir."""
  return [rl_test_utils.final_checkpoint(config, w) for w in workdirs]


def test_killed_run_resumes_equal_to_the_straight_one(stale_run, tmp_path, monkeypatch):
  """An iteration that dies after the iteration-4 checkpoint; rerun: same records, params, ring."""
  workdir, config, _ = stale_run
  killed = str(tmp_path / "killed")
  summary = _kill_then_resume(config, killed, monkeypatch)
  assert summary["resumed_from_iteration"] == 4 and summary["iterations"] == 6
  assert _records(killed) == _records(workdir)
  a, b = _final_checkpoints(config, workdir, killed)
  assert rl_test_utils.params_allclose(a.state.params, b.state.params)
  assert (
    list(a.extra["staleness"]["versions"])
    == list(b.extra["staleness"]["versions"])
    == [
      3,
      4,
      5,
    ]
  )
  for i in ("0", "1", "2"):
    assert rl_test_utils.params_allclose(
      a.extra["staleness"]["params"][i], b.extra["staleness"]["params"][i]
    )


def test_old_logp_modes(tmp_path):
  """ "sampler" is the recorded behaviour log-probs; "behaviour" recomputes them (same numbers)."""
  rl_test_utils.register_test_tasks()
  base = dict(**{"rl.iterations": 3, "eval.every": 3, "checkpoint.every": 3})
  out = {}
  for mode in ("current", "behaviour", "sampler"):
    config = _config(**base, **{"rl.old_logp": mode})
    rl.run(config, str(tmp_path / mode))
    out[mode] = [r for r in _records(str(tmp_path / mode)) if r["phase"] == "rl"]
  last = {m: r[-1] for m, r in out.items()}
  assert last["sampler"]["mismatch_k3"] == 0.0
  assert last["behaviour"]["mismatch_k3"] < 1e-6  # trainer vs sampler numerics only
  assert last["current"]["mismatch_k3"] > 10 * max(last["behaviour"]["mismatch_k3"], 1e-8)
  # Same first batch (staleness 0 at the first update): "current" == "behaviour" there.
  assert out["current"][0]["loss"] == out["behaviour"][0]["loss"]
  # Every mode reports the current policy's distance from the sampler (the same
  # numbers on the first batches, which every mode samples alike).
  for mode in ("behaviour", "sampler"):
    assert out[mode][1]["offpolicy_k3"] == pytest.approx(
      out["current"][1]["offpolicy_k3"], rel=0.05
    )
    assert out[mode][-1]["offpolicy_k3"] > 10 * max(last["behaviour"]["mismatch_k3"], 1e-8)


def test_periodic_mode_with_mini_batches(tmp_path):
  rl_test_utils.register_test_tasks()
  config = _config(
    **{
      "rl.staleness": 4,
      "rl.staleness_mode": "periodic",
      "train.mini_batches": 2,
      "rl.iterations": 4,
      "checkpoint.every": 4,
      "eval.every": 4,
    }
  )
  summary = rl.run(config, str(tmp_path / "periodic"))
  rl_records = [r for r in _records(str(tmp_path / "periodic")) if r["phase"] == "rl"]
  assert [r["staleness_max"] for r in rl_records] == [0, 2, 0, 2]
  assert summary["staleness_max"] == 2


@pytest.mark.parametrize(
  "overrides",
  [
    {"rollout.over_provision": 2.0},  # partial rollouts: recycled tokens are staler still
    {"rollout.weight_dtype": "fp8_e4m3", "rollout.kv_dtype": "fp8_e4m3"},
  ],
  ids=["partial", "fp8"],
)
def test_composes_with_partial_and_fp8_rollouts(tmp_path, overrides):
  rl_test_utils.register_test_tasks()
  config = _config(**{"rl.iterations": 4, "checkpoint.every": 4, "eval.every": 4, **overrides})
  summary = rl.run(config, str(tmp_path / "run"))
  rl_records = [r for r in _records(str(tmp_path / "run")) if r["phase"] == "rl"]
  assert summary["iterations"] == 4
  assert [r["staleness_min"] for r in rl_records] == [0, 1, 2, 2]
  if "rollout.over_provision" in overrides:
    assert summary["staleness_max"] >= 2
  else:
    assert [r["staleness_max"] for r in rl_records] == [0, 1, 2, 2]


@pytest.mark.parametrize("devices", [2, 8])
def test_stale_run_on_a_multi_device_mesh(tmp_path, devices):
  """The ring's copies keep the params' sharding; the donated live params do not take them."""
  rl_test_utils.register_test_tasks()
  config = _config(
    **{"rl.iterations": 3, "checkpoint.every": 3, "eval.every": 3, "mesh.num_devices": devices}
  )
  summary = rl.run(config, str(tmp_path / "run"))
  rl_records = [r for r in _records(str(tmp_path / "run")) if r["phase"] == "rl"]
  assert summary["iterations"] == 3
  assert [r["staleness_max"] for r in rl_records] == [0, 1, 2]
  assert all(np.isfinite(r["loss"]) for r in rl_records)


def test_proximal_ewma_is_the_bias_corrected_average():
  beta = 0.5
  ewma = rl.ProximalEwma(beta, put=lambda t: jax.tree.map(jnp.asarray, t))
  thetas = [_tree(v) for v in (4.0, 8.0, 2.0)]
  assert _value(ewma.select(thetas[0])) == 4.0  # starts as a copy, total weight 1
  ewma.update(thetas[1])  # W = 1.5: (0.5 * 4 + 8) / 1.5
  assert _value(ewma.params) == pytest.approx((0.5 * 4 + 8) / 1.5)
  ewma.update(thetas[2])  # W = 1.75: weights 0.25, 0.5, 1 on 4, 8, 2
  by_hand = (0.25 * 4 + 0.5 * 8 + 2) / 1.75
  assert _value(ewma.params) == pytest.approx(by_hand)
  assert ewma.total_weight == pytest.approx(1.75)
  assert _value(thetas[0]) == 4.0  # the caller's params are never donated
  state = ewma.state_dict()
  other = rl.ProximalEwma(beta, put=lambda t: jax.tree.map(jnp.asarray, t))
  other.load_state_dict(state)
  assert _value(other.params) == pytest.approx(by_hand) and other.total_weight == 1.75
  other.update(thetas[0])
  ewma.update(thetas[0])
  assert _value(other.params) == _value(ewma.params)
  for bad in (0.0, 1.0, -0.1, True, "0.9"):
    with pytest.raises(ValueError, match="ewma_decay"):
      rl.ProximalEwma(bad)
  c = rl_test_utils.tiny_config(**{"rl.old_logp": "ewma", "rl.ewma_decay": 1.5})
  with pytest.raises(ValueError, match=r"config.rl.ewma_decay` must be a number in \(0, 1\)"):
    rl.validate_config(c)


def test_ewma_run_resumes_equal_to_the_straight_one(tmp_path, monkeypatch):
  """PPO-EWMA end to end: old_logp from the average, checkpointed with the run."""
  rl_test_utils.register_test_tasks()
  config = _config(**{"rl.staleness": 0, "rl.old_logp": "ewma", "rl.ewma_decay": 0.5})
  straight = str(tmp_path / "straight")
  summary = rl.run(config, straight)
  assert not summary["fused_rl_step"]
  records = [r for r in _records(straight) if r["phase"] == "rl"]
  # The first batch is on-policy (the average starts at the params); later the
  # proximal policy lags the sampler, which the mismatch metrics measure.
  assert records[0]["mismatch_k3"] < 1e-6
  assert all(r["mismatch_k3"] > 1e-7 for r in records[1:])
  assert all(r["offpolicy_k3"] < 1e-6 for r in records)  # the current policy sampled

  killed = str(tmp_path / "killed")
  assert _kill_then_resume(config, killed, monkeypatch)["resumed_from_iteration"] == 4
  assert _records(killed) == _records(straight)
  a, b = _final_checkpoints(config, straight, killed)
  assert a.extra["proximal"]["total_weight"] == b.extra["proximal"]["total_weight"]
  assert rl_test_utils.params_allclose(a.extra["proximal"]["params"], b.extra["proximal"]["params"])
  assert not rl_test_utils.params_allclose(a.extra["proximal"]["params"], a.state.params)
