"""`StepSpec`: a train config validated and resolved once, into what the step's pieces read.

`make_train_step`, `make_step_fn` and `make_compute_logprobs` turn the
`ConfigDict` into one frozen `StepSpec` when they are built: the policy loss
(registry entry of `config.loss`, or `make_train_step(loss=...)`), the
aggregation mode behind "default", the keyword sections as read-only dicts,
and every number and flag as a plain Python value. The pieces of the step
(`_batch`, `_transforms`, `_update`, `_loss`, `_bapo`, `_forward`, `_gather`,
`_host`) read that value only, so no piece re-derives a setting, and a config
changed after the step was built changes nothing the step does.

  spec = StepSpec.from_config(config)          # validates, then resolves
  spec.loss.fn, spec.agg, spec.loss_kwargs     # PolicyLossSpec, "token-mean", {...}
"""

import copy
import dataclasses
import types
from collections.abc import Mapping
from typing import Any

import ml_collections

from rlx import objectives
from rlx.train import _config


@dataclasses.dataclass(frozen=True)
class StepSpec:
  """A validated train config, resolved for the train step (frozen, compared by value).

  Equal configs (and losses) give equal specs. Not hashable: the keyword
  sections are (read-only) mappings. Field names are those of `get_config()`
  where the field is the config's own, so a function reading e.g.
  `micro_batches` takes either.

  Attributes:
    loss: the policy loss, a `rlx.objectives.PolicyLossSpec`: the registry
      entry of `config.loss`, or the `loss=` of `make_train_step`.
    loss_name: `config.loss` (names the loss in messages).
    loss_kwargs: the loss's keyword hyper-parameters (`config.loss_kwargs`).
    agg: the aggregation mode of the loss, KL and entropy terms (`config.agg`,
      "default" resolved to `loss.default_agg`).
    kl_coef: KL penalty coefficient (0 = off).
    kl_kind: KL estimator (`rlx.objectives.kl_penalty` kind).
    entropy_coef: entropy bonus coefficient (0 = off).
    use_bapo: BAPO adaptive clip bounds before each update.
    bapo_kwargs: the keywords of `rlx.objectives.bapo_clip_bounds`
      (`config.bapo_kwargs`; with BAPO on a loss without dual clip, also
      `dual_clip=None`: no token loses its gradient to one).
    use_m2po: the M2PO second-moment mask.
    m2po_kwargs: the keywords of `rlx.objectives.m2po_mask`.
    use_rollout_correction: the rollout-mismatch correction.
    rollout_correction_kwargs: the keywords of `rlx.objectives.rollout_correction`.
    use_vcpo: the VCPO learning-rate factor.
    temperature: logits are divided by it before log-softmax.
    logprob_chunk_size: sequence chunk of `rlx.policy.token_logprobs` (0 = its default).
    gather_fsdp_params: all-gather FSDP-sharded params for each forward.
    gather_fsdp_per_layer: gather one decoder layer at a time.
    unroll_max_layers: unroll the differentiated forward up to this many layers.
    micro_batches: gradient-accumulation steps per update.
    mini_batches: optimizer updates per epoch.
    ppo_epochs: epochs over one rollout batch.
    shuffle: shuffle sequences between mini-batches each epoch.
    optimizer: the `config.optimizer` section (the logged learning-rate schedule).
    max_grad_norm: global-norm gradient clipping of the default optimizer (0 = off).
    nonfinite: "skip" or "raise".
    report_throughput: wait for each step and add host-timed metrics.
  """

  loss: objectives.PolicyLossSpec
  loss_name: str
  loss_kwargs: Mapping[str, Any]
  agg: str
  kl_coef: float
  kl_kind: str
  entropy_coef: float
  use_bapo: bool
  bapo_kwargs: Mapping[str, Any]
  use_m2po: bool
  m2po_kwargs: Mapping[str, Any]
  use_rollout_correction: bool
  rollout_correction_kwargs: Mapping[str, Any]
  use_vcpo: bool
  temperature: float
  logprob_chunk_size: int
  gather_fsdp_params: bool
  gather_fsdp_per_layer: bool
  unroll_max_layers: int
  micro_batches: int
  mini_batches: int
  ppo_epochs: int
  shuffle: bool
  optimizer: Mapping[str, Any]
  max_grad_norm: float
  nonfinite: str
  report_throughput: bool

  @property
  def updates_per_step(self) -> int:
    """Optimizer updates in one train step: `ppo_epochs * mini_batches`."""
    return self.ppo_epochs * self.mini_batches

  @classmethod
  def from_config(
    cls,
    config: ml_collections.ConfigDict,
    *,
    loss: objectives.PolicyLossSpec | None = None,
  ) -> "StepSpec":
    """Validates `config` (`validate_config`) and resolves it.

    Args:
      config: the train config (`get_config()`).
      loss: the policy loss instead of the registry entry of `config.loss`
        (`config.loss_kwargs` are checked against it).

    Returns:
      The `StepSpec`; it shares no mutable state with `config`.

    Raises:
      ValueError: naming the first invalid field (`validate_config`).
    """
    if loss is not None and not isinstance(loss, objectives.PolicyLossSpec):
      raise ValueError(
        f"`loss` must be a rlx.objectives.PolicyLossSpec or None, got {type(loss).__name__}."
      )
    _config.validate_config(config, spec=loss)
    loss = _config.loss_spec(config, loss)
    bapo_kwargs = _frozen(config.bapo_kwargs)
    if config.use_bapo and "dual_clip" not in loss.clip_keywords:
      bapo_kwargs = types.MappingProxyType(dict(bapo_kwargs, dual_clip=None))
    return cls(
      loss=loss,
      loss_name=str(config.loss),
      loss_kwargs=_frozen(config.loss_kwargs),
      agg=_config.resolve_agg(config, loss),
      kl_coef=float(config.kl_coef),
      kl_kind=str(config.kl_kind),
      entropy_coef=float(config.entropy_coef),
      use_bapo=bool(config.use_bapo),
      bapo_kwargs=bapo_kwargs,
      use_m2po=bool(config.use_m2po),
      m2po_kwargs=_frozen(config.m2po_kwargs),
      use_rollout_correction=bool(config.use_rollout_correction),
      rollout_correction_kwargs=_frozen(config.rollout_correction_kwargs),
      use_vcpo=bool(config.use_vcpo),
      temperature=float(config.temperature),
      logprob_chunk_size=int(config.logprob_chunk_size),
      gather_fsdp_params=bool(config.gather_fsdp_params),
      gather_fsdp_per_layer=bool(config.gather_fsdp_per_layer),
      unroll_max_layers=int(config.unroll_max_layers),
      micro_batches=int(config.micro_batches),
      mini_batches=int(config.mini_batches),
      ppo_epochs=int(config.ppo_epochs),
      shuffle=bool(config.shuffle),
      optimizer=_frozen(config.optimizer),
      max_grad_norm=float(config.max_grad_norm),
      nonfinite=str(config.nonfinite),
      report_throughput=bool(config.report_throughput),
    )


def as_step_spec(
  config: ml_collections.ConfigDict | StepSpec,
  *,
  loss: objectives.PolicyLossSpec | StepSpec | None = None,
) -> StepSpec:
  """The `StepSpec` of a builder's `(config, spec)` arguments, resolved at most once.

  Args:
    config: a train config, or an already resolved `StepSpec`.
    loss: a `StepSpec` resolved from `config` (returned as it is), or the
      policy loss to resolve `config` with (None: its registry entry).

  Returns:
    `loss` or `config` when either is a `StepSpec`, else
    `StepSpec.from_config(config, loss=loss)`.
  """
  if isinstance(loss, StepSpec):
    return loss
  if isinstance(config, StepSpec):
    if loss is not None:
      raise ValueError("`spec` must be None when `cfg` is a StepSpec (it holds its loss already).")
    return config
  return StepSpec.from_config(config, loss=loss)


def _frozen(section: Any) -> Mapping[str, Any]:
  """A read-only deep copy of a config section (`to_kwargs`: nested dicts made plain)."""
  return types.MappingProxyType(copy.deepcopy(_config.to_kwargs(section)))
