"""`TrainState`: everything the train step reads and writes, as one pytree."""

import functools
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from jax.sharding import Mesh

from rlx import policy
from rlx.train import _config, _mesh, _optimizer, _placement


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
  params: Any,
  model_config: Any,
  train_config: ml_collections.ConfigDict,
  mesh: Mesh,
  *,
  optimizer: optax.GradientTransformation | None = None,
) -> TrainState:
  """The `NamedSharding` of every leaf of a `TrainState` on `mesh`.

  Args:
    params: params pytree (arrays or `jax.ShapeDtypeStruct`s; only shapes used).
    model_config: the `rlx.policy.ModelConfig`.
    train_config: the train config (selects the optimizer).
    mesh: a mesh from `make_mesh`.
    optimizer: optional optax transformation replacing `make_optimizer(train_config)`.

  Returns:
    A `TrainState` whose leaves are `NamedSharding`s.
  """
  p_shardings = policy.param_shardings(model_config, mesh)
  optimizer = _resolve_optimizer(optimizer, train_config)
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
  optimizer: optax.GradientTransformation | None = None,
) -> TrainState:
  """A fresh `TrainState` on `mesh`: step 0, sharded params, new optimizer state.

  The state owns its buffers: `params` are copied onto the mesh (never
  aliased), so the donating train step deletes only the state's copy and the
  caller's `params` stay usable (e.g. as the frozen reference policy for
  `compute_logprobs`).

  Args:
    params: the initial policy params (e.g. from `rlx.policy.init_params` or
      `load_hf_checkpoint`), host or device arrays; checked against
      `model_config` (`rlx.policy.check_params`).
    model_config: the `rlx.policy.ModelConfig` of `params`.
    train_config: the train config (`get_config()`).
    mesh: a mesh from `make_mesh`.
    rng: a PRNG key (raw u32[2] or typed); stored as raw key data.
    optimizer: optional optax transformation replacing
      `make_optimizer(train_config)` (pass the same one to `make_train_step`).

  Returns:
    A `TrainState` with every leaf sharded on `mesh` (see
    `train_state_shardings`).

  Raises:
    ValueError: `params` do not match `model_config` (every missing, unexpected
      or mis-shaped leaf is named), or `rng` is not a PRNG key.
  """
  _config.validate_config(train_config)
  policy.check_params(params, model_config)
  check_like(params, _abstract_params(model_config), "params", "the params of `model_config`")
  rng = jnp.asarray(rng)
  if jnp.issubdtype(rng.dtype, jax.dtypes.prng_key):
    rng = jax.random.key_data(rng)
  if rng.dtype != jnp.uint32 or rng.ndim != 1:
    raise ValueError(f"`rng` must be a PRNG key (u32[2] or typed key), got {rng.dtype}{rng.shape}.")
  optimizer = _resolve_optimizer(optimizer, train_config)
  shardings = train_state_shardings(params, model_config, train_config, mesh, optimizer=optimizer)
  params = _placement.copy_to(params, shardings.params)
  opt_state = jax.jit(optimizer.init, out_shardings=shardings.opt_state)(params)
  rep = _mesh.replicated(mesh)
  return TrainState(
    step=_placement.put(np.zeros((), np.int32), rep),
    params=params,
    opt_state=opt_state,
    rng=_placement.put(np.asarray(rng), rep),
    skipped=_placement.put(np.zeros((), np.int32), rep),
  )


def abstract_train_state(
  model_config: Any,
  train_config: ml_collections.ConfigDict,
  mesh: Mesh,
  *,
  optimizer: optax.GradientTransformation | None = None,
) -> TrainState:
  """A `TrainState` of `jax.ShapeDtypeStruct`s (with shardings on `mesh`).

  The restore target for a checkpoint: shapes come from
  `rlx.policy.init_params` traced abstractly (nothing allocated), shardings
  from `mesh`, so a checkpoint written on any mesh restores onto this one.

  Args:
    model_config: the `rlx.policy.ModelConfig`.
    train_config: the train config (selects the optimizer).
    mesh: the mesh to restore onto.
    optimizer: optional optax transformation replacing `make_optimizer(train_config)`.

  Returns:
    A `TrainState` whose leaves are `jax.ShapeDtypeStruct` with `.sharding`.
  """
  params = _abstract_params(model_config)
  optimizer = _resolve_optimizer(optimizer, train_config)
  shapes = TrainState(
    step=jax.ShapeDtypeStruct((), jnp.int32),
    params=params,
    opt_state=jax.eval_shape(optimizer.init, params),
    rng=jax.eval_shape(lambda: jax.random.PRNGKey(0)),
    skipped=jax.ShapeDtypeStruct((), jnp.int32),
  )
  shardings = train_state_shardings(params, model_config, train_config, mesh, optimizer=optimizer)
  return jax.tree.map(
    lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, shardings
  )


def _resolve_optimizer(
  optimizer: optax.GradientTransformation | None, train_config: ml_collections.ConfigDict
) -> optax.GradientTransformation:
  if optimizer is None:
    return _optimizer.make_optimizer(train_config)
  if not (
    callable(getattr(optimizer, "init", None)) and callable(getattr(optimizer, "update", None))
  ):
    raise ValueError(
      "`optimizer` must be an optax.GradientTransformation (with init and update), got "
      f"{type(optimizer).__name__}."
    )
  return optimizer


def check_like(tree: Any, abstract: Any, name: str, what: str) -> None:
  """Raises ValueError naming the first leaf of `tree` whose structure, shape or dtype differs.

  Args:
    tree: a pytree of arrays (e.g. a `TrainState`).
    abstract: the expected pytree of `jax.ShapeDtypeStruct`s.
    name: the argument's name in messages (e.g. "state").
    what: what `abstract` is, for the structure message.
  """
  _mesh.check_same_structure(tree, abstract, name, what)
  check_not_deleted(tree, name)
  for (path, leaf), want in zip(
    jax.tree_util.tree_leaves_with_path(tree), jax.tree.leaves(abstract), strict=True
  ):
    shape, dtype = tuple(np.shape(leaf)), getattr(leaf, "dtype", None)
    if dtype is None:
      dtype = np.asarray(leaf).dtype
    if shape != tuple(want.shape) or dtype != want.dtype:
      raise ValueError(
        f"`{name}{jax.tree_util.keystr(path)}` is {dtype}{list(shape)}, expected "
        f"{want.dtype}{list(want.shape)} (another model config, dtype or optimizer?)."
      )


def check_not_deleted(tree: Any, name: str) -> None:
  """Raises ValueError naming the first deleted (donated) array of `tree`."""
  for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
    if isinstance(leaf, jax.Array) and leaf.is_deleted():
      raise ValueError(
        f"`{name}{jax.tree_util.keystr(path)}` was deleted: its buffers were donated to a "
        "train step (which donates its input state); use the state the step returned."
      )


def _abstract_params(model_config: Any) -> Any:
  return jax.eval_shape(functools.partial(policy.init_params, model_config), jax.random.PRNGKey(0))
