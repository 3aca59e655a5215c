"""rlx.objectives: pure-function RL objectives for language models.

Every function here is pure: data arrays are positional, hyper-parameters are
keyword-only, and nothing calls a model. Per-token arrays are `[B, T]`
(sequences x tokens), right-padded, with `mask` marking the tokens that count.
"""

# --- ratios, aggregation, policy losses (block A) ---

# --- advantages, KL, rollout-mismatch correction, adaptive clipping (block B) ---
