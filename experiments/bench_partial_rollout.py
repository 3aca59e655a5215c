r"""Long-tail rollouts: synchronous vs continuous batching vs partial rollouts (APRIL), one process.

Workload: a random Qwen2-style policy sampled at temperature 1 with
`--stop_ids` stop tokens (ids V-K..V-1). A random policy is near uniform, so
each step stops with probability ~K/V: most responses are short and a few
run to the `--max_new_tokens` cap, and a group (G samples of one prompt) is
as long as its longest member. Every collection must deliver
`--target_groups` complete groups of G samples with the policy of that
collection (the version is bumped every collection, as after a train step).

Modes (same weights, prompts and slots; every mode keeps its own state):

  synchronous     `Sampler.generate` with static batching: a wave of
                  `--slots` requests runs until its longest row ends, then
                  the next wave is admitted (the classic synchronous rollout).
  continuous      `Sampler.generate` with continuous batching: a finished
                  slot is refilled at the next scheduling point; the call
                  still waits for the longest group.
  partial 1.5x/2x `rlx.sampling.RolloutEngine` (APRIL, Zhou et al. 2025,
                  https://arxiv.org/abs/2509.18521): ceil(x * target) groups
                  in flight (the buffered ones first), stop as soon as
                  `target` groups are complete, the rest is buffered and
                  resumed next collection by the newer policy (its KV
                  recomputed by prefill, counted in the time).

Each round runs one collection of every mode (interleaved, so machine load
hits all modes alike), after `--warmup` rounds (compiles, fills the buffers).
Reported: completed groups per second (target groups per collection over the
collection's wall time, median over rounds, and over the summed time),
slot utilisation (generated tokens / (decode steps * slots): the fraction of
slot-steps that produced a token), generated tokens/s, and for partial
rollouts the off-policy token fraction and mean staleness of the returned
tokens.

Rerun (prints the markdown table; `--out` also writes it):
  python experiments/bench_partial_rollout.py \
    --out=experiments/results/bench_partial_rollout_cpu.md
"""

import dataclasses
import math
import os
import platform
import shlex
import statistics
import sys
import time

import jax
import numpy as np
from absl import app, flags

from rlx import policy, sampling
from rlx.sampling import scheduling

_TARGET = flags.DEFINE_integer("target_groups", 16, "Complete groups per collection.")
_G = flags.DEFINE_integer("group", 4, "Samples per prompt (G).")
_SLOTS = flags.DEFINE_integer("slots", 32, "Concurrent slots (max_slots).")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 96, "Response length cap.")
_STOPS = flags.DEFINE_integer("stop_ids", 12, "Stop token ids K (the ids V-K..V-1).")
_VOCAB = flags.DEFINE_integer("vocab", 256, "Vocabulary size V.")
_ROUNDS = flags.DEFINE_integer("rounds", 8, "Measured rounds (one collection per mode each).")
_WARMUP = flags.DEFINE_integer("warmup", 2, "Unmeasured rounds first.")
_STEPS = flags.DEFINE_integer("steps_per_sync", 8, "Decode steps per device window.")
_CHUNKS = flags.DEFINE_list("prefill_chunk", ["16", "64"], "Prefill tokens per row and call.")
_OVER = flags.DEFINE_list("over_provision", ["1.5", "2.0"], "Partial-rollout factors.")
_OUT = flags.DEFINE_string("out", "", "Also write the markdown here.")


def _model():
  return policy.ModelConfig.small(
    "qwen2",
    vocab_size=_VOCAB.value,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
  )


def _compiles(sampler) -> int:
  """Programs compiled so far by the sampler's prefill and decode jits."""
  counts = sampler.compile_counts()
  return counts["prefill"] + counts["decode"]


class _Prompts:
  """Seeded random prompts of 4..16 tokens (ids below the stop ids), keyed 0, 1, ..."""

  def __init__(self, vocab: int, stops: int, seed: int):
    self.rng = np.random.default_rng(seed)
    self.hi = vocab - stops
    self.next = 0

  def __call__(self, n: int):
    out = []
    for _ in range(n):
      out.append((self.next, self.rng.integers(1, self.hi, int(self.rng.integers(4, 17))).tolist()))
      self.next += 1
    return out


def main(argv):
  del argv
  mc = _model()
  v, k = _VOCAB.value, _STOPS.value
  if not 1 <= k < v:
    raise app.UsageError(f"--stop_ids must be in [1, vocab={v}).")
  target, g, slots = _TARGET.value, _G.value, _SLOTS.value
  factors = [float(x) for x in _OVER.value]
  base = sampling.SamplerConfig(
    max_slots=slots,
    page_size=16,
    num_pages=max(slots, 1) * math.ceil((16 + _MAX_NEW.value) / 16) + 8,
    max_prompt_len=16,
    max_new_tokens=_MAX_NEW.value,
    temperature=1.0,
    stop_token_ids=tuple(range(v - k, v)),
    steps_per_sync=_STEPS.value,
  )
  params = policy.init_params(mc, jax.random.key(0))

  def versioned(version):  # a new policy every collection (as after a train step)
    return jax.tree.map(lambda x: x * (1.0 + 1e-3 * version), params)

  def sync_mode(sampler, seed):
    source = _Prompts(v, k, seed)

    def collect(p, rng, version):
      del version
      prompts = [pr for _, pr in source(target)]
      compiles = _compiles(sampler)
      t0 = time.perf_counter()
      out = sampler.generate(p, prompts, num_samples=g, rng=rng)
      wall = time.perf_counter() - t0
      st = out.stats
      return (
        wall, st["generated_tokens"], st["decode_steps"], 0.0, 0.0, st["syncs"], 0,
        st["prefill_tokens"], _compiles(sampler) - compiles,
      )  # fmt: skip

    return collect

  def partial_mode(cont, factor, seed):
    source = _Prompts(v, k, seed)
    engine = sampling.RolloutEngine(
      cont, num_samples=g, target_groups=target, over_provision=factor
    )

    def collect(p, rng, version):
      compiles = _compiles(cont)
      t0 = time.perf_counter()
      out = engine.collect(p, source, rng, policy_version=version)
      wall = time.perf_counter() - t0
      st = out.stats
      return (
        wall,
        st["generated_tokens"],
        st["decode_steps"],
        st["off_policy_token_fraction"],
        st["mean_staleness"],
        st["syncs"],
        st["groups_resumed"],
        st["prefill_tokens"],
        _compiles(cont) - compiles,
      )

    return collect

  modes, chunks = {}, [int(c) for c in _CHUNKS.value]
  for c in chunks:
    cfg = dataclasses.replace(base, prefill_chunk=c)
    static = sampling.Sampler(mc, dataclasses.replace(cfg, continuous_batching=False))
    cont = sampling.Sampler(mc, cfg)
    # Compile the prefill calls that fresh prompts make (every row bucket x every width
    # bucket up to the longest prompt) before measuring. Resumed samples prefill their
    # prompt + generated prefix, which can need wider calls: those compile when first met
    # and are counted in the table (compiles in the measured rounds).
    for smp in (static, cont):
      for rows in scheduling.prefill_rows(slots):
        for width in scheduling.prefill_widths(c):
          if width <= base.max_prompt_len:
            smp.generate(params, [[1] * width] * rows, num_samples=1, rng=jax.random.key(0))
    modes[(c, "synchronous (static batching)")] = sync_mode(static, 1)
    modes[(c, "continuous batching")] = sync_mode(cont, 1)
    for f in factors:
      modes[(c, f"partial rollout {f:g}x")] = partial_mode(cont, f, 1)
  records = {name: [] for name in modes}
  load_start = os.getloadavg()[0]
  key = jax.random.key(1)
  for r in range(_WARMUP.value + _ROUNDS.value):
    p = versioned(r)
    for name, collect in modes.items():
      res = collect(p, jax.random.fold_in(key, r), r)
      if r >= _WARMUP.value:
        records[name].append(res)

  lines = [
    f"## Long-tail rollout: {target} complete groups x G={g} per collection, {slots} slots",
    "",
    f"Random Qwen2-style policy (V={v}, 2 layers, width 64), temperature 1, {k} stop ids "
    f"(stop probability ~{k / v:.3f} per token), max_new_tokens={_MAX_NEW.value}, "
    f"steps_per_sync={_STEPS.value}; {_ROUNDS.value} measured rounds after {_WARMUP.value} "
    f"warm-up rounds, modes interleaved per round; a new policy version every collection. "
    f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
    f"jax {jax.__version__} on {jax.devices()[0].platform}; 1-minute load average "
    f"{load_start:.1f} before the measured rounds, {os.getloadavg()[0]:.1f} after them.",
    "",
    "| prefill chunk | mode | groups/s (median) | groups/s (total) | x sync | x continuous | "
    "slot util. | tokens/s | "
    "off-policy tokens | mean staleness | decode steps | host syncs | groups resumed | "
    "prefill tokens | compiles (measured rounds) |",
    "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
  ]
  sync_rate, cont_rate = {}, {}
  for (chunk, name), rec in records.items():
    if name == "continuous batching":
      cont_rate[chunk] = target / statistics.median([x[0] for x in rec])
  for (chunk, name), rec in records.items():
    walls = [x[0] for x in rec]
    toks = sum(x[1] for x in rec)
    steps = sum(x[2] for x in rec)
    med = target / statistics.median(walls)
    total = target * len(rec) / sum(walls)
    sync_rate.setdefault(chunk, med)
    util = toks / (steps * slots) if steps else 0.0
    offp = statistics.mean(x[3] for x in rec)
    stale = statistics.mean(x[4] for x in rec)
    lines.append(
      f"| {chunk} | {name} | {med:.2f} | {total:.2f} | {med / sync_rate[chunk]:.2f} | "
      f"{med / cont_rate[chunk]:.2f} | {util:.2f} | "
      f"{toks / sum(walls):.0f} | {offp:.2f} | {stale:.2f} | {steps / len(rec):.0f} | "
      f"{sum(x[5] for x in rec) / len(rec):.0f} | {sum(x[6] for x in rec) / len(rec):.1f} | "
      f"{sum(x[7] for x in rec) / len(rec):.0f} | {sum(x[8] for x in rec)} |"
    )
  lines += [
    "",
    "x sync / x continuous: median groups/s over the synchronous (static batching) / the "
    "continuous batching row of the same prefill chunk. Decode steps, host syncs "
    "and groups resumed are per collection; compiles: prefill / decode programs compiled "
    "during this mode's measured collections (their time is in those collections' wall time)."
    " Partial rollouts "
    "return groups whose early tokens came from older policy versions (off-policy tokens, "
    "staleness in versions); the trainer corrects them with the recorded per-token "
    "log-probs (`rlx.objectives.rollout_correction`). Prefill chunk: the most tokens per row "
    "of one prefill call (each call is padded to the smallest power-of-two width bucket that "
    "holds its longest piece, `rlx.sampling.scheduling.prefill_widths`); a resumed sample "
    "prefills its prompt and generated prefix again, in pieces of at most the chunk.",
    "",
    f"Rerun: `{shlex.join(['python', 'experiments/bench_partial_rollout.py', *sys.argv[1:]])}`",
  ]
  text = "\n".join(lines) + "\n"
  print(text)
  if _OUT.value:
    with open(_OUT.value, "w") as f:
      f.write(text)


if __name__ == "__main__":
  app.run(main)
