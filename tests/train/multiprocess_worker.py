"""One process of the two-process test: jax.distributed on 127.0.0.1, CPU gloo.

Usage: python multiprocess_worker.py PORT NUM_PROCESSES PROCESS_ID NUM_STEPS OUT_JSON CKPT_DIR
Each process has 2 CPU devices; the (data=2, fsdp=2) mesh spans all processes.
Writes the per-step metrics (replicated, so equal on every process) to OUT_JSON
and saves the final state, collectively, as checkpoint NUM_STEPS in CKPT_DIR.
"""

import json
import os
import sys

os.environ["XLA_FLAGS"] = (
  "--xla_force_host_platform_device_count=2 " + os.environ.get("RLX_TEST_XLA_FLAGS", "")
).strip()
os.environ["JAX_PLATFORMS"] = "cpu"
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import train_testlib as tl  # noqa: E402

from rlx import train  # noqa: E402


def main(
  port: int, num_processes: int, process_id: int, num_steps: int, out: str, ckpt_dir: str
) -> None:
  train.initialize_distributed(f"127.0.0.1:{port}", num_processes, process_id)
  assert jax.process_count() == num_processes and len(jax.local_devices()) == 2
  assert len(jax.devices()) == 2 * num_processes
  state, history = tl.run_steps("d2f2", num_steps)
  # The throughput meter reads replicated metrics on every process.
  throughput = tl.fns("d2f2")[2].throughput.read()
  assert throughput["steps"] == num_steps and throughput["loss_tokens_per_second"] > 0
  with train.Checkpointer(ckpt_dir) as ckpt:
    ckpt.save(num_steps, state, data_cursor={"next_batch": num_steps})
  with open(out, "w") as f:
    json.dump([{k: float(v) for k, v in h.items()} for h in history], f)
  jax.distributed.shutdown()


if __name__ == "__main__":
  main(
    int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5], sys.argv[6]
  )
