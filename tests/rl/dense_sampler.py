"""TEST DOUBLE of `rlx.sampling.Sampler`: a plain dense full-recompute sampler.

Same `generate` / `generate_fn` API as the real sampler, implemented with one
full `rlx.policy.forward` per decoded token (no KV cache). Used only by the
tests and scratch runs while the real sampler is not available.
"""

import types
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from rlx import policy


class Completions(types.SimpleNamespace):
  pass


class DenseTestSampler:
  """Test double: dense full-recompute sampling with the real sampler's API."""

  def __init__(self, model_config, cfg, mesh=None):
    self.model_config = model_config
    self.cfg = types.SimpleNamespace(**cfg) if isinstance(cfg, dict) else cfg
    self.mesh = mesh
    self._jit = jax.jit(self.generate_fn)

  def generate_fn(self, params, prompt_tokens, prompt_lengths, rng):
    """(tokens i32[N, T], logprobs f32[N, T], lengths i32[N], stopped bool[N]); jittable."""
    c = self.cfg
    n, p = prompt_tokens.shape
    t_max = c.max_new_tokens
    s = p + t_max
    buf = jnp.zeros((n, s), jnp.int32).at[:, :p].set(prompt_tokens)
    stop_ids = jnp.asarray(c.stop_token_ids or (-1,), jnp.int32)
    row_keys = jax.vmap(lambda i: jax.random.fold_in(rng, i))(jnp.arange(n))
    greedy = c.temperature == 0
    temp = 1.0 if greedy else c.temperature

    def body(t, carry):
      buf, out, logps, done, lengths = carry
      logits = policy.forward(params, self.model_config, buf)
      pos = prompt_lengths + t - 1
      last = jnp.take_along_axis(logits, pos[:, None, None], axis=1)[:, 0].astype(jnp.float32)
      logp_all = jax.nn.log_softmax(last / temp, axis=-1)
      if greedy:
        tok = jnp.argmax(last, axis=-1).astype(jnp.int32)
      else:
        keys = jax.vmap(lambda k: jax.random.fold_in(k, t))(row_keys)
        tok = jax.vmap(lambda k, lp: jax.random.categorical(k, lp))(keys, logp_all)
        tok = tok.astype(jnp.int32)
      lp = jnp.take_along_axis(logp_all, tok[:, None], axis=1)[:, 0]
      active = ~done
      tok = jnp.where(active, tok, 0)
      out = out.at[:, t].set(tok)
      logps = logps.at[:, t].set(jnp.where(active, lp, 0.0))
      buf = jax.vmap(lambda b, i, v, a: jnp.where(a, b.at[i].set(v), b))(
        buf, prompt_lengths + t, tok, active
      )
      lengths = lengths + active.astype(jnp.int32)
      done = done | (active & jnp.any(tok[:, None] == stop_ids[None, :], axis=1))
      return buf, out, logps, done, lengths

    init = (
      buf,
      jnp.zeros((n, t_max), jnp.int32),
      jnp.zeros((n, t_max), jnp.float32),
      jnp.zeros((n,), bool),
      jnp.zeros((n,), jnp.int32),
    )
    _, out, logps, done, lengths = jax.lax.fori_loop(0, t_max, body, init)
    return out, logps, lengths, done

  def generate(self, params, prompts: Sequence[Sequence[int]], *, num_samples: int, rng: Any):
    c = self.cfg
    n = len(prompts) * num_samples
    tokens = np.zeros((n, c.max_prompt_len), np.int32)
    lengths = np.zeros((n,), np.int32)
    for i, pr in enumerate(prompts):
      for j in range(num_samples):
        tokens[i * num_samples + j, : len(pr)] = pr
        lengths[i * num_samples + j] = len(pr)
    out, logps, lens, done = self._jit(params, tokens, lengths, rng)
    done = np.asarray(done)
    return Completions(
      tokens=out,
      logprobs=logps,
      lengths=lens,
      finish_reason=["stop" if d else "length" for d in done],
      prompt_index=np.repeat(np.arange(len(prompts), dtype=np.int32), num_samples),
      stats={},
    )
