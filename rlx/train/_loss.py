"""The objective of one micro-batch: registry policy loss + KL penalty - entropy bonus.

  loss = L_policy(logp, old_logp, A, m; agg_scale=Z) + kl_coef * agg(KL(logp || ref), Z)
         - entropy_coef * agg(H, Z)

with Z the mini-batch's denominator (`rlx.objectives.aggregate_scale`), so the
micro-batch losses sum to the mini-batch's (gradient accumulation with the
global token count, as verl's `agg_loss`). The policy loss is `StepSpec.loss`,
the registry entry `rlx.objectives.get_policy_loss_spec(config.loss)` (or the
spec passed to `make_train_step(loss=...)`): its extra inputs (e.g. ASPO's
entropy) come from its `extra_inputs`, never from its name, and reach it
detached unless its `differentiable_entropy`.
"""

from typing import Any

import jax
import jax.numpy as jnp

from rlx import objectives
from rlx.train import _forward, _gather, _spec

# Extra loss inputs the step can provide, from the forward's outputs.
_EXTRA_INPUTS = ("entropy",)


def make_loss_fn(model_config: Any, spec: _spec.StepSpec, gather: _gather.FsdpGather):
  """`loss_fn(params, micro, agg_scale, clip_kwargs) -> (loss, aux)` for one micro-batch.

  Args:
    model_config: the `rlx.policy.ModelConfig`.
    spec: the resolved train config (its `loss` is the policy loss).
    gather: the `FsdpGather` of the forward.

  Returns:
    The loss function; `aux` holds the loss terms, the masked entropy sum,
    the valid-token count and the loss's `PolicyLossMetrics` as a dict.
  """
  policy_loss_spec = spec.loss
  unsupported = sorted(set(policy_loss_spec.extra_inputs) - set(_EXTRA_INPUTS))
  if unsupported:
    raise ValueError(
      f"Loss {spec.loss_name!r} needs inputs {unsupported} that the train step cannot provide "
      f"(it provides {_EXTRA_INPUTS})."
    )
  agg, kl_coef, entropy_coef = spec.agg, spec.kl_coef, spec.entropy_coef
  # Per-layer FSDP gathering needs the layer loop (one gathered layer live at a time).
  unroll = gather.layer_params_fn is None and (
    int(model_config.num_layers) <= spec.unroll_max_layers
  )

  def loss_fn(params, micro: dict, agg_scale: jax.Array, clip_kwargs: dict):
    mask = micro["loss_mask"]
    logp, entropy = _forward.batch_logprobs(
      params, micro, model_config, spec, gather, unroll=unroll
    )
    # The loss sees the entropy detached unless its spec asks for the gradient.
    differentiable = policy_loss_spec.differentiable_entropy
    extra = {"entropy": entropy if differentiable else jax.lax.stop_gradient(entropy)}
    if entropy_coef == 0:
      entropy = jax.lax.stop_gradient(entropy)
    policy_loss, policy_metrics = policy_loss_spec.fn(
      logp,
      micro["old_logp"],
      micro["advantages"],
      mask,
      is_weights=micro.get("is_weights"),
      agg=agg,
      agg_scale=agg_scale,
      **spec.loss_kwargs,
      **clip_kwargs,
      **{name: extra[name] for name in policy_loss_spec.extra_inputs},
    )
    entropy_loss = objectives.aggregate(entropy, mask, agg, scale=agg_scale)
    loss = policy_loss - entropy_coef * entropy_loss
    kl_loss = jnp.zeros((), jnp.float32)
    if kl_coef > 0:
      kl = objectives.kl_penalty(logp, micro["ref_logp"], spec.kl_kind, mask=mask)
      kl_loss = objectives.aggregate(kl, mask, agg, scale=agg_scale)
      loss = loss + kl_coef * kl_loss
    aux = {
      "loss": loss,
      "policy_loss": policy_loss,
      "kl_loss": kl_loss,
      "entropy_loss": entropy_loss,
      "entropy": jnp.sum(jnp.where(mask, entropy, 0.0)),
      "n_tokens": jnp.sum(mask).astype(jnp.float32),
      "policy_metrics": policy_metrics._asdict(),
    }
    return loss, aux

  return loss_fn
