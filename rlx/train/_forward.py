"""The policy forward of the train step: token log-probs of a batch dict, FSDP-gathered.

One function serves the differentiated forward of each micro-batch and the
no-gradient forwards (`compute_logprobs`, BAPO's bound search): the same
`rlx.policy.token_logprobs` with the config's temperature, chunking and
gathering, so `old_logp` from `compute_logprobs` is exactly the `logp` the
step differentiates at its first update.
"""

from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from rlx import policy
from rlx.train import _gather, _rows, _spec


def batch_logprobs(
  params: Any,
  data: dict,
  model_config: Any,
  spec: _spec.StepSpec,
  gather: _gather.FsdpGather = _gather.NO_GATHER,
  *,
  unroll: bool = False,
) -> tuple[jax.Array, jax.Array]:
  """`rlx.policy.token_logprobs` on a (micro-)batch dict, FSDP params gathered.

  With gathering (`fsdp_gather_fns`) the activations stay batch-sharded;
  without it XLA may instead keep the weights' model-dim sharding and
  replicate the batch (much more communication).

  Args:
    params: the params pytree.
    data: dict with `tokens i32[B, S]`, `loss_mask bool[B, S]` and optional
      `positions`, `segment_ids` `i32[B, S]`.
    model_config: the `rlx.policy.ModelConfig`.
    spec: the resolved train config (temperature, logprob_chunk_size).
    gather: the `FsdpGather` of the mesh.
    unroll: run the decoder blocks as a Python loop (rlx.policy `unroll`)
      instead of the layer scan; same values.

  Returns:
    `(logp, entropy)`, each `[B, S]`, 0 where `loss_mask` is 0.
  """
  if gather.params_fn is not None:
    params = gather.params_fn(params)
  kwargs = {}
  if spec.logprob_chunk_size:
    kwargs["chunk_size"] = spec.logprob_chunk_size
  return policy.token_logprobs(
    params,
    model_config,
    data["tokens"],
    data["loss_mask"],
    positions=data.get("positions"),
    segment_ids=data.get("segment_ids"),
    temperature=spec.temperature,
    layer_params_fn=gather.layer_params_fn,
    unroll=unroll,
    **kwargs,
  )


def microbatched_logprobs(
  params: Any,
  data: dict,
  model_config: Any,
  spec: _spec.StepSpec,
  mesh: Mesh,
  gather: _gather.FsdpGather = _gather.NO_GATHER,
) -> jax.Array:
  """No-gradient `logp f32[B, S]` of a batch, computed in `spec.micro_batches` parts.

  The parts are the strided row split of `split_rows` (scanned with
  `lax.scan`, so only one part's activations are live), merged back into row
  order.
  """

  def body(_, micro):
    logp, _ = batch_logprobs(params, micro, model_config, spec, gather)
    return None, jax.lax.stop_gradient(logp).astype(jnp.float32)

  _, logp = jax.lax.scan(body, None, _rows.split_rows(data, spec.micro_batches, mesh))
  return _rows.merge_rows(logp)
