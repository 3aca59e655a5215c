"""rlx.objectives: pure-function RL objectives for language models.

Every function here is pure: data arrays are positional, hyper-parameters are
keyword-only, and nothing calls a model. Per-token arrays are `[B, T]`
(sequences x tokens), right-padded, with `mask` marking the tokens that count.
"""

# --- ratios, aggregation, policy losses (block A) ---

# --- advantages, KL, rollout-mismatch correction, adaptive clipping (block B) ---
from rlx.objectives._advantages import (
  broadcast_to_tokens,
  drgrpo_advantages,
  grpo_advantages,
  rloo_advantages,
)
from rlx.objectives._bapo import (
  BapoClipBounds,
  bapo_clip_bounds,
)
from rlx.objectives._correction import (
  RolloutCorrectionMetrics,
  rollout_correction,
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
from rlx.objectives._vcpo import (
  vcpo_lr_factor,
)
