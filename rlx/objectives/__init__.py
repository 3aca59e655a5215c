"""rlx.objectives: pure-function RL objectives for language models.

Every function here is pure: data arrays are positional, hyper-parameters are
keyword-only, and nothing calls a model. Per-token arrays are `[B, T]`
(sequences x tokens), right-padded, with `mask` marking the tokens that count.
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
from rlx.objectives._gspo import (
  gspo_loss,
)
from rlx.objectives._kl import (
  KL_KINDS,
  kl_penalty,
)
from rlx.objectives._m2po import (
  m2po_mask,
)
from rlx.objectives._median import (
  median_advantages,
)
from rlx.objectives._metrics import (
  PolicyLossMetrics,
)
from rlx.objectives._minpro import (
  minpro_loss,
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
)
from rlx.objectives._sapo import (
  sapo_loss,
)
from rlx.objectives._vcpo import (
  vcpo_lr_factor,
)

__all__ = (
  "AGG_MODES",
  "BAPO_DUAL_CLIP",
  "BapoClipBounds",
  "CTPO_VARIANTS",
  "KL_KINDS",
  "POLICY_LOSSES",
  "POLICY_LOSS_SPECS",
  "PolicyLossMetrics",
  "PolicyLossSpec",
  "RolloutCorrectionMetrics",
  "aggregate",
  "aggregate_scale",
  "aspo_loss",
  "bapo_clip_bounds",
  "broadcast_to_tokens",
  "cispo_loss",
  "ctpo_clip_scale",
  "ctpo_loss",
  "cumulative_log_ratio",
  "drgrpo_advantages",
  "get_policy_loss",
  "get_policy_loss_spec",
  "grpo_advantages",
  "gspo_loss",
  "kl_penalty",
  "m2po_mask",
  "median_advantages",
  "min_prefix_log_ratio",
  "minpro_loss",
  "ppo_clip_loss",
  "rloo_advantages",
  "rollout_correction",
  "sapo_loss",
  "sequence_log_ratio",
  "token_log_ratio",
  "vcpo_lr_factor",
)
