r"""One accelerator session's checks, in one run: kernels, sampler, train step, an RL iteration.

Four sections, one markdown file:

  kernels      experiments/check_kernels.py's `run_checks`: every Pallas kernel
               on the device's real path against its pure-jnp reference (error,
               time, GB/s or TFLOP/s); its flags (--context_lengths, ...) apply.
  sampler      `rlx.sampling.Sampler.generate` on a randomly initialised model
               with Qwen2.5-0.5B's shapes (config.json of
               https://huggingface.co/Qwen/Qwen2.5-0.5B-Instruct, bf16, no
               weights read), bf16 and FP8 KV: generated tokens/s of the second
               call (the first compiles), slot utilisation, decode steps.
  train step   `rlx.train.make_train_step` on the same model over all local
               devices: median step time of --train_steps synced steps after a
               compiling one, tokens/s (B x S / step) and MFU = (6 N + 12 L H
               Dh S) FLOPs per token x tokens/s / (devices x peak bf16 FLOP/s).
  RL iteration experiments/configs/arithmetic.py's host-driven
               `rlx.rl.Learner.iteration` (sampler -> reward -> advantages ->
               log-probs -> train step): phase times of the iteration after a
               compiling one (random policy, no warm-up: the cost depends on
               shapes, not on what the policy knows).

Usage (a GPU session; the table also goes to experiments/results/gpu_h200.md):

  python experiments/check_device.py
  python experiments/check_device.py --smoke   # tiny shapes on CPU (interpret-mode kernels)

`--smoke` checks that the script runs, not the device's speed; it is exercised
by tests/kernels_pallas/test_kernels_check_device_script.py (as a subprocess).
"""

import dataclasses
import importlib.util
import os
import pathlib
import statistics
import sys
import time
from typing import Any

from absl import app, flags

_HERE = pathlib.Path(__file__).resolve().parent


def _load_experiment(name: str):
  """Imports experiments/<name>.py once (a re-import keeps its absl flags)."""
  if name in sys.modules:
    return sys.modules[name]
  spec = importlib.util.spec_from_file_location(name, _HERE / f"{name}.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  sys.modules[name] = module
  return module


# Defines --smoke, --output and the kernel-section flags (shared with check_kernels.py).
check_kernels = _load_experiment("check_kernels")

FLAGS = flags.FLAGS
_SLOTS = flags.DEFINE_integer("sampler_slots", 64, "Sampler: concurrent sequences.")
_PROMPT = flags.DEFINE_integer("sampler_prompt_len", 256, "Sampler: prompt tokens.")
_NEW = flags.DEFINE_integer("sampler_new_tokens", 512, "Sampler: new tokens per sequence.")
_TRAIN_BATCH = flags.DEFINE_integer("train_batch", 32, "Train step: sequences B.")
_TRAIN_SEQ = flags.DEFINE_integer("train_seq", 1024, "Train step: sequence length S.")
_TRAIN_STEPS = flags.DEFINE_integer("train_steps", 5, "Train step: timed steps (median).")

DEFAULT_OUTPUT = _HERE / "results" / "gpu_h200.md"

# config.json fields of Qwen/Qwen2.5-0.5B-Instruct (shapes only).
QWEN25_05B = dict(
  architectures=["Qwen2ForCausalLM"], model_type="qwen2", vocab_size=151936, hidden_size=896,
  intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
  max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6,
  tie_word_embeddings=True, hidden_act="silu", attention_dropout=0.0, use_sliding_window=False,
  bos_token_id=151643, eos_token_id=151645, torch_dtype="bfloat16",
)  # fmt: skip

# Dense bf16 peak FLOP/s per device, by substring of `device_kind`: NVIDIA H100/H200
# datasheets (https://www.nvidia.com/en-us/data-center/h200/, 1979 TFLOPS with 2:4
# sparsity = 989 dense), Cloud TPU system architecture pages for the TPUs.
PEAK_BF16_FLOPS = (
  ("H200", 989e12),
  ("H100", 989e12),
  ("v6", 918e12),
  ("v5p", 459e12),
  ("v5", 197e12),
)


@dataclasses.dataclass(frozen=True)
class Settings:
  """Sizes of one run (`full()` for a device session, `smoke()` for CPU)."""

  smoke: bool
  kernels: dict  # check_kernels.run_checks config
  sampler_slots: int
  sampler_prompt_len: int
  sampler_new_tokens: int
  train_batch: int
  train_seq: int
  train_steps: int
  command: str


def smoke_settings(command: str = "python experiments/check_device.py --smoke") -> Settings:
  kernels = dict(
    smoke=True, context_lengths=[20], batch_sizes=[2], kv_dtypes=["float8_e4m3fn"],
    num_kv_heads=1, gqa=2, head_dim=64, page_size=16, pages_per_compute_block=2,
    matmul_shapes=[(16, 256, 128)], iters=1, repeats=1, max_kv_gib=1.0, command=command,
  )  # fmt: skip
  return Settings(True, kernels, 4, 8, 8, 8, 32, 1, command)


def _model_config(smoke: bool):
  from rlx import policy  # noqa: PLC0415

  if smoke:
    return policy.ModelConfig.small("qwen2", param_dtype="float32", compute_dtype="float32")
  return policy.ModelConfig.from_hf_config(QWEN25_05B, param_dtype="bfloat16")


def _peak_flops(device) -> float | None:
  for key, peak in PEAK_BF16_FLOPS:
    if device.platform != "cpu" and key.lower() in device.device_kind.lower():
      return peak
  return None


def sampler_section(s: Settings, mc, params) -> list[str]:
  """Generated tokens/s of the second `generate` call, bf16 and FP8 KV (calibrated scales)."""
  import jax  # noqa: PLC0415
  import numpy as np  # noqa: PLC0415

  from rlx import sampling  # noqa: PLC0415

  kv_dtypes = ("float32", "fp8_e4m3") if s.smoke else ("bfloat16", "fp8_e4m3")
  rng = np.random.default_rng(0)
  prompts = [
    rng.integers(1, mc.vocab_size, int(n)).tolist()
    for n in rng.integers(s.sampler_prompt_len // 2, s.sampler_prompt_len + 1, s.sampler_slots)
  ]
  # FP8 KV scales from one trainer forward over the prompts (amax / headroom).
  width = max(len(p) for p in prompts)
  calib = np.zeros((len(prompts), width), np.int32)
  for row, p in enumerate(prompts):
    calib[row, : len(p)] = p
  calibration = sampling.calibrate_kv_scales(params, mc, calib, calib != 0)
  page = 16
  pages_per_sequence = -(-(s.sampler_prompt_len + s.sampler_new_tokens) // page)
  lines = [
    f"## sampler ({s.sampler_slots} slots, prompts {s.sampler_prompt_len // 2}-"
    f"{s.sampler_prompt_len} tokens, {s.sampler_new_tokens} new tokens, temperature 1, "
    "no stop ids)",
    "",
    "| KV dtype | tokens/s | wall s | decode steps | slot utilisation | compile + first call s |",
    "|---|---:|---:|---:|---:|---:|",
  ]
  for kv_dtype in kv_dtypes:
    config = sampling.SamplerConfig(
      max_slots=s.sampler_slots, page_size=page, num_pages=s.sampler_slots * pages_per_sequence,
      max_prompt_len=s.sampler_prompt_len, max_new_tokens=s.sampler_new_tokens,
      kv_dtype=kv_dtype, temperature=1.0,
    )  # fmt: skip
    sampler = sampling.Sampler(mc, config)
    scales = calibration if kv_dtype.startswith("fp8") else None
    start = time.perf_counter()
    sampler.generate(params, prompts, num_samples=1, rng=jax.random.key(0), kv_scales=scales)
    first = time.perf_counter() - start
    out = sampler.generate(params, prompts, num_samples=1, rng=jax.random.key(1), kv_scales=scales)
    stats = out.stats
    lines.append(
      f"| {kv_dtype} | {stats['tokens_per_s']:,.0f} | {stats['wall_s']:.2f} | "
      f"{stats['decode_steps']} | {stats['slot_utilisation']:.2f} | {first:.1f} |"
    )
  return lines


def train_section(s: Settings, mc, params) -> list[str]:
  """Median synced train-step time over all local devices (smoke: one), tokens/s and MFU."""
  import jax  # noqa: PLC0415
  import numpy as np  # noqa: PLC0415

  from rlx import train  # noqa: PLC0415

  devices = jax.devices()[:1] if s.smoke else jax.devices()
  mesh = train.make_mesh(data=-1, devices=devices)
  config = train.get_config()
  step = train.make_train_step(mc, config, mesh)
  state = train.create_train_state(params, mc, config, mesh, rng=jax.random.PRNGKey(0))
  rng = np.random.default_rng(0)
  b, t = s.train_batch, s.train_seq
  prompt = t // 4
  batch = {
    "tokens": rng.integers(1, mc.vocab_size, (b, t)).astype(np.int32),
    "loss_mask": (np.arange(t)[None, :] >= prompt).repeat(b, 0).astype(np.float32),
    "advantages": rng.normal(size=b).astype(np.float32),
  }
  batch = train.shard_batch(batch, mesh)
  batch["old_logp"] = train.make_compute_logprobs(mc, config, mesh)(state, batch)
  start = time.perf_counter()
  state, metrics = step(state, batch)
  jax.block_until_ready(metrics)
  compile_s = time.perf_counter() - start
  times = []
  for _ in range(s.train_steps):
    start = time.perf_counter()
    state, metrics = step(state, batch)
    jax.block_until_ready(metrics)
    times.append(time.perf_counter() - start)
  step_s = statistics.median(times)
  tokens_per_s = b * t / step_s
  matmul_params = sum(x.size for x in jax.tree.leaves(params))
  flops_per_token = 6 * matmul_params + 12 * mc.num_layers * mc.num_heads * mc.head_dim * t
  peak = _peak_flops(jax.devices()[0])
  mfu = f"{100 * flops_per_token * tokens_per_s / (peak * mesh.size):.1f}%" if peak else "n/a (CPU)"
  return [
    f"## train step (B={b} x S={t}, {mc.param_dtype}, loss {config.loss}, mesh {dict(mesh.shape)})",
    "",
    "| step ms | tokens/s | MFU | compile + first step s | loss |",
    "|---:|---:|---:|---:|---:|",
    f"| {1e3 * step_s:.1f} | {tokens_per_s:,.0f} | {mfu} | {compile_s:.1f} | "
    f"{float(train.to_host(metrics['loss'])):.4f} |",
  ]


def rl_section(s: Settings) -> list[str]:
  """Phase times of one host-driven RL iteration of the arithmetic config (after one compiling)."""
  import jax  # noqa: PLC0415

  from rlx import rl, train  # noqa: PLC0415

  spec = importlib.util.spec_from_file_location("arithmetic", _HERE / "configs" / "arithmetic.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  config = module.get_config()
  if s.smoke:
    config.rl.prompts_per_iteration = 4
    config.rl.num_samples = 2
  task = rl.make_task(config)
  mesh = rl.build_mesh(config)
  model_config, params = rl.build_model(config, task)
  learner = rl.Learner(config, task, model_config, mesh)
  k, n = learner.group_size, int(config.rl.prompts_per_iteration)
  kwargs = rl.sampler_kwargs(config, task, rows=n * k, greedy=False)
  sampler = rl.make_sampler(model_config, kwargs, mesh)
  rollout = rl.SyncRollout(
    sampler, num_samples=k, max_prompt_len=kwargs["max_prompt_len"],
    max_new_tokens=kwargs["max_new_tokens"],
  )  # fmt: skip
  source = rl.PromptSource(task.split("train"), batch_size=n, seed=0)
  state = train.create_train_state(
    params, model_config, learner.train_config, mesh, rng=jax.random.PRNGKey(1)
  )
  ref = jax.tree.map(lambda x: x.copy(), state.params) if learner.uses_ref else None
  start = time.perf_counter()
  state, _, _ = learner.iteration(state, ref, rollout, source.next_batch(), jax.random.key(0))
  first = time.perf_counter() - start
  state, m, _ = learner.iteration(state, ref, rollout, source.next_batch(), jax.random.key(1))
  phases = ("rollout", "reward", "logp", "train")
  return [
    f"## RL iteration ({config.task.name}, {n} prompts x {k} samples, loss {config.train.loss})",
    "",
    "| " + " | ".join(f"{p} s" for p in phases) + " | total s | compile + first iteration s |",
    "|" + "---:|" * (len(phases) + 2),
    "| "
    + " | ".join(f"{m[f'time/{p}_s']:.3f}" for p in phases)
    + f" | {m['time/iteration_s']:.3f} | {first:.1f} |",
  ]


def run(s: Settings) -> str:
  """All four sections as one markdown document."""
  import jax  # noqa: PLC0415

  from rlx import policy  # noqa: PLC0415

  rows, kernel_header = check_kernels.run_checks(s.kernels)
  # check_kernels' header: a title, the device and copy-bandwidth line, the command.
  device_line = next(line for line in kernel_header.split("\n") if line.startswith("device:"))
  kernels = check_kernels.format_table(rows, "## kernels vs references\n\n" + device_line)
  mc = _model_config(s.smoke)
  params = policy.init_params(mc, jax.random.PRNGKey(0))
  lines = [
    "# rlx on one accelerator session",
    "",
    f"{len(jax.devices())} x {jax.devices()[0].device_kind}, smoke={s.smoke}. Model of the "
    f"sampler and train step: {'ModelConfig.small' if s.smoke else 'Qwen2.5-0.5B shapes'}, "
    f"{sum(x.size for x in jax.tree.leaves(params)) / 1e6:.1f}M params, random weights.",
    "",
    kernels,
    "",
    *sampler_section(s, mc, params),
    "",
    *train_section(s, mc, params),
    "",
    *rl_section(s),
    "",
    f"Rerun: `{s.command}`",
    "",
  ]
  return "\n".join(lines)


def main(argv):
  del argv
  command = " ".join(["python", "experiments/check_device.py"] + sys.argv[1:])
  if FLAGS.smoke:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    settings = smoke_settings(command)
  else:
    kernels = check_kernels.config_from_flags()
    kernels["command"] = command
    settings = Settings(
      False, kernels, _SLOTS.value, _PROMPT.value, _NEW.value, _TRAIN_BATCH.value,
      _TRAIN_SEQ.value, _TRAIN_STEPS.value, command,
    )  # fmt: skip
  print("rerun with:", command, flush=True)
  report = run(settings)
  print(report)
  output: Any = FLAGS.output or (None if FLAGS.smoke else DEFAULT_OUTPUT)
  if output:
    pathlib.Path(output).parent.mkdir(parents=True, exist_ok=True)
    pathlib.Path(output).write_text(report)
    print(f"wrote {output}")


if __name__ == "__main__":
  app.run(main)
