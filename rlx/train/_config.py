"""Training configuration: `get_config()` defaults and their validation.

A researcher changes the objective with one field (`config.loss = "gspo"`);
the train step stays one compiled, sharded function. Launch commands live in
the experiment configs that start from these defaults, e.g.

  config = rlx.train.get_config()
  config.loss = "cispo"
  config.loss_kwargs = {"clip_high": 0.28}
"""

import inspect
from typing import Any

import ml_collections

from rlx import objectives

AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
KL_KINDS = ("k1", "abs", "k2", "k3", "low_var_kl", "k3+")
SCHEDULES = ("constant", "warmup_cosine")
NONFINITE_MODES = ("skip", "raise")


def get_config() -> ml_collections.ConfigDict:
  """Default `TrainConfig`: token-mean PPO clip, AdamW, one update per batch.

  Returns:
    A `ml_collections.ConfigDict`; every field is commented below.
  """
  c = ml_collections.ConfigDict()
  # --- objective ---
  # Policy loss: any key of rlx.objectives.POLICY_LOSSES
  # ("ppo", "gspo", "ctpo", "minpro", "cispo", "sapo", "aspo").
  c.loss = "ppo"
  # Keyword hyper-parameters of the loss (clip_low, clip_high, dual_clip, ...);
  # empty = the loss's own defaults.
  c.loss_kwargs = ml_collections.ConfigDict()
  # Loss aggregation mode (rlx.objectives.aggregate), also used for the KL and
  # entropy terms; "default" = the policy loss's own default `agg` (e.g.
  # seq-mean-token-mean for gspo, token-mean for ppo).
  c.agg = "default"
  # BAPO adaptive clip bounds (rlx.objectives.bapo_clip_bounds), computed inside
  # the step on each mini-batch and passed to the loss as clip bounds. Only for
  # loss="ppo".
  c.use_bapo = False
  c.bapo_kwargs = ml_collections.ConfigDict()
  # M2PO second-moment mask (rlx.objectives.m2po_mask) on old vs rollout logp;
  # needs `rollout_logp` in the batch.
  c.use_m2po = False
  c.m2po_kwargs = ml_collections.ConfigDict()
  # Rollout-mismatch correction (rlx.objectives.rollout_correction): its
  # weights become the loss's `is_weights` and its mask replaces the loss mask.
  # Needs `rollout_logp` in the batch.
  c.use_rollout_correction = False
  c.rollout_correction_kwargs = ml_collections.ConfigDict()
  # VCPO: scale every update by sqrt(min(1, ESS)) of the batch's sequence IS
  # weights prod_t pi_old / pi_rollout (rlx.objectives.vcpo_lr_factor); needs
  # `rollout_logp` in the batch.
  c.use_vcpo = False
  # KL(current || frozen reference) penalty coefficient; 0 disables it. When
  # > 0 the batch must carry `ref_logp` (see compute_logprobs).
  c.kl_coef = 0.0
  # KL estimator (rlx.objectives.kl_penalty kind).
  c.kl_kind = "low_var_kl"
  # Entropy bonus coefficient (loss -= entropy_coef * aggregated entropy).
  c.entropy_coef = 0.0
  # Sampling temperature: logits are divided by it before log-softmax, the same
  # as the sampler did when recording rollout_logp.
  c.temperature = 1.0
  # Sequence chunk of rlx.policy.token_logprobs; 0 = the policy's default.
  c.logprob_chunk_size = 0
  # All-gather the FSDP-sharded params for each (micro-batch) forward (ZeRO-3:
  # params/grads/optimizer state stay sharded; the gradient of the gather is a
  # reduce-scatter). False leaves the layout to XLA's sharding propagation,
  # which may replicate the batch instead.
  c.gather_fsdp_params = True
  # With gather_fsdp_params: gather one decoder layer at a time inside the
  # policy's layer scan (rlx.policy `layer_params_fn`; the backward pass
  # re-gathers each layer), so gathered weights cost about one layer of memory
  # rather than the whole model. False gathers the whole param tree before the
  # forward (the previous behaviour; kept for comparison).
  c.gather_fsdp_per_layer = True
  # --- optimisation ---
  # Global-norm gradient clipping; 0 disables it.
  c.max_grad_norm = 1.0
  c.optimizer = ml_collections.ConfigDict()
  c.optimizer.learning_rate = 1e-6  # peak learning rate
  c.optimizer.b1 = 0.9
  c.optimizer.b2 = 0.999
  c.optimizer.eps = 1e-8
  c.optimizer.weight_decay = 0.0  # AdamW decoupled weight decay
  # "constant" (after a linear warmup) or "warmup_cosine" (linear warmup then
  # cosine decay to end_lr_ratio * learning_rate at decay_steps).
  c.optimizer.schedule = "constant"
  c.optimizer.warmup_steps = 0  # in optimizer updates
  c.optimizer.decay_steps = 1000  # in optimizer updates (warmup_cosine only)
  c.optimizer.end_lr_ratio = 0.0
  # --- batching ---
  # Gradient-accumulation steps per optimizer update (micro-batches of each
  # mini-batch); the loss denominator is always the mini-batch's.
  c.micro_batches = 1
  # PPO epochs over one rollout batch.
  c.ppo_epochs = 1
  # Optimizer updates per epoch: the batch is split into this many mini-batches.
  c.mini_batches = 1
  # Shuffle sequences between mini-batches each epoch (rng folded from step).
  c.shuffle = True
  # --- robustness ---
  # A non-finite loss or gradient skips that update ("skip", counted in the
  # metrics) or, in addition, raises NonFiniteError on host after the step.
  c.nonfinite = "skip"
  # --- metrics ---
  # Wait for each step on host and report step_time_s, tokens_per_second and
  # loss_tokens_per_second (wall clock; the first step includes compilation).
  # False keeps dispatch asynchronous and omits these three metrics.
  c.report_throughput = True
  return c


def validate_config(config: ml_collections.ConfigDict) -> None:
  """Raises ValueError naming the first invalid field of a train config."""
  if config.loss not in objectives.POLICY_LOSSES:
    raise ValueError(
      f"`config.loss` must be one of {sorted(objectives.POLICY_LOSSES)}, got {config.loss!r}."
    )
  _choice(config.agg, AGG_MODES + ("default",), "config.agg")
  _choice(config.kl_kind, KL_KINDS, "config.kl_kind")
  _choice(config.optimizer.schedule, SCHEDULES, "config.optimizer.schedule")
  _choice(config.nonfinite, NONFINITE_MODES, "config.nonfinite")
  if config.use_bapo and config.loss != "ppo":
    raise ValueError(f"`config.use_bapo` needs config.loss == 'ppo', got {config.loss!r}.")
  for name in ("micro_batches", "ppo_epochs", "mini_batches"):
    value = config[name]
    if not isinstance(value, int) or value < 1:
      raise ValueError(f"`config.{name}` must be an int >= 1, got {value!r}.")
  for name in ("kl_coef", "entropy_coef", "max_grad_norm", "logprob_chunk_size"):
    if config[name] < 0:
      raise ValueError(f"`config.{name}` must be >= 0, got {config[name]!r}.")
  if not config.temperature > 0:
    raise ValueError(f"`config.temperature` must be > 0, got {config.temperature!r}.")
  opt = config.optimizer
  if not opt.learning_rate >= 0:
    raise ValueError(f"`config.optimizer.learning_rate` must be >= 0, got {opt.learning_rate}.")
  if opt.warmup_steps < 0:
    raise ValueError(f"`config.optimizer.warmup_steps` must be >= 0, got {opt.warmup_steps}.")
  if opt.schedule == "warmup_cosine" and opt.decay_steps <= opt.warmup_steps:
    raise ValueError(
      f"`config.optimizer.decay_steps` ({opt.decay_steps}) must exceed warmup_steps "
      f"({opt.warmup_steps}) for the warmup_cosine schedule."
    )


def resolve_agg(config: ml_collections.ConfigDict) -> str:
  """The aggregation mode of a config: `config.agg`, or the loss's default."""
  if config.agg != "default":
    return config.agg
  parameter = inspect.signature(objectives.POLICY_LOSSES[config.loss]).parameters.get("agg")
  if parameter is None or parameter.default not in AGG_MODES:
    raise ValueError(
      f"Loss {config.loss!r} has no default `agg`; set config.agg to one of {AGG_MODES}."
    )
  return parameter.default


def to_kwargs(section: Any) -> dict:
  """A kwargs dict from a ConfigDict section (nested dicts made plain)."""
  if section is None:
    return {}
  if isinstance(section, ml_collections.ConfigDict):
    return section.to_dict()
  return dict(section)


def _choice(value: Any, choices: tuple, name: str) -> None:
  if value not in choices:
    raise ValueError(f"`{name}` must be one of {choices}, got {value!r}.")
