"""The single sharded, jitted train step: forward, pure loss, grads, optax update.

One call of `train_step(state, batch)` consumes one rollout batch:

  for epoch in range(ppo_epochs):                       # lax.scan
    shuffle the B sequences (key = fold_in(fold_in(rng, step), epoch))
    for mini_batch in split(batch, mini_batches):       # lax.scan
      for micro in split(mini_batch, micro_batches):    # lax.scan
        logp, entropy = rlx.policy.token_logprobs(params, micro)
        loss = POLICY_LOSSES[config.loss](logp, old_logp, adv, mask,
                   agg_scale=<mini-batch denominator>, ...)
               + kl_coef * KL(logp || ref) - entropy_coef * H
        grads += d loss / d params
      params, opt_state = optax update (skipped if loss/grads are non-finite)

Every micro-batch loss is divided by the denominator of the WHOLE mini-batch
(`rlx.objectives.aggregate_scale`), so the summed micro-batch losses and
gradients equal those of the un-split mini-batch for every aggregation mode.
Rollout correction and the M2PO mask depend only on (old, rollout) log-probs,
so they are computed once on the whole batch before the loops.

FSDP: params, gradients and optimizer state stay sharded over "fsdp"; each
forward gathers the embedding / final norm / LM head before it and ONE decoder
layer at a time inside the policy's layer scan (`fsdp_gather_fns`, passed to
`rlx.policy.token_logprobs` as `layer_params_fn`), so the gathered weights in
memory are about one layer plus the embedding/head instead of the whole model.
"""

import functools
import time
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from jax.sharding import Mesh, PartitionSpec

from rlx import objectives, policy
from rlx.train import _config, _mesh, _optimizer, _state

REQUIRED_KEYS = ("tokens", "loss_mask", "advantages", "old_logp")
OPTIONAL_KEYS = ("rollout_logp", "ref_logp", "positions", "segment_ids")

# Metric names that are maxima (combined by max, not mean, across updates).
_MAX_METRICS = ("ratio_max",)


class NonFiniteError(FloatingPointError):
  """A train step met a non-finite loss or gradient with `nonfinite="raise"`.

  The update was skipped (params/optimizer state unchanged) before raising;
  `state` and `metrics` hold the step's outputs so a caller can inspect or
  continue.
  """

  def __init__(self, message: str, state: _state.TrainState, metrics: dict):
    super().__init__(message)
    self.state = state
    self.metrics = metrics


class TrainStep:
  """`train_step(state, batch) -> (state, metrics)`, from `make_train_step`.

  Calling it runs ONE jitted function (`self.jitted`) with explicit in/out
  shardings that donates `state`; batch arrays not yet sharded along the
  batch axes (numpy, one device) are placed first. With `nonfinite="raise"` the call also
  checks the `skipped` metric on host and raises `NonFiniteError`.

  With `report_throughput` (config `report_throughput`, default True) the
  call waits for the step to finish and adds host-measured metrics (numpy
  float32 scalars): `step_time_s` (wall time of the call, batch placement
  included; the first call also includes compilation), `tokens_per_second`
  (B * S positions processed / step_time_s) and `loss_tokens_per_second`
  (valid loss tokens / step_time_s). Turn it off to keep dispatch fully
  asynchronous (e.g. to overlap host work with the step).
  """

  def __init__(self, jitted: Any, nonfinite: str, mesh: Mesh, *, report_throughput: bool = False):
    self.jitted = jitted
    self.mesh = mesh
    self._raise = nonfinite == "raise"
    self._report_throughput = report_throughput

  def __call__(self, state: _state.TrainState, batch: Mapping[str, jax.Array]):
    start = time.perf_counter()
    if not isinstance(state, _state.TrainState):
      raise ValueError(
        f"`state` must be a rlx.train.TrainState (create_train_state), got {type(state).__name__}."
      )
    if not isinstance(batch, Mapping):
      raise ValueError(f"`batch` must be a dict of arrays, got {type(batch).__name__}.")
    placed = _mesh.place_batch(batch, self.mesh)
    state, metrics = self.jitted(state, placed)
    if self._report_throughput:
      jax.block_until_ready(metrics)
      elapsed = max(time.perf_counter() - start, 1e-9)
      b, s = placed["tokens"].shape
      loss_tokens = float(np.asarray(metrics["tokens"].addressable_data(0)))
      metrics = dict(
        metrics,
        step_time_s=np.float32(elapsed),
        tokens_per_second=np.float32(b * s / elapsed),
        loss_tokens_per_second=np.float32(loss_tokens / elapsed),
      )
    if self._raise:
      skipped = int(np.asarray(metrics["skipped"].addressable_data(0)))
      if skipped:
        raise NonFiniteError(
          f"{skipped} optimizer update(s) of step {int(metrics['step'].addressable_data(0))} "
          "had a non-finite loss or gradient and were skipped.",
          state,
          metrics,
        )
    return state, metrics

  def lower(self, state: _state.TrainState, batch: Mapping[str, jax.Array]):
    """`jax.stages.Lowered` of the step (e.g. to inspect the compiled HLO)."""
    return self.jitted.lower(state, _mesh.place_batch(batch, self.mesh))


def make_train_step(
  model_config: Any,
  train_config: ml_collections.ConfigDict,
  mesh: Mesh,
  *,
  donate: bool = True,
) -> TrainStep:
  """Builds the jitted, sharded `train_step(state, batch) -> (state, metrics)`.

  The objective is `rlx.objectives.POLICY_LOSSES[train_config.loss]` (any of
  them; hyper-parameters from `train_config.loss_kwargs`), plus optional BAPO
  bounds, M2PO mask, rollout correction, KL to a reference and an entropy
  bonus (see `get_config`). Changing the loss changes only what is traced:
  the step is always this one compiled function.

  Per optimizer update, with the mini-batch's denominator Z =
  aggregate_scale(mask, agg) and micro-batches m:
    loss = sum_m [ L_policy(m; agg_scale=Z) + kl_coef * agg(KL(m), Z)
                   - entropy_coef * agg(H(m), Z) ]
  which equals the un-split mini-batch's loss (and gradient) for every
  aggregation mode (ASPO included: its high-entropy threshold is a
  per-sequence quantile, so splitting the batch does not move it).
  Update: params <- AdamW(clip_by_global_norm(grad)), skipped (params and
  optimizer state kept) if the loss or the gradient norm is not finite.

  References: PPO epochs / mini-batches (Schulman et al. 2017,
  https://arxiv.org/abs/1707.06347); FSDP / ZeRO-3 sharding (Rajbhandari et
  al. 2020, https://arxiv.org/abs/1910.02054); gradient accumulation with the
  global token count (verl `agg_loss`).

  Batch (a dict; B = sequences, S = padded sequence length; B must be
  divisible by mini_batches x micro_batches x data x fsdp):
    tokens        i32[B, S]   prompt + response + right padding.
    loss_mask     [B, S]      1 on response tokens that count (bool or 0/1).
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
    ratio_mean, ratio_max = max, is_weight_mean), rollout-correction metrics
    (`rollout_correction/*`) or mismatch_k1/k3 when rollout_logp is given,
    bapo_c_low/c_high/positive_share, m2po_masked_frac, vcpo_ess,
    vcpo_lr_factor, grad_norm (before clipping), update_norm, param_norm
    (after the step), learning_rate, tokens (valid loss tokens in the
    batch), skipped (updates skipped in this step), skipped_total, step (the
    step index that ran); with `train_config.report_throughput` also
    step_time_s, tokens_per_second and loss_tokens_per_second, measured on
    host (see `TrainStep`).

  Args:
    model_config: the `rlx.policy.ModelConfig`.
    train_config: the train config (`get_config()`), validated here.
    mesh: the mesh the state and batch live on (`make_mesh`).
    donate: donate the input state's buffers (default True).

  Returns:
    A `TrainStep`; call it as `state, metrics = train_step(state, batch)`.
  """
  _config.validate_config(train_config)
  cfg = train_config
  optimizer = _optimizer.make_optimizer(cfg)
  schedule = _optimizer.make_schedule(cfg)
  params_shape = jax.eval_shape(
    functools.partial(policy.init_params, model_config), jax.random.PRNGKey(0)
  )
  shardings = _state.train_state_shardings(params_shape, model_config, cfg, mesh)
  p_shardings = shardings.params
  batch_spec = PartitionSpec(_mesh.BATCH_AXES)
  num_shards = _mesh.batch_axis_size(mesh)
  gathered = fsdp_gather_fns(model_config, cfg, mesh)
  agg = _config.resolve_agg(cfg)
  loss_fn = _make_loss_fn(model_config, cfg, gathered)

  def shard_rows(x: jax.Array) -> jax.Array:
    """Constrains a [n, b, ...] stack of batches to shard b over the batch axes."""
    spec = PartitionSpec(None, _mesh.BATCH_AXES, *([None] * (x.ndim - 2)))
    return jax.lax.with_sharding_constraint(x, jax.sharding.NamedSharding(mesh, spec))

  def split(data: dict, parts: int) -> dict:
    """[B, ...] -> [parts, B / parts, ...]; part k holds rows k, k + parts, ...

    Rows are taken strided so each device's contiguous block of the batch
    stays on that device for every part (no resharding).
    """

    def one(x):
      x = x.reshape((x.shape[0] // parts, parts) + x.shape[1:])
      return shard_rows(jnp.swapaxes(x, 0, 1))

    return jax.tree.map(one, data)

  def update(carry, mini):
    """One optimizer update on one mini-batch (micro-batched grad accumulation)."""
    params, opt_state, skipped, lr_factor = carry
    agg_scale = objectives.aggregate_scale(mini["loss_mask"], agg)
    bounds = {}
    if cfg.use_bapo:
      bounds = _bapo_bounds(params, mini, model_config, cfg, split, gathered)
    micros = split(mini, cfg.micro_batches)
    zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
    zeros = jax.lax.with_sharding_constraint(zeros, p_shardings)

    def micro_step(grads_acc, micro):
      (_, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, micro, agg_scale, bounds)
      grads_acc = jax.tree.map(lambda a, g: a + g.astype(jnp.float32), grads_acc, grads)
      return grads_acc, aux

    grads, aux = jax.lax.scan(micro_step, zeros, micros)
    grads = jax.lax.with_sharding_constraint(grads, p_shardings)
    metrics = _combine_micro_metrics(aux)
    grad_norm = optax.tree.norm(grads)
    finite = jnp.isfinite(metrics["loss"]) & jnp.isfinite(grad_norm)
    grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params)
    updates, new_opt_state = optimizer.update(grads, opt_state, params)
    if cfg.use_vcpo:
      updates = jax.tree.map(lambda u: u * lr_factor.astype(u.dtype), updates)
    new_params = optax.apply_updates(params, updates)
    keep = lambda new, old: jnp.where(finite, new, old)
    new_params = jax.tree.map(keep, new_params, params)
    new_opt_state = jax.tree.map(keep, new_opt_state, opt_state)
    metrics.update(
      grad_norm=grad_norm,
      update_norm=jnp.where(finite, optax.tree.norm(updates), 0.0),
      learning_rate=jnp.asarray(schedule(_update_count(opt_state)), jnp.float32),
      skipped=(~finite).astype(jnp.float32),
    )
    for name in ("c_low", "c_high", "positive_share"):
      if name in bounds:
        metrics[f"bapo_{name}"] = jnp.asarray(bounds[name], jnp.float32)
    skipped = skipped + (~finite).astype(jnp.int32)
    return (new_params, new_opt_state, skipped, lr_factor), metrics

  def step_fn(state: _state.TrainState, batch: dict):
    data, pre_metrics = _prepare_batch(batch, cfg, num_shards)
    batch_size = data["tokens"].shape[0]
    step_rng = jax.random.fold_in(state.rng, state.step)

    def epoch(carry, epoch_index):
      if cfg.shuffle and cfg.mini_batches > 1:
        perm = jax.random.permutation(jax.random.fold_in(step_rng, epoch_index), batch_size)
        shuffled = jax.tree.map(lambda x: x[perm], data)
      else:
        shuffled = data
      return jax.lax.scan(update, carry, split(shuffled, cfg.mini_batches))

    lr_factor = pre_metrics.get("vcpo_lr_factor", jnp.ones((), jnp.float32))
    carry = (state.params, state.opt_state, state.skipped, lr_factor)
    (params, opt_state, skipped, _), per_update = jax.lax.scan(
      epoch, carry, jnp.arange(cfg.ppo_epochs)
    )
    metrics = {
      name: jnp.max(v) if name in _MAX_METRICS else jnp.mean(v) for name, v in per_update.items()
    }
    metrics["skipped"] = jnp.sum(per_update["skipped"])
    metrics["tokens"] = jnp.sum(data["loss_mask"]).astype(jnp.float32)
    metrics["param_norm"] = optax.tree.norm(params)
    metrics["skipped_total"] = skipped.astype(jnp.float32)
    metrics["step"] = state.step.astype(jnp.float32)
    metrics.update(pre_metrics)
    new_state = state.replace(
      step=state.step + 1, params=params, opt_state=opt_state, skipped=skipped
    )
    return new_state, metrics

  jitted = jax.jit(
    step_fn,
    in_shardings=(shardings, jax.sharding.NamedSharding(mesh, batch_spec)),
    out_shardings=(shardings, _mesh.replicated(mesh)),
    donate_argnums=(0,) if donate else (),
  )
  return TrainStep(
    jitted, cfg.nonfinite, mesh, report_throughput=bool(cfg.get("report_throughput", True))
  )


def _update_count(opt_state: Any) -> jax.Array:
  """The optimizer's update counter (for the logged learning rate)."""
  counts = [
    leaf
    for path, leaf in jax.tree_util.tree_leaves_with_path(opt_state)
    if path and getattr(path[-1], "name", None) == "count"
  ]
  return counts[-1] if counts else jnp.zeros((), jnp.int32)


def _prepare_batch(batch: dict, cfg: ml_collections.ConfigDict, num_shards: int):
  """Validates the batch and applies the whole-batch transforms.

  Returns the dict used by the loops (tokens, loss_mask, advantages [B, S],
  old_logp, and is_weights / ref_logp / positions / segment_ids where used)
  and the metrics of the whole-batch transforms.
  """
  unknown = sorted(set(batch) - set(REQUIRED_KEYS) - set(OPTIONAL_KEYS))
  missing = [k for k in REQUIRED_KEYS if k not in batch]
  if unknown or missing:
    raise ValueError(
      f"Batch keys: missing {missing}, unknown {unknown}; required {REQUIRED_KEYS}, "
      f"optional {OPTIONAL_KEYS}."
    )
  tokens = batch["tokens"]
  if tokens.ndim != 2 or not jnp.issubdtype(tokens.dtype, jnp.integer):
    raise ValueError(f"`tokens` must be an int array [B, S], got {tokens.dtype}{tokens.shape}.")
  shape = tokens.shape
  for key in ("loss_mask", "old_logp", "rollout_logp", "ref_logp", "positions", "segment_ids"):
    if key in batch and batch[key].shape != shape:
      raise ValueError(f"`{key}` must have the shape of `tokens` {shape}, got {batch[key].shape}.")
  adv = batch["advantages"]
  if adv.shape not in (shape, shape[:1]):
    raise ValueError(
      f"`advantages` must have shape [B, S] = {shape} or [B] = {shape[:1]}, got {adv.shape}."
    )
  parts = cfg.mini_batches * cfg.micro_batches * num_shards
  if shape[0] % parts:
    raise ValueError(
      f"Batch size {shape[0]} must be divisible by mini_batches ({cfg.mini_batches}) x "
      f"micro_batches ({cfg.micro_batches}) x data x fsdp ({num_shards}) = {parts}."
    )
  needs_rollout = cfg.use_rollout_correction or cfg.use_m2po or cfg.use_vcpo
  if needs_rollout and "rollout_logp" not in batch:
    raise ValueError("`rollout_logp` is required by use_rollout_correction / use_m2po / use_vcpo.")
  if cfg.kl_coef > 0 and "ref_logp" not in batch:
    raise ValueError("`ref_logp` is required when kl_coef > 0 (see compute_logprobs).")

  mask = batch["loss_mask"]
  mask = mask if mask.dtype == jnp.bool_ else mask != 0
  old_logp = batch["old_logp"].astype(jnp.float32)
  metrics = {}
  is_weights = None
  if "rollout_logp" in batch:
    rollout_logp = batch["rollout_logp"].astype(jnp.float32)
    if cfg.use_m2po:
      m2po_kwargs = _config.to_kwargs(cfg.m2po_kwargs)
      new_mask = objectives.m2po_mask(old_logp, rollout_logp, mask, **m2po_kwargs) != 0
      n_valid = jnp.maximum(jnp.sum(mask), 1).astype(jnp.float32)
      metrics["m2po_masked_frac"] = jnp.sum(mask & ~new_mask) / n_valid
      mask = new_mask
    if cfg.use_rollout_correction:
      rc_kwargs = _config.to_kwargs(cfg.rollout_correction_kwargs)
      is_weights, new_mask, rc_metrics = objectives.rollout_correction(
        old_logp, rollout_logp, mask, **rc_kwargs
      )
      mask = mask & (new_mask != 0)
      for name, value in rc_metrics._asdict().items():
        metrics[f"rollout_correction/{name}"] = jnp.asarray(value, jnp.float32)
    if cfg.use_vcpo:
      # Sequence IS weights of the behaviour policy: prod_t pi_old / pi_rollout.
      seq_log_w = jnp.sum(jnp.where(mask, old_logp - rollout_logp, 0.0), axis=1)
      seq_w = jnp.exp(jnp.clip(seq_log_w, -20.0, 20.0))
      ess, lr_factor = objectives.vcpo_lr_factor(seq_w, valid=jnp.any(mask, axis=1))
      metrics["vcpo_ess"] = ess
      metrics["vcpo_lr_factor"] = lr_factor
    if not cfg.use_rollout_correction:
      for kind in ("k1", "k3"):
        per_token = objectives.kl_penalty(rollout_logp, old_logp, kind, mask=mask)
        metrics[f"mismatch_{kind}"] = objectives.aggregate(per_token, mask, "token-mean")

  data = {
    "tokens": tokens,
    "loss_mask": mask,
    "advantages": (
      objectives.broadcast_to_tokens(adv, mask) if adv.ndim == 1 else adv.astype(jnp.float32)
    ),
    "old_logp": old_logp,
  }
  if is_weights is not None:
    data["is_weights"] = jax.lax.stop_gradient(is_weights.astype(jnp.float32))
  if cfg.kl_coef > 0:
    data["ref_logp"] = batch["ref_logp"].astype(jnp.float32)
  for key in ("positions", "segment_ids"):
    if key in batch:
      data[key] = batch[key]
  return data, metrics


class FsdpGather(NamedTuple):
  """How the forward gathers FSDP-sharded params (see `fsdp_gather_fns`).

  Attributes:
    params_fn: applied to the whole params tree before the forward (None =
      identity).
    layer_params_fn: passed to `rlx.policy.token_logprobs`, applied to each
      decoder layer's params inside the layer scan (None = identity).
  """

  params_fn: Callable[[Any], Any] | None
  layer_params_fn: Callable[[Any], Any] | None


NO_GATHER = FsdpGather(None, None)


def fsdp_gather_fns(model_config: Any, cfg: ml_collections.ConfigDict, mesh: Mesh) -> FsdpGather:
  """The param-gathering functions of the train step's forward (ZeRO-3 / FSDP).

  - `gather_fsdp_params` and `gather_fsdp_per_layer` (default): the
    embedding / final norm / LM head are all-gathered over "fsdp" before the
    forward, and each decoder layer's slice of the stacked `[L, ...]` weights
    inside the policy's layer scan (`rlx.policy` `layer_params_fn`), so
    about one layer's gathered weights are live at a time (the backward pass
    re-gathers each layer, and each layer's gradient is reduced back to its
    shard inside the loop: a reduce-scatter where the backend has one, an
    all-reduce + slice on CPU).
  - `gather_fsdp_per_layer=False`: the whole tree is gathered before the
    forward (gathered weights of every layer live at once).
  - `gather_fsdp_params=False`: no constraint; XLA's sharding propagation
    chooses (it may replicate the batch instead of gathering weights).
  Tensor ("tensor" axis) sharding is kept in every case. On a mesh whose
  "fsdp" axis has size 1 nothing needs gathering and both functions are None.

  Args:
    model_config: the `rlx.policy.ModelConfig`.
    cfg: the train config (`gather_fsdp_params`, `gather_fsdp_per_layer`).
    mesh: the mesh the params live on.

  Returns:
    An `FsdpGather`.
  """
  if not cfg.gather_fsdp_params or mesh.shape.get("fsdp", 1) == 1:
    return NO_GATHER  # nothing is sharded over "fsdp"
  gathered = _mesh.gathered_param_shardings(model_config, mesh)
  if not cfg.get("gather_fsdp_per_layer", True):
    return FsdpGather(lambda p: jax.lax.with_sharding_constraint(p, gathered), None)
  top = {k: v for k, v in gathered.items() if k != "layers"}
  layer = _mesh.gathered_layer_shardings(model_config, mesh)

  def params_fn(params):
    rest = {k: params[k] for k in top}
    return dict(params, **jax.lax.with_sharding_constraint(rest, top))

  def layer_params_fn(layer_params):
    return jax.lax.with_sharding_constraint(layer_params, layer)

  return FsdpGather(params_fn, layer_params_fn)


def _token_logprobs(
  params,
  data: dict,
  model_config: Any,
  cfg: ml_collections.ConfigDict,
  gather: FsdpGather = NO_GATHER,
):
  """`rlx.policy.token_logprobs` on a (micro-)batch dict, FSDP params gathered.

  With gathering (`fsdp_gather_fns`) the activations stay batch-sharded;
  without it XLA may instead keep the weights' model-dim sharding and
  replicate the batch (much more communication).
  """
  if gather.params_fn is not None:
    params = gather.params_fn(params)
  kwargs = {}
  if cfg.logprob_chunk_size:
    kwargs["chunk_size"] = int(cfg.logprob_chunk_size)
  return policy.token_logprobs(
    params,
    model_config,
    data["tokens"],
    data["loss_mask"],
    positions=data.get("positions"),
    segment_ids=data.get("segment_ids"),
    temperature=float(cfg.temperature),
    layer_params_fn=gather.layer_params_fn,
    **kwargs,
  )


def _make_loss_fn(model_config: Any, cfg: ml_collections.ConfigDict, gathered: Any):
  """`loss_fn(params, micro, agg_scale, bounds) -> (loss, aux)` for one micro-batch."""
  policy_loss = objectives.POLICY_LOSSES[cfg.loss]
  loss_kwargs = _config.to_kwargs(cfg.loss_kwargs)
  agg = _config.resolve_agg(cfg)
  kl_coef = float(cfg.kl_coef)
  entropy_coef = float(cfg.entropy_coef)

  def loss_fn(params, micro, agg_scale, bounds):
    mask = micro["loss_mask"]
    logp, entropy = _token_logprobs(params, micro, model_config, cfg, gathered)
    if entropy_coef == 0:
      entropy = jax.lax.stop_gradient(entropy)
    kwargs = dict(loss_kwargs)
    if bounds:
      # BAPO bounds are ratio values [c_low, c_high]; PPO clips r to
      # [1 - clip_low, 1 + clip_high], with BAPO's dual clip for A < 0.
      kwargs["clip_low"] = 1.0 - bounds["c_low"]
      kwargs["clip_high"] = bounds["c_high"] - 1.0
      kwargs["dual_clip"] = bounds["dual_clip"]
    if cfg.loss == "aspo":
      kwargs["entropy"] = jax.lax.stop_gradient(entropy)
    pl, pm = policy_loss(
      logp,
      micro["old_logp"],
      micro["advantages"],
      mask,
      is_weights=micro.get("is_weights"),
      agg=agg,
      agg_scale=agg_scale,
      **kwargs,
    )
    entropy_loss = objectives.aggregate(entropy, mask, agg, scale=agg_scale)
    loss = pl - entropy_coef * entropy_loss
    kl_loss = jnp.zeros((), jnp.float32)
    if kl_coef > 0:
      kl = objectives.kl_penalty(logp, micro["ref_logp"], cfg.kl_kind, mask=mask)
      kl_loss = objectives.aggregate(kl, mask, agg, scale=agg_scale)
      loss = loss + kl_coef * kl_loss
    n_tokens = jnp.sum(mask).astype(jnp.float32)
    aux = {
      "loss": loss,
      "policy_loss": pl,
      "kl_loss": kl_loss,
      "entropy_loss": entropy_loss,
      "entropy": jnp.sum(jnp.where(mask, entropy, 0.0)),
      "n_tokens": n_tokens,
      "policy_metrics": pm._asdict(),
    }
    return loss, aux

  return loss_fn


def _combine_micro_metrics(aux: dict) -> dict:
  """Per-micro-batch aux (stacked on axis 0) -> mini-batch metrics.

  Loss terms already carry the mini-batch denominator, so they are summed;
  per-token means are re-weighted by each micro-batch's valid-token count.
  """
  n = aux["n_tokens"]
  total = jnp.sum(n)
  safe_total = jnp.maximum(total, 1.0)
  out = {name: jnp.sum(aux[name]) for name in ("loss", "policy_loss", "kl_loss", "entropy_loss")}
  out["entropy"] = jnp.sum(aux["entropy"]) / safe_total
  for name, value in aux["policy_metrics"].items():
    value = jnp.asarray(value, jnp.float32)
    if name in _MAX_METRICS:
      out[name] = jnp.max(value)
    else:
      out[name] = jnp.sum(value * n) / safe_total
  return out


def _bapo_bounds(params, mini: dict, model_config: Any, cfg, split, gathered) -> dict:
  """BAPO clip bounds from a no-grad forward over the whole mini-batch."""

  def forward(_, micro):
    logp, _ = _token_logprobs(params, micro, model_config, cfg, gathered)
    return None, jax.lax.stop_gradient(logp)

  _, logp = jax.lax.scan(forward, None, split(mini, cfg.micro_batches))
  # Undo the strided split: [micro, rows, S] -> [rows * micro, S] in row order.
  logp = jnp.swapaxes(logp, 0, 1).reshape(mini["tokens"].shape)
  kwargs = _config.to_kwargs(cfg.bapo_kwargs)
  b = objectives.bapo_clip_bounds(
    logp, mini["old_logp"], mini["advantages"], mini["loss_mask"], **kwargs
  )
  return {
    "c_low": b.c_low,
    "c_high": b.c_high,
    "positive_share": b.positive_share,
    "dual_clip": kwargs.get("dual_clip", 3.0),
  }
