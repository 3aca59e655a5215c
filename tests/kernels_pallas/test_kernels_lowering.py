"""The hardware paths lower on CPU: Pallas Triton (GPU) and Mosaic (TPU) kernels -> MLIR.

`jax.export` can lower for a platform that is not present. This runs the Pallas
Triton lowering (to Triton IR) and the Pallas Mosaic lowering (to Mosaic MLIR)
of the real, non-interpret kernels, catching unsupported ops, non-power-of-two
Triton blocks, mixed-dtype dots and Mosaic block-shape errors without a GPU or
TPU. It does not run the backend compilers (PTX / libtpu), so it is a necessary,
not a sufficient, check; experiments/check_kernels.py is the hardware check.

The public kernels are lowered as a host of that platform would trace them: the
inputs are placement-free `jax.ShapeDtypeStruct`s, so the default platform decides
(`rlx.kernels_pallas.default_platform`): traced under `jax.sharding.use_abstract_mesh` of an
`AbstractMesh` whose `abstract_device` is of the target platform, as an AOT export from a
CPU host would trace them.
"""

import jax
import jax.numpy as jnp
import pytest
from jax import export
from jax.sharding import AbstractDevice, AbstractMesh

from rlx.kernels_pallas import (
  PagedAttentionBlockSizes,
  default_platform,
  fp8_blockwise_matmul,
  paged_attention,
)

_CUSTOM_CALL = {"cuda": "__gpu$xla.gpu.triton", "tpu": "tpu_custom_call"}
_TARGET = {"cuda": "gpu", "tpu": "tpu"}  # jax.default_backend() spelling
_KIND = {"cuda": "NVIDIA H100 80GB HBM3", "tpu": "TPU v6 lite"}
_IMPL = {"cuda": "pallas_gpu", "tpu": "pallas_tpu"}


def _target_mesh(platform):
  """A one-device abstract mesh of `platform`'s devices: traced under it, placement-free inputs
  run on that platform (`default_platform()` reads the abstract mesh's device)."""
  device = AbstractDevice(_KIND[platform], None, _TARGET[platform])
  return AbstractMesh((1,), ("x",), abstract_device=device)


@pytest.fixture
def platform_ready(request, monkeypatch):
  platform = request.param
  if platform == "tpu":
    # Mosaic lowering asks for the TPU generation; on CPU, declare a v6e. Private
    # API: skip rather than fail if a future jax moves it.
    tpu_info = pytest.importorskip("jax._src.pallas.mosaic.tpu_info")
    if not hasattr(tpu_info, "registry") or not hasattr(tpu_info, "get_tpu_info_for_chip"):
      pytest.skip("tpu_info registry not available in this jax")
    monkeypatch.setitem(
      tpu_info.registry,
      jax.devices()[0].device_kind,
      lambda: tpu_info.get_tpu_info_for_chip(tpu_info.ChipVersion.TPU_V6E, 1),
    )
  # Placement-free inputs run on the default platform: the target's, as on its host.
  with jax.sharding.use_abstract_mesh(_target_mesh(platform)):
    assert default_platform() == _TARGET[platform]
    yield platform


def _export(fn, platform, *specs):
  checks = [export.DisabledSafetyCheck.custom_call(_CUSTOM_CALL[platform])]
  exported = export.export(jax.jit(fn), platforms=[platform], disabled_checks=checks)(*specs)
  assert _CUSTOM_CALL[platform] in exported.mlir_module()


@pytest.mark.parametrize("platform_ready", ["cuda", "tpu"], indirect=True)
@pytest.mark.parametrize(
  ("page_dtype", "gqa", "page_size", "head_dim"),
  [("bfloat16", 4, 64, 128), ("float8_e4m3fn", 1, 16, 64), ("float32", 8, 32, 128)],
)
def test_paged_attention_lowers(platform_ready, page_dtype, gqa, page_size, head_dim):
  platform = platform_ready
  batch, num_kv_heads, num_pages, pages_per_sequence = 4, 2, 40, 8
  q_dtype = jnp.float32 if page_dtype == "float32" else jnp.bfloat16
  q = jax.ShapeDtypeStruct((batch, num_kv_heads * gqa, head_dim), q_dtype)
  pages = jax.ShapeDtypeStruct((num_kv_heads, num_pages, page_size, head_dim), page_dtype)
  lengths = jax.ShapeDtypeStruct((batch,), jnp.int32)
  table = jax.ShapeDtypeStruct((batch, pages_per_sequence), jnp.int32)
  scale = jax.ShapeDtypeStruct((num_kv_heads,), jnp.float32)

  def fn(q, k, v, lengths, table, k_scale, v_scale):
    return paged_attention(
      q, k, v, lengths, table, k_scale=k_scale, v_scale=v_scale, sm_scale=head_dim**-0.5,
      impl=_IMPL[platform], interpret=False,
      block_sizes=PagedAttentionBlockSizes(pages_per_compute_block=2, pages_per_split=4),
    )  # fmt: skip

  _export(fn, platform, q, pages, pages, lengths, table, scale, scale)


@pytest.mark.parametrize("platform_ready", ["cuda", "tpu"], indirect=True)
@pytest.mark.parametrize(
  ("m", "k", "n", "block_k"), [(256, 512, 384, 256), (100, 300, 200, 256), (128, 4096, 256, 512)]
)
def test_fp8_matmul_lowers(platform_ready, m, k, n, block_k):
  platform = platform_ready
  kb, nb = -(-k // 128), -(-n // 128)
  specs = (
    jax.ShapeDtypeStruct((m, k), jnp.float8_e4m3fn),
    jax.ShapeDtypeStruct((m, kb), jnp.float32),
    jax.ShapeDtypeStruct((k, n), jnp.float8_e4m3fn),
    jax.ShapeDtypeStruct((kb, nb), jnp.float32),
  )

  def fn(xq, xs, wq, ws):
    return fp8_blockwise_matmul(
      xq, xs, wq, ws, out_dtype=jnp.dtype(jnp.bfloat16), impl=_IMPL[platform], interpret=False,
      block_m=128, block_k=block_k,
    )  # fmt: skip

  _export(fn, platform, *specs)
