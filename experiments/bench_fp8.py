r"""FP8 rollout vs bf16 KV in one process: capacity at a fixed pool in bytes, refresh, mismatch.

One random Qwen2-style policy (N(0, 0.02) init plus N(0, gain^2 / fan_in)
noise on every kernel, `--weight_gain`, and N(0, 0.01) on the other leaves,
so next-token distributions are not flat), three
rollout variants of it, measured side by side (timed calls interleaved
across the variants so machine load hits them alike):

  bf16 KV        float32 weights (`weight_dtype="auto"`), `kv_dtype="bfloat16"`
  fp8 KV         float32 weights, `kv_dtype="fp8_e4m3"` (scales from
                 `rlx.sampling.calibrate_kv_scales`, K/V headroom 200/100)
  fp8 W8A8 + KV  `weight_dtype="fp8_e4m3"` (128x128 weight blocks, dynamic
                 1x128 activation groups, `fp8_blockwise_matmul`) + FP8 KV

Tables:

  capacity  Every variant gets the same pool in BYTES (`--pool_mib`), so an
            FP8 pool has twice the pages of a bf16 one. "max concurrent" is
            the number of full sequences (max_prompt + new tokens) the pool
            holds; the run then admits `--requests` prompts (default: as
            many as the largest capacity) into `max_slots` = that largest
            capacity, sampled at temperature
            1 with no stop token, and reports the measured mean concurrency
            (generated tokens / decode steps), preemptions and decode
            tokens/s (generated tokens over the call's wall time, median of
            `--repeats` calls after a warm-up).
  refresh   Cost of the per-update refresh on device: `quantize_params`
            (re-quantize every decoder linear) and `calibrate_kv_scales`
            (one trainer forward over `--calib_batch` x `--calib_len`
            tokens); median of `--repeats` after a warm-up, and the compile
            counts after several refreshes (must stay 1).
  mismatch  The sampled rollouts of each variant (capacity run) scored by
            the trainer (float32 `token_logprobs`): k1, k3 of
            `rlx.objectives.rollout_mismatch_kl`; and greedy agreement with
            the bf16-KV sampler on `--greedy_prompts` prompts: first tokens
            equal, and tokens generated before the first divergence.

CPU caveat: FP8 matmuls run as the XLA reference (upcast + float32 dots) on
CPU, so W8A8 is slower here, not faster; the byte savings are what carry to
GPU/TPU. The machine may be shared: see the load averages in the output.

Rerun (prints the markdown; `--out` also writes it):

  python experiments/bench_fp8.py --out=experiments/results/bench_fp8_cpu.md
"""

import dataclasses
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from rlx import objectives, policy, sampling

_LAYERS = flags.DEFINE_integer("layers", 4, "Decoder layers.")
_HIDDEN = flags.DEFINE_integer("hidden", 256, "Model width.")
_INTERMEDIATE = flags.DEFINE_integer("intermediate", 768, "MLP width.")
_HEADS = flags.DEFINE_integer("heads", 8, "Query heads (head_dim = hidden / heads).")
_KV_HEADS = flags.DEFINE_integer("kv_heads", 2, "KV heads.")
_VOCAB = flags.DEFINE_integer("vocab", 512, "Vocabulary size.")
_GAIN = flags.DEFINE_float(
  "weight_gain", 0.5, "Noise on every kernel: N(0, gain^2 / fan_in); other leaves N(0, 0.01)."
)
_PAGE = flags.DEFINE_integer("page_size", 16, "KV page size.")
_MAX_PROMPT = flags.DEFINE_integer("max_prompt", 32, "Longest prompt (prompts are 8..max).")
_NEW = flags.DEFINE_integer("new_tokens", 64, "max_new_tokens.")
_POOL_MIB = flags.DEFINE_float("pool_mib", 4.0, "KV pool size in MiB, the same for every variant.")
_REQUESTS = flags.DEFINE_integer(
  "requests", 0, "capacity: prompts per call (0: max_slots, the largest capacity)."
)
_SYNC = flags.DEFINE_integer("steps_per_sync", 16, "Decode steps per device window.")
_CALIB_BATCH = flags.DEFINE_integer("calib_batch", 16, "refresh: calibration batch rows.")
_CALIB_LEN = flags.DEFINE_integer("calib_len", 96, "refresh: calibration sequence length.")
_GREEDY_PROMPTS = flags.DEFINE_integer("greedy_prompts", 16, "mismatch: greedy prompts.")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Timed calls per measurement (median reported).")
_SMOKE = flags.DEFINE_bool("smoke", False, "Tiny settings for a quick check (tests).")
_NOTE = flags.DEFINE_string("note", "", "Free text for the header (e.g. machine load).")
_OUT = flags.DEFINE_string("out", None, "Optional file to write the markdown to.")

_OWN_FLAGS = {v.name for v in list(globals().values()) if isinstance(v, flags.FlagHolder)}
VARIANTS = (
  ("bf16 KV", "auto", "bfloat16"),
  ("fp8 KV", "auto", "fp8_e4m3"),
  ("fp8 W8A8 + KV", "fp8_e4m3", "fp8_e4m3"),
)


def _settings() -> dict:
  s = dict(
    layers=_LAYERS.value, hidden=_HIDDEN.value, intermediate=_INTERMEDIATE.value,
    heads=_HEADS.value, kv_heads=_KV_HEADS.value, vocab=_VOCAB.value, page=_PAGE.value,
    max_prompt=_MAX_PROMPT.value, new=_NEW.value, pool_mib=_POOL_MIB.value,
    requests=_REQUESTS.value, calib_batch=_CALIB_BATCH.value, calib_len=_CALIB_LEN.value,
    greedy_prompts=_GREEDY_PROMPTS.value, repeats=_REPEATS.value,
  )  # fmt: skip
  if _SMOKE.value:
    s.update(
      layers=1, hidden=32, intermediate=64, heads=4, kv_heads=2, vocab=64, page=4, max_prompt=8,
      new=4, pool_mib=0.0625 / 8, requests=0, calib_batch=2, calib_len=8, greedy_prompts=4,
      repeats=1,
    )  # fmt: skip
  return s


def _timed(fn, repeats: int) -> list[float]:
  out = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    out.append(time.perf_counter() - t0)
  return out


def _trainer_logprobs(params, mc, prompts, out):
  """Float32 trainer log-probs of each row's generated tokens, left-aligned [N, M]."""
  n, m = out.tokens.shape
  width = max(len(p) for p in prompts) + m
  seqs = np.zeros((n, width), np.int32)
  mask = np.zeros_like(seqs)
  for r in range(n):
    p, g = prompts[out.prompt_index[r]], out.lengths[r]
    seqs[r, : len(p)] = p
    seqs[r, len(p) : len(p) + g] = out.tokens[r, :g]
    mask[r, len(p) : len(p) + g] = 1
  logp, _ = jax.jit(policy.token_logprobs, static_argnums=1)(params, mc, seqs, mask)
  old = np.zeros((n, m), np.float32)
  for r in range(n):
    old[r, : out.lengths[r]] = np.asarray(logp[r])[mask[r].astype(bool)]
  return old


def _rerun_flags() -> list[str]:
  out = []
  for name in flags.FLAGS:
    f = flags.FLAGS[name]
    if f.present and name in _OWN_FLAGS and name != "out":
      out.append(f"--{name}={f.value}")
  return out


def main(argv):
  del argv
  s = _settings()
  mc = policy.ModelConfig.small(
    "qwen2", num_layers=s["layers"], hidden_size=s["hidden"],
    intermediate_size=s["intermediate"], num_heads=s["heads"], num_kv_heads=s["kv_heads"],
    head_dim=s["hidden"] // s["heads"], vocab_size=s["vocab"],
  )  # fmt: skip
  params = policy.init_params(mc, jax.random.key(0))
  noise = np.random.default_rng(0)

  def perturb(path, x):
    std = _GAIN.value / np.sqrt(x.shape[-2]) if path[-1].key == "kernel" else 0.1
    return x + jnp.asarray(std * noise.normal(size=x.shape), x.dtype)

  params = jax.tree_util.tree_map_with_path(perturb, params)
  rng = np.random.default_rng(1)
  lo = min(8, s["max_prompt"])
  seq_len = s["max_prompt"] + s["new"]
  calib = jnp.asarray(rng.integers(0, s["vocab"], size=(s["calib_batch"], s["calib_len"])))
  kv_scales = sampling.calibrate_kv_scales(params, mc, calib)
  budget = int(s["pool_mib"] * 2**20)

  # Pools of equal bytes; slots = the largest capacity (so the pool, not the slots, limits).
  plans = []
  for name, wdt, kdt in VARIANTS:
    itemsize = jnp.dtype(sampling.KV_DTYPES[kdt]).itemsize
    page_bytes = 2 * mc.num_layers * mc.num_kv_heads * s["page"] * mc.head_dim * itemsize
    pages = budget // page_bytes
    pps = -(-(seq_len - 1) // s["page"])
    plans.append((name, wdt, kdt, pages, pages // pps, page_bytes))
  slots = max(p[4] for p in plans)
  num_requests = s["requests"] or slots
  prompts = [
    list(rng.integers(0, s["vocab"], size=int(rng.integers(lo, s["max_prompt"] + 1))))
    for _ in range(num_requests)
  ]
  base = dict(
    page_size=s["page"], max_prompt_len=s["max_prompt"], max_new_tokens=s["new"],
    steps_per_sync=_SYNC.value, prefill_chunk=s["max_prompt"], temperature=1.0,
  )  # fmt: skip
  runs = []
  for name, wdt, kdt, pages, capacity, page_bytes in plans:
    if capacity < 1:
      raise app.UsageError(f"--pool_mib={s['pool_mib']} holds no full sequence for {name}.")
    cfg = sampling.SamplerConfig(
      max_slots=slots, num_pages=pages, weight_dtype=wdt, kv_dtype=kdt, **base
    )
    runs.append((name, cfg, sampling.Sampler(mc, cfg), capacity, page_bytes))

  def scales_for(cfg):
    return kv_scales if cfg.kv_dtype.startswith("fp8") else None

  def call(sampler, p, key=0):
    return sampler.generate(
      p, prompts, rng=jax.random.key(key), kv_scales=scales_for(sampler.config)
    )

  rollout = {name: sampling.quantize_params(params, cfg) for name, cfg, *_ in runs}
  outs = {name: call(smp, rollout[name]) for name, _, smp, *_ in runs}  # warm-up (compiles)
  tps = {name: [] for name, *_ in runs}
  for rep in range(s["repeats"]):
    for name, _, smp, *_ in runs:
      outs[name] = call(smp, rollout[name], key=1 + rep)
      tps[name].append(outs[name].stats["tokens_per_s"])

  load = os.getloadavg()[0]
  device = jax.devices()[0]
  lines = [
    f"# FP8 rollout benchmark ({device.platform}: {device.device_kind}, {os.cpu_count()} host "
    f"cores, 1-minute load average {load:.1f} after the capacity runs)",
    "",
    f"Model: qwen2-style, {mc.num_layers} layers, width {mc.hidden_size}, MLP "
    f"{mc.intermediate_size}, heads {mc.num_heads}/{mc.num_kv_heads} (head_dim {mc.head_dim}), "
    f"vocab {mc.vocab_size}, float32 params, weight gain {_GAIN.value}. Prompts 8-"
    f"{s['max_prompt']} tokens, {s['new']} new tokens at temperature 1, page {s['page']}, "
    f"KV pool {budget / 2**20:.3g} MiB for every variant, max_slots {slots}, "
    f"{num_requests} prompts per call. Median of {s['repeats']} calls after a warm-up.",
  ]
  if _NOTE.value:
    lines += ["", _NOTE.value]
  ref_cap = runs[0][3]
  lines += [
    "",
    "## Capacity and decode speed at a fixed KV pool in bytes",
    "",
    "| variant | KV bytes/token | pages | max concurrent seqs | vs bf16 | measured mean "
    "concurrency | preemptions | decode tokens/s | tokens/s vs bf16 |",
    "|---|---|---|---|---|---|---|---|---|",
  ]
  ref_tps = statistics.median(tps[runs[0][0]])
  for name, cfg, _, capacity, page_bytes in runs:
    st = outs[name].stats
    lines.append(
      f"| {name} | {page_bytes / s['page']:.0f} | {cfg.num_pages} | {capacity} | "
      f"{capacity / ref_cap:.2f}x | {st['generated_tokens'] / max(st['decode_steps'], 1):.1f} | "
      f"{st['preemptions']} | {statistics.median(tps[name]):.0f} | "
      f"{statistics.median(tps[name]) / ref_tps:.2f}x |"
    )

  # Refresh cost.
  fp8_cfg = runs[2][1]
  quant = lambda p: sampling.quantize_params(p, fp8_cfg)  # noqa: E731
  calib_fn = lambda p: sampling.calibrate_kv_scales(p, mc, calib)  # noqa: E731
  jax.block_until_ready((quant(params), calib_fn(params)))
  reps = max(3, s["repeats"])
  news = [jax.tree.map(lambda x, i=i: x * (1 + 1e-3 * i), params) for i in range(reps)]
  jax.block_until_ready(news)
  it = iter(news)
  t_quant = _timed(lambda: quant(next(it)), reps)
  it = iter(news)
  t_calib = _timed(lambda: calib_fn(next(it)), reps)
  fp8_counts = sampling.fp8_compile_counts()
  compiles = (
    fp8_counts["quantize_params"],
    fp8_counts["calibrate_kv_scales"],
    runs[2][2].compile_counts()["decode"],
  )
  gen_s = outs["fp8 W8A8 + KV"].stats["wall_s"]  # one rollout call of the FP8 variant
  n_weights = sum(
    int(np.prod(params["layers"][g][n]["kernel"].shape)) for g, n in policy.LINEAR_KERNELS
  )
  lines += [
    "",
    "## Refresh after a policy update (on device, jitted)",
    "",
    "| step | median ms | vs one rollout call | compiles after refreshes |",
    "|---|---|---|---|",
    f"| quantize_params ({n_weights / 1e6:.2f} M decoder weights -> FP8 blocks) | "
    f"{1e3 * statistics.median(t_quant):.1f} | {statistics.median(t_quant) / gen_s:.3f}x | "
    f"{compiles[0]} |",
    f"| calibrate_kv_scales (forward over {s['calib_batch']} x {s['calib_len']} tokens) | "
    f"{1e3 * statistics.median(t_calib):.1f} | {statistics.median(t_calib) / gen_s:.3f}x | "
    f"{compiles[1]} |",
    f"| sampler decode loop (new params + scales each call) | - | - | {compiles[2]} |",
  ]

  # Mismatch vs the trainer and greedy agreement.
  lines += [
    "",
    "## Rollout-training mismatch (trainer float32 log-probs of each variant's own samples)",
    "",
    "| variant | k1 | k3 | greedy first tokens equal | greedy tokens before first divergence |",
    "|---|---|---|---|---|",
  ]
  gprompts = prompts[: s["greedy_prompts"]]
  greedy = {}
  for name, cfg, *_ in runs:
    gcfg = dataclasses.replace(
      cfg, temperature=0.0, max_slots=len(gprompts), num_pages=max(cfg.num_pages, len(gprompts)
      * cfg.pages_per_sequence)
    )  # fmt: skip
    greedy[name] = sampling.Sampler(mc, gcfg).generate(
      params, gprompts, rng=jax.random.key(0), kv_scales=scales_for(cfg)
    )
  ref = greedy[runs[0][0]]
  for name, *_ in runs:
    out = outs[name]
    old = _trainer_logprobs(params, mc, prompts, out)
    valid = np.arange(out.tokens.shape[1])[None] < out.lengths[:, None]
    kl = objectives.rollout_mismatch_kl(old, out.logprobs, valid)
    g = greedy[name]
    first = float(np.mean(g.tokens[:, 0] == ref.tokens[:, 0]))
    diff = g.tokens != ref.tokens
    prefix = np.where(diff.any(1), diff.argmax(1), g.tokens.shape[1])
    lines.append(
      f"| {name} | {float(kl.k1):.2e} | {float(kl.k3):.2e} | {first:.2f} | "
      f"{prefix.sum() / ref.lengths.sum():.2f} |"
    )
  rerun = " ".join(["python", sys.argv[0], *_rerun_flags()])
  lines += [
    "",
    f"(load average {os.getloadavg()[0]:.1f} at the end.) Rerun: `{rerun}`",
    "",
  ]
  text = "\n".join(lines)
  print(text, flush=True)
  if _OUT.value:
    with open(_OUT.value, "w") as f:
      f.write(text)


if __name__ == "__main__":
  app.run(main)
