"""write_kv_pages: scatter + quantize, round-tripped through paged attention."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlx.kernels_pallas import fp8_max, paged_attention_reference, write_kv_pages

HKV, PAGE, D, PPS, P = 2, 4, 8, 3, 8


def _pool(dtype):
  return jnp.full((HKV, P, PAGE, D), jnp.nan, dtype)  # NaN: unwritten slots must never be read


def _dense_attention(q, k, v, lengths):
  """q [B, H, D], k/v [B, Hkv, L, D] float: softmax attention over the first lengths[b]."""
  group = q.shape[1] // k.shape[1]
  k = jnp.repeat(k, group, axis=1)
  v = jnp.repeat(v, group, axis=1)
  logits = jnp.einsum("bhd,bhld->bhl", q, k) / np.sqrt(q.shape[-1])
  valid = jnp.arange(k.shape[2])[None, None, :] < lengths[:, None, None]
  probs = jax.nn.softmax(jnp.where(valid, logits, -jnp.inf), axis=-1)
  return jnp.einsum("bhl,bhld->bhd", probs, jnp.where(valid[..., None], v, 0.0))


def test_write_decode_token_lands_in_page_and_row():
  kp, vp = jnp.zeros((HKV, P, PAGE, D)), jnp.zeros((HKV, P, PAGE, D))
  table = jnp.asarray([[5, 2, 7], [0, 1, 3]], jnp.int32)
  k_new = jnp.arange(2 * HKV * D, dtype=jnp.float32).reshape(2, HKV, D) + 1
  positions = jnp.asarray([6, 0], jnp.int32)  # seq 0: page slot 1 -> page 2, row 2
  kp2, vp2 = write_kv_pages(kp, vp, k_new, 2 * k_new, positions, table)
  np.testing.assert_array_equal(kp2[:, 2, 2], k_new[0])
  np.testing.assert_array_equal(kp2[:, 0, 0], k_new[1])
  np.testing.assert_array_equal(vp2[:, 2, 2], 2 * k_new[0])
  assert int((kp2 != 0).sum()) == 2 * HKV * D  # nothing else touched


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float8_e4m3fn", "float8_e5m2"])
def test_prefill_then_decode_round_trips_through_attention(dtype):
  rng = np.random.default_rng(0)
  batch, chunk, num_heads = 3, 7, 4
  k = rng.normal(size=(batch, HKV, PPS * PAGE, D)).astype(np.float32)
  v = rng.normal(size=(batch, HKV, PPS * PAGE, D)).astype(np.float32)
  q = jnp.asarray(rng.normal(size=(batch, num_heads, D)), jnp.float32)
  # Lengths after the step are 6, 8, 4: pages [6, 1], [0, 4], [7] are written; page 3 is
  # listed twice but in slots no sequence reaches (allowed, never read).
  table = jnp.asarray([[6, 1, 3], [0, 4, 2], [7, 5, 3]], jnp.int32)
  prompt = jnp.asarray([5, 7, 3], jnp.int32)  # ragged prefill chunk
  fp8 = "float8" in dtype
  k_scale = jnp.asarray(np.abs(k).max(axis=(0, 2, 3)) / 200.0, jnp.float32) if fp8 else None
  v_scale = jnp.asarray(np.abs(v).max() / 100.0, jnp.float32) if fp8 else None
  kw = dict(k_scale=k_scale, v_scale=v_scale)
  kp, vp = _pool(dtype), _pool(dtype)
  chunk_k = k[:, :, :chunk].transpose(0, 2, 1, 3)  # [B, T, Hkv, D]: the layer_qkv layout
  chunk_v = v[:, :, :chunk].transpose(0, 2, 1, 3)
  kp, vp = write_kv_pages(
    kp, vp, chunk_k, chunk_v, jnp.zeros(3, jnp.int32), table, num_new=prompt, **kw
  )
  # One decode step appends token `prompt[b]` of each sequence.
  idx = np.asarray(prompt)
  k_step = k[np.arange(batch), :, idx]
  v_step = v[np.arange(batch), :, idx]
  kp, vp = write_kv_pages(kp, vp, k_step, v_step, prompt, table, **kw)
  lengths = prompt + 1
  got = paged_attention_reference(q, kp, vp, lengths, table, **kw)
  assert np.isfinite(np.asarray(got)).all()  # NaN of unwritten slots never read
  # Expected: dense attention over the values the pool can hold (quantize-dequantize).
  ks = 1.0 if k_scale is None else np.asarray(k_scale)[None, :, None, None]
  vs = 1.0 if v_scale is None else np.asarray(v_scale)
  kq = jnp.asarray(k / ks).astype(dtype).astype(jnp.float32) * ks
  vq = jnp.asarray(v / vs).astype(dtype).astype(jnp.float32) * vs
  want = _dense_attention(q, kq, vq, lengths)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5)
  # ... and close to the unquantized attention (FP8 error budget).
  exact = _dense_attention(q, jnp.asarray(k), jnp.asarray(v), lengths)
  tol = {"float32": 1e-5, "bfloat16": 3e-2, "float8_e4m3fn": 0.15, "float8_e5m2": 0.3}[dtype]
  np.testing.assert_allclose(np.asarray(got), np.asarray(exact), atol=tol)


def test_fp8_write_saturates_instead_of_overflowing():
  kp = jnp.zeros((HKV, P, PAGE, D), jnp.float8_e4m3fn)
  k_new = jnp.full((1, HKV, D), 1e9, jnp.float32).at[0, 1].set(-1e9)
  table = jnp.asarray([[1, 2, 3]], jnp.int32)
  kp2, _ = write_kv_pages(kp, kp, k_new, k_new, jnp.asarray([0]), table, k_scale=1.0, v_scale=1.0)
  stored = np.asarray(kp2[:, 1, 0].astype(jnp.float32))
  np.testing.assert_array_equal(stored[0], fp8_max(jnp.float8_e4m3fn))
  np.testing.assert_array_equal(stored[1], -fp8_max(jnp.float8_e4m3fn))


def test_scale_change_under_jit_does_not_recompile():
  kp = jnp.zeros((HKV, P, PAGE, D), jnp.float8_e5m2)
  table = jnp.asarray([[1, 2, 3]], jnp.int32)
  k_new = jnp.ones((1, HKV, D))
  traces = []

  @jax.jit
  def step(kp, s):
    traces.append(1)
    return write_kv_pages(kp, kp, k_new, k_new, jnp.asarray([3]), table, k_scale=s, v_scale=s)[0]

  a = step(kp, jnp.float32(0.5))
  b = step(kp, jnp.float32(0.25))
  assert len(traces) == 1
  assert float(a[0, 1, 3, 0].astype(jnp.float32)) == 2.0
  assert float(b[0, 1, 3, 0].astype(jnp.float32)) == 4.0


@pytest.mark.parametrize(
  ("kwargs", "match"),
  [
    (dict(positions=jnp.asarray([12])), "capacity"),
    (dict(positions=jnp.asarray([-1])), "capacity"),
    (dict(page_table=jnp.asarray([[1, 2, 9]], jnp.int32), positions=jnp.asarray([8])), "page_"),
    (dict(k_new=jnp.ones((1, 3, D))), "k_new"),
    (dict(num_new=jnp.asarray([2])), "num_new"),
    (dict(num_new=jnp.asarray([0.5])), "num_new"),  # was silently truncated to 0
    (dict(k_scale=None), "k_scale` is required"),
  ],
)
def test_invalid_writes_raise(kwargs, match):
  kp = jnp.zeros((HKV, P, PAGE, D), jnp.float8_e4m3fn)
  args = dict(
    k_pages=kp, v_pages=kp, k_new=jnp.ones((1, HKV, D)), v_new=jnp.ones((1, HKV, D)),
    positions=jnp.asarray([0]), page_table=jnp.asarray([[1, 2, 3]], jnp.int32),
    k_scale=1.0, v_scale=1.0,
  )  # fmt: skip
  args.update(kwargs)
  if "k_new" in kwargs:
    args["v_new"] = kwargs["k_new"]
  with pytest.raises(ValueError, match=match):
    write_kv_pages(**args)


def test_stacked_pool_writes_only_the_given_layer():
  rng = np.random.default_rng(1)
  num_layers = 3
  kp = jnp.zeros((num_layers, HKV, P, PAGE, D))
  table = jnp.asarray([[5, 2, 7], [0, 1, 3]], jnp.int32)
  k_new = jnp.asarray(rng.normal(size=(2, 5, HKV, D)), jnp.float32)  # [B, T, Hkv, D]
  positions = jnp.asarray([2, 0], jnp.int32)
  num_new = jnp.asarray([5, 3], jnp.int32)
  flat_k, flat_v = write_kv_pages(kp[1], kp[1], k_new, 2 * k_new, positions, table, num_new=num_new)
  for layer in (1, jnp.int32(1)):
    got_k, got_v = write_kv_pages(
      kp, kp, k_new, 2 * k_new, positions, table, num_new=num_new, layer=layer
    )
    np.testing.assert_array_equal(got_k[1], flat_k)
    np.testing.assert_array_equal(got_v[1], flat_v)
    assert not np.asarray(got_k[0]).any() and not np.asarray(got_k[2]).any()
  # Token t of sequence 0 sits at position 2 + t: page 5 rows 2, 3 then page 2 rows 0..2.
  np.testing.assert_array_equal(flat_k[:, 5, 2], k_new[0, 0])
  np.testing.assert_array_equal(flat_k[:, 2, 2], k_new[0, 4])
  np.testing.assert_array_equal(flat_k[:, 0, 2], k_new[1, 2])
  assert int((flat_k != 0).any(axis=(0, 3)).sum()) == 8  # 5 + 3 rows written, nothing else
  with pytest.raises(ValueError, match="layer"):
    write_kv_pages(kp, kp, k_new, k_new, positions, table, layer=3)
  with pytest.raises(ValueError, match="stacked"):
    write_kv_pages(kp[0], kp[0], k_new, k_new, positions, table, layer=0)


def test_stacked_write_in_a_loop_is_in_place():
  """Inside a jitted scan carrying the stacked pool, the write is an in-place scatter."""
  num_layers = 2
  table = jnp.asarray([[1, 2, 3]], jnp.int32)

  def run(kp, vp, k_new):
    def body(carry, i):
      kp, vp = carry
      kp, vp = write_kv_pages(kp, vp, k_new, k_new, jnp.asarray([4]), table, layer=i)
      return (kp, vp), None

    return jax.lax.scan(body, (kp, vp), jnp.arange(num_layers))[0]

  pool = jnp.zeros((num_layers, HKV, 64, PAGE, D))
  hlo = jax.jit(run, donate_argnums=(0, 1)).lower(pool, pool, jnp.ones((1, HKV, D))).compile()
  text = hlo.as_text()
  shape = f"f32[{num_layers},{HKV},64,{PAGE},{D}]"
  copies = [line for line in text.splitlines() if shape in line and " copy(" in line]
  assert not copies, copies
  assert "transpose(" not in text
