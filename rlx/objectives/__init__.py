"""rlx.objectives: pure-function RL objectives for language models.

Every function here is pure: data arrays are positional, hyper-parameters are
keyword-only, and nothing calls a model. Per-token arrays are `[B, T]`
(sequences x tokens), right-padded, with `mask` marking the tokens that count.
Masks hold 0/1 or bool values, hyper-parameters are real scalars (Python,
NumPy or 0-d arrays) and flags are bools; every function checks this and the
ranges of its hyper-parameters whenever the values are known (eager calls),
raising a ValueError that names the argument. Under `jit` traced values pass:
a traced mask is read as `mask != 0`.
"""

from rlx.objectives._advantages import (
  broadcast_to_tokens,
  drgrpo_advantages,
  grpo_advantages,
  rloo_advantages,
)
from rlx.objectives._aggregate import (
  AGG_MODES,
  aggregate,
  aggregate_scale,
)
from rlx.objectives._ais import (
  adaptive_is_lambda,
)
from rlx.objectives._aspo import (
  aspo_loss,
)
from rlx.objectives._bapo import (
  BAPO_DUAL_CLIP,
  BapoClipBounds,
  bapo_clip_bounds,
)
from rlx.objectives._cispo import (
  cispo_loss,
)
from rlx.objectives._correction import (
  RolloutCorrectionMetrics,
  rollout_correction,
)
from rlx.objectives._ctpo import (
  CTPO_VARIANTS,
  ctpo_clip_scale,
  ctpo_loss,
)
from rlx.objectives._ess import (
  effective_sample_size,
)
from rlx.objectives._gspo import (
  gspo_loss,
)
from rlx.objectives._is_weights import (
  renormalize_weights,
  sequence_importance_weights,
  token_importance_weights,
)
from rlx.objectives._kl import (
  KL_KINDS,
  kl_penalty,
)
from rlx.objectives._m2po import (
  M2poClipBounds,
  m2po_clip_bounds,
  m2po_loss,
  m2po_mask,
)
from rlx.objectives._median import (
  median_advantages,
)
from rlx.objectives._metrics import (
  PolicyLossMetrics,
  policy_loss_metrics,
)
from rlx.objectives._minpro import (
  minpro_loss,
)
from rlx.objectives._mismatch import (
  MismatchKL,
  rollout_mismatch_kl,
)
from rlx.objectives._ppo import (
  ppo_clip_loss,
)
from rlx.objectives._ratios import (
  cumulative_log_ratio,
  min_prefix_log_ratio,
  sequence_log_ratio,
  token_log_ratio,
)
from rlx.objectives._registry import (
  POLICY_LOSS_SPECS,
  POLICY_LOSSES,
  PolicyLossSpec,
  get_policy_loss,
  get_policy_loss_spec,
  policy_loss_spec,
  register_policy_loss,
  unregister_policy_loss,
)
from rlx.objectives._rejection import (
  rollout_rejection_mask,
)
from rlx.objectives._sapo import (
  sapo_loss,
)
from rlx.objectives._sat import (
  SatClipBounds,
  sat_clip_bounds,
  sat_loss,
)
from rlx.objectives._vcpo import (
  vcpo_advantages,
  vcpo_baseline,
  vcpo_lr_factor,
)
from rlx.objectives._vespo import (
  vespo_loss,
)
from rlx.objectives._veto import (
  rollout_veto_mask,
)

__all__ = (
  "adaptive_is_lambda",
  "AGG_MODES",
  "aggregate",
  "aggregate_scale",
  "aspo_loss",
  "bapo_clip_bounds",
  "BAPO_DUAL_CLIP",
  "BapoClipBounds",
  "broadcast_to_tokens",
  "cispo_loss",
  "ctpo_clip_scale",
  "ctpo_loss",
  "CTPO_VARIANTS",
  "cumulative_log_ratio",
  "drgrpo_advantages",
  "effective_sample_size",
  "get_policy_loss",
  "get_policy_loss_spec",
  "grpo_advantages",
  "gspo_loss",
  "KL_KINDS",
  "kl_penalty",
  "M2poClipBounds",
  "m2po_clip_bounds",
  "m2po_loss",
  "m2po_mask",
  "median_advantages",
  "min_prefix_log_ratio",
  "minpro_loss",
  "MismatchKL",
  "POLICY_LOSS_SPECS",
  "POLICY_LOSSES",
  "policy_loss_metrics",
  "policy_loss_spec",
  "PolicyLossMetrics",
  "PolicyLossSpec",
  "ppo_clip_loss",
  "register_policy_loss",
  "renormalize_weights",
  "rloo_advantages",
  "rollout_correction",
  "rollout_mismatch_kl",
  "rollout_rejection_mask",
  "rollout_veto_mask",
  "RolloutCorrectionMetrics",
  "sapo_loss",
  "sat_clip_bounds",
  "sat_loss",
  "SatClipBounds",
  "sequence_importance_weights",
  "sequence_log_ratio",
  "token_importance_weights",
  "token_log_ratio",
  "unregister_policy_loss",
  "vcpo_advantages",
  "vcpo_baseline",
  "vcpo_lr_factor",
  "vespo_loss",
)
