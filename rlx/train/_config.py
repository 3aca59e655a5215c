"""Training configuration: `get_config()` defaults and their validation.

A researcher changes the objective with one field (`config.loss = "gspo"`);
the train step stays one compiled, sharded function. The returned ConfigDict is
locked, so a misspelt field is an error rather than a silently ignored new
one; the free-form keyword sections (`loss_kwargs`, `bapo_kwargs`,
`m2po_kwargs`, `rollout_correction_kwargs`) stay open and are checked against
the signature of the function they feed. Layout after flax's `configs/default.py`
(https://github.com/google/flax/tree/main/examples/lm1b/configs) and
big_vision's configs (https://github.com/google-research/big_vision):

  config = rlx.train.get_config()
  config.loss = "cispo"
  config.loss_kwargs = {"clip_high": 0.28}
"""

import inspect
import math
from collections.abc import Callable
from typing import Any

import ml_collections
import numpy as np

from rlx import objectives
from rlx._choices import check_choice

SCHEDULES = ("constant", "warmup_cosine")
NONFINITE_MODES = ("skip", "raise")
# Sections holding keyword arguments of a function (open for new keys), and
# the function whose keywords they may name.
KWARGS_SECTIONS = ("loss_kwargs", "bapo_kwargs", "m2po_kwargs", "rollout_correction_kwargs")
# Keywords of the loss that the step itself passes (never from `loss_kwargs`).
_STEP_OWNED_LOSS_KEYWORDS = ("is_weights", "agg", "agg_scale")


def get_config() -> ml_collections.ConfigDict:
  """Default train config: token-mean PPO clip, AdamW, one update per batch.

  Returns:
    A locked `ml_collections.ConfigDict` (assigning an unknown field raises);
    every field is commented below.
  """
  c = ml_collections.ConfigDict()
  # --- objective ---
  # Policy loss: any key of rlx.objectives.POLICY_LOSS_SPECS: the built-ins
  # ("ppo", "gspo", "ctpo", "minpro", "cispo", "sapo", "aspo", "vespo", "sat", "m2po") and any loss
  # registered with rlx.objectives.register_policy_loss.
  c.loss = "ppo"
  # Keyword hyper-parameters of the loss (clip_low, clip_high, dual_clip, ...);
  # empty = the loss's own defaults. Checked against the loss's signature.
  c.loss_kwargs = ml_collections.ConfigDict()
  # Loss aggregation mode (rlx.objectives.aggregate), also used for the KL and
  # entropy terms; "default" = the loss's registered default
  # (`PolicyLossSpec.default_agg`: seq-mean-token-mean for gspo, token-mean for ppo).
  c.agg = "default"
  # BAPO adaptive clip bounds (rlx.objectives.bapo_clip_bounds), computed inside
  # the step on each mini-batch and passed to the loss through the clip keywords
  # its registry spec declares (`PolicyLossSpec.clip_keywords`; needs clip_low and
  # clip_high). Those keywords must then not be set in loss_kwargs.
  c.use_bapo = False
  c.bapo_kwargs = ml_collections.ConfigDict()
  # M2PO second-moment mask (rlx.objectives.m2po_mask) on old vs rollout logp;
  # needs `rollout_logp` in the batch.
  c.use_m2po = False
  c.m2po_kwargs = ml_collections.ConfigDict()
  # Rollout-mismatch correction (rlx.objectives.rollout_correction) of the
  # sampled tokens: its weights become the loss's `is_weights` and its mask is
  # combined with the loss mask. Needs `rollout_logp` in the batch.
  c.use_rollout_correction = False
  c.rollout_correction_kwargs = ml_collections.ConfigDict()
  # VCPO: scale every update by sqrt(min(1, ESS)) of the batch's sequence IS
  # weights prod_t pi_old / pi_rollout over the sampled tokens
  # (rlx.objectives.vcpo_lr_factor); needs `rollout_logp` in the batch.
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
  # forward (more memory, fewer collectives).
  c.gather_fsdp_per_layer = True
  # The differentiated forward runs the decoder blocks as a Python loop
  # (rlx.policy `unroll=True`) instead of the layer scan when the model has at
  # most this many layers: the backward pass then needs no stacked per-layer
  # residual buffers (zero-filled, written and sliced by the scan every step),
  # the same values at a longer compile. 0 = always the scan; so are the
  # no-gradient forwards (compute_logprobs, BAPO) and a step that gathers FSDP
  # params one layer at a time (gather_fsdp_per_layer on an "fsdp" axis > 1).
  c.unroll_max_layers = 4
  # --- optimisation ---
  # Global-norm gradient clipping (finite); 0 disables it.
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
  # True: wait for each step on host and add step_time_s, tokens_per_second and
  # loss_tokens_per_second to its metrics (a host sync per step). False (default)
  # keeps dispatch asynchronous; `TrainStep.throughput.read()` measures the same
  # over a window of steps with one sync when read.
  c.report_throughput = False
  c.lock()
  for section in KWARGS_SECTIONS:
    c[section].unlock()
  return c


def validate_config(
  config: ml_collections.ConfigDict, *, spec: objectives.PolicyLossSpec | None = None
) -> None:
  """Raises ValueError naming the first invalid field of a train config.

  Checks every field's value, that the config has exactly the fields of
  `get_config()` (a misspelt or missing field is named, also in an unlocked
  copy), and that each `*_kwargs` section names only keywords of its function.

  Args:
    config: the train config.
    spec: the policy loss to check `loss_kwargs` against instead of the
      registry entry of `config.loss` (`make_train_step(loss=...)`).
  """
  _check_fields(config, get_config(), "config")
  _check_numbers_and_flags(config)
  spec = loss_spec(config, spec)
  check_choice(config.agg, objectives.AGG_MODES + ("default",), "config.agg")
  check_choice(config.kl_kind, objectives.KL_KINDS, "config.kl_kind")
  check_choice(config.optimizer.schedule, SCHEDULES, "config.optimizer.schedule")
  check_choice(config.nonfinite, NONFINITE_MODES, "config.nonfinite")
  _check_keywords(
    config.loss_kwargs,
    spec.fn,
    "config.loss_kwargs",
    exclude=_STEP_OWNED_LOSS_KEYWORDS + spec.extra_inputs,
  )
  _check_keywords(config.bapo_kwargs, objectives.bapo_clip_bounds, "config.bapo_kwargs")
  _check_keywords(config.m2po_kwargs, objectives.m2po_mask, "config.m2po_kwargs")
  _check_keywords(
    config.rollout_correction_kwargs,
    objectives.rollout_correction,
    "config.rollout_correction_kwargs",
    exclude=("sampled_mask",),
  )
  if config.use_bapo:
    _check_bapo(config, spec)
  opt = config.optimizer
  if opt.schedule == "warmup_cosine" and opt.decay_steps <= opt.warmup_steps:
    raise ValueError(
      f"`config.optimizer.decay_steps` ({opt.decay_steps}) must exceed warmup_steps "
      f"({opt.warmup_steps}) for the warmup_cosine schedule."
    )


def _check_numbers_and_flags(config: ml_collections.ConfigDict) -> None:
  """Every entry of `FIELD_RULES`, in order: its kind, then its range."""
  for path, rule in FIELD_RULES.items():
    value = config
    for part in path.split("."):
      value = value[part]
    name = f"config.{path}"
    if rule == "bool":
      if not isinstance(value, bool | np.bool_):
        raise ValueError(f"`{name}` must be a bool, got {value!r}.")
      continue
    kind, low, low_open, high, high_open = rule
    is_int = isinstance(value, int | np.integer) and not isinstance(value, bool | np.bool_)
    is_real = is_int or isinstance(value, float | np.floating)
    expected = _describe(rule)
    if (kind == "int" and not is_int) or not is_real:
      raise ValueError(f"`{name}` must be {expected}, got {value!r}.")
    number = float(value)
    below = number <= low if low_open else number < low
    above = high is not None and (number >= high if high_open else number > high)
    if not math.isfinite(number) or below or above:
      raise ValueError(f"`{name}` must be {expected}, got {value!r}.")


def _describe(rule: tuple) -> str:
  kind, low, low_open, high, high_open = rule
  what = "an int (not a bool)" if kind == "int" else "a finite real number"
  if high is None:
    return f"{what} {'>' if low_open else '>='} {low:g}"
  left, right = "(" if low_open else "[", ")" if high_open else "]"
  return f"{what} in {left}{low:g}, {high:g}{right}"


# Every bool and number field of get_config(): "bool", or (kind, low, low_open,
# high, high_open) for a finite value of `kind` ("int" refuses floats and bools;
# "float" takes ints and floats, never bools) in the interval between low and
# high (None = unbounded), open at a bound whose flag is True. Checked by
# validate_config; `test_every_field_has_a_rule` keeps it complete.
FIELD_RULES: dict[str, Any] = {
  "use_bapo": "bool",
  "use_m2po": "bool",
  "use_rollout_correction": "bool",
  "use_vcpo": "bool",
  "kl_coef": ("float", 0.0, False, None, False),
  "entropy_coef": ("float", 0.0, False, None, False),
  "temperature": ("float", 0.0, True, None, False),
  "logprob_chunk_size": ("int", 0, False, None, False),
  "gather_fsdp_params": "bool",
  "gather_fsdp_per_layer": "bool",
  "unroll_max_layers": ("int", 0, False, None, False),
  # 0 disables clipping; +inf is refused (use 0 for "off").
  "max_grad_norm": ("float", 0.0, False, None, False),
  "optimizer.learning_rate": ("float", 0.0, False, None, False),
  "optimizer.b1": ("float", 0.0, False, 1.0, True),
  "optimizer.b2": ("float", 0.0, False, 1.0, True),
  "optimizer.eps": ("float", 0.0, True, None, False),
  "optimizer.weight_decay": ("float", 0.0, False, None, False),
  "optimizer.warmup_steps": ("int", 0, False, None, False),
  "optimizer.decay_steps": ("int", 1, False, None, False),
  "optimizer.end_lr_ratio": ("float", 0.0, False, 1.0, False),
  "micro_batches": ("int", 1, False, None, False),
  "ppo_epochs": ("int", 1, False, None, False),
  "mini_batches": ("int", 1, False, None, False),
  "shuffle": "bool",
  "report_throughput": "bool",
}
# Fields checked against a fixed set of choices instead (see validate_config).
CHOICE_FIELDS = ("loss", "agg", "kl_kind", "optimizer.schedule", "nonfinite")


def loss_spec(
  config: ml_collections.ConfigDict, spec: objectives.PolicyLossSpec | None = None
) -> objectives.PolicyLossSpec:
  """The registry entry (`rlx.objectives.PolicyLossSpec`) of `config.loss` (or `spec`, if given)."""
  if spec is not None:
    return spec
  if config.loss not in objectives.POLICY_LOSS_SPECS:
    raise ValueError(
      f"`config.loss` must be one of {sorted(objectives.POLICY_LOSS_SPECS)}, got {config.loss!r}."
    )
  return objectives.get_policy_loss_spec(config.loss)


def resolve_agg(
  config: ml_collections.ConfigDict, spec: objectives.PolicyLossSpec | None = None
) -> str:
  """The aggregation mode of a config: `config.agg`, or the loss's registered default."""
  if config.agg != "default":
    return config.agg
  return loss_spec(config, spec).default_agg


def to_kwargs(section: Any) -> dict:
  """A kwargs dict from a ConfigDict section (nested dicts made plain)."""
  if section is None:
    return {}
  if isinstance(section, ml_collections.ConfigDict):
    return section.to_dict()
  return dict(section)


def _check_fields(config: Any, defaults: ml_collections.ConfigDict, name: str) -> None:
  """Same field names as `defaults`, recursively (kwargs sections are free-form)."""
  if not isinstance(config, ml_collections.ConfigDict | dict):
    raise ValueError(f"`{name}` must be a ConfigDict (get_config()), got {type(config).__name__}.")
  have, want = set(config.keys()), set(defaults.keys())
  unknown, missing = sorted(have - want), sorted(want - have)
  if unknown or missing:
    raise ValueError(
      f"`{name}` has unknown fields {unknown} and lacks fields {missing}; "
      f"the fields are those of rlx.train.get_config(): {sorted(want)}."
    )
  for key in want:
    if isinstance(defaults[key], ml_collections.ConfigDict) and key not in KWARGS_SECTIONS:
      _check_fields(config[key], defaults[key], f"{name}.{key}")


def _check_keywords(
  section: Any, fn: Callable, name: str, *, exclude: tuple[str, ...] = ()
) -> None:
  """Every key of `section` is a keyword-only parameter of `fn` (minus `exclude`)."""
  allowed = sorted(
    p.name
    for p in inspect.signature(fn).parameters.values()
    if p.kind is inspect.Parameter.KEYWORD_ONLY and p.name not in exclude
  )
  unknown = sorted(set(to_kwargs(section)) - set(allowed))
  if unknown:
    raise ValueError(
      f"`{name}` has unknown keywords {unknown}; {fn.__name__} takes {allowed}"
      + (f" (the step passes {sorted(exclude)} itself)." if exclude else ".")
    )


def _check_bapo(config: ml_collections.ConfigDict, spec: objectives.PolicyLossSpec) -> None:
  """BAPO needs the loss's ratio clip keywords, and owns them."""
  if not {"clip_low", "clip_high"} <= set(spec.clip_keywords):
    raise ValueError(
      f"`config.use_bapo` needs a loss whose registry spec declares the clip keywords "
      f"clip_low and clip_high; {config.loss!r} declares {spec.clip_keywords}."
    )
  conflicts = sorted(set(to_kwargs(config.loss_kwargs)) & set(spec.clip_keywords))
  if conflicts:
    raise ValueError(
      f"`config.loss_kwargs` sets {conflicts}, which BAPO sets from its adaptive bounds "
      "(`config.use_bapo`); configure them through `config.bapo_kwargs` (c_low, c_high, "
      "dual_clip, ...) instead."
    )
  if "dual_clip" not in spec.clip_keywords and "dual_clip" in to_kwargs(config.bapo_kwargs):
    raise ValueError(
      f"`config.bapo_kwargs.dual_clip` is set, but loss {config.loss!r} has no dual clip "
      f"(its clip keywords are {spec.clip_keywords})."
    )
