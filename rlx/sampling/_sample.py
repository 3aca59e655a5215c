"""Next-token sampling from `[S, V]` logits: greedy, temperature, top-k, top-p; recorded log-probs.

The recorded log-prob of a sampled token is `log softmax(logits / T)[token]`
over the FULL vocabulary (greedy: T = 1), the distribution a trainer
recomputes with `rlx.policy.token_logprobs(..., temperature=T)`. Top-k / top-p
truncation changes which tokens can be drawn, not the recorded value: the
truncation is a behaviour-policy mismatch that rollout correction (TIS/MIS)
sees. Top-k then top-p as in HF transformers' logits warpers
(`TopKLogitsWarper`, `TopPLogitsWarper`); nucleus sampling: Holtzman et al.
2019, https://arxiv.org/abs/1904.09751.

Randomness: sample j of prompt i draws its t-th token with the key
`fold_in(fold_in(fold_in(rng, i), j), t)`, so a sample's tokens depend only on
(rng, prompt index, sample index, position), never on the slot it runs in or
on which other requests share the batch.
"""

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int


def sample_keys(
  rng: Array, prompt_index: Int[Array, " S"], sample_index: Int[Array, " S"], step: Int[Array, " S"]
) -> Array:
  """Per-row keys `fold_in(fold_in(fold_in(rng, prompt), sample), step)`, shape `[S]`."""

  def one(p, s, t):
    return jax.random.fold_in(jax.random.fold_in(jax.random.fold_in(rng, p), s), t)

  return jax.vmap(one)(prompt_index, sample_index, step)


def sample_tokens(
  logits: Float[Array, "S V"],
  keys: Array,
  *,
  temperature: float | Float[Array, ""],
  top_k: int,
  top_p: float | Float[Array, ""],
) -> tuple[Int[Array, " S"], Float[Array, " S"]]:
  """Draws one token per row; returns `(tokens i32[S], logp f32[S])`.

  `temperature == 0`: argmax, `logp = log softmax(logits)[token]`. Otherwise
  the candidates are the `top_k` largest of `logits / T` (0 = all; ties at the
  k-th value are kept) and then the smallest prefix of those, in descending
  order, whose softmax mass reaches `top_p` (tokens tied with its last value
  are kept); the token is drawn from the softmax over the candidates (Gumbel
  max, `jax.random.categorical`) and `logp = log softmax(logits / T)[token]`
  over the full vocabulary. All math in float32.

  Args:
    logits: f32[S, V].
    keys: `[S]` PRNG keys (`sample_keys`).
    temperature: float >= 0; the Python float 0.0 selects greedy decoding, any
      other value (Python float or traced f32 scalar > 0) sampling.
    top_k: static int >= 0.
    top_p: in (0, 1]; the Python float 1.0 disables the nucleus filter, any
      other value (Python float or traced f32 scalar) enables it.
  """
  logits = logits.astype(jnp.float32)
  vocab = logits.shape[-1]
  if isinstance(temperature, int | float) and temperature == 0.0:
    tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logp = jax.nn.log_softmax(logits, axis=-1)
    return tokens, jnp.take_along_axis(logp, tokens[:, None], axis=-1)[:, 0]
  scaled = logits / jnp.asarray(temperature, jnp.float32)
  logp_all = jax.nn.log_softmax(scaled, axis=-1)
  masked = scaled
  top_values = None
  if 0 < top_k < vocab:
    top_values = jax.lax.top_k(scaled, top_k)[0]  # [S, k], descending
    masked = jnp.where(scaled >= top_values[:, -1:], scaled, -jnp.inf)
  if not (isinstance(top_p, int | float) and top_p >= 1.0):
    if top_values is None:
      top_values = -jnp.sort(-scaled, axis=-1)  # descending
    probs = jax.nn.softmax(top_values, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # mass of the strictly better-ranked tokens
    keep = before < jnp.asarray(top_p, jnp.float32)  # always keeps the first
    threshold = jnp.min(jnp.where(keep, top_values, jnp.inf), axis=-1, keepdims=True)
    masked = jnp.where(masked >= threshold, masked, -jnp.inf)
  tokens = jax.vmap(lambda k, row: jax.random.categorical(k, row))(keys, masked).astype(jnp.int32)
  return tokens, jnp.take_along_axis(logp_all, tokens[:, None], axis=-1)[:, 0]
