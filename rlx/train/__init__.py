"""rlx.train: meshes, the train state, the single sharded train step, checkpoints.

Typical use (see `make_train_step` for the batch contract):

  mesh = rlx.train.make_mesh(data=2, fsdp=2, tensor=2)
  config = rlx.train.get_config(); config.loss = "gspo"
  state = rlx.train.create_train_state(params, model_config, config, mesh, rng=key)
  train_step = rlx.train.make_train_step(model_config, config, mesh)
  compute_logprobs = rlx.train.make_compute_logprobs(model_config, config, mesh)
  batch = rlx.train.shard_batch(batch, mesh)
  batch["old_logp"] = compute_logprobs(state, batch)
  state, metrics = train_step(state, batch)

FSDP (ZeRO-3): params, gradients and optimizer state are stored sharded over
the "fsdp" mesh axis; the forward all-gathers the embedding / LM head before
it and each decoder layer inside the policy's layer scan (one layer at a time,
re-gathered in the backward pass), see `fsdp_gather_fns`.
"""

from rlx.train._checkpoint import (
  Checkpointer,
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
from rlx.train._logprobs import (
  ComputeLogprobs,
  make_compute_logprobs,
)
from rlx.train._mesh import (
  BATCH_AXES,
  MESH_AXES,
  batch_axis_size,
  batch_sharding,
  gathered_layer_shardings,
  gathered_param_shardings,
  make_mesh,
  opt_state_shardings,
  param_shardings,
  replicated,
  shard_batch,
  shard_params,
)
from rlx.train._optimizer import (
  make_optimizer,
  make_schedule,
)
from rlx.train._state import (
  TrainState,
  abstract_train_state,
  create_train_state,
  train_state_shardings,
)
from rlx.train._step import (
  FsdpGather,
  NonFiniteError,
  TrainStep,
  fsdp_gather_fns,
  make_train_step,
)
