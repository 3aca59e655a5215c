"""rlx.sampling end to end on a tiny model: log-probs, preemption, sharing, compiles, rng, jit.

Every sampler here shares its compiled programs with others (configs that differ
only in traced values, `Sampler.shares_compiled_programs`), so the whole module
compiles the decode loop only a handful of times.
"""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from rlx import policy, sampling
from rlx.sampling import scheduling

MODEL = policy.ModelConfig.small(
  "qwen2", vocab_size=64, hidden_size=32, intermediate_size=64, head_dim=8
)
BASE = sampling.SamplerConfig(
  max_slots=4,
  page_size=4,
  num_pages=48,
  max_prompt_len=12,
  max_new_tokens=8,
  steps_per_sync=4,
  prefill_chunk=8,
  temperature=0.0,
)
PROMPTS = [[1, 2, 3, 4, 5], [7], [3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14], [5, 6], [9, 8, 7, 6]]


@pytest.fixture(scope="module")
def params():
  p = policy.init_params(MODEL, jax.random.key(0))
  # O(1) weights: peaked, position-dependent next-token distributions.
  noise = np.random.default_rng(0)
  return jax.tree.map(lambda x: x + jnp.asarray(0.3 * noise.normal(size=x.shape), x.dtype), p)


def _sequences(prompts, out, num_samples):
  """[N, max_prompt_len + M] prompt + completion rows, masks of the completion tokens."""
  n = len(out.lengths)
  width = BASE.max_prompt_len + BASE.max_new_tokens
  seqs = np.zeros((n, width), np.int32)
  mask = np.zeros((n, width), np.int32)
  for r in range(n):
    p = prompts[r // num_samples]
    g = out.lengths[r]
    seqs[r, : len(p)] = p
    seqs[r, len(p) : len(p) + g] = out.tokens[r, :g]
    mask[r, len(p) : len(p) + g] = 1
  return seqs, mask


_token_logprobs = jax.jit(policy.token_logprobs, static_argnums=1)
_forward = jax.jit(policy.forward, static_argnums=1)


def _completion_values(x, mask):
  """Right-aligned [N, width] values on the mask -> [N, M] left-aligned, 0-padded."""
  out = np.zeros((x.shape[0], BASE.max_new_tokens), np.float32)
  for r in range(x.shape[0]):
    v = np.asarray(x[r])[mask[r].astype(bool)]
    out[r, : v.size] = v
  return out


def test_greedy_is_argmax_and_logprobs_match_token_logprobs(params):
  sampler = sampling.Sampler(MODEL, BASE)
  out = sampler.generate(params, PROMPTS, num_samples=2, rng=jax.random.key(3))
  n = len(PROMPTS) * 2
  assert out.tokens.shape == out.logprobs.shape == (n, BASE.max_new_tokens)
  np.testing.assert_array_equal(out.prompt_index, np.repeat(np.arange(len(PROMPTS)), 2))
  assert (out.lengths == BASE.max_new_tokens).all() and set(out.finish_reason) == {"length"}
  np.testing.assert_array_equal(out.tokens[0::2], out.tokens[1::2])  # greedy samples agree
  seqs, mask = _sequences(PROMPTS, out, 2)
  logits = np.asarray(_forward(params, MODEL, jnp.asarray(seqs)))
  for r in range(n):
    p = len(PROMPTS[r // 2])
    np.testing.assert_array_equal(
      out.tokens[r], logits[r, p - 1 : p - 1 + BASE.max_new_tokens].argmax(-1)
    )
  logp, _ = _token_logprobs(params, MODEL, jnp.asarray(seqs), jnp.asarray(mask))
  np.testing.assert_allclose(out.logprobs, _completion_values(logp, mask), atol=1e-4)
  assert out.stats["pages_in_use_at_end"] == 0
  assert out.stats["generated_tokens"] == n * BASE.max_new_tokens


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampled_logprobs_match_token_logprobs(params, temperature):
  cfg = dataclasses.replace(BASE, temperature=temperature)
  out = sampling.Sampler(MODEL, cfg).generate(params, PROMPTS, num_samples=3, rng=jax.random.key(1))
  seqs, mask = _sequences(PROMPTS, out, 3)
  logp, _ = _token_logprobs(
    params, MODEL, jnp.asarray(seqs), jnp.asarray(mask), temperature=jnp.float32(temperature)
  )
  np.testing.assert_allclose(out.logprobs, _completion_values(logp, mask), atol=1e-4)
  assert len({tuple(t) for t in out.tokens}) > len(PROMPTS)  # samples of a prompt differ


def test_samples_follow_the_softmax_chi_square(params):
  """Probability-integral transform of every sampled token is uniform (chi-square, 10 bins).

  For a token t drawn from p, `F(t - 1) + U p(t)` (U ~ Uniform(0, 1)) is Uniform(0, 1);
  tokens from different positions with different distributions pool into one test.
  """
  cfg = dataclasses.replace(BASE, temperature=1.0)
  prompts = PROMPTS * 4
  out = sampling.Sampler(MODEL, cfg).generate(params, prompts, num_samples=4, rng=jax.random.key(7))
  seqs, mask = _sequences(prompts, out, 4)
  logits = np.asarray(_forward(params, MODEL, jnp.asarray(seqs)), np.float64)
  probs = np.exp(logits - logits.max(-1, keepdims=True))
  probs /= probs.sum(-1, keepdims=True)
  u_rng = np.random.default_rng(0)
  pit = []
  for r in range(seqs.shape[0]):
    for s in np.nonzero(mask[r])[0]:
      p = probs[r, s - 1]
      t = seqs[r, s]
      pit.append(p[:t].sum() + u_rng.uniform() * p[t])
  counts = np.histogram(pit, bins=10, range=(0, 1))[0]
  assert len(pit) == mask.sum() >= 600
  result = stats.chisquare(counts)
  assert result.pvalue > 1e-3, (counts, result)


def test_preemption_small_pool_same_greedy_tokens(params):
  big = sampling.Sampler(MODEL, BASE).generate(
    params, PROMPTS, num_samples=2, rng=jax.random.key(0)
  )
  small_cfg = dataclasses.replace(BASE, num_pages=5)  # one full sequence: 19 tokens in 5 pages
  small = sampling.Sampler(MODEL, small_cfg)
  out = small.generate(params, PROMPTS, num_samples=2, rng=jax.random.key(0))
  assert out.stats["preemptions"] > 0
  assert out.stats["peak_pages_used"] <= 5
  np.testing.assert_array_equal(out.tokens, big.tokens)
  np.testing.assert_allclose(out.logprobs, big.logprobs, atol=1e-5)
  assert out.finish_reason == big.finish_reason and out.stats["pages_in_use_at_end"] == 0
  # Decode compiled once for this sampler whatever the mix; prefill within its bound.
  assert small.compile_counts()["decode"] == 1
  assert small.compile_counts()["prefill"] == 1  # max_slots <= 8: one row bucket


def test_decode_compiles_once_across_lengths_and_temperatures(params):
  sampler = sampling.Sampler(MODEL, BASE)
  for prompts in (PROMPTS[:1], PROMPTS, [[1] * 12] * 6, [[2]]):
    sampler.generate(params, prompts, num_samples=1, rng=jax.random.key(0))
  assert sampler.compile_counts()["decode"] == 1
  assert sampler.compile_counts()["prefill"] == 1
  # Temperature, top-p values, stop ids and steps_per_sync are traced: one more key at most.
  a = sampling.Sampler(MODEL, dataclasses.replace(BASE, temperature=0.5, steps_per_sync=3))
  b = sampling.Sampler(MODEL, dataclasses.replace(BASE, temperature=1.3, steps_per_sync=7))
  assert a.shares_compiled_programs(b)


def test_prefill_width_follows_the_prompts(params):
  # A chunk wider than the prompts: each prefill call is only as wide as the width bucket
  # of its longest piece (8 or 16 here, never the 32 of the chunk); same greedy tokens.
  assert scheduling.prefill_widths(32) == (8, 16, 32)
  assert scheduling.prefill_widths(48) == (8, 16, 32, 48)
  assert scheduling.prefill_widths(4) == (4,)
  wide = sampling.Sampler(MODEL, dataclasses.replace(BASE, prefill_chunk=32))
  abstract = jax.eval_shape(lambda: params)

  def ran_width(width):  # generate ran a (8 rows, width) call: tracing it builds no program
    before = wide.compile_counts()["prefill"]
    wide.trace_prefill(abstract, width=width)
    return wide.compile_counts()["prefill"] == before

  assert wide.compile_counts()["prefill"] == 0  # programs of this test only
  # Three rows of 4 prefilled tokens: one program, (8 rows, 8 tokens).
  wide.generate(params, [[1, 2, 3, 4, 5]] * 3, num_samples=1, rng=jax.random.key(0))
  assert wide.compile_counts()["prefill"] == 1 and ran_width(8)
  # Admissions prefill 4 / 11 / 1..3 tokens at most: one more program, 16 (the 12-token prompt).
  out = wide.generate(params, PROMPTS, num_samples=2, rng=jax.random.key(0))
  assert wide.compile_counts()["prefill"] == 2 and ran_width(16)
  assert wide.compile_counts()["prefill"] == 2 <= scheduling.prefill_compile_bound(wide.config)
  ref = sampling.Sampler(MODEL, BASE).generate(
    params, PROMPTS, num_samples=2, rng=jax.random.key(0)
  )
  np.testing.assert_array_equal(out.tokens, ref.tokens)
  np.testing.assert_allclose(out.logprobs, ref.logprobs, atol=1e-5)
  assert not ran_width(32)  # never the chunk's width: a new program


def test_trace_prefill_is_the_program_generate_runs(params):
  cfg = dataclasses.replace(BASE, kv_dtype="fp8_e4m3", max_slots=8)
  sampler = sampling.Sampler(MODEL, cfg)
  shape = (MODEL.num_layers, MODEL.num_kv_heads)
  ones = np.ones(shape, np.float32)
  assert sampler.compile_counts()["prefill"] == 0  # programs of this test only
  # 8 rows of 9 prefilled tokens: calls (8 rows, 8 tokens), then (8 rows, 1 -> 8 tokens).
  sampler.generate(params, [list(range(1, 11))] * 8, rng=jax.random.key(0), kv_scales=(ones,) * 2)
  assert sampler.compile_counts()["prefill"] == 1
  scales = (jax.ShapeDtypeStruct(shape, jnp.float32),) * 2  # abstract scales are accepted
  abstract = jax.eval_shape(lambda: params)
  # Every slot admitted with a full chunk: the widest call, (8 rows, prefill_chunk tokens).
  # Its abstract signature (shapes, dtypes, static arguments) is the program generate built:
  # tracing it builds no new one.
  traced = sampler.trace_prefill(abstract, kv_scales=scales)
  assert sampler.compile_counts()["prefill"] == 1
  assert traced.lower().compile().memory_analysis() is not None
  sampler.trace_decode(abstract, kv_scales=scales).lower()
  assert sampler.compile_counts() == {"decode": 1, "prefill": 1, "copy_pages": 0}
  with pytest.raises(ValueError, match="`rows` must be one of the prefill row buckets"):
    sampler.trace_prefill(abstract, rows=4, kv_scales=scales)
  with pytest.raises(ValueError, match="`width` must be one of the prefill widths"):
    sampler.trace_prefill(abstract, width=5, kv_scales=scales)


def test_prefix_sharing_holds_prompt_pages_once(params):
  # m = 9 prefilled prompt tokens = 2 full pages + 1 partial; decode writes positions 9..16.
  prompt = [[5, 1, 2, 3, 4, 5, 6, 7, 8, 9]]
  sampler = sampling.Sampler(MODEL, dataclasses.replace(BASE, steps_per_sync=16))
  shared = sampler.generate(params, prompt, num_samples=4, rng=jax.random.key(0))
  # 2 shared full pages + per sample 3 own pages (copied partial + 2 new) = 14; unshared: 20.
  assert shared.stats["peak_pages_used"] == 2 + 4 * 3
  assert shared.stats["pages_in_use_at_end"] == 0
  one = sampler.generate(params, prompt, num_samples=1, rng=jax.random.key(0))
  assert one.stats["peak_pages_used"] == 5  # G = 1 copies nothing
  np.testing.assert_array_equal(shared.tokens, np.repeat(one.tokens, 4, axis=0))


def test_rng_independent_of_batch_and_slots(params):
  cfg = dataclasses.replace(BASE, temperature=1.0)
  sampler = sampling.Sampler(MODEL, cfg)
  full = sampler.generate(params, PROMPTS, num_samples=2, rng=jax.random.key(5))
  again = sampler.generate(params, PROMPTS, num_samples=2, rng=jax.random.key(5))
  np.testing.assert_array_equal(full.tokens, again.tokens)
  # The first two prompts alone (other slots, other neighbours) sample the same rows.
  part = sampler.generate(params, PROMPTS[:2], num_samples=2, rng=jax.random.key(5))
  np.testing.assert_array_equal(part.tokens, full.tokens[:4])
  static = sampling.Sampler(MODEL, dataclasses.replace(cfg, continuous_batching=False))
  np.testing.assert_array_equal(
    static.generate(params, PROMPTS, num_samples=2, rng=jax.random.key(5)).tokens, full.tokens
  )
  other = sampler.generate(params, PROMPTS, num_samples=2, rng=jax.random.key(6))
  assert (other.tokens != full.tokens).any()


def test_generate_fn_inside_jit_equals_generate(params):
  cfg = dataclasses.replace(BASE, temperature=1.0, stop_token_ids=(3,))
  sampler = sampling.Sampler(MODEL, cfg)
  prompts = PROMPTS[:2]
  out = sampler.generate(params, prompts, num_samples=2, rng=jax.random.key(2))
  width = max(map(len, prompts))
  toks = np.zeros((len(prompts), width), np.int32)
  for i, p in enumerate(prompts):
    toks[i, : len(p)] = p
  lens = np.asarray([len(p) for p in prompts], np.int32)

  @jax.jit
  def rollout(params, toks, lens, rng):
    return sampler.generate_fn(
      params, jnp.repeat(toks, 2, axis=0), jnp.repeat(lens, 2), rng, num_samples=2
    )

  tokens, logprobs, lengths, stopped = rollout(params, toks, lens, jax.random.key(2))
  np.testing.assert_array_equal(tokens, out.tokens)
  np.testing.assert_allclose(logprobs, out.logprobs, atol=1e-5)
  np.testing.assert_array_equal(lengths, out.lengths)
  np.testing.assert_array_equal(stopped, np.asarray(out.finish_reason) == "stop")
  with pytest.raises(ValueError, match="max_slots"):
    sampler.generate_fn(
      params, np.ones((5, 3), np.int32), np.full(5, 3, np.int32), jax.random.key(0)
    )
  with pytest.raises(ValueError, match="num_pages"):
    tight = sampling.Sampler(MODEL, dataclasses.replace(cfg, num_pages=9))
    tight.generate_fn(params, np.ones((2, 3), np.int32), np.full(2, 3, np.int32), jax.random.key(0))


def test_stop_tokens_end_samples(params):
  greedy = sampling.Sampler(MODEL, BASE).generate(params, PROMPTS, rng=jax.random.key(0))
  stop = int(greedy.tokens[0, 2])
  cfg = dataclasses.replace(BASE, stop_token_ids=(stop,))
  out = sampling.Sampler(MODEL, cfg).generate(params, PROMPTS, rng=jax.random.key(0))
  for r in range(len(PROMPTS)):
    row = greedy.tokens[r].tolist()
    if stop in row:
      g = row.index(stop) + 1
      assert out.finish_reason[r] == "stop" and out.lengths[r] == g
      np.testing.assert_array_equal(out.tokens[r, :g], row[:g])
      assert not out.tokens[r, g:].any() and not out.logprobs[r, g:].any()
    else:
      assert out.finish_reason[r] == "length"
  assert "stop" in out.finish_reason


def test_top_k_top_p_sampler_never_emits_excluded_tokens(params):
  cfg = dataclasses.replace(BASE, temperature=0.8, top_k=6, top_p=0.7)
  out = sampling.Sampler(MODEL, cfg).generate(params, PROMPTS, num_samples=4, rng=jax.random.key(4))
  seqs, mask = _sequences(PROMPTS, out, 4)
  logits = np.asarray(_forward(params, MODEL, jnp.asarray(seqs))) / 0.8
  for r in range(seqs.shape[0]):
    for s in np.nonzero(mask[r])[0]:
      row = logits[r, s - 1]
      order = np.argsort(-row)[:6]
      p = np.exp(row[order] - row[order].max())
      p /= p.sum()
      nucleus = order[: int(np.sum(np.cumsum(p) - p < 0.7))]
      assert seqs[r, s] in nucleus


def _pool_materialisations(hlo: str, layer_pool: tuple, num_layers: int):
  """Top-level HLO ops that materialise a layer's pool or copy/slice the stacked pool.

  Ops inside fusion computations are skipped: there a dynamic-slice of the pool
  is computed lazily by its consumer (the page gather), element by element.
  Returns (offending lines, number of ops producing the stacked pool shape).
  """
  full_pool = (num_layers, *layer_pool)
  bad, seen = [], 0
  for block in re.split(r"\n(?=\S)", hlo):
    if block.startswith(("%fused", "%wrapped")):
      continue
    for line in block.splitlines()[1:]:
      found = re.match(r"\s*(ROOT )?%\S+ = \w+\[([\d,]*)\]\S* ([\w-]+)\(", line)
      if not found:
        continue
      dims = tuple(int(d) for d in found.group(2).split(",") if d)
      op = found.group(3)
      seen += dims == full_pool
      if dims in (layer_pool, (1, *layer_pool)) and op != "bitcast":
        bad.append(line.strip()[:160])
      elif dims == full_pool and op in ("copy", "dynamic-slice", "slice", "concatenate"):
        bad.append(line.strip()[:160])
  return bad, seen


def test_pool_check_flags_a_materialised_layer():
  """Negative control of the HLO check below: slicing a layer out and using it is caught."""
  pool = jnp.zeros((2, 2, 48, 4, 8))
  hlo = jax.jit(lambda p, i: jnp.sin(p[i]) + 1).lower(pool, 1).compile().as_text()
  bad, _ = _pool_materialisations(hlo, (2, 48, 4, 8), 2)
  assert bad


# 72-token page tables: the XLA attention runs two blocks, the second under a `lax.cond`
# (whose operands would be materialised if a layer's pool were sliced out for it).
_TWO_BLOCKS = dataclasses.replace(BASE, max_new_tokens=60)


@pytest.mark.parametrize("cfg", [BASE, _TWO_BLOCKS], ids=["one_block", "two_blocks"])
def test_decode_step_reads_pages_without_copying_the_pool(params, cfg):
  """Compiled decode loop: the stacked pool is updated in place, never copied or sliced whole."""
  sampler = sampling.Sampler(MODEL, cfg)
  hlo = sampler.trace_decode(params).lower().compile().as_text()
  m = MODEL
  layer_pool = (m.num_kv_heads, cfg.num_pages, cfg.page_size, m.head_dim)
  bad, seen = _pool_materialisations(hlo, layer_pool, m.num_layers)
  assert not bad, bad
  assert seen  # the check looked at the right shapes
  assert (" conditional(" in hlo) == (cfg is _TWO_BLOCKS)  # the block skip is compiled in
