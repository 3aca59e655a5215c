"""Next-token sampling from `[S, V]` logits: greedy, temperature, top-k, top-p; recorded log-probs.

The recorded log-prob of a sampled token is `log softmax(logits / T)[token]`
over the FULL vocabulary (greedy: T = 1), the distribution a trainer
recomputes with `rlx.policy.token_logprobs(..., temperature=T)`. Top-k / top-p
truncation changes which tokens can be drawn, not the recorded value: the
truncation is a behaviour-policy mismatch that rollout correction (TIS/MIS)
sees. Top-k then top-p as in HF transformers' logits warpers
(`TopKLogitsWarper`, `TopPLogitsWarper`); nucleus sampling: Holtzman et al.
2019, https://arxiv.org/abs/1904.09751. Both are resolved in Python: with
top_k = 0 (or >= V) and top_p = 1 no sort, top-k or cumulative-mass code is
traced at all.

The draw is inverse transform sampling with ONE uniform per row (as
FlashInfer's sorting-free `sampling_from_probs`, Ye et al. 2025,
https://arxiv.org/abs/2501.01005): with weights `w = exp(logits / T - max)`
(0 outside the top-k / top-p candidates), the token is the first index whose
cumulative weight exceeds `u * sum(w)` (`inverse_cdf`: masked sums, in two
levels of ~sqrt(V) above 64 tokens), so a step draws S random numbers instead
of the S x V of Gumbel-max (`jax.random.categorical`, whose per-logit bits and
two logarithms made temperature sampling ~25% slower than greedy on CPU) and
computes one exponential per logit, shared with the log-prob. The stream of
tokens therefore differs from a Gumbel-max draw with the same keys; its
distribution is the same softmax.

Randomness: sample j of prompt i draws its t-th token with
`u = jax.random.uniform(fold_in(fold_in(fold_in(rng, i), j), t))`, so a
sample's tokens depend only on (rng, prompt index, sample index, position),
never on the slot it runs in or on which other requests share the batch.
For threefry keys (JAX's default) the three fold-ins and the uniform are
computed by one straight-line Threefry-2x32 (Salmon et al. 2011, "Parallel
random numbers: as easy as 1, 2, 3", https://doi.org/10.1145/2063384.2063405),
bit for bit JAX's `fold_in` and `uniform` (jax/_src/random/threefry2x32.py)
but fused into the surrounding elementwise code, where XLA:CPU would otherwise
lower each of the four hashes as its own rolled `while` loop; other key
implementations go through `jax.random` itself.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

# Threefry-2x32, 20 rounds: rotation constants and key-schedule parity (Salmon et al. 2011).
_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))
_PARITY = np.uint32(0x1BD11BDA)


def _threefry2x32(k1, k2, x1, x2):
  """Threefry-2x32 (20 rounds) of the counter words (x1, x2) under the key (k1, k2); uint32."""
  ks = (k1, k2, k1 ^ k2 ^ _PARITY)
  x1, x2 = x1 + ks[0], x2 + ks[1]
  for i in range(5):
    for r in _ROTATIONS[i % 2]:
      x1 = x1 + x2
      x2 = ((x2 << np.uint32(r)) | (x2 >> np.uint32(32 - r))) ^ x1
    x1 = x1 + ks[(i + 1) % 3]
    x2 = x2 + ks[(i + 2) % 3] + np.uint32(i + 1)
  return x1, x2


def _key_words(rng):
  """The (k1, k2) uint32 words of a threefry key, or None when `jax.random` must draw itself."""
  if not jax.config.jax_threefry_partitionable:
    return None
  if jax.dtypes.issubdtype(rng.dtype, jax.dtypes.prng_key):
    if str(jax.random.key_impl(rng)) != "threefry2x32":
      return None
    rng = jax.random.key_data(rng)
  elif jax.config.jax_default_prng_impl != "threefry2x32":
    return None
  rng = jnp.asarray(rng, jnp.uint32)
  return rng[..., 0], rng[..., 1]


def _fold_in_words(k1, k2, data):
  """`jax.random.fold_in` on key words: Threefry of the counter (0, uint32(data))."""
  data = jnp.asarray(data).astype(jnp.uint32)
  return _threefry2x32(k1, k2, jnp.zeros_like(data), data)


def _uniform_words(k1, k2):
  """`jax.random.uniform(key, ())` (float32 in [0, 1)) on key words."""
  zero = jnp.zeros(jnp.shape(k1), jnp.uint32)
  b1, b2 = _threefry2x32(k1, k2, zero, zero)
  bits = (b1 ^ b2) >> np.uint32(32 - 23) | np.uint32(0x3F800000)  # 23 mantissa bits in [1, 2)
  return jax.lax.bitcast_convert_type(bits, jnp.float32) - np.float32(1.0)


def sample_keys(
  rng: Array, prompt_index: Int[Array, " S"], sample_index: Int[Array, " S"], step: Int[Array, " S"]
) -> Array:
  """Per-row keys `fold_in(fold_in(fold_in(rng, prompt), sample), step)`, shape `[S]`."""

  def one(p, s, t):
    return jax.random.fold_in(jax.random.fold_in(jax.random.fold_in(rng, p), s), t)

  return jax.vmap(one)(prompt_index, sample_index, step)


def key_uniforms(keys: Array) -> Float[Array, " S"]:
  """`jax.random.uniform(key)` for each of the `[S]` keys (float32 in [0, 1))."""
  words = _key_words(keys)
  if words is None:
    return jax.vmap(lambda k: jax.random.uniform(k, (), jnp.float32))(keys)
  return _uniform_words(*words)


def sample_uniforms(
  rng: Array, prompt_index: Int[Array, " S"], sample_index: Int[Array, " S"], step: Int[Array, " S"]
) -> Float[Array, " S"]:
  """`key_uniforms(sample_keys(rng, prompt_index, sample_index, step))`, fused for threefry keys."""
  words = _key_words(rng)
  if words is None:
    return key_uniforms(sample_keys(rng, prompt_index, sample_index, step))
  shape = jnp.shape(prompt_index)
  k1, k2 = (jnp.broadcast_to(w, shape) for w in words)
  for data in (prompt_index, sample_index, step):
    k1, k2 = _fold_in_words(k1, k2, data)
  return _uniform_words(k1, k2)


def _pow2_at_least_sqrt(n: int) -> int:
  return 1 << max(0, math.ceil(math.log2(math.sqrt(n))))


def _first_index(mask):
  """Index of the first True of each row of bool[S, n] (n when there is none), int32."""
  n = mask.shape[-1]
  return jnp.min(jnp.where(mask, jnp.arange(n, dtype=jnp.int32), n), axis=-1)


def _last_index(mask):
  """Index of the last True of each row of bool[..., n] (-1 when there is none), int32."""
  n = mask.shape[-1]
  return jnp.max(jnp.where(mask, jnp.arange(n, dtype=jnp.int32), -1), axis=-1)


def _sums_before(w):
  """`sum_{j < i} w[..., j]` for every i: one masked sum (fused; O(n^2) adds per row)."""
  n = w.shape[-1]
  i = jnp.arange(n)
  return jnp.sum(jnp.where(i[None, :] < i[:, None], w[..., None, :], 0.0), axis=-1)


def _pick(w, threshold):
  """The last i with `w_i > 0` and `sum_{j < i} w_j <= threshold` per row (w >= 0)."""
  return _last_index((w > 0) & (_sums_before(w) <= threshold[..., None]))


# Up to this vocabulary size the draw scans the whole row at once (O(V^2) adds per row).
_ONE_LEVEL_MAX_VOCAB = 64


def inverse_cdf(weights: Float[Array, "S V"], u: Float[Array, " S"]) -> Int[Array, " S"]:
  """Inverse transform sampling: per row, the token i with `W_i <= u * W_V < W_i + w_i`.

  `W_i = sum_{j < i} w_j`; `weights` >= 0 with a positive entry per row, `u` in
  [0, 1). The token is found as the LAST index with positive weight and `W_i <=
  u * W_V`, so it always has positive weight whatever the float rounding of the
  sums (a truncated token is never drawn). Vocabularies above
  `_ONE_LEVEL_MAX_VOCAB` go in two levels: the block of ~sqrt(V) tokens (by the
  blocks' masses), then the token within it; O(V^1.5) adds per row, no
  cumulative-sum op (a reduce-window: several XLA:CPU kernels per call).
  """
  s, v = weights.shape
  if v <= _ONE_LEVEL_MAX_VOCAB:
    return _pick(weights, u * jnp.sum(weights, axis=-1))
  block = _pow2_at_least_sqrt(v)
  blocks = -(-v // block)
  w = jnp.pad(weights, ((0, 0), (0, blocks * block - v))).reshape(s, blocks, block)
  mass = jnp.sum(w, axis=-1)  # [S, blocks]
  threshold = u * jnp.sum(mass, axis=-1)
  before = _sums_before(mass)
  b = _last_index((mass > 0) & (before <= threshold[:, None]))
  rest = threshold - jnp.take_along_axis(before, b[:, None], axis=1)[:, 0]
  inside = jnp.take_along_axis(w, b[:, None, None], axis=1)[:, 0]  # [S, block]
  return b * block + _pick(inside, rest)


def sample_from_uniforms(
  logits: Float[Array, "S V"],
  u: Float[Array, " S"],
  *,
  temperature: float | Float[Array, ""],
  top_k: int,
  top_p: float | Float[Array, ""],
) -> tuple[Int[Array, " S"], Float[Array, " S"]]:
  """`sample_tokens` with the rows' uniforms `u` (f32[S] in [0, 1)) instead of their keys."""
  logits = logits.astype(jnp.float32)
  vocab = logits.shape[-1]
  greedy = isinstance(temperature, int | float) and temperature == 0.0
  scaled = logits if greedy else logits / jnp.asarray(temperature, jnp.float32)
  top = jnp.max(scaled, axis=-1, keepdims=True)
  shifted = scaled - top
  weights = jnp.exp(shifted)
  log_norm = jnp.log(jnp.sum(weights, axis=-1))
  if greedy:  # the first maximal logit, as argmax
    tokens = jnp.minimum(_first_index(scaled == top), vocab - 1)
  else:
    keep = None
    top_values = None
    if 0 < top_k < vocab:
      top_values = jax.lax.top_k(scaled, top_k)[0]  # [S, k], descending
      keep = scaled >= top_values[:, -1:]
    if not (isinstance(top_p, int | float) and top_p >= 1.0):
      if top_values is None:
        top_values = -jnp.sort(-scaled, axis=-1)  # descending
      probs = jax.nn.softmax(top_values, axis=-1)
      before = jnp.cumsum(probs, axis=-1) - probs  # mass of the strictly better-ranked tokens
      in_nucleus = before < jnp.asarray(top_p, jnp.float32)  # always keeps the first
      threshold = jnp.min(jnp.where(in_nucleus, top_values, jnp.inf), axis=-1, keepdims=True)
      keep = scaled >= threshold if keep is None else keep & (scaled >= threshold)
    if keep is not None:
      weights = jnp.where(keep, weights, 0.0)
    tokens = inverse_cdf(weights, u)
  logp = jnp.take_along_axis(shifted, tokens[:, None], axis=-1)[:, 0] - log_norm
  return tokens.astype(jnp.int32), logp


def sample_tokens(
  logits: Float[Array, "S V"],
  keys: Array,
  *,
  temperature: float | Float[Array, ""],
  top_k: int,
  top_p: float | Float[Array, ""],
) -> tuple[Int[Array, " S"], Float[Array, " S"]]:
  """Draws one token per row; returns `(tokens i32[S], logp f32[S])`.

  `temperature == 0`: the first maximal logit (argmax), `logp = log
  softmax(logits)[token]`. Otherwise the candidates are the `top_k` largest of
  `logits / T` (0 = all; ties at the k-th value are kept) and then the
  smallest prefix of those, in descending order, whose softmax mass reaches
  `top_p` (tokens tied with its last value are kept); the token is drawn from
  the softmax over the candidates by inverse transform sampling with
  `u = jax.random.uniform(key)` (module docstring) and `logp = log
  softmax(logits / T)[token]` over the full vocabulary. All math in float32.

  Args:
    logits: f32[S, V].
    keys: `[S]` PRNG keys (`sample_keys`); unused when greedy.
    temperature: float >= 0; the Python float 0.0 selects greedy decoding, any
      other value (Python float or traced f32 scalar > 0) sampling.
    top_k: static int >= 0.
    top_p: in (0, 1]; the Python float 1.0 disables the nucleus filter, any
      other value (Python float or traced f32 scalar) enables it.
  """
  greedy = isinstance(temperature, int | float) and temperature == 0.0
  u = None if greedy else key_uniforms(keys)
  return sample_from_uniforms(logits, u, temperature=temperature, top_k=top_k, top_p=top_p)
