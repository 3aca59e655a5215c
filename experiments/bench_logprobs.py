r"""Peak memory and time of chunked `token_logprobs` vs the naive full-logits computation.

Both paths run the same tiny policy (1 decoder layer) with a large vocabulary;
the naive path materialises `[B, S, V]` float32 logits (`forward` +
`logprobs_from_logits`), the chunked path applies the LM head `chunk_size`
positions at a time under `jax.checkpoint`. For each (method, mode) with mode
"value" (logp + entropy) or "value+grad" (gradient of a scalar of both w.r.t.
the params) it reports, side by side from one run:

  xla_temp_mb   temporary buffer bytes of the compiled program
                (`jit(...).lower(...).compile().memory_analysis()`), i.e. the
                peak scratch XLA plans for, excluding arguments and outputs;
  rss_peak_mb   peak resident memory of a fresh subprocess that runs only that
                variant, sampled every ~1 ms during its first call, minus its
                resident memory just before that call (params, inputs and the
                compiled program already resident);
  time_ms       median wall time of a call after one warm-up call.

Rerun (writes the table to stdout; `--out` also writes it to a file):

  python experiments/bench_logprobs.py \
    --out=experiments/results/logprobs_cpu.md

Defaults: B=2, S=512, hidden 256, V=152064 (Qwen2.5), chunk 128; ~1-2 minutes
on 2 CPU cores.
"""

import json
import os
import resource
import shlex
import statistics
import subprocess
import sys
import threading
import time

from absl import app, flags

_BATCH = flags.DEFINE_integer("batch", 2, "Sequences B.")
_SEQ = flags.DEFINE_integer("seq", 512, "Sequence length S.")
_HIDDEN = flags.DEFINE_integer("hidden", 256, "Model width D.")
_VOCAB = flags.DEFINE_integer("vocab", 152064, "Vocabulary size V.")
_CHUNK = flags.DEFINE_integer("chunk_size", 128, "Chunk size of token_logprobs.")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Timed calls per variant (median reported).")
_MODES = flags.DEFINE_list("modes", ["value", "value+grad"], "Modes to benchmark.")
_RSS = flags.DEFINE_bool("rss", True, "Also measure peak RSS, one subprocess per variant.")
_OUT = flags.DEFINE_string("out", None, "Optional file to write the markdown table to.")
_VARIANT = flags.DEFINE_string("variant", None, "Internal: run one 'method:mode' and print JSON.")

METHODS = ("naive", "chunked")


def _current_rss_mb() -> float:
  with open("/proc/self/statm") as f:
    return int(f.read().split()[1]) * resource.getpagesize() / 2**20


class _RssSampler:
  """Samples the current RSS every ~1 ms in a thread; `peak_mb` is the maximum seen."""

  def __init__(self):
    self.peak_mb = _current_rss_mb()
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._run, daemon=True)

  def _run(self):
    while not self._stop.is_set():
      self.peak_mb = max(self.peak_mb, _current_rss_mb())
      time.sleep(0.001)

  def __enter__(self):
    self._thread.start()
    return self

  def __exit__(self, *exc):
    self._stop.set()
    self._thread.join()
    self.peak_mb = max(self.peak_mb, _current_rss_mb())


def _setup():
  import jax
  import jax.numpy as jnp
  import numpy as np

  from rlx import policy

  config = policy.ModelConfig(
    family="qwen2",
    vocab_size=_VOCAB.value,
    hidden_size=_HIDDEN.value,
    num_layers=1,
    num_heads=4,
    num_kv_heads=2,
    head_dim=_HIDDEN.value // 4,
    intermediate_size=2 * _HIDDEN.value,
    attention_bias=True,
  )
  params = policy.init_params(config, jax.random.key(0))
  rng = np.random.default_rng(0)
  tokens = jnp.asarray(rng.integers(0, config.vocab_size, (_BATCH.value, _SEQ.value)), jnp.int32)
  mask = jnp.ones(tokens.shape, jnp.float32).at[:, : _SEQ.value // 4].set(0.0)
  return jax, policy, config, params, tokens, mask


def _make_fn(method: str, mode: str):
  jax, policy, config, params, tokens, mask = _setup()
  chunk = _CHUNK.value

  def values(p):
    if method == "naive":
      logits = policy.forward(p, config, tokens)
      return policy.logprobs_from_logits(logits, tokens, mask)
    return policy.token_logprobs(p, config, tokens, mask, chunk_size=chunk)

  if mode == "value":
    fn = values
  elif mode == "value+grad":

    def fn(p):
      def scalar(p):
        logp, entropy = values(p)
        return jax.numpy.sum(logp) + 0.01 * jax.numpy.sum(entropy)

      return jax.value_and_grad(scalar)(p)

  else:
    raise ValueError(f"unknown mode {mode!r}; expected 'value' or 'value+grad'.")
  return jax, jax.jit(fn), params


def _run_variant(method: str, mode: str, measure_rss: bool) -> dict:
  jax, fn, params = _make_fn(method, mode)
  jax.block_until_ready(params)
  compiled = fn.lower(params).compile()
  analysis = compiled.memory_analysis()
  temp_mb = analysis.temp_size_in_bytes / 2**20 if analysis is not None else float("nan")
  rss_before = _current_rss_mb()
  with _RssSampler() as sampler:
    jax.block_until_ready(compiled(params))  # first call, RSS sampled throughout
  times = []
  for _ in range(_REPEATS.value):
    start = time.perf_counter()
    jax.block_until_ready(compiled(params))
    times.append(time.perf_counter() - start)
  result = {"xla_temp_mb": temp_mb, "time_ms": 1e3 * statistics.median(times)}
  if measure_rss:
    result["rss_peak_mb"] = sampler.peak_mb - rss_before
  return result


def _subprocess_rss(method: str, mode: str) -> float:
  flag_names = ("batch", "seq", "hidden", "vocab", "chunk_size")
  args = [f"--{n}={flags.FLAGS[n].value}" for n in flag_names]
  out = subprocess.run(
    [sys.executable, os.path.abspath(__file__), f"--variant={method}:{mode}", "--repeats=1", *args],
    check=True,
    capture_output=True,
    text=True,
  ).stdout
  return json.loads(out.strip().splitlines()[-1])["rss_peak_mb"]


def main(argv):
  del argv
  if _VARIANT.value:
    method, mode = _VARIANT.value.split(":")
    print(json.dumps(_run_variant(method, mode, measure_rss=True)))
    return

  import jax

  rows = []
  for mode in _MODES.value:
    for method in METHODS:
      result = _run_variant(method, mode, measure_rss=False)
      result["rss_peak_mb"] = _subprocess_rss(method, mode) if _RSS.value else float("nan")
      rows.append((mode, method, result))
      print(f"done {method} {mode}: {result}", file=sys.stderr)

  b, s, v = _BATCH.value, _SEQ.value, _VOCAB.value
  logits_mb = b * s * v * 4 / 2**20
  lines = [
    "# token_logprobs: chunked vs naive (CPU)",
    "",
    f"B={b}, S={s}, hidden={_HIDDEN.value}, V={v}, chunk_size={_CHUNK.value}, 1 decoder layer, "
    f"float32; one [B, S, V] float32 logits tensor = {logits_mb:.0f} MiB.",
    f"jax {jax.__version__}, backend {jax.default_backend()}, {os.cpu_count()} CPU cores.",
    "",
    "| mode | method | xla_temp_mb | rss_peak_mb | time_ms |",
    "|---|---|---:|---:|---:|",
  ]
  by_key = {}
  for mode, method, r in rows:
    by_key[(mode, method)] = r
    lines.append(
      f"| {mode} | {method} | {r['xla_temp_mb']:.0f} | {r['rss_peak_mb']:.0f} | "
      f"{r['time_ms']:.0f} |"
    )
  lines += [
    "",
    "| mode | naive / chunked xla_temp | naive / chunked rss_peak | chunked / naive time |",
  ]
  lines.append("|---|---:|---:|---:|")
  for mode in _MODES.value:
    n, c = by_key[(mode, "naive")], by_key[(mode, "chunked")]
    lines.append(
      f"| {mode} | {n['xla_temp_mb'] / max(c['xla_temp_mb'], 1e-9):.1f}x | "
      f"{n['rss_peak_mb'] / max(c['rss_peak_mb'], 1e-9):.1f}x | "
      f"{c['time_ms'] / n['time_ms']:.2f}x |"
    )
  rerun = shlex.join(["python", "experiments/bench_logprobs.py", *sys.argv[1:]])
  lines += ["", f"Rerun: `{rerun}`", ""]
  table = "\n".join(lines)
  print(table)
  if _OUT.value:
    os.makedirs(os.path.dirname(os.path.abspath(_OUT.value)), exist_ok=True)
    with open(_OUT.value, "w") as f:
      f.write(table)


if __name__ == "__main__":
  app.run(main)
