"""rl.async_rollout: the rollout thread and its bounded queue, disjoint device sets, the
staleness bound, and a killed run that resumes with no prompt lost or trained twice."""

import os
import time
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import rl_test_utils

from rlx import rl, train


class _FakeRollout:
  """`collect` records its calls; `gate` (when set) holds each collection until released."""

  def __init__(self, gate=None, fail_at=None):
    self.calls = []
    self.gate = gate
    self.fail_at = fail_at

  def collect(self, params, prompts, rng, *, policy_version):
    if self.gate is not None:
      self.gate.acquire()
    if len(self.calls) == self.fail_at:
      raise RuntimeError("the sampler broke")
    self.calls.append((params, list(map(tuple, prompts)), policy_version))
    return types.SimpleNamespace(tokens=jnp.zeros((len(prompts), 2), jnp.int32))


def _source(n=10, batch=2):
  examples = [types.SimpleNamespace(prompt_ids=[i]) for i in range(n)]
  return rl.PromptSource(examples, batch_size=batch, seed=0)


def _wait_for(predicate, timeout=10.0):
  deadline = time.time() + timeout
  while not predicate():
    assert time.time() < deadline, "timed out"
    time.sleep(0.01)


def test_thread_runs_at_most_queue_size_plus_one_batches_ahead():
  rollout = _FakeRollout()
  source = _source()
  pipe = rl.AsyncRollout(rollout, source, place=lambda p: p, key=jax.random.PRNGKey(0),
                         queue_size=2)  # fmt: skip
  with pytest.raises(ValueError, match="publish"):
    pipe.start()
  pipe.publish("v0", 0)
  pipe.start()
  _wait_for(lambda: pipe.queue.full())
  time.sleep(0.2)  # it would run further now if the bound did not hold
  assert len(rollout.calls) == 3  # 2 queued + 1 waiting to be queued
  assert pipe.consumed_cursor == {"epoch": 0, "index": 0}  # the learner took nothing yet
  item, waited = pipe.get()
  assert item.index == 0 and item.version == 0 and waited >= 0
  assert pipe.consumed_cursor == item.cursor == {"epoch": 0, "index": 2}
  pipe.publish("v1", 4)  # later collections sample with the new version
  pipe.get()  # room again: the 5th collection starts now, after the publish
  _wait_for(lambda: len(rollout.calls) >= 5)
  assert [c[0] for c in rollout.calls[:3]] == ["v0"] * 3 and rollout.calls[4][0] == "v1"
  assert rollout.calls[4][2] == 4
  pipe.stop()
  assert pipe.queue.empty()
  # Each batch's prompts follow the source's stream, one batch after the other.
  stream = [p for c in rollout.calls for p in c[1]]
  assert stream == [(e.prompt_ids[0],) for e in _source(batch=len(stream)).next_batch()]


class _FakePartial:
  """A `PartialRollout` stand-in: pulls 2 prompts a collection; the second waits in flight
  for a published version (`params_update`)."""

  def __init__(self):
    self.calls = []
    self.last_stats = {}

  def collect_groups(self, params, source, rng, *, policy_version, params_update):
    keys = [k for k, _ in source(2)]
    seen = [(params, policy_version)]
    if len(self.calls) == 1:
      _wait_for(lambda: seen.append(params_update()) or seen[-1] is not None)
    self.calls.append((keys, seen))
    self.last_stats = {"policy_version": seen[-1][1]}
    return types.SimpleNamespace(tokens=jnp.zeros((2, 2), jnp.int32)), np.asarray(keys)

  def state_dict(self):
    return {"collections": np.asarray(len(self.calls))}


def test_partial_rollouts_take_published_params_in_flight_and_carry_their_buffer():
  with pytest.raises(ValueError, match="batch_size` must be 1"):
    rl.AsyncRollout(_FakePartial(), _source(), place=lambda p: p, key=jax.random.PRNGKey(0),
                    queue_size=1)  # fmt: skip
  rollout, source = _FakePartial(), _source(batch=1)
  pipe = rl.AsyncRollout(rollout, source, place=lambda p: p, key=jax.random.PRNGKey(0),
                         queue_size=1)  # fmt: skip
  assert pipe.consumed_buffer == {"collections": 0}
  pipe.publish("v0", 0)
  pipe.start()
  first, _ = pipe.get()
  assert first.version == 0 and first.buffer == {"collections": 1}
  assert pipe.consumed_buffer == first.buffer and pipe.consumed_cursor == {"epoch": 0, "index": 2}
  # The second collection is in flight, asking for newer params at every scheduling point.
  pipe.publish("v1", 1)
  second, _ = pipe.get()
  keys, seen = rollout.calls[1]
  assert seen[0] == ("v0", 0) and seen[-1] == ("v1", 1) and all(s is None for s in seen[1:-1])
  assert second.version == 1  # the newest version that sampled it
  assert [e.prompt_ids[0] for e in second.examples] == [source.examples[k].prompt_ids[0]
                                                        for k in keys]  # fmt: skip
  assert pipe.consumed_buffer == {"collections": 2}
  with pytest.raises(ValueError, match="older than the last published 1"):
    pipe.publish("v0", 0)
  pipe.stop()


def test_a_failing_rollout_thread_fails_the_learner():
  pipe = rl.AsyncRollout(_FakeRollout(fail_at=1), _source(), place=lambda p: p,
                         key=jax.random.PRNGKey(0), queue_size=1)  # fmt: skip
  pipe.publish("v0", 0)
  pipe.start()
  pipe.get()
  with pytest.raises(RuntimeError, match="rollout thread failed") as info:
    pipe.get()
  assert "the sampler broke" in str(info.value.__cause__)
  pipe.stop()


@pytest.mark.parametrize(
  ("overrides", "match"),
  [
    ({"mesh.rollout_devices": 1}, "rl.async_rollout = True"),
    ({"rl.async_rollout": True, "rl.staleness": 1}, "controlled staleness"),
    (
      {"rl.async_rollout": True, "rl.old_logp": "behaviour", "rollout.over_provision": 2.0},
      "'behaviour' needs one params version per batch",
    ),
    ({"rl.async_rollout": True, "rl.async_queue_size": 0}, "config.rl.async_queue_size"),
    ({"rl.async_rollout": True, "rl.max_staleness": -1}, "config.rl.max_staleness"),
    ({"rl.async_rollout": True, "rl.stale_batches": "skip"}, "config.rl.stale_batches"),
  ],
)
def test_settings_and_combinations_are_named(overrides, match):
  with pytest.raises(ValueError, match=match):
    rl.validate_config(rl_test_utils.tiny_config(**overrides))


def test_rollout_devices_must_leave_devices_to_train():
  config = rl_test_utils.tiny_config(
    **{"rl.async_rollout": True, "mesh.rollout_devices": 2, "mesh.num_devices": 2}
  )
  with pytest.raises(ValueError, match="leaves none of the 2 devices"):
    rl.build_mesh(config)


def _config(**overrides):
  base = {
    "rl.async_rollout": True,
    "rl.iterations": 8,
    "checkpoint.every": 4,
    "eval.every": 4,
    "train.entropy_coef": 0.01,
  }
  base.update(overrides)
  return rl_test_utils.run_config(**base)


def _rl_records(workdir):
  return [r for r in rl.read_metrics(os.path.join(workdir, "metrics.jsonl")) if r["phase"] == "rl"]


@pytest.mark.parametrize(("devices", "rollout_devices"), [(1, 0), (2, 0), (2, 1), (8, 4)])
def test_async_run_on_shared_and_disjoint_devices(tmp_path, devices, rollout_devices):
  rl_test_utils.register_test_tasks()
  config = _config(
    **{
      "rl.iterations": 4,
      "mesh.num_devices": devices,
      "mesh.rollout_devices": rollout_devices,
    }
  )
  if rollout_devices:
    train_mesh = rl.build_mesh(config)
    rollout_mesh = rl.build_rollout_mesh(config, train_mesh)
    assert not set(train_mesh.devices.flat) & set(rollout_mesh.devices.flat)
    assert len(rollout_mesh.devices.flat) == rollout_devices
  summary = rl.run(config, str(tmp_path / "run"))
  records = _rl_records(str(tmp_path / "run"))
  assert summary["iterations"] == 4 and not summary["fused_rl_step"]
  assert all(np.isfinite(r["loss"]) for r in records)
  # The first batch is on-policy; after that the thread runs ahead: never more than
  # queue + in flight = 2 batches of one update each behind, and it never goes backwards.
  assert records[0]["staleness_max"] == 0
  assert all(0 <= r["staleness_max"] <= 2 for r in records)
  versions = [r["iteration"] - 1 - r["staleness_max"] for r in records]
  assert versions == sorted(versions)
  assert [r["async/batch_index"] for r in records] == [0, 1, 2, 3]
  assert all(r["time/learner_wait_s"] >= 0 and "async/rollout_busy_s" in r for r in records)


@pytest.mark.parametrize("mode", ["drop", "keep"])
def test_batches_over_max_staleness_are_dropped_or_kept_and_counted(tmp_path, mode):
  rl_test_utils.register_test_tasks()
  config = _config(**{"rl.iterations": 6, "rl.max_staleness": 1, "rl.stale_batches": mode})
  # The learner waits before each update, so the thread is always 2 batches ahead.
  original = rl.Learner.update

  def slow(self, *args, **kwargs):
    time.sleep(0.3)
    return original(self, *args, **kwargs)

  with pytest.MonkeyPatch.context() as m:
    m.setattr(rl.Learner, "update", slow)
    summary = rl.run(config, str(tmp_path / "run"))
  records = _rl_records(str(tmp_path / "run"))
  last = records[-1]
  if mode == "drop":
    assert last["async/dropped_total"] > 0 and last["async/stale_kept_total"] == 0
    assert summary["staleness_max"] <= 1
    # A dropped batch's prompts are skipped, not trained later.
    batches = [r["async/batch_index"] for r in records]
    assert batches == sorted(batches) and batches[-1] > len(records) - 1
  else:
    assert last["async/stale_kept_total"] > 0 and last["async/dropped_total"] == 0
    assert summary["staleness_max"] == 2
    assert [r["async/batch_index"] for r in records] == list(range(6))


@pytest.mark.parametrize(("devices", "rollout_devices"), [(1, 0), (2, 1), (8, 4)])
def test_async_partial_rollouts_on_shared_and_disjoint_devices(tmp_path, devices, rollout_devices):
  """APRIL partial rollouts in the rollout thread (weights updated in flight), sharing the
  devices or on their own: every trained group is complete, new, and versioned per token."""
  rl_test_utils.register_test_tasks()
  config = _config(
    **{
      "rl.iterations": 4,
      "mesh.num_devices": devices,
      "mesh.rollout_devices": rollout_devices,
      "rollout.over_provision": 2.0,
    }
  )
  summary = rl.run(config, str(tmp_path / "run"))
  records = _rl_records(str(tmp_path / "run"))
  assert summary["iterations"] == 4 and all(np.isfinite(r["loss"]) for r in records)
  trained = [i for r in records for i in r["async/prompts"]]
  assert len(trained) == len(set(trained)) == 4 * config.rl.prompts_per_iteration
  for r in records:
    assert r["rollout/groups_returned"] == config.rl.prompts_per_iteration
    assert r["rollout/params_updates"] >= 0 and 0 <= r["staleness_min"] <= r["staleness_max"]
  assert records[0]["staleness_max"] == 0


@pytest.mark.parametrize("partial", [False, True], ids=["sync", "partial"])
def test_killed_run_resumes_with_no_prompt_lost_or_trained_twice(tmp_path, monkeypatch, partial):
  """Killed in iteration 6 (after the iteration-4 checkpoint) with a batch queued and one
  in flight; the resumed run trains each prompt of the stream exactly once (in order, without
  partial rollouts; with them, every prompt pulled is trained or still buffered)."""
  rl_test_utils.register_test_tasks()
  config = _config(**({"rollout.over_provision": 2.0} if partial else {}))
  workdir = str(tmp_path / "killed")
  original = rl.AsyncRollout.get
  calls, ahead = [], []

  def dying(self):
    calls.append(1)
    if len(calls) == 6:  # the learner asks for its 6th batch: 5 trained
      _wait_for(lambda: self.queue.full())
      ahead.append(self.queue.qsize())  # batches sampled beyond the 5 trained
      raise KeyboardInterrupt("killed")
    return original(self)

  monkeypatch.setattr(rl.AsyncRollout, "get", dying)
  with pytest.raises(KeyboardInterrupt):
    rl.run(config, workdir)
  monkeypatch.setattr(rl.AsyncRollout, "get", original)
  assert ahead[0] >= 1  # the kill found sampled batches the learner had not trained
  deadline = time.time() + 60  # the step-4 save finishes in the background
  while "4" not in os.listdir(os.path.join(workdir, "checkpoints")) and time.time() < deadline:
    time.sleep(0.1)
  summary = rl.run(config, workdir)
  assert summary["resumed_from_iteration"] == 4 and summary["iterations"] == 8
  records = _rl_records(workdir)
  assert [r["iteration"] for r in records] == list(range(1, 9))
  trained = [i for r in records for i in r["async/prompts"]]
  assert len(set(trained)) == len(trained) == 8 * config.rl.prompts_per_iteration
  # The prompt stream of the run's source: the seeded permutation epoch after epoch.
  task = rl.make_task(config)
  examples = task.split("train")
  index = {id(e): i for i, e in enumerate(examples)}
  if not partial:
    source = rl.PromptSource(examples, batch_size=len(trained), seed=config.seed + 1)
    assert trained == [index[id(e)] for e in source.next_batch()]
    return
  # Partial: the final checkpoint's buffer holds the pulled prompts not trained yet, and
  # trained + buffered is exactly the start of the stream (nothing lost, nothing twice).
  buf = rl_test_utils.final_checkpoint(config, workdir).extra["rollout_buffer"]
  buffered = [int(k) for k in buf["key"][: int(buf["count"])]]
  pulled = len(trained) + len(buffered)
  source = rl.PromptSource(examples, batch_size=pulled, seed=config.seed + 1)
  assert sorted(trained + buffered) == sorted(index[id(e)] for e in source.next_batch())


def test_published_params_are_copies_the_learner_may_donate():
  """`publish` through `copy_to` on the same mesh: new buffers, so the donating step is safe."""
  rl_test_utils.register_test_tasks()
  config = rl_test_utils.tiny_config()
  task = rl.make_task(config)
  model_config, params = rl.build_model(config, task)
  mesh = rl.build_mesh(config)
  params = train.shard_params(params, model_config, mesh)
  from rlx import policy

  shardings = policy.param_shardings(model_config, mesh)
  rollout = _FakeRollout()
  pipe = rl.AsyncRollout(rollout, _source(),
                         place=lambda p: train.copy_to(p, shardings),
                         key=jax.random.PRNGKey(0), queue_size=1)  # fmt: skip
  pipe.publish(params, 0)
  pipe.start()
  try:
    pipe.get()  # the thread collected with what was published
  finally:
    pipe.stop()
  placed, _, version = rollout.calls[0]
  assert version == 0
  for a, b in zip(jax.tree.leaves(placed), jax.tree.leaves(params), strict=True):
    assert a.unsafe_buffer_pointer() != b.unsafe_buffer_pointer()
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize(
  ("old_logp", "devices", "rollout_devices"),
  [("behaviour", 1, 0), ("behaviour", 2, 1), ("behaviour", 8, 4), ("current", 2, 1)],
)
def test_async_old_logp_behaviour_recomputes_with_the_sampling_version(
  tmp_path, old_logp, devices, rollout_devices
):
  """With rl.old_logp = "behaviour" a stale batch's old_logp is its sampling version's: the
  trainer's log-probs then match the sampler's (mismatch ~ 0), unlike the learner's own."""
  rl_test_utils.register_test_tasks()
  config = _config(
    **{
      "rl.iterations": 5,
      "mesh.num_devices": devices,
      "mesh.rollout_devices": rollout_devices,
      "rl.old_logp": old_logp,
      "rl.async_queue_size": 2,
    }
  )
  original = rl.Learner.update

  def slow(self, *args, **kwargs):  # the thread runs ahead: the later batches are stale
    time.sleep(0.3)
    return original(self, *args, **kwargs)

  with pytest.MonkeyPatch.context() as m:
    m.setattr(rl.Learner, "update", slow)
    rl.run(config, str(tmp_path / "run"))
  records = _rl_records(str(tmp_path / "run"))
  stale = [r for r in records if r["staleness_min"] > 0]
  assert stale, [r["staleness_min"] for r in records]
  k1 = [abs(r["mismatch_k1"]) for r in stale]
  if old_logp == "behaviour":
    assert max(k1) < 1e-5, k1
  else:
    assert min(k1) > 1e-4, k1
