"""rlx.kernels_pallas: Pallas kernels with pure-jnp references.

- `paged_attention`: paged grouped-query decode attention over bf16/f32 or FP8
  KV pages (PagedAttention, https://arxiv.org/abs/2309.06180): Pallas Triton
  kernel on GPU, Pallas Mosaic kernel on TPU, XLA reference math on CPU, chosen
  by where the inputs live; with `paged_attention_reference`, `write_kv_pages`
  (static per-tensor / per-head scales) and `write_kv_pages_per_token` (a
  dynamic FP8 scale per token and KV head, stored beside the pages, which every
  attention path reads when given the scale pools as `k_scale` / `v_scale`).
- `paged_prefill_attention`: a prefill chunk's causal attention over its row's
  cached pages and itself (chunked prefill), with
  `paged_prefill_attention_reference`.
- `fp8_blockwise_matmul`: FP8 matmul with DeepSeek-V3 blockwise scales
  (https://arxiv.org/abs/2412.19437; DeepGEMM), with the quantizers
  `quantize_fp8_blockwise` / `quantize_fp8_per_token_group`.

Dispatch: `impl="auto"` runs the Pallas kernel of the platform the inputs live on
(XLA reference math on CPU); `arrays_platform(*arrays)` names that platform
(`default_platform()` when no input is placed) and `resolve_impl(impl, interpret,
platform)` the implementation a call takes, for callers that choose their own
kernels the same way. To export for a platform this host lacks (`jax.export`
for TPU from a CPU host), trace under an abstract mesh of that platform's
devices, which `default_platform()` then names:

  device = jax.sharding.AbstractDevice("TPU v6 lite", None, "tpu")
  mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device)
  with jax.sharding.use_abstract_mesh(mesh):
    exported = jax.export.export(jax.jit(f), platforms=["tpu"])(*shape_dtype_structs)

or shard the inputs over compile-only devices
(`jax.experimental.topologies.get_topology_desc`).

Every kernel runs on CPU in Pallas interpret mode (`interpret=True`, or
`interpret=pltpu.InterpretParams()` for the TPU kernels); see tests/kernels_pallas.
"""

from rlx.kernels_pallas._common import (
  arrays_platform,
  default_platform,
  resolve_impl,
)
from rlx.kernels_pallas._fp8_matmul import (
  fp8_blockwise_matmul,
  fp8_blockwise_matmul_reference,
)
from rlx.kernels_pallas._fp8_quant import (
  dequantize_fp8_blockwise,
  fp8_max,
  quantize_fp8_blockwise,
  quantize_fp8_per_token_group,
  saturating_cast,
)
from rlx.kernels_pallas._kv_write import (
  write_kv_pages,
  write_kv_pages_per_token,
)
from rlx.kernels_pallas._paged_attention import (
  PagedAttentionBlockSizes,
  paged_attention,
  paged_attention_reference,
  validate_paged_attention_inputs,
)
from rlx.kernels_pallas._paged_prefill_attention import (
  paged_prefill_attention,
  paged_prefill_attention_reference,
)

__all__ = (
  "PagedAttentionBlockSizes",
  "arrays_platform",
  "default_platform",
  "dequantize_fp8_blockwise",
  "fp8_blockwise_matmul",
  "fp8_blockwise_matmul_reference",
  "fp8_max",
  "paged_attention",
  "paged_attention_reference",
  "paged_prefill_attention",
  "paged_prefill_attention_reference",
  "quantize_fp8_blockwise",
  "quantize_fp8_per_token_group",
  "resolve_impl",
  "saturating_cast",
  "validate_paged_attention_inputs",
  "write_kv_pages",
  "write_kv_pages_per_token",
)
