r"""Compiles rlx programs for TPU slices on a CPU-only machine: fits, memory, roofline.

For each program x model x topology, the program is built through the public API
(`rlx.train.make_train_step`, `rlx.train.make_compute_logprobs`) on a mesh over
the compile-only devices of `jax.experimental.topologies.get_topology_desc`
(libtpu, `pip install -e ".[tpu]"`; no chips), traced with abstract sharded
params / state / batch (`jax.ShapeDtypeStruct`, no weights) and compiled by the
real TPU compiler (https://docs.jax.dev/en/latest/aot.html). Reported:

  status        "ok", or the compiler's error, shortened (e.g. out of HBM);
  compile s     wall time of lower + compile on this host;
  HBM GiB       per chip, from `Compiled.memory_analysis()`: arguments,
                outputs, temporaries, aliased (donated inputs reused as
                outputs), and in use = arguments + outputs - aliased +
                temporaries + code, against the chip's capacity;
  roofline ms   analytic lower bound on the step time of one chip,
                max(FLOPs / peak FLOP/s, bytes / HBM bandwidth), from the model
                dimensions (below) and the chip's published peaks;
  tokens/s      B * S / roofline time (every processed position, as
                experiments/bench_train_step.py counts them): an upper bound.

FLOPs (matmuls only; N = L * (D * Dh * (2 H + 2 Hkv) + 3 D I) + V * D, the
weights a token multiplies through, LM head included; attention counted over
the full S x S score matrix):
  forward per token   2 N + 4 L H Dh S
  train step          (3 + remat) x forward, per token of each PPO epoch
  compute_logprobs    1 x forward
Bytes per chip (HBM traffic lower bound; activations not counted): every pass
(forward, backward, recomputed forward) of a micro-batch streams the gathered
weights once (tensor = 1), each micro-batch reads and writes this chip's
gradient shard, and each optimizer update reads params, gradient and optimizer
state and writes params and optimizer state (this chip's shards). XLA's
`cost_analysis()` is not used: it counts a while-loop body (the layer and
micro-batch scans) once.

Batch, sequence and mesh follow experiments/configs/gsm8k_hf.py: B =
prompts_per_iteration x num_samples rows, S = --prompt_len +
task.gsm8k.max_answer_len, its train config (micro/mini-batches, PPO epochs,
loss), bf16 params, and mesh fsdp = min(mesh.fsdp, chips), data = the rest.

Rerun (prints the markdown table; `--out` also writes it):

  python experiments/compile_tpu.py \
    --topologies=v5e:2x2,v6e:2x4 --models=qwen2.5-0.5b \
    --out=experiments/results/compile_tpu.md

`--smoke` compiles one tiny model on v5e:2x2 (a few seconds).
"""

import os

# libtpu reads these when the first topology is built: no metadata-server look-ups, one
# local worker. JAX itself stays on the CPU (the TPU devices are compile-only).
os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v5litepod-4")
os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # compile-only: no chips to guard
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import dataclasses  # noqa: E402 (after the libtpu environment)
import importlib.util  # noqa: E402
import pathlib  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import ml_collections  # noqa: E402
import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from rlx import policy, rl, train  # noqa: E402

_CONFIG_PATH = pathlib.Path(__file__).resolve().parent / "configs" / "gsm8k_hf.py"

PROGRAMS = ("train_step", "compute_logprobs")
TOPOLOGIES = ("v5e:2x2", "v5e:2x4", "v6e:2x4", "v5p:2x2x1")

# config.json fields of the Hugging Face checkpoints (Qwen/Qwen2.5-*-Instruct, Qwen/Qwen3-8B,
# https://huggingface.co/Qwen); only the shapes matter here, no weights are read.
HF_CONFIGS = {
  "qwen2.5-0.5b": dict(
    architectures=["Qwen2ForCausalLM"], model_type="qwen2", vocab_size=151936,
    hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
    num_key_value_heads=2, max_position_embeddings=32768, rope_theta=1000000.0,
    rms_norm_eps=1e-6, tie_word_embeddings=True, hidden_act="silu", attention_dropout=0.0,
    use_sliding_window=False, bos_token_id=151643, eos_token_id=151645, torch_dtype="bfloat16",
  ),
  "qwen2.5-1.5b": dict(
    architectures=["Qwen2ForCausalLM"], model_type="qwen2", vocab_size=151936,
    hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
    num_key_value_heads=2, max_position_embeddings=32768, rope_theta=1000000.0,
    rms_norm_eps=1e-6, tie_word_embeddings=True, hidden_act="silu", attention_dropout=0.0,
    use_sliding_window=False, bos_token_id=151643, eos_token_id=151645, torch_dtype="bfloat16",
  ),
  "qwen2.5-7b": dict(
    architectures=["Qwen2ForCausalLM"], model_type="qwen2", vocab_size=152064,
    hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
    num_key_value_heads=4, max_position_embeddings=32768, rope_theta=1000000.0,
    rms_norm_eps=1e-6, tie_word_embeddings=False, hidden_act="silu", attention_dropout=0.0,
    use_sliding_window=False, bos_token_id=151643, eos_token_id=151645, torch_dtype="bfloat16",
  ),
  "qwen3-8b": dict(
    architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=151936,
    hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
    num_key_value_heads=8, head_dim=128, max_position_embeddings=40960, rope_theta=1000000.0,
    rms_norm_eps=1e-6, tie_word_embeddings=False, hidden_act="silu", attention_dropout=0.0,
    attention_bias=False, use_sliding_window=False, bos_token_id=151643, eos_token_id=151645,
    torch_dtype="bfloat16",
  ),
}  # fmt: skip


@dataclasses.dataclass(frozen=True)
class ChipSpec:
  """Published per-chip peaks of a TPU generation."""

  bf16_flops: float  # dense bf16 FLOP/s
  hbm_bytes: float  # HBM capacity (the published "GB" read as GiB)
  hbm_bandwidth: float  # bytes/s
  source: str


CHIPS = {
  "v5e": ChipSpec(197e12, 16 * 2**30, 819e9, "https://cloud.google.com/tpu/docs/v5e"),
  "v6e": ChipSpec(918e12, 32 * 2**30, 1638e9, "https://cloud.google.com/tpu/docs/v6e"),
  "v5p": ChipSpec(459e12, 95 * 2**30, 2765e9, "https://cloud.google.com/tpu/docs/v5p"),
}


@dataclasses.dataclass(frozen=True)
class Workload:
  """Batch and mesh sizes of one program: B rows of S tokens."""

  rows: int
  seq_len: int
  fsdp: int  # cap on the mesh's fsdp axis (the rest of the chips is data)
  tensor: int


@dataclasses.dataclass
class Row:
  """One program x model x topology result (see the module docstring for the columns)."""

  program: str
  model: str
  topology: str
  mesh: str
  status: str
  compile_s: float
  memory: dict[str, int]  # memory_analysis fields, per chip
  capacity: float
  flops: float  # per chip per step
  bytes: float  # per chip per step
  roofline_s: float
  tokens_per_s: float


def define_flags() -> None:
  """Defines the absl flags; called only when run as a script.

  Importing the module (as the tests do) thus adds no global flags that could clash
  with another experiment's.
  """
  flags.DEFINE_list("topologies", list(TOPOLOGIES), "TPU topologies (name:shape).")
  flags.DEFINE_list("models", list(HF_CONFIGS), f"Models, from {list(HF_CONFIGS)}.")
  flags.DEFINE_list("programs", list(PROGRAMS), f"Programs, from {list(PROGRAMS)}.")
  flags.DEFINE_integer(
    "prompt_len", 256, "Prompt tokens per row (the config leaves it to the data; assumed)."
  )
  flags.DEFINE_string("out", None, "Optional file to write the markdown table to.")
  flags.DEFINE_bool("smoke", False, "One tiny model on v5e:2x2 (a few seconds).")
  config_flags.DEFINE_config_file("config", str(_CONFIG_PATH), "The RL config.")


def default_config() -> ml_collections.ConfigDict:
  """experiments/configs/gsm8k_hf.py's `get_config()` (the `--config` default)."""
  spec = importlib.util.spec_from_file_location("gsm8k_hf", _CONFIG_PATH)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config()


def model_config(name: str, config: ml_collections.ConfigDict) -> policy.ModelConfig:
  """The `ModelConfig` of `HF_CONFIGS[name]` (or "tiny") in the config's dtypes."""
  dtypes = dict(param_dtype=config.model.param_dtype, compute_dtype=config.model.compute_dtype)
  if name == "tiny":
    return policy.ModelConfig.small("qwen2", **dtypes)
  if name not in HF_CONFIGS:
    raise ValueError(f"Unknown model {name!r}; choose from {list(HF_CONFIGS)} (or 'tiny').")
  mc = policy.ModelConfig.from_hf_config(HF_CONFIGS[name], **dtypes)
  return dataclasses.replace(mc, remat=bool(config.model.remat))


def workload(config: ml_collections.ConfigDict, prompt_len: int) -> Workload:
  """B, S and mesh caps of `config` (B = prompts x samples, S = prompt + answer tokens)."""
  return Workload(
    rows=int(config.rl.prompts_per_iteration) * int(config.rl.num_samples),
    seq_len=int(prompt_len) + int(config.task.gsm8k.max_answer_len),
    fsdp=int(config.mesh.fsdp),
    tensor=int(config.mesh.tensor),
  )


def make_topology_mesh(topology: str, load: Workload) -> jax.sharding.Mesh:
  """A `("data", "fsdp", "tensor")` mesh over the compile-only devices of `topology`."""
  from jax.experimental import topologies  # noqa: PLC0415 (needs libtpu)

  devices = topologies.get_topology_desc(topology_name=topology, platform="tpu").devices
  tensor = min(load.tensor, len(devices))
  fsdp = min(load.fsdp, len(devices) // tensor)
  return train.make_mesh(data=-1, fsdp=fsdp, tensor=tensor, devices=devices)


def chip_spec(topology: str) -> ChipSpec:
  generation = topology.split(":")[0]
  if generation not in CHIPS:
    raise ValueError(f"No published peaks for {generation!r}; known: {sorted(CHIPS)}.")
  return CHIPS[generation]


def _per_chip_bytes(tree: Any) -> int:
  return sum(
    int(np.prod(x.sharding.shard_shape(x.shape))) * jnp.dtype(x.dtype).itemsize
    for x in jax.tree.leaves(tree)
  )


def roofline(
  program: str, mc: policy.ModelConfig, cfg: ml_collections.ConfigDict, load: Workload, state
) -> tuple[float, float]:
  """(FLOPs, HBM bytes) of one chip for one call of `program` (see the module docstring)."""
  d, dh, heads, kv, layers = (
    mc.hidden_size, mc.head_dim, mc.num_heads, mc.num_kv_heads, mc.num_layers
  )  # fmt: skip
  matmul_params = layers * (d * dh * (2 * heads + 2 * kv) + 3 * d * mc.intermediate_size)
  matmul_params += mc.vocab_size * d
  forward = 2 * matmul_params + 4 * layers * heads * dh * load.seq_len  # FLOPs per token
  chips = state.step.sharding.mesh.size
  tokens = load.rows * load.seq_len
  params_full = sum(x.size * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(state.params))
  micro = int(cfg.micro_batches)
  if program == "compute_logprobs":
    return tokens * forward / chips, micro * params_full
  passes = 3 + int(mc.remat)
  epochs, updates = int(cfg.ppo_epochs), int(cfg.ppo_epochs) * int(cfg.mini_batches)
  params_shard, opt_shard = _per_chip_bytes(state.params), _per_chip_bytes(state.opt_state)
  per_update = micro * ((passes - 1) * params_full + 2 * params_shard)
  per_update += 3 * params_shard + 2 * opt_shard
  return epochs * tokens * passes * forward / chips, updates * per_update


def _abstract_batch(mesh, program: str, load: Workload) -> dict:
  sharding = NamedSharding(mesh, PartitionSpec(train.BATCH_AXES))
  b, s = load.rows, load.seq_len
  shapes = {"tokens": ((b, s), jnp.int32), "loss_mask": ((b, s), jnp.bool_)}
  if program == "train_step":
    shapes |= {"advantages": ((b,), jnp.float32), "old_logp": ((b, s), jnp.float32)}
    shapes |= {"rollout_logp": ((b, s), jnp.float32)}
  return {k: jax.ShapeDtypeStruct(sh, dt, sharding=sharding) for k, (sh, dt) in shapes.items()}


def _short_error(error: Exception, limit: int = 160) -> str:
  lines = [line.strip() for line in str(error).splitlines() if line.strip()]
  text = next((line for line in lines if "RESOURCE_EXHAUSTED" in line or "memory" in line), "")
  text = text or (lines[0] if lines else type(error).__name__)
  return (type(error).__name__ + ": " + text)[:limit].replace("|", "/")


def compile_one(program: str, model: str, topology: str, config, load: Workload) -> Row:
  """Builds, traces and compiles `program` for `topology`; never raises on compiler errors."""
  mc = model_config(model, config)
  cfg = rl.train_config(config)  # what rlx.rl.run builds the train step from
  mesh = make_topology_mesh(topology, load)
  layout = "x".join(str(mesh.shape[a]) for a in train.MESH_AXES)
  chip = chip_spec(topology)
  state = train.abstract_train_state(mc, cfg, mesh)
  batch = _abstract_batch(mesh, program, load)
  if program == "train_step":
    jitted, args = train.make_train_step(mc, cfg, mesh).jitted, (state, batch)
  elif program == "compute_logprobs":
    jitted, args = train.make_compute_logprobs(mc, cfg, mesh).jitted, (state.params, batch)
  else:
    raise ValueError(f"Unknown program {program!r}; choose from {PROGRAMS}.")
  flops, nbytes = roofline(program, mc, cfg, load, state)
  seconds = max(flops / chip.bf16_flops, nbytes / chip.hbm_bandwidth)
  start = time.perf_counter()
  memory, status = {}, "ok"
  try:
    # Mosaic kernels outside a shard_map read the TPU generation from the default device.
    with jax.default_device(mesh.devices.flat[0]):
      compiled = jitted.trace(*args).lower().compile()
    stats = compiled.memory_analysis()
    memory = {
      k: int(getattr(stats, f"{k}_size_in_bytes"))
      for k in ("argument", "output", "temp", "alias", "generated_code")
    }
  except Exception as e:  # noqa: BLE001 (the compiler's error is the result)
    status = _short_error(e)
  return Row(
    program=program, model=model, topology=topology, mesh=layout, status=status,
    compile_s=time.perf_counter() - start, memory=memory, capacity=chip.hbm_bytes,
    flops=flops, bytes=nbytes, roofline_s=seconds, tokens_per_s=load.rows * load.seq_len / seconds,
  )  # fmt: skip


def in_use(memory: dict[str, int]) -> int:
  """Per-chip HBM a compiled program holds at its peak (donated inputs counted once)."""
  return (
    memory["argument"] + memory["output"] - memory["alias"] + memory["temp"]
    + memory["generated_code"]
  )  # fmt: skip


def run(
  programs, models, topologies, config: ml_collections.ConfigDict, load: Workload, log=print
) -> list[Row]:
  """Every program x model x topology, in that nesting order."""
  rows = []
  for model in models:
    for topology in topologies:
      for program in programs:
        row = compile_one(program, model, topology, config, load)
        log(f"{program} {model} {topology}: {row.status} ({row.compile_s:.1f} s)")
        rows.append(row)
  return rows


def smoke_setup(config: ml_collections.ConfigDict) -> tuple[ml_collections.ConfigDict, Workload]:
  """A tiny model's config and workload (8 rows of 64 tokens, one update) for v5e:2x2."""
  config = ml_collections.ConfigDict(config.to_dict())
  config.train.micro_batches = 1
  config.train.mini_batches = 1
  return config, Workload(rows=8, seq_len=64, fsdp=2, tensor=1)


def _num(x: float) -> str:
  """3 significant digits, without exponents for values >= 100 (e.g. 1,580)."""
  return f"{x:,.0f}" if abs(x) >= 100 else f"{x:.3g}"


def markdown(rows: list[Row], load: Workload, config, command: str) -> str:
  gib = 2.0**30
  lines = [
    "# rlx programs compiled for TPU slices (deviceless, real TPU compiler)",
    "",
    f"Batch B={load.rows} rows x S={load.seq_len} tokens, micro_batches "
    f"{config.train.micro_batches}, mini_batches {config.train.mini_batches}, ppo_epochs "
    f"{config.train.ppo_epochs}, loss {config.train.loss}, {config.model.param_dtype} params, "
    f"remat {config.model.remat}, jax {jax.__version__}. HBM in GiB per chip; roofline and "
    "tokens/s are analytic bounds from the chip's published peaks, not measurements.",
    "",
    "| program | model | topology | mesh d x f x t | status | compile s | args | outputs "
    "| temps | aliased | in use / capacity | TFLOP/chip | GB/chip | roofline ms | bound "
    "| tokens/s |",
    "|---|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|",
  ]
  for r in rows:
    m = r.memory
    mem = ["-"] * 5
    if m:
      mem = [_num(m[k] / gib) for k in ("argument", "output", "temp", "alias")]
      use = in_use(m)
      over = "" if use <= r.capacity else " (over)"
      mem.append(f"{_num(use / gib)} / {r.capacity / gib:.0f}{over}")
    chip = chip_spec(r.topology)
    bound = "FLOPs" if r.flops / chip.bf16_flops >= r.bytes / chip.hbm_bandwidth else "HBM"
    cells = [r.program, r.model, r.topology, r.mesh, r.status, f"{r.compile_s:.1f}", *mem]
    cells += [_num(r.flops / 1e12), _num(r.bytes / 1e9), _num(1e3 * r.roofline_s), bound]
    cells.append(f"{r.tokens_per_s:,.0f}")
    lines.append("| " + " | ".join(cells) + " |")
  lines += ["", "Chip peaks (per chip, bf16 dense):", ""]
  lines += [
    f"- {name}: {c.bf16_flops / 1e12:.0f} TFLOP/s, {c.hbm_bandwidth / 1e9:.0f} GB/s HBM, "
    f"{c.hbm_bytes / gib:.0f} GiB ({c.source})"
    for name, c in CHIPS.items()
  ]
  lines += ["", f"Rerun: `{command}`", ""]
  return "\n".join(lines)


def main(argv):
  del argv
  f = flags.FLAGS
  config = f.config
  load = workload(config, f.prompt_len)
  programs, models, topologies = f.programs, f.models, f.topologies
  if f.smoke:
    config, load = smoke_setup(config)
    models, topologies = ["tiny"], ["v5e:2x2"]
  for name, values, known in (
    ("--programs", programs, PROGRAMS),
    ("--models", models, (*HF_CONFIGS, "tiny")),
    ("--topologies", [t.split(":")[0] for t in topologies], tuple(CHIPS)),
  ):
    bad = sorted(set(values) - set(known))
    if bad:
      raise app.UsageError(f"{name}: unknown {bad}; choose from {list(known)}.")
  rows = run(programs, models, topologies, config, load, log=lambda s: print(s, file=sys.stderr))
  command = "python " + " ".join(["experiments/compile_tpu.py"] + sys.argv[1:])
  table = markdown(rows, load, config, command)
  print(table)
  if f.out:
    pathlib.Path(f.out).write_text(table)


if __name__ == "__main__":
  define_flags()
  app.run(main)
