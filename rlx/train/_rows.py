"""Strided split of a batch into parts that stay on their devices, and its inverse.

A batch `[B, ...]` sharded over the batch axes holds a contiguous block of
rows per device. Part k of `split_rows(x, parts)` takes rows k, k + parts,
k + 2 * parts, ..., so every device's block contributes to every part and no
row moves between devices (no resharding per micro- or mini-batch).
"""

from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from rlx.train import _mesh


def split_rows(data: Any, parts: int, mesh: Mesh) -> Any:
  """Every leaf `[B, ...]` -> `[parts, B / parts, ...]`; part k holds rows k, k + parts, ...

  Args:
    data: pytree of arrays with a common leading dimension B divisible by `parts`.
    parts: number of parts (static int >= 1).
    mesh: the mesh; the second (row) dimension of the result is constrained
      to the batch axes.

  Returns:
    The pytree with each leaf `[parts, B / parts, ...]`.
  """

  def one(x):
    x = x.reshape((x.shape[0] // parts, parts) + x.shape[1:])
    x = jnp.swapaxes(x, 0, 1)
    spec = PartitionSpec(None, _mesh.BATCH_AXES, *([None] * (x.ndim - 2)))
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))

  return jax.tree.map(one, data)


def merge_rows(x: jax.Array) -> jax.Array:
  """Inverse of `split_rows` for one array: `[parts, rows, ...]` -> `[rows * parts, ...]`."""
  return jnp.swapaxes(x, 0, 1).reshape((x.shape[0] * x.shape[1],) + x.shape[2:])
