"""Per-token log-probabilities and entropies without materialising [B, S, V] logits.

The LM head is applied to sequence chunks of the final hidden states inside a
`lax.scan`; each chunk's float32 logits live only inside one scan step, and
the step is wrapped in `jax.checkpoint` so the backward pass recomputes them
chunk by chunk instead of storing them. Peak logit memory is therefore
`B * chunk_size * V * 4` bytes instead of `B * S * V * 4` (measured by
experiments/bench_logprobs.py).
"""

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from rlx.policy._config import ModelConfig, check_model_config
from rlx.policy._model import LayerParamsFn, Params, check_tokens, forward, lm_head_kernel

DEFAULT_CHUNK_SIZE = 128


def _check_temperature(temperature: Any) -> None:
  """A real scalar (Python/NumPy number or 0-d array, traced allowed); finite and > 0 if known."""
  if isinstance(temperature, bool | np.bool_) or temperature is None:
    raise ValueError(f"`temperature` must be a real number > 0, got {temperature!r}.")
  if not isinstance(temperature, int | float):
    dtype = getattr(temperature, "dtype", None)
    real = dtype is not None and (
      jnp.issubdtype(dtype, jnp.floating) or jnp.issubdtype(dtype, jnp.integer)
    )
    if not real or not isinstance(temperature, np.ndarray | np.generic | jax.Array):
      raise ValueError(
        f"`temperature` must be a real number > 0, got {type(temperature).__name__} "
        f"{temperature!r}."
      )
    if np.ndim(temperature) != 0:
      raise ValueError(
        f"`temperature` must be a scalar (rank 0), got shape {np.shape(temperature)}."
      )
    if isinstance(temperature, jax.core.Tracer):
      return  # traced: unknown value
  value = float(np.asarray(temperature))
  if not (np.isfinite(value) and value > 0):
    raise ValueError(f"`temperature` must be finite and > 0, got {value!r}.")


def _check_not_empty(tokens: Any) -> None:
  if 0 in np.shape(tokens):
    raise ValueError(
      f"`tokens` must be [B, S] with B >= 1 sequences and S >= 1 positions, got the "
      f"zero-size shape {np.shape(tokens)}."
    )


def _check_mask(mask: Any, tokens: Any) -> None:
  if mask is None:
    raise ValueError("`mask` must be an array with the shape of `tokens`, got None.")
  if np.shape(mask) != np.shape(tokens):
    raise ValueError(
      f"`mask` must have the shape of `tokens` {np.shape(tokens)}, got {np.shape(mask)}."
    )
  dtype = _dtype(mask)
  if not (jnp.issubdtype(dtype, jnp.bool_) or _is_real_dtype(dtype)):
    raise ValueError(f"`mask` must hold bool, int or float values, got dtype {dtype}.")


def _dtype(x: Any) -> np.dtype:
  """The dtype of `x` without moving device data."""
  return np.dtype(x.dtype) if hasattr(x, "dtype") else np.asarray(x).dtype


def _is_real_dtype(dtype: Any) -> bool:
  return jnp.issubdtype(dtype, jnp.floating) or jnp.issubdtype(dtype, jnp.integer)


def _check_chunk_size(chunk_size: Any) -> int:
  if isinstance(chunk_size, bool | np.bool_) or not isinstance(chunk_size, int | np.integer):
    raise ValueError(f"`chunk_size` must be a positive int, got {chunk_size!r}.")
  if chunk_size < 1:
    raise ValueError(f"`chunk_size` must be a positive int, got {chunk_size!r}.")
  return int(chunk_size)


def _token_stats(
  logits: Float[Array, "... V"], targets: Int[Array, "..."]
) -> tuple[Float[Array, "..."], Float[Array, "..."]]:
  """(log softmax(logits)[target], entropy of softmax(logits)), float32.

  A target outside [0, V) (possible under `jit` only) gives a NaN log-prob,
  never another token's.
  """
  lse = jax.nn.logsumexp(logits, axis=-1)
  target_logit = jnp.take_along_axis(
    logits,
    targets[..., None],
    axis=-1,
    mode="fill",
    fill_value=jnp.nan,
    wrap_negative_indices=False,
  )[..., 0]
  probs = jnp.exp(logits - lse[..., None])
  entropy = lse - jnp.sum(probs * logits, axis=-1)
  return target_logit - lse, entropy


def _shift_and_mask(
  logp: Float[Array, "B Sm1"], entropy: Float[Array, "B Sm1"], mask: Array
) -> tuple[Float[Array, "B S"], Float[Array, "B S"]]:
  b = logp.shape[0]
  zeros = jnp.zeros((b, 1), jnp.float32)
  logp = jnp.concatenate([zeros, logp], axis=1)
  entropy = jnp.concatenate([zeros, entropy], axis=1)
  valid = jnp.asarray(mask) != 0
  valid = valid.at[:, 0].set(False)
  return jnp.where(valid, logp, 0.0), jnp.where(valid, entropy, 0.0)


def logprobs_from_logits(
  logits: Float[Array, "B S V"],
  tokens: Int[Array, "B S"],
  mask: Array,
  *,
  temperature: float | Float[Array, ""] = 1.0,
) -> tuple[Float[Array, "B S"], Float[Array, "B S"]]:
  """Naive per-token log-probs/entropies from full logits (the reference for `token_logprobs`).

  `logp[:, s] = log softmax(logits[:, s-1] / T)[tokens[:, s]]`,
  `entropy[:, s] = -sum_v p_v log p_v` of that same distribution, for s >= 1;
  both 0 at s = 0 and wherever `mask == 0`. Float32 math.

  Args:
    logits: [B, S, V] logits (position s predicts token s + 1).
    tokens: i32[B, S] token ids.
    mask: [B, S], nonzero where the value is wanted.
    temperature: softmax temperature T > 0 (a real scalar; finite and > 0
      when its value is known, unchecked when traced).

  Returns:
    (logp f32[B, S], entropy f32[B, S]).
  """
  if np.ndim(logits) != 3 or np.shape(logits)[:2] != np.shape(tokens):
    raise ValueError(
      f"`logits` must have shape [B, S, V] with [B, S] = tokens.shape {np.shape(tokens)}, "
      f"got {np.shape(logits)}."
    )
  if np.shape(logits)[-1] == 0:
    raise ValueError(f"`logits` must have V >= 1 entries, got shape {np.shape(logits)}.")
  check_tokens(tokens, np.shape(logits)[-1])
  _check_not_empty(tokens)
  _check_mask(mask, tokens)
  _check_temperature(temperature)
  if not _is_real_dtype(_dtype(logits)):
    raise ValueError(f"`logits` must hold real numbers, got dtype {_dtype(logits)}.")
  logits = jnp.asarray(logits).astype(jnp.float32) / temperature
  logp, entropy = _token_stats(logits[:, :-1], jnp.asarray(tokens, jnp.int32)[:, 1:])
  return _shift_and_mask(logp, entropy, mask)


def token_logprobs(
  params: Params,
  config: ModelConfig,
  tokens: Int[Array, "B S"],
  mask: Array,
  *,
  positions: Int[Array, "B S"] | None = None,
  segment_ids: Int[Array, "B S"] | None = None,
  temperature: float | Float[Array, ""] = 1.0,
  chunk_size: int = DEFAULT_CHUNK_SIZE,
  layer_params_fn: LayerParamsFn | None = None,
  unroll: bool = False,
) -> tuple[Float[Array, "B S"], Float[Array, "B S"]]:
  """Per-token log-probabilities and entropies of `tokens` under the policy, chunked.

  `logp[:, s] = log softmax(logits[:, s-1] / T)[tokens[:, s]]` and
  `entropy[:, s] = H(softmax(logits[:, s-1] / T))` for s >= 1; 0 at s = 0 and
  where `mask == 0`. Equal to `logprobs_from_logits(forward(...), ...)`, but the
  LM head runs on `chunk_size` positions at a time under `jax.checkpoint`, so
  neither the forward nor the backward pass holds more than
  `B * chunk_size * V` float32 logits. Differentiable w.r.t. `params`.

  Args:
    params: parameter tree.
    config: model config.
    tokens: i32[B, S] right-padded token ids in [0, V).
    mask: [B, S], nonzero on the tokens whose values are wanted (response).
    positions: i32[B, S] or None, as in `forward`.
    segment_ids: i32[B, S] or None, as in `forward`.
    temperature: softmax temperature T > 0 (Python float or traced scalar;
      finite and > 0 when its value is known).
    chunk_size: positions per LM-head chunk (static int >= 1, Python or NumPy); S - 1 is padded
      up to a multiple of it internally.
    layer_params_fn: optional per-layer parameter hook, as in `forward` (e.g.
      the train step's one-layer-at-a-time FSDP all-gather). The LM head uses
      `params` as passed.
    unroll: unrolled layers instead of the layer scan, as in `forward`.

  Returns:
    (logp f32[B, S], entropy f32[B, S]).
  """
  check_model_config(config)
  check_tokens(tokens, config.vocab_size)
  _check_not_empty(tokens)
  _check_mask(mask, tokens)
  _check_temperature(temperature)
  chunk_size = _check_chunk_size(chunk_size)
  tokens = jnp.asarray(tokens, jnp.int32)
  b, s = tokens.shape
  hidden = forward(
    params,
    config,
    tokens,
    positions,
    segment_ids=segment_ids,
    return_hidden=True,
    layer_params_fn=layer_params_fn,
    unroll=unroll,
  )
  n = s - 1
  if n == 0:
    zeros = jnp.zeros((b, 0), jnp.float32)
    return _shift_and_mask(zeros, zeros, mask)
  chunk = min(chunk_size, n)
  num_chunks = -(-n // chunk)
  pad = num_chunks * chunk - n
  h = jnp.pad(hidden[:, :-1], ((0, 0), (0, pad), (0, 0)))
  targets = jnp.pad(tokens[:, 1:], ((0, 0), (0, pad)))
  h = h.reshape(b, num_chunks, chunk, -1).swapaxes(0, 1)  # [n, B, c, D]
  targets = targets.reshape(b, num_chunks, chunk).swapaxes(0, 1)  # [n, B, c]
  dtype = jnp.dtype(config.compute_dtype)
  kernel = lm_head_kernel(params, config).astype(dtype)

  @jax.checkpoint
  def chunk_stats(kernel, h_c, t_c):
    logits = jnp.einsum(
      "bcd,dv->bcv", h_c.astype(dtype), kernel, preferred_element_type=jnp.float32
    )
    return _token_stats(logits / temperature, t_c)

  def step(carry, xs):
    h_c, t_c = xs
    return carry, chunk_stats(kernel, h_c, t_c)

  _, (logp, entropy) = jax.lax.scan(step, None, (h, targets))
  logp = logp.swapaxes(0, 1).reshape(b, num_chunks * chunk)[:, :n]
  entropy = entropy.swapaxes(0, 1).reshape(b, num_chunks * chunk)[:, :n]
  return _shift_and_mask(logp, entropy, mask)
