"""Per-token FP8 KV scales: the write, decode attention (XLA, GPU kernel, reference), prefill.

The write stores `scale = amax_d |k| / fp8_max` per token and KV head beside the
pages; every reader multiplies each cached token by its own scale. The dense
float32 formula is computed here from the definition and compared with every
path (the TPU kernel in interpret mode here, and compiled for a TPU in its own test file).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from rlx.kernels_pallas import (
  PagedAttentionBlockSizes,
  fp8_max,
  paged_attention,
  paged_attention_reference,
  paged_prefill_attention,
  paged_prefill_attention_reference,
  write_kv_pages,
  write_kv_pages_per_token,
)

HKV, PAGES, PAGE, D = 2, 12, 8, 16
PPS = 3  # pages per sequence: capacity 24


def _table(batch):
  rng = np.random.default_rng(1)
  return jnp.asarray(rng.permutation(PAGES)[: batch * PPS].reshape(batch, PPS), jnp.int32)


def _filled(dtype, lengths, seed=0, layers=None, outlier=1.0):
  """Pools written with per-token scales; also the exact K/V written (K channel 0 x outlier)."""
  rng = np.random.default_rng(seed)
  batch = len(lengths)
  cap = PPS * PAGE
  k = rng.normal(size=(batch, cap, HKV, D)).astype(np.float32)
  k[..., 0] = outlier * (1.0 + np.abs(k[..., 0]))
  k *= rng.uniform(0.01, 30.0, size=(batch, cap, HKV, 1))  # token magnitudes far apart
  v = rng.normal(size=(batch, cap, HKV, D)).astype(np.float32)
  lead = () if layers is None else (layers,)
  pool = jnp.zeros((*lead, HKV, PAGES, PAGE, D), dtype)
  scales = jnp.ones((*lead, HKV, PAGES, PAGE), jnp.float32)
  table = _table(batch)
  kp, vp, ks, vs = pool, pool, scales, scales
  num = jnp.asarray(lengths, jnp.int32)
  for layer in range(1 if layers is None else layers):
    kp, vp, ks, vs = write_kv_pages_per_token(
      kp, vp, ks, vs, jnp.asarray(k) * (layer + 1), jnp.asarray(v), jnp.zeros((batch,), jnp.int32),
      table, num_new=num, layer=None if layers is None else layer,
    )  # fmt: skip
  return kp, vp, ks, vs, table, k, v


def _dense_reference(q, kp, vp, ks, vs, lengths, table):
  """The definition: K[t] = k_pages[g, page, row] * k_scale[g, page, row]; masked softmax."""
  q, kp, vp = (
    np.asarray(q, np.float32),
    np.asarray(kp.astype(jnp.float32)),
    np.asarray(vp.astype(jnp.float32)),
  )
  ks, vs, table = np.asarray(ks), np.asarray(vs), np.asarray(table)
  batch, heads, _ = q.shape
  group = heads // HKV
  out = np.zeros((batch, heads, D))
  for b in range(batch):
    n = int(lengths[b])
    pages, rows = table[b, np.arange(n) // PAGE], np.arange(n) % PAGE
    for h in range(heads):
      g = h // group
      keys = kp[g, pages, rows] * ks[g, pages, rows][:, None]
      vals = vp[g, pages, rows] * vs[g, pages, rows][:, None]
      logits = keys @ q[b, h] / np.sqrt(D)
      p = np.exp(logits - logits.max())
      out[b, h] = (p / p.sum()) @ vals
  return out


@pytest.mark.parametrize("dtype", [jnp.float8_e4m3fn, jnp.float8_e5m2])
def test_write_stores_each_tokens_amax_on_the_format_max(dtype):
  lengths = [5, 24]
  kp, vp, ks, vs, table, k, v = _filled(dtype, lengths)
  fmax = fp8_max(dtype)
  for b, n in enumerate(lengths):
    pages, rows = np.asarray(table)[b, np.arange(n) // PAGE], np.arange(n) % PAGE
    for g in range(HKV):
      scale = np.asarray(ks)[g, pages, rows]
      np.testing.assert_allclose(scale, np.abs(k[b, :n, g]).max(-1) / fmax, rtol=1e-6)
      stored = np.asarray(kp[g, pages, rows].astype(jnp.float32))
      np.testing.assert_array_equal(np.abs(stored).max(-1), fmax)  # the amax lands exactly
      back = stored * scale[:, None]
      rel = np.linalg.norm(back - k[b, :n, g]) / np.linalg.norm(k[b, :n, g])
      assert rel < (0.04 if dtype == jnp.float8_e4m3fn else 0.08), rel
  # Rows past each length keep their initial scale (1) and zero pages.
  written = np.zeros((PAGES, PAGE), bool)
  for b, n in enumerate(lengths):
    written[np.asarray(table)[b, np.arange(n) // PAGE], np.arange(n) % PAGE] = True
  np.testing.assert_array_equal(np.asarray(ks)[:, ~written], 1.0)


def test_per_token_error_is_below_static_per_head_on_tokens_of_mixed_magnitude():
  """A float format's relative error barely depends on a static scale; a per-token scale puts
  each token's largest element exactly on the format's max. With an outlier channel, as
  trained keys have, that element dominates the token's norm, so the error drops."""
  lengths = [24, 24]
  kp, _, ks, _, table, k, _ = _filled(jnp.float8_e4m3fn, lengths, outlier=8.0)
  amax = np.abs(k).max(axis=(0, 1, 3))  # per head
  kp_static, _ = write_kv_pages(
    jnp.zeros((HKV, PAGES, PAGE, D), jnp.float8_e4m3fn),
    jnp.zeros((HKV, PAGES, PAGE, D), jnp.float8_e4m3fn), jnp.asarray(k), jnp.asarray(k),
    jnp.zeros((2,), jnp.int32), table, k_scale=jnp.asarray(amax / 448.0), v_scale=1.0,
  )  # fmt: skip

  def rel_err(pages, scale):
    t = np.asarray(table)
    got = np.asarray(pages.astype(jnp.float32))[:, t].reshape(HKV, 2, -1, D)
    got = got * (np.asarray(scale)[:, t].reshape(HKV, 2, -1)[..., None] if scale.ndim > 1
                 else np.asarray(scale)[:, None, None, None])  # fmt: skip
    want = k.transpose(2, 0, 1, 3)
    return np.mean(np.linalg.norm(got - want, axis=-1) / np.linalg.norm(want, axis=-1))

  per_token, static = rel_err(kp, ks), rel_err(kp_static, jnp.asarray(amax / 448.0))
  assert per_token < 0.6 * static, (per_token, static)


@pytest.mark.parametrize(
  "impl, interpret, block",
  [
    ("xla", False, PagedAttentionBlockSizes()),
    ("xla", False, PagedAttentionBlockSizes(pages_per_compute_block=1)),
    ("pallas_gpu", True, PagedAttentionBlockSizes(pages_per_compute_block=2)),
    ("pallas_gpu", True, PagedAttentionBlockSizes(pages_per_compute_block=2, pages_per_split=2)),
    ("pallas_tpu", pltpu.InterpretParams(), PagedAttentionBlockSizes(pages_per_compute_block=2)),
  ],
)
@pytest.mark.parametrize("group", [1, 2])
def test_decode_attention_matches_the_definition(impl, interpret, block, group):
  lengths = np.asarray([1, 8, 9, 24], np.int32)
  kp, vp, ks, vs, table, _, _ = _filled(jnp.float8_e4m3fn, lengths, seed=2)
  q = jnp.asarray(np.random.default_rng(3).normal(size=(4, HKV * group, D)), jnp.float32)
  want = _dense_reference(q, kp, vp, ks, vs, lengths, table)
  ref = paged_attention_reference(q, kp, vp, jnp.asarray(lengths), table, k_scale=ks, v_scale=vs)
  np.testing.assert_allclose(ref, want, atol=1e-5)
  got = paged_attention(
    q, kp, vp, jnp.asarray(lengths), table, k_scale=ks, v_scale=vs, impl=impl,
    interpret=interpret, block_sizes=block,
  )  # fmt: skip
  np.testing.assert_allclose(got, want, atol=2e-5)


@pytest.mark.parametrize(
  "impl, interpret", [("xla", False), ("pallas_gpu", True), ("pallas_tpu", pltpu.InterpretParams())]
)
def test_garbage_scales_past_the_length_never_reach_the_output(impl, interpret):
  lengths = np.asarray([3, 13], np.int32)
  kp, vp, ks, vs, table, _, _ = _filled(jnp.float8_e4m3fn, lengths, seed=4)
  q = jnp.asarray(np.random.default_rng(5).normal(size=(2, HKV, D)), jnp.float32)
  kwargs = dict(impl=impl, interpret=interpret)
  clean = paged_attention(q, kp, vp, jnp.asarray(lengths), table, k_scale=ks, v_scale=vs, **kwargs)
  used = np.zeros((PAGES, PAGE), bool)
  for b, n in enumerate(lengths):
    used[np.asarray(table)[b, np.arange(n) // PAGE], np.arange(n) % PAGE] = True
  bad = (
    jnp.where(jnp.asarray(used)[None], ks, jnp.nan),
    jnp.where(jnp.asarray(used)[None], vs, jnp.inf),
  )
  dirty = paged_attention(
    q, kp, vp, jnp.asarray(lengths), table, k_scale=bad[0], v_scale=bad[1], **kwargs
  )
  np.testing.assert_array_equal(np.asarray(dirty), np.asarray(clean))


def test_stacked_layer_reads_its_own_scales():
  lengths = np.asarray([7, 20], np.int32)
  kp, vp, ks, vs, table, _, _ = _filled(jnp.float8_e4m3fn, lengths, seed=6, layers=3)
  q = jnp.asarray(np.random.default_rng(7).normal(size=(2, HKV, D)), jnp.float32)
  for layer in range(3):
    want = _dense_reference(q, kp[layer], vp[layer], ks[layer], vs[layer], lengths, table)
    got = jax.jit(
      lambda q, kp, vp, ks, vs, layer: paged_attention(
        q, kp, vp, jnp.asarray(lengths), table, k_scale=ks, v_scale=vs, layer=layer, impl="xla"
      )
    )(q, kp, vp, ks, vs, jnp.int32(layer))
    np.testing.assert_allclose(got, want, atol=2e-5)
    gpu = paged_attention(
      q, kp, vp, jnp.asarray(lengths), table, k_scale=ks, v_scale=vs, layer=layer,
      impl="pallas_gpu", interpret=True, block_sizes=PagedAttentionBlockSizes(2),
    )  # fmt: skip
    np.testing.assert_allclose(gpu, want, atol=2e-5)


def test_unit_per_token_scales_equal_unit_static_scales():
  lengths = np.asarray([5, 17], np.int32)
  kp, vp, _, _, table, _, _ = _filled(jnp.float8_e4m3fn, lengths, seed=8)
  q = jnp.asarray(np.random.default_rng(9).normal(size=(2, HKV, D)), jnp.float32)
  ones = jnp.ones((HKV, PAGES, PAGE), jnp.float32)
  a = paged_attention(q, kp, vp, jnp.asarray(lengths), table, k_scale=ones, v_scale=ones)
  b = paged_attention(q, kp, vp, jnp.asarray(lengths), table, k_scale=1.0, v_scale=1.0)
  np.testing.assert_allclose(a, b, atol=1e-6)


@pytest.mark.parametrize("stacked", [False, True])
def test_prefill_attention_matches_reference_and_decode(stacked):
  """Chunk 2 of a prompt over its cached chunk 1: wrapper == reference, and the last query
  equals decode attention over the pool after the chunk is written."""
  rng = np.random.default_rng(10)
  batch, c = 2, 8
  start = jnp.asarray([8, 11], jnp.int32)
  num_new = jnp.asarray([8, 5], jnp.int32)
  table = _table(batch)
  lead = (2,) if stacked else ()
  layer = 1 if stacked else None
  kp = vp = jnp.zeros((*lead, HKV, PAGES, PAGE, D), jnp.float8_e4m3fn)
  ks = vs = jnp.ones((*lead, HKV, PAGES, PAGE), jnp.float32)
  k1 = jnp.asarray(
    rng.normal(size=(batch, 16, HKV, D)) * rng.uniform(0.1, 10, (batch, 16, HKV, 1)), jnp.float32
  )
  v1 = jnp.asarray(rng.normal(size=(batch, 16, HKV, D)), jnp.float32)
  kp, vp, ks, vs = write_kv_pages_per_token(
    kp, vp, ks, vs, k1, v1, jnp.zeros((batch,), jnp.int32), table, num_new=start, layer=layer
  )
  q = jnp.asarray(rng.normal(size=(batch, c, 2 * HKV, D)), jnp.float32)
  k = jnp.asarray(rng.normal(size=(batch, c, HKV, D)) * 5, jnp.float32)
  v = jnp.asarray(rng.normal(size=(batch, c, HKV, D)), jnp.float32)
  args = (q, k, v, kp, vp, start, num_new, table)
  got = paged_prefill_attention(*args, k_scale=ks, v_scale=vs, layer=layer)
  ref = paged_prefill_attention_reference(*args, k_scale=ks, v_scale=vs, layer=layer)
  np.testing.assert_allclose(got, ref, atol=2e-5)
  # Write the chunk, then decode-attend the last real query of each row over everything.
  kp2, vp2, ks2, vs2 = write_kv_pages_per_token(
    kp, vp, ks, vs, k, v, start, table, num_new=num_new, layer=layer
  )
  last = num_new - 1
  q_last = q[jnp.arange(batch), last]
  dec = paged_attention(
    q_last, kp2, vp2, start + num_new, table, k_scale=ks2, v_scale=vs2, layer=layer, impl="xla"
  )
  np.testing.assert_allclose(got[jnp.arange(batch), last], dec, atol=2e-5)


def test_bad_per_token_arguments_are_named():
  kp = jnp.zeros((HKV, PAGES, PAGE, D), jnp.float8_e4m3fn)
  ks = jnp.ones((HKV, PAGES, PAGE), jnp.float32)
  new = jnp.zeros((1, HKV, D), jnp.float32)
  pos, table = jnp.zeros((1,), jnp.int32), _table(1)
  with pytest.raises(ValueError, match="need FP8 pages"):
    write_kv_pages_per_token(
      kp.astype(jnp.bfloat16), kp.astype(jnp.bfloat16), ks, ks, new, new, pos, table
    )
  with pytest.raises(ValueError, match="`v_scale` must be float32 per-token scales"):
    write_kv_pages_per_token(kp, kp, ks, ks[:, :, :4], new, new, pos, table)
  q = jnp.zeros((1, HKV, D), jnp.float32)
  lengths = jnp.ones((1,), jnp.int32)
  with pytest.raises(ValueError, match="must both be static"):
    paged_attention(q, kp, kp, lengths, table, k_scale=ks, v_scale=1.0)
  with pytest.raises(ValueError, match=r"\(2, 12, 8\) \(one per token\)"):
    paged_attention(q, kp, kp, lengths, table, k_scale=ks[:, :, :3], v_scale=ks[:, :, :3])
