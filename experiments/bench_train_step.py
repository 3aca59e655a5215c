r"""Tokens/s of the sharded train step across mesh layouts, measured in one run.

For each mesh layout (data x fsdp x tensor) the same small policy and the same
rollout batch run through `rlx.train.make_train_step` (PPO clip, token-mean,
AdamW, one optimizer update per step unless flags say otherwise). After one
warm-up (compiling) step, `--steps` steps are timed on host with
`block_until_ready` after each, then `--steps` more are dispatched without any
wait and timed by the step's `ThroughputMeter` (one sync when read); reported
side by side:

  step_ms      median wall time of one synced train step;
  tokens/s     B * S / step time (all processed positions, prompt + response
               + padding, i.e. what the forward/backward pays for);
  async tok/s  the same from `train_step.throughput.read()` over the
               asynchronously dispatched steps (dispatch of the first to
               completion of the last);
  ratio        tokens/s relative to the first layout of the run;
  compile_s    wall time of the first (compiling) call;
  temp MiB     XLA's temporary-buffer size of the compiled step per device
               (`memory_analysis().temp_size_in_bytes`): activations, saved
               residuals, gathered weights, gradients in flight;
  MFU          model FLOPs utilisation, accelerators only: (6 * N_params +
               12 * L * H * Dh * S) FLOPs per token (forward + backward; the
               attention term counts the full S x S score matrix) times
               tokens/s, over the chips' peak dense bf16 FLOP/s.

Layouts with an "fsdp" axis > 1 run once per `--gather_modes` entry:
"layer" gathers one decoder layer's FSDP-sharded weights at a time inside the
layer scan (`config.gather_fsdp_per_layer=True`, the default), "model" gathers
the whole param tree before the forward (`gather_fsdp_per_layer=False`), so
the two are compared side by side in one run.

On CPU the script forces 8 fake host devices (XLA_FLAGS), so the multi-device
layouts share the same physical cores as the 1-device one: their ratios show
the cost of partitioning and collectives on one host, not a speed-up.

Rerun (prints the markdown table; `--out` also writes it to a file):

  python experiments/bench_train_step.py \
    --out=experiments/results/train_step_cpu.md

Defaults: 4 layers, width 256, vocab 2048, B=32, S=128; 6 rows, ~4-8 minutes
on 2 CPU cores.
"""

import os
import statistics
import sys
import time

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", "") and (
  os.environ.get("JAX_PLATFORMS", "") in ("", "cpu")
):
  # Only affects the CPU backend; an accelerator keeps its real devices.
  os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
  ).strip()

import jax  # noqa: E402
import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402

from rlx import policy, train  # noqa: E402

_LAYOUTS = flags.DEFINE_list(
  "layouts",
  ["1x1x1", "8x1x1", "1x8x1", "2x2x2"],
  "Mesh layouts data x fsdp x tensor; '1x1x1' uses one device.",
)
_BATCH = flags.DEFINE_integer("batch", 32, "Sequences B per step.")
_SEQ = flags.DEFINE_integer("seq", 128, "Sequence length S.")
_PROMPT = flags.DEFINE_integer("prompt", 32, "Prompt tokens per sequence (no loss).")
_LAYERS = flags.DEFINE_integer("layers", 4, "Decoder layers.")
_HIDDEN = flags.DEFINE_integer("hidden", 256, "Model width.")
_HEADS = flags.DEFINE_integer("heads", 8, "Query heads (head_dim = hidden / heads).")
_KV_HEADS = flags.DEFINE_integer("kv_heads", 4, "KV heads.")
_VOCAB = flags.DEFINE_integer("vocab", 2048, "Vocabulary size.")
_DTYPE = flags.DEFINE_string("dtype", None, "Param/compute dtype (default: f32 CPU, bf16 else).")
_MICRO = flags.DEFINE_integer("micro_batches", 1, "Micro-batches per update.")
_LOSS = flags.DEFINE_string("loss", "ppo", "Policy loss (any key of POLICY_LOSSES).")
_GATHER = flags.DEFINE_bool(
  "gather_fsdp_params", True, "All-gather FSDP params before the forward (config field)."
)
_GATHER_MODES = flags.DEFINE_list(
  "gather_modes",
  ["layer", "model"],
  "For layouts with fsdp > 1: 'layer' (per-layer gather in the layer scan) and/or 'model' "
  "(whole param tree gathered before the forward).",
)
_STEPS = flags.DEFINE_integer("steps", 5, "Timed steps per layout (median reported).")
_OUT = flags.DEFINE_string("out", None, "Optional file to write the markdown table to.")

# Peak dense bf16 FLOP/s per chip, by substring of `device_kind` (vendor specs).
_PEAK_FLOPS = (
  ("H200", 989e12),
  ("H100", 989e12),
  ("A100", 312e12),
  ("L4", 121e12),
  ("v6", 918e12),
  ("v5p", 459e12),
  ("v5", 197e12),  # v5e / "TPU v5 lite"
  ("v4", 275e12),
)


def _peak_flops(device: jax.Device) -> float | None:
  if device.platform == "cpu":
    return None
  for key, flops in _PEAK_FLOPS:
    if key.lower() in device.device_kind.lower():
      return flops
  return None


def _model_config() -> policy.ModelConfig:
  dtype = _DTYPE.value or ("float32" if jax.default_backend() == "cpu" else "bfloat16")
  return policy.ModelConfig(
    family="qwen2",
    vocab_size=_VOCAB.value,
    hidden_size=_HIDDEN.value,
    num_layers=_LAYERS.value,
    num_heads=_HEADS.value,
    num_kv_heads=_KV_HEADS.value,
    head_dim=_HIDDEN.value // _HEADS.value,
    intermediate_size=3 * _HIDDEN.value,
    attention_bias=True,
    param_dtype=dtype,
    compute_dtype=dtype,
  )


def _batch(rng: np.random.Generator) -> dict:
  b, s, p = _BATCH.value, _SEQ.value, _PROMPT.value
  lengths = rng.integers((s - p) // 2, s - p + 1, b)
  pos = np.arange(s)[None, :]
  return {
    "tokens": rng.integers(1, _VOCAB.value, (b, s)).astype(np.int32),
    "loss_mask": ((pos >= p) & (pos < p + lengths[:, None])).astype(np.float32),
    "advantages": rng.normal(size=b).astype(np.float32),
  }


def _flops_per_token(mc: policy.ModelConfig, params) -> float:
  n_params = sum(x.size for x in jax.tree.leaves(params))
  attention = 12 * mc.num_layers * mc.num_heads * mc.head_dim * _SEQ.value
  return 6.0 * n_params + attention


def _run_layout(
  layout: str, gather_mode: str | None, mc: policy.ModelConfig, host_batch: dict
) -> dict:
  data, fsdp, tensor = (int(x) for x in layout.split("x"))
  n = data * fsdp * tensor
  devices = jax.devices()
  if n > len(devices):
    raise ValueError(f"Layout {layout} needs {n} devices, have {len(devices)}.")
  mesh = train.make_mesh(data, fsdp, tensor, devices=devices[:n])
  config = train.get_config()
  config.loss = _LOSS.value
  config.micro_batches = _MICRO.value
  config.gather_fsdp_params = _GATHER.value
  config.gather_fsdp_per_layer = gather_mode != "model"
  config.optimizer.learning_rate = 1e-5
  config.report_throughput = False  # timed here, around block_until_ready
  params = policy.init_params(mc, jax.random.PRNGKey(0))
  flops = _flops_per_token(mc, params)
  state = train.create_train_state(params, mc, config, mesh, rng=jax.random.PRNGKey(1))
  del params
  step = train.make_train_step(mc, config, mesh)
  logprobs = train.make_compute_logprobs(mc, config, mesh)
  batch = train.shard_batch(host_batch, mesh)
  batch["old_logp"] = logprobs(state, batch)
  start = time.perf_counter()
  state, metrics = step(state, batch)
  jax.block_until_ready((state, metrics))
  compile_s = time.perf_counter() - start
  times = []
  for _ in range(_STEPS.value):
    start = time.perf_counter()
    state, metrics = step(state, batch)
    jax.block_until_ready((state, metrics))
    times.append(time.perf_counter() - start)
  loss = float(train.to_host(metrics)["loss"])
  step.throughput.read()  # start a fresh window
  for _ in range(_STEPS.value):
    state, metrics = step(state, batch)  # asynchronous: no wait per step
  async_tps = step.throughput.read()["tokens_per_second"]
  memory = step.lower(state, batch).compile().memory_analysis()  # cached: no recompile
  temp_mib = memory.temp_size_in_bytes / 2**20 if memory is not None else None
  step_s = statistics.median(times)
  tokens_per_s = _BATCH.value * _SEQ.value / step_s
  peak = _peak_flops(devices[0])
  mfu = flops * tokens_per_s / (peak * n) if peak else None
  return dict(
    layout=layout,
    gather=gather_mode or "-",
    step_ms=1e3 * step_s,
    tps=tokens_per_s,
    async_tps=async_tps,
    compile_s=compile_s,
    temp_mib=temp_mib,
    mfu=mfu,
    loss=loss,
  )


def main(argv):
  del argv
  if not 0 <= _PROMPT.value < _SEQ.value:
    raise app.UsageError(f"--prompt ({_PROMPT.value}) must be in [0, --seq={_SEQ.value}).")
  bad = sorted(set(_GATHER_MODES.value) - {"layer", "model"})
  if bad or not _GATHER_MODES.value:
    raise app.UsageError(f"--gather_modes must be a non-empty subset of layer,model, got {bad}.")
  mc = _model_config()
  host_batch = _batch(np.random.default_rng(0))
  runs = []
  for layout in _LAYOUTS.value:
    fsdp = int(layout.split("x")[1])
    modes = _GATHER_MODES.value if fsdp > 1 and _GATHER.value else [None]
    runs += [(layout, mode) for mode in modes]
  load_start = os.getloadavg()[0]
  rows = [_run_layout(layout, mode, mc, host_batch) for layout, mode in runs]
  base = rows[0]["tps"]
  device = jax.devices()[0]
  lines = [
    f"# train step tokens/s across mesh layouts ({device.platform}: {device.device_kind}, "
    f"{len(jax.devices())} devices, {os.cpu_count()} host cores)",
    "",
    f"Model: qwen2-style, {mc.num_layers} layers, width {mc.hidden_size}, heads "
    f"{mc.num_heads}/{mc.num_kv_heads}, vocab {mc.vocab_size}, {mc.param_dtype}. Batch "
    f"B={_BATCH.value} x S={_SEQ.value} (prompt {_PROMPT.value}), loss {_LOSS.value}, "
    f"micro_batches {_MICRO.value}, gather_fsdp_params {_GATHER.value}, median of "
    f"{_STEPS.value} synced steps after a compiling one, then {_STEPS.value} asynchronous "
    f"ones. 1-minute load average {load_start:.1f} at the start, {os.getloadavg()[0]:.1f} at "
    "the end.",
    "",
    "| layout (data x fsdp x tensor) | fsdp gather | step ms | tokens/s | async tok/s | ratio "
    "| compile s | temp MiB | MFU | loss |",
    "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
  ]
  for r in rows:
    mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "n/a (CPU)"
    temp = f"{r['temp_mib']:.1f}" if r["temp_mib"] is not None else "n/a"
    lines.append(
      f"| {r['layout']} | {r['gather']} | {r['step_ms']:.1f} | {r['tps']:.0f} | "
      f"{r['async_tps']:.0f} | {r['tps'] / base:.2f} | {r['compile_s']:.1f} | {temp} | "
      f"{mfu} | {r['loss']:.6f} |"
    )
  lines += _notes(rows, device)
  lines += ["", "Rerun: `python " + " ".join([sys.argv[0]] + _rerun_flags()) + "`", ""]
  table = "\n".join(lines)
  print(table)
  if _OUT.value:
    with open(_OUT.value, "w") as f:
      f.write(table)


def _notes(rows: list[dict], device: jax.Device) -> list[str]:
  """Reading notes computed from the rows (and what the platform implies)."""
  notes = []
  if device.platform == "cpu" and len(jax.devices()) > 1:
    notes.append(
      f"- The {len(jax.devices())} devices are fake host devices on the same "
      f"{os.cpu_count()} cores: the ratios compare partitionings (and their collectives) on "
      "one host, not a multi-device speed-up. Compare rows within one run."
    )
  losses = {f"{r['loss']:.6f}" for r in rows}
  if len(rows) > 1:
    notes.append(
      "- The loss is the same in every row: same step, same numbers, any layout and gather mode."
      if len(losses) == 1
      else f"- The loss differs across rows ({len(losses)} distinct values)."
    )
  by_layout = {}
  for r in rows:
    by_layout.setdefault(r["layout"], {})[r["gather"]] = r
  for layout, modes in by_layout.items():
    layer, model = modes.get("layer"), modes.get("model")
    if layer and model and layer["temp_mib"] and model["temp_mib"]:
      notes.append(
        f"- {layout}: the per-layer FSDP gather needs {layer['temp_mib']:.1f} MiB of XLA "
        f"temporaries per device against {model['temp_mib']:.1f} MiB for the whole-model "
        f"gather ({100 * (layer['temp_mib'] / model['temp_mib'] - 1):+.0f}%), at "
        f"{layer['step_ms'] / model['step_ms']:.2f}x its step time."
      )
  if device.platform == "cpu":
    notes.append("- MFU is printed only on an accelerator.")
  return ["", "Notes:", *notes] if notes else []


def _rerun_flags() -> list[str]:
  """The non-default flags of this run, to print the exact rerun command."""
  out = []
  for flag in (
    _LAYOUTS,
    _BATCH,
    _SEQ,
    _PROMPT,
    _LAYERS,
    _HIDDEN,
    _HEADS,
    _KV_HEADS,
    _VOCAB,
    _GATHER_MODES,
  ):
    f = flags.FLAGS[flag.name]
    if f.present:
      value = ",".join(f.value) if isinstance(f.value, list) else f.value
      out.append(f"--{flag.name}={value}")
  for flag in (_DTYPE, _MICRO, _LOSS, _GATHER, _STEPS, _OUT):
    f = flags.FLAGS[flag.name]
    if f.present:
      out.append(f"--{flag.name}={f.value}")
  return out


if __name__ == "__main__":
  app.run(main)
