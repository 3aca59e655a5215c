"""Subprocess half of the resume test: restore a checkpoint, train on, save params.

Usage: python resume_worker.py CKPT_DIR LAYOUT NUM_STEPS OUT_NPZ
Restores the latest checkpoint onto LAYOUT's mesh, continues from its data
cursor for NUM_STEPS train steps and writes the final params (and every leaf
of the restored TrainState, as `restored_<i>`) to OUT_NPZ.
"""

import os
import sys

os.environ["XLA_FLAGS"] = (
  "--xla_force_host_platform_device_count=8 " + os.environ.get("RLX_TEST_XLA_FLAGS", "")
).strip()
os.environ["JAX_PLATFORMS"] = "cpu"
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import numpy as np  # noqa: E402
import train_testlib as tl  # noqa: E402

from rlx import train  # noqa: E402


def main(ckpt_dir: str, layout: str, num_steps: int, out: str) -> None:
  m, cfg, _, _ = tl.fns(layout)
  target = train.abstract_train_state(tl.model_config(), cfg, m)
  with train.Checkpointer(ckpt_dir) as ckpt:
    restored = ckpt.restore(target)
  start = restored.data_cursor["next_batch"]
  assert int(restored.state.step) == restored.step == start, (restored.step, start)
  np.testing.assert_array_equal(restored.extra["buffer"], np.arange(6).reshape(2, 3))
  # Everything restored (rng, skipped count, optimizer state), saved for comparison.
  restored_leaves = [np.asarray(x) for x in jax.tree.leaves(jax.device_get(restored.state))]
  state, _ = tl.run_steps(layout, num_steps, start=start, state=restored.state)
  restored = {f"restored_{i}": leaf for i, leaf in enumerate(restored_leaves)}
  np.savez(out, *tl.host_params(state), step=int(state.step), **restored)


if __name__ == "__main__":
  main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4])
