"""Subprocess half of the killed-save test: a run killed while a checkpoint is being written.

Usage: python killed_save_worker.py CKPT_DIR
Saves step 1 (waits for it), starts the asynchronous save of step 2 with a
large extra item and kills itself (SIGKILL) while the files are written.
"""

import os
import signal
import sys

os.environ["JAX_PLATFORMS"] = "cpu"
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402
import train_testlib as tl  # noqa: E402

from rlx import train  # noqa: E402


def main(ckpt_dir: str) -> None:
  m = tl.mesh("single")
  cfg = tl.train_config()
  state = tl.init_state(m, cfg)
  ckpt = train.Checkpointer(ckpt_dir, async_save=True)
  ckpt.save(1, state, data_cursor={"next_batch": 1})
  ckpt.wait_until_finished()
  big = np.random.default_rng(0).random((64, 1024, 1024), dtype=np.float32)  # 256 MiB
  ckpt.save(2, state, data_cursor={"next_batch": 2}, extra={"big": big})
  print("save of step 2 started", flush=True)
  os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
  main(sys.argv[1])
