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

FP8 rollout params (`quantize_linears`: each decoder linear kernel an
`Fp8Kernel(values, scale)`) get the same layout with `fp8_linears=True`: the
FP8 `values` take the dense kernel's spec, and each dim of the 128x128 block
`scale` is sharded on the same axis only where every shard of the values
holds whole blocks (the per-shard width is a multiple of 128), so a device's
scales are exactly those of its values; elsewhere that scale dim is
replicated (the scales are 128x128 times smaller than the values). This is
the layout of blockwise-FP8 weights under tensor parallelism in vLLM
(`Fp8LinearMethod.create_weights`, https://github.com/vllm-project/vllm:
`weight_scale_inv` is split with the weight when the shard is block-aligned).
"""

from typing import Any

import jax
from jax.sharding import Mesh, PartitionSpec

from rlx._mesh_axes import FSDP_AXIS, TENSOR_AXIS
from rlx.policy._config import ModelConfig, check_model_config
from rlx.policy._model import FP8_BLOCK, LINEAR_KERNELS, Fp8Kernel, Params, _is_shape, param_shapes

FSDP = FSDP_AXIS
TENSOR = TENSOR_AXIS

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


def partition_rules(config: ModelConfig, mesh: Mesh, *, fp8_linears: bool = False) -> Params:
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
    fp8_linears: True: the tree of `quantize_linears(params)` (FP8 rollout
      params): every decoder linear `kernel` is an `Fp8Kernel(values=spec,
      scale=spec)`, values as the dense kernel, each scale dim on the same
      axis where the shards hold whole 128-blocks, else replicated.

  Returns:
    A pytree with the structure of the params and `PartitionSpec` leaves.
  """
  check_model_config(config)
  if not isinstance(mesh, Mesh):
    raise ValueError(f"`mesh` must be a jax.sharding.Mesh, got {type(mesh).__name__}.")
  if not isinstance(fp8_linears, bool):
    raise ValueError(f"`fp8_linears` must be a bool, got {fp8_linears!r}.")
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
  specs = jax.tree_util.tree_map_with_path(spec, shapes, is_leaf=_is_shape)
  if fp8_linears:
    for group, name in LINEAR_KERNELS:
      leaf = specs["layers"][group][name]
      shape = shapes["layers"][group][name]["kernel"]
      leaf["kernel"] = Fp8Kernel(
        values=leaf["kernel"], scale=_block_scale_spec(leaf["kernel"], shape, mesh)
      )
  return specs


def _block_scale_spec(values: PartitionSpec, shape: tuple[int, ...], mesh: Mesh) -> PartitionSpec:
  """The spec of an `Fp8Kernel.scale` [..., ceil(K/128), ceil(N/128)] for values sharded `values`.

  Leading (layer) dims copy the values' spec; a block dim keeps the values'
  axis only if each shard of the values holds whole blocks.
  """
  axes = list(values) + [None] * (len(shape) - len(values))
  out = axes[:-2]
  for dim, axis in zip(shape[-2:], axes[-2:], strict=True):
    size = _axis_size(mesh, axis) if axis is not None else 1
    out.append(axis if axis is not None and (dim // size) % FP8_BLOCK == 0 else None)
  return PartitionSpec(*out)


def param_shardings(config: ModelConfig, mesh: Mesh, *, fp8_linears: bool = False) -> Any:
  """`NamedSharding`s for the params: `partition_rules` (same `fp8_linears`) bound to `mesh`."""
  return jax.tree_util.tree_map(
    lambda s: jax.sharding.NamedSharding(mesh, s),
    partition_rules(config, mesh, fp8_linears=fp8_linears),
    is_leaf=lambda x: isinstance(x, PartitionSpec),
  )
