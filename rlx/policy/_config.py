"""`ModelConfig`: the static description of a Qwen2 / Qwen3 / Llama decoder.

The config is a frozen, hashable dataclass so it can be passed to `jax.jit` as a
static argument. It is built from a Hugging Face `config.json` dict with
`ModelConfig.from_hf_config` and written back with `to_hf_config`; anything in
the HF config that this implementation would compute differently (sliding
window attention, rope types other than llama3, MLP biases, quantized weights,
activations other than SiLU, dropout, ...) is rejected with an error naming the
field, never silently ignored. Fields that contradict each other (the legacy
`rope_theta` / `rope_scaling` against `rope_parameters`, `dtype` against
`torch_dtype`) are an error naming both; a field that is absent takes the
transformers default of that model type (`transformers.Qwen2Config`,
`Qwen3Config`, `LlamaConfig`) with a warning naming it, so the model is the one
`transformers` would build from the same file.
"""

import dataclasses
import math
import warnings
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp
import numpy as np

FAMILIES = ("qwen2", "qwen3", "llama")

_ARCHITECTURES = {
  "qwen2": "Qwen2ForCausalLM",
  "qwen3": "Qwen3ForCausalLM",
  "llama": "LlamaForCausalLM",
}

_DTYPES = ("float32", "bfloat16", "float16")

# The sizes a config must give as positive ints.
_SIZE_FIELDS = (
  "vocab_size",
  "hidden_size",
  "num_layers",
  "num_heads",
  "num_kv_heads",
  "head_dim",
  "intermediate_size",
)
# The int fields (sizes and token ids, `eos_token_id` aside) that NumPy integers are converted from.
_INT_FIELDS = (*_SIZE_FIELDS, "max_position_embeddings", "bos_token_id", "pad_token_id")

# transformers' defaults for the config.json fields that change the computation, per
# model type (the class defaults of Qwen2Config / Qwen3Config / LlamaConfig, transformers
# 5.x). `None` for num_key_value_heads: as many as the query heads (multi-head
# attention); `None` for head_dim: hidden_size / num_attention_heads.
_HF_DEFAULTS: dict[str, dict[str, Any]] = {
  "qwen2": dict(
    num_key_value_heads=32, head_dim=None, rms_norm_eps=1e-6, rope_theta=10000.0,
    tie_word_embeddings=False, max_position_embeddings=32768,
  ),
  "qwen3": dict(
    num_key_value_heads=32, head_dim=128, rms_norm_eps=1e-6, rope_theta=10000.0,
    tie_word_embeddings=False, max_position_embeddings=32768, attention_bias=False,
  ),
  "llama": dict(
    num_key_value_heads=None, head_dim=None, rms_norm_eps=1e-6, rope_theta=10000.0,
    tie_word_embeddings=False, max_position_embeddings=2048, attention_bias=False,
  ),
}  # fmt: skip

# Keys a rope parameter dict may hold (rope_type "default" uses only the first three).
_ROPE_KEYS = ("rope_type", "rope_theta", "partial_rotary_factor")
_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def _is_int(value: Any) -> bool:
  return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: Any) -> bool:
  return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)


def _as_python_int(value: Any) -> Any:
  """NumPy integers become Python ints (so the config hashes and prints canonically)."""
  return int(value) if isinstance(value, np.integer) else value


def _check_positive_real(value: Any, name: str) -> float:
  """float(value) for a finite real > 0, else a ValueError naming `name`."""
  if not _is_real(value) or not math.isfinite(value) or value <= 0:
    raise ValueError(f"`{name}` must be a finite number > 0, got {value!r}.")
  return float(value)


@dataclasses.dataclass(frozen=True)
class RopeScaling:
  """Llama-3 ("llama3") rope frequency scaling, as in Llama 3.1+ checkpoints.

  Wavelengths longer than `original_max_position_embeddings / low_freq_factor`
  are divided by `factor`, shorter than `... / high_freq_factor` are kept, and
  the band between is interpolated smoothly: `apply_scaling` of Meta's reference
  (https://github.com/meta-llama/llama-models, Llama 3.1; The Llama 3 Herd of
  Models, https://arxiv.org/abs/2407.21783), transformers'
  `_compute_llama3_parameters`. RoPE itself: RoFormer,
  https://arxiv.org/abs/2104.09864.
  """

  factor: float
  low_freq_factor: float
  high_freq_factor: float
  original_max_position_embeddings: int

  def __post_init__(self):
    for name in ("factor", "low_freq_factor", "high_freq_factor"):
      value = _check_positive_real(getattr(self, name), f"rope_scaling.{name}")
      object.__setattr__(self, name, value)
    if self.high_freq_factor <= self.low_freq_factor:
      raise ValueError(
        "llama3 rope scaling needs high_freq_factor > low_freq_factor (the band between "
        f"the two wavelengths is interpolated); got high_freq_factor={self.high_freq_factor}, "
        f"low_freq_factor={self.low_freq_factor}."
      )
    value = self.original_max_position_embeddings
    if not _is_int(value) or value <= 0:
      raise ValueError(
        f"`rope_scaling.original_max_position_embeddings` must be a positive int, got {value!r}."
      )

  def to_hf(self) -> dict[str, Any]:
    return {
      "rope_type": "llama3",
      "factor": self.factor,
      "low_freq_factor": self.low_freq_factor,
      "high_freq_factor": self.high_freq_factor,
      "original_max_position_embeddings": self.original_max_position_embeddings,
    }


def check_model_config(config: Any, name: str = "config") -> None:
  """Raises ValueError unless `config` is a `ModelConfig`."""
  if not isinstance(config, ModelConfig):
    raise ValueError(
      f"`{name}` must be a rlx.policy.ModelConfig (e.g. ModelConfig.from_hf_config), got "
      f"{type(config).__name__} {config!r:.80}."
    )


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
    rope_theta: RoPE base (finite, > 0).
    rope_scaling: None or `RopeScaling` (llama3 scaling).
    rms_norm_eps: epsilon of every RMSNorm (finite, > 0).
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
    for name in _INT_FIELDS:
      object.__setattr__(self, name, _as_python_int(getattr(self, name)))
    if isinstance(self.eos_token_id, list | tuple):
      object.__setattr__(self, "eos_token_id", tuple(_as_python_int(i) for i in self.eos_token_id))
    else:
      object.__setattr__(self, "eos_token_id", _as_python_int(self.eos_token_id))
    if self.family not in FAMILIES:
      raise ValueError(f"`family` must be one of {FAMILIES}, got {self.family!r}.")
    for name in _SIZE_FIELDS:
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
    if not _is_int(self.max_position_embeddings) or self.max_position_embeddings <= 0:
      raise ValueError(
        f"`max_position_embeddings` must be a positive int, got {self.max_position_embeddings!r}."
      )
    # Non-positive eps / theta give NaN or inf (rsqrt(0), 0 ** -x) only later, in the logits.
    object.__setattr__(self, "rope_theta", _check_positive_real(self.rope_theta, "rope_theta"))
    object.__setattr__(
      self, "rms_norm_eps", _check_positive_real(self.rms_norm_eps, "rms_norm_eps")
    )
    for name in ("attention_bias", "attention_out_bias", "qk_norm", "tie_embeddings", "remat"):
      if not isinstance(getattr(self, name), bool):
        raise ValueError(f"`{name}` must be a bool, got {getattr(self, name)!r}.")
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
      value = getattr(self, name)
      ids = value if isinstance(value, tuple) and name == "eos_token_id" else (value,)
      if value is None or (ids and all(_is_int(i) for i in ids)):
        continue
      raise ValueError(f"`{name}` must be None or an int (eos: or a list of ints), got {value!r}.")
    for name in ("bos_token_id", "eos_token_id"):  # the sampler stops on / starts with these
      value = getattr(self, name)
      for i in value if isinstance(value, tuple) else (value,):
        if i is not None and not 0 <= i < self.vocab_size:
          raise ValueError(f"`{name}` {i} is outside the vocabulary [0, {self.vocab_size}).")
    object.__setattr__(self, "param_dtype", _dtype_name(self.param_dtype, "param_dtype"))
    object.__setattr__(self, "compute_dtype", _dtype_name(self.compute_dtype, "compute_dtype"))

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

    Every field read is checked (type, range) and named in the error. Resolution
    rules, matching what `transformers` builds from the same file:

    - Rope: the transformers>=5 layout (`rope_parameters`) and the older one
      (`rope_theta` + `rope_scaling`) are both read; when a file holds both
      (as `to_hf_config` writes, for 4.x readers) they must agree, else a
      ValueError names the disagreeing fields (transformers itself prefers one
      or the other depending on whether `rope_scaling` is set).
    - `dtype` and its legacy name `torch_dtype` must agree when both are set.
    - `num_key_value_heads`: null means as many as the query heads; absent,
      the model type's transformers default (32 for qwen2 / qwen3, the query
      heads for llama).
    - `head_dim`: absent or null means `hidden_size / num_attention_heads`
      (which must divide) for qwen2 / llama, 128 for qwen3 (Qwen3Config's
      default); an explicit value may differ from the ratio (Qwen3 and Llama
      decouple it).
    - Absent `rms_norm_eps`, `rope_theta`, `tie_word_embeddings`,
      `max_position_embeddings`, `attention_bias`: transformers' default of the
      model type. Every absent field that changes the computation is named in
      one warning.
    - Required (an absent one is an error): `model_type`, `vocab_size`,
      `hidden_size`, `intermediate_size`, `num_hidden_layers`,
      `num_attention_heads` (transformers' defaults describe a 7B model).

    Args:
      hf: the parsed config.json.
      param_dtype: parameter dtype; default: the checkpoint's `dtype` /
        `torch_dtype`, else float32.
      compute_dtype: activation dtype; default: `param_dtype`.

    Returns:
      The `ModelConfig`.

    Raises:
      ValueError: naming the unsupported architecture, the unsupported, missing,
        mistyped, out-of-range or contradicting field(s).
    """
    model_type = _check_architecture(hf)

    defaults = _HF_DEFAULTS[model_type]
    defaulted: dict[str, Any] = {}

    def field(
      name: str, check, expected: str, *, required: bool = False, nullable: bool = False
    ) -> Any:
      if name not in hf:
        if required:
          raise ValueError(f"config.json lacks the required field {name!r} ({model_type}).")
        defaulted[name] = defaults[name]
        return defaults[name]
      value = hf[name]
      if value is None and nullable:
        return None
      if not check(value):
        raise ValueError(f"config.json field {name} must be {expected}, got {value!r}.")
      return value

    positive_int = lambda v: _is_int(v) and v > 0  # noqa: E731
    sizes = {
      name: field(name, positive_int, "a positive int", required=True)
      for name in (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
      )
    }
    num_heads = sizes["num_attention_heads"]
    num_kv_heads = field(
      "num_key_value_heads", positive_int, "a positive int or null", nullable=True
    )
    if num_kv_heads is None:
      num_kv_heads = num_heads
    head_dim = field("head_dim", positive_int, "a positive int or null", nullable=True)
    if head_dim is None:
      if sizes["hidden_size"] % num_heads:
        raise ValueError(
          f"config.json has no head_dim and hidden_size={sizes['hidden_size']} is not a "
          f"multiple of num_attention_heads={num_heads}; set head_dim."
        )
      head_dim = sizes["hidden_size"] // num_heads
    rms_norm_eps = field(
      "rms_norm_eps", lambda v: _is_real(v) and math.isfinite(v) and v > 0, "a finite number > 0"
    )
    tie = field("tie_word_embeddings", lambda v: isinstance(v, bool), "true or false")
    max_positions = field("max_position_embeddings", positive_int, "a positive int")
    if model_type == "qwen2":
      attention_bias, attention_out_bias = True, False
    else:
      attention_bias = attention_out_bias = field(
        "attention_bias", lambda v: isinstance(v, bool), "true or false"
      )

    _check_layer_types(hf, sizes["num_hidden_layers"])

    rope_theta, rope_scaling = _parse_rope(hf, model_type, defaulted)

    dtype = _checkpoint_dtype(hf)  # checked even when overridden
    if param_dtype is not None:
      dtype = param_dtype
    # head_dim = hidden_size / num_attention_heads is a derivation (checked above), not a guess.
    warn = {k: v for k, v in defaulted.items() if not (k == "head_dim" and v is None)}
    if warn.get("num_key_value_heads", 0) is None:
      warn["num_key_value_heads"] = f"num_attention_heads = {num_heads}"
    if warn:
      warnings.warn(
        f"config.json ({model_type}) lacks "
        + ", ".join(f"{k} (using {v})" for k, v in warn.items())
        + f": transformers' {_ARCHITECTURES[model_type].replace('ForCausalLM', 'Config')} "
        "defaults.",
        stacklevel=2,
      )
    try:
      return cls(
        family=model_type,
        vocab_size=sizes["vocab_size"],
        hidden_size=sizes["hidden_size"],
        num_layers=sizes["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        intermediate_size=sizes["intermediate_size"],
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        rms_norm_eps=rms_norm_eps,
        attention_bias=attention_bias,
        attention_out_bias=attention_out_bias,
        qk_norm=model_type == "qwen3",
        tie_embeddings=tie,
        max_position_embeddings=max_positions,
        bos_token_id=hf.get("bos_token_id"),
        eos_token_id=hf.get("eos_token_id"),
        pad_token_id=hf.get("pad_token_id"),
        param_dtype=dtype,
        compute_dtype=compute_dtype if compute_dtype is not None else dtype,
      )
    except ValueError as e:
      note = f" (absent, so transformers' defaults: {defaulted})" if defaulted else ""
      raise ValueError(f"config.json ({model_type}) gives an invalid config{note}: {e}") from e

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


def _check_architecture(hf: Any) -> str:
  """The `model_type` of a config.json dict, after rejecting what rlx.policy does not build.

  Raises ValueError for a non-dict, an unsupported model type or architecture, and any
  field whose value asks for computation rlx does not implement (sliding window, MLP
  bias, partial rotary, quantization, dropout, M-RoPE, a non-SiLU activation).
  """
  if not isinstance(hf, Mapping):
    raise ValueError(f"The HF config must be a dict (parsed config.json), got {type(hf).__name__}.")
  model_type = hf.get("model_type")
  if model_type not in FAMILIES:
    raise ValueError(
      f"Unsupported model_type {model_type!r} (architectures={hf.get('architectures')}); "
      f"rlx.policy supports {FAMILIES} ({', '.join(_ARCHITECTURES.values())})."
    )
  architectures = hf.get("architectures") or [_ARCHITECTURES[model_type]]
  if isinstance(architectures, str) or not isinstance(architectures, (list, tuple)):
    raise ValueError(f"config.json field architectures must be a list, got {architectures!r}.")
  bad = [a for a in architectures if a != _ARCHITECTURES[model_type]]
  if bad:
    raise ValueError(
      f"Unsupported architecture(s) {bad} for model_type {model_type!r}; "
      f"expected {_ARCHITECTURES[model_type]!r}."
    )

  def reject(field: str, ok: tuple[Any, ...]) -> None:
    # Type-exact comparison: 0 must not pass for False, nor 1 for True.
    value = hf.get(field)
    if field in hf and not any(type(value) is type(v) and value == v for v in ok):
      raise ValueError(
        f"Unsupported config.json field {field}={hf[field]!r} for {model_type}; "
        f"supported values: {list(ok)}."
      )

  reject("hidden_act", ("silu", "swish"))
  reject("use_sliding_window", (False, None))
  reject("mlp_bias", (False, None))
  reject("partial_rotary_factor", (1.0, 1, None))
  reject("quantization_config", (None,))
  reject("attention_dropout", (0.0, 0, None))  # rlx has no dropout
  reject("use_mrope", (False, None))
  if model_type == "qwen2":
    # transformers' Qwen2Attention always has q/k/v biases and ignores this field.
    reject("attention_bias", (True, None))
  return model_type


def _check_layer_types(hf: Mapping[str, Any], num_layers: int) -> None:
  """`layer_types`, when present, must list `num_layers` full-attention layers."""
  layer_types = hf.get("layer_types")
  if layer_types is not None:
    if not isinstance(layer_types, (list, tuple)):
      raise ValueError(f"config.json field layer_types must be a list, got {layer_types!r}.")
    bad_layers = sorted({str(t) for t in layer_types if t != "full_attention"})
    if bad_layers:
      raise ValueError(
        f"Unsupported config.json field layer_types containing {bad_layers}; "
        "only 'full_attention' layers are supported."
      )
    if len(layer_types) != num_layers:
      raise ValueError(
        f"config.json field layer_types has {len(layer_types)} entries but "
        f"num_hidden_layers={num_layers}."
      )


def _checkpoint_dtype(hf: Mapping[str, Any]) -> str:
  """The checkpoint dtype from `dtype` / legacy `torch_dtype` (must agree), else float32."""
  values = {k: hf[k] for k in ("dtype", "torch_dtype") if hf.get(k) is not None}
  names = {}
  for key, value in values.items():
    try:
      names[key] = _dtype_name(value, key)
    except ValueError as e:
      raise ValueError(f"config.json field {key}={value!r}: {e}") from e
  if len(set(names.values())) > 1:
    raise ValueError(
      f"config.json fields dtype={values['dtype']!r} and torch_dtype={values['torch_dtype']!r} "
      "disagree; keep one."
    )
  return next(iter(names.values()), "float32")


def _rope_dict(value: Any, name: str) -> dict[str, Any]:
  """A rope parameter dict with `type` folded into `rope_type`; checks its keys."""
  if not isinstance(value, Mapping):
    raise ValueError(f"config.json field {name} must be a dict, got {value!r}.")
  params = dict(value)
  if "full_attention" in params and isinstance(params["full_attention"], Mapping):
    # transformers 5 layout keyed by layer type; only full attention is supported.
    if set(params) != {"full_attention"}:
      raise ValueError(f"Unsupported {name} for layer types {sorted(params)}.")
    params = dict(params["full_attention"])
  if "type" in params:
    legacy = params.pop("type")
    if params.setdefault("rope_type", legacy) != legacy:
      raise ValueError(
        f"config.json field {name} has type={legacy!r} and rope_type={params['rope_type']!r}."
      )
  unknown = sorted(set(params) - set(_ROPE_KEYS) - set(_LLAMA3_KEYS))
  if unknown:
    raise ValueError(f"Unsupported keys {unknown} in config.json field {name}.")
  return params


def _parse_rope(
  hf: Mapping[str, Any], model_type: str, defaulted: dict[str, Any]
) -> tuple[float, RopeScaling | None]:
  """Returns (rope_theta, rope_scaling) from either HF layout, checking they agree.

  Adds `rope_theta` to `defaulted` when no layout sets it.
  """
  params = {}
  if hf.get("rope_parameters") is not None:
    params = _rope_dict(hf["rope_parameters"], "rope_parameters")
  legacy = {}
  if hf.get("rope_scaling") is not None:
    legacy = _rope_dict(hf["rope_scaling"], "rope_scaling")
  if hf.get("rope_theta") is not None:
    if "rope_theta" in legacy and legacy["rope_theta"] != hf["rope_theta"]:
      raise ValueError(
        f"config.json fields rope_theta={hf['rope_theta']!r} and "
        f"rope_scaling.rope_theta={legacy['rope_theta']!r} disagree."
      )
    legacy["rope_theta"] = hf["rope_theta"]
  if params and (legacy or "rope_scaling" in hf):
    # Both layouts: every value the legacy one states must match rope_parameters, and
    # an explicit `rope_scaling: null` means no scaling.
    if "rope_scaling" in hf and hf["rope_scaling"] is None:
      legacy.setdefault("rope_type", "default")
    for key, value in legacy.items():
      have = params.get(key, "default" if key == "rope_type" else None)
      if have != value:
        from_top = key == "rope_theta" and hf.get("rope_theta") is not None
        source = "rope_theta" if from_top else f"rope_scaling.{key}"
        raise ValueError(
          f"config.json fields {source}={value!r} and rope_parameters.{key}={have!r} "
          "disagree; keep one rope layout (transformers resolves such a file differently "
          "depending on which fields are set)."
        )
  params = params or legacy
  if "rope_theta" not in params:
    params["rope_theta"] = defaulted["rope_theta"] = _HF_DEFAULTS[model_type]["rope_theta"]
  theta = params["rope_theta"]
  if not _is_real(theta) or not math.isfinite(theta) or theta <= 0:
    raise ValueError(f"config.json rope_theta={theta!r} must be a finite number > 0.")
  factor = params.get("partial_rotary_factor", 1.0)
  if factor != 1.0 or isinstance(factor, bool):
    raise ValueError(f"Unsupported rope partial_rotary_factor={factor!r} for {model_type}.")
  rope_type = params.get("rope_type", "default")
  if rope_type in ("default", None):
    extra = sorted(set(params) & set(_LLAMA3_KEYS))
    if extra:
      raise ValueError(f"Rope type 'default' takes no scaling, but the config sets {extra}.")
    return float(theta), None
  if rope_type != "llama3":
    raise ValueError(
      f"Unsupported rope_scaling type {rope_type!r} for {model_type}; "
      "supported: 'default' (none) and 'llama3'."
    )
  missing = [k for k in _LLAMA3_KEYS if k not in params]
  if missing:
    raise ValueError(f"llama3 rope_scaling is missing fields {missing}.")
  return float(theta), RopeScaling(**{k: params[k] for k in _LLAMA3_KEYS})
