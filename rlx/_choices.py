"""Named choices shared by rlx.sampling, rlx.train and rlx.rl, and the check of a choice.

The dtype names a sampler (`rlx.sampling.SamplerConfig`) and the RL config's
rollout section accept, and the kernel implementations of `rlx.kernels_pallas`,
written once here so that every config and kernel validating them offers the
same set. Imports nothing of rlx (any rlx module may import it).
"""

from collections.abc import Iterable
from typing import Any

import jax.numpy as jnp

# FP8 format name -> dtype (W8A8 decoder linears, FP8 KV pages).
FP8_DTYPES = {"fp8_e4m3": jnp.float8_e4m3fn, "fp8_e5m2": jnp.float8_e5m2}
# KV page dtype name -> dtype.
KV_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, **FP8_DTYPES}
# kv_dtype names a sampler and the RL config accept: "auto" = the model's compute dtype.
KV_DTYPE_NAMES = ("auto", *KV_DTYPES)
# kv_scale_mode names: "static" = calibrated scales per layer (and KV head) passed by the
# caller; "per_token" = a scale per cached token and KV head, written with the pages.
KV_SCALE_MODES = ("static", "per_token")
# weight_dtype names: "auto" = the params' own leaves; FP8 = W8A8 decoder linears.
WEIGHT_DTYPES = ("auto", *FP8_DTYPES)
# `impl` of the rlx.kernels_pallas kernels (`paged_attention`, `fp8_blockwise_matmul`;
# checked by `rlx.kernels_pallas.resolve_impl`) and a sampler's `attention_impl`:
# "auto" = the kernel of the inputs' platform (XLA on CPU), "pallas" = the Pallas kernel of
# that platform (off GPU/TPU chosen by `interpret`), "pallas_gpu" (Triton), "pallas_tpu"
# (Mosaic), "xla" = pure-jnp reference math.
ATTENTION_IMPLS = ("auto", "pallas", "pallas_gpu", "pallas_tpu", "xla")


def check_choice(value: Any, choices: Iterable[Any], name: str) -> None:
  """Raises ValueError naming `name` unless `value` is one of `choices`.

  Args:
    value: the configured value.
    choices: the allowed values (shown as a tuple in the message).
    name: the field's name, e.g. "config.agg".
  """
  choices = tuple(choices)
  if value not in choices:
    raise ValueError(f"`{name}` must be one of {choices}, got {value!r}.")
