"""rlx.kernels_pallas: Pallas kernels with pure-jnp references.

- `paged_attention`: paged grouped-query decode attention over bf16/f32 or FP8
  KV pages (Pallas Triton kernel on GPU, Pallas Mosaic kernel on TPU, XLA
  reference on CPU), with `paged_attention_reference` and `write_kv_pages`.
- `fp8_blockwise_matmul`: FP8 matmul with DeepSeek-V3 blockwise scales, with the
  quantizers `quantize_fp8_blockwise` / `quantize_fp8_per_token_group`.

Every kernel runs on CPU in Pallas interpret mode (`interpret=True`, or
`interpret=pltpu.InterpretParams()` for the TPU kernel); see tests/kernels_pallas.
"""

from rlx.kernels_pallas._fp8_matmul import fp8_blockwise_matmul as fp8_blockwise_matmul
from rlx.kernels_pallas._fp8_matmul import (
  fp8_blockwise_matmul_reference as fp8_blockwise_matmul_reference,
)
from rlx.kernels_pallas._fp8_quant import dequantize_fp8_blockwise as dequantize_fp8_blockwise
from rlx.kernels_pallas._fp8_quant import fp8_max as fp8_max
from rlx.kernels_pallas._fp8_quant import quantize_fp8_blockwise as quantize_fp8_blockwise
from rlx.kernels_pallas._fp8_quant import (
  quantize_fp8_per_token_group as quantize_fp8_per_token_group,
)
from rlx.kernels_pallas._fp8_quant import saturating_cast as saturating_cast
from rlx.kernels_pallas._kv_write import write_kv_pages as write_kv_pages
from rlx.kernels_pallas._paged_attention import PagedAttentionBlockSizes as PagedAttentionBlockSizes
from rlx.kernels_pallas._paged_attention import paged_attention as paged_attention
from rlx.kernels_pallas._paged_attention import (
  paged_attention_reference as paged_attention_reference,
)
from rlx.kernels_pallas._paged_attention import (
  validate_paged_attention_inputs as validate_paged_attention_inputs,
)
