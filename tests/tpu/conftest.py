"""Deviceless TPU compiles: compile-only TPU devices from libtpu on a CPU-only machine.

`jax.experimental.topologies.get_topology_desc` describes a TPU slice without its
chips; a `jax.jit` traced with `jax.ShapeDtypeStruct`s sharded on a mesh over those
devices lowers and compiles with the real TPU compiler, and its
`memory_analysis()` reports per-chip HBM use
(https://docs.jax.dev/en/latest/aot.html). The tests skip only where libtpu cannot
be imported (`pip install -e ".[tpu]"`).

libtpu reads its host environment when the first topology is built: the metadata
server look-ups are switched off and a single local worker is declared, so nothing
is queried over the network.
"""

import os

os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v5litepod-4")
os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
# Compile-only: no chips to guard, so parallel test workers may each load libtpu.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import importlib.util  # noqa: E402 (after the libtpu environment)

import jax  # noqa: E402
import pytest  # noqa: E402

LIBTPU_MISSING = importlib.util.find_spec("libtpu") is None


@pytest.fixture(scope="session")
def v5e_2x2():
  """The 4 compile-only devices of a TPU v5e 2x2 slice."""
  if LIBTPU_MISSING:
    pytest.skip('libtpu is not importable: deviceless TPU compiles need pip install -e ".[tpu]"')
  from jax.experimental import topologies  # noqa: PLC0415

  return topologies.get_topology_desc(topology_name="v5e:2x2", platform="tpu").devices


@pytest.fixture(scope="session")
def lower_and_compile():
  """`fn(traced, device) -> (lowered, compiled)` for a `jax.stages.Traced` built for TPU.

  Mosaic (Pallas TPU) kernels outside a `shard_map` ask the default device for the
  TPU generation while lowering; on a CPU host that is the CPU, so the lowering
  runs with `device` (a compile-only TPU device) as the default device.
  """

  def fn(traced, device):
    with jax.default_device(device):
      lowered = traced.lower()
      return lowered, lowered.compile()

  return fn
