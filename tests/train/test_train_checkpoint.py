"""Orbax checkpoints: bit-exact resume in a new process, re-sharding, keep-last-N, async."""

import dataclasses
import os
import re
import shutil
import subprocess
import sys
import warnings

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
import train_testlib as tl

from rlx import train

HERE = os.path.dirname(os.path.abspath(__file__))


def _worker_env():
  env = dict(os.environ)
  env["XLA_FLAGS"] = (
    "--xla_force_host_platform_device_count=8 " + os.environ.get("RLX_TEST_XLA_FLAGS", "")
  ).strip()
  env["JAX_PLATFORMS"] = "cpu"
  return env


def test_resume_in_new_process_is_bitwise_equal(tmp_path):
  layout, total, k = "d2f2t2", 4, 2
  straight, _ = tl.run_steps(layout, total)
  partial, _ = tl.run_steps(layout, k)
  with train.Checkpointer(tmp_path / "ckpt", max_to_keep=2) as ckpt:
    assert ckpt.save(
      k, partial, data_cursor={"next_batch": k}, extra={"buffer": np.arange(6).reshape(2, 3)}
    )
  out = tmp_path / "params.npz"
  proc = subprocess.run(
    [
      sys.executable,
      os.path.join(HERE, "resume_worker.py"),
      str(tmp_path / "ckpt"),
      layout,
      str(total - k),
      str(out),
    ],
    env=_worker_env(),
    capture_output=True,
    text=True,
    timeout=600,
  )
  assert proc.returncode == 0, proc.stderr[-4000:]
  resumed = np.load(out)
  assert int(resumed["step"]) == total
  want = tl.host_params(straight)
  saved = [np.asarray(x) for x in jax.tree.leaves(jax.device_get(partial))]
  assert len(resumed.files) == len(want) + 1 + len(saved)
  for i, leaf in enumerate(want):
    np.testing.assert_array_equal(resumed[f"arr_{i}"], leaf)
  # The whole state round-tripped bitwise: step, params, optimizer state, rng, skipped.
  restored = [resumed[f"restored_{i}"] for i in range(len(saved))]
  for got, want_leaf in zip(restored, saved, strict=True):
    assert got.dtype == want_leaf.dtype
    np.testing.assert_array_equal(got, want_leaf)


def test_restore_onto_another_mesh_and_keep_training(tmp_path):
  mc = tl.model_config()
  src_state, _ = tl.run_steps("d2f2t2", 1)
  saved_params = tl.host_params(src_state)
  saved_opt = [np.asarray(x) for x in jax.tree.leaves(jax.device_get(src_state.opt_state))]
  with train.Checkpointer(tmp_path) as ckpt:
    ckpt.save(1, src_state, data_cursor=1)
  states = {}
  with train.Checkpointer(tmp_path) as ckpt:
    for layout in ("data8", "single"):
      m, cfg, _, _ = tl.fns(layout)
      target = train.abstract_train_state(mc, cfg, m)
      restored = ckpt.restore(target)
      assert restored.step == 1 and restored.data_cursor == 1 and restored.extra is None
      state = states[layout] = restored.state
      for got, want in zip(tl.host_params(state), saved_params, strict=True):
        np.testing.assert_array_equal(got, want)
      opt = [np.asarray(x) for x in jax.tree.leaves(jax.device_get(state.opt_state))]
      for got, want in zip(opt, saved_opt, strict=True):
        np.testing.assert_array_equal(got, want)
      for leaf, abstract in zip(jax.tree.leaves(state), jax.tree.leaves(target), strict=True):
        assert leaf.sharding.is_equivalent_to(abstract.sharding, leaf.ndim)
  # One more step on the new mesh matches one more step on the original one.
  on_new, _ = tl.run_steps("data8", 1, start=1, state=states["data8"])
  on_old, _ = tl.run_steps("d2f2t2", 1, start=1, state=src_state)
  for got, want in zip(tl.host_params(on_new), tl.host_params(on_old), strict=True):
    np.testing.assert_allclose(got, want, atol=1e-5)


def test_async_save_keep_last_n_and_donation(tmp_path):
  m, cfg, step_fn, logprobs = tl.fns("single")
  state = tl.init_state(m, cfg)
  snapshots = {}
  with train.Checkpointer(tmp_path, max_to_keep=2, async_save=True) as ckpt:
    for i in range(4):
      snapshots[i] = tl.host_params(state)
      assert ckpt.save(i, state, data_cursor={"next_batch": i}, extra={"i": np.array(i)})
      # The next step donates `state` while the save may still be writing.
      state, _ = step_fn(state, tl.prepare(tl.make_batch(i), m, state, logprobs))
    ckpt.wait_until_finished()
    assert ckpt.all_steps() == [2, 3] and ckpt.latest_step() == 3
    target = train.abstract_train_state(tl.model_config(), cfg, m)
    for step in (2, 3):
      restored = ckpt.restore(target, step=step)
      assert restored.data_cursor == {"next_batch": step}
      assert int(restored.extra["i"]) == step and int(restored.state.step) == step
      for got, want in zip(tl.host_params(restored.state), snapshots[step], strict=True):
        np.testing.assert_array_equal(got, want)
    with pytest.raises(FileNotFoundError, match="step 0"):
      ckpt.restore(target, step=0)
  with train.Checkpointer(tmp_path / "empty") as empty:
    with pytest.raises(FileNotFoundError, match="No checkpoint"):
      empty.restore(target)


def test_extra_holds_bfloat16_arrays(tmp_path):
  """E.g. the best params of a bfloat16 model, kept as host arrays."""
  m, cfg, _, _ = tl.fns("single")
  best = np.arange(6, dtype=np.float32).reshape(2, 3).astype(jax.numpy.bfloat16)
  with train.Checkpointer(tmp_path) as ckpt:
    assert ckpt.save(1, tl.init_state(m, cfg), extra={"best": best})
  with train.Checkpointer(tmp_path) as ckpt:
    restored = ckpt.restore(train.abstract_train_state(tl.model_config(), cfg, m))
  assert restored.extra["best"].dtype == best.dtype
  np.testing.assert_array_equal(restored.extra["best"], best)


def _damage(step_dir, how: str) -> None:
  """Corrupts a saved step's state item: truncated array files, or garbage everywhere."""
  files = [p for p in (step_dir / "state").rglob("*") if p.is_file()]
  if how == "truncate":
    data = [p for p in files if p.parent.name == "d"]
    assert data
    for p in data:
      p.write_bytes(p.read_bytes()[:16])
  else:
    rng = np.random.default_rng(0)
    for p in files:
      p.write_bytes(rng.integers(0, 256, p.stat().st_size, dtype=np.uint8).tobytes())


@pytest.mark.parametrize("how", ["truncate", "garbage"])
def test_unreadable_newest_step_falls_back_and_is_replaced(tmp_path, how):
  m, cfg, _, _ = tl.fns("single")
  state = tl.init_state(m, cfg)
  target = train.abstract_train_state(tl.model_config(), cfg, m)
  with train.Checkpointer(tmp_path) as ckpt:
    for step in (1, 2):
      ckpt.save(step, state, data_cursor=step)
  _damage(tmp_path / "2", how)
  with train.Checkpointer(tmp_path) as ckpt:
    with pytest.warns(UserWarning, match=r"step 2 in .* cannot be read") as record:
      restored = ckpt.restore(target)
    assert restored.step == 1 and restored.data_cursor == 1
    assert any("Restored checkpoint step 1" in str(w.message) for w in record)
    for w in record:  # one short line each, no TensorStore spec dumps
      assert "\n" not in str(w.message) and len(str(w.message)) < 700
    with pytest.raises(train.CheckpointError, match=r"step 2 in .* cannot be read") as info:
      ckpt.restore(target, step=2)
    assert info.value.step == 2 and "\n" not in str(info.value)
    # The run resumes from step 1 and saves step 2 again over the broken one.
    with pytest.warns(UserWarning, match="Deleting unreadable checkpoint step 2"):
      assert ckpt.save(2, state, data_cursor="again")
  with train.Checkpointer(tmp_path) as ckpt:
    assert ckpt.restore(target).data_cursor == "again"


def test_a_broken_step_warns_with_the_array_and_without_asyncio_noise(tmp_path):
  """Orbax reads arrays concurrently: the reads still running when one fails are drained."""
  proc = subprocess.run(
    [sys.executable, os.path.join(HERE, "broken_restore_worker.py"), str(tmp_path)],
    env=_worker_env(),
    capture_output=True,
    text=True,
    timeout=600,
  )
  assert proc.returncode == 0, proc.stderr[-4000:]
  lines = proc.stdout.splitlines()
  assert lines.count("restored 1") == 6, proc.stdout
  unreadable = [line for line in lines if "cannot be read (truncated" in line]
  assert len(unreadable) == 6, proc.stdout
  for message in unreadable:
    # The innermost error: the array's path and what is wrong with its file. Every array's
    # files are truncated, so whichever read fails first is named (`step`, `params.embed...`).
    assert re.search(r"array `[a-z_]+(\.[\w.]+)?`: ValueError: OUT_OF_RANGE", message), (
      message
    )  # the whole message: pytest truncates the one-line warning
    assert "Requested byte range" in message and "local file" not in message
    assert "Encountered error while reading" not in message and "tensorstore_spec" not in message
  assert "Event loop is closed" not in proc.stderr, proc.stderr[-4000:]


def test_retention_keeps_good_steps_over_broken_ones(tmp_path):
  m, cfg, _, _ = tl.fns("single")
  state = tl.init_state(m, cfg)
  target = train.abstract_train_state(tl.model_config(), cfg, m)
  with train.Checkpointer(tmp_path, max_to_keep=None) as ckpt:
    for step in (1, 2, 3):
      ckpt.save(step, state, data_cursor=step)
  _damage(tmp_path / "2", "truncate")
  _damage(tmp_path / "3", "truncate")
  with train.Checkpointer(tmp_path, max_to_keep=2) as ckpt:
    with pytest.warns(UserWarning, match="cannot be read"):
      assert ckpt.restore(target).step == 1
    ckpt.save(4, state, data_cursor=4)
    ckpt.wait_until_finished()
    # Keep-last-2 of the READABLE steps: 1 and 4; the broken 2 and 3 go.
    assert ckpt.all_steps() == [1, 4]
    ckpt.save(5, state, data_cursor=5)
    ckpt.wait_until_finished()
    assert ckpt.all_steps() == [4, 5]


def test_saves_that_cannot_happen_raise(tmp_path, monkeypatch):
  m, cfg, _, _ = tl.fns("single")
  state = tl.init_state(m, cfg)
  with train.Checkpointer(tmp_path, save_interval_steps=2) as ckpt:
    assert ckpt.save(2, state)
    assert ckpt.save(3, state) is False  # skipped by save_interval_steps, as documented
    with pytest.raises(ValueError, match="step 2 already exists"):
      ckpt.save(2, state, force=True)
    with pytest.raises(ValueError, match="step 0 is older than the newest kept step 2"):
      ckpt.save(0, state, force=True)
    with pytest.raises(ValueError, match="`step` must be an int >= 0"):
      ckpt.save(-4, state)
    with pytest.raises(ValueError, match="`data_cursor` must be JSON-serialisable"):
      ckpt.save(4, state, data_cursor={"rng": np.random.default_rng(0)})
    with pytest.raises(ValueError, match=r"`extra\['name'\]` must be a numeric array"):
      ckpt.save(4, state, extra={"name": "run-1", "n": np.arange(2)})
    # Orbax's CheckpointManager.save returns False when it declines a save.
    monkeypatch.setattr(ocp.CheckpointManager, "save", lambda *a, **k: False)
    with pytest.raises(train.CheckpointError, match="orbax declined to save checkpoint step 4"):
      ckpt.save(4, state)
    monkeypatch.undo()
    assert ckpt.all_steps() == [2]
  (tmp_path / "a_file").write_text("")
  with pytest.raises(ValueError, match="exists and is not a directory"):
    train.Checkpointer(tmp_path / "a_file")


def test_restore_onto_another_config_names_the_leaves(tmp_path):
  m, cfg, _, _ = tl.fns("single")
  with train.Checkpointer(tmp_path) as ckpt:
    ckpt.save(1, tl.init_state(m, cfg))
    other = dataclasses.replace(tl.model_config(), hidden_size=48)
    with pytest.raises(ValueError, match=r"does not match `target`.*embed/embedding is \[64, 32\]"):
      ckpt.restore(train.abstract_train_state(other, cfg, m))


def test_a_run_killed_mid_save_leaves_only_loadable_steps(tmp_path):
  ckpt_dir = tmp_path / "ckpt"
  proc = subprocess.run(
    [sys.executable, os.path.join(HERE, "killed_save_worker.py"), str(ckpt_dir)],
    env=_worker_env(),
    capture_output=True,
    text=True,
    timeout=600,
  )
  assert proc.returncode == -9 and "save of step 2 started" in proc.stdout, proc.stderr[-4000:]
  leftovers = [p.name for p in ckpt_dir.iterdir() if p.name not in ("1",)]
  assert leftovers and all("tmp" in name for name in leftovers), leftovers  # interrupted
  m, cfg, _, _ = tl.fns("single")
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # nothing unreadable to warn about
    with train.Checkpointer(ckpt_dir) as ckpt:
      assert ckpt.all_steps() == [1]
      restored = ckpt.restore(train.abstract_train_state(tl.model_config(), cfg, m))
  assert restored.step == 1 and restored.data_cursor == {"next_batch": 1}


@pytest.mark.parametrize("damage", ["missing extra", "missing state", "garbage cursor"])
def test_other_damage_to_the_newest_step_also_falls_back(tmp_path, damage):
  m, cfg, _, _ = tl.fns("single")
  state = tl.init_state(m, cfg)
  with train.Checkpointer(tmp_path) as ckpt:
    for step in (1, 2):
      ckpt.save(step, state, data_cursor=step, extra={"buffer": np.arange(step + 2)})
  step_dir = tmp_path / "2"
  if damage == "missing extra":  # would otherwise restore silently without the buffer
    shutil.rmtree(step_dir / "extra")
  elif damage == "missing state":
    shutil.rmtree(step_dir / "state")
  else:
    (step_dir / "cursor" / "metadata").write_text("{not json")
  with train.Checkpointer(tmp_path) as ckpt:
    with pytest.warns(UserWarning, match=r"step 2 in .* cannot be read"):
      restored = ckpt.restore(train.abstract_train_state(tl.model_config(), cfg, m))
  assert restored.step == 1 and list(restored.extra["buffer"]) == [0, 1, 2]
