"""Name -> policy loss registry, for choosing the loss from a config string.

Each entry is a `PolicyLossSpec` that declares what a caller (e.g. a train
step) must know about the loss without special-casing it by name: the extra
data inputs it reads, its default aggregation mode, which keywords take
PPO-style ratio clip bounds (so an adaptive-bound scheme such as BAPO knows
what it may set), and whether its entropy input carries a gradient.

The built-in losses are registered here; a researcher's own loss joins them
with `register_policy_loss` and is then selected by name like any other
(`train.loss = "my_loss"`, see `rlx.train.get_config`);
`unregister_policy_loss` removes it again.
"""

import inspect
from collections.abc import Callable, Iterator, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from rlx.objectives._aggregate import AGG_MODES
from rlx.objectives._aspo import aspo_loss
from rlx.objectives._cispo import cispo_loss
from rlx.objectives._ctpo import ctpo_loss
from rlx.objectives._gspo import gspo_loss
from rlx.objectives._m2po import m2po_loss
from rlx.objectives._metrics import PolicyLossMetrics
from rlx.objectives._minpro import minpro_loss
from rlx.objectives._ppo import ppo_clip_loss
from rlx.objectives._sapo import sapo_loss
from rlx.objectives._sat import sat_loss
from rlx.objectives._vespo import vespo_loss

_RATIO_CLIPS = ("clip_low", "clip_high", "dual_clip")
# Data inputs every policy loss takes positionally, in this order.
DATA_INPUTS = ("logp", "old_logp", "advantages", "mask")
# Keyword-only parameters every policy loss has (the caller passes them).
COMMON_KEYWORDS = ("is_weights", "agg", "agg_scale")
# Extra per-token data inputs a caller such as the train step can provide.
EXTRA_INPUTS = ("entropy",)


class PolicyLossSpec(NamedTuple):
  """What a policy loss needs from its caller.

  Every loss has the signature
  `fn(logp, old_logp, advantages, mask, *, <hyper-parameters>, <extra inputs>,
  is_weights=None, agg=default_agg, agg_scale=None) -> (loss, PolicyLossMetrics)`
  with `[B, T]` data arrays.

  Attributes:
    fn: the pure loss function.
    extra_inputs: keyword DATA inputs beyond `(logp, old_logp, advantages,
      mask)` (and the common `is_weights`), each `[B, T]`, e.g.
      `("entropy",)` for ASPO; `()` otherwise. Names from `EXTRA_INPUTS`.
    default_agg: the default of the loss's `agg` keyword (one of `AGG_MODES`).
    clip_keywords: the keywords that take ratio clip bounds in PPO's
      convention: `clip_low`/`clip_high` bound the ratio to
      `[1 - clip_low, 1 + clip_high]` and `dual_clip` caps the ratio of A < 0
      tokens at `c`. An adaptive-bound scheme (e.g. `bapo_clip_bounds`) sets
      exactly these; a caller that also sets them in its loss kwargs has two
      sources for one bound and should raise. Losses whose bounds mean
      something else (CTPO's position-scaled log-space window, SAPO's
      temperatures, VESPO's kernel) declare `()`. SAT declares PPO's: its
      `clip_low`/`clip_high` are the nominal radii it contracts per token.
    differentiable_entropy: whether the `entropy` input keeps its gradient
      with respect to the policy params (a loss that shapes the entropy
      itself); False (every built-in) passes it detached.
  """

  fn: Callable
  extra_inputs: tuple[str, ...]
  default_agg: str
  clip_keywords: tuple[str, ...]
  differentiable_entropy: bool = False

  def hyperparameters(self) -> tuple[str, ...]:
    """The loss's own keyword hyper-parameters (what `train.loss_kwargs` may set)."""
    skip = set(COMMON_KEYWORDS) | set(self.extra_inputs)
    return tuple(
      p.name
      for p in inspect.signature(self.fn).parameters.values()
      if p.kind is inspect.Parameter.KEYWORD_ONLY and p.name not in skip
    )


def policy_loss_spec(
  fn: Callable,
  *,
  extra_inputs: tuple[str, ...] = (),
  clip_keywords: tuple[str, ...] = (),
  default_agg: str | None = None,
  differentiable_entropy: bool = False,
  check_outputs: bool = True,
) -> PolicyLossSpec:
  """Builds and validates the `PolicyLossSpec` of a policy loss function.

  The function must take `(logp, old_logp, advantages, mask)` as its first four
  positional parameters and have the keyword-only parameters `is_weights`,
  `agg` and `agg_scale` (plus its own hyper-parameters and any
  `extra_inputs`). With `check_outputs`, it is traced once abstractly
  (`jax.eval_shape`, nothing runs or compiles) on `[2, 3]` inputs to check it
  returns `(float scalar loss, PolicyLossMetrics)`.

  Args:
    fn: the loss function.
    extra_inputs: keyword data inputs it reads, from `EXTRA_INPUTS`.
    clip_keywords: keyword-only parameters taking PPO-convention ratio clip
      bounds (`clip_low`, `clip_high`, `dual_clip`), set by BAPO.
    default_agg: its default aggregation mode; None reads the default of its
      `agg` parameter.
    differentiable_entropy: pass the `entropy` input with its gradient.
    check_outputs: trace `fn` abstractly to check what it returns.

  Returns:
    The `PolicyLossSpec`.

  Raises:
    ValueError: naming what does not match the contract.
  """
  if not callable(fn):
    raise ValueError(f"`fn` must be callable, got {type(fn).__name__}.")
  name = getattr(fn, "__name__", repr(fn))
  params = inspect.signature(fn).parameters
  positional = [
    p.name
    for p in params.values()
    if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
  ]
  if tuple(positional[:4]) != DATA_INPUTS or any(
    params[p].default is inspect.Parameter.empty for p in positional[4:]
  ):
    raise ValueError(
      f"Policy loss {name}: its positional parameters must be {DATA_INPUTS} (data arrays "
      f"`[B, T]`), got {tuple(positional)}."
    )
  keyword_only = {p.name for p in params.values() if p.kind is inspect.Parameter.KEYWORD_ONLY}
  missing = [k for k in COMMON_KEYWORDS if k not in keyword_only]
  if missing:
    raise ValueError(
      f"Policy loss {name}: needs the keyword-only parameters {list(COMMON_KEYWORDS)} "
      f"(rollout-correction weights, aggregation mode and its global denominator); "
      f"missing {missing}."
    )
  extra_inputs, clip_keywords = tuple(extra_inputs), tuple(clip_keywords)
  unknown = sorted(set(extra_inputs) - set(EXTRA_INPUTS))
  if unknown:
    raise ValueError(
      f"`extra_inputs` of {name}: {unknown} cannot be provided; the available extra "
      f"inputs are {EXTRA_INPUTS}."
    )
  for arg, names in (("extra_inputs", extra_inputs), ("clip_keywords", clip_keywords)):
    absent = sorted(set(names) - keyword_only)
    if absent:
      raise ValueError(f"`{arg}` of {name}: {absent} are not keyword-only parameters of it.")
  bad_clips = sorted(set(clip_keywords) - set(_RATIO_CLIPS))
  if bad_clips:
    raise ValueError(f"`clip_keywords` of {name}: {bad_clips} are not among {_RATIO_CLIPS}.")
  if differentiable_entropy and "entropy" not in extra_inputs:
    raise ValueError(
      f"`differentiable_entropy` of {name} needs 'entropy' in `extra_inputs`, got {extra_inputs}."
    )
  if default_agg is None:
    default_agg = params["agg"].default
  if default_agg not in AGG_MODES:
    raise ValueError(
      f"Policy loss {name}: its default aggregation (`default_agg`, or the default of its `agg` "
      f"parameter) must be one of {AGG_MODES}, got {default_agg!r}."
    )
  spec = PolicyLossSpec(
    fn=fn,
    extra_inputs=extra_inputs,
    default_agg=default_agg,
    clip_keywords=clip_keywords,
    differentiable_entropy=bool(differentiable_entropy),
  )
  if check_outputs:
    _check_outputs(spec, name)
  return spec


def _check_outputs(spec: PolicyLossSpec, name: str) -> None:
  """Traces `spec.fn` abstractly on `[2, 3]` inputs; checks `(scalar, PolicyLossMetrics)`."""
  x = jax.ShapeDtypeStruct((2, 3), jnp.float32)
  extra = {k: x for k in spec.extra_inputs}
  try:
    out = jax.eval_shape(
      lambda *a, **k: spec.fn(*a, agg=spec.default_agg, **k), x, x, x, x, **extra
    )
  except Exception as e:  # the user's code: say which call failed, keep the cause
    raise ValueError(
      f"Policy loss {name} failed when traced on [2, 3] float32 inputs with its default "
      f"hyper-parameters: {type(e).__name__}: {e}"
    ) from e
  ok = isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], PolicyLossMetrics)
  if ok:
    loss = out[0]
    ok = getattr(loss, "shape", None) == () and jnp.issubdtype(loss.dtype, jnp.floating)
  if not ok:
    raise ValueError(
      f"Policy loss {name} must return (loss, metrics) with a float scalar loss and "
      f"rlx.objectives.PolicyLossMetrics metrics (build them with "
      f"rlx.objectives.policy_loss_metrics), got {jax.tree.map(lambda a: a.shape, out)}."
    )


_SPECS: dict[str, PolicyLossSpec] = {}
_BUILTIN = ("ppo", "gspo", "ctpo", "minpro", "cispo", "sapo", "aspo", "vespo", "sat", "m2po")


class _View(Mapping):
  """A read-only live view of the registry (registrations show up in it)."""

  def __init__(self, value: Callable[[PolicyLossSpec], Any]):
    self._value = value

  def __getitem__(self, name: str) -> Any:
    return self._value(_SPECS[name])

  def __iter__(self) -> Iterator[str]:
    return iter(_SPECS)

  def __len__(self) -> int:
    return len(_SPECS)

  def __repr__(self) -> str:
    return f"{type(self).__name__}({dict(self)!r})"


POLICY_LOSS_SPECS: Mapping[str, PolicyLossSpec] = _View(lambda spec: spec)
"""Read-only view: loss name -> `PolicyLossSpec` (built-ins and registered losses)."""

POLICY_LOSSES: Mapping[str, Callable] = _View(lambda spec: spec.fn)
"""Read-only view: loss name -> loss function."""


def register_policy_loss(
  name: str,
  fn: Callable,
  *,
  extra_inputs: tuple[str, ...] = (),
  clip_keywords: tuple[str, ...] = (),
  default_agg: str | None = None,
  differentiable_entropy: bool = False,
  overwrite: bool = False,
) -> PolicyLossSpec:
  """Registers a policy loss under `name`, validated like a built-in (`policy_loss_spec`).

  Afterwards `name` is a key of `POLICY_LOSS_SPECS` / `POLICY_LOSSES`, so a
  train config selects it with `loss = name` and `loss_kwargs` sets its
  hyper-parameters (checked against its signature).

  Example:
    def my_loss(logp, old_logp, advantages, mask, *, clip=0.2,
                is_weights=None, agg="token-mean", agg_scale=None):
      ratio = jnp.exp(logp - old_logp)
      per_token = -jnp.minimum(ratio * advantages,
                               jnp.clip(ratio, 1 - clip, 1 + clip) * advantages)
      loss = rlx.objectives.aggregate(per_token, mask, agg, scale=agg_scale)
      return loss, rlx.objectives.policy_loss_metrics(
          mask != 0, log_ratio=logp - old_logp, ratio=ratio)

    rlx.objectives.register_policy_loss("my_loss", my_loss)

  Args:
    name: the registry key (a non-empty str).
    fn: the loss function (see `policy_loss_spec` for its contract).
    extra_inputs / clip_keywords / default_agg / differentiable_entropy: as
      in `policy_loss_spec`.
    overwrite: replace a registered loss of the same name (built-ins excepted)
      instead of raising, e.g. when a module is imported twice.

  Returns:
    The registered `PolicyLossSpec`.

  Raises:
    ValueError: a bad name, a taken name, or a loss that breaks the contract.
  """
  if not isinstance(name, str) or not name or name != name.strip():
    raise ValueError(f"`name` must be a non-empty str without surrounding spaces, got {name!r}.")
  if name in _BUILTIN:
    raise ValueError(f"`name` {name!r} is a built-in loss and cannot be replaced.")
  if name in _SPECS and not overwrite:
    raise ValueError(
      f"A policy loss named {name!r} is already registered; pass overwrite=True to replace it."
    )
  spec = policy_loss_spec(
    fn,
    extra_inputs=extra_inputs,
    clip_keywords=clip_keywords,
    default_agg=default_agg,
    differentiable_entropy=differentiable_entropy,
  )
  _SPECS[name] = spec
  return spec


def unregister_policy_loss(name: str) -> PolicyLossSpec:
  """Removes the loss registered under `name` by `register_policy_loss`.

  Afterwards `name` is free again (`register_policy_loss` takes it without
  `overwrite`), e.g. to drop a loss tried in a notebook or to restore the
  registry after registering losses for a test. The returned spec registers
  the same loss again:

    spec = rlx.objectives.unregister_policy_loss("my_loss")
    rlx.objectives.register_policy_loss(
        "my_loss", spec.fn, extra_inputs=spec.extra_inputs,
        clip_keywords=spec.clip_keywords, default_agg=spec.default_agg,
        differentiable_entropy=spec.differentiable_entropy)

  Args:
    name: the key of a registered loss (not a built-in).

  Returns:
    The removed `PolicyLossSpec`.

  Raises:
    ValueError: `name` is a built-in loss, or no loss is registered under it.
  """
  if isinstance(name, str) and name in _BUILTIN:
    raise ValueError(f"`name` {name!r} is a built-in loss and cannot be removed.")
  try:
    return _SPECS.pop(name)
  except (KeyError, TypeError):
    registered = tuple(n for n in _SPECS if n not in _BUILTIN)
    raise ValueError(
      f"`name` must be a registered loss, one of {registered}, got {name!r}."
    ) from None


def get_policy_loss_spec(name: str) -> PolicyLossSpec:
  """Returns the `PolicyLossSpec` registered under `name` (a key of `POLICY_LOSS_SPECS`).

  Raises:
    ValueError: naming the valid keys, if `name` is unknown.
  """
  try:
    return _SPECS[name]
  except (KeyError, TypeError):
    raise ValueError(f"`name` must be one of {tuple(_SPECS)}, got {name!r}.") from None


def get_policy_loss(name: str) -> Callable:
  """Returns the policy loss registered under `name` (a key of `POLICY_LOSSES`).

  Every loss has the signature
  `f(logp, old_logp, advantages, mask, *, ..., is_weights=None, agg=..., agg_scale=None)
  -> (loss, PolicyLossMetrics)` with `[B, T]` data arrays; `get_policy_loss_spec`
  says which extra inputs, default `agg` and clip keywords it has.

  Raises:
    ValueError: naming the valid keys, if `name` is unknown.
  """
  return get_policy_loss_spec(name).fn


for _name, _fn, _kwargs in (
  ("ppo", ppo_clip_loss, {"clip_keywords": _RATIO_CLIPS}),
  ("gspo", gspo_loss, {"clip_keywords": ("clip_low", "clip_high")}),
  ("ctpo", ctpo_loss, {}),
  ("minpro", minpro_loss, {"clip_keywords": _RATIO_CLIPS}),
  ("cispo", cispo_loss, {"clip_keywords": ("clip_low", "clip_high")}),
  ("sapo", sapo_loss, {}),
  ("aspo", aspo_loss, {"extra_inputs": ("entropy",), "clip_keywords": _RATIO_CLIPS}),
  ("vespo", vespo_loss, {}),
  # SAT's clip_low / clip_high are PPO's nominal radii, which it contracts per token.
  ("sat", sat_loss, {"clip_keywords": _RATIO_CLIPS}),
  # M2PO sets its own radii from its second-moment budget: no clip keywords.
  ("m2po", m2po_loss, {}),
):
  # Built-ins are tested directly; no abstract trace at import time.
  _SPECS[_name] = policy_loss_spec(_fn, check_outputs=False, **_kwargs)
del _name, _fn, _kwargs
