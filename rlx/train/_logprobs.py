"""`compute_logprobs`: the old / reference log-probs by the step's own forward.

Its `score_norms` gives each row's score-gradient norm (VCPO's baseline weight).
"""

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from jaxtyping import Array, Float, Int

from rlx import _memory, policy
from rlx.train import _batch, _forward, _gather, _mesh, _placement, _rows, _spec, _state
from rlx.train import _memory as _train_memory

_INPUT_KEYS = ("tokens", "loss_mask", "positions", "segment_ids")


@dataclasses.dataclass(frozen=True, eq=False)
class ComputeLogprobs:
  """`compute_logprobs(state_or_params, batch) -> logp f32[B, S]`, from `make_compute_logprobs`.

  Calling it checks the params against the model config
  (`rlx.policy.check_params`) and the batch (keys, shapes, token ids in
  [0, vocab)) on host, then dispatches one jitted, sharded function
  (`jitted`) without waiting for it. Inside another jitted function trace
  `logprobs_fn(params, batch)` instead (pure, no host checks).

  `score_norms(state_or_params, batch) -> f32[B]` gives each row's
  score-gradient norm `||grad_theta sum_s logp[b, s]||` with the same checks
  (pure: `score_norms_fn`).

  Attributes:
    jitted: the jitted, sharded function `(params, inputs) -> logp`.
    logprobs_fn: the pure `logprobs_fn(params, batch) -> logp f32[B, S]`.
    mesh: the mesh of the params and batch.
    model_config: the `rlx.policy.ModelConfig`.
    micro_batches: the forward runs in this many row parts.
    spec: the `StepSpec` it was built from (named in out-of-memory errors).

  A call whose program does not fit in device memory raises
  `rlx.train.OutOfMemoryError`, listing the settings that lower it
  (`memory_advice`).
  """

  jitted: Any
  logprobs_fn: Callable[[Any, Mapping[str, jax.Array]], jax.Array]
  mesh: Mesh
  model_config: Any
  micro_batches: int
  spec: _spec.StepSpec | None = None
  score_norms_fn: Callable[[Any, Mapping[str, jax.Array]], jax.Array] | None = None
  jitted_score_norms: Any = None

  def memory_advice(self, rows: int | None = None) -> tuple[str, ...]:
    """The settings that lower this program's device memory (B = `rows`), current values."""
    return _train_memory.compute_logprobs_advice(self.spec, self.mesh, rows)

  def __call__(self, params: Any, batch: Mapping[str, Any]) -> Float[Array, "B S"]:
    return self._run(self.jitted, "compute_logprobs", params, batch, self.memory_advice)

  def score_norms(self, params: Any, batch: Mapping[str, Any]) -> Float[Array, " B"]:
    """Per-row score-gradient norms `||grad_theta sum_s logp[b, s]||_2`, f32[B].

    The gradient of each row's sequence log-probability (the sum of its
    `logp` over `loss_mask`, the same forward as `__call__`) with respect to
    every parameter, its global L2 norm per row: the `||grad log
    pi(tau_i)||` of VCPO's minimum-variance baseline
    (`rlx.objectives.vcpo_baseline`). One backward pass per row, vectorised
    over the rows of each of the `micro_batches` parts, that never forms a
    params-shaped gradient: each decoder layer's gradient is reduced to its
    squared norm inside the layer scan (`row_score_norms`). So each of the
    `B / micro_batches / (data x fsdp)` rows a device computes at once holds
    the gradient of one (FSDP-gathered) layer at a time plus that of the
    top-level params (the embedding / LM-head gradient [V, D] is dense per
    row); raise `micro_batches` for a big model or vocabulary. A row with no
    loss tokens gets 0.
    """
    return self._run(
      self.jitted_score_norms,
      "compute_logprobs.score_norms",
      params,
      batch,
      self.score_norms_memory_advice,
    )

  def score_norms_memory_advice(self, rows: int | None = None) -> tuple[str, ...]:
    """`memory_advice` for `score_norms` (B = `rows`): its per-row gradients first."""
    return (
      f"train.micro_batches = {self.micro_batches} (now): score_norms holds, per row of a "
      "micro-batch on its device, the gradient of one gathered decoder layer at a time plus "
      "that of the embedding / final norm / LM head ([V, D] per row); more micro-batches hold "
      "fewer rows",
    ) + self.memory_advice(rows)

  def _run(
    self,
    jitted: Any,
    name: str,
    params: Any,
    batch: Mapping[str, Any],
    advice: Callable[[int], tuple[str, ...]],
  ) -> jax.Array:
    if isinstance(params, _state.TrainState):
      params = params.params
    policy.check_params(params, self.model_config)
    _state.check_not_deleted(params, "params")
    check_inputs(batch, self.micro_batches * _mesh.batch_axis_size(self.mesh))
    _batch.check_values(batch, int(self.model_config.vocab_size))
    inputs = {k: batch[k] for k in _INPUT_KEYS if k in batch}
    rows = int(inputs["tokens"].shape[0])
    with _memory.explain_out_of_memory(name, lambda: advice(rows)):
      return jitted(params, _placement.place_batch(inputs, self.mesh))


def check_inputs(batch: Mapping[str, Any], parts: int) -> None:
  """Keys and shapes of a `compute_logprobs` batch (no values are read)."""
  if not isinstance(batch, Mapping) or "tokens" not in batch or "loss_mask" not in batch:
    keys = sorted(batch) if isinstance(batch, Mapping) else type(batch).__name__
    raise ValueError(f"`batch` needs `tokens` and `loss_mask`, got {keys}.")
  shape = _batch.check_token_shaped(batch, _INPUT_KEYS[1:])
  if shape[0] % parts:
    raise ValueError(
      f"Batch size {shape[0]} must be divisible by micro_batches x data x fsdp = {parts}."
    )


def make_compute_logprobs(
  model_config: Any, train_config: ml_collections.ConfigDict, mesh: Mesh
) -> ComputeLogprobs:
  """Builds `compute_logprobs(state_or_params, batch) -> logp f32[B, S]`.

  logp[b, s] = log softmax(logits[b, s-1] / temperature)[tokens[b, s]], 0 at
  s = 0 and where `loss_mask` is 0 — exactly the `logp` the train step
  differentiates (same `rlx.policy.token_logprobs`, temperature, chunking,
  FSDP gathering and shardings), computed without gradients in
  `train_config.micro_batches` row parts. Use it for the anchor `old_logp`
  (with `state`) at the start of an iteration and for `ref_logp` (with the
  frozen reference params, sharded like the policy's via `shard_params`).

  Args:
    model_config: the `rlx.policy.ModelConfig`.
    train_config: the train config (temperature, micro_batches, chunk size,
      FSDP gathering), validated and resolved here (`StepSpec`).
    mesh: the mesh the params and batch live on.

  Returns:
    A `ComputeLogprobs` callable taking (`TrainState` or params, batch dict
    with `tokens i32[B, S]`, `loss_mask [B, S]` and optional `positions`,
    `segment_ids`) and returning f32[B, S] sharded along the batch.
  """
  spec = _spec.StepSpec.from_config(train_config)
  gather = _gather.fsdp_gather_fns(model_config, spec, mesh)
  parts = spec.micro_batches * _mesh.batch_axis_size(mesh)

  def model_inputs(batch: Mapping[str, jax.Array]) -> dict:
    check_inputs(batch, parts)
    mask = batch["loss_mask"]
    inputs = {k: batch[k] for k in _INPUT_KEYS if k in batch}
    inputs["loss_mask"] = mask if mask.dtype == jnp.bool_ else mask != 0
    return inputs

  def logprobs_fn(params: Any, batch: Mapping[str, jax.Array]) -> jax.Array:
    inputs = model_inputs(batch)
    return _forward.microbatched_logprobs(params, inputs, model_config, spec, mesh, gather)

  def score_norms_fn(params: Any, batch: Mapping[str, jax.Array]) -> jax.Array:
    return row_score_norms(params, model_inputs(batch), model_config, spec, mesh, gather)

  batch_sharding = NamedSharding(mesh, PartitionSpec(_mesh.BATCH_AXES))
  in_shardings = (policy.param_shardings(model_config, mesh), batch_sharding)
  return ComputeLogprobs(
    jitted=jax.jit(logprobs_fn, in_shardings=in_shardings, out_shardings=batch_sharding),
    logprobs_fn=logprobs_fn,
    mesh=mesh,
    model_config=model_config,
    micro_batches=spec.micro_batches,
    spec=spec,
    score_norms_fn=score_norms_fn,
    jitted_score_norms=jax.jit(
      score_norms_fn, in_shardings=in_shardings, out_shardings=batch_sharding
    ),
  )


@jax.custom_vjp
def _tap(tree: Any, probe: Float[Array, ""]) -> Any:
  """Identity on `tree`; the cotangent of `probe` is the squared norm of `tree`'s cotangent."""
  del probe
  return tree


def _tap_fwd(tree: Any, probe: Float[Array, ""]) -> tuple[Any, None]:
  del probe
  return tree, None


def _tap_bwd(_, cotangent: Any) -> tuple[None, Float[Array, ""]]:
  # None: a zero cotangent for `tree` (never differentiated here, so nothing is built).
  squares = [
    jnp.sum(jnp.square(c.astype(jnp.float32)))
    for c in jax.tree.leaves(cotangent)
    if jnp.issubdtype(c.dtype, jnp.inexact)
  ]
  return None, sum(squares, jnp.zeros((), jnp.float32))


_tap.defvjp(_tap_fwd, _tap_bwd)


def _tapped_gather(
  gather: _gather.FsdpGather, top_probe: Float[Array, ""], layer_probes: Float[Array, " L"]
) -> _gather.FsdpGather:
  """`gather`, then `_tap`: the top-level params with `top_probe`, layer i with `layer_probes[i]`.

  The top-level params (embedding, final norm, LM head) are tapped once
  before the forward, so a tied embedding's two uses add up before squaring.
  """

  def params_fn(params: Any) -> Any:
    if gather.params_fn is not None:
      params = gather.params_fn(params)
    top = {k: v for k, v in params.items() if k != "layers"}
    return dict(params, **_tap(top, top_probe))

  def layer_params_fn(layer: Any, *, layer_index: Int[Array, ""]) -> Any:
    if gather.layer_params_fn is not None:
      layer = gather.layer_params_fn(layer)
    return _tap(layer, layer_probes[layer_index])

  return _gather.FsdpGather(params_fn, layer_params_fn)


def row_score_norms(
  params: Any,
  inputs: Mapping[str, jax.Array],
  model_config: Any,
  spec: _spec.StepSpec,
  mesh: Mesh,
  gather: _gather.FsdpGather = _gather.NO_GATHER,
) -> Float[Array, " B"]:
  """`||grad_theta sum_s logp[b, s]||_2` of each row, one layer's gradient at a time.

  The row's squared norm is summed from parts: the top-level params and each
  decoder layer go through `_tap` (after their FSDP gather) with a zero
  scalar probe, whose cotangent is the squared norm of that part's gradient,
  and `jax.grad` is taken w.r.t. the probes only, so no params-shaped
  gradient is ever accumulated: the backward pass holds one layer's weight
  cotangent at a time (plus the top-level params', e.g. the dense [V, D]
  embedding cotangent). Vectorised over the rows of each of the
  `spec.micro_batches` row parts, which are scanned.

  Args:
    params: the params pytree.
    inputs: the batch dict of `batch_logprobs` (`loss_mask` bool), [B, S] each.
    model_config: the `rlx.policy.ModelConfig`.
    spec: the resolved train config.
    mesh: the mesh of the params and batch.
    gather: the `FsdpGather` of the mesh.

  Returns:
    f32[B], 0 for a row without loss tokens.
  """

  def sequence_logp(probes, row):
    logp, _ = _forward.batch_logprobs(
      params, row, model_config, spec, _tapped_gather(gather, *probes)
    )
    return jnp.sum(logp.astype(jnp.float32))

  def row_norm(row):
    probes = (jnp.zeros((), jnp.float32), jnp.zeros((model_config.num_layers,), jnp.float32))
    top, layers = jax.grad(sequence_logp)(probes, jax.tree.map(lambda x: x[None], row))
    return jnp.sqrt(top + jnp.sum(layers))

  def body(_, micro):
    return None, jax.lax.stop_gradient(jax.vmap(row_norm)(micro))

  _, norms = jax.lax.scan(body, None, _rows.split_rows(inputs, spec.micro_batches, mesh))
  return _rows.merge_rows(norms)
