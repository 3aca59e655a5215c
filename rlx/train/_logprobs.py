"""`compute_logprobs`: the old / reference log-probs by the step's own forward."""

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from jaxtyping import Array, Float

from rlx.train import _config, _mesh, _state, _step


class ComputeLogprobs:
  """`compute_logprobs(state_or_params, batch) -> logp f32[B, S]`.

  From `make_compute_logprobs`; runs one jitted, sharded function.
  """

  def __init__(self, jitted: Any, micro_batches: int, mesh: Mesh, param_shardings: Any = None):
    self.jitted = jitted
    self._param_shardings = param_shardings
    self.mesh = mesh
    self._micro_batches = micro_batches
    self._num_shards = _mesh.batch_axis_size(mesh)

  def __call__(self, params: Any, batch: Mapping[str, jax.Array]) -> Float[Array, "B S"]:
    if isinstance(params, _state.TrainState):
      params = params.params
    if self._param_shardings is not None:
      _mesh._check_same_structure(params, self._param_shardings, "params", "the policy's params")
    if "tokens" not in batch or "loss_mask" not in batch:
      raise ValueError(f"`batch` needs `tokens` and `loss_mask`, got keys {sorted(batch)}.")
    tokens = batch["tokens"]
    if len(tokens.shape) != 2:
      raise ValueError(f"`tokens` must be [B, S], got shape {tokens.shape}.")
    for key in ("loss_mask", "positions", "segment_ids"):
      if key in batch and batch[key].shape != tokens.shape:
        raise ValueError(
          f"`{key}` must have the shape of `tokens` {tokens.shape}, got {batch[key].shape}."
        )
    parts = self._micro_batches * self._num_shards
    if tokens.shape[0] % parts:
      raise ValueError(
        f"Batch size {tokens.shape[0]} must be divisible by micro_batches x data x fsdp = {parts}."
      )
    inputs = {
      k: batch[k] for k in ("tokens", "loss_mask", "positions", "segment_ids") if k in batch
    }
    return self.jitted(params, _mesh.place_batch(inputs, self.mesh))


def make_compute_logprobs(
  model_config: Any, train_config: ml_collections.ConfigDict, mesh: Mesh
) -> ComputeLogprobs:
  """Builds `compute_logprobs(state_or_params, batch) -> logp f32[B, S]`.

  logp[b, s] = log softmax(logits[b, s-1] / temperature)[tokens[b, s]], 0 at
  s = 0 and where `loss_mask` is 0 — exactly the `logp` the train step
  differentiates (same `rlx.policy.token_logprobs`, temperature, chunking and
  shardings), computed without gradients in `train_config.micro_batches`
  chunks. Use it for the anchor `old_logp` (with `state`) at the start of an
  iteration and for `ref_logp` (with the frozen reference params, sharded like
  the policy's via `shard_params`).

  Args:
    model_config: the `rlx.policy.ModelConfig`.
    train_config: the train config (temperature, micro_batches, chunk size).
    mesh: the mesh the params and batch live on.

  Returns:
    A `ComputeLogprobs` callable taking (`TrainState` or params, batch dict
    with `tokens i32[B, S]`, `loss_mask [B, S]` and optional `positions`,
    `segment_ids`) and returning f32[B, S] sharded along the batch.
  """
  _config.validate_config(train_config)
  cfg = train_config
  p_shardings = _mesh.param_shardings(model_config, mesh)
  batch_sharding = NamedSharding(mesh, PartitionSpec(_mesh.BATCH_AXES))
  micro_batches = cfg.micro_batches
  gathered = _step.fsdp_gather_fns(model_config, cfg, mesh)

  def fn(params, inputs):
    mask = inputs["loss_mask"]
    inputs = dict(inputs, loss_mask=mask if mask.dtype == jnp.bool_ else mask != 0)
    rows = inputs["tokens"].shape[0] // micro_batches

    def one(x):
      x = jnp.swapaxes(x.reshape((rows, micro_batches) + x.shape[1:]), 0, 1)
      spec = PartitionSpec(None, _mesh.BATCH_AXES, *([None] * (x.ndim - 2)))
      return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))

    def body(_, micro):
      logp, _ = _step._token_logprobs(params, micro, model_config, cfg, gathered)
      return None, logp.astype(jnp.float32)

    _, logp = jax.lax.scan(body, None, jax.tree.map(one, inputs))
    return jnp.swapaxes(logp, 0, 1).reshape(inputs["tokens"].shape)

  jitted = jax.jit(fn, in_shardings=(p_shardings, batch_sharding), out_shardings=batch_sharding)
  return ComputeLogprobs(jitted, micro_batches, mesh, p_shardings)
