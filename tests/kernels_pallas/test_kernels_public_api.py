"""The public surface of rlx.kernels_pallas (one re-export per name, `__all__`)."""

import inspect
import pathlib

import pytest

import rlx.kernels_pallas as kp

PACKAGE = pathlib.Path(kp.__file__).resolve().parent

PUBLIC = (
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


def test_public_names():
  names = {n for n in dir(kp) if not n.startswith("_") and not inspect.ismodule(getattr(kp, n))}
  assert names == set(PUBLIC)
  assert kp.__all__ == PUBLIC  # sorted, one entry per public name
  for name in PUBLIC:  # each re-exported from a private file of the package
    path = pathlib.Path(inspect.getsourcefile(getattr(kp, name))).resolve()
    assert path.parent == PACKAGE, (name, path)
    assert path.name.startswith("_") and path.name != "__init__.py", (name, path)


def test_documented_signatures():
  sig = inspect.signature(kp.paged_attention)
  assert list(sig.parameters)[:5] == ["q", "k_pages", "v_pages", "lengths", "page_table"]
  for name in ("sm_scale", "k_scale", "v_scale", "impl", "interpret", "block_sizes"):
    assert sig.parameters[name].kind is inspect.Parameter.KEYWORD_ONLY
  assert sig.parameters["impl"].default == "auto"
  sig = inspect.signature(kp.paged_attention_reference)
  assert list(sig.parameters) == [
    "q", "k_pages", "v_pages", "lengths", "page_table", "sm_scale", "k_scale", "v_scale",
  ]  # fmt: skip
  sig = inspect.signature(kp.write_kv_pages)
  assert list(sig.parameters)[:6] == [
    "k_pages", "v_pages", "k_new", "v_new", "positions", "page_table",
  ]  # fmt: skip
  for name in ("num_new", "k_scale", "v_scale"):
    assert sig.parameters[name].kind is inspect.Parameter.KEYWORD_ONLY
  sig = inspect.signature(kp.fp8_blockwise_matmul)
  assert list(sig.parameters)[:4] == ["x_q", "x_scale", "w_q", "w_scale"]
  for name in ("out_dtype", "impl", "interpret", "block_m", "block_k"):
    assert sig.parameters[name].kind is inspect.Parameter.KEYWORD_ONLY
  for name in PUBLIC:
    doc = inspect.getdoc(getattr(kp, name))
    assert doc and doc.strip(), name


SOURCES = sorted(str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py"))
KNOWN = ("__init__.py", "_common.py", "_fp8_matmul.py", "_fp8_quant.py", "_kv_write.py",
         "_paged_attention.py", "_paged_attention_tpu.py",
         "_paged_prefill_attention.py")  # fmt: skip


def test_sources_found():
  assert set(KNOWN) <= set(SOURCES), SOURCES


@pytest.mark.parametrize("source", SOURCES)
def test_docstrings_cite_no_documents_outside_the_repository(source):
  text = (PACKAGE / source).read_text()
  for word in ("REFERENCE.md", "contracts.md", "DESIGN.md"):
    assert word not in text, (source, word)
