"""Hugging Face checkpoint directories <-> (ModelConfig, params).

A checkpoint directory holds `config.json` and either one `model.safetensors`
or shards `model-0000k-of-0000n.safetensors` listed in
`model.safetensors.index.json`. HF linear weights are `[out, in]`; rlx kernels
are `[in, out]` and per-layer tensors are stacked on a leading `[L]` axis.
Conversion is a transpose and a stack, so a load/save round trip is bitwise
lossless in the checkpoint's dtype. File layout: the safetensors format
(https://github.com/huggingface/safetensors) and transformers' sharded
checkpoints (`save_pretrained(max_shard_size=...)`, whose index maps each tensor
name to its shard in `weight_map`). Every unreadable or inconsistent file is an
error naming that file.
"""

import dataclasses
import json
import os
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from rlx.policy._config import ModelConfig, check_model_config
from rlx.policy._model import Params, check_params, param_shapes

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
DEFAULT_MAX_SHARD_BYTES = 5 * 2**30

# HF names that carry no parameters of ours and are skipped when present.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def _linear_names(
  module: str, hf_module: str, projections: tuple[str, ...], *, bias: bool
) -> tuple[tuple[tuple[str, ...], str, bool], ...]:
  """`_LAYER_NAMES` rows of a module's linear projections: each kernel, then its bias if `bias`.

  rlx `module/proj/kernel` is HF `hf_module.proj.weight`, `module/proj/bias` is
  `hf_module.proj.bias`.
  """
  rows = []
  for proj in projections:
    rows.append(((module, proj, "kernel"), f"{hf_module}.{proj}.weight", True))
    if bias:
      rows.append(((module, proj, "bias"), f"{hf_module}.{proj}.bias", False))
  return tuple(rows)


# (rlx path inside one layer, HF suffix after "model.layers.{i}.", is a linear kernel)
_LAYER_NAMES: tuple[tuple[tuple[str, ...], str, bool], ...] = (
  (("input_norm", "scale"), "input_layernorm.weight", False),
  (("post_attn_norm", "scale"), "post_attention_layernorm.weight", False),
  *_linear_names("attn", "self_attn", ("q_proj", "k_proj", "v_proj", "o_proj"), bias=True),
  (("attn", "q_norm", "scale"), "self_attn.q_norm.weight", False),
  (("attn", "k_norm", "scale"), "self_attn.k_norm.weight", False),
  *_linear_names("mlp", "mlp", ("gate_proj", "up_proj", "down_proj"), bias=False),
)


def _get(tree: Params, path: tuple[str, ...]) -> Any:
  for key in path:
    if not isinstance(tree, dict) or key not in tree:
      return None
    tree = tree[key]
  return tree


def _set(tree: Params, path: tuple[str, ...], value: Any) -> None:
  for key in path[:-1]:
    tree = tree.setdefault(key, {})
  tree[path[-1]] = value


def hf_tensor_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
  """The HF tensor names and `[out, in]` shapes a checkpoint of `config` must contain."""
  check_model_config(config)
  shapes = param_shapes(config)
  out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": shapes["embed"]["embedding"]}
  for i in range(config.num_layers):
    for path, hf_name, is_kernel in _LAYER_NAMES:
      shape = _get(shapes["layers"], path)
      if shape is None:
        continue
      shape = shape[1:]
      out[f"model.layers.{i}.{hf_name}"] = shape[::-1] if is_kernel else shape
  out["model.norm.weight"] = shapes["final_norm"]["scale"]
  if not config.tie_embeddings:
    out["lm_head.weight"] = shapes["lm_head"]["kernel"][::-1]
  return out


def _check_path(path: Any, name: str = "path") -> str:
  """`os.fspath(path)` for a str / os.PathLike, else a ValueError naming `name`."""
  if not isinstance(path, str | os.PathLike) or isinstance(path, bytes):
    raise ValueError(f"`{name}` must be a str or os.PathLike directory, got {path!r}.")
  return os.fspath(path)


def _read_json(file: str) -> Any:
  """Parsed JSON of `file`; a ValueError naming the file when it is not valid JSON."""
  try:
    with open(file) as f:
      return json.load(f)
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise ValueError(f"{file} is not valid JSON: {e}") from e


def _tensor_files(path: str) -> tuple[list[str], dict[str, str] | None]:
  """The safetensors files of a checkpoint, and the index's weight map (None without index)."""
  index = os.path.join(path, INDEX_FILE)
  if os.path.exists(index):
    content = _read_json(index)
    weight_map = content.get("weight_map") if isinstance(content, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
      raise ValueError(
        f"{index} has no `weight_map` (a non-empty dict tensor name -> shard file), got "
        f"{weight_map!r}" + ("." if isinstance(content, dict) else f" in {type(content).__name__}.")
      )
    bad = sorted(
      {
        repr(f)
        for f in weight_map.values()
        if not isinstance(f, str) or os.path.basename(f) != f or f in ("", ".", "..")
      }
    )
    if bad:
      raise ValueError(f"{index} maps tensors to invalid shard file names {bad}.")
    files = sorted(set(weight_map.values()))
    missing = [f for f in files if not os.path.exists(os.path.join(path, f))]
    if missing:
      raise ValueError(f"{index} lists shard files that do not exist: {missing}.")
    return [os.path.join(path, f) for f in files], weight_map
  single = os.path.join(path, SINGLE_FILE)
  if os.path.exists(single):
    return [single], None
  files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
  if not files:
    raise ValueError(f"No *.safetensors files in checkpoint directory {path}.")
  return [os.path.join(path, f) for f in files], None


def _read_tensors(
  files: list[str], weight_map: dict[str, str] | None
) -> Iterator[tuple[str, np.ndarray]]:
  """(name, array) of every tensor; errors name the file (truncated, duplicated, unlisted)."""
  seen: dict[str, str] = {}
  for file in files:
    try:
      with safe_open(file, framework="numpy") as f:
        names = list(f.keys())
        arrays = ((name, f.get_tensor(name)) for name in names)
        for name, array in arrays:
          if name in seen:
            raise ValueError(f"tensor {name} is stored twice, in {seen[name]} and in {file}.")
          seen[name] = file
          if weight_map is not None and weight_map.get(name) != os.path.basename(file):
            listed = weight_map.get(name)
            where = f"in {listed}" if listed else "nowhere"
            raise ValueError(f"{file} holds tensor {name}, which {INDEX_FILE} places {where}.")
          yield name, array
    except ValueError:
      raise
    except Exception as e:  # safetensors raises its own error types (truncated header/data)
      raise ValueError(
        f"Cannot read safetensors file {file} (truncated or corrupt?): {type(e).__name__}: {e}"
      ) from e
  if weight_map is not None:
    absent = sorted(n for n in weight_map if n not in seen)
    if absent:
      raise ValueError(
        f"{INDEX_FILE} lists tensors that their shard files do not hold: "
        + ", ".join(f"{n} ({weight_map[n]})" for n in absent[:10])
        + (f" and {len(absent) - 10} more" if len(absent) > 10 else "")
        + "."
      )


def load_hf_checkpoint(
  path: str | os.PathLike,
  *,
  dtype: Any = None,
  compute_dtype: Any = None,
  remat: bool = False,
  shardings: Any = None,
) -> tuple[ModelConfig, Params]:
  """Loads a Qwen2 / Qwen3 / Llama HF checkpoint directory.

  Args:
    path: directory with config.json and model.safetensors (or shards + index).
    dtype: parameter dtype to convert to; default: the checkpoint's dtype
      (config.json `dtype` / `torch_dtype`, float32 when absent).
    compute_dtype: activation dtype; default: the parameter dtype.
    remat: the config's `remat` (rematerialise each decoder block in the
      backward pass; not an HF field).
    shardings: optional pytree of `jax.sharding.Sharding` with the params'
      structure (e.g. from `partition_rules`); each array is placed directly.

  Returns:
    (config, params) with params as described in `rlx.policy` (stacked layers).

  Raises:
    ValueError: unsupported architecture/field (naming config.json), an
      unreadable file (invalid JSON, an index without `weight_map`, a truncated
      or corrupt safetensors file, a tensor stored twice or not where the index
      says: each naming the file), or missing / unexpected / mis-shaped
      tensors (all of them named in one message).
  """
  path = _check_path(path)
  if not os.path.isdir(path):
    what = "is not a directory" if os.path.exists(path) else "does not exist"
    raise ValueError(f"`path` {path} {what}; expected a checkpoint directory with config.json.")
  config_file = os.path.join(path, "config.json")
  if not os.path.exists(config_file):
    raise ValueError(f"No config.json in checkpoint directory {path}.")
  hf_config = _read_json(config_file)
  try:
    config = ModelConfig.from_hf_config(hf_config, param_dtype=dtype, compute_dtype=compute_dtype)
  except ValueError as e:
    raise ValueError(f"{config_file}: {e}") from e
  if not isinstance(remat, bool):
    raise ValueError(f"`remat` must be a bool, got {remat!r}.")
  config = dataclasses.replace(config, remat=remat)
  np_dtype = np.dtype(getattr(ml_dtypes, config.param_dtype, config.param_dtype))

  want = hf_tensor_shapes(config)
  tensors: dict[str, np.ndarray] = {}
  unexpected: list[str] = []
  extra_head = None
  for name, array in _read_tensors(*_tensor_files(path)):
    if name.endswith(_IGNORED_SUFFIXES):
      continue
    if not jnp.issubdtype(array.dtype, jnp.floating):
      unexpected.append(f"{name} with non-float dtype {array.dtype}")
      continue
    if name == "lm_head.weight" and config.tie_embeddings:
      extra_head = array  # some writers store the tied head too; must equal the embedding
      continue
    if name not in want:
      unexpected.append(f"{name} {tuple(array.shape)}")
      continue
    tensors[name] = array
  missing = [f"{n} {want[n]}" for n in want if n not in tensors]
  misshaped = [
    f"{n} has shape {tuple(a.shape)}, expected {want[n]}"
    for n, a in tensors.items()
    if tuple(a.shape) != want[n]
  ]
  embedding = tensors.get("model.embed_tokens.weight")
  if extra_head is not None and embedding is not None and not np.array_equal(extra_head, embedding):
    unexpected.append("lm_head.weight (differs from the tied embedding)")
  problems = []
  if missing:
    hint = ""
    if "lm_head.weight" in want and "lm_head.weight" not in tensors:
      hint = " (config.json has tie_word_embeddings=false, so the LM head is its own tensor)"
    problems.append("missing tensors: " + ", ".join(missing) + hint)
  if unexpected:
    problems.append("unexpected tensors: " + ", ".join(unexpected))
  if misshaped:
    problems.append("mis-shaped tensors: " + "; ".join(misshaped))
  if problems:
    raise ValueError(f"Checkpoint {path} does not match its config.json: " + ". ".join(problems))

  def convert(a: np.ndarray) -> np.ndarray:
    return a.astype(np_dtype) if a.dtype != np_dtype else a

  params: Params = {
    "embed": {"embedding": convert(tensors["model.embed_tokens.weight"])},
    "final_norm": {"scale": convert(tensors["model.norm.weight"])},
  }
  if not config.tie_embeddings:
    params["lm_head"] = {"kernel": np.ascontiguousarray(convert(tensors["lm_head.weight"]).T)}
  layers: Params = {}
  for layer_path, hf_name, is_kernel in _LAYER_NAMES:
    first = f"model.layers.0.{hf_name}"
    if first not in want:
      continue
    per_layer = []
    for i in range(config.num_layers):
      a = convert(tensors.pop(f"model.layers.{i}.{hf_name}"))
      per_layer.append(a.T if is_kernel else a)
    _set(layers, layer_path, np.stack(per_layer))
  params["layers"] = layers

  if shardings is None:
    params = jax.tree_util.tree_map(jnp.asarray, params)
  else:
    params = jax.tree_util.tree_map(jax.device_put, params, shardings)
  return config, params


def _hf_tensors(config: ModelConfig, params: Params) -> dict[str, np.ndarray]:
  """HF name -> [out, in] numpy array, in each parameter's own dtype."""
  host = jax.tree_util.tree_map(np.asarray, jax.device_get(params))
  out = {"model.embed_tokens.weight": host["embed"]["embedding"]}
  for i in range(config.num_layers):
    for path, hf_name, is_kernel in _LAYER_NAMES:
      stacked = _get(host["layers"], path)
      if stacked is None:
        continue
      a = stacked[i]
      out[f"model.layers.{i}.{hf_name}"] = a.T if is_kernel else a
  out["model.norm.weight"] = host["final_norm"]["scale"]
  if not config.tie_embeddings:
    out["lm_head.weight"] = host["lm_head"]["kernel"].T
  return {k: np.ascontiguousarray(v) for k, v in out.items()}


def save_hf_checkpoint(
  path: str | os.PathLike,
  config: ModelConfig,
  params: Params,
  *,
  max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> None:
  """Writes `config.json` + safetensors that `transformers` (and `load_hf_checkpoint`) load.

  Tensors are written in their own dtype (no conversion), so save -> load is
  bitwise lossless. Above `max_shard_bytes` the tensors are split into
  `model-0000k-of-0000n.safetensors` files with a `model.safetensors.index.json`.
  config.json's `dtype` is the embedding's dtype.

  Args:
    path: output directory (created if needed).
    config: the model config.
    params: parameters matching `config` (checked; mismatches are named).
    max_shard_bytes: largest shard size in bytes before splitting (>= 1).
  """
  check_model_config(config)
  check_params(params, config)
  if (
    isinstance(max_shard_bytes, bool)
    or not isinstance(max_shard_bytes, int | np.integer)
    or max_shard_bytes < 1
  ):
    raise ValueError(f"`max_shard_bytes` must be a positive int, got {max_shard_bytes!r}.")
  path = _check_path(path)
  if os.path.exists(path) and not os.path.isdir(path):
    raise ValueError(f"`path` {path} exists and is not a directory.")
  os.makedirs(path, exist_ok=True)
  tensors = _hf_tensors(config, params)
  hf_config = config.to_hf_config()
  dtype_name = tensors["model.embed_tokens.weight"].dtype.name
  hf_config["dtype"] = hf_config["torch_dtype"] = dtype_name
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(hf_config, f, indent=2, sort_keys=True)
    f.write("\n")

  shards: list[dict[str, np.ndarray]] = [{}]
  size = 0
  for name, array in tensors.items():
    if shards[-1] and size + array.nbytes > max_shard_bytes:
      shards.append({})
      size = 0
    shards[-1][name] = array
    size += array.nbytes
  metadata = {"format": "pt"}
  for stale in (INDEX_FILE, SINGLE_FILE):
    if os.path.exists(os.path.join(path, stale)):
      os.remove(os.path.join(path, stale))
  if len(shards) == 1:
    save_file(shards[0], os.path.join(path, SINGLE_FILE), metadata=metadata)
    return
  weight_map = {}
  for k, shard in enumerate(shards):
    file = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
    save_file(shard, os.path.join(path, file), metadata=metadata)
    weight_map.update({name: file for name in shard})
  total = sum(a.nbytes for a in tensors.values())
  with open(os.path.join(path, INDEX_FILE), "w") as f:
    json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    f.write("\n")
