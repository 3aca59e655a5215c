"""Placing params and batches on a mesh, on one process or across several.

Params follow `rlx.policy.param_shardings`; batch arrays are split along their
first (sequence) dimension over `BATCH_AXES`. Multi-process placement uses
`jax.make_array_from_callback` / `jax.make_array_from_process_local_data`
(https://jax.readthedocs.io/en/latest/multi_process.html).
"""

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding

from rlx import policy
from rlx.train import _mesh


def shard_params(params: Any, model_config: Any, mesh: Mesh) -> Any:
  """Places `params` on `mesh` by the policy's partition rules.

  A leaf that already has its target sharding is returned as is (no copy);
  `create_train_state` copies, so the train state never aliases the caller's
  buffers.

  Args:
    params: the params pytree (host or device arrays, any sharding), checked
      against the config by `rlx.policy.check_params`.
    model_config: the `rlx.policy.ModelConfig` the params belong to.
    mesh: the target mesh.

  Returns:
    The same pytree with every leaf a `jax.Array` sharded on `mesh`.
  """
  policy.check_params(params, model_config)
  shardings = policy.param_shardings(model_config, mesh)
  _mesh.check_same_structure(params, shardings, "params", "rlx.policy.param_shardings")
  return jax.tree.map(put, params, shardings)


def copy_to(tree: Any, shardings: Any) -> Any:
  """Places `tree` with `shardings` in NEW buffers (never aliasing an input leaf)."""
  return jax.tree.map(lambda x, s: put(x, s, copy=True), tree, shardings)


def shard_batch(batch: Mapping[str, Any], mesh: Mesh, *, process_local: bool = False) -> dict:
  """Places a batch dict on `mesh`, dim 0 of every array over ("data", "fsdp").

  Args:
    batch: dict of arrays, each with the batch (sequence) dimension first,
      e.g. `tokens i32[B, S]`, `advantages f32[B]`.
    mesh: the mesh to place the batch on.
    process_local: if False, every process passes the same GLOBAL batch and
      keeps its own slices of it; if True, each process passes only ITS rows
      (`B / jax.process_count()` of them, process order) and the global batch
      is their concatenation.

  Returns:
    A dict with the same keys of sharded `jax.Array`s (global shapes).

  Raises:
    ValueError: arrays disagree on the batch size, a batch is empty (B = 0 or
      a zero-size dimension), or the (global) batch size is not divisible by
      the number of batch shards.
  """
  if not isinstance(batch, Mapping) or not batch:
    raise ValueError(f"`batch` must be a non-empty dict of arrays, got {type(batch)}.")
  sizes = {k: np.shape(v)[0] if np.ndim(v) else None for k, v in batch.items()}
  if any(s is None for s in sizes.values()) or len(set(sizes.values())) != 1:
    raise ValueError(f"All batch arrays need the same leading batch size, got {sizes}.")
  for key, value in batch.items():
    check_not_empty(np.shape(value), f"batch['{key}']")
  local_size = next(iter(sizes.values()))
  global_size = local_size * (jax.process_count() if process_local else 1)
  shards = _mesh.batch_axis_size(mesh)
  if global_size % shards:
    raise ValueError(
      f"Global batch size {global_size} must be divisible by the number of batch shards "
      f"data x fsdp = {shards}."
    )
  out = {}
  for key, value in batch.items():
    sharding = _mesh.batch_sharding(mesh, np.ndim(value))
    if process_local:
      out[key] = jax.make_array_from_process_local_data(sharding, np.asarray(value))
    else:
      out[key] = put(value, sharding)
  return out


def place_batch(batch: Mapping[str, Any], mesh: Mesh) -> dict:
  """Like `shard_batch` (global data), but leaves correctly sharded arrays alone.

  Used on entry of the jitted step functions, so callers may pass numpy
  arrays, arrays on one device, or arrays already from `shard_batch`.
  """
  shards = _mesh.batch_axis_size(mesh)
  out = {}
  for key, value in batch.items():
    shape = np.shape(value)
    if not shape:
      raise ValueError(f"Batch array `{key}` must have a leading batch dimension, got a scalar.")
    check_not_empty(shape, f"batch['{key}']")
    if shape[0] % shards:
      raise ValueError(
        f"Batch array `{key}` has {shape[0]} rows, not divisible by the number of batch "
        f"shards data x fsdp = {shards}."
      )
    sharding = _mesh.batch_sharding(mesh, len(shape))
    if isinstance(value, jax.Array) and value.sharding.is_equivalent_to(sharding, value.ndim):
      out[key] = value
    else:
      out[key] = put(value, sharding)
  return out


def check_not_empty(shape: tuple[int, ...], name: str) -> None:
  """Raises ValueError naming `name` if an array of `shape` has a zero-size dimension."""
  if any(d == 0 for d in shape):
    dims = ", ".join(str(d) for d in shape)
    raise ValueError(
      f"`{name}` is empty (shape [{dims}]): a batch needs at least one sequence (B >= 1) "
      "and one position (S >= 1)."
    )


def put(x: Any, sharding: NamedSharding, *, copy: bool = False) -> jax.Array:
  """Places `x` with `sharding`; works when the mesh spans several processes.

  With `copy=True` the result never shares a buffer with `x` (a jax.Array
  input that already has the sharding is copied, not returned).
  """
  if isinstance(x, jax.Array) and x.is_fully_addressable and jax.process_count() == 1:
    out = jax.device_put(x, sharding, may_alias=False if copy else None)
    if copy and shares_buffer(out, x):
      # `may_alias=False` is not honoured for every resharding: placing a
      # one-device array replicated on a mesh reuses its buffer for that
      # device's replica. `out` now has `sharding`, so a jitted copy applies.
      out = jax.jit(jnp.copy, out_shardings=sharding)(out)
    return out
  if isinstance(x, jax.Array) and not x.is_fully_addressable:
    # Already global: reshard under jit (no host round trip); jnp.copy keeps
    # jit from forwarding the input buffer when the sharding is unchanged.
    return jax.jit(jnp.copy if copy else (lambda y: y), out_shardings=sharding)(x)
  host = np.asarray(x)
  return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def shares_buffer(a: Any, b: Any) -> bool:
  """Whether two `jax.Array`s have a device buffer in common (False for non-arrays)."""
  if not (isinstance(a, jax.Array) and isinstance(b, jax.Array)):
    return False
  if a.is_deleted() or b.is_deleted():
    return False
  buffers = {(s.device, s.data.unsafe_buffer_pointer()) for s in a.addressable_shards}
  return any((s.device, s.data.unsafe_buffer_pointer()) in buffers for s in b.addressable_shards)
