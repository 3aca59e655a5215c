"""FP8 quantizers and the blockwise-scaled FP8 matmul (Pallas interpret mode vs reference)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from rlx.kernels_pallas import (
  dequantize_fp8_blockwise,
  fp8_blockwise_matmul,
  fp8_blockwise_matmul_reference,
  fp8_max,
  quantize_fp8_blockwise,
  quantize_fp8_per_token_group,
  saturating_cast,
)

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
INTERPRET = {"gpu": True, "tpu": pltpu.InterpretParams()}


def test_fp8_max_values():
  assert fp8_max(E4M3) == 448.0
  assert fp8_max(E5M2) == 57344.0
  with pytest.raises(ValueError, match="float8"):
    fp8_max(jnp.bfloat16)


def test_blockwise_scales_hand_computed():
  # 3x3 matrix, 2x2 blocks: blocks are [[0:2,0:2],[0:2,2]],[[2,0:2],[2,2]] (partial).
  w = jnp.asarray([[1.0, -4.0, 0.5], [2.0, 3.0, -8.0], [0.0, 0.0, 0.25]])
  wq, scale = quantize_fp8_blockwise(w, block=(2, 2))
  np.testing.assert_allclose(
    np.asarray(scale), np.asarray([[4.0, 8.0], [1e-10, 0.25]]) / 448.0, rtol=1e-6
  )
  # The amax element of each block maps to exactly +-448.
  assert float(wq[0, 1].astype(jnp.float32)) == -448.0
  assert float(wq[1, 2].astype(jnp.float32)) == -448.0
  assert float(wq[2, 2].astype(jnp.float32)) == 448.0
  assert float(wq[2, 0].astype(jnp.float32)) == 0.0  # all-zero part stays zero, finite scale
  np.testing.assert_allclose(dequantize_fp8_blockwise(wq, scale, (2, 2)), w, rtol=2**-4)


def test_per_token_group_scales_hand_computed():
  x = jnp.asarray([[1.0, -2.0, 3.0, 0.5, -6.0]])  # groups of 2: [1,-2],[3,.5],[-6]
  xq, scale = quantize_fp8_per_token_group(x, group=2, dtype=E5M2)
  np.testing.assert_allclose(np.asarray(scale), [[2 / 57344, 3 / 57344, 6 / 57344]], rtol=1e-6)
  assert float(xq[0, 4].astype(jnp.float32)) == -57344.0


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_roundtrip_error_within_half_ulp(dtype):
  rng = np.random.default_rng(0)
  w = jnp.asarray(rng.standard_t(df=3, size=(256, 384)), jnp.float32)  # heavy tails
  wq, scale = quantize_fp8_blockwise(w, dtype=dtype)
  assert wq.dtype == dtype and scale.shape == (2, 3) and scale.dtype == jnp.float32
  err = np.abs(np.asarray(dequantize_fp8_blockwise(wq, scale) - w))
  mantissa_bits = 3 if dtype == E4M3 else 2
  min_normal_exp = -6 if dtype == E4M3 else -14
  full = np.repeat(np.repeat(np.asarray(scale), 128, 0), 128, 1)
  # Half a unit in the last place for normals, half the subnormal spacing below.
  bound = 2.0 ** (-mantissa_bits - 1) * np.abs(np.asarray(w)) + full * 2.0 ** (
    min_normal_exp - mantissa_bits - 1
  )
  assert (err <= bound * (1 + 1e-6)).all()


def test_saturating_cast_clamps_and_keeps_nan():
  x = jnp.asarray([1e9, -1e9, 3.0, jnp.nan])
  y = np.asarray(saturating_cast(x, E4M3).astype(jnp.float32))
  np.testing.assert_array_equal(y[:3], [448.0, -448.0, 3.0])
  assert np.isnan(y[3])


def _quantized(m, k, n, seed=0):
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.normal(size=(m, k)), jnp.float32)
  w = jnp.asarray(rng.normal(size=(k, n)), jnp.float32)
  xq, xs = quantize_fp8_per_token_group(x)
  wq, ws = quantize_fp8_blockwise(w)
  return x, w, xq, xs, wq, ws


@pytest.mark.parametrize("kernel", ["gpu", "tpu"])
@pytest.mark.parametrize(("m", "k", "n"), [(16, 256, 128), (40, 300, 200)])
def test_matmul_kernel_matches_reference_on_same_inputs(kernel, m, k, n):
  _, _, xq, xs, wq, ws = _quantized(m, k, n)
  want = fp8_blockwise_matmul_reference(xq, xs, wq, ws)
  got = fp8_blockwise_matmul(
    xq, xs, wq, ws, out_dtype=jnp.float32, impl="pallas", interpret=INTERPRET[kernel]
  )
  assert got.shape == (m, n) and got.dtype == jnp.float32
  # Same products, same per-block float32 accumulation: only summation order differs.
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=1e-5)


@pytest.mark.parametrize("kernel", ["gpu", "tpu"])
@pytest.mark.parametrize(("k", "block_k"), [(1000, 256), (640, 128)])
def test_matmul_kernel_with_k_spanning_several_k_steps(kernel, k, block_k):
  # TPU: K = 1000 -> 8 quantization blocks in 4 grid steps of 2 (the last one partly
  # zero padding); K = 640 -> 5 steps of one block. The float32 accumulator scratch
  # carries across the sequential K axis. (GPU: one program loops over all of K.)
  m, n = 24, 200
  _, _, xq, xs, wq, ws = _quantized(m, k, n, seed=3)
  # Distinct per-block scales so that a scale applied to the wrong K block shows.
  xs = xs * jnp.arange(1, xs.shape[1] + 1, dtype=jnp.float32)
  ws = ws * jnp.arange(ws.shape[0], 0, -1, dtype=jnp.float32)[:, None]
  want = fp8_blockwise_matmul_reference(xq, xs, wq, ws)
  got = fp8_blockwise_matmul(
    xq, xs, wq, ws, out_dtype=jnp.float32, impl="pallas", interpret=INTERPRET[kernel],
    block_k=block_k,
  )  # fmt: skip
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-4)


def test_matmul_tpu_kernel_k_steps_sum_hand_computed_blocks():
  # Three K blocks in three grid steps (block_k = 128), each with its own scales:
  # out = 128 * (1 * 0.5 + 2 * 4 + 3 * 0.25) exactly.
  xq = jnp.ones((1, 384), E4M3)
  wq = jnp.ones((384, 1), E4M3)
  xs = jnp.asarray([[1.0, 2.0, 3.0]])
  ws = jnp.asarray([[0.5], [4.0], [0.25]])
  got = fp8_blockwise_matmul(
    xq, xs, wq, ws, out_dtype=jnp.float32, impl="pallas_tpu", interpret=INTERPRET["tpu"],
    block_k=128,
  )  # fmt: skip
  assert float(got[0, 0]) == 128 * (1 * 0.5 + 2 * 4.0 + 3 * 0.25)


def test_matmul_reference_hand_computed_block_scales():
  # K = 256 -> two K blocks with different scales; each block's dot is scaled separately.
  xq = jnp.ones((1, 256), E4M3)
  wq = jnp.ones((256, 1), E4M3)
  xs = jnp.asarray([[2.0, 3.0]])
  ws = jnp.asarray([[0.5], [4.0]])
  got = fp8_blockwise_matmul_reference(xq, xs, wq, ws)
  assert float(got[0, 0]) == 128 * 2.0 * 0.5 + 128 * 3.0 * 4.0
  got = fp8_blockwise_matmul(xq, xs, wq, ws, out_dtype=jnp.float32, impl="pallas", interpret=True)
  assert float(got[0, 0]) == 128 * 2.0 * 0.5 + 128 * 3.0 * 4.0


def test_quantized_product_close_to_float32_product():
  # Stated bound: relative Frobenius error <= 5% for e4m3 on Gaussian inputs
  # (each operand carries ~2.5% RMS relative rounding error; measured ~3.7%).
  x, w, xq, xs, wq, ws = _quantized(64, 512, 256, seed=1)
  got = fp8_blockwise_matmul(xq, xs, wq, ws, out_dtype=jnp.float32)  # auto -> XLA on CPU
  exact = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
  rel = np.linalg.norm(np.asarray(got) - exact) / np.linalg.norm(exact)
  assert rel < 0.05


def test_saturated_inputs_give_finite_outputs():
  rng = np.random.default_rng(2)
  x = jnp.asarray(rng.normal(size=(16, 256)) * 1e6, jnp.float32)  # far beyond 448 * scale
  w = jnp.asarray(rng.normal(size=(256, 128)) * 1e6, jnp.float32)
  xs, ws = jnp.ones((16, 2)), jnp.ones((2, 1))
  xq, wq = saturating_cast(x, E4M3), saturating_cast(w, E4M3)
  kw = dict(impl="pallas", interpret=True)
  got_bf16 = fp8_blockwise_matmul(xq, xs, wq, ws, out_dtype=jnp.bfloat16, **kw)
  assert np.isfinite(np.asarray(got_bf16.astype(jnp.float32))).all()
  # (Nearly) every input saturated to +-448; the product is that of the clamped values.
  assert (np.abs(np.asarray(xq.astype(jnp.float32))) == 448.0).mean() > 0.99
  got = fp8_blockwise_matmul(xq, xs, wq, ws, out_dtype=jnp.float32, **kw)
  want = np.asarray(xq.astype(jnp.float32), np.float64) @ np.asarray(wq.astype(jnp.float32))
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6)


@pytest.mark.parametrize(
  ("args", "match"),
  [
    (lambda q: (q[0][:, :200], *q[1:]), "Contracting"),
    (lambda q: (q[0], q[1][:, :1], *q[2:]), "x_scale"),
    (lambda q: (*q[:3], q[3][:, :1]), "w_scale"),
    (lambda q: (q[0].astype(jnp.bfloat16), *q[1:]), "x_q"),
    (lambda q: (q[0][0], *q[1:]), "rank 2"),
  ],
)
def test_matmul_invalid_inputs(args, match):
  _, _, *q = _quantized(8, 256, 256)
  with pytest.raises(ValueError, match=match):
    fp8_blockwise_matmul(*args(q))
  with pytest.raises(ValueError, match=match):
    fp8_blockwise_matmul_reference(*args(q))


def test_matmul_rejects_non_float_out_dtype():
  # Regression: an integer (or FP8) out_dtype used to be a silent, unsaturated cast.
  _, _, *q = _quantized(8, 128, 128)
  for out_dtype in (jnp.int8, jnp.float8_e4m3fn):
    with pytest.raises(ValueError, match="out_dtype"):
      fp8_blockwise_matmul(*q, out_dtype=out_dtype)
    with pytest.raises(ValueError, match="out_dtype"):
      fp8_blockwise_matmul_reference(*q, out_dtype=out_dtype)


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_quantizers_keep_signed_zero_and_make_non_finite_blocks_nan(dtype):
  x = jnp.asarray([[-0.0, -0.0, 1.0, 2.0], [np.inf, 1.0, np.nan, 1.0]], jnp.float32)
  xq, xs = quantize_fp8_per_token_group(x, group=2, dtype=dtype)
  assert np.signbit(np.asarray(xq[0, :2].astype(jnp.float32))).all()  # -0 stays -0
  np.testing.assert_allclose(np.asarray(xs[0]), [1e-10 / fp8_max(dtype), 2 / fp8_max(dtype)])
  assert np.isinf(np.asarray(xs[1, 0])) and np.isnan(np.asarray(xs[1, 1]))
  with np.errstate(invalid="ignore"):  # 0 * inf
    deq = np.asarray(xq.astype(jnp.float32)) * np.repeat(np.asarray(xs), 2, axis=1)
  assert np.isnan(deq[1]).all()  # never clamped into plausible finite numbers
  wq, ws = quantize_fp8_blockwise(x, block=(2, 2), dtype=dtype)
  assert np.isnan(np.asarray(dequantize_fp8_blockwise(wq, ws, (2, 2)))[1]).all()


def test_quantizer_invalid_inputs():
  with pytest.raises(ValueError, match="rank 2"):
    quantize_fp8_blockwise(jnp.ones((4,)))
  with pytest.raises(ValueError, match="float8"):
    quantize_fp8_per_token_group(jnp.ones((4, 4)), dtype=jnp.bfloat16)
  with pytest.raises(ValueError, match="block"):
    quantize_fp8_blockwise(jnp.ones((4, 4)), block=(0, 128))
  with pytest.raises(ValueError, match="block"):  # was a ZeroDivisionError
    dequantize_fp8_blockwise(jnp.ones((4, 4)), jnp.ones((1, 1)), block=(0, 128))
  _, _, *q = _quantized(8, 128, 128)
  with pytest.raises(ValueError, match="impl"):
    fp8_blockwise_matmul(*q, impl="triton")
  with pytest.raises(ValueError, match="block_k"):
    fp8_blockwise_matmul(*q, block_k=100)
  with pytest.raises(ValueError, match="block_m"):
    fp8_blockwise_matmul(*q, block_m=24)
  with pytest.raises(ValueError, match="not a GPU"):
    fp8_blockwise_matmul(*q, impl="pallas_gpu")
  with pytest.raises(ValueError, match="x_scale` must be a float array"):
    fp8_blockwise_matmul(q[0], q[1].astype(jnp.int32), *q[2:])
  with pytest.raises(ValueError, match="Empty"):
    fp8_blockwise_matmul(q[0][:0], q[1][:0], *q[2:])


@pytest.mark.skipif(jax.default_backend() not in ("gpu", "tpu"), reason="needs a GPU or TPU")
def test_hardware_matmul_matches_reference():
  _, _, xq, xs, wq, ws = _quantized(256, 512, 384)
  got = fp8_blockwise_matmul(xq, xs, wq, ws, out_dtype=jnp.float32)  # auto: Pallas
  want = fp8_blockwise_matmul_reference(xq, xs, wq, ws)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-3)


def test_quantizer_and_cast_inputs_name_the_argument():
  # Zero-size, non-array, non-real inputs and non-dtypes each name their argument.
  for call, match in [
    (lambda: quantize_fp8_blockwise(jnp.ones((0, 4))), r"`w` must be a non-empty \[K, N\]"),
    (lambda: quantize_fp8_per_token_group(jnp.ones((4, 0))), r"`x` must be a non-empty \[M, K\]"),
    (lambda: quantize_fp8_blockwise([[1.0, 2.0]]), "`w` must be an array, got list"),
    (lambda: quantize_fp8_blockwise(np.full((2, 2), "a")), "`w` must hold real numbers"),
    (
      lambda: quantize_fp8_per_token_group(jnp.ones((2, 2), jnp.complex64)),
      "`x` must hold real numbers",
    ),
    (lambda: quantize_fp8_blockwise(jnp.ones((2, 2)), dtype="foo"), "`dtype` must be a dtype"),
    (lambda: fp8_max("foo"), "`dtype` must be a dtype"),
    (lambda: saturating_cast(jnp.ones(2), "foo"), "`dtype` must be a dtype"),
  ]:
    with pytest.raises(ValueError, match=match):
      call()
  # Integer weights, lists for casts and scales, and NumPy block sizes are fine.
  _, ws = quantize_fp8_blockwise(jnp.ones((4, 4), jnp.int32), block=(np.int64(2), 2))
  np.testing.assert_allclose(ws, np.full((2, 2), 1 / 448.0), rtol=1e-6)
  got = saturating_cast([1e6, -2.0], E4M3).astype(jnp.float32)
  np.testing.assert_array_equal(got, [448.0, -2.0])
  wq, ws = quantize_fp8_blockwise(jnp.ones((4, 4)), block=(2, 2))
  np.testing.assert_array_equal(dequantize_fp8_blockwise(wq, np.asarray(ws).tolist(), (2, 2)), 1.0)
  _, _, *q = _quantized(8, 128, 128)
  want = fp8_blockwise_matmul(*q, out_dtype=jnp.float32)
  np.testing.assert_array_equal(
    fp8_blockwise_matmul(*q, out_dtype=jnp.float32, block_m=np.int64(32)), want
  )
  with pytest.raises(ValueError, match="`out_dtype` must be a float dtype"):
    fp8_blockwise_matmul(*q, out_dtype="foo")


@pytest.mark.parametrize("kernel", ["gpu", "tpu"])
@pytest.mark.parametrize(("devices", "rows"), [(1, 16), (2, 16), (8, 16), (8, 12)])
def test_kernel_on_a_mesh_runs_per_device_and_matches_reference(kernel, devices, rows):
  """Under a jit of mesh-sharded activations the Pallas kernel runs in a shard_map (XLA cannot
  partition a Pallas call): rows split over the mesh axes that divide them, weights gathered."""
  from jax.sharding import NamedSharding, PartitionSpec  # noqa: PLC0415

  from rlx import train  # noqa: PLC0415

  if len(jax.devices()) < devices:
    pytest.skip(f"needs {devices} devices (--xla_force_host_platform_device_count)")
  mesh = train.make_mesh(
    data=-1, fsdp=2 if devices > 2 else 1, tensor=1, devices=jax.devices()[:devices]
  )
  x = jax.random.normal(jax.random.key(0), (rows, 256), jnp.float32)
  w = jax.random.normal(jax.random.key(1), (256, 200), jnp.float32)
  x_q, x_scale = quantize_fp8_per_token_group(x, 128)
  w_q, w_scale = quantize_fp8_blockwise(w, (128, 128))
  # Rows over the batch axes where they divide (12 rows on 4 x 2: replicated, and the
  # kernel's shard_map splits them over "data" alone).
  split = rows % (mesh.shape["data"] * mesh.shape["fsdp"]) == 0
  spec = PartitionSpec(train.BATCH_AXES) if split else PartitionSpec()
  x_q, x_scale = jax.device_put((x_q, x_scale), NamedSharding(mesh, spec))
  w_q, w_scale = jax.device_put((w_q, w_scale), NamedSharding(mesh, PartitionSpec("fsdp")))

  def matmul(*args):
    return fp8_blockwise_matmul(
      *args, impl="pallas", interpret=INTERPRET[kernel], out_dtype=jnp.float32
    )

  args = (x_q, x_scale, w_q, w_scale)
  got = jax.jit(matmul)(*args)
  want = fp8_blockwise_matmul_reference(*args)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
  assert ("shard_map" in str(jax.make_jaxpr(matmul)(*args))) == (devices > 1)


def test_kernel_inside_a_shard_map_is_not_wrapped_again():
  """In a caller's shard_map body (manual axes) the kernel runs on the local rows as it is."""
  from jax.sharding import PartitionSpec  # noqa: PLC0415

  from rlx import train  # noqa: PLC0415

  if len(jax.devices()) < 2:
    pytest.skip("needs 2 devices (--xla_force_host_platform_device_count)")
  mesh = train.make_mesh(data=2, fsdp=1, tensor=1, devices=jax.devices()[:2])
  _, _, x_q, x_scale, w_q, w_scale = _quantized(16, 256, 128)
  rows = PartitionSpec(train.BATCH_AXES)

  def local(*args):
    return fp8_blockwise_matmul(*args, impl="pallas", interpret=True, out_dtype=jnp.float32)

  per_device = jax.shard_map(
    local,
    mesh=mesh,
    in_specs=(rows, rows, PartitionSpec(), PartitionSpec()),
    out_specs=rows,
    check_vma=False,  # a pallas_call's outputs carry no varying-axes type
  )
  args = (x_q, x_scale, w_q, w_scale)
  got = jax.jit(per_device)(*args)
  np.testing.assert_allclose(
    np.asarray(got), np.asarray(fp8_blockwise_matmul_reference(*args)), rtol=0, atol=1e-5
  )
  assert str(jax.make_jaxpr(per_device)(*args)).count("shard_map") == 1
