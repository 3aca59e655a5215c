"""rlx: reinforcement learning of language models in JAX.

Subpackages:
  rlx.objectives      pure-function losses, advantages, KL, mismatch correction
  rlx.policy          decoder-only transformer, HF checkpoints, token log-probs
  rlx.kernels_pallas  Pallas kernels (paged attention, FP8 matmul) + references
  rlx.sampling        paged-KV continuous-batching sampler
  rlx.train           mesh, train state, the sharded train step, checkpoints
  rlx.tasks           verifiable tasks and rewards (embedded arithmetic, GSM8K-format math)
  rlx.rl              the RL loop: rollout, rewards, advantages, train steps, checkpoints

and, for checking that your own jitted functions do not recompile:
  rlx.counted_jit     `jax.jit` that counts the programs it traces
"""

from rlx._jit import counted_jit

__all__ = ("counted_jit",)
__version__ = "0.1.0"
