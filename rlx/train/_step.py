"""The single sharded, jitted train step: forward, pure loss, grads, optax update.

One call of `train_step(state, batch)` consumes one rollout batch:

  data = whole-batch transforms (mismatch metrics, M2PO, rollout correction, VCPO)
  for epoch in range(ppo_epochs):                       # lax.scan
    shuffle the B sequences (key = fold_in(fold_in(rng, step), epoch))
    for mini_batch in split(data, mini_batches):        # lax.scan
      [BAPO bounds from a no-grad forward of the mini-batch]
      for micro in split(mini_batch, micro_batches):    # lax.scan
        grads += d loss(micro; agg_scale = mini-batch denominator) / d params
      params, opt_state = optax update (skipped if loss/grads are non-finite)

The config is validated and resolved once, into the frozen `StepSpec` that
every piece reads (`_spec`). The pieces live in their own modules: `_batch`
(contract), `_transforms` (whole-batch transforms), `_update` (one optimizer
update), `_loss` (the objective), `_bapo`, `_forward` / `_gather`
(FSDP-gathered forward), `_metrics` (merging) and `_host` (the host-side
`TrainStep`). Layout after flax's lm1b `train_step` and big_vision's
`update_fn` (https://github.com/google/flax/tree/main/examples/lm1b,
https://github.com/google-research/big_vision).
"""

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from rlx import objectives, policy
from rlx.train import (
  _batch,
  _gather,
  _host,
  _mesh,
  _metrics,
  _optimizer,
  _rows,
  _spec,
  _state,
  _transforms,
  _update,
)


def make_train_step(
  model_config: Any,
  train_config: ml_collections.ConfigDict,
  mesh: Mesh,
  *,
  donate: bool = True,
  optimizer: optax.GradientTransformation | None = None,
  loss: str | Callable | objectives.PolicyLossSpec | None = None,
) -> _host.TrainStep:
  """Builds the jitted, sharded `train_step(state, batch) -> (state, metrics)`.

  The objective is the registry entry
  `rlx.objectives.get_policy_loss_spec(train_config.loss)` (any loss;
  hyper-parameters from `train_config.loss_kwargs`, extra inputs such as
  ASPO's entropy from `spec.extra_inputs`), plus optional BAPO bounds (through
  `spec.clip_keywords`), M2PO mask, rollout correction, VCPO, KL to a
  reference and an entropy bonus (see `get_config`). Changing the loss changes
  only what is traced: the step is always this one compiled function.

  Per optimizer update, with the mini-batch's denominator Z =
  aggregate_scale(mask, agg) and micro-batches m:
    loss = sum_m [ L_policy(m; agg_scale=Z) + kl_coef * agg(KL(m), Z)
                   - entropy_coef * agg(H(m), Z) ]
  which equals the un-split mini-batch's loss (and gradient) for every
  aggregation mode (ASPO included: its high-entropy threshold is a
  per-sequence quantile, so splitting the batch does not move it).
  Update: params <- optimizer(grad) (default AdamW after global-norm
  clipping, `make_optimizer`), skipped (params and optimizer state kept) if
  the loss or the gradient norm is not finite.

  References: PPO epochs / mini-batches (Schulman et al. 2017,
  https://arxiv.org/abs/1707.06347); FSDP / ZeRO-3 sharding (Rajbhandari et
  al. 2020, https://arxiv.org/abs/1910.02054); gradient accumulation with the
  global token count (verl `agg_loss`,
  https://github.com/volcengine/verl/blob/main/verl/trainer/ppo/core_algos.py).

  Batch (a dict; B = sequences, S = padded sequence length; B must be
  divisible by mini_batches x micro_batches x data x fsdp; B, S >= 1):
    tokens        i32[B, S]   prompt + response + right padding, ids in [0, vocab).
    loss_mask     [B, S]      1 on the sampled response tokens that count (bool or 0/1).
    advantages    f32[B, S] or f32[B] (broadcast over the response tokens).
    old_logp      f32[B, S]   anchor log-probs (`compute_logprobs` with the
                              params at the start of the iteration).
    rollout_logp  f32[B, S]   optional; sampler log-probs (needed by rollout
                              correction / M2PO / VCPO; gives mismatch metrics).
    ref_logp      f32[B, S]   optional; reference log-probs (needed if kl_coef > 0).
    positions, segment_ids  i32[B, S]  optional; passed to the policy forward.

  Metrics (f32 scalars, means over the step's optimizer updates unless noted):
    loss, policy_loss, kl_loss, entropy_loss (the aggregated terms; loss =
    policy_loss + kl_coef·kl_loss − entropy_coef·entropy_loss), entropy
    (token mean), the `PolicyLossMetrics` fields (clip fractions, approx_kl,
    ratio_mean, ratio_max = max, is_weight_mean); with `rollout_logp`:
    mismatch_k1, mismatch_k3 (`rlx.objectives.rollout_mismatch_kl` of the
    sampled tokens, whatever the correction settings), and where enabled
    `rollout_correction/*`, m2po_masked_frac, vcpo_ess, vcpo_lr_factor,
    bapo_c_low / bapo_c_high / bapo_positive_share; grad_norm (before
    clipping), update_norm, param_norm (after the step), learning_rate (the
    config's schedule at the update counter, `update_counter`; before the VCPO
    factor), tokens (valid loss tokens), skipped (updates skipped in this
    step, a sum), skipped_total, step (the step index that ran); with
    `train_config.report_throughput` also step_time_s, tokens_per_second and
    loss_tokens_per_second, measured on host (see `TrainStep`).

  Args:
    model_config: the `rlx.policy.ModelConfig`.
    train_config: the train config (`get_config()`), validated here.
    mesh: the mesh the state and batch live on (`make_mesh`).
    donate: donate the input state's buffers (default True).
    optimizer: an optax transformation replacing `make_optimizer(train_config)`;
      pass the same one to `create_train_state` / `abstract_train_state`. The
      logged learning_rate stays `make_schedule(train_config)` at the update
      counter.
    loss: the policy loss, instead of the registry entry `train_config.loss`:
      a registered name, a `rlx.objectives.PolicyLossSpec`, or a loss function
      (made a spec by `rlx.objectives.policy_loss_spec`, so with no extra
      inputs or clip keywords). `train_config.loss_kwargs` are checked
      against it. None (default): `train_config.loss`.

  Returns:
    A `TrainStep`; call it as `state, metrics = train_step(state, batch)`, or
    trace `train_step.step_fn(state, batch)` inside your own jit.
  """
  spec = _spec.StepSpec.from_config(train_config, loss=_resolve_loss(loss))
  if optimizer is None:
    optimizer = _optimizer.optimizer_of(spec.optimizer, spec.max_grad_norm)
  params_shape = jax.eval_shape(
    functools.partial(policy.init_params, model_config), jax.random.PRNGKey(0)
  )
  shardings = _state.train_state_shardings(
    params_shape, model_config, train_config, mesh, optimizer=optimizer
  )
  step_fn = make_step_fn(model_config, train_config, mesh, optimizer, spec=spec)
  jitted = jax.jit(
    step_fn,
    in_shardings=(shardings, NamedSharding(mesh, PartitionSpec(_mesh.BATCH_AXES))),
    out_shardings=(shardings, _mesh.replicated(mesh)),
    donate_argnums=(0,) if donate else (),
  )
  return _host.TrainStep(
    jitted=jitted,
    step_fn=step_fn,
    mesh=mesh,
    config=train_config,
    spec=spec,
    vocab_size=int(model_config.vocab_size),
    abstract_state=_state.abstract_train_state(
      model_config, train_config, mesh, optimizer=optimizer
    ),
    nonfinite=spec.nonfinite,
    report_throughput=spec.report_throughput,
    model_config=model_config,
  )


def make_step_fn(
  model_config: Any,
  cfg: ml_collections.ConfigDict | _spec.StepSpec,
  mesh: Mesh,
  optimizer: optax.GradientTransformation,
  *,
  spec: _spec.StepSpec | objectives.PolicyLossSpec | None = None,
) -> Callable[[_state.TrainState, dict], tuple[_state.TrainState, dict]]:
  """The pure `step_fn(state, batch) -> (state, metrics)` (traceable, no host checks).

  Only shapes are validated (at trace time); it may be called inside any
  jit whose arrays live on `mesh` (the sharding constraints name its axes).

  Args:
    model_config: the `rlx.policy.ModelConfig`.
    cfg: the train config (validated and resolved here unless `spec` is a
      `StepSpec`), or its `StepSpec`.
    mesh: the mesh of the state and batch.
    optimizer: the optax transformation of the state.
    spec: the `StepSpec` resolved from `cfg` (e.g. by `make_train_step`; `cfg`
      is then not read), or the policy loss to resolve `cfg` with (None: the
      registry entry of `cfg.loss`).

  Returns:
    The step function.
  """
  spec = _spec.as_step_spec(cfg, loss=spec)
  num_shards = _mesh.batch_axis_size(mesh)
  gather = _gather.fsdp_gather_fns(model_config, spec, mesh)
  param_shardings = policy.param_shardings(model_config, mesh)
  update = _update.make_update_fn(model_config, spec, mesh, optimizer, param_shardings, gather)

  def step_fn(state: _state.TrainState, batch: dict):
    _batch.check_batch(batch, spec, num_shards)
    data, pre_metrics = _transforms.prepare_batch(batch, spec)
    carry = _update.UpdateCarry(
      params=state.params,
      opt_state=state.opt_state,
      skipped=state.skipped,
      lr_factor=pre_metrics.get("vcpo_lr_factor", jnp.ones((), jnp.float32)),
      step=state.step,
    )
    step_rng = jax.random.fold_in(state.rng, state.step)

    def epoch(carry, epoch_index):
      shuffled = data
      if spec.shuffle and spec.mini_batches > 1:
        rows = data["tokens"].shape[0]
        perm = jax.random.permutation(jax.random.fold_in(step_rng, epoch_index), rows)
        shuffled = jax.tree.map(lambda x: x[perm], data)
      minis = _rows.split_rows(shuffled, spec.mini_batches, mesh)
      indices = epoch_index * spec.mini_batches + jnp.arange(spec.mini_batches)
      return jax.lax.scan(update, carry, (minis, indices))

    carry, per_update = jax.lax.scan(epoch, carry, jnp.arange(spec.ppo_epochs))
    metrics = _metrics.merge_update_metrics(per_update)
    metrics["tokens"] = jnp.sum(data["loss_mask"]).astype(jnp.float32)
    metrics["param_norm"] = optax.tree.norm(carry.params)
    metrics["skipped_total"] = carry.skipped.astype(jnp.float32)
    metrics["step"] = state.step.astype(jnp.float32)
    metrics.update(pre_metrics)
    new_state = state.replace(
      step=state.step + 1, params=carry.params, opt_state=carry.opt_state, skipped=carry.skipped
    )
    return new_state, metrics

  return step_fn


def _resolve_loss(
  loss: str | Callable | objectives.PolicyLossSpec | None,
) -> objectives.PolicyLossSpec | None:
  """`make_train_step`'s `loss` argument as a spec (None: the config's registry entry)."""
  if loss is None or isinstance(loss, objectives.PolicyLossSpec):
    return loss
  if isinstance(loss, str):
    if loss not in objectives.POLICY_LOSS_SPECS:
      raise ValueError(
        f"`loss` must be one of {sorted(objectives.POLICY_LOSS_SPECS)} (or a loss function / "
        f"PolicyLossSpec), got {loss!r}."
      )
    return objectives.get_policy_loss_spec(loss)
  if callable(loss):
    return objectives.policy_loss_spec(loss)
  raise ValueError(
    f"`loss` must be a registered name, a PolicyLossSpec or a loss function, got "
    f"{type(loss).__name__}."
  )
