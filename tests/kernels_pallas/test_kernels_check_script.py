"""experiments/check_kernels.py runs end to end on CPU (tiny shapes, Pallas interpret mode)."""

import importlib.util
import math
import pathlib

import pytest

_PATH = pathlib.Path(__file__).resolve().parents[2] / "experiments" / "check_kernels.py"


@pytest.fixture(scope="module")
def check_kernels():
  spec = importlib.util.spec_from_file_location("check_kernels", _PATH)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_smoke_run_produces_accurate_rows(check_kernels):
  cfg = dict(
    smoke=True, context_lengths=[20], batch_sizes=[2], kv_dtypes=["float8_e4m3fn"],
    num_kv_heads=1, gqa=2, head_dim=64, page_size=16, pages_per_compute_block=2,
    matmul_shapes=[(16, 256, 128)], iters=1, repeats=1, max_kv_gib=1.0, command="pytest",
  )  # fmt: skip
  rows, header = check_kernels.run_checks(cfg)
  kernels = [r.kernel for r in rows]
  assert kernels == [
    "paged_attention[pallas_gpu]",
    "paged_attention[pallas_tpu]",
    "paged_attention[xla]",
    "fp8_blockwise_matmul",
    "jnp.dot bf16",
  ]
  for r in rows:
    assert not r.note.startswith("FAILED"), r.note
    assert math.isfinite(r.rel_err) and r.rel_err < 1e-2, r
    assert r.time_us > 0
  table = check_kernels.format_table(rows, header)
  assert "copy bandwidth" in table and table.count("\n|") == len(rows) + 2
