"""Orbax checkpoints: bit-exact resume in a new process, re-sharding, keep-last-N, async."""

import os
import subprocess
import sys

import jax
import numpy as np
import pytest
import train_testlib as tl

from rlx import train

HERE = os.path.dirname(os.path.abspath(__file__))


def _worker_env():
  env = dict(os.environ)
  env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
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
