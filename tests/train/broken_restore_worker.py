"""Subprocess half of the broken-step restore test: restores past a truncated newest step.

Usage: python broken_restore_worker.py CKPT_DIR
On a 2 x 2 x 2 mesh (many shards, many concurrent reads) saves steps 1 and 2
into six sub-directories, truncates every data file of step 2 to half its
size and restores each; prints `restored <step>` and every warning, one per
line. Run in its own process because the noise of the orphaned reads
(asyncio tracebacks on stderr) shows reliably only outside pytest.
"""

import os
import pathlib
import sys
import warnings

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = (
  "--xla_force_host_platform_device_count=8 " + os.environ.get("RLX_TEST_XLA_FLAGS", "")
).strip()
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import train_testlib as tl  # noqa: E402

from rlx import train  # noqa: E402


def main(ckpt_dir: str) -> None:
  m = tl.mesh("d2f2t2")
  cfg = tl.train_config()
  state = tl.init_state(m, cfg)
  target = train.abstract_train_state(tl.model_config(), cfg, m)
  for i in range(6):  # the noise came from a race: about half the directories printed it
    directory = pathlib.Path(ckpt_dir) / str(i)
    with train.Checkpointer(directory) as ckpt:
      for step in (1, 2):
        ckpt.save(step, state, data_cursor=step)
    for p in (directory / "2" / "state").rglob("*"):
      if p.is_file() and p.parent.name == "d":
        p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])
    with warnings.catch_warnings(record=True) as record:
      warnings.simplefilter("always")
      with train.Checkpointer(directory) as ckpt:
        print(f"restored {ckpt.restore(target).step}", flush=True)
    for w in record:
      print(f"warning: {w.message}", flush=True)


if __name__ == "__main__":
  main(sys.argv[1])
