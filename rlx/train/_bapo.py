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
import ml_collections
from jax.sharding import Mesh

from rlx import objectives
from rlx.train import _config, _forward, _gather


def bapo_clip_kwargs(
  params: Any,
  mini: dict,
  model_config: Any,
  cfg: ml_collections.ConfigDict,
  mesh: Mesh,
  gather: _gather.FsdpGather,
  spec: objectives.PolicyLossSpec | None = None,
) -> tuple[dict, dict]:
  """The loss's clip keywords from BAPO bounds of one mini-batch, and their metrics.

  Args:
    params: the current params.
    mini: the mini-batch dict (tokens, loss_mask, advantages, old_logp, ...).
    model_config: the `rlx.policy.ModelConfig`.
    cfg: the train config (`bapo_kwargs`, micro_batches, loss).
    mesh: the mesh.
    gather: the `FsdpGather` of the forward.
    spec: the policy loss; None = the registry entry of `cfg.loss`.

  Returns:
    `(clip_kwargs, metrics)`: the keywords of `spec.clip_keywords` to pass to
    the loss, and f32 scalars bapo_c_low, bapo_c_high, bapo_positive_share.
  """
  spec = _config.loss_spec(cfg, spec)
  kwargs = _config.to_kwargs(cfg.bapo_kwargs)
  if "dual_clip" not in spec.clip_keywords:
    kwargs["dual_clip"] = None  # the loss has no dual clip: no token loses its gradient to one
  logp = _forward.microbatched_logprobs(params, mini, model_config, cfg, mesh, gather)
  bounds = objectives.bapo_clip_bounds(
    jax.lax.stop_gradient(logp), mini["old_logp"], mini["advantages"], mini["loss_mask"], **kwargs
  )
  clip = {k: v for k, v in bounds.clip_kwargs().items() if k in spec.clip_keywords}
  metrics = {
    "bapo_c_low": bounds.c_low,
    "bapo_c_high": bounds.c_high,
    "bapo_positive_share": bounds.positive_share,
  }
  return clip, metrics
