"""FP8 rollout on a tiny random model: W8A8 linears, FP8 KV, refresh, recalibration, compiles.

Model: qwen2-style, 2 layers, width 32, MLP 64, head_dim 8, vocab 64, weights
N(0, 0.02) plus N(0, 0.1) noise (peaked but not saturated next-token
distributions). Widths below 128 exercise the partial edge blocks of the
128x128 weight quantization (tests/policy covers widths above 128).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlx import objectives, policy, sampling

MODEL = policy.ModelConfig.small(
  "qwen2", vocab_size=64, hidden_size=32, intermediate_size=64, head_dim=8
)
HIGH = sampling.SamplerConfig(
  max_slots=8,
  page_size=4,
  num_pages=40,
  max_prompt_len=8,
  max_new_tokens=8,
  steps_per_sync=8,
  prefill_chunk=8,
  temperature=0.0,
  kv_dtype="bfloat16",
)
FP8 = dataclasses.replace(HIGH, weight_dtype="fp8_e4m3", kv_dtype="fp8_e4m3")
_rng = np.random.default_rng(0)
PROMPTS = [list(_rng.integers(0, 64, size=int(_rng.integers(2, 9)))) for _ in range(8)]
LINEARS = [("attn", n) for n in ("q_proj", "k_proj", "v_proj", "o_proj")] + [
  ("mlp", n) for n in ("gate_proj", "up_proj", "down_proj")
]


def _noised(p, seed, scale=0.1):
  noise = np.random.default_rng(seed)
  return jax.tree.map(lambda x: x + jnp.asarray(scale * noise.normal(size=x.shape), x.dtype), p)


@pytest.fixture(scope="module")
def params():
  return _noised(policy.init_params(MODEL, jax.random.key(0)), 0)


@pytest.fixture(scope="module")
def samplers():
  return sampling.Sampler(MODEL, HIGH), sampling.Sampler(MODEL, FP8)


def _padded(prompts, width):
  return jnp.asarray([list(p) + [0] * (width - len(p)) for p in prompts], jnp.int32)


def _sequences(out):
  """[N, prompt + M] prompt + completion rows and the completion mask."""
  n, m = out.tokens.shape
  seqs = np.zeros((n, HIGH.max_prompt_len + m), np.int32)
  mask = np.zeros_like(seqs)
  for r in range(n):
    p, g = PROMPTS[out.prompt_index[r]], out.lengths[r]
    seqs[r, : len(p)] = p
    seqs[r, len(p) : len(p) + g] = out.tokens[r, :g]
    mask[r, len(p) : len(p) + g] = 1
  return seqs, mask


_token_logprobs = jax.jit(policy.token_logprobs, static_argnums=1)


def test_fp8_leaf_carries_scales_and_refuses_dense_use(params):
  q = sampling.quantize_params(params, FP8)  # jitted (compile shared with the other tests)
  for group, name in LINEARS:
    kernel = q["layers"][group][name]["kernel"]
    assert isinstance(kernel, policy.Fp8Kernel)
    assert kernel.values.dtype == jnp.float8_e4m3fn
    dense = params["layers"][group][name]["kernel"]
    assert kernel.values.shape == dense.shape
    assert kernel.scale.shape == (MODEL.num_layers, 1, 1) and kernel.scale.dtype == jnp.float32
    deq = np.asarray(kernel.values, np.float32) * np.asarray(kernel.scale)  # one block
    err = np.abs(deq - np.asarray(dense)) / np.max(np.abs(np.asarray(dense)))
    assert 0 < err.max() <= 2.0**-4  # e4m3: 3 mantissa bits
    # An FP8 leaf can never be used as a dense kernel by accident.
    for convert in (jnp.asarray, np.asarray, lambda k: k.astype(jnp.float32)):
      with pytest.raises(TypeError, match="Fp8Kernel"):
        convert(kernel)
    with pytest.raises(TypeError, match="Fp8Kernel"):
      jnp.einsum("i,io->o", jnp.ones(32), kernel)
  # Embeddings, norms, biases and (untied) LM head are the same arrays.
  assert q["embed"]["embedding"] is params["embed"]["embedding"]
  assert q["layers"]["input_norm"]["scale"] is params["layers"]["input_norm"]["scale"]
  assert q["layers"]["attn"]["q_proj"]["bias"] is params["layers"]["attn"]["q_proj"]["bias"]
  assert (
    policy.quantize_linears(q)["layers"]["attn"]["q_proj"]["kernel"]
    is (q["layers"]["attn"]["q_proj"]["kernel"])
  )  # idempotent
  # Params stay a plain pytree: leaves are arrays (values and scales).
  assert all(isinstance(x, jax.Array) for x in jax.tree.leaves(q))
  # Training-side checks refuse FP8 params; the sampler and forward accept them.
  with pytest.raises(ValueError, match="Fp8Kernel but must be a dense array"):
    policy.check_params(q, MODEL)
  policy.check_params(q, MODEL, allow_fp8=True)
  bad = jax.tree.map(lambda x: x, q)
  bad["layers"]["attn"]["q_proj"]["kernel"] = policy.Fp8Kernel(
    bad["layers"]["attn"]["q_proj"]["kernel"].values, jnp.ones((2, 2, 2), jnp.float32)
  )
  with pytest.raises(ValueError, match="scale"):
    policy.check_params(bad, MODEL, allow_fp8=True)
  with pytest.raises(ValueError, match="dtype"):
    policy.quantize_linears(params, "int8")


def test_kv_bytes_greedy_agreement_and_mismatch(params, samplers):
  """FP8 (W8A8 + FP8 KV) vs bf16-KV float32-weight sampler, greedy, same model and prompts.

  Measured on this model and these 8 prompts (CPU, jax 0.10.2): KV bytes per
  token 0.50x of bf16 KV; greedy agreement: 6 of 8 first tokens equal, 66% of
  the tokens generated before the first divergence (a random 32-wide model
  has small logit margins; W8A8 moves logits by a few percent); mismatch of
  the FP8 sampler's recorded log-probs against the trainer's float32
  log-probs of the same tokens: k1 = 3.8e-3, k3 = 7.0e-4 (against the
  trainer running the same FP8 weights, leaving only the FP8 KV and
  activation rounding: k3 = 3.7e-4). Bounds below leave ~5x room.
  """
  high, fp8 = samplers
  key = jax.random.key(1)
  a = high.generate(params, PROMPTS, rng=key)
  scales = sampling.calibrate_kv_scales(params, MODEL, _padded(PROMPTS, 8))
  b = fp8.generate(params, PROMPTS, rng=key, kv_scales=scales)
  # KV bytes per token from the pool arrays.
  capacity = HIGH.num_pages * HIGH.page_size
  per_token = [(s.kv_pool().k.nbytes + s.kv_pool().v.nbytes) / capacity for s in (high, fp8)]
  assert per_token[1] / per_token[0] <= 0.52
  assert fp8.kv_pool().k.dtype == jnp.float8_e4m3fn
  # Greedy agreement.
  first = float(np.mean(a.tokens[:, 0] == b.tokens[:, 0]))
  diff = a.tokens != b.tokens
  prefix = np.where(diff.any(1), diff.argmax(1), a.tokens.shape[1])
  agreement = float(prefix.sum() / a.lengths.sum())
  assert first >= 0.5 and agreement >= 0.4, (first, agreement)
  # Log-prob mismatch of the FP8 sampler's tokens against the trainer.
  seqs, mask = _sequences(b)
  logp, _ = _token_logprobs(params, MODEL, seqs, mask)
  old = np.zeros_like(b.logprobs)
  for r in range(len(b.lengths)):
    old[r, : b.lengths[r]] = np.asarray(logp[r])[mask[r].astype(bool)]
  valid = np.arange(b.tokens.shape[1])[None] < b.lengths[:, None]
  kl = objectives.rollout_mismatch_kl(old, b.logprobs, valid)
  print(float(kl.k1), float(kl.k3), first, agreement)
  assert abs(float(kl.k1)) < 2e-2 and 0 < float(kl.k3) < 4e-3


def test_requantize_after_update_equals_quantizing_new_params(params, samplers):
  _, fp8 = samplers
  new = _noised(params, 5, scale=0.02)
  stale = sampling.quantize_params(params, FP8)
  refreshed = sampling.quantize_params(new, FP8)
  direct = policy.quantize_linears(new)
  for x, y in zip(jax.tree.leaves(refreshed), jax.tree.leaves(direct), strict=True):
    np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32))
  v = lambda t: np.asarray(t["layers"]["mlp"]["up_proj"]["kernel"].values, np.float32)  # noqa: E731
  assert not np.array_equal(v(stale), v(refreshed))
  # Dense params into an FP8 sampler are quantized on entry: same as pre-quantized.
  scales = sampling.calibrate_kv_scales(new, MODEL, _padded(PROMPTS, 8))
  key = jax.random.key(2)
  a = fp8.generate(new, PROMPTS[:4], rng=key, kv_scales=scales)
  b = fp8.generate(refreshed, PROMPTS[:4], rng=key, kv_scales=scales)
  np.testing.assert_array_equal(a.tokens, b.tokens)
  np.testing.assert_array_equal(a.logprobs, b.logprobs)


def test_refresh_and_recalibration_do_not_recompile(params, samplers):
  _, fp8 = samplers
  tokens = _padded(PROMPTS, 8)
  key = jax.random.key(3)
  p = params
  for step in range(3):
    rollout = sampling.quantize_params(p, FP8)
    scales = sampling.calibrate_kv_scales(p, MODEL, tokens, k_headroom=200.0 + step)
    fp8.generate(rollout, PROMPTS[:4], rng=key, kv_scales=scales)
    if step == 0:
      sizes = sampling.fp8_compile_counts()
    p = _noised(p, 10 + step, scale=0.02)
  assert sampling.fp8_compile_counts() == sizes
  assert fp8.compile_counts()["decode"] == 1
  assert fp8.compile_counts()["prefill"] == 1


def test_kv_scales_from_absmax():
  k = jnp.asarray([[2.0, 4.0], [0.0, 1.0]])
  v = jnp.asarray([[1.0, 3.0], [5.0, 0.5]])
  ks, vs = sampling.kv_scales_from_absmax(k, v)
  np.testing.assert_allclose(ks, [[0.01, 0.02], [1e-10 / 200, 0.005]], rtol=1e-6)
  np.testing.assert_allclose(vs, np.asarray(v) / 100.0, rtol=1e-6)
  ks, vs = sampling.kv_scales_from_absmax(k, v, k_headroom=100.0, v_headroom=50.0, per_head=False)
  np.testing.assert_allclose(ks, [0.04, 0.01], rtol=1e-6)
  np.testing.assert_allclose(vs, [0.06, 0.1], rtol=1e-6)
  with pytest.raises(ValueError, match="k_headroom"):
    sampling.kv_scales_from_absmax(k, v, k_headroom=0.0)
  with pytest.raises(ValueError, match="k_amax"):
    sampling.kv_scales_from_absmax(jnp.ones((2, 2, 2)), v)
  with pytest.raises(ValueError, match="config"):
    sampling.quantize_params({}, "fp8")


def test_fp8_generate_fn_under_jit(params, samplers):
  _, fp8 = samplers
  prompts = PROMPTS[:4]
  tokens, lengths = _padded(prompts, 8), jnp.asarray([len(p) for p in prompts], jnp.int32)
  scales = sampling.calibrate_kv_scales(params, MODEL, tokens)

  @jax.jit
  def run(p, tokens, lengths, key, scales):
    return fp8.generate_fn(p, tokens, lengths, key, kv_scales=scales)  # dense p: quantized inside

  key = jax.random.key(4)
  out_tokens, out_logp, out_len, _ = run(params, tokens, lengths, key, scales)
  ref = fp8.generate(params, prompts, rng=key, kv_scales=scales)
  np.testing.assert_array_equal(np.asarray(out_len), ref.lengths)
  # Same FP8 model: tokens equal (a different batch shape may only flip exact near-ties).
  assert float(np.mean(np.asarray(out_tokens) == ref.tokens)) >= 0.9
  first = np.asarray(out_tokens)[:, 0] == ref.tokens[:, 0]
  np.testing.assert_allclose(np.asarray(out_logp)[first, 0], ref.logprobs[first, 0], atol=1e-4)


def test_per_token_kv_logprobs_equal_a_forward_over_per_token_rounded_kv(params):
  """The sampler with per-token FP8 KV records the log-probs of the dense forward whose
  attention reads K/V rounded exactly as `write_kv_pages_per_token` stores them (each
  token and KV head scaled by amax / 448): the whole path (prefill chunk, decode write,
  paged reads) applies the definition, and nothing else. The pool holds f32 scales of
  the pool's shape without D (4 / D more bytes per element)."""
  cfg = dataclasses.replace(
    HIGH, kv_dtype="fp8_e4m3", kv_scale_mode="per_token", temperature=1.0, prefill_chunk=4
  )
  sampler = sampling.Sampler(MODEL, cfg)
  out = sampler.generate(params, PROMPTS, num_samples=2, rng=jax.random.key(2))
  pool = sampler.kv_pool()
  assert pool.k_scale.shape == pool.k.shape[:-1] and pool.k_scale.dtype == jnp.float32

  def rounded(x):
    x = x.astype(jnp.float32)
    scale = jnp.maximum(jnp.abs(x).max(-1, keepdims=True), 1e-10) / 448.0
    return (x / scale).astype(jnp.float8_e4m3fn).astype(jnp.float32) * scale

  def attention(i, q, k, v, *, positions, segment_ids):
    del i, positions
    return policy.dense_causal_attention(q, rounded(k), rounded(v), segment_ids)

  n = len(out.lengths)
  seqs = np.zeros((n, HIGH.max_prompt_len + cfg.max_new_tokens), np.int32)
  mask = np.zeros_like(seqs)
  for r in range(n):
    p, g = PROMPTS[out.prompt_index[r]], out.lengths[r]
    seqs[r, : len(p)], seqs[r, len(p) : len(p) + g] = p, out.tokens[r, :g]
    mask[r, len(p) : len(p) + g] = 1
  logits = policy.forward(params, MODEL, jnp.asarray(seqs), attention_fn=attention)
  logp, _ = policy.logprobs_from_logits(logits, jnp.asarray(seqs), jnp.asarray(mask))
  for r in range(n):
    want = np.asarray(logp[r])[mask[r].astype(bool)]
    np.testing.assert_allclose(out.logprobs[r, : out.lengths[r]], want, atol=2e-4)
