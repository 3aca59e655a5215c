"""FSDP (ZeRO-3) param gathering for the train step's forward.

Params, gradients and optimizer state are stored sharded over the "fsdp" mesh
axis (Rajbhandari et al. 2020, https://arxiv.org/abs/1910.02054; PyTorch FSDP,
https://arxiv.org/abs/2304.11277). Each forward all-gathers the weights it
needs, the gradient of the gather being a reduce-scatter; here by sharding
constraints that XLA's SPMD partitioner turns into collectives.
"""

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import ml_collections
from jax.sharding import Mesh

from rlx._mesh_axes import FSDP_AXIS
from rlx.train import _mesh, _spec


class FsdpGather(NamedTuple):
  """How the forward gathers FSDP-sharded params (see `fsdp_gather_fns`).

  Attributes:
    params_fn: applied to the whole params tree before the forward (None =
      identity).
    layer_params_fn: passed to `rlx.policy.token_logprobs`, applied to each
      decoder layer's params inside the layer scan (None = identity).
  """

  params_fn: Callable[[Any], Any] | None
  layer_params_fn: Callable[[Any], Any] | None


NO_GATHER = FsdpGather(None, None)


def fsdp_gather_fns(
  model_config: Any, cfg: ml_collections.ConfigDict | _spec.StepSpec, mesh: Mesh
) -> FsdpGather:
  """The param-gathering functions of the train step's forward (ZeRO-3 / FSDP).

  - `gather_fsdp_params` and `gather_fsdp_per_layer` (default): the
    embedding / final norm / LM head are all-gathered over "fsdp" before the
    forward, and each decoder layer's slice of the stacked `[L, ...]` weights
    inside the policy's layer scan (`rlx.policy` `layer_params_fn`), so
    about one layer's gathered weights are live at a time (the backward pass
    re-gathers each layer, and each layer's gradient is reduced back to its
    shard inside the loop: a reduce-scatter where the backend has one, an
    all-reduce + slice on CPU).
  - `gather_fsdp_per_layer=False`: the whole tree is gathered before the
    forward (gathered weights of every layer live at once).
  - `gather_fsdp_params=False`: no constraint; XLA's sharding propagation
    chooses (it may replicate the batch instead of gathering weights).
  Tensor ("tensor" axis) sharding is kept in every case. On a mesh whose
  "fsdp" axis has size 1 nothing needs gathering and both functions are None.

  Args:
    model_config: the `rlx.policy.ModelConfig`.
    cfg: the train config, or its `StepSpec` (`gather_fsdp_params`,
      `gather_fsdp_per_layer`).
    mesh: the mesh the params live on.

  Returns:
    An `FsdpGather`.
  """
  if not cfg.gather_fsdp_params or mesh.shape.get(FSDP_AXIS, 1) == 1:
    return NO_GATHER  # nothing is sharded over "fsdp"
  gathered = _mesh.gathered_param_shardings(model_config, mesh)
  if not cfg.gather_fsdp_per_layer:
    return FsdpGather(lambda p: jax.lax.with_sharding_constraint(p, gathered), None)
  top = {k: v for k, v in gathered.items() if k != "layers"}
  layer = _mesh.gathered_layer_shardings(model_config, mesh)

  def params_fn(params):
    rest = {k: params[k] for k in top}
    return dict(params, **jax.lax.with_sharding_constraint(rest, top))

  def layer_params_fn(layer_params):
    return jax.lax.with_sharding_constraint(layer_params, layer)

  return FsdpGather(params_fn, layer_params_fn)
