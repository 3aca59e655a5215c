"""Name -> policy loss registry, for choosing the loss from a config string.

Each entry is a `PolicyLossSpec` that declares what a caller (e.g. a train
step) must know about the loss without special-casing it by name: the extra
data inputs it reads, its default aggregation mode, and which keywords take
PPO-style ratio clip bounds (so an adaptive-bound scheme such as BAPO knows
what it may set).
"""

import inspect
import types
from collections.abc import Callable, Mapping
from typing import NamedTuple

from rlx.objectives._aspo import aspo_loss
from rlx.objectives._cispo import cispo_loss
from rlx.objectives._ctpo import ctpo_loss
from rlx.objectives._gspo import gspo_loss
from rlx.objectives._minpro import minpro_loss
from rlx.objectives._ppo import ppo_clip_loss
from rlx.objectives._sapo import sapo_loss

_RATIO_CLIPS = ("clip_low", "clip_high", "dual_clip")


class PolicyLossSpec(NamedTuple):
  """What a policy loss needs from its caller.

  Every loss has the signature
  `fn(logp, old_logp, advantages, mask, *, <hyper-parameters>, <extra inputs>,
  is_weights=None, agg=default_agg, agg_scale=None) -> (loss, PolicyLossMetrics)`
  with `[B, T]` data arrays.

  Attributes:
    fn: the pure loss function.
    extra_inputs: keyword DATA inputs beyond `(logp, old_logp, advantages,
      mask)` (and the common `is_weights`), each `[B, T]` and detached, e.g.
      `("entropy",)` for ASPO; `()` otherwise.
    default_agg: the default of the loss's `agg` keyword (one of `AGG_MODES`).
    clip_keywords: the keywords that take ratio clip bounds in PPO's
      convention: `clip_low`/`clip_high` bound the ratio to
      `[1 - clip_low, 1 + clip_high]` and `dual_clip` caps the ratio of A < 0
      tokens at `c`. An adaptive-bound scheme (e.g. `bapo_clip_bounds`) sets
      exactly these; a caller that also sets them in its loss kwargs has two
      sources for one bound and should raise. Losses whose bounds mean
      something else (CTPO's position-scaled log-space window, SAPO's
      temperatures) declare `()`.
  """

  fn: Callable
  extra_inputs: tuple[str, ...]
  default_agg: str
  clip_keywords: tuple[str, ...]


def _spec(
  fn: Callable, *, extra_inputs: tuple[str, ...] = (), clip_keywords: tuple[str, ...] = ()
) -> PolicyLossSpec:
  """A spec whose `default_agg` is read from `fn`'s signature."""
  default_agg = inspect.signature(fn).parameters["agg"].default
  return PolicyLossSpec(
    fn=fn, extra_inputs=extra_inputs, default_agg=default_agg, clip_keywords=clip_keywords
  )


POLICY_LOSS_SPECS: Mapping[str, PolicyLossSpec] = types.MappingProxyType(
  {
    "ppo": _spec(ppo_clip_loss, clip_keywords=_RATIO_CLIPS),
    "gspo": _spec(gspo_loss, clip_keywords=("clip_low", "clip_high")),
    "ctpo": _spec(ctpo_loss),
    "minpro": _spec(minpro_loss, clip_keywords=_RATIO_CLIPS),
    "cispo": _spec(cispo_loss, clip_keywords=("clip_low", "clip_high")),
    "sapo": _spec(sapo_loss),
    "aspo": _spec(aspo_loss, extra_inputs=("entropy",), clip_keywords=_RATIO_CLIPS),
  }
)

POLICY_LOSSES: Mapping[str, Callable] = types.MappingProxyType(
  {name: spec.fn for name, spec in POLICY_LOSS_SPECS.items()}
)


def get_policy_loss_spec(name: str) -> PolicyLossSpec:
  """Returns the `PolicyLossSpec` registered under `name` (a key of `POLICY_LOSS_SPECS`).

  Raises:
    ValueError: naming the valid keys, if `name` is unknown.
  """
  try:
    return POLICY_LOSS_SPECS[name]
  except (KeyError, TypeError):
    raise ValueError(f"`name` must be one of {tuple(POLICY_LOSS_SPECS)}, got {name!r}.") from None


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
