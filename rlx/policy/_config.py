"""`ModelConfig`: the static description of a Qwen2 / Qwen3 / Llama decoder.

The config is a frozen, hashable dataclass so it can be passed to `jax.jit` as a
static argument. It is built from a Hugging Face `config.json` dict with
`ModelConfig.from_hf_config` and written back with `to_hf_config`; anything in
the HF config that this implementation would compute differently (sliding
window attention, rope types other than llama3, MLP biases, quantized weights,
activations other than SiLU, ...) is rejected with an error naming the field,
never silently ignored.
"""

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp

FAMILIES = ("qwen2", "qwen3", "llama")

_ARCHITECTURES = {
  "qwen2": "Qwen2ForCausalLM",
  "qwen3": "Qwen3ForCausalLM",
  "llama": "LlamaForCausalLM",
}

_DTYPES = ("float32", "bfloat16", "float16")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
  """Llama-3 ("llama3") rope frequency scaling, as in Llama 3.1+ checkpoints.

  Wavelengths longer than `original_max_position_embeddings / low_freq_factor`
  are divided by `factor`, shorter than `... / high_freq_factor` are kept, and
  the band between is interpolated smoothly (Meta's Llama 3.1 reference).
  """

  factor: float
  low_freq_factor: float
  high_freq_factor: float
  original_max_position_embeddings: int

  def to_hf(self) -> dict[str, Any]:
    return {
      "rope_type": "llama3",
      "factor": self.factor,
      "low_freq_factor": self.low_freq_factor,
      "high_freq_factor": self.high_freq_factor,
      "original_max_position_embeddings": self.original_max_position_embeddings,
    }


def _dtype_name(value: Any, name: str) -> str:
  try:
    dtype_name = jnp.dtype(value).name
  except TypeError as e:
    raise ValueError(f"`{name}` must be one of {_DTYPES}, got {value!r}.") from e
  if dtype_name not in _DTYPES:
    raise ValueError(f"`{name}` must be one of {_DTYPES}, got {value!r}.")
  return dtype_name


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Static hyper-parameters of a decoder-only transformer (hashable, jit-static).

  Attributes:
    family: "qwen2" | "qwen3" | "llama".
    vocab_size: V, rows of the embedding / columns of the LM head.
    hidden_size: model width.
    num_layers: number of decoder blocks L.
    num_heads: query heads H.
    num_kv_heads: key/value heads Hkv (GQA); H must be a multiple of Hkv.
    head_dim: per-head width Dh (Qwen3 decouples it from hidden_size / H).
    intermediate_size: SwiGLU MLP width.
    rope_theta: RoPE base.
    rope_scaling: None or `RopeScaling` (llama3 scaling).
    rms_norm_eps: epsilon of every RMSNorm.
    attention_bias: whether q/k/v projections have biases (Qwen2: always).
    attention_out_bias: whether the output projection has a bias (Llama and
      Qwen3 with `attention_bias`; never Qwen2).
    qk_norm: per-head RMSNorm on queries and keys before RoPE (Qwen3).
    tie_embeddings: LM head is the transposed embedding matrix.
    max_position_embeddings: carried for round-tripping config.json.
    bos_token_id, eos_token_id, pad_token_id: carried for config.json
      (`eos_token_id` may be a tuple of ids).
    param_dtype: dtype name of the parameters ("float32" | "bfloat16" | "float16").
    compute_dtype: dtype name of activations and matmul inputs. Softmax,
      RMSNorm statistics, RoPE and logits are always computed in float32.
    remat: wrap each decoder block in `jax.checkpoint` (recompute activations
      in the backward pass); not an HF field.
  """

  family: str
  vocab_size: int
  hidden_size: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  intermediate_size: int
  rope_theta: float = 10000.0
  rope_scaling: RopeScaling | None = None
  rms_norm_eps: float = 1e-6
  attention_bias: bool = False
  attention_out_bias: bool = False
  qk_norm: bool = False
  tie_embeddings: bool = False
  max_position_embeddings: int = 32768
  bos_token_id: int | None = None
  eos_token_id: int | tuple[int, ...] | None = None
  pad_token_id: int | None = None
  param_dtype: str = "float32"
  compute_dtype: str = "float32"
  remat: bool = False

  def __post_init__(self):
    if self.family not in FAMILIES:
      raise ValueError(f"`family` must be one of {FAMILIES}, got {self.family!r}.")
    for name in (
      "vocab_size",
      "hidden_size",
      "num_layers",
      "num_heads",
      "num_kv_heads",
      "head_dim",
      "intermediate_size",
    ):
      value = getattr(self, name)
      if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"`{name}` must be a positive int, got {value!r}.")
    if self.num_heads % self.num_kv_heads:
      raise ValueError(
        f"`num_heads` ({self.num_heads}) must be a multiple of `num_kv_heads` "
        f"({self.num_kv_heads})."
      )
    if self.head_dim % 2:
      raise ValueError(f"`head_dim` must be even for RoPE, got {self.head_dim}.")
    if self.rope_scaling is not None and not isinstance(self.rope_scaling, RopeScaling):
      raise ValueError(f"`rope_scaling` must be None or RopeScaling, got {self.rope_scaling!r}.")
    if isinstance(self.eos_token_id, list):
      object.__setattr__(self, "eos_token_id", tuple(self.eos_token_id))
    object.__setattr__(self, "param_dtype", _dtype_name(self.param_dtype, "param_dtype"))
    object.__setattr__(self, "compute_dtype", _dtype_name(self.compute_dtype, "compute_dtype"))
    object.__setattr__(self, "rope_theta", float(self.rope_theta))
    object.__setattr__(self, "rms_norm_eps", float(self.rms_norm_eps))

  @property
  def num_query_groups(self) -> int:
    """Query heads per KV head (H / Hkv)."""
    return self.num_heads // self.num_kv_heads

  @classmethod
  def small(cls, family: str = "qwen2", **overrides: Any) -> "ModelConfig":
    """A tiny config for tests and embedded tasks (2 layers, width 64, GQA 4/2)."""
    defaults = dict(
      family=family,
      vocab_size=128,
      hidden_size=64,
      num_layers=2,
      num_heads=4,
      num_kv_heads=2,
      head_dim=16,
      intermediate_size=128,
      attention_bias=family == "qwen2",
      qk_norm=family == "qwen3",
    )
    defaults.update(overrides)
    return cls(**defaults)

  @classmethod
  def from_hf_config(
    cls,
    hf: Mapping[str, Any],
    *,
    param_dtype: Any = None,
    compute_dtype: Any = None,
  ) -> "ModelConfig":
    """Builds a config from a Hugging Face `config.json` dict.

    Accepts both the transformers>=5 layout (`rope_parameters`) and the older
    one (`rope_theta` + `rope_scaling`).

    Args:
      hf: the parsed config.json.
      param_dtype: parameter dtype; default: the checkpoint's `dtype` /
        `torch_dtype`, else float32.
      compute_dtype: activation dtype; default: `param_dtype`.

    Returns:
      The `ModelConfig`.

    Raises:
      ValueError: naming the unsupported architecture or field.
    """
    model_type = hf.get("model_type")
    if model_type not in FAMILIES:
      raise ValueError(
        f"Unsupported model_type {model_type!r} (architectures={hf.get('architectures')}); "
        f"rlx.policy supports {FAMILIES} ({', '.join(_ARCHITECTURES.values())})."
      )
    architectures = hf.get("architectures") or [_ARCHITECTURES[model_type]]
    bad = [a for a in architectures if a != _ARCHITECTURES[model_type]]
    if bad:
      raise ValueError(
        f"Unsupported architecture(s) {bad} for model_type {model_type!r}; "
        f"expected {_ARCHITECTURES[model_type]!r}."
      )

    def reject(field: str, ok: Any) -> None:
      if field in hf and hf[field] not in ok:
        raise ValueError(
          f"Unsupported config.json field {field}={hf[field]!r} for {model_type}; "
          f"supported values: {list(ok)}."
        )

    reject("hidden_act", ("silu",))
    reject("use_sliding_window", (False, None))
    reject("mlp_bias", (False, None))
    reject("partial_rotary_factor", (1.0, None))
    reject("quantization_config", (None,))
    layer_types = hf.get("layer_types") or []
    bad_layers = sorted({t for t in layer_types if t != "full_attention"})
    if bad_layers:
      raise ValueError(
        f"Unsupported config.json field layer_types containing {bad_layers}; "
        "only 'full_attention' layers are supported."
      )

    rope_theta, rope_scaling = _parse_rope(hf, model_type)

    num_heads = int(hf["num_attention_heads"])
    num_kv_heads = int(hf.get("num_key_value_heads") or num_heads)
    head_dim = hf.get("head_dim") or int(hf["hidden_size"]) // num_heads
    if model_type == "qwen2":
      attention_bias, attention_out_bias = True, False
    else:
      attention_bias = attention_out_bias = bool(hf.get("attention_bias", False))

    dtype = param_dtype
    if dtype is None:
      dtype = hf.get("dtype") or hf.get("torch_dtype") or "float32"
    eos = hf.get("eos_token_id")
    return cls(
      family=model_type,
      vocab_size=int(hf["vocab_size"]),
      hidden_size=int(hf["hidden_size"]),
      num_layers=int(hf["num_hidden_layers"]),
      num_heads=num_heads,
      num_kv_heads=num_kv_heads,
      head_dim=int(head_dim),
      intermediate_size=int(hf["intermediate_size"]),
      rope_theta=rope_theta,
      rope_scaling=rope_scaling,
      rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
      attention_bias=attention_bias,
      attention_out_bias=attention_out_bias,
      qk_norm=model_type == "qwen3",
      tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
      max_position_embeddings=int(hf.get("max_position_embeddings", 32768)),
      bos_token_id=hf.get("bos_token_id"),
      eos_token_id=tuple(eos) if isinstance(eos, list) else eos,
      pad_token_id=hf.get("pad_token_id"),
      param_dtype=dtype,
      compute_dtype=compute_dtype if compute_dtype is not None else dtype,
    )

  def to_hf_config(self) -> dict[str, Any]:
    """The HF `config.json` dict (transformers>=5 layout, also read by 4.x)."""
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": self.rope_theta}
    if self.rope_scaling is not None:
      rope = {**self.rope_scaling.to_hf(), "rope_theta": self.rope_theta}
    eos = list(self.eos_token_id) if isinstance(self.eos_token_id, tuple) else self.eos_token_id
    hf: dict[str, Any] = {
      "architectures": [_ARCHITECTURES[self.family]],
      "model_type": self.family,
      "vocab_size": self.vocab_size,
      "hidden_size": self.hidden_size,
      "intermediate_size": self.intermediate_size,
      "num_hidden_layers": self.num_layers,
      "num_attention_heads": self.num_heads,
      "num_key_value_heads": self.num_kv_heads,
      "head_dim": self.head_dim,
      "hidden_act": "silu",
      "max_position_embeddings": self.max_position_embeddings,
      "rms_norm_eps": self.rms_norm_eps,
      "rope_parameters": rope,
      # Legacy keys for transformers 4.x readers.
      "rope_theta": self.rope_theta,
      "rope_scaling": self.rope_scaling.to_hf() if self.rope_scaling is not None else None,
      "tie_word_embeddings": self.tie_embeddings,
      "attention_dropout": 0.0,
      "use_cache": True,
      "bos_token_id": self.bos_token_id,
      "eos_token_id": eos,
      "pad_token_id": self.pad_token_id,
      "dtype": self.param_dtype,
      "torch_dtype": self.param_dtype,
    }
    if self.family == "qwen2":
      if not self.attention_bias or self.attention_out_bias:
        raise ValueError("qwen2 checkpoints always have q/k/v biases and no output bias.")
      hf.update(use_sliding_window=False, max_window_layers=self.num_layers)
    else:
      if self.attention_bias != self.attention_out_bias:
        raise ValueError(
          f"{self.family} checkpoints have one `attention_bias` for q/k/v/o; got "
          f"attention_bias={self.attention_bias}, attention_out_bias={self.attention_out_bias}."
        )
      hf.update(attention_bias=self.attention_bias)
    if self.family == "qwen3":
      if not self.qk_norm:
        raise ValueError("qwen3 checkpoints always have q/k norms (qk_norm=True).")
      hf.update(use_sliding_window=False, max_window_layers=self.num_layers)
    elif self.qk_norm:
      raise ValueError(f"{self.family} checkpoints have no q/k norm; got qk_norm=True.")
    if self.family == "llama":
      hf.update(mlp_bias=False)
    return hf


def _parse_rope(hf: Mapping[str, Any], model_type: str) -> tuple[float, RopeScaling | None]:
  """Returns (rope_theta, rope_scaling) from either HF config layout."""
  params = hf.get("rope_parameters")
  if params is None:
    params = dict(hf.get("rope_scaling") or {})
    params.setdefault("rope_theta", hf.get("rope_theta", 10000.0))
  params = dict(params)
  if "rope_type" not in params and "type" in params:
    params["rope_type"] = params["type"]
  rope_type = params.get("rope_type", "default")
  theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
  if params.get("partial_rotary_factor", 1.0) != 1.0:
    raise ValueError(
      f"Unsupported rope partial_rotary_factor={params['partial_rotary_factor']!r} "
      f"for {model_type}."
    )
  if rope_type in ("default", None):
    return theta, None
  if rope_type != "llama3":
    raise ValueError(
      f"Unsupported rope_scaling type {rope_type!r} for {model_type}; "
      "supported: 'default' (none) and 'llama3'."
    )
  missing = [
    k
    for k in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    if k not in params
  ]
  if missing:
    raise ValueError(f"llama3 rope_scaling is missing fields {missing}.")
  if params["high_freq_factor"] == params["low_freq_factor"]:
    raise ValueError("llama3 rope_scaling needs high_freq_factor != low_freq_factor.")
  return theta, RopeScaling(
    factor=float(params["factor"]),
    low_freq_factor=float(params["low_freq_factor"]),
    high_freq_factor=float(params["high_freq_factor"]),
    original_max_position_embeddings=int(params["original_max_position_embeddings"]),
  )
