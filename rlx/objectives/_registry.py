"""Name -> policy loss registry, for choosing the loss from a config string."""

import types
from collections.abc import Callable, Mapping

from rlx.objectives._aspo import aspo_loss
from rlx.objectives._cispo import cispo_loss
from rlx.objectives._ctpo import ctpo_loss
from rlx.objectives._gspo import gspo_loss
from rlx.objectives._minpro import minpro_loss
from rlx.objectives._ppo import ppo_clip_loss
from rlx.objectives._sapo import sapo_loss

POLICY_LOSSES: Mapping[str, Callable] = types.MappingProxyType(
  {
    "ppo": ppo_clip_loss,
    "gspo": gspo_loss,
    "ctpo": ctpo_loss,
    "minpro": minpro_loss,
    "cispo": cispo_loss,
    "sapo": sapo_loss,
    "aspo": aspo_loss,
  }
)


def get_policy_loss(name: str) -> Callable:
  """Returns the policy loss registered under `name` (a key of `POLICY_LOSSES`).

  Every loss has the signature
  `f(logp, old_logp, advantages, mask, *, ..., is_weights=None, agg=..., agg_scale=None)
  -> (loss, PolicyLossMetrics)` with `[B, T]` data arrays.

  Raises:
    ValueError: naming the valid keys, if `name` is unknown.
  """
  try:
    return POLICY_LOSSES[name]
  except (KeyError, TypeError):
    raise ValueError(f"`name` must be one of {tuple(POLICY_LOSSES)}, got {name!r}.") from None
