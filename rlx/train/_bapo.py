"""BAPO inside the step: adaptive clip bounds from a no-gradient forward of each mini-batch.

Xi et al. 2025, "BAPO: Stabilizing Off-Policy Reinforcement Learning for LLMs
via Balanced Policy Optimization with Adaptive Clipping" (reference
implementation https://github.com/WooooDyy/BAPO).
Before each optimizer update the current policy's log-probs of the mini-batch
are computed (micro-batched, no gradient), `rlx.objectives.bapo_clip_bounds`
adapts [c_low, c_high], and the bounds reach the loss through the clip
keywords its registry spec declares (`PolicyLossSpec.clip_keywords`).
"""

from typing import Any

import jax
from jax.sharding import Mesh

from rlx import objectives
from rlx.train import _forward, _gather, _spec


def bapo_clip_kwargs(
  params: Any,
  mini: dict,
  model_config: Any,
  spec: _spec.StepSpec,
  mesh: Mesh,
  gather: _gather.FsdpGather,
) -> tuple[dict, dict]:
  """The loss's clip keywords from BAPO bounds of one mini-batch, and their metrics.

  Args:
    params: the current params.
    mini: the mini-batch dict (tokens, loss_mask, advantages, old_logp, ...).
    model_config: the `rlx.policy.ModelConfig`.
    spec: the resolved train config (`bapo_kwargs`, micro_batches, loss).
    mesh: the mesh.
    gather: the `FsdpGather` of the forward.

  Returns:
    `(clip_kwargs, metrics)`: the keywords of `spec.loss.clip_keywords` to pass
    to the loss, and f32 scalars bapo_c_low, bapo_c_high, bapo_positive_share.
  """
  logp = _forward.microbatched_logprobs(params, mini, model_config, spec, mesh, gather)
  bounds = objectives.bapo_clip_bounds(
    jax.lax.stop_gradient(logp),
    mini["old_logp"],
    mini["advantages"],
    mini["loss_mask"],
    **spec.bapo_kwargs,
  )
  clip_keywords = spec.loss.clip_keywords
  clip = {k: v for k, v in bounds.clip_kwargs().items() if k in clip_keywords}
  metrics = {
    "bapo_c_low": bounds.c_low,
    "bapo_c_high": bounds.c_high,
    "bapo_positive_share": bounds.positive_share,
  }
  return clip, metrics
