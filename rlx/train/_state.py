"""`TrainState`: everything the train step reads and writes, as one pytree."""

import functools
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from jax.sharding import Mesh

from rlx import policy
from rlx.train import _config, _mesh, _optimizer


@flax.struct.dataclass
class TrainState:
  """The state threaded through `train_step` (a pytree; checkpointed whole).

  Attributes:
    step: i32[] number of `train_step` calls done (one call = one rollout
      batch = ppo_epochs x mini_batches optimizer updates).
    params: the policy params pytree, sharded by `rlx.policy.partition_rules`.
    opt_state: the optax state, each param-shaped leaf sharded like its param.
    rng: u32[2] raw PRNG key; the step's randomness is `fold_in(rng, step)`,
      so it never changes and resuming reproduces the same shuffles.
    skipped: i32[] optimizer updates skipped so far for a non-finite loss or
      gradient.
  """

  step: jax.Array
  params: Any
  opt_state: Any
  rng: jax.Array
  skipped: jax.Array


def train_state_shardings(
  params: Any, model_config: Any, train_config: ml_collections.ConfigDict, mesh: Mesh
) -> TrainState:
  """The `NamedSharding` of every leaf of a `TrainState` on `mesh`.

  Args:
    params: params pytree (arrays or `jax.ShapeDtypeStruct`s; only shapes used).
    model_config: the `rlx.policy.ModelConfig`.
    train_config: the train config (selects the optimizer).
    mesh: a mesh from `make_mesh`.

  Returns:
    A `TrainState` whose leaves are `NamedSharding`s.
  """
  p_shardings = _mesh.param_shardings(model_config, mesh)
  optimizer = _optimizer.make_optimizer(train_config)
  rep = _mesh.replicated(mesh)
  return TrainState(
    step=rep,
    params=p_shardings,
    opt_state=_mesh.opt_state_shardings(optimizer, params, p_shardings),
    rng=rep,
    skipped=rep,
  )


def create_train_state(
  params: Any,
  model_config: Any,
  train_config: ml_collections.ConfigDict,
  mesh: Mesh,
  *,
  rng: jax.Array,
) -> TrainState:
  """A fresh `TrainState` on `mesh`: step 0, sharded params, new optimizer state.

  Args:
    params: the initial policy params (e.g. from `rlx.policy.init_params` or
      `load_hf_checkpoint`), host or device arrays.
    model_config: the `rlx.policy.ModelConfig` of `params`.
    train_config: the train config (`get_config()`).
    mesh: a mesh from `make_mesh`.
    rng: a PRNG key (raw u32[2] or typed); stored as raw key data.

  Returns:
    A `TrainState` with every leaf sharded on `mesh` (see
    `train_state_shardings`).
  """
  _config.validate_config(train_config)
  rng = jnp.asarray(rng)
  if jnp.issubdtype(rng.dtype, jax.dtypes.prng_key):
    rng = jax.random.key_data(rng)
  if rng.dtype != jnp.uint32 or rng.ndim != 1:
    raise ValueError(f"`rng` must be a PRNG key (u32[2] or typed key), got {rng.dtype}{rng.shape}.")
  shardings = train_state_shardings(params, model_config, train_config, mesh)
  params = _mesh.shard_params(params, model_config, mesh)
  optimizer = _optimizer.make_optimizer(train_config)
  opt_state = jax.jit(optimizer.init, out_shardings=shardings.opt_state)(params)
  rep = _mesh.replicated(mesh)
  return TrainState(
    step=_mesh._put(np.zeros((), np.int32), rep),
    params=params,
    opt_state=opt_state,
    rng=_mesh._put(np.asarray(rng), rep),
    skipped=_mesh._put(np.zeros((), np.int32), rep),
  )


def abstract_train_state(
  model_config: Any, train_config: ml_collections.ConfigDict, mesh: Mesh
) -> TrainState:
  """A `TrainState` of `jax.ShapeDtypeStruct`s (with shardings on `mesh`).

  The restore target for a checkpoint: shapes come from
  `rlx.policy.init_params` traced abstractly (nothing allocated), shardings
  from `mesh`, so a checkpoint written on any mesh restores onto this one.

  Args:
    model_config: the `rlx.policy.ModelConfig`.
    train_config: the train config (selects the optimizer).
    mesh: the mesh to restore onto.

  Returns:
    A `TrainState` whose leaves are `jax.ShapeDtypeStruct` with `.sharding`.
  """
  params = jax.eval_shape(
    functools.partial(policy.init_params, model_config), jax.random.PRNGKey(0)
  )
  optimizer = _optimizer.make_optimizer(train_config)
  shapes = TrainState(
    step=jax.ShapeDtypeStruct((), jnp.int32),
    params=params,
    opt_state=jax.eval_shape(optimizer.init, params),
    rng=jax.eval_shape(lambda: jax.random.PRNGKey(0)),
    skipped=jax.ShapeDtypeStruct((), jnp.int32),
  )
  shardings = train_state_shardings(params, model_config, train_config, mesh)
  return jax.tree.map(
    lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, shardings
  )
