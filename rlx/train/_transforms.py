"""Whole-batch transforms of the train step: mismatch metrics, M2PO, rollout correction, VCPO.

They depend only on the (old, rollout) log-probs of the SAMPLED tokens, never on
the current params, so they run once per step on the whole batch, before the
epoch / mini-batch loops, and are exact under any batch split. Each is the
`rlx.objectives` function of its method; the step only combines their masks:

  sampled  = loss_mask != 0                       (the tokens the sampler drew)
  mask     = sampled & m2po_mask(old, rollout, sampled)
  weights, mask = rollout_correction(old, rollout, mask, sampled_mask=sampled)
  vcpo     = vcpo_lr_factor(sequence_importance_weights(old, rollout, sampled))

so a sequence-level IS weight is the ratio of the sequence as sampled, even when
M2PO drops some of its tokens from the loss; rejection and veto act on the
tokens M2PO kept.
"""

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from rlx import objectives
from rlx.train import _spec

# Rollout-correction metrics reported under their own stable names instead
# (the same numbers as `rlx.objectives.rollout_mismatch_kl` of the sampled tokens).
_MISMATCH_FIELDS = ("mismatch_k1", "mismatch_k3")


def prepare_batch(batch: Mapping[str, Any], spec: _spec.StepSpec) -> tuple[dict, dict]:
  """The dict the step's loops consume, and the metrics of the whole-batch transforms.

  Args:
    batch: a validated train batch (`check_batch`).
    spec: the resolved train config.

  Returns:
    `(data, metrics)`: `data` holds tokens, loss_mask (bool, after M2PO and
    rejection), advantages f32[B, S], old_logp f32, and is_weights / ref_logp /
    positions / segment_ids where used; `metrics` holds f32 scalars:
    mismatch_k1, mismatch_k3 (whenever `rollout_logp` is given),
    m2po_masked_frac, `rollout_correction/*`, vcpo_ess, vcpo_lr_factor.
  """
  sampled = _as_bool(batch["loss_mask"])
  mask = sampled
  old_logp = batch["old_logp"].astype(jnp.float32)
  metrics: dict[str, jax.Array] = {}
  is_weights = None
  if "rollout_logp" in batch:
    rollout_logp = batch["rollout_logp"].astype(jnp.float32)
    mismatch = objectives.rollout_mismatch_kl(old_logp, rollout_logp, sampled)
    metrics["mismatch_k1"] = mismatch.k1
    metrics["mismatch_k3"] = mismatch.k3
    if spec.use_m2po:
      keep = objectives.m2po_mask(old_logp, rollout_logp, sampled, **spec.m2po_kwargs)
      keep = _as_bool(keep)
      n_sampled = jnp.maximum(jnp.sum(sampled), 1).astype(jnp.float32)
      metrics["m2po_masked_frac"] = jnp.sum(sampled & ~keep) / n_sampled
      mask = mask & keep
    if spec.use_rollout_correction:
      is_weights, kept, rc_metrics = objectives.rollout_correction(
        old_logp,
        rollout_logp,
        mask,
        sampled_mask=sampled,
        **spec.rollout_correction_kwargs,
      )
      mask = _as_bool(kept)
      for name, value in rc_metrics._asdict().items():
        if name not in _MISMATCH_FIELDS:
          metrics[f"rollout_correction/{name}"] = jnp.asarray(value, jnp.float32)
    if spec.use_vcpo:
      seq_weights = objectives.sequence_importance_weights(old_logp, rollout_logp, sampled)
      ess, lr_factor = objectives.vcpo_lr_factor(seq_weights, valid=jnp.any(sampled, axis=1))
      metrics["vcpo_ess"] = ess
      metrics["vcpo_lr_factor"] = lr_factor

  advantages = batch["advantages"]
  if advantages.ndim == 1:
    advantages = objectives.broadcast_to_tokens(advantages, mask)
  data = {
    "tokens": batch["tokens"],
    "loss_mask": mask,
    "advantages": advantages.astype(jnp.float32),
    "old_logp": old_logp,
  }
  if is_weights is not None:
    data["is_weights"] = jax.lax.stop_gradient(is_weights.astype(jnp.float32))
  if spec.kl_coef > 0:
    data["ref_logp"] = batch["ref_logp"].astype(jnp.float32)
  for key in ("positions", "segment_ids"):
    if key in batch:
      data[key] = batch[key]
  return data, metrics


def _as_bool(mask: jax.Array) -> jax.Array:
  return mask if mask.dtype == jnp.bool_ else mask != 0
