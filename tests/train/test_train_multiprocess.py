"""Two processes joined by jax.distributed (CPU gloo) train and checkpoint like one process."""

import json
import os
import socket
import subprocess
import sys

import numpy as np
import train_testlib as tl

from rlx import train

HERE = os.path.dirname(os.path.abspath(__file__))


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def test_two_processes_match_one_process(tmp_path):
  steps = 2
  port = _free_port()
  env = dict(os.environ)
  env["XLA_FLAGS"] = (
    "--xla_force_host_platform_device_count=2 " + os.environ.get("RLX_TEST_XLA_FLAGS", "")
  ).strip()
  env["JAX_PLATFORMS"] = "cpu"
  procs = [
    subprocess.Popen(
      [
        sys.executable,
        os.path.join(HERE, "multiprocess_worker.py"),
        str(port),
        "2",
        str(i),
        str(steps),
        str(tmp_path / f"out{i}.json"),
        str(tmp_path / "ckpt"),
      ],
      env=env,
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
      text=True,
    )
    for i in range(2)
  ]
  outputs = []
  try:
    for p in procs:
      outputs.append(p.communicate(timeout=600)[0])
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
  for p, output in zip(procs, outputs, strict=True):
    assert p.returncode == 0, output[-4000:]
  got = [json.loads((tmp_path / f"out{i}.json").read_text()) for i in range(2)]
  # Replicated (device-computed) metrics agree across processes (no host-timed
  # metrics by default: dispatch is asynchronous).
  assert "step_time_s" not in got[0][0]
  assert got[0] == got[1]
  single, want = tl.run_steps("single", steps)
  for g, w in zip(got[0], want, strict=True):
    for name in ("loss", "policy_loss", "grad_norm", "param_norm", "entropy"):
      np.testing.assert_allclose(g[name], w[name], rtol=1e-5, err_msg=name)
    assert g["tokens"] == w["tokens"] and g["skipped"] == 0
  # The checkpoint both processes wrote together restores in this one process.
  m, cfg, _, _ = tl.fns("single")
  with train.Checkpointer(tmp_path / "ckpt") as ckpt:
    restored = ckpt.restore(train.abstract_train_state(tl.model_config(), cfg, m))
  assert restored.step == steps and restored.data_cursor == {"next_batch": steps}
  for got_leaf, want_leaf in zip(
    tl.host_params(restored.state), tl.host_params(single), strict=True
  ):
    np.testing.assert_allclose(got_leaf, want_leaf, atol=1e-5)
