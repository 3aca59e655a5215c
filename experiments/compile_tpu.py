r"""Compiles rlx programs for TPU slices on a CPU-only machine: fits, memory, roofline.

For each program x model x topology, the program is built through the public API
as `rlx.rl.run` builds it, on a mesh over the compile-only devices of
`jax.experimental.topologies.get_topology_desc` (libtpu, `pip install -e ".[tpu]"`;
no chips), traced with abstract sharded params / state / batch
(`jax.ShapeDtypeStruct`, no weights) and compiled by the real TPU compiler
(https://docs.jax.dev/en/latest/aot.html). Programs:

  train_step, compute_logprobs   `rlx.train.make_train_step` / `make_compute_logprobs`
                                 on `rl.train_config(config)`;
  score_norms                    `ComputeLogprobs.score_norms` (each row's
                                 score-gradient norm, VCPO's baseline,
                                 `rl.baseline = "vcpo"`) on the same config;
  prefill, decode                the sampler's two jitted programs of a `generate`
                                 call (`rl.make_sampler(rl.sampler_kwargs(...))`,
                                 `Sampler.trace_prefill` (the widest call) /
                                 `Sampler.trace_decode` (one window of
                                 steps_per_sync steps)), on the config's bf16 KV
                                 pages; `_fp8kv`: FP8 (e4m3) KV pages; `_fp8tok`: FP8
                                 KV pages with per-token scales (f32 scale pools
                                 beside the pages, `kv_scale_mode="per_token"`); `_fp8`: rlx's
                                 FP8 rollout, W8A8 decoder linears + FP8 KV, the
                                 params quantized and placed as `rl.Fp8Refresh` does;
  fp8_matmul <linears>           `kernels_pallas.fp8_blockwise_matmul` at each decoder
                                 linear's (K, N), M = the decode slots, per chip in a
                                 `shard_map` (rows over the batch axes);
  rl_step                        `rl.make_rl_step`: sampling (`Sampler.generate_fn`),
                                 JAX reward, advantages, log-probs and the train step
                                 in one program; every row needs a slot, so the
                                 sampler is sized by rlx's defaults (max_slots = rows,
                                 num_pages = rows x pages per sequence); `_fp8`: with
                                 rlx's FP8 rollout (W8A8 + FP8 KV; the params quantized
                                 inside the program, the KV scales an input).

The sampler and the fused step take the task's lengths and stop token from
`ShapesTask` (GSM8K's prompt / answer lengths, the checkpoint's EOS; a JAX
exact-match reward, since GSM8K's numeric check runs on the host). Reported:

  status        "ok", or the compiler's error, shortened; "out of memory: ..." where
                it does not fit, the settings `rlx.train.OutOfMemoryError` lists for
                it (remat, micro-batches, fsdp / tensor, pool size, ...) under the table;
  compile s     wall time of lower + compile on this host;
  HBM GiB       per chip, from `Compiled.memory_analysis()`: arguments,
                outputs, temporaries, aliased (donated inputs reused as
                outputs), and in use = arguments + outputs - aliased +
                temporaries + code, against the chip's capacity;
  donated       per-chip bytes of the state the program updates in place (train
                state; K/V page pools), logical, before the TPU layout's tile
                padding (aliased bytes include it);
  Mosaic        Pallas TPU (Mosaic) kernel calls in the lowered StableHLO;
  roofline ms   analytic lower bound on the time of one call on one chip,
                max(FLOPs / peak FLOP/s, bytes / HBM bandwidth), from the model
                dimensions (below) and the chip's published peaks (bf16 peak for
                the FP8 matmul too: its TPU kernel multiplies in bf16);
  tokens/s      tokens of one call / roofline time: B * S for the train
                programs (every processed position, as
                experiments/bench_train_step.py counts them), the slots for a
                decode step, B x W for a prefill call: an upper bound.

FLOPs (matmuls only; N = L * (D * Dh * (2 H + 2 Hkv) + 3 D I) + V * D, the
weights a token multiplies through, LM head included):
  forward per token   2 N + 4 L H Dh C, C = positions attended (S for training)
  train step          (3 + remat) x forward, per token of each PPO epoch
  compute_logprobs    1 x forward
  score_norms         3 x forward (one forward and backward per row, no update)
  decode step         slots per chip x forward at C = prompt + max_new / 2
  prefill call        B x W tokens per chip x forward at C = prompt / 2
  fp8 matmul          2 M K N per chip
  rl_step             every row's prefill and max_new decode steps, then
                      compute_logprobs and the train step
Bytes per chip (HBM traffic lower bound; activations not counted): every pass
(forward, backward, recomputed forward) of a micro-batch streams the gathered
weights once (tensor = 1), each micro-batch reads and writes this chip's
gradient shard, and each optimizer update reads params, gradient and optimizer
state and writes params and optimizer state (this chip's shards); score_norms
streams the gathered weights twice per micro-batch (forward and backward) and
writes no gradient. A decode step
or prefill call streams the weights once (FP8 linears: 1 byte per weight) plus
its slots' K/V: read over C positions (decode), written for the new tokens and
read over (prompt - W) / 2 cached positions (prefill). XLA's `cost_analysis()`
is not used: it counts a while-loop body (the layer, micro-batch and decode
loops) once.

Batch, sequence and mesh follow experiments/configs/gsm8k_hf.py: B =
prompts_per_iteration x num_samples rows, S = --prompt_len +
task.gsm8k.max_answer_len, its train config (micro/mini-batches, PPO epochs,
loss), its sampler (slots, pages, steps_per_sync), bf16 params, and mesh fsdp =
min(mesh.fsdp, chips), data = the rest.

Run (prints the markdown table; `--out` also writes it); with no flags, every program of
every model on every topology:

  python experiments/compile_tpu.py --topologies=v5e:2x4,v5p:2x2x1 --models=qwen2.5-0.5b

experiments/results/compile_tpu.md gathers several runs, each table under its command.

`--smoke` compiles one tiny model on v5e:2x2 (a few seconds per program).

`--rollout_chips=n` compiles each program for asynchronous RL's split of the slice
(`rl.async_rollout` with `mesh.rollout_devices = n`, as `rlx.rl.build_mesh` /
`build_rollout_mesh` split the devices): the sampler's programs on the last n chips
(data-parallel, params replicated per chip), the train programs on the others, so
both sides must fit at once; the topology column names the side and its chips. The
fused rl_step needs one mesh and is left out:

  python experiments/compile_tpu.py --rollout_chips=4 --topologies=v5e:2x4 \
    --models=qwen2.5-0.5b --programs=train_step,compute_logprobs,prefill,decode

`--search` reports instead the largest size of each program that fits a chip, found
by compiling (`search_largest`): the rows B of train_step, compute_logprobs,
score_norms and rl_step* (in multiples of mini x micro-batches x batch shards and of
the group size), the page pool (num_pages, in multiples of 256) of the sampler's programs:

  python experiments/compile_tpu.py --search --topologies=v5e:2x2,v5e:2x4 \
    --models=qwen2.5-0.5b --programs=train_step,prefill,decode

A shipped config compiles for the slice its docstring names with `--config`, e.g.
`--config=experiments/configs/gsm8k_7b_v5p.py --models=qwen2.5-7b
--topologies=v5p:2x2x1`.
"""

import os

# libtpu reads these when the first topology is built: no metadata-server look-ups, one
# local worker. JAX itself stays on the CPU (the TPU devices are compile-only).
os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v5litepod-4")
os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # compile-only: no chips to guard
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import contextlib  # noqa: E402 (after the libtpu environment)
import dataclasses  # noqa: E402
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

from rlx import kernels_pallas, policy, rl, sampling, tasks, train  # noqa: E402

_CONFIG_PATH = pathlib.Path(__file__).resolve().parent / "configs" / "gsm8k_hf.py"

PROGRAMS = (
  "train_step", "compute_logprobs", "score_norms", "prefill", "decode", "prefill_fp8kv",
  "decode_fp8kv", "prefill_fp8tok", "decode_fp8tok", "prefill_fp8", "decode_fp8", "fp8_matmul",
  "rl_step", "rl_step_fp8",
)  # fmt: skip
# Sampler programs' rollout dtypes (`config.rollout.weight_dtype`, `config.rollout.kv_dtype`,
# `config.rollout.kv_scale_mode`): the config's bf16 KV pages, FP8 KV pages (static or
# per-token scales), and rlx's FP8 rollout (W8A8 linears + FP8 KV).
ROLLOUT_DTYPES = {
  "": ("auto", None, "static"),
  "_fp8kv": ("auto", "fp8_e4m3", "static"),
  "_fp8tok": ("auto", "fp8_e4m3", "per_token"),
  "_fp8": ("fp8_e4m3", "fp8_e4m3", "static"),
}
_MOSAIC = "tpu_custom_call"  # the custom-call target of a Pallas Mosaic (TPU) kernel
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
  answer_len: int  # of the S tokens, the sampler's max_new_tokens (the rest: the prompt)


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
  donated: int = 0  # per-chip bytes of the donated inputs (logical, unpadded)
  mosaic: int = 0  # Mosaic kernel call sites in the lowered program (StableHLO)
  note: str = ""  # the shapes a row stands for (sampler and matmul programs)
  advice: tuple[str, ...] = ()  # rlx.train.OutOfMemoryError's advice, when it did not fit


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
  flags.DEFINE_bool(
    "search",
    False,
    "Instead of the table: the largest rows (train_step, compute_logprobs, score_norms, "
    "rl_step*) or "
    "page pool (prefill*, decode*) of each program that fits a chip, found by compiling.",
  )
  flags.DEFINE_integer("max_probes", 7, "--search: compiles per program x model x topology.")
  flags.DEFINE_integer(
    "rollout_chips",
    0,
    "Asynchronous RL's split: the sampler's programs on the last n chips of each topology, "
    "the train programs on the others (0: every program on the whole slice).",
  )
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
  if name == "tiny":  # 128-wide linears: whole FP8 blocks, as the Qwen shapes have
    return policy.ModelConfig.small(
      "qwen2", hidden_size=128, intermediate_size=256, num_heads=2, num_kv_heads=2, head_dim=64,
      **dtypes,
    )  # fmt: skip
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
    answer_len=int(config.task.gsm8k.max_answer_len),
  )


def topology_devices(topology: str) -> list:
  """The compile-only devices of `topology`."""
  from jax.experimental import topologies  # noqa: PLC0415 (needs libtpu)

  return list(topologies.get_topology_desc(topology_name=topology, platform="tpu").devices)


def make_topology_mesh(topology: str, load: Workload, devices=None) -> jax.sharding.Mesh:
  """A `("data", "fsdp", "tensor")` mesh over the compile-only devices of `topology`.

  `devices`: a subset of them to use instead of all.
  """
  devices = topology_devices(topology) if devices is None else devices
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
  if program == "score_norms":
    return 3 * tokens * forward / chips, 2 * micro * params_full
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


class ShapesTask(tasks.Task):
  """The prompt / answer lengths and stop tokens of a task, without its data.

  What `rlx.rl` builds the sampler (`rl.sampler_kwargs`) and the fused step from.
  Its reward is token exact match (`rlx.tasks.exact_match`, with `jax_reward`):
  GSM8K's numeric check runs on the host, and the fused program needs a JAX reward.
  """

  def __init__(self, max_prompt_len: int, max_answer_len: int, stop_token_ids: tuple[int, ...]):
    self.name = "gsm8k-shapes"
    self.tokenizer = None
    self.stop_token_ids = tuple(stop_token_ids)
    self.max_prompt_len = int(max_prompt_len)
    self.max_answer_len = int(max_answer_len)
    self.jax_reward = tasks.exact_match_jax_reward(self.stop_token_ids)

  def split(self, name: str) -> list:
    if name not in tasks.SPLITS:
      raise ValueError(f"Task {self.name!r}: `name` must be one of {tasks.SPLITS}, got {name!r}.")
    return []  # shapes only: no examples

  def score(self, examples, completions) -> np.ndarray:
    return np.asarray(
      [
        tasks.exact_match(e.answer, c, self.stop_token_ids)
        for e, c in zip(examples, completions, strict=True)
      ],
      np.float32,
    )


def shapes_task(model: str, load: Workload) -> ShapesTask:
  """Prompts of S - answer tokens, answers of `max_answer_len`, the checkpoint's EOS as stop."""
  eos = HF_CONFIGS[model]["eos_token_id"] if model in HF_CONFIGS else 1
  return ShapesTask(load.seq_len - load.answer_len, load.answer_len, (int(eos),))


def rollout_config(config: ml_collections.ConfigDict, program: str) -> ml_collections.ConfigDict:
  """`config` with the rollout dtypes of a sampler program (`ROLLOUT_DTYPES`)."""
  suffix = next(k for k in sorted(ROLLOUT_DTYPES, key=len, reverse=True) if program.endswith(k))
  weight, kv, mode = ROLLOUT_DTYPES[suffix]
  config = ml_collections.ConfigDict(config.to_dict())
  config.rollout.weight_dtype = weight
  config.rollout.kv_dtype = kv or config.rollout.kv_dtype
  config.rollout.kv_scale_mode = mode
  return config


def _with_sharding(tree: Any, shardings: Any) -> Any:
  return jax.tree.map(
    lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings
  )


def _fp8_weights(sampler: sampling.Sampler) -> bool:
  return sampler.config.weight_dtype not in (None, "auto")


def rollout_params(mc: policy.ModelConfig, sampler: sampling.Sampler, params: Any) -> Any:
  """The abstract params the sampler runs: FP8 linears placed as `rl.Fp8Refresh` puts them."""
  if not _fp8_weights(sampler):
    return params
  fp8 = jax.eval_shape(lambda p: sampling.quantize_params(p, sampler.config), params)
  return _with_sharding(fp8, policy.param_shardings(mc, sampler.mesh, fp8_linears=True))


def kv_scales(mc: policy.ModelConfig, sampler: sampling.Sampler) -> tuple | None:
  """Abstract f32[L, Hkv] K and V scales, replicated (static FP8 KV), as `rl.Fp8Refresh` has."""
  if jnp.dtype(sampler.config.page_dtype(mc.compute_dtype)).itemsize != 1:
    return None
  if sampler.config.kv_scale_mode == "per_token":  # the pool holds them
    return None
  replicated = NamedSharding(sampler.mesh, PartitionSpec())
  scale = jax.ShapeDtypeStruct((mc.num_layers, mc.num_kv_heads), jnp.float32, sharding=replicated)
  return scale, scale


def _decoder_linears(mc: policy.ModelConfig) -> dict[tuple[int, int], list[str]]:
  """(K, N) of every decoder linear, with the names sharing the shape."""
  d, q, kv, i = (
    mc.hidden_size,
    mc.num_heads * mc.head_dim,
    mc.num_kv_heads * mc.head_dim,
    (mc.intermediate_size),
  )
  shapes = {
    "q_proj": (d, q), "k_proj": (d, kv), "v_proj": (d, kv), "o_proj": (q, d),
    "gate_proj": (d, i), "up_proj": (d, i), "down_proj": (i, d),
  }  # fmt: skip
  out: dict[tuple[int, int], list[str]] = {}
  for name, shape in shapes.items():
    out.setdefault(shape, []).append(name)
  return out


def _forward_flops(mc: policy.ModelConfig, context: float) -> float:
  """Matmul FLOPs of one token attending `context` positions (module docstring's N)."""
  return 2 * _matmul_params(mc) + 4 * mc.num_layers * mc.num_heads * mc.head_dim * context


def _matmul_params(mc: policy.ModelConfig) -> int:
  d, dh, heads, kv, layers = (
    mc.hidden_size, mc.head_dim, mc.num_heads, mc.num_kv_heads, mc.num_layers
  )  # fmt: skip
  return layers * (d * dh * (2 * heads + 2 * kv) + 3 * d * mc.intermediate_size) + mc.vocab_size * d


def _weight_bytes(mc: policy.ModelConfig, fp8_linears: bool) -> float:
  """Bytes of the weights one token multiplies through (FP8 decoder linears: 1 byte each)."""
  head = mc.vocab_size * mc.hidden_size * jnp.dtype(mc.param_dtype).itemsize
  linears = _matmul_params(mc) - mc.vocab_size * mc.hidden_size
  return head + linears * (1 if fp8_linears else jnp.dtype(mc.param_dtype).itemsize)


def _kv_bytes_per_token(mc: policy.ModelConfig, page_dtype, per_token: bool = False) -> int:
  """K and V bytes of one cached token over the layers (+ its f32 scales when per-token)."""
  row = mc.head_dim * jnp.dtype(page_dtype).itemsize + (4 if per_token else 0)
  return mc.num_layers * 2 * mc.num_kv_heads * row


def sampler_roofline(
  kind: str, mc: policy.ModelConfig, sampler: sampling.Sampler, prompt_len: int
) -> tuple[float, float, float]:
  """(FLOPs, HBM bytes, tokens) of one chip for one decode step or the widest prefill call.

  decode: every slot attends prompt_len + max_new_tokens / 2 positions (the mean over a
  full-length sample); bytes = the weights (gathered: each chip streams all of them) +
  its slots' K/V of those positions. prefill: B x W tokens attending prompt_len / 2
  positions on average; bytes = the weights + the K/V written + the cached K/V read
  ((prompt_len - W) / 2 positions per row on average over a prompt's chunks).
  """
  cfg = sampler.config
  shards = train.batch_axis_size(sampler.mesh)
  fp8 = _fp8_weights(sampler)
  kv_token = _kv_bytes_per_token(
    mc, cfg.page_dtype(mc.compute_dtype), cfg.kv_scale_mode == "per_token"
  )
  weights = _weight_bytes(mc, fp8)
  if kind == "decode":
    rows, context = cfg.max_slots / shards, prompt_len + cfg.max_new_tokens / 2
    return rows * _forward_flops(mc, context), weights + rows * context * kv_token, cfg.max_slots
  rows, width = sampling.scheduling.prefill_rows(cfg.max_slots)[-1], cfg.prefill_chunk
  tokens = rows * width / shards
  reads = rows / shards * max(prompt_len - width, 0) / 2 * kv_token
  flops = tokens * _forward_flops(mc, prompt_len / 2)
  return flops, weights + tokens * kv_token + reads, rows * width


def _short_error(error: Exception, limit: int = 160) -> str:
  lines = [line.strip() for line in str(error).splitlines() if line.strip()]
  text = next((line for line in lines if "RESOURCE_EXHAUSTED" in line or "memory" in line), "")
  text = text or (lines[0] if lines else type(error).__name__)
  return (type(error).__name__ + ": " + text)[:limit].replace("|", "/")


@dataclasses.dataclass
class Program:
  """One program to compile: how to trace it and its analytic roofline inputs (per chip)."""

  trace: Any  # () -> jax.stages.Traced
  flops: float
  bytes: float
  tokens: float  # tokens one call processes (tokens/s = tokens / roofline time)
  donated: int = 0  # per-chip bytes of the state the program updates in place (donated)
  note: str = ""
  label: str = ""  # the row's program name, when one program has several rows
  advice: tuple[str, ...] = ()  # what rlx's out-of-memory error lists (`memory_advice`)


def _rl_config(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """The fused step's config: every row in a slot at once (sampler sizes 0: rlx's default)."""
  config = ml_collections.ConfigDict(config.to_dict())
  config.sampler.max_slots = 0
  config.sampler.num_pages = 0
  return config


def build_programs(
  program: str, model: str, config: ml_collections.ConfigDict, load: Workload, mesh
) -> list[Program]:
  """The traced program(s) of `program`, each built as `rlx.rl.run` builds it."""
  mc = model_config(model, config)
  cfg = rl.train_config(config)  # what rlx.rl.run builds the train step from
  state = train.abstract_train_state(mc, cfg, mesh)
  tokens = load.rows * load.seq_len
  if program in ("train_step", "compute_logprobs", "score_norms"):
    batch = _abstract_batch(mesh, program, load)
    flops, nbytes = roofline(program, mc, cfg, load, state)
    if program == "train_step":
      step = train.make_train_step(mc, cfg, mesh)
      donated = _per_chip_bytes(state)
      trace = lambda: step.jitted.trace(state, batch)  # noqa: E731
      advice = step.memory_advice(load.rows)
      return [Program(trace, flops, nbytes, tokens, donated, advice=advice)]
    logprobs = train.make_compute_logprobs(mc, cfg, mesh)
    if program == "score_norms":
      jitted, advice = logprobs.jitted_score_norms, logprobs.score_norms_memory_advice
    else:
      jitted, advice = logprobs.jitted, logprobs.memory_advice
    trace = lambda: jitted.trace(state.params, batch)  # noqa: E731
    return [Program(trace, flops, nbytes, tokens, advice=advice(load.rows))]
  task = shapes_task(model, load)
  if program.startswith("rl_step"):
    return [_rl_step_program(mc, rollout_config(config, program), load, mesh, task)]
  sampler_config = rollout_config(config, program)
  kwargs = rl.sampler_kwargs(sampler_config, task, rows=load.rows, greedy=False)
  sampler = rl.make_sampler(mc, kwargs, mesh)
  params, scales = rollout_params(mc, sampler, state.params), kv_scales(mc, sampler)
  c = sampler.config
  pool = f"{c.max_slots} slots, {c.num_pages} pages of {c.page_size}"
  pool += f", {c.page_dtype(mc.compute_dtype)}"
  if program == "fp8_matmul":
    return _fp8_matmul_programs(mc, sampler)
  prompt_len = task.max_prompt_len
  if program.startswith("decode"):
    flops, nbytes, n = sampler_roofline("decode", mc, sampler, prompt_len)
    note = f"{pool}; {c.steps_per_sync} steps per call, roofline per step"
    trace = lambda: sampler.trace_decode(params, kv_scales=scales)  # noqa: E731
    pool_bytes, advice = sampler.pool_bytes_per_chip(), sampler.memory_advice()
    return [Program(trace, flops, nbytes, n, pool_bytes, note, advice=advice)]
  flops, nbytes, n = sampler_roofline("prefill", mc, sampler, prompt_len)
  rows = sampling.scheduling.prefill_rows(c.max_slots)[-1]
  note = f"{pool}; widest call {rows} x {c.prefill_chunk} tokens"
  trace = lambda: sampler.trace_prefill(params, kv_scales=scales)  # noqa: E731
  pool_bytes, advice = sampler.pool_bytes_per_chip(), sampler.memory_advice()
  return [Program(trace, flops, nbytes, n, pool_bytes, note, advice=advice)]


def _fp8_matmul_programs(mc: policy.ModelConfig, sampler: sampling.Sampler) -> list[Program]:
  """`fp8_blockwise_matmul` at each decoder linear's (K, N), M = a decode step's slots.

  Called per chip in a `shard_map` (rows over the batch axes, FP8 weights and block
  scales replicated), as a Mosaic kernel must be on a mesh.
  """
  mesh, m = sampler.mesh, sampler.config.max_slots
  batch = PartitionSpec(train.BATCH_AXES)
  rows, rep = NamedSharding(mesh, batch), NamedSharding(mesh, PartitionSpec())
  f8, f32, block = jnp.float8_e4m3fn, jnp.float32, 128  # the kernel's 128 x 128 FP8 blocks
  shards = train.batch_axis_size(mesh)
  out = []
  for (k, n), names in _decoder_linears(mc).items():
    args = (
      jax.ShapeDtypeStruct((m, k), f8, sharding=rows),
      jax.ShapeDtypeStruct((m, -(-k // block)), f32, sharding=rows),
      jax.ShapeDtypeStruct((k, n), f8, sharding=rep),
      jax.ShapeDtypeStruct((-(-k // block), -(-n // block)), f32, sharding=rep),
    )
    fn = jax.jit(
      jax.shard_map(
        lambda x, xs, w, ws: kernels_pallas.fp8_blockwise_matmul(
          x, xs, w, ws, out_dtype=mc.compute_dtype
        ),
        mesh=mesh, in_specs=(batch, batch, PartitionSpec(), PartitionSpec()), out_specs=batch,
        check_vma=False,
      )
    )  # fmt: skip
    mc_rows = m / shards
    flops = 2 * mc_rows * k * n
    nbytes = mc_rows * k + k * n + 2 * mc_rows * n + 4 * (mc_rows * k / block + k * n / block**2)
    note = f"{'/'.join(names)}: [{m}, {k}] x [{k}, {n}], {mc_rows:.0f} rows per chip"
    label = "fp8_matmul " + "/".join(name.removesuffix("_proj") for name in names)
    trace = lambda fn=fn, args=args: fn.trace(*args)  # noqa: E731
    out.append(Program(trace, flops, nbytes, m, note=note, label=label))
  return out


def _rl_step_program(mc, config, load: Workload, mesh, task: ShapesTask) -> Program:
  """`rl.make_rl_step` (sample, JAX reward, advantages, log-probs, update) as one program."""
  config = _rl_config(config)
  learner = rl.Learner(config, task, mc, mesh)
  kwargs = rl.sampler_kwargs(config, task, rows=load.rows, greedy=False)
  sampler = rl.make_sampler(mc, kwargs, mesh)
  step = rl.make_rl_step(learner, sampler)
  cfg = learner.train_config
  state = train.abstract_train_state(mc, cfg, mesh)
  n, width = load.rows // learner.group_size, sampler.config.max_prompt_len
  answer_width = 32  # reference-answer tokens (any width: the reward compares them)
  args = (
    state, state.params, np.zeros((n, width), np.int32), np.full((n,), width, np.int32),
    np.zeros((n, answer_width), np.int32), np.ones((n,), np.int32), jax.random.key(0),
  )  # fmt: skip
  if step.fp8 is not None:  # FP8 rollout: this step's KV scales go in (None: bf16 KV)
    args = (*args, kv_scales(mc, sampler))
  # Sampling: every row prefills its prompt and decodes max_new_tokens steps, each
  # streaming the weights and its K/V; then compute_logprobs and the train step.
  c, chips, shards = sampler.config, mesh.size, train.batch_axis_size(mesh)
  p_len, m = task.max_prompt_len, c.max_new_tokens
  kv_token = _kv_bytes_per_token(mc, c.page_dtype(mc.compute_dtype), c.kv_scale_mode == "per_token")
  weights = _weight_bytes(mc, _fp8_weights(sampler))
  sample_flops = (
    load.rows
    / chips
    * (p_len * _forward_flops(mc, p_len / 2) + m * _forward_flops(mc, p_len + m / 2))
  )
  chunks = -(-(p_len - 1) // c.prefill_chunk)
  kv_traffic = load.rows / shards * kv_token * (p_len + m * (p_len + m / 2))  # writes + reads
  sample_bytes = (chunks + m) * weights + kv_traffic
  flops, nbytes = sample_flops, sample_bytes
  for part in ("compute_logprobs", "train_step"):
    f, b = roofline(part, mc, cfg, load, state)
    flops, nbytes = flops + f, nbytes + b
  note = (
    f"{load.rows} rows sampled in {c.max_slots} slots ({c.num_pages} pages of {c.page_size}, "
    f"{c.page_dtype(mc.compute_dtype)}), then compute_logprobs + train_step"
  )
  trace = lambda: step.jitted.trace(*args)  # noqa: E731
  donated, advice = _per_chip_bytes(state), step.memory_advice(n)
  return Program(trace, flops, nbytes, load.rows * load.seq_len, donated, note, advice=advice)


def compile_program(
  prog: Program, mesh, name: str, *, kernel: str = _MOSAIC, default_device: bool = True
) -> tuple[dict[str, int], int]:
  """Traces, lowers and compiles `prog`: (per-chip `memory_analysis` fields, kernel calls).

  `kernel` is the custom-call target counted in the lowered StableHLO (Mosaic's;
  compile_cuda.py passes Triton's); `default_device` lowers with the mesh's first
  device as JAX's default (Pallas' Mosaic lowering reads the TPU generation from it).

  Raises:
    rlx.train.OutOfMemoryError: it does not fit a chip (with `prog.advice`).
  """
  traced = prog.trace()  # on the host CPU: a closed-over key or constant is made there
  with jax.default_device(mesh.devices.flat[0]) if default_device else contextlib.nullcontext():
    lowered = traced.lower()
    kernels = lowered.as_text().count(f"@{kernel}")
    with train.explain_out_of_memory(name, prog.advice):
      compiled = lowered.compile()
  stats = compiled.memory_analysis()
  memory = {
    k: int(getattr(stats, f"{k}_size_in_bytes"))
    for k in ("argument", "output", "temp", "alias", "generated_code")
  }
  return memory, kernels


def compile_on_mesh(
  program: str, model: str, target: str, mesh, chip, config, load: Workload, **compile_kwargs
) -> list[Row]:
  """`program`'s rows compiled on `mesh` (devices of `target`, peaks `chip`); never raises.

  A compiler error becomes the row's status; out of memory also gives rlx's advice.
  `compile_kwargs` go to `compile_program`.
  """
  layout = "x".join(str(mesh.shape[a]) for a in train.MESH_AXES)
  rows = []
  for prog in build_programs(program, model, config, load, mesh):
    seconds = max(prog.flops / chip.bf16_flops, prog.bytes / chip.hbm_bandwidth)
    start = time.perf_counter()
    memory, status, kernels, advice = {}, "ok", 0, ()
    try:
      memory, kernels = compile_program(prog, mesh, prog.label or program, **compile_kwargs)
    except train.OutOfMemoryError as e:  # the compiler's line + what rlx advises
      status, advice = "out of memory: " + _short_error(e.__cause__), e.advice
    except Exception as e:  # noqa: BLE001 (the compiler's error is the result)
      status = _short_error(e)
    rows.append(
      Row(
        program=prog.label or program,
        model=model,
        topology=target,
        mesh=layout,
        status=status,
        compile_s=time.perf_counter() - start,
        memory=memory,
        capacity=chip.hbm_bytes,
        flops=prog.flops,
        bytes=prog.bytes,
        roofline_s=seconds,
        tokens_per_s=prog.tokens / seconds,
        donated=prog.donated,
        mosaic=kernels,
        note=prog.note,
        advice=advice,
      )  # fmt: skip
    )
  return rows


SAMPLER_PROGRAMS = tuple(p for p in PROGRAMS if p.startswith(("prefill", "decode", "fp8_matmul")))


def split_compile_fn(rollout_chips: int):
  """A `run` compile_fn for the asynchronous split: sampler programs on the last
  `rollout_chips` chips (data-parallel, as `rl.build_rollout_mesh`), the rest on the others."""

  def compile_split(program: str, model: str, topology: str, config, load: Workload) -> list[Row]:
    devices = topology_devices(topology)
    if not 0 < rollout_chips < len(devices):
      raise app.UsageError(
        f"--rollout_chips={rollout_chips} must leave chips to both sides of {topology} "
        f"({len(devices)} chips)."
      )
    if program.startswith("rl_step"):
      return []  # the fused step samples and trains on one mesh
    train_devices, rollout_devices = devices[:-rollout_chips], devices[-rollout_chips:]
    if program in SAMPLER_PROGRAMS:
      side, mesh = "rollout", train.make_mesh(-1, 1, 1, devices=rollout_devices)
    else:
      side, mesh = "train", make_topology_mesh(topology, load, train_devices)
    target = f"{topology} {side} {len(mesh.devices.flat)}/{len(devices)}"
    return compile_on_mesh(program, model, target, mesh, chip_spec(topology), config, load)

  return compile_split


def compile_one(program: str, model: str, topology: str, config, load: Workload) -> list[Row]:
  """Builds, traces and compiles `program` for `topology`; never raises on compiler errors."""
  mesh = make_topology_mesh(topology, load)
  return compile_on_mesh(program, model, topology, mesh, chip_spec(topology), config, load)


def in_use(memory: dict[str, int]) -> int:
  """Per-chip HBM a compiled program holds at its peak (donated inputs counted once)."""
  return (
    memory["argument"] + memory["output"] - memory["alias"] + memory["temp"]
    + memory["generated_code"]
  )  # fmt: skip


def run(
  programs,
  models,
  topologies,
  config: ml_collections.ConfigDict,
  load: Workload,
  log=print,
  compile_fn=None,
) -> list[Row]:
  """Every program x model x topology, in that nesting order.

  `compile_fn(program, model, topology, config, load) -> rows` (default `compile_one`;
  compile_cuda.py passes its own, with GPU sets as topologies).
  """
  compile_fn = compile_fn or compile_one
  rows = []
  for model in models:
    for topology in topologies:
      for program in programs:
        for row in compile_fn(program, model, topology, config, load):
          log(f"{program} {model} {topology}: {row.status} ({row.compile_s:.1f} s) {row.note}")
          rows.append(row)
  return rows


def smoke_setup(config: ml_collections.ConfigDict) -> tuple[ml_collections.ConfigDict, Workload]:
  """A tiny model's config and workload (8 rows of 64 tokens, one update) for v5e:2x2."""
  config = ml_collections.ConfigDict(config.to_dict())
  config.train.micro_batches = 1
  config.train.mini_batches = 1
  config.rl.prompts_per_iteration, config.rl.num_samples = 2, 4
  config.sampler.max_slots, config.sampler.num_pages = 8, 0  # 0: every slot at full length
  return config, Workload(rows=8, seq_len=64, fsdp=2, tensor=1, answer_len=32)


# Programs whose largest size that fits `--search` finds: the batch's rows (B) for the train
# programs and the fused step, the K/V page pool (num_pages) for the sampler's.
ROW_PROGRAMS = ("train_step", "compute_logprobs", "score_norms", "rl_step", "rl_step_fp8")
POOL_GRANULE = 256  # pages


@dataclasses.dataclass
class SearchRow:
  """The largest size of one program x model x topology that compiles and fits a chip."""

  program: str
  model: str
  topology: str
  mesh: str
  size: str  # "rows" or "num_pages"
  configured: int
  largest: int | None  # the largest size that fits (None: not even one granule)
  smallest_failing: int | None  # the smallest size tried that does not fit (None: none)
  largest_memory: dict[str, int]
  capacity: float
  probes: list[tuple[int, str]]  # (size, "fits" / "out of memory" / error) in probe order
  seconds: float


def _row_granule(config: ml_collections.ConfigDict, mesh) -> int:
  """Rows B come in multiples of mini x micro-batches x batch shards and of the group size."""
  train_rows = int(config.train.mini_batches) * int(config.train.micro_batches)
  return int(np.lcm(train_rows * train.batch_axis_size(mesh), int(config.rl.num_samples)))


def _sized(program: str, config, load: Workload, size: int):
  """(config, load) with `program`'s searched size set to `size` rows or pages."""
  config = ml_collections.ConfigDict(config.to_dict())
  if program in ROW_PROGRAMS:
    config.rl.prompts_per_iteration = size // int(config.rl.num_samples)
    return config, dataclasses.replace(load, rows=size)
  config.sampler.num_pages = size
  return config, load


def largest_fitting(
  probe: Any, start: int, capacity: float, max_probes: int
) -> tuple[int | None, int | None]:
  """(largest size that fits, smallest that does not) among the sizes `probe` tried.

  `probe(n)` compiles size n (in granules, n >= 1) and returns its bytes in use, or
  None when it does not compile for lack of memory; a size fits when that is at
  most `capacity`. From `start`: halving to a fitting size (or doubling once to see
  the slope), then the size where the line through the memory of the two largest
  sizes compiled meets the capacity (bisecting where that falls past the bracket); it
  stops when the bracket is one granule wide or after `max_probes` probes. None
  stands for "not found": no size fits (largest), or every size tried fits (smallest).
  """
  measured: list[tuple[int, float]] = []  # (size, bytes in use) of every compiled probe
  lo, hi, tried = None, None, 0

  def fits(n: int) -> bool:
    nonlocal tried
    tried += 1
    use = probe(n)
    if use is not None:
      measured.append((n, use))
    return use is not None and use <= capacity

  n = max(1, int(start))
  while tried < max_probes:
    if lo is not None and hi is not None and hi - lo <= 1:
      break
    if fits(n):
      lo = n
    else:
      hi = n
      if lo is None and n == 1:
        break
    if lo is None:
      n = max(1, hi // 2)
      continue
    guess = None
    if len(measured) >= 2:
      (n_a, u_a), (n_b, u_b) = sorted(measured)[-2:]
      slope = (u_b - u_a) / (n_b - n_a)
      guess = int(n_b + (capacity - u_b) / slope) if slope > 0 else None
    if hi is None:
      n = max(lo + 1, guess if guess is not None else 2 * lo)
    elif guess is None or guess >= hi:
      n = (lo + hi) // 2
    else:
      n = min(max(guess, lo + 1), hi - 1)
  return lo, hi


def search_largest(
  program: str,
  model: str,
  topology: str,
  config,
  load: Workload,
  *,
  max_probes: int = 7,
  log=print,
) -> SearchRow:
  """The largest rows (train programs) or page pool (sampler) of `program` that fits a chip.

  Sizes are whole granules (rows: `_row_granule`; pages: `POOL_GRANULE`), searched from
  the config's by `largest_fitting`. A size fits when it compiles (the TPU compiler
  rejects a program over its HBM: `rlx.train.OutOfMemoryError`) and its memory in use
  (`in_use`) is at most the chip's capacity.
  """
  start = time.perf_counter()
  mesh = make_topology_mesh(topology, load)
  layout = "x".join(str(mesh.shape[a]) for a in train.MESH_AXES)
  capacity = chip_spec(topology).hbm_bytes
  rows_kind = program in ROW_PROGRAMS
  granule = _row_granule(config, mesh) if rows_kind else POOL_GRANULE
  configured = load.rows if rows_kind else int(config.sampler.num_pages)
  probes: list[tuple[int, str]] = []
  memories: dict[int, dict[str, int]] = {}

  def probe(n: int) -> int | None:
    sized_config, sized_load = _sized(program, config, load, n * granule)
    (prog,) = [
      p for p in build_programs(program, model, sized_config, sized_load, mesh)
      if (p.label or program) == program
    ]  # fmt: skip
    try:
      memory, _ = compile_program(prog, mesh, program)
    except train.OutOfMemoryError:
      probes.append((n * granule, "out of memory"))
      log(f"search {program} {model} {topology}: {n * granule} out of memory")
      return None
    use = in_use(memory)
    probes.append((n * granule, f"{use / 2**30:.3g} GiB"))
    log(f"search {program} {model} {topology}: {n * granule} in use {use / 2**30:.2f} GiB")
    memories[n] = memory
    return use

  lo, hi = None, None
  try:
    lo, hi = largest_fitting(probe, configured // granule, capacity, max_probes)
  except Exception as e:  # noqa: BLE001 (a compiler error other than memory ends the search)
    probes.append((-1, _short_error(e)))
  return SearchRow(
    program=program, model=model, topology=topology, mesh=layout,
    size="rows" if rows_kind else "num_pages", configured=configured,
    largest=None if lo is None else lo * granule,
    smallest_failing=None if hi is None else hi * granule,
    largest_memory=memories.get(lo, {}), capacity=capacity, probes=probes,
    seconds=time.perf_counter() - start,
  )  # fmt: skip


def search_markdown(rows: list[SearchRow], config, command: str) -> str:
  """The `--search` table."""
  gib = 2.0**30
  lines = [
    "| program | model | topology | mesh d x f x t | size | config | largest that fits "
    "| smallest that does not | in use at largest / capacity | probes | search s |",
    "|---|---|---|---|---|---:|---:|---:|---:|---|---:|",
  ]
  for r in rows:
    use = (
      f"{_num(in_use(r.largest_memory) / gib)} / {r.capacity / gib:.0f}"
      if r.largest_memory
      else "-"
    )
    probes = ", ".join(f"{n}: {status}" if n >= 0 else status for n, status in r.probes)
    cells = [r.program, r.model, r.topology, r.mesh, r.size, str(r.configured)]
    cells += [str(r.largest or "none"), str(r.smallest_failing or "none tried"), use, probes]
    cells.append(f"{r.seconds:.0f}")
    lines.append("| " + " | ".join(cells) + " |")
  lines += ["", f"Rerun: `{command}`", ""]
  return "\n".join(lines)


def _num(x: float) -> str:
  """3 significant digits, without exponents for values >= 100 (e.g. 1,580)."""
  return f"{x:,.0f}" if abs(x) >= 100 else f"{x:.3g}"


def table_lines(
  rows: list[Row], chip_of, *, target: str = "topology", kernel: str = "Mosaic", per: str = "chip"
) -> list[str]:
  """The markdown table of `rows` (header and one line per row); `chip_of(target)` peaks."""
  gib = 2.0**30
  lines = [
    f"| program | model | {target} | mesh d x f x t | status | compile s | args | outputs "
    f"| temps | aliased | donated | in use / capacity | {kernel} | TFLOP/{per} | GB/{per} "
    "| roofline ms | bound | tokens/s |",
    "|---|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|",
  ]
  for r in rows:
    m = r.memory
    mem = ["-"] * 4 + [_num(r.donated / gib), "-", "-"]
    if m:
      mem = [_num(m[k] / gib) for k in ("argument", "output", "temp", "alias")]
      use = in_use(m)
      over = "" if use <= r.capacity else " (over)"
      mem += [_num(r.donated / gib), f"{_num(use / gib)} / {r.capacity / gib:.0f}{over}"]
      mem.append(str(r.mosaic))
    chip = chip_of(r.topology)
    bound = "FLOPs" if r.flops / chip.bf16_flops >= r.bytes / chip.hbm_bandwidth else "HBM"
    cells = [r.program, r.model, r.topology, r.mesh, r.status, f"{r.compile_s:.1f}", *mem]
    cells += [_num(r.flops / 1e12), _num(r.bytes / 1e9), _num(1e3 * r.roofline_s), bound]
    cells.append(f"{r.tokens_per_s:,.0f}")
    lines.append("| " + " | ".join(cells) + " |")
  return lines


def notes_lines(rows: list[Row]) -> list[str]:
  """The shapes each row stands for, and rlx's advice for the rows out of memory."""
  lines = []
  notes = {}
  for r in rows:
    if r.note:
      notes.setdefault((r.program, r.model, r.note), []).append(r.topology)
  if notes:
    lines += ["", "Shapes per row:", ""]
    lines += [f"- {p} ({m}, {', '.join(t)}): {n}" for (p, m, n), t in notes.items()]
  advised: dict[tuple[str, ...], list[str]] = {}
  for r in rows:
    if r.advice:
      advised.setdefault(r.advice, []).append(f"{r.program} {r.model} {r.topology}")
  if advised:
    lines += ["", "What rlx's `rlx.train.OutOfMemoryError` lists for the rows out of memory:"]
    for advice, where in advised.items():
      lines += ["", f"- {', '.join(where)}:"] + [f"  - {a}" for a in advice]
  return lines


def markdown(rows: list[Row], load: Workload, config, command: str) -> str:
  gib = 2.0**30
  lines = [
    "# rlx programs compiled for TPU slices (deviceless, real TPU compiler)",
    "",
    f"Batch B={load.rows} rows x S={load.seq_len} tokens, micro_batches "
    f"{config.train.micro_batches}, mini_batches {config.train.mini_batches}, ppo_epochs "
    f"{config.train.ppo_epochs}, loss {config.train.loss}, {config.model.param_dtype} params, "
    f"remat {config.model.remat}, jax {jax.__version__}. HBM in GiB per chip; roofline and "
    "tokens/s are analytic bounds from the chip's published peaks, not measurements. "
    f"Sampler: max_slots {config.sampler.max_slots}, page_size {config.sampler.page_size}, "
    f"num_pages {config.sampler.num_pages}, steps_per_sync {config.sampler.steps_per_sync}, "
    f"prompts of {load.seq_len - load.answer_len} tokens, max_new_tokens {load.answer_len}. "
    "donated: per-chip bytes of the state a program updates in place (the train state, the "
    "KV page pool; logical, before TPU tile padding), to compare with aliased; Mosaic: Pallas "
    "TPU kernel calls in the lowered program.",
    "",
  ]
  lines += table_lines(rows, chip_spec)
  lines += notes_lines(rows)
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
  log = lambda s: print(s, file=sys.stderr)  # noqa: E731
  command = "python " + " ".join(["experiments/compile_tpu.py"] + sys.argv[1:])
  if f.search:
    searched = [
      search_largest(p, m, t, config, load, max_probes=f.max_probes, log=log)
      for m in models for t in topologies for p in programs if p != "fp8_matmul"
    ]  # fmt: skip
    table = search_markdown(searched, config, command)
  else:
    compile_fn = split_compile_fn(f.rollout_chips) if f.rollout_chips else None
    rows = run(programs, models, topologies, config, load, log=log, compile_fn=compile_fn)
    table = markdown(rows, load, config, command)
  print(table)
  if f.out:
    pathlib.Path(f.out).write_text(table)


if __name__ == "__main__":
  define_flags()
  app.run(main)
