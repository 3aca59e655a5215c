"""Paged prefill attention vs its dense reference, and vs decode attention on written pages.

Cases sweep the page dtype (f32, bf16, FP8 e4m3 / e5m2), the GQA ratio, the
page size and stacked vs single-layer pools; every case holds rows that start at
0 (no cached part), start mid-page, start on a page boundary, and a padding row
(num_new = 0), with stale NaN in every page position a row must not read.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlx.kernels_pallas import (
  paged_attention_reference,
  paged_prefill_attention,
  paged_prefill_attention_reference,
  write_kv_pages,
)

B, C, HKV, D = 4, 8, 2, 16
PAGES_PER_SEQUENCE = 5
CASES = [
  ("float32", 1, 4, False),
  ("float32", 4, 8, True),
  ("bfloat16", 2, 4, True),
  ("float8_e4m3fn", 4, 4, True),
  ("float8_e5m2", 1, 8, False),
]
# Max abs error vs the reference: float32 math on the same (rounded) values in both;
# bf16 queries/keys in the bf16 and FP8 cases round the bf16 output.
TOLERANCE = {"float32": 2e-5, "bfloat16": 2e-2, "float8_e4m3fn": 2e-2, "float8_e5m2": 2e-2}
START = np.asarray([0, 6, 8, 0], np.int32)  # from 0, mid-page, page boundary (page 4), padding
NUM_NEW = np.asarray([8, 5, 8, 0], np.int32)


def _inputs(dtype, group, page_size, stacked, seed=0):
  rng = np.random.default_rng(seed)
  num_pages = B * PAGES_PER_SEQUENCE + 3
  q_dtype = jnp.float32 if dtype == "float32" else jnp.bfloat16
  h = HKV * group
  q = jnp.asarray(rng.normal(size=(B, C, h, D)), q_dtype)
  k = jnp.asarray(rng.normal(size=(B, C, HKV, D)), q_dtype)
  v = jnp.asarray(rng.normal(size=(B, C, HKV, D)), q_dtype)
  layers = 3 if stacked else 1
  shape = (layers, HKV, num_pages, page_size, D)
  pools = [np.full(shape, np.nan, np.float32) for _ in range(2)]
  table = rng.permutation(num_pages)[: B * PAGES_PER_SEQUENCE].reshape(B, PAGES_PER_SEQUENCE)
  for pool in pools:  # cached positions < start hold values, everything else NaN
    for b in range(B):
      for t in range(START[b]):
        pool[:, :, table[b, t // page_size], t % page_size] = rng.normal(size=(layers, HKV, D))
  k_pages, v_pages = (jnp.asarray(p, dtype) for p in pools)
  if not stacked:
    k_pages, v_pages = k_pages[0], v_pages[0]
  scales = {}
  if "float8" in dtype:
    scales = dict(k_scale=jnp.asarray([0.02, 0.05]), v_scale=jnp.float32(0.03))
  layer = 1 if stacked else None
  args = (q, k, v, k_pages, v_pages, jnp.asarray(START), jnp.asarray(NUM_NEW))
  return args + (jnp.asarray(table, jnp.int32),), dict(layer=layer, **scales)


@pytest.mark.parametrize("dtype, group, page_size, stacked", CASES)
def test_matches_reference(dtype, group, page_size, stacked):
  args, kw = _inputs(dtype, group, page_size, stacked)
  out = paged_prefill_attention(*args, **kw)
  ref = paged_prefill_attention_reference(*args, **kw)
  assert out.shape == args[0].shape and out.dtype == args[0].dtype and ref.dtype == jnp.float32
  assert np.isfinite(np.asarray(out, np.float32)).all()
  np.testing.assert_allclose(np.asarray(out, np.float32), ref, atol=TOLERANCE[dtype])
  assert not np.asarray(out[3]).any()  # padding row (nothing to attend to): zeros, no NaN
  # Under jit with traced positions (the sampler's prefill) and a traced layer.
  jitted = jax.jit(lambda *a: paged_prefill_attention(*a[:8], **kw))(*args)
  np.testing.assert_allclose(np.asarray(jitted, np.float32), np.asarray(out, np.float32))


def test_all_rows_from_position_zero_skip_the_cached_part():
  args, kw = _inputs("float32", 2, 4, False)
  start = jnp.zeros((B,), jnp.int32)
  args = (*args[:5], start, *args[6:])
  np.testing.assert_allclose(
    paged_prefill_attention(*args, **kw), paged_prefill_attention_reference(*args, **kw), atol=2e-5
  )


@pytest.mark.parametrize("dtype", ["float32", "float8_e4m3fn"])
def test_equals_decode_attention_over_the_written_chunk(dtype):
  """Writing the chunk into the pages and reading query c's keys by decode attention
  (length start + c + 1) gives the same output: the chunk's own K/V are rounded as stored."""
  args, kw = _inputs(dtype, 2, 4, False)
  q, k, v, k_pages, v_pages, start, num_new, table = args
  k_pages, v_pages = (
    jnp.nan_to_num(p.astype(jnp.float32)).astype(p.dtype) for p in (k_pages, v_pages)
  )
  scales = {n: kw[n] for n in ("k_scale", "v_scale") if n in kw}
  out = paged_prefill_attention(q, k, v, k_pages, v_pages, start, num_new, table, **scales)
  kp, vp = write_kv_pages(k_pages, v_pages, k, v, start, table, num_new=num_new, **scales)
  for b in range(3):  # the real rows
    for c in range(int(num_new[b])):
      lengths = jnp.asarray([int(start[b]) + c + 1], jnp.int32)
      want = paged_attention_reference(q[b : b + 1, c], kp, vp, lengths, table[b : b + 1], **scales)
      tol = 2e-5 if dtype == "float32" else 2e-2
      np.testing.assert_allclose(np.asarray(out[b, c], np.float32), want[0], atol=tol)


def test_bad_inputs_name_the_argument():
  args, kw = _inputs("float32", 2, 4, True)
  q, k, v, k_pages, v_pages, start, num_new, table = args
  with pytest.raises(ValueError, match="`q`"):
    paged_prefill_attention(q[0], k, v, k_pages, v_pages, start, num_new, table, **kw)
  with pytest.raises(ValueError, match="`k` and `v`"):
    paged_prefill_attention(q, k[:, :4], v, k_pages, v_pages, start, num_new, table, **kw)
  with pytest.raises(ValueError, match="`k_pages`"):
    paged_prefill_attention(q, k, v, k_pages[0], v_pages, start, num_new, table, **kw)
  with pytest.raises(ValueError, match="`layer`"):
    paged_prefill_attention(q, k, v, k_pages, v_pages, start, num_new, table, layer=3)
  with pytest.raises(ValueError, match="`start`"):
    paged_prefill_attention(q, k, v, k_pages, v_pages, start[:2], num_new, table, **kw)
  with pytest.raises(ValueError, match="num_new"):
    paged_prefill_attention(q, k, v, k_pages, v_pages, start, num_new + 1, table, **kw)
  with pytest.raises(ValueError, match="`page_table`"):
    paged_prefill_attention(q, k, v, k_pages, v_pages, start, num_new, table[:2], **kw)
  fp8 = (k_pages.astype(jnp.float8_e4m3fn), v_pages.astype(jnp.float8_e4m3fn))
  with pytest.raises(ValueError, match="k_scale"):
    paged_prefill_attention(q, k, v, *fp8, start, num_new, table, **kw)
  with pytest.raises(ValueError, match="sm_scale"):
    paged_prefill_attention_reference(
      q, k, v, k_pages, v_pages, start, num_new, table, sm_scale="1", **kw
    )


def _dense_by_hand(q, pools, scales, start, num_new, table, sm_scale):
  """float64 attention of every chunk query, one (row, query) at a time, from written pages.

  `pools` hold the chunk too (`write_kv_pages`). Query c of row b (position start[b] + c)
  sees positions t < start[b] + min(c + 1, num_new[b]): its cached tokens and the chunk's
  tokens up to itself (a padding query c >= num_new[b] sees all real ones). Gather them
  from page table[b, t // page] at slot t % page into dense K/V (times the KV head's
  scale), then a plain softmax over exactly those keys.
  """
  b, c, h, d = q.shape
  hkv, page_size = pools[0].shape[0], pools[0].shape[2]
  kp, vp = (np.asarray(p.astype(jnp.float32), np.float64) * s[:, None, None, None]
            for p, s in zip(pools, scales, strict=True))  # fmt: skip
  q = np.asarray(q.astype(jnp.float32), np.float64)
  out = np.zeros((b, c, h, d))
  for row in range(b):
    for query in range(c):
      positions = range(start[row] + min(query + 1, num_new[row]))
      if not positions:
        continue  # nothing to attend to: zeros
      pages = [table[row, t // page_size] for t in positions]
      slots = [t % page_size for t in positions]
      keys, values = kp[:, pages, slots], vp[:, pages, slots]  # [Hkv, T, D]
      for head in range(h):
        g = head // (h // hkv)
        logits = sm_scale * keys[g] @ q[row, query, head]
        p = np.exp(logits - logits.max())
        out[row, query, head] = (p / p.sum()) @ values[g]
  return out


@pytest.mark.parametrize("dtype, group, page_size, stacked", CASES)
def test_matches_dense_causal_attention_by_hand(dtype, group, page_size, stacked):
  """Gather the pages (chunk written) into dense K/V, causal masked softmax: the same output."""
  args, kw = _inputs(dtype, group, page_size, stacked)
  q, k, v, k_pages, v_pages, start, num_new, table = args
  out = paged_prefill_attention(*args, **kw)
  written = write_kv_pages(k_pages, v_pages, k, v, start, table, num_new=num_new, **kw)
  layer = kw["layer"] or 0
  pools = [p[layer] if stacked else p for p in written]
  scales = [
    np.broadcast_to(np.asarray(kw.get(name, 1.0), np.float64), (HKV,))
    for name in ("k_scale", "v_scale")
  ]
  want = _dense_by_hand(q, pools, scales, START, NUM_NEW, np.asarray(table), D**-0.5)
  np.testing.assert_allclose(np.asarray(out, np.float32), want, atol=TOLERANCE[dtype], rtol=0)
  # A query sees no later chunk token: changing the last real token of row 1 leaves its
  # earlier queries as they were.
  last = int(NUM_NEW[1]) - 1
  k2, v2 = k.at[1, last].add(1.0), v.at[1, last].add(1.0)
  out2 = paged_prefill_attention(q, k2, v2, *args[3:], **kw)
  np.testing.assert_array_equal(np.asarray(out2[1, :last]), np.asarray(out[1, :last]))
  assert np.any(np.asarray(out2[1, last]) != np.asarray(out[1, last]))
