"""Device meshes and the shardings of params, optimizer state and batches.

The mesh always has the three axes of contracts.md, in this order:
`("data", "fsdp", "tensor")`. Params and the optimizer state that mirrors
them are sharded over "fsdp" and "tensor" by `rlx.policy.partition_rules`;
batches are sharded along their first (sequence) dimension over
`("data", "fsdp")`, so every device of a data/fsdp group sees a distinct
slice of the batch and FSDP gathers the weights it needs for its slice.
"""

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
import optax
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from rlx import policy

MESH_AXES = ("data", "fsdp", "tensor")
# The batch (sequence) dimension is split over these axes.
BATCH_AXES = ("data", "fsdp")


def make_mesh(
  data: int = -1,
  fsdp: int = 1,
  tensor: int = 1,
  *,
  devices: Sequence[jax.Device] | None = None,
) -> Mesh:
  """Builds a `("data", "fsdp", "tensor")` device mesh.

  `data * fsdp * tensor` must equal the number of devices; at most one size may
  be -1, meaning "all remaining devices". The devices default to
  `jax.devices()`, i.e. every device of every process after
  `jax.distributed.initialize`, so the same call builds a single-CPU mesh, an
  8-fake-device CPU mesh, a GPU node or a multi-host TPU slice. The device
  order comes from `jax.experimental.mesh_utils.create_device_mesh`, which
  places the innermost ("tensor") axis on the fastest interconnect.

  Args:
    data: size of the pure data-parallel axis (params replicated across it).
    fsdp: size of the fully-sharded data-parallel axis (params and optimizer
      state sharded across it, batch split across it too).
    tensor: size of the tensor-parallel axis (matmul dimensions split).
    devices: the devices to use (default: all of `jax.devices()`).

  Returns:
    A `jax.sharding.Mesh` of shape `(data, fsdp, tensor)` with `Auto` axes.

  Raises:
    ValueError: a size is 0 or below -1, more than one size is -1, the sizes do
      not divide / multiply to the device count (the message names both).
  """
  devices = list(jax.devices() if devices is None else devices)
  num_devices = len(devices)
  if num_devices == 0:
    raise ValueError("`devices` is empty.")
  sizes = {"data": data, "fsdp": fsdp, "tensor": tensor}
  for name, size in sizes.items():
    if not isinstance(size, int | np.integer) or (size < 1 and size != -1):
      raise ValueError(f"Mesh axis `{name}` must be a positive int or -1, got {size!r}.")
  free = [name for name, size in sizes.items() if size == -1]
  if len(free) > 1:
    raise ValueError(f"At most one mesh axis may be -1, got {free} ({sizes}).")
  known = int(np.prod([s for s in sizes.values() if s != -1]))
  if free:
    if num_devices % known:
      raise ValueError(
        f"Mesh sizes {sizes} (product of the fixed axes {known}) do not divide "
        f"the device count {num_devices}."
      )
    sizes[free[0]] = num_devices // known
  shape = tuple(int(sizes[name]) for name in MESH_AXES)
  if int(np.prod(shape)) != num_devices:
    raise ValueError(
      f"Mesh sizes data={shape[0]} x fsdp={shape[1]} x tensor={shape[2]} = "
      f"{int(np.prod(shape))} must equal the device count {num_devices}."
    )
  try:
    device_array = mesh_utils.create_device_mesh(shape, devices)
  except (AssertionError, ValueError, NotImplementedError):
    # Topology-aware placement is unavailable for this shape/devices; use order.
    device_array = np.asarray(devices, dtype=object).reshape(shape)
  return Mesh(device_array, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def batch_axis_size(mesh: Mesh) -> int:
  """Number of batch shards: `mesh.shape["data"] * mesh.shape["fsdp"]`."""
  return int(np.prod([mesh.shape[a] for a in BATCH_AXES]))


def replicated(mesh: Mesh) -> NamedSharding:
  """The fully replicated sharding on `mesh`."""
  return NamedSharding(mesh, PartitionSpec())


def batch_sharding(mesh: Mesh, ndim: int) -> NamedSharding:
  """Sharding of a batch array of rank `ndim`: dim 0 over ("data", "fsdp")."""
  if ndim < 1:
    raise ValueError(f"A batch array needs rank >= 1, got rank {ndim}.")
  return NamedSharding(mesh, PartitionSpec(BATCH_AXES, *([None] * (ndim - 1))))


def param_shardings(model_config: Any, mesh: Mesh) -> Any:
  """`NamedSharding`s of the params, from `rlx.policy.partition_rules`.

  Args:
    model_config: an `rlx.policy.ModelConfig`.
    mesh: a mesh from `make_mesh`.

  Returns:
    A pytree with the structure of the params whose leaves are `NamedSharding`.
  """
  specs = policy.partition_rules(model_config, mesh)
  return jax.tree.map(
    lambda spec: NamedSharding(mesh, spec),
    specs,
    is_leaf=lambda x: isinstance(x, PartitionSpec),
  )


def gathered_param_shardings(model_config: Any, mesh: Mesh) -> Any:
  """Param shardings with the "fsdp" axis removed (tensor sharding kept).

  The layout the train step all-gathers the params into for the forward
  (FSDP / ZeRO-3: params, grads and optimizer state are stored sharded over
  "fsdp"; the gradient of the gather is a reduce-scatter): the non-layer
  params before the forward, each decoder layer inside the layer scan
  (`gathered_layer_shardings`), or, with `gather_fsdp_per_layer=False`, the
  whole tree before the forward.

  Args:
    model_config: an `rlx.policy.ModelConfig`.
    mesh: a mesh from `make_mesh`.

  Returns:
    A pytree with the structure of the params whose leaves are `NamedSharding`.
  """

  def drop_fsdp(entry):
    if isinstance(entry, tuple):
      kept = tuple(a for a in entry if a != "fsdp")
      return kept if len(kept) > 1 else (kept[0] if kept else None)
    return None if entry == "fsdp" else entry

  return jax.tree.map(
    lambda spec: NamedSharding(mesh, PartitionSpec(*(drop_fsdp(e) for e in spec))),
    policy.partition_rules(model_config, mesh),
    is_leaf=lambda x: isinstance(x, PartitionSpec),
  )


def gathered_layer_shardings(model_config: Any, mesh: Mesh) -> Any:
  """Shardings of ONE decoder layer's params after the per-layer FSDP gather.

  `gathered_param_shardings(...)["layers"]` without the leading `[L]` axis:
  the layout the train step's `layer_params_fn` constrains each layer slice to
  inside the policy's layer scan (one layer gathered at a time).

  Args:
    model_config: an `rlx.policy.ModelConfig`.
    mesh: a mesh from `make_mesh`.

  Returns:
    A pytree with the structure of `rlx.policy.get_layer(params, i)` whose
    leaves are `NamedSharding`.
  """

  def drop_layer_axis(sharding: NamedSharding) -> NamedSharding:
    spec = tuple(sharding.spec)
    if spec and spec[0] is not None:
      raise ValueError(f"The stacked layer axis must not be sharded, got spec {sharding.spec}.")
    return NamedSharding(mesh, PartitionSpec(*spec[1:]))

  return jax.tree.map(drop_layer_axis, gathered_param_shardings(model_config, mesh)["layers"])


def shard_params(params: Any, model_config: Any, mesh: Mesh) -> Any:
  """Places `params` on `mesh` by the policy's partition rules.

  Args:
    params: the params pytree (host or device arrays, any sharding).
    model_config: the `rlx.policy.ModelConfig` the params belong to.
    mesh: the target mesh.

  Returns:
    The same pytree with every leaf a `jax.Array` sharded on `mesh`.
  """
  shardings = param_shardings(model_config, mesh)
  _check_same_structure(params, shardings, "params", "rlx.policy.partition_rules(config, mesh)")
  return jax.tree.map(_put, params, shardings)


def opt_state_shardings(
  optimizer: optax.GradientTransformation, params: Any, params_shardings: Any
) -> Any:
  """Shardings of `optimizer`'s state: each param-shaped leaf like its param.

  Leaves of the state that mirror a parameter (Adam moments, ...) get that
  parameter's sharding; every other leaf (step counts, scalars) is replicated.
  The state is traced abstractly (`jax.eval_shape`), nothing is allocated.

  Args:
    optimizer: the optax transformation whose state is sharded.
    params: the params pytree (arrays or `jax.ShapeDtypeStruct`s).
    params_shardings: pytree of `NamedSharding`s with the params' structure.

  Returns:
    A pytree of `NamedSharding`s with the optimizer state's structure.
  """
  leaves = jax.tree.leaves(params_shardings)
  if not leaves:
    raise ValueError("`params_shardings` has no leaves.")
  mesh = leaves[0].mesh
  _check_same_structure(params, params_shardings, "params", "params_shardings")
  abstract_params = jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, p.dtype), params)
  abstract_state = jax.eval_shape(optimizer.init, abstract_params)
  return optax.tree_utils.tree_map_params(
    optimizer,
    lambda _, sharding: sharding,
    abstract_state,
    params_shardings,
    transform_non_params=lambda _: replicated(mesh),
  )


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
    ValueError: arrays disagree on the batch size, or the (global) batch size
      is not divisible by the number of batch shards.
  """
  if not isinstance(batch, Mapping) or not batch:
    raise ValueError(f"`batch` must be a non-empty dict of arrays, got {type(batch)}.")
  sizes = {k: np.shape(v)[0] if np.ndim(v) else None for k, v in batch.items()}
  if any(s is None for s in sizes.values()) or len(set(sizes.values())) != 1:
    raise ValueError(f"All batch arrays need the same leading batch size, got {sizes}.")
  local_size = next(iter(sizes.values()))
  global_size = local_size * (jax.process_count() if process_local else 1)
  shards = batch_axis_size(mesh)
  if global_size % shards:
    raise ValueError(
      f"Global batch size {global_size} must be divisible by the number of batch shards "
      f"data x fsdp = {shards}."
    )
  out = {}
  for key, value in batch.items():
    sharding = batch_sharding(mesh, np.ndim(value))
    if process_local:
      out[key] = jax.make_array_from_process_local_data(sharding, np.asarray(value))
    else:
      out[key] = _put(value, sharding)
  return out


def place_batch(batch: Mapping[str, Any], mesh: Mesh) -> dict:
  """Like `shard_batch` (global data), but leaves correctly sharded arrays alone.

  Used on entry of the jitted step functions, so callers may pass numpy
  arrays, arrays on one device, or arrays already from `shard_batch`.
  """
  shards = batch_axis_size(mesh)
  out = {}
  for key, value in batch.items():
    shape = np.shape(value)
    if not shape:
      raise ValueError(f"Batch array `{key}` must have a leading batch dimension, got a scalar.")
    if shape[0] % shards:
      raise ValueError(
        f"Batch array `{key}` has {shape[0]} rows, not divisible by the number of batch "
        f"shards data x fsdp = {shards}."
      )
    sharding = batch_sharding(mesh, len(shape))
    if isinstance(value, jax.Array) and value.sharding.is_equivalent_to(sharding, value.ndim):
      out[key] = value
    else:
      out[key] = _put(value, sharding)
  return out


def _put(x: Any, sharding: NamedSharding) -> jax.Array:
  """Places `x` with `sharding`; works when the mesh spans several processes."""
  if isinstance(x, jax.Array) and x.is_fully_addressable and jax.process_count() == 1:
    return jax.device_put(x, sharding)
  if isinstance(x, jax.Array) and not x.is_fully_addressable:
    # Already global: reshard under jit (no host round trip).
    return jax.jit(lambda y: y, out_shardings=sharding)(x)
  host = np.asarray(x)
  return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def _check_same_structure(a: Any, b: Any, a_name: str, b_name: str) -> None:
  sa, sb = jax.tree.structure(a), jax.tree.structure(b)
  if sa != sb:
    raise ValueError(f"`{a_name}` has tree structure {sa}, but `{b_name}` has {sb}.")
