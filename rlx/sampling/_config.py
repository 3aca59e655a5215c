"""`SamplerConfig`: the static shape and sampling settings of a `Sampler`."""

import dataclasses
import math

import jax.numpy as jnp

from rlx._choices import (
  ATTENTION_IMPLS,
  KV_DTYPE_NAMES,
  KV_DTYPES,
  KV_SCALE_MODES,
  WEIGHT_DTYPES,
  check_choice,
)


def _positive_int(value, name: str) -> int:
  if not isinstance(value, int) or isinstance(value, bool) or value < 1:
    raise ValueError(f"`{name}` must be a positive int, got {value!r}.")
  return value


@dataclasses.dataclass(frozen=True)
class SamplerConfig:
  """Static settings of a paged-KV sampler (hashable; changing one recompiles).

  Attributes:
    max_slots: S, sequences decoded at once (the decode batch).
    page_size: tokens per KV page.
    num_pages: P, pages in the pool (shared by all slots). Must hold at least
      one full sequence: `P >= ceil((max_prompt_len + max_new_tokens - 1) / page_size)`.
    max_prompt_len: longest accepted prompt (tokens).
    max_new_tokens: M, generated tokens per sample at most.
    kv_dtype: page dtype: "float32" | "bfloat16" | "fp8_e4m3" | "fp8_e5m2" |
      "auto" (the model's compute dtype). FP8 pages need `kv_scales` in
      `generate` (K = page * k_scale), unless `kv_scale_mode` is "per_token".
    kv_scale_mode: how FP8 pages are scaled. "static": one scale per layer
      (and KV head) passed to `generate` as `kv_scales`, calibrated by the caller
      (vLLM's FP8 KV cache). "per_token": every cached token gets its own
      scale per KV head, `amax_d |k| / fp8_max`, computed when it is written and
      kept in a float32 pool beside the pages
      (`rlx.kernels_pallas.write_kv_pages_per_token`): no calibration, each
      token's largest element is exact, for 4 / D more KV bytes (25% at head
      dim 16, 3% at 128). Only with an FP8 `kv_dtype`. On TPU the decode kernel
      reads the scales in tiles of 8 pages: a `num_pages` that is a multiple of
      8 avoids a padded copy of the scale pools per layer and step.
    weight_dtype: "auto" or None: the params' own leaves as passed. "fp8_e4m3" |
      "fp8_e5m2": every decoder linear runs W8A8 with 128x128 FP8 weight blocks
      and dynamic 1x128 activation scales (`rlx.policy.quantize_linears`);
      dense params passed to `generate` are quantized on device at the start
      of each call, or pass `rlx.sampling.quantize_params(params, config)`
      once per policy update. Embeddings and the LM head stay high precision.
    temperature: 0 = greedy; else logits are divided by it before sampling.
    top_k: 0 = off; else sample among the k largest logits.
    top_p: nucleus sampling mass in (0, 1]; 1 = off.
    stop_token_ids: a sample ends after emitting one of these (it is kept).
    steps_per_sync: decode steps run on device (one `lax.while_loop`) between
      two host scheduling points.
    prefill_chunk: most tokens per prefill call and row (prompts longer than
      this are prefilled in several chunks). A call is only as wide as the
      smallest power-of-two bucket (>= min(8, prefill_chunk)) holding its
      longest piece, so short prompts are not padded to the full chunk; at
      most ~log2(prefill_chunk / 8) + 1 widths compile.
    continuous_batching: True: finished slots are refilled at every
      scheduling point. False: static batching, the next wave of requests is
      admitted only when every slot is idle (for comparisons).
    attention_impl: `impl` of `rlx.kernels_pallas.paged_attention` for decode.
  """

  max_slots: int = 32
  page_size: int = 16
  num_pages: int = 512
  max_prompt_len: int = 64
  max_new_tokens: int = 128
  kv_dtype: str = "float32"
  kv_scale_mode: str = "static"
  weight_dtype: str | None = "auto"
  temperature: float = 1.0
  top_k: int = 0
  top_p: float = 1.0
  stop_token_ids: tuple[int, ...] = ()
  steps_per_sync: int = 32
  prefill_chunk: int = 64
  continuous_batching: bool = True
  attention_impl: str = "auto"

  def __post_init__(self):
    for name in (
      "max_slots",
      "page_size",
      "num_pages",
      "max_prompt_len",
      "max_new_tokens",
      "steps_per_sync",
      "prefill_chunk",
    ):
      _positive_int(getattr(self, name), name)
    check_choice(self.kv_dtype, KV_DTYPE_NAMES, "kv_dtype")
    check_choice(self.kv_scale_mode, KV_SCALE_MODES, "kv_scale_mode")
    if self.kv_scale_mode == "per_token" and not self.kv_dtype.startswith("fp8"):
      raise ValueError(
        f"`kv_scale_mode`='per_token' needs an FP8 `kv_dtype` (fp8_e4m3 or fp8_e5m2), got "
        f"kv_dtype={self.kv_dtype!r}."
      )
    if self.weight_dtype is not None and self.weight_dtype not in WEIGHT_DTYPES:
      raise ValueError(
        f"`weight_dtype` must be None or one of {WEIGHT_DTYPES}, got {self.weight_dtype!r}."
      )
    t = self.temperature
    if isinstance(t, bool) or not isinstance(t, int | float) or not math.isfinite(t) or t < 0:
      raise ValueError(f"`temperature` must be a finite float >= 0, got {t!r}.")
    object.__setattr__(self, "temperature", float(t))
    if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 0:
      raise ValueError(f"`top_k` must be an int >= 0 (0 = off), got {self.top_k!r}.")
    p = self.top_p
    if isinstance(p, bool) or not isinstance(p, int | float) or not 0 < p <= 1:
      raise ValueError(f"`top_p` must be in (0, 1], got {p!r}.")
    object.__setattr__(self, "top_p", float(p))
    stops = self.stop_token_ids
    if isinstance(stops, int):
      stops = (stops,)
    try:
      stops = tuple(stops)
    except TypeError as e:
      raise ValueError(f"`stop_token_ids` must be a tuple of ints, got {stops!r}.") from e
    if not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in stops):
      raise ValueError(f"`stop_token_ids` must be non-negative ints, got {stops!r}.")
    object.__setattr__(self, "stop_token_ids", stops)
    if not isinstance(self.continuous_batching, bool):
      raise ValueError(f"`continuous_batching` must be a bool, got {self.continuous_batching!r}.")
    check_choice(self.attention_impl, ATTENTION_IMPLS, "attention_impl")
    need = self.pages_per_sequence
    if self.num_pages < need:
      raise ValueError(
        f"`num_pages`={self.num_pages} is smaller than one full sequence: max_prompt_len + "
        f"max_new_tokens - 1 = {self.max_prompt_len + self.max_new_tokens - 1} tokens need "
        f"{need} pages of {self.page_size}."
      )

  @property
  def pages_per_sequence(self) -> int:
    """Page-table width: pages of the longest sequence's KV (the last token is never cached)."""
    return -(-(self.max_prompt_len + self.max_new_tokens - 1) // self.page_size)

  def page_dtype(self, compute_dtype) -> jnp.dtype:
    """The pool dtype for a model computing in `compute_dtype`."""
    if self.kv_dtype == "auto":
      return jnp.dtype(compute_dtype)
    return jnp.dtype(KV_DTYPES[self.kv_dtype])
