"""impl="auto" follows where the inputs live; on CPU (any placement, traced or not) it is XLA.

The TPU side (a `jit` over inputs sharded on compile-only TPU devices picks the
Mosaic kernel) is in tests/tpu, which needs libtpu.
"""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from rlx import kernels_pallas


def _platform_under_jit(*args):
  seen = []

  def fn(*xs):
    seen.append(kernels_pallas.arrays_platform(*xs))
    return xs[0]

  jax.jit(fn).trace(*args)
  return seen[0]


def test_concrete_numpy_and_none_inputs_are_cpu():
  x = jnp.ones((4, 8))
  assert kernels_pallas.arrays_platform(x, np.ones(3), None) == "cpu"
  assert kernels_pallas.arrays_platform() == "cpu"
  assert kernels_pallas.resolve_impl("auto", False, kernels_pallas.arrays_platform(x)) == "xla"


def test_traced_inputs_on_a_cpu_mesh_stay_cpu():
  mesh = jax.make_mesh((8,), ("x",), devices=jax.devices()[:8])
  sharded = jax.device_put(jnp.ones((8, 4)), NamedSharding(mesh, PartitionSpec("x")))
  assert _platform_under_jit(sharded) == "cpu"
  spec = jax.ShapeDtypeStruct((8, 4), jnp.float32, sharding=NamedSharding(mesh, PartitionSpec()))
  assert kernels_pallas.arrays_platform(spec) == "cpu"
  assert _platform_under_jit(spec) == "cpu"
  # Single-device tracers name no mesh: the default backend decides.
  assert _platform_under_jit(jax.ShapeDtypeStruct((2,), jnp.float32)) == "cpu"


def test_shard_map_body_is_cpu():
  mesh = jax.make_mesh((8,), ("x",), devices=jax.devices()[:8])
  seen = []

  def body(x):
    seen.append(kernels_pallas.arrays_platform(x))
    return x

  f = jax.shard_map(body, mesh=mesh, in_specs=PartitionSpec("x"), out_specs=PartitionSpec("x"))
  jax.jit(f).trace(jax.device_put(jnp.ones((8, 2)), NamedSharding(mesh, PartitionSpec("x"))))
  assert seen == ["cpu"]
