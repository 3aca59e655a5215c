"""Device meshes and the shardings of params, optimizer state and batches.

The mesh always has three axes, in this order: `("data", "fsdp", "tensor")`
(the naming of MaxText / big_vision meshes). Params and the optimizer state that mirrors
them are sharded over "fsdp" and "tensor" by `rlx.policy.partition_rules`;
batches are sharded along their first (sequence) dimension over
`("data", "fsdp")`, so every device of a data/fsdp group sees a distinct
slice of the batch and FSDP gathers the weights it needs for its slice.
"""

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
import optax
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from rlx import policy
from rlx._mesh_axes import BATCH_AXES, DATA_AXIS, FSDP_AXIS, MESH_AXES, TENSOR_AXIS


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
  sizes = {DATA_AXIS: data, FSDP_AXIS: fsdp, TENSOR_AXIS: tensor}
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
      kept = tuple(a for a in entry if a != FSDP_AXIS)
      return kept if len(kept) > 1 else (kept[0] if kept else None)
    return None if entry == FSDP_AXIS else entry

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
  check_same_structure(params, params_shardings, "params", "params_shardings")
  abstract_params = jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, p.dtype), params)
  abstract_state = jax.eval_shape(optimizer.init, abstract_params)
  return optax.tree_utils.tree_map_params(
    optimizer,
    lambda _, sharding: sharding,
    abstract_state,
    params_shardings,
    transform_non_params=lambda _: replicated(mesh),
  )


def check_same_structure(a: Any, b: Any, a_name: str, b_name: str) -> None:
  """Raises ValueError naming both trees if `a` and `b` differ in pytree structure."""
  sa, sb = jax.tree.structure(a), jax.tree.structure(b)
  if sa != sb:
    raise ValueError(f"`{a_name}` has tree structure {sa}, but `{b_name}` has {sb}.")
