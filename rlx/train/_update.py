"""One optimizer update on one mini-batch: micro-batched gradients, a guarded optax step.

  grads = sum_m d loss(micro_m; agg_scale = Z_mini) / d params      (lax.scan over micro-batches)
  params, opt_state <- optax update, kept unchanged if the loss or |grads| is not finite

The logged learning rate is `schedule(n)` at the update counter n computed
from the `TrainState` (`update_counter`), not read from the optimizer state,
so any optimizer chain (several `count` leaves, MultiSteps, ...) reports it
right.
"""

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh

from rlx import objectives
from rlx.train import _bapo, _gather, _loss, _metrics, _optimizer, _rows, _spec


class UpdateCarry(NamedTuple):
  """What the updates of one step thread through their `lax.scan`.

  Attributes:
    params: the params.
    opt_state: the optax state.
    skipped: i32[] updates skipped so far (`TrainState.skipped` + this step's).
    lr_factor: f32[] factor on every update (VCPO; 1 otherwise).
    step: i32[] the `TrainState.step` of the running step (constant).
  """

  params: Any
  opt_state: Any
  skipped: jax.Array
  lr_factor: jax.Array
  step: jax.Array


def make_update_fn(
  model_config: Any,
  spec: _spec.StepSpec,
  mesh: Mesh,
  optimizer: optax.GradientTransformation,
  param_shardings: Any,
  gather: _gather.FsdpGather,
) -> Callable:
  """`update(carry, (mini, update_index)) -> (carry, metrics)`, a `lax.scan` body.

  Args:
    model_config: the `rlx.policy.ModelConfig`.
    spec: the resolved train config.
    mesh: the mesh.
    optimizer: the optax transformation of the state.
    param_shardings: `NamedSharding`s of the params (gradients are kept so).
    gather: the `FsdpGather` of the forward.

  Returns:
    The update function; `metrics` holds the merged micro-batch metrics plus
    grad_norm, update_norm, learning_rate, skipped (and the bapo_* bounds).
  """
  loss_fn = _loss.make_loss_fn(model_config, spec, gather)
  schedule = _optimizer.schedule_of(spec.optimizer)
  per_step = spec.updates_per_step

  def update(carry: UpdateCarry, xs) -> tuple[UpdateCarry, dict]:
    mini, update_index = xs
    params = carry.params
    agg_scale = objectives.aggregate_scale(mini["loss_mask"], spec.agg)
    clip_kwargs, metrics = {}, {}
    if spec.use_bapo:
      clip_kwargs, metrics = _bapo.bapo_clip_kwargs(params, mini, model_config, spec, mesh, gather)
    zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
    zeros = jax.lax.with_sharding_constraint(zeros, param_shardings)

    def micro_step(grads_acc, micro):
      grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
      (_, aux), grads = grad_fn(params, micro, agg_scale, clip_kwargs)
      return jax.tree.map(lambda a, g: a + g.astype(jnp.float32), grads_acc, grads), aux

    micros = _rows.split_rows(mini, spec.micro_batches, mesh)
    grads, aux = jax.lax.scan(micro_step, zeros, micros)
    grads = jax.lax.with_sharding_constraint(grads, param_shardings)
    metrics.update(_metrics.merge_micro_metrics(aux))
    grad_norm = optax.tree.norm(grads)
    finite = jnp.isfinite(metrics["loss"]) & jnp.isfinite(grad_norm)
    grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params)
    updates, new_opt_state = optimizer.update(grads, carry.opt_state, params)
    if spec.use_vcpo:
      updates = jax.tree.map(lambda u: u * carry.lr_factor.astype(u.dtype), updates)
    new_params = optax.apply_updates(params, updates)
    keep = lambda new, old: jnp.where(finite, new, old)
    n = _optimizer.update_counter(carry.step, update_index, carry.skipped, per_step)
    metrics.update(
      grad_norm=grad_norm,
      update_norm=jnp.where(finite, optax.tree.norm(updates), 0.0),
      learning_rate=jnp.asarray(schedule(n), jnp.float32),
      skipped=(~finite).astype(jnp.float32),
    )
    carry = carry._replace(
      params=jax.tree.map(keep, new_params, params),
      opt_state=jax.tree.map(keep, new_opt_state, carry.opt_state),
      skipped=carry.skipped + (~finite).astype(jnp.int32),
    )
    return carry, metrics

  return update
