"""rlx.train: meshes, the train state, the single sharded train step, checkpoints.

Typical use (see `make_train_step` for the batch contract):

  mesh = rlx.train.make_mesh(data=2, fsdp=2, tensor=2)
  config = rlx.train.get_config(); config.loss = "gspo"
  state = rlx.train.create_train_state(params, model_config, config, mesh, rng=key)
  train_step = rlx.train.make_train_step(model_config, config, mesh)
  compute_logprobs = rlx.train.make_compute_logprobs(model_config, config, mesh)
  batch = rlx.train.shard_batch(batch, mesh)
  batch["old_logp"] = compute_logprobs(state, batch)
  state, metrics = train_step(state, batch)      # asynchronous dispatch
  print(train_step.throughput.read())            # tokens/s since the last read

Inside another jitted function (e.g. a whole RL iteration) trace the pure
`train_step.step_fn(state, batch)` and `compute_logprobs.logprobs_fn(params,
batch)`: the same computations without host checks. `make_step_fn` builds that
pure step alone; `StepSpec.from_config(config)` is the config validated and
resolved once (`train_step.spec`; `as_step_spec` for a builder's `(config,
spec)` arguments), and `schedule_of(spec.optimizer)` its learning-rate schedule.

FSDP (ZeRO-3): params, gradients and optimizer state are stored sharded over
the "fsdp" mesh axis; the forward all-gathers the embedding / LM head before
it and each decoder layer inside the policy's layer scan (one layer at a time,
re-gathered in the backward pass), see `fsdp_gather_fns`.

A program that does not fit in device memory raises `OutOfMemoryError`: the
compiler's line plus the settings that lower the memory (remat,
micro-batches, fsdp / tensor, ...) with their current values.
`explain_out_of_memory(program, advice)` gives the same error around any code
(e.g. an ahead-of-time `.lower(...).compile()`).
"""

from rlx._memory import OutOfMemoryError, explain_out_of_memory, is_out_of_memory
from rlx._mesh_axes import (
  BATCH_AXES,
  MESH_AXES,
)
from rlx.policy import (
  param_shardings,
)
from rlx.train._checkpoint import (
  Checkpointer,
  CheckpointError,
  Restored,
)
from rlx.train._config import (
  get_config,
  resolve_agg,
  validate_config,
)
from rlx.train._distributed import (
  initialize_distributed,
  to_host,
)
from rlx.train._gather import (
  FsdpGather,
  fsdp_gather_fns,
)
from rlx.train._host import (
  NonFiniteError,
  TrainStep,
)
from rlx.train._logprobs import (
  ComputeLogprobs,
  make_compute_logprobs,
)
from rlx.train._mesh import (
  batch_axis_size,
  batch_sharding,
  gathered_layer_shardings,
  gathered_param_shardings,
  make_mesh,
  opt_state_shardings,
  replicated,
)
from rlx.train._optimizer import (
  make_optimizer,
  make_schedule,
  schedule_of,
  update_counter,
  updates_per_step,
)
from rlx.train._placement import (
  copy_to,
  shard_batch,
  shard_params,
)
from rlx.train._spec import (
  StepSpec,
  as_step_spec,
)
from rlx.train._state import (
  TrainState,
  abstract_train_state,
  create_train_state,
  train_state_shardings,
)
from rlx.train._step import (
  make_step_fn,
  make_train_step,
)
from rlx.train._throughput import (
  ThroughputMeter,
)

__all__ = (
  "abstract_train_state",
  "as_step_spec",
  "BATCH_AXES",
  "batch_axis_size",
  "batch_sharding",
  "CheckpointError",
  "Checkpointer",
  "ComputeLogprobs",
  "create_train_state",
  "explain_out_of_memory",
  "fsdp_gather_fns",
  "FsdpGather",
  "gathered_layer_shardings",
  "gathered_param_shardings",
  "get_config",
  "initialize_distributed",
  "is_out_of_memory",
  "make_compute_logprobs",
  "make_mesh",
  "make_optimizer",
  "make_schedule",
  "make_step_fn",
  "make_train_step",
  "MESH_AXES",
  "NonFiniteError",
  "OutOfMemoryError",
  "opt_state_shardings",
  "param_shardings",
  "replicated",
  "resolve_agg",
  "Restored",
  "schedule_of",
  "shard_batch",
  "shard_params",
  "copy_to",
  "StepSpec",
  "ThroughputMeter",
  "to_host",
  "train_state_shardings",
  "TrainState",
  "TrainStep",
  "update_counter",
  "updates_per_step",
  "validate_config",
)
