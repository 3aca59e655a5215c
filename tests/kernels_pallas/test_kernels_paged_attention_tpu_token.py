"""Per-token KV scales in the TPU (Pallas Mosaic) paged decode-attention kernel.

`paged_attention(..., impl="pallas_tpu")` with per-token scales `k_scale = scales[g, 0] *
k_token` (V likewise, `[Hkv, P, page_size]`) is run in interpret mode
(`pltpu.InterpretParams()`) against a dense float32 jnp computation of

  K[t] = k_pages[g, page, row] * scales[g, 0] * k_token[g, page, row]   (V likewise)

and its Mosaic kernel (and the static-scale one) is compiled with the real TPU
compiler for a compile-only v5e device when libtpu is importable
(https://docs.jax.dev/en/latest/aot.html).
"""

import os

# libtpu reads these when the first topology is built (as in tests/tpu/conftest.py):
# no metadata-server look-ups, one local worker, several test processes may load it.
os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v5litepod-4")
os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import functools  # noqa: E402 (after the libtpu environment)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from jax import lax  # noqa: E402
from jax.experimental.pallas import tpu as pltpu  # noqa: E402

from rlx.kernels_pallas import PagedAttentionBlockSizes, paged_attention  # noqa: E402

NUM_SEQS = 4
PAGES_PER_SEQUENCE = 3
# Max abs error vs the float32 reference: f32 pages run f32 dots; FP8 pages run bf16
# queries and bf16 probabilities in the PV dot (~2^-8 relative), as tolerated for the
# TPU kernel in test_kernels_paged_attention.py.
TOLERANCE = {"float32": 2e-5, "float8_e4m3fn": 2e-2}


def make_inputs(dtype, num_heads, num_kv_heads, page_size, head_dim, total_pages, seed=0):
  """4 sequences of 3-page tables: lengths 1, mid-page, 2 pages, capacity."""
  rng = np.random.default_rng(seed)
  dtype = jnp.dtype(dtype)
  q_dtype = jnp.float32 if dtype == jnp.float32 else jnp.bfloat16
  q = jnp.asarray(rng.normal(size=(NUM_SEQS, num_heads, head_dim)), q_dtype)
  shape = (num_kv_heads, total_pages, page_size, head_dim)
  if dtype == jnp.float32:
    k_pages = jnp.asarray(rng.normal(size=shape), jnp.float32)
    v_pages = jnp.asarray(rng.normal(size=shape), jnp.float32)
    scales = rng.uniform(0.5, 1.5, size=(num_kv_heads, 2))
  else:  # FP8 values up to ~+-40 (e4m3 max 448), per-head scales bring them to O(1)
    k_pages = jnp.asarray(np.clip(8 * rng.normal(size=shape), -448, 448), dtype)
    v_pages = jnp.asarray(np.clip(8 * rng.normal(size=shape), -448, 448), dtype)
    scales = rng.uniform(0.5, 1.5, size=(num_kv_heads, 2)) / 8
  token_shape = (num_kv_heads, total_pages, page_size)
  k_token = jnp.asarray(rng.uniform(0.25, 2.0, size=token_shape), jnp.float32)
  v_token = jnp.asarray(rng.uniform(0.25, 2.0, size=token_shape), jnp.float32)
  capacity = PAGES_PER_SEQUENCE * page_size
  lengths = jnp.asarray([1, page_size + page_size // 2 - 1, 2 * page_size, capacity], jnp.int32)
  table = rng.permutation(total_pages)[: NUM_SEQS * PAGES_PER_SEQUENCE]
  page_table = jnp.asarray(table.reshape(NUM_SEQS, PAGES_PER_SEQUENCE), jnp.int32)
  scales = jnp.asarray(scales, jnp.float32)
  return q, k_pages, v_pages, lengths, page_table, scales, (k_token, v_token)


@functools.partial(jax.jit, static_argnames=("sm_scale",))
def dense_reference(q, k_pages, v_pages, lengths, page_table, scales, token_scales, sm_scale):
  """The formula in float32 jnp: gather pages by the table, scale, masked softmax."""
  k_token, v_token = token_scales
  batch, num_heads, head_dim = q.shape
  num_kv_heads, _, page_size, _ = k_pages.shape
  group = num_heads // num_kv_heads
  capacity = page_table.shape[1] * page_size
  t = jnp.arange(capacity)
  page = page_table[:, t // page_size]  # [B, L]
  row = jnp.broadcast_to(t % page_size, page.shape)
  valid = t[None, :] < lengths[:, None]  # [B, L]
  g = jnp.arange(num_kv_heads)[:, None, None]
  k = k_pages[g, page, row].astype(jnp.float32)  # [Hkv, B, L, D]
  v = v_pages[g, page, row].astype(jnp.float32)
  k = k * (scales[:, 0][:, None, None] * k_token[g, page, row])[..., None]
  v = v * (scales[:, 1][:, None, None] * v_token[g, page, row])[..., None]
  k = jnp.where(valid[None, :, :, None], k, 0.0)
  v = jnp.where(valid[None, :, :, None], v, 0.0)
  qf = q.astype(jnp.float32).reshape(batch, num_kv_heads, group, head_dim)
  hp = lax.Precision.HIGHEST
  logits = jnp.einsum("bhgd,hbld->bhgl", qf, k, precision=hp) * sm_scale
  logits = jnp.where(valid[:, None, None, :], logits, -jnp.inf)
  probs = jax.nn.softmax(logits, axis=-1)
  out = jnp.einsum("bhgl,hbld->bhgd", probs, v, precision=hp)
  return out.reshape(batch, num_heads, head_dim)


def run_kernel(q, k_pages, v_pages, lengths, page_table, scales, token_scales, *, ppcb):
  """The TPU kernel in interpret mode: per-token scales `scales[:, 0] * k_token` (V likewise),
  or the static per-head scales `scales[:, 0]` / `scales[:, 1]` when `token_scales` is None."""
  k_scale, v_scale = scales[:, 0], scales[:, 1]
  if token_scales is not None:
    k_token, v_token = token_scales
    k_scale, v_scale = k_scale[:, None, None] * k_token, v_scale[:, None, None] * v_token
  return paged_attention(
    q, k_pages, v_pages, lengths, page_table, k_scale=k_scale, v_scale=v_scale,
    sm_scale=1.0 / np.sqrt(q.shape[-1]), impl="pallas_tpu", interpret=pltpu.InterpretParams(),
    block_sizes=PagedAttentionBlockSizes(pages_per_compute_block=ppcb),
  )  # fmt: skip


# (page dtype, H, Hkv, page_size, head_dim, P, pages_per_compute_block): each of
# dtype x {GQA, MHA}, page 8/16, D 16/128, ppcb 1/2 and P % 8 == 0 or not occurs.
CASES = [
  ("float8_e4m3fn", 4, 2, 8, 16, 16, 1),
  ("float8_e4m3fn", 2, 2, 16, 128, 13, 2),
  ("float32", 4, 2, 16, 128, 12, 2),
  ("float32", 2, 2, 8, 16, 16, 1),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_token_scales_match_dense_reference(case):
  dtype, num_heads, num_kv_heads, page_size, head_dim, total_pages, ppcb = case
  args = make_inputs(dtype, num_heads, num_kv_heads, page_size, head_dim, total_pages)
  got = run_kernel(*args, ppcb=ppcb)
  want = dense_reference(*args, sm_scale=1.0 / np.sqrt(head_dim))
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=TOLERANCE[dtype], rtol=0)
  # The token scales are really used: without them the output differs.
  k_token, v_token = args[-1]
  plain = run_kernel(*args[:-1], (jnp.ones_like(k_token), jnp.ones_like(v_token)), ppcb=ppcb)
  assert np.abs(np.asarray(plain) - np.asarray(want)).max() > 10 * TOLERANCE[dtype]


@pytest.mark.parametrize("ppcb", [1, 2])
def test_garbage_past_length_never_reaches_output(ppcb):
  # P = 12: the tile holding the last pages is padded with ones in the wrapper.
  args = make_inputs("float8_e4m3fn", 4, 2, 8, 16, total_pages=12, seed=3)
  q, k_pages, v_pages, lengths, page_table, scales, (k_token, v_token) = args
  clean = np.asarray(run_kernel(*args, ppcb=ppcb))
  page_size = k_pages.shape[2]
  used = np.zeros(k_pages.shape[:3], bool)  # (Hkv, P, row) holding a live token
  for b in range(NUM_SEQS):
    for t in range(int(lengths[b])):
      used[:, int(page_table[b, t // page_size]), t % page_size] = True
  assert (used.any(axis=2) & ~used.all(axis=2)).any()  # garbage in a partly used page
  garbage = np.where(np.arange(used.size).reshape(used.shape) % 2, np.nan, np.inf)
  k_token = jnp.where(used, k_token, garbage)
  v_token = jnp.where(used, v_token, -garbage)
  k_pages = jnp.where(used[..., None], k_pages, jnp.asarray(np.nan, k_pages.dtype))
  v_pages = jnp.where(used[..., None], v_pages, jnp.asarray(np.nan, v_pages.dtype))
  dirty = np.asarray(
    run_kernel(q, k_pages, v_pages, lengths, page_table, scales, (k_token, v_token), ppcb=ppcb)
  )
  assert np.isfinite(dirty).all()
  np.testing.assert_array_equal(dirty, clean)


@pytest.mark.parametrize("total_pages", [16, 13])
def test_no_token_scales_equals_all_ones(total_pages):
  # Per-head factors 1: static scales of ones vs per-token scales of ones run the kernel
  # without and with token scales on the same numbers (P = 13: the ones padding too).
  *args, (k_token, v_token) = make_inputs("float8_e4m3fn", 4, 2, 8, 16, total_pages, seed=5)
  args[-1] = jnp.ones_like(args[-1])
  ones = (jnp.ones_like(k_token), jnp.ones_like(v_token))
  plain = run_kernel(*args, None, ppcb=2)
  with_ones = run_kernel(*args, ones, ppcb=2)
  np.testing.assert_allclose(np.asarray(plain), np.asarray(with_ones), atol=1e-6, rtol=0)


def test_token_scales_shape_is_checked():
  q, k_pages, v_pages, lengths, table, scales, (k_token, v_token) = make_inputs(
    "float32", 2, 2, 8, 16, 16
  )
  with pytest.raises(ValueError, match=r"`k_scale` must be .* \(2, 16, 8\) \(one per token\)"):
    run_kernel(q, k_pages, v_pages, lengths, table, scales, (k_token[:, :8], v_token), ppcb=1)
  with pytest.raises(ValueError, match="must both be static .* or both per-token"):
    paged_attention(
      q, k_pages, v_pages, lengths, table, k_scale=k_token, v_scale=scales[:, 1],
      impl="pallas_tpu", interpret=pltpu.InterpretParams(),
    )  # fmt: skip


# ------------------------------------------------------------------------------------------
# Real TPU compiler (libtpu), compile-only device: no TPU chip needed
# ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tpu_device():
  pytest.importorskip("libtpu", reason="deviceless TPU compiles need libtpu")
  from jax.experimental import topologies  # noqa: PLC0415

  return topologies.get_topology_desc(platform="tpu", topology_name="v5e:2x2").devices[0]


@pytest.mark.parametrize(
  ("token_scales", "total_pages", "ppcb"),
  [(True, 64, 2), (True, 60, 1), (False, 64, 2)],
  ids=["token-P64-ppcb2", "token-P60-ppcb1", "per-head-P64-ppcb2"],
)
def test_mosaic_kernel_compiles_for_tpu(tpu_device, token_scales, total_pages, ppcb):
  batch, num_heads, num_kv_heads, head_dim, page_size, pages_per_sequence = 4, 8, 2, 128, 16, 8
  sharding = jax.sharding.SingleDeviceSharding(tpu_device)

  def spec(shape, dtype):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

  pages = spec((num_kv_heads, total_pages, page_size, head_dim), jnp.float8_e4m3fn)
  # Per-token scales [Hkv, P, page_size], or static per-head ones [Hkv].
  scale = spec(
    (num_kv_heads, total_pages, page_size) if token_scales else (num_kv_heads,), jnp.float32
  )
  args = [
    spec((batch, num_heads, head_dim), jnp.bfloat16),
    pages,
    pages,
    spec((batch,), jnp.int32),
    spec((batch, pages_per_sequence), jnp.int32),
    scale,
    scale,
  ]

  def f(q, k_pages, v_pages, lengths, page_table, k_scale, v_scale):
    return paged_attention(
      q, k_pages, v_pages, lengths, page_table, k_scale=k_scale, v_scale=v_scale,
      sm_scale=head_dim**-0.5, impl="pallas_tpu", interpret=False,
      block_sizes=PagedAttentionBlockSizes(pages_per_compute_block=ppcb),
    )  # fmt: skip

  with jax.default_device(tpu_device):
    lowered = jax.jit(f).trace(*args).lower(lowering_platforms=("tpu",))
    compiled = lowered.compile()
  assert "rlx_paged_attention_tpu" in lowered.as_text()
  assert compiled.memory_analysis() is not None
