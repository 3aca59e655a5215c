"""Multi-process (multi-host) setup and host transfer of replicated results."""

from typing import Any

import jax
import numpy as np


def initialize_distributed(
  coordinator_address: str,
  num_processes: int,
  process_id: int,
  *,
  cpu_collectives: str | None = "gloo",
  local_device_ids: Any = None,
) -> None:
  """Joins a multi-process JAX run (`jax.distributed.initialize`).

  Call once per process before any other JAX call. Afterwards `jax.devices()`
  lists the devices of all processes, `make_mesh` spans them, and the train
  step's collectives run across processes. On CPU, cross-process collectives
  need an implementation (`cpu_collectives="gloo"`); on GPU/TPU it is ignored.

  Args:
    coordinator_address: "host:port" of process 0's coordinator service.
    num_processes: total number of processes.
    process_id: this process's index in [0, num_processes).
    cpu_collectives: CPU collectives implementation ("gloo"/"mpi"), or None to
      leave JAX's default.
    local_device_ids: optional restriction of this process's local devices.

  Raises:
    ValueError: `process_id` is out of range or `num_processes` < 1.
  """
  if num_processes < 1 or not 0 <= process_id < num_processes:
    raise ValueError(
      f"Need num_processes >= 1 and 0 <= process_id < num_processes, got "
      f"num_processes={num_processes}, process_id={process_id}."
    )
  if cpu_collectives is not None:
    jax.config.update("jax_cpu_collectives_implementation", cpu_collectives)
  jax.distributed.initialize(
    coordinator_address=coordinator_address,
    num_processes=num_processes,
    process_id=process_id,
    local_device_ids=local_device_ids,
  )


def to_host(tree: Any) -> Any:
  """Fetches a pytree of (replicated or fully addressable) arrays to numpy.

  Works in multi-process runs, where a replicated output (e.g. the train
  step's metrics) is not fully addressable but every process holds a full
  copy: the copy on the first local device is read. For sharded arrays
  spanning processes use `jax.experimental.multihost_utils` instead.

  Args:
    tree: pytree of `jax.Array`s (or numpy / Python values, returned as numpy).

  Returns:
    The same pytree with numpy leaves.

  Raises:
    ValueError: a leaf is sharded across processes (not replicated).
  """

  def one(x):
    if not isinstance(x, jax.Array) or x.is_fully_addressable:
      return np.asarray(x)
    if not x.is_fully_replicated:
      raise ValueError(
        f"Array of shape {x.shape} with sharding {x.sharding} spans processes and is not "
        "replicated; gather it with jax.experimental.multihost_utils."
      )
    return np.asarray(x.addressable_data(0))

  return jax.tree.map(one, tree)
