"""Paged decode attention: both Pallas kernels (interpret mode on CPU) vs the reference.

The sweep is a covering design rather than the full product: each of the 12
cases is one (dtype, GQA ratio) pair, and page size / head dim / block sizes
are assigned so that every pair of values of (dtype, GQA, page size, head dim)
occurs (checked by `test_sweep_is_pairwise_covering`). Every case holds four
sequences with lengths 1, exactly one page, one past a page boundary and full
capacity, so every length class meets every other axis value. Each case runs
on the GPU-style kernel (`interpret=True`) and on the TPU kernel
(`interpret=pltpu.InterpretParams()`).
"""

import contextlib
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import AbstractDevice, AbstractMesh

from rlx.kernels_pallas import (
  PagedAttentionBlockSizes,
  arrays_platform,
  default_platform,
  paged_attention,
  paged_attention_reference,
  resolve_impl,
  saturating_cast,
)

DTYPES = ("bfloat16", "float32", "float8_e4m3fn", "float8_e5m2")
GQA = (1, 4, 8)
PAGE_SIZES = (16, 32, 64)
HEAD_DIMS = (64, 128)
BLOCK_SIZES = (
  PagedAttentionBlockSizes(pages_per_compute_block=2),  # 2 pages per step, 1 split
  PagedAttentionBlockSizes(pages_per_compute_block=1, pages_per_split=1),  # 3 splits
  PagedAttentionBlockSizes(pages_per_compute_block=2, pages_per_split=2),  # 2 splits
)
# Head-dim choice per (dtype, gqa) so that all pairs with page size / gqa / dtype occur.
_HEAD_DIM_INDEX = ((0, 1, 0), (1, 0, 1), (1, 0, 1), (1, 0, 0))
CASES = [
  (DTYPES[d], GQA[g], PAGE_SIZES[(d + g) % 3], HEAD_DIMS[_HEAD_DIM_INDEX[d][g]], (3 * d + g) % 3)
  for d in range(4)
  for g in range(3)
]
# Max abs error allowed vs the reference on the same (de)quantized page values.
# bf16/FP8 cases use bf16 queries, and the kernels feed bf16 probabilities to the
# P.V dot (Triton dots need equal operand dtypes): error ~ 2^-8 relative.
TOLERANCE = {"float32": 2e-5, "bfloat16": 2e-2, "float8_e4m3fn": 2e-2, "float8_e5m2": 2e-2}
KERNELS = {
  "gpu": ("pallas_gpu", True),
  "tpu": ("pallas_tpu", pltpu.InterpretParams()),
  "xla": ("xla", False),  # blocked online softmax over the live pages (the CPU path)
}

NUM_KV_HEADS = 2
PAGES_PER_SEQUENCE = 3
NUM_PAGES = 14  # 4 sequences x 3 pages + 2 spare pages


def make_inputs(dtype, gqa, page_size, head_dim, seed=0):
  """Four sequences: lengths 1, page, page + 1, capacity; pages randomly placed."""
  rng = np.random.default_rng(seed)
  dtype = jnp.dtype(dtype)
  q_dtype = jnp.float32 if dtype == jnp.float32 else jnp.bfloat16
  num_heads = NUM_KV_HEADS * gqa
  q = jnp.asarray(rng.normal(size=(4, num_heads, head_dim)), q_dtype)
  shape = (NUM_KV_HEADS, NUM_PAGES, page_size, head_dim)
  k = rng.normal(size=shape).astype(np.float32)
  v = rng.normal(size=shape).astype(np.float32)
  if dtype in (jnp.float8_e4m3fn, jnp.float8_e5m2):
    k_scale = jnp.asarray(np.abs(k).max(axis=(1, 2, 3)) / 200.0, jnp.float32)  # per head
    v_scale = jnp.asarray(np.abs(v).max() / 100.0, jnp.float32)  # per tensor
    k_pages = saturating_cast(jnp.asarray(k) / k_scale[:, None, None, None], dtype)
    v_pages = saturating_cast(jnp.asarray(v) / v_scale, dtype)
  else:
    k_scale = v_scale = None
    k_pages, v_pages = jnp.asarray(k, dtype), jnp.asarray(v, dtype)
  capacity = PAGES_PER_SEQUENCE * page_size
  lengths = jnp.asarray([1, page_size, page_size + 1, capacity], jnp.int32)
  page_table = jnp.asarray(rng.permutation(NUM_PAGES)[:12].reshape(4, 3), jnp.int32)
  return q, k_pages, v_pages, lengths, page_table, k_scale, v_scale


def dense_attention_numpy(q, k_pages, v_pages, lengths, page_table, k_scale, v_scale):
  """Independent float64 loop: gather each sequence's tokens, then softmax attention."""
  q = np.asarray(q, np.float64)
  kp = np.asarray(k_pages.astype(jnp.float32), np.float64)
  vp = np.asarray(v_pages.astype(jnp.float32), np.float64)
  num_kv_heads, _, page_size, head_dim = kp.shape
  ks = np.broadcast_to(1.0 if k_scale is None else np.asarray(k_scale), (num_kv_heads,))
  vs = np.broadcast_to(1.0 if v_scale is None else np.asarray(v_scale), (num_kv_heads,))
  group = q.shape[1] // num_kv_heads
  out = np.zeros_like(q)
  for b in range(q.shape[0]):
    for h in range(q.shape[1]):
      g = h // group
      rows = [(page_table[b, t // page_size], t % page_size) for t in range(int(lengths[b]))]
      keys = np.stack([kp[g, p, r] for p, r in rows]) * ks[g]
      vals = np.stack([vp[g, p, r] for p, r in rows]) * vs[g]
      logits = keys @ q[b, h] / np.sqrt(head_dim)
      w = np.exp(logits - logits.max())
      out[b, h] = (w / w.sum()) @ vals
  return out


def test_sweep_is_pairwise_covering():
  cols = list(zip(*CASES, strict=True))
  for a, b in itertools.combinations(range(4), 2):
    assert set(zip(cols[a], cols[b], strict=True)) == set(
      itertools.product(set(cols[a]), set(cols[b]))
    )
  assert set(cols[0]) == set(DTYPES) and set(cols[1]) == set(GQA)
  assert set(cols[2]) == set(PAGE_SIZES) and set(cols[3]) == set(HEAD_DIMS)
  assert set(cols[4]) == {0, 1, 2}


@pytest.mark.parametrize("dtype", ["float32", "float8_e4m3fn"])
def test_reference_matches_numpy_loop(dtype):
  args = make_inputs(dtype, gqa=4, page_size=16, head_dim=64, seed=1)
  q, kp, vp, lengths, table, ks, vs = args
  got = paged_attention_reference(q, kp, vp, lengths, table, k_scale=ks, v_scale=vs)
  want = dense_attention_numpy(q, kp, vp, np.asarray(lengths), np.asarray(table), ks, vs)
  np.testing.assert_allclose(np.asarray(got), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kernel", sorted(KERNELS))
@pytest.mark.parametrize(("dtype", "gqa", "page_size", "head_dim", "block_sizes"), CASES)
def test_kernel_matches_reference(kernel, dtype, gqa, page_size, head_dim, block_sizes):
  impl, interpret = KERNELS[kernel]
  q, kp, vp, lengths, table, ks, vs = make_inputs(dtype, gqa, page_size, head_dim)
  got = paged_attention(
    q, kp, vp, lengths, table, k_scale=ks, v_scale=vs, impl=impl, interpret=interpret,
    block_sizes=BLOCK_SIZES[block_sizes],
  )  # fmt: skip
  want = paged_attention_reference(q, kp, vp, lengths, table, k_scale=ks, v_scale=vs)
  assert got.shape == q.shape and got.dtype == q.dtype
  np.testing.assert_allclose(
    np.asarray(got.astype(jnp.float32)), np.asarray(want), atol=TOLERANCE[dtype], rtol=0
  )


@pytest.mark.parametrize("pages_per_block", [1, 2, 4])
def test_xla_path_stops_at_the_longest_live_sequence(pages_per_block):
  # Every sequence shorter than the table: the loop stops early, so NaN in the pages
  # past the longest sequence (table entries there point at NaN pages) is never read.
  q, kp, vp, _, table, _, _ = make_inputs("float32", 4, 16, 64, seed=11)
  capacity = PAGES_PER_SEQUENCE * 16
  for lengths in ([1, 3, 16, 17], [5, 0, 9, 2], [capacity, 1, 30, 33]):
    lengths = jnp.asarray(lengths, jnp.int32)
    used = np.zeros(kp.shape[1], bool)
    for b, length in enumerate(np.asarray(lengths)):
      used[np.asarray(table)[b, : -(-int(length) // 16)]] = True
    dirty = [jnp.where(jnp.asarray(used)[None, :, None, None], x, jnp.nan) for x in (kp, vp)]
    run = jax.jit(
      lambda lengths, kp, vp: paged_attention(
        q,
        kp,
        vp,
        lengths,
        table,
        impl="xla",
        block_sizes=PagedAttentionBlockSizes(pages_per_compute_block=pages_per_block),
      )  # fmt: skip
    )
    got = np.asarray(run(lengths, *dirty))
    want = np.asarray(paged_attention_reference(q, kp, vp, jnp.maximum(lengths, 1), table))
    live = np.asarray(lengths) > 0
    np.testing.assert_allclose(got[live], want[live], atol=2e-5, rtol=0)
    np.testing.assert_array_equal(got[~live], 0.0)


@pytest.mark.parametrize("pages_per_block", [None, 1, 3])
def test_xla_path_long_table_matches_reference(pages_per_block):
  # 10 pages per sequence: 1 page per block is 10 blocks (the fori_loop path), 3 pages
  # 4 unrolled blocks, None the default; NaN in every page no sequence uses.
  rng = np.random.default_rng(5)
  page, pps, num_pages = 4, 10, 34
  q = jnp.asarray(rng.normal(size=(3, 4, 16)), jnp.float32)
  kp, vp = (jnp.asarray(rng.normal(size=(2, num_pages, page, 16)), jnp.float32) for _ in "kv")
  table = jnp.asarray(rng.permutation(num_pages)[:30].reshape(3, pps), jnp.int32)
  lengths = jnp.asarray([1, 17, 25], jnp.int32)  # 7 of 10 blocks of one page are live
  used = np.zeros(num_pages, bool)
  for b, length in enumerate(np.asarray(lengths)):
    used[np.asarray(table)[b, : -(-int(length) // page)]] = True
  dirty = [jnp.where(jnp.asarray(used)[None, :, None, None], x, jnp.nan) for x in (kp, vp)]
  sizes = PagedAttentionBlockSizes(pages_per_compute_block=pages_per_block)
  got = jax.jit(
    lambda kp, vp: paged_attention(q, kp, vp, lengths, table, impl="xla", block_sizes=sizes)
  )(*dirty)
  want = paged_attention_reference(q, kp, vp, lengths, table)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=0)


@pytest.mark.parametrize("impl", ["xla"])  # the Pallas paths slice the layer out first
def test_stacked_pools_with_layer_equal_the_layer_pools(impl):
  # The layer index is traced inside the jitted kernel wrapper: one compile for all layers.
  q, kp, vp, lengths, table, _, _ = make_inputs("float32", 4, 16, 64, seed=3)
  stack_k = jnp.stack([kp, 2.0 * kp, -kp])  # [L=3, Hkv, P, page, D]
  stack_v = jnp.stack([vp, vp + 1.0, 0.5 * vp])
  interpret = impl == "pallas_gpu"
  for i in range(3) if impl == "xla" else (2,):
    want = paged_attention(
      q, stack_k[i], stack_v[i], lengths, table, impl=impl, interpret=interpret
    )
    got = paged_attention(
      q, stack_k, stack_v, lengths, table, impl=impl, interpret=interpret, layer=i
    )
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  with pytest.raises(ValueError, match="stacked"):
    paged_attention(q, kp, vp, lengths, table, impl=impl, layer=0)
  with pytest.raises(ValueError, match="layer"):
    paged_attention(q, stack_k, stack_v, lengths, table, impl=impl, layer=3)


def _with_nan_garbage(args):
  """Pool with NaN in every unused page and every position >= length; junk table entries."""
  q, kp, vp, lengths, table, ks, vs = args
  page_size = kp.shape[2]
  used = np.zeros(kp.shape[1:3], bool)  # [P, page]
  table_np = np.array(table)
  for b, length in enumerate(np.asarray(lengths)):
    for t in range(int(length)):
      used[table_np[b, t // page_size], t % page_size] = True
    first_unused = -(-int(length) // page_size)
    table_np[b, first_unused:] = [-7, 10**6, 3][: 3 - first_unused]  # junk, never read
  mask = jnp.asarray(used)[None, :, :, None]
  nan = jnp.asarray(np.nan, kp.dtype)
  return (
    q, jnp.where(mask, kp, nan), jnp.where(mask, vp, nan), lengths,
    jnp.asarray(table_np, jnp.int32), ks, vs,
  )  # fmt: skip


@pytest.mark.parametrize("impl", ["pallas_gpu", "pallas_tpu", "xla"])
def test_nan_garbage_in_unused_pages_never_reaches_output(impl):
  interpret = {"pallas_gpu": True, "pallas_tpu": pltpu.InterpretParams(), "xla": False}[impl]
  args = make_inputs("bfloat16", gqa=4, page_size=16, head_dim=64, seed=2)
  dirty = _with_nan_garbage(args)
  bs = PagedAttentionBlockSizes(pages_per_compute_block=2, pages_per_split=2)

  def run(a):
    q, kp, vp, lengths, table, ks, vs = a
    return paged_attention(
      q, kp, vp, lengths, table, k_scale=ks, v_scale=vs, impl=impl, interpret=interpret,
      block_sizes=bs,
    )  # fmt: skip

  clean_out, dirty_out = run(args), run(dirty)
  assert np.isfinite(np.asarray(dirty_out.astype(jnp.float32))).all()
  np.testing.assert_array_equal(np.asarray(dirty_out), np.asarray(clean_out))


@pytest.mark.parametrize("impl", ["pallas_gpu", "pallas_tpu", "xla"])
def test_idle_slot_with_length_zero_under_jit_gives_zeros(impl):
  # Eagerly, length 0 is rejected; under jit (sampler with idle slots) it must not NaN.
  interpret = {"pallas_gpu": True, "pallas_tpu": pltpu.InterpretParams(), "xla": False}[impl]
  q, kp, vp, lengths, table, _, _ = make_inputs("float32", 1, 16, 64, seed=8)
  lengths = lengths.at[1].set(0)
  run = jax.jit(lambda *a: paged_attention(*a, impl=impl, interpret=interpret))
  out = np.asarray(run(q, kp, vp, lengths, table))
  np.testing.assert_array_equal(out[1], 0.0)
  want = paged_attention_reference(q, kp, vp, lengths.at[1].set(1), table)
  np.testing.assert_allclose(out[[0, 2, 3]], np.asarray(want)[[0, 2, 3]], atol=2e-5)


@pytest.mark.parametrize("impl", ["pallas_gpu", "pallas_tpu", "xla"])
def test_length_over_capacity_under_jit_is_clamped_to_capacity(impl):
  # Regression: under jit (no eager check) a length > capacity made the TPU index maps read
  # the SMEM page table out of bounds (3 pages, 2 per block -> page slot 3) and the GPU
  # kernel attend to its zero-padded table entry (3 pages padded to a split of 4).
  interpret = {"pallas_gpu": True, "pallas_tpu": pltpu.InterpretParams(), "xla": False}[impl]
  q, kp, vp, lengths, table, _, _ = make_inputs("float32", 1, 16, 64, seed=9)
  capacity = PAGES_PER_SEQUENCE * 16
  bs = PagedAttentionBlockSizes(pages_per_compute_block=2, pages_per_split=4)
  run = jax.jit(
    lambda lengths: paged_attention(
      q, kp, vp, lengths, table, impl=impl, interpret=interpret, block_sizes=bs
    )
  )
  over = jnp.asarray([capacity + 5, 1, capacity + 17, capacity], jnp.int32)
  want = paged_attention_reference(q, kp, vp, jnp.minimum(over, capacity), table)
  np.testing.assert_allclose(np.asarray(run(over)), np.asarray(want), atol=2e-5, rtol=0)


@pytest.mark.parametrize(
  ("page_size", "head_dim", "match"),
  [
    (8, 64, "pages_per_compute_block \\* page_size >= 16"),
    (16, 8, "head_dim >= 16"),
    (16, 64, "min_block_h must be a power of two >= 16"),
  ],
)
def test_gpu_kernel_rejects_tiles_below_the_triton_dot_minimum(page_size, head_dim, match):
  # Triton's dot needs every dim >= 16; interpret mode would otherwise accept such tiles.
  pages = jnp.zeros((NUM_KV_HEADS, NUM_PAGES, page_size, head_dim), jnp.float32)
  q = jnp.zeros((4, NUM_KV_HEADS, head_dim), jnp.float32)
  lengths = jnp.asarray([1, 2, 3, 4], jnp.int32)
  table = jnp.arange(12, dtype=jnp.int32).reshape(4, 3)
  min_block_h = 8 if "min_block_h" in match else 16
  bs = PagedAttentionBlockSizes(pages_per_compute_block=1, min_block_h=min_block_h)
  with pytest.raises(ValueError, match=match):
    paged_attention(
      q, pages, pages, lengths, table, impl="pallas_gpu", interpret=True, block_sizes=bs
    )


@pytest.mark.parametrize("impl", ["pallas_gpu", "pallas_tpu"])
def test_permuting_pool_and_page_table_leaves_output_unchanged(impl):
  interpret = True if impl == "pallas_gpu" else pltpu.InterpretParams()
  q, kp, vp, lengths, table, ks, vs = make_inputs("float8_e4m3fn", 8, 32, 64, seed=3)
  perm = np.random.default_rng(4).permutation(NUM_PAGES)  # new slot i holds old page perm[i]
  inverse = np.argsort(perm)
  kp2, vp2 = kp[:, perm], vp[:, perm]
  table2 = jnp.asarray(inverse[np.asarray(table)], jnp.int32)
  kw = dict(k_scale=ks, v_scale=vs, impl=impl, interpret=interpret)
  out1 = paged_attention(q, kp, vp, lengths, table, **kw)
  out2 = paged_attention(q, kp2, vp2, lengths, table2, **kw)
  np.testing.assert_array_equal(np.asarray(out1), np.asarray(out2))


@contextlib.contextmanager
def _backend_compiles():
  """Collects the XLA programs compiled inside the block (`jax.monitoring` events)."""
  compiles = []

  def listen(event, duration, **kwargs):
    del duration, kwargs
    if event == "/jax/core/compile/backend_compile_duration":
      compiles.append(event)

  jax.monitoring.register_event_duration_secs_listener(listen)
  try:
    yield compiles
  finally:
    jax.monitoring.unregister_event_duration_listener(listen)


def test_changing_scale_values_does_not_recompile():
  q, kp, vp, lengths, table, ks, vs = make_inputs("float8_e5m2", 1, 16, 64, seed=5)
  kw = dict(impl="pallas_gpu", interpret=True)
  paged_attention(q, kp, vp, lengths, table, k_scale=ks, v_scale=vs, **kw)
  scales = [(ks * f, vs * f) for f in (0.5, 2.0)]
  with _backend_compiles() as compiles:
    outs = [
      paged_attention(q, kp, vp, lengths, table, k_scale=k, v_scale=v, **kw) for k, v in scales
    ]
  assert not compiles  # nothing compiled at all: the kernel's program is reused
  # The scales really are used: V scaled by 2 doubles the output (K scale changes logits).
  ref = paged_attention_reference(q, kp, vp, lengths, table, k_scale=ks * 2, v_scale=vs * 2)
  np.testing.assert_allclose(np.asarray(outs[1], np.float32), np.asarray(ref), atol=4e-2)
  assert not np.allclose(np.asarray(outs[0], np.float32), np.asarray(outs[1], np.float32))


def test_auto_on_cpu_is_the_xla_path_and_works_under_jit():
  q, kp, vp, lengths, table, _, _ = make_inputs("float32", 4, 16, 64, seed=6)
  want = paged_attention_reference(q, kp, vp, lengths, table)
  # Online softmax in another summation order than the reference: equal to f32 rounding.
  got = jax.jit(lambda *a: paged_attention(*a))(q, kp, vp, lengths, table)  # traced lengths
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=TOLERANCE["float32"], rtol=0)
  got = paged_attention(q, kp, vp, lengths, table, sm_scale=0.5)
  want = paged_attention_reference(q, kp, vp, lengths, table, sm_scale=0.5)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=TOLERANCE["float32"], rtol=0)
  # Regression: the XLA path returned float32 for bf16 q (the kernels return q's dtype),
  # so the output dtype depended on the backend.
  got = paged_attention(q.astype(jnp.bfloat16), kp, vp, lengths, table)
  assert got.dtype == jnp.bfloat16


def _valid():
  return make_inputs("float32", 4, 16, 64, seed=7)[:5]


@pytest.mark.parametrize(
  ("change", "match"),
  [
    (lambda a: {**a, "v_pages": a["v_pages"][:, :, :8]}, "v_pages"),
    (lambda a: {**a, "q": a["q"][:, :7]}, "multiple of the number of KV heads"),
    (lambda a: {**a, "q": a["q"][..., :32]}, "head dim"),
    (lambda a: {**a, "lengths": jnp.asarray([1, 2, 3, 49], jnp.int32)}, "lengths\\[3\\] = 49"),
    (lambda a: {**a, "lengths": jnp.asarray([0, 2, 3, 4], jnp.int32)}, "0 < length"),
    (lambda a: {**a, "lengths": a["lengths"].astype(jnp.float32)}, "lengths"),
    (lambda a: {**a, "lengths": a["lengths"][:3]}, "lengths"),
    (lambda a: {**a, "page_table": a["page_table"][:3]}, "page_table"),
    (lambda a: {**a, "page_table": a["page_table"].at[3, 2].set(99)}, "page_table\\[3, 2\\]"),
    (lambda a: {**a, "k_pages": a["k_pages"].astype(jnp.float16)}, "k_pages"),
    (lambda a: {**a, "q": a["q"][0]}, "rank 3"),
    (lambda a: {**a, "k_scale": jnp.ones((3,))}, "k_scale"),
    (lambda a: {**a, "impl": "cuda"}, "impl"),
    (lambda a: {**a, "impl": "pallas_gpu"}, "interpret=True"),
    (lambda a: {**a, "impl": "pallas_tpu"}, "InterpretParams"),
    (
      lambda a: {
        **a,
        "k_pages": a["k_pages"].astype(jnp.float8_e4m3fn),
        "v_pages": a["v_pages"].astype(jnp.float8_e4m3fn),
      },
      "k_scale` is required",
    ),
  ],
)
def test_invalid_inputs_raise_clear_errors(change, match):
  q, kp, vp, lengths, table = _valid()
  base = dict(q=q, k_pages=kp, v_pages=vp, lengths=lengths, page_table=table)
  kwargs = change(base)
  with pytest.raises(ValueError, match=match):
    paged_attention(**kwargs)
  if "impl" not in kwargs:  # the reference shares the validator
    with pytest.raises(ValueError, match=match):
      paged_attention_reference(**kwargs)


@pytest.mark.skipif(jax.default_backend() not in ("gpu", "tpu"), reason="needs a GPU or TPU")
@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn"])
def test_hardware_kernel_matches_reference(dtype):
  q, kp, vp, lengths, table, ks, vs = make_inputs(dtype, 4, 16, 128)
  got = paged_attention(q, kp, vp, lengths, table, k_scale=ks, v_scale=vs)  # auto: Pallas
  want = paged_attention_reference(q, kp, vp, lengths, table, k_scale=ks, v_scale=vs)
  np.testing.assert_allclose(
    np.asarray(got.astype(jnp.float32)), np.asarray(want), atol=TOLERANCE[dtype], rtol=0
  )


def test_impl_resolution():
  resolve = resolve_impl
  assert resolve("auto", False, "cpu") == "xla"
  assert resolve("auto", False, "gpu") == "pallas_gpu"
  assert resolve("auto", False, "tpu") == "pallas_tpu"
  assert resolve("pallas", False, "gpu") == "pallas_gpu"
  assert resolve("pallas", False, "tpu") == "pallas_tpu"
  assert resolve("pallas", True, "cpu") == "pallas_gpu"
  assert resolve("pallas", pltpu.InterpretParams(), "cpu") == "pallas_tpu"
  assert resolve("pallas_tpu", pltpu.InterpretParams(), "cpu") == "pallas_tpu"
  assert resolve("pallas_gpu", False, "gpu") == "pallas_gpu"
  assert resolve("xla", False, "tpu") == "xla"
  with pytest.raises(ValueError, match="not a TPU"):
    resolve("pallas_tpu", False, "gpu")
  with pytest.raises(ValueError, match="not a GPU"):
    resolve("pallas_gpu", False, "cpu")
  with pytest.raises(
    ValueError,
    match=r"`impl` must be one of \('auto', 'pallas', 'pallas_gpu', 'pallas_tpu', 'xla'\), "
    "got 'cuda'",
  ):
    resolve("cuda", False, "gpu")


def test_dispatch_follows_where_the_arrays_live():
  # The default platform is a GPU (traced under an abstract mesh of GPU devices, as when
  # exporting for a GPU from a CPU host): arrays placed on the CPU device must still take
  # the XLA path (and off-hardware Pallas must still ask for interpret mode), because the
  # computation runs where its inputs are, not on the default platform.
  gpu = AbstractMesh((1,), ("x",), abstract_device=AbstractDevice("NVIDIA H100", None, "gpu"))
  cpu = jax.devices("cpu")[0]
  args = jax.device_put(make_inputs("float32", 4, 16, 64, seed=6)[:5], cpu)
  with jax.sharding.use_abstract_mesh(gpu):
    assert default_platform() == "gpu"
    assert arrays_platform(*args) == "cpu"
    assert arrays_platform(np.zeros(3), None) == "gpu"  # nothing placed: default
    # The XLA path: the Pallas kernels (interpret=False) do not run on a CPU ("Only
    # interpret mode is supported on CPU backend"), and the result is impl="xla"'s, bit
    # for bit.
    out = paged_attention(*args)
    assert out.devices() == {cpu}
    np.testing.assert_array_equal(np.asarray(out), np.asarray(paged_attention(*args, impl="xla")))
    np.testing.assert_allclose(
      np.asarray(out), np.asarray(paged_attention_reference(*args)), atol=1e-6
    )
    with pytest.raises(ValueError, match="on 'cpu' \\(not a GPU\\) needs interpret=True"):
      paged_attention(*args, impl="pallas_gpu")
    # Under jit (tracers carry no placement) the default platform decides: the GPU kernel.
    assert jax.jit(lambda x: jnp.float32(arrays_platform(x) == "gpu"))(args[0]) == 1.0
    assert "pallas_call" in str(jax.jit(paged_attention).trace(*args).jaxpr)
  assert "pallas_call" not in str(jax.jit(paged_attention).trace(*args).jaxpr)  # CPU: XLA


def test_default_platform_follows_default_device():
  assert default_platform() == jax.default_backend()
  with jax.default_device(jax.devices("cpu")[0]):
    assert default_platform() == "cpu"


def test_bad_inputs_name_the_argument():
  q, k, v, lengths, table, _, _ = make_inputs("float32", 1, 16, 64)
  for call, match in [
    # Zero-size batch, heads or head dim (was an empty result or a ZeroDivisionError).
    (lambda: paged_attention(q[:0], k, v, lengths[:0], table[:0]), r"`q` must be \[B, H, D\]"),
    (lambda: paged_attention(q[:, :0], k, v, lengths, table), r"`q` must be \[B, H, D\]"),
    (
      lambda: paged_attention(q[..., :0], k[..., :0], v[..., :0], lengths, table),
      r"`q` must be \[B, H, D\]",
    ),
    (lambda: paged_attention(q, k[:0], v[:0], lengths, table), "`k_pages` must have Hkv >= 1"),
    # Tiling must be a PagedAttentionBlockSizes of positive ints.
    (
      lambda: paged_attention(q, k, v, lengths, table, block_sizes={"pages_per_split": 1}),
      "`block_sizes` must be a PagedAttentionBlockSizes",
    ),
    (
      lambda: PagedAttentionBlockSizes(pages_per_compute_block=0),
      "`pages_per_compute_block` must be a positive int or None",
    ),
    (lambda: PagedAttentionBlockSizes(min_block_h=None), "`min_block_h` must be a positive int"),
  ]:
    with pytest.raises(ValueError, match=match):
      call()


@pytest.mark.parametrize("name", ["k_scale", "v_scale"])
def test_dequantization_scales_must_be_finite_and_positive(name):
  q, k, v, lengths, table, k_scale, v_scale = make_inputs("float8_e4m3fn", 1, 16, 64)
  scales = {"k_scale": k_scale, "v_scale": v_scale}
  # 0 zeroes the keys (uniform attention), a negative flips them, NaN / inf give NaN.
  for bad in (0.0, -1.0, np.nan, np.inf, jnp.array([1.0, 0.0])):
    with pytest.raises(ValueError, match=f"`{name}` must be finite and > 0"):
      paged_attention(q, k, v, lengths, table, **{**scales, name: bad})
  # Traced scales are not checked (values change without recompiling).
  f = jax.jit(lambda s: paged_attention(q, k, v, lengths, table, **{**scales, name: s}))
  np.testing.assert_array_equal(f(scales[name]), paged_attention(q, k, v, lengths, table, **scales))
