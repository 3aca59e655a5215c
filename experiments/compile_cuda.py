r"""Compiles rlx programs for NVIDIA GPUs (H100 / H200, sm_90) on a machine without one.

The GPU counterpart of experiments/compile_tpu.py: the same programs (its
`build_programs`: train step, log-probs, the sampler's prefill / decode with bf16 and
FP8 KV pages and with W8A8 FP8 linears, the Pallas FP8 matmul, the fused RL step),
traced with abstract sharded inputs on a mesh of compile-only GPU devices and
compiled by XLA's real GPU compiler (HLO passes, LLVM -> PTX, `ptxas` -> SASS), with
per-GPU `memory_analysis()` and the same analytic rooflines.

How (no GPU, no driver, no libcuda):

  * The CUDA PJRT plugin (jax-cuda12-plugin 0.10.2: rlx's `cuda-compile` extra, or
    its `cuda` extra on a GPU machine) implements `PJRT_TopologyDescription_Create`
    for deviceless compiles:
    `PJRT_GpuDeviceTopology_Create` in
    https://github.com/openxla/xla/blob/main/xla/pjrt/c/pjrt_c_api_gpu_internal.cc
    reads two options, "target_config" (a text-format
    `stream_executor.GpuTargetConfigProto`, the device description a compile
    needs) and "topology" ("<partitions>x<hosts per partition>x<devices per
    host>", `xla::TopologySizes::FromString`). Without "target_config" it opens a
    local GPU client instead, which fails here with "No visible GPU devices".
    `jax.experimental.topologies.get_topology_desc(platform="cuda", **options)`
    passes both options through and returns the topology's compile-only devices.
  * A program traced on a mesh over those devices lowers and compiles as for TPU
    (https://docs.jax.dev/en/latest/aot.html): XLA finds the target config in the
    topology and, with no client, runs a deviceless compilation
    (https://github.com/openxla/xla/blob/main/xla/pjrt/gpu/se_gpu_pjrt_compiler.cc:
    "Found GPU target config and no PjRtClient. Performing a deviceless
    compilation"). Autotuning is skipped (GEMM and Triton configs come from
    heuristics), so compile times and kernel choices differ a little from a
    compile on a GPU. XLA's scheduling / rematerialization memory limit is 80% of
    the config's `device_memory_size` here (`GetSchedulerMemoryLimit` in
    https://github.com/openxla/xla/blob/main/xla/service/gpu/gpu_hlo_schedule.cc),
    where on a GPU it is the size of JAX's memory pool.
  * PTX is assembled by `ptxas`, from the `nvidia-cuda-nvcc-cu12` wheel beside the
    plugin (its default `--xla_gpu_cuda_data_dir` is that wheel's directory) or
    a CUDA toolkit on the PATH / in /usr/local/cuda. cuBLAS, cuDNN and NCCL are
    not needed (none was installed where the table was made).
  * Pallas Triton kernels (rlx.kernels_pallas, GPU path) lower for compute
    capability 9.0 when JAX sees no GPU (`jax/_src/pallas/triton/
    pallas_call_registration.py` falls back to "9.0"), i.e. for H100 / H200;
    XLA then compiles their Triton IR with the rest of the program. "Triton" counts
    their call sites (`__gpu$xla.gpu.triton` custom calls) in the lowered StableHLO.

Target configs: `target_config(gpu)` writes the `GpuTargetConfigProto` from the
published device properties of compute capability 9.0 (CUDA C++ Programming Guide,
"Features and Technical Specifications",
https://docs.nvidia.com/cuda/cuda-c-programming-guide/#features-and-technical-specifications,
and the Hopper tuning guide, https://docs.nvidia.com/cuda/hopper-tuning-guide/) and
the product pages; the H200 is the H100 SXM (same GH100 chip, 132 SMs) with 141 GB
of HBM3e at 4.8 TB/s instead of 80 GB at 3.35 TB/s, so its config is the H100's with
only the memory size, bandwidth and name changed. XLA keeps such files for many GPUs
(https://github.com/openxla/xla/tree/main/xla/backends/gpu/target_config/specs);
the generated ones carry the fields jaxlib 0.10.2's proto knows.

Columns are compile_tpu.py's (see its docstring), per GPU; capacity is the
published memory (H200: 141 GB = 131 GiB). At run time JAX preallocates 75% of
it by default (`XLA_PYTHON_CLIENT_MEM_FRACTION`,
https://docs.jax.dev/en/latest/gpu_memory_allocation.html). Rooflines use the
dense bf16 peak, also for the FP8 programs (H100 / H200: 989 TFLOP/s bf16, 1,979
FP8).

Install (a separate environment keeps the CPU one clean):

  python -m venv --system-site-packages /tmp/cudavenv
  /tmp/cudavenv/bin/pip install -e ".[cuda-compile]"
  # = jax-cuda12-plugin==0.10.2 nvidia-cuda-nvcc-cu12==12.9.86

Rerun (prints the markdown table; `--out` also writes it):

  /tmp/cudavenv/bin/python experiments/compile_cuda.py \
    --gpus=h200:1,h200:8 --models=qwen2.5-0.5b \
    --out=experiments/results/compile_cuda.md

`--smoke` compiles one tiny model on 2 H200 (about a minute on 2 CPU cores);
`--print_target_config` prints the generated target configs.
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the GPUs are compile-only: JAX runs on CPU

import dataclasses  # noqa: E402
import importlib.util  # noqa: E402
import pathlib  # noqa: E402
import sys  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import compile_tpu  # noqa: E402 (experiments/compile_tpu.py: builders, rooflines)
import jax  # noqa: E402
import ml_collections  # noqa: E402
from absl import app, flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from rlx import train  # noqa: E402

PROGRAMS = compile_tpu.PROGRAMS
HF_CONFIGS = compile_tpu.HF_CONFIGS
_TRITON = "__gpu$xla.gpu.triton"  # the custom-call target of a Pallas Triton kernel


@dataclasses.dataclass(frozen=True)
class GpuSpec:
  """Published per-GPU peaks and the device properties XLA compiles for."""

  name: str  # the device kind JAX reports
  bf16_flops: float  # dense bf16 FLOP/s
  hbm_bytes: float  # memory capacity (the published GB, 1e9 bytes)
  hbm_bandwidth: float  # bytes/s
  source: str


GPUS = {
  "h100": GpuSpec(
    "NVIDIA H100 80GB HBM3", 989e12, 80e9, 3.35e12, "https://www.nvidia.com/en-us/data-center/h100/"
  ),
  "h200": GpuSpec(
    "NVIDIA H200 141GB HBM3e", 989e12, 141e9, 4.8e12,
    "https://www.nvidia.com/en-us/data-center/h200/",
  ),
}  # fmt: skip

# Device properties of compute capability 9.0 (H100 SXM5; the H200 shares the chip),
# `stream_executor.GpuDeviceInfoProto` fields: the CUDA programming guide's
# per-compute-capability limits, 132 SMs, 50 MB L2, 1.98 GHz boost clock.
_SM90 = dict(
  threads_per_block_limit=1024, threads_per_warp=32, shared_memory_per_block=48 * 1024,
  shared_memory_per_core=228 * 1024, shared_memory_per_block_optin=227 * 1024,
  threads_per_core_limit=2048, core_count=132, fpus_per_core=128,
  block_dim_limit_x=2**31 - 1, block_dim_limit_y=65535, block_dim_limit_z=65535,
  thread_dim_limit_x=1024, thread_dim_limit_y=1024, thread_dim_limit_z=64,
  registers_per_core_limit=65536, registers_per_block_limit=65536,
  l2_cache_size=50 * 2**20, clock_rate_ghz=1.98, device_address_bits=64,
  device_vendor='"NVIDIA Corporation"',
)  # fmt: skip
_DNN_VERSION = (9, 10, 0)  # the cuDNN assumed at run time (XLA picks cuDNN rewrites by it)


def target_config(gpu: str) -> str:
  """The text-format `stream_executor.GpuTargetConfigProto` of `gpu` ("h100" | "h200")."""
  spec = GPUS[gpu]
  fields = dict(_SM90)
  fields |= dict(
    device_memory_size=int(spec.hbm_bytes), memory_bandwidth=int(spec.hbm_bandwidth),
    name=f'"{spec.name}"',
  )  # fmt: skip
  info = [f"  {k}: {v}" for k, v in fields.items()]
  # sm_90a, as a Hopper GPU reports itself to XLA (wgmma, TMA: the "a" features)
  info.append(
    "  cuda_compute_capability { major: 9 minor: 0 feature_extension: ACCELERATED_FEATURES }"
  )
  major, minor, patch = _DNN_VERSION
  return "\n".join(
    ["gpu_device_info {", *info, "}", 'platform_name: "CUDA"',
     f"dnn_version_info {{ major: {major} minor: {minor} patch: {patch} }}",
     f'device_description_str: "{spec.name}"', ""]
  )  # fmt: skip


def cuda_plugin_missing() -> str | None:
  """Why deviceless CUDA compiles cannot run here (None: the plugin is importable)."""
  try:
    found = importlib.util.find_spec("jax_plugins.xla_cuda12") is not None
  except ModuleNotFoundError:  # no jax_plugins namespace package at all
    found = False
  if not found:
    return 'the CUDA PJRT plugin is not importable: pip install -e ".[cuda-compile]"'
  return None


def parse_gpus(spec: str) -> tuple[str, int]:
  """ "h200:8" -> ("h200", 8): 8 GPUs of one node (NVLink)."""
  gpu, _, count = spec.partition(":")
  if gpu not in GPUS or not count.isdigit() or int(count) < 1:
    raise ValueError(f"GPU spec {spec!r}: want <gpu>:<count>, gpu from {sorted(GPUS)}.")
  return gpu, int(count)


def gpu_devices(spec: str) -> list:
  """The compile-only devices of `spec` ("h200:8"): one host of `count` GPUs."""
  from jax.experimental import topologies  # noqa: PLC0415

  gpu, count = parse_gpus(spec)
  topology = topologies.get_topology_desc(
    platform="cuda", topology=f"1x1x{count}", target_config=target_config(gpu)
  )
  return topology.devices


def make_gpu_mesh(spec: str, load: compile_tpu.Workload) -> jax.sharding.Mesh:
  """A `("data", "fsdp", "tensor")` mesh over `spec`'s GPUs, as compile_tpu sizes it."""
  devices = gpu_devices(spec)
  tensor = min(load.tensor, len(devices))
  fsdp = min(load.fsdp, len(devices) // tensor)
  return train.make_mesh(data=-1, fsdp=fsdp, tensor=tensor, devices=devices)


def compile_one(
  program: str, model: str, gpus: str, config, load: compile_tpu.Workload
) -> list[compile_tpu.Row]:
  """Builds, traces and compiles `program` for `gpus`; never raises on compiler errors.

  compile_tpu's `compile_on_mesh` on a GPU mesh; a row's `mosaic` field counts Triton kernels.
  """
  mesh = make_gpu_mesh(gpus, load)
  chip = GPUS[parse_gpus(gpus)[0]]
  return compile_tpu.compile_on_mesh(
    program, model, gpus, mesh, chip, config, load, kernel=_TRITON, default_device=False
  )


def run(programs, models, gpus, config, load: compile_tpu.Workload, log=print):
  """Every program x model x GPU set, in that nesting order (compile_tpu's `run`)."""
  return compile_tpu.run(programs, models, gpus, config, load, log=log, compile_fn=compile_one)


def smoke_setup(config: ml_collections.ConfigDict):
  """compile_tpu's tiny workload (8 rows of 64 tokens, fsdp 2) and the GPUs: 2 H200."""
  config, load = compile_tpu.smoke_setup(config)
  return config, load, ["h200:2"]


def markdown(rows, load: compile_tpu.Workload, config, command: str) -> str:
  """compile_tpu.markdown's table, per GPU, with Triton kernel counts."""
  gib = 2.0**30
  lines = [
    "# rlx programs compiled for NVIDIA GPUs (deviceless, real XLA GPU compiler)",
    "",
    f"Batch B={load.rows} rows x S={load.seq_len} tokens, micro_batches "
    f"{config.train.micro_batches}, mini_batches {config.train.mini_batches}, ppo_epochs "
    f"{config.train.ppo_epochs}, loss {config.train.loss}, {config.model.param_dtype} params, "
    f"remat {config.model.remat}, jax {jax.__version__}. Memory in GiB per GPU; roofline and "
    "tokens/s are analytic bounds from the GPU's published peaks, not measurements. "
    f"Sampler: max_slots {config.sampler.max_slots}, page_size {config.sampler.page_size}, "
    f"num_pages {config.sampler.num_pages}, steps_per_sync {config.sampler.steps_per_sync}, "
    f"prompts of {load.seq_len - load.answer_len} tokens, max_new_tokens {load.answer_len}. "
    "GPUs `h200:N`: N H200 of one node (NVLink), topology 1x1xN, sm_90 target config from "
    "experiments/compile_cuda.py; compiled without autotuning (no device). donated: per-GPU "
    "bytes of the state a program updates in place (the train state, the KV page pool), to "
    "compare with aliased; Triton: Pallas Triton kernel calls in the lowered program.",
    "",
  ]
  chip_of = lambda spec: GPUS[parse_gpus(spec)[0]]  # noqa: E731
  lines += compile_tpu.table_lines(rows, chip_of, target="GPUs", kernel="Triton", per="GPU")
  lines += compile_tpu.notes_lines(rows)
  used = sorted({parse_gpus(r.topology)[0] for r in rows})
  lines += ["", "GPU peaks (per GPU, bf16 dense):", ""]
  lines += [
    f"- {GPUS[g].name}: {GPUS[g].bf16_flops / 1e12:.0f} TFLOP/s, "
    f"{GPUS[g].hbm_bandwidth / 1e12:.2f} TB/s HBM, {GPUS[g].hbm_bytes / 1e9:.0f} GB = "
    f"{GPUS[g].hbm_bytes / gib:.0f} GiB ({GPUS[g].source})"
    for g in used
  ]
  lines += ["", f"Rerun: `{command}`", ""]
  return "\n".join(lines)


def define_flags() -> None:
  """Defines the absl flags; called only when run as a script (see compile_tpu.py)."""
  flags.DEFINE_list("gpus", ["h200:1", "h200:8"], f"GPU sets <gpu>:<count>, gpu from {list(GPUS)}.")
  flags.DEFINE_list("models", list(HF_CONFIGS), f"Models, from {list(HF_CONFIGS)}.")
  flags.DEFINE_list("programs", list(PROGRAMS), f"Programs, from {list(PROGRAMS)}.")
  flags.DEFINE_integer(
    "prompt_len", 256, "Prompt tokens per row (the config leaves it to the data; assumed)."
  )
  flags.DEFINE_string("out", None, "Optional file to write the markdown table to.")
  flags.DEFINE_bool("smoke", False, "One tiny model on 2 H200 (about a minute).")
  flags.DEFINE_bool("print_target_config", False, "Print the --gpus' target configs and exit.")
  config_flags.DEFINE_config_file("config", str(compile_tpu._CONFIG_PATH), "The RL config.")


def main(argv):
  del argv
  f = flags.FLAGS
  config, gpus = f.config, f.gpus
  load = compile_tpu.workload(config, f.prompt_len)
  programs, models = f.programs, f.models
  for spec in gpus:
    try:
      parse_gpus(spec)
    except ValueError as e:
      raise app.UsageError(str(e)) from e
  if f.print_target_config:
    for gpu in dict.fromkeys(parse_gpus(s)[0] for s in gpus):
      print(f"# {gpu}\n{target_config(gpu)}")
    return
  if f.smoke:
    config, load, gpus = smoke_setup(config)
    models = ["tiny"]
  for name, values, known in (
    ("--programs", programs, PROGRAMS),
    ("--models", models, (*HF_CONFIGS, "tiny")),
  ):
    bad = sorted(set(values) - set(known))
    if bad:
      raise app.UsageError(f"{name}: unknown {bad}; choose from {list(known)}.")
  if reason := cuda_plugin_missing():
    raise app.UsageError(f"Cannot compile for CUDA: {reason}.")
  rows = run(programs, models, gpus, config, load, log=lambda s: print(s, file=sys.stderr))
  command = "python " + " ".join(["experiments/compile_cuda.py"] + sys.argv[1:])
  table = markdown(rows, load, config, command)
  print(table)
  if f.out:
    pathlib.Path(f.out).write_text(table)


if __name__ == "__main__":
  define_flags()
  app.run(main)
