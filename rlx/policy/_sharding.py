"""Partition rules: a `PartitionSpec` for every parameter over mesh axes "fsdp" and "tensor".

Megatron-style tensor parallelism (Shoeybi et al. 2019,
https://arxiv.org/abs/1909.08053) on the "tensor" axis — q/k/v and gate/up
kernels split their output (heads / intermediate) dim, o/down kernels their
input dim, the vocabulary dim of embedding and LM head is split — plus ZeRO-3
/ FSDP sharding of the other (model-width) dim on the "fsdp" axis. The
stacked layer axis and all norm scales are replicated. A dim falls back to
replication for an axis that is missing from the mesh, has size 1, or does
not divide it; attention projections are tensor-sharded only when the number
of (KV) heads divides the axis size, so a head is never split.
"""

from typing import Any

import jax
from jax.sharding import Mesh, PartitionSpec

from rlx.policy._config import ModelConfig, check_model_config
from rlx.policy._model import Params, _is_shape, param_shapes

FSDP = "fsdp"
TENSOR = "tensor"

# Per-leaf logical layout: one entry per dim, an axis name or None.
# Keys are the leaf paths inside params with the "layers" prefix removed.
_LAYOUTS: dict[str, tuple[str | None, ...]] = {
  "embed/embedding": (TENSOR, FSDP),
  "lm_head/kernel": (FSDP, TENSOR),
  "final_norm/scale": (None,),
  "input_norm/scale": (None, None),
  "post_attn_norm/scale": (None, None),
  "attn/q_norm/scale": (None, None),
  "attn/k_norm/scale": (None, None),
  "attn/q_proj/kernel": (None, FSDP, TENSOR),
  "attn/k_proj/kernel": (None, FSDP, TENSOR),
  "attn/v_proj/kernel": (None, FSDP, TENSOR),
  "attn/o_proj/kernel": (None, TENSOR, FSDP),
  "attn/q_proj/bias": (None, TENSOR),
  "attn/k_proj/bias": (None, TENSOR),
  "attn/v_proj/bias": (None, TENSOR),
  "attn/o_proj/bias": (None, None),
  "mlp/gate_proj/kernel": (None, FSDP, TENSOR),
  "mlp/up_proj/kernel": (None, FSDP, TENSOR),
  "mlp/down_proj/kernel": (None, TENSOR, FSDP),
}


def _axis_size(mesh: Mesh, axis: str) -> int:
  return int(mesh.shape[axis]) if axis in mesh.shape else 1


def partition_rules(config: ModelConfig, mesh: Mesh) -> Params:
  """PartitionSpecs for every parameter of `config` on `mesh` (see module docstring).

  Layout (`L` stacked layers; "fsdp" = F, "tensor" = T):
    embedding [V, D] -> (T, F); lm_head [D, V] -> (F, T);
    q/k/v kernels [L, D, N*Dh] -> (None, F, T); o kernel [L, H*Dh, D] -> (None, T, F);
    gate/up [L, D, I] -> (None, F, T); down [L, I, D] -> (None, T, F);
    q/k/v biases -> (None, T); norms and o bias replicated.

  Args:
    config: model config.
    mesh: a `jax.sharding.Mesh`; axes other than "fsdp"/"tensor" (e.g.
      "data") are not used for parameters.

  Returns:
    A pytree with the structure of the params and `PartitionSpec` leaves.
  """
  check_model_config(config)
  if not isinstance(mesh, Mesh):
    raise ValueError(f"`mesh` must be a jax.sharding.Mesh, got {type(mesh).__name__}.")
  tensor_size = _axis_size(mesh, TENSOR)
  heads = {
    "q_proj": config.num_heads,
    "k_proj": config.num_kv_heads,
    "v_proj": config.num_kv_heads,
    "o_proj": config.num_heads,
  }

  def spec(path, shape: tuple[int, ...]) -> PartitionSpec:
    keys = [p.key for p in path]
    name = "/".join(keys[1:] if keys[0] == "layers" else keys)
    layout = _LAYOUTS[name]
    axes: list[str | None] = []
    for dim, axis in zip(shape, layout, strict=True):
      size = _axis_size(mesh, axis) if axis is not None else 1
      ok = axis is not None and size > 1 and dim % size == 0
      if ok and axis == TENSOR and keys[1] == "attn" and keys[2] in heads:
        ok = heads[keys[2]] % tensor_size == 0
      axes.append(axis if ok else None)
    return PartitionSpec(*axes)

  shapes = param_shapes(config)
  return jax.tree_util.tree_map_with_path(spec, shapes, is_leaf=_is_shape)


def param_shardings(config: ModelConfig, mesh: Mesh) -> Any:
  """`NamedSharding`s for the params: `partition_rules` bound to `mesh`."""
  return jax.tree_util.tree_map(
    lambda s: jax.sharding.NamedSharding(mesh, s),
    partition_rules(config, mesh),
    is_leaf=lambda x: isinstance(x, PartitionSpec),
  )
