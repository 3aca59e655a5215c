"""The public surface of rlx.kernels_pallas (one re-export per name)."""

import inspect

import rlx.kernels_pallas as kp

PUBLIC = {
  "PagedAttentionBlockSizes",
  "dequantize_fp8_blockwise",
  "fp8_blockwise_matmul",
  "fp8_blockwise_matmul_reference",
  "fp8_max",
  "paged_attention",
  "paged_attention_reference",
  "quantize_fp8_blockwise",
  "quantize_fp8_per_token_group",
  "saturating_cast",
  "validate_paged_attention_inputs",
  "write_kv_pages",
}


def test_public_names():
  names = {n for n in dir(kp) if not n.startswith("_") and not inspect.ismodule(getattr(kp, n))}
  assert names == PUBLIC


def test_documented_signatures():
  sig = inspect.signature(kp.paged_attention)
  assert list(sig.parameters)[:5] == ["q", "k_pages", "v_pages", "lengths", "page_table"]
  for name in ("sm_scale", "k_scale", "v_scale", "impl", "interpret"):
    assert sig.parameters[name].kind is inspect.Parameter.KEYWORD_ONLY
  assert sig.parameters["impl"].default == "auto"
  sig = inspect.signature(kp.fp8_blockwise_matmul)
  assert sig.parameters["out_dtype"].kind is inspect.Parameter.KEYWORD_ONLY
  for name in PUBLIC:
    doc = inspect.getdoc(getattr(kp, name))
    assert doc and doc.strip(), name
