r"""Compile (first-call) time and steady-state tokens/s: rlx.sampling vs Tunix's vanilla sampler.

Both samplers run the same Qwen2-style architecture with the same weights
(rlx's random init copied into Tunix's `tunix.models.qwen2.model.Qwen2`), the
same batch of B prompts of the same length, the same number of new tokens and
no stop token (every row runs to `--new_tokens`), in one process:

  rlx     `rlx.sampling.Sampler(...).generate` (paged KV cache, continuous
          batching, `--steps_per_sync` decode steps per device window).
  tunix   `tunix.generate.sampler.Sampler(model, tokenizer, CacheConfig)`
          called on the prompts as strings of token ids (a whitespace
          tokenizer: its host-side encode/decode is part of its call), with
          `return_logprobs=True` (rlx always records log-probs); greedy, or
          `top_p=1.0` at temperature T (Tunix's categorical draw); its own
          left-padded dense KV cache, one jitted prefill and one jitted
          `lax.while_loop` of decode steps.

Compile table: each row is the first call of a freshly built sampler after
`jax.clear_caches()` (and, for rlx, after dropping its shared-engine cache), so
every program it runs is traced and compiled again; rounds are interleaved
across rows (after one warm-up round that is not counted) and the median is
reported: wall and process CPU time of the first call (construction
included), the XLA compile time and the number of programs compiled
(`jax.monitoring` compile events). Speed table: the median wall time of
`--repeats` warm calls, interleaved across rows; tokens/s counts B *
new_tokens. Greedy rows also report how many rows produce rlx's greedy tokens
(float32, same weights: they must agree).

Install Tunix for this benchmark only (its pinned dependencies would change
transformers / huggingface_hub in this environment; the generate and qwen2
modules need only flax, jax and sentencepiece):

  pip install --no-deps google-tunix==0.1.7 && pip install sentencepiece

`tunix/__init__.py` imports every Tunix subpackage (RL, SFT, metrics, ...);
when those dependencies are missing this script imports just
`tunix.generate.sampler` and `tunix.models.qwen2.model` from the installed
package. Without Tunix the Tunix rows are skipped with a message.

Rerun (prints the markdown tables; `--out` also writes them to a file):

  python experiments/bench_sampler_compile.py \
    --out=experiments/results/bench_sampler_compile_cpu.md

Defaults: the main job's model (2 layers, width 64, MLP 192, 4/2 heads,
vocab 17, float32), B=64 prompts of 16 tokens, 48 new tokens; ~3 minutes on
2 CPU cores.
"""

import collections
import importlib
import importlib.util
import os
import statistics
import sys
import time
import types
from collections.abc import Callable

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from rlx import policy, sampling

_LAYERS = flags.DEFINE_integer("layers", 2, "Decoder layers.")
_HIDDEN = flags.DEFINE_integer("hidden", 64, "Model width.")
_INTERMEDIATE = flags.DEFINE_integer("intermediate", 192, "MLP width.")
_HEADS = flags.DEFINE_integer("heads", 4, "Query heads (head_dim = hidden / heads).")
_KV_HEADS = flags.DEFINE_integer("kv_heads", 2, "KV heads.")
_VOCAB = flags.DEFINE_integer("vocab", 17, "Vocabulary size.")
_BATCH = flags.DEFINE_integer("batch", 64, "B: prompts per call (rlx max_slots).")
_PROMPT = flags.DEFINE_integer("prompt_len", 16, "Tokens per prompt (all prompts).")
_NEW = flags.DEFINE_integer("new_tokens", 48, "New tokens per row (no stop token).")
_PAGE = flags.DEFINE_integer("page_size", 8, "rlx KV page size.")
_SYNC = flags.DEFINE_integer("steps_per_sync", 16, "rlx decode steps per device window.")
_TEMPS = flags.DEFINE_list("temperatures", ["0", "1"], "Temperatures (0 = greedy), one row each.")
_TRUNC = flags.DEFINE_bool(
  "truncation", True, "Speed table: also T=1 with top-k 8 / top-p 0.9 (both samplers)."
)
_SAMPLERS = flags.DEFINE_list("samplers", ["rlx", "tunix"], "Samplers to run.")
_ROUNDS = flags.DEFINE_integer("compile_rounds", 3, "Timed first calls per row (median).")
_REPEATS = flags.DEFINE_integer("repeats", 21, "Timed warm calls per row (median).")
_NOTE = flags.DEFINE_string("note", "", "Free text for the table header (e.g. machine load).")
_OUT = flags.DEFINE_string("out", None, "Optional file to write the markdown tables to.")

_INSTALL = "pip install --no-deps google-tunix==0.1.7 && pip install sentencepiece"


# ------------------------------------------------------------------------------------------
# Workload.


def _model_config() -> policy.ModelConfig:
  return policy.ModelConfig(
    family="qwen2",
    vocab_size=_VOCAB.value,
    hidden_size=_HIDDEN.value,
    num_layers=_LAYERS.value,
    num_heads=_HEADS.value,
    num_kv_heads=_KV_HEADS.value,
    head_dim=_HIDDEN.value // _HEADS.value,
    intermediate_size=_INTERMEDIATE.value,
    attention_bias=True,
  )


def _prompts(seed: int, n: int, length: int, vocab: int) -> list[list[int]]:
  """n prompts of `length` ids uniform in [1, vocab)."""
  rng = np.random.default_rng(seed)
  return [rng.integers(1, vocab, length).tolist() for _ in range(n)]


def _params(mc: policy.ModelConfig):
  """rlx's random init with kernels and embeddings scaled to std 0.5 (from 0.02): peaked
  next-token distributions, so greedy argmaxes are rarely near ties and the two samplers'
  float32 greedy tokens can be compared."""

  def scale(path, x):
    return x * 25.0 if path[-1].key in ("kernel", "embedding") else x

  return jax.tree_util.tree_map_with_path(scale, policy.init_params(mc, jax.random.key(0)))


class Row:
  """One sampler at one sampling setting: `make()` builds it, `call(s)` runs the prompts."""

  def __init__(self, name: str, make: Callable, call: Callable, greedy: bool):
    self.name, self.make, self.call, self.greedy = name, make, call, greedy


def _rlx_row(mc, params, prompts, temperature, top_k=0, top_p=1.0) -> Row:
  pps = -(-(_PROMPT.value + _NEW.value - 1) // _PAGE.value)
  cfg = sampling.SamplerConfig(
    max_slots=_BATCH.value,
    page_size=_PAGE.value,
    num_pages=_BATCH.value * pps,
    max_prompt_len=_PROMPT.value,
    max_new_tokens=_NEW.value,
    temperature=temperature,
    top_k=top_k,
    top_p=top_p,
    stop_token_ids=(),
    steps_per_sync=_SYNC.value,
  )
  key = jax.random.key(1)

  def make():
    sampling.clear_compile_cache()  # fresh jitted functions: they compile again
    return sampling.Sampler(mc, cfg)

  def call(sampler):
    return np.asarray(sampler.generate(params, prompts, rng=key).tokens)

  name = _row_name("rlx", temperature, top_k, top_p)
  return Row(name, make, call, temperature == 0.0)


def _row_name(sampler: str, temperature: float, top_k: int, top_p: float) -> str:
  if temperature == 0.0:
    return f"{sampler} greedy"
  trunc = f", top-k {top_k} / top-p {top_p}" if top_k or top_p < 1.0 else ""
  return f"{sampler} T={temperature:g}{trunc}"


# ------------------------------------------------------------------------------------------
# Tunix.


def _import_tunix():
  """(sampler module, qwen2 model module) or None when Tunix is not installed."""
  try:
    if importlib.util.find_spec("tunix") is None:
      return None
  except (ImportError, ValueError):
    return None
  try:
    import tunix  # noqa: F401, PLC0415 (optional)
  except ImportError:
    # The package __init__ imports every Tunix subpackage; load only what is used.
    spec = importlib.util.find_spec("tunix")
    pkg = types.ModuleType("tunix")
    pkg.__path__ = list(spec.submodule_search_locations)
    sys.modules["tunix"] = pkg
  sampler = importlib.import_module("tunix.generate.sampler")
  qwen2 = importlib.import_module("tunix.models.qwen2.model")
  return sampler, qwen2


class _IdTokenizer:
  """Token ids as whitespace-separated text (the tokenizer interface Tunix's Sampler takes).

  Tunix's decode masks out every cached position holding the pad id, so the pad id is
  the vocabulary size (a token the model never emits), not 0.
  """

  def __init__(self, pad_id: int):
    self._pad = pad_id

  def encode(self, text, **kwargs):
    del kwargs
    return [int(t) for t in text.split()]

  def decode(self, ids, **kwargs):
    del kwargs
    return " ".join(str(int(i)) for i in ids)

  def bos_id(self):
    return 0  # falsy: Tunix prepends no BOS

  def eos_id(self):
    return self._pad

  def pad_id(self):
    return self._pad


def _tunix_model(tunix_qwen2, mc: policy.ModelConfig, params):
  """Tunix's nnx `Qwen2` with rlx's weights (same architecture and sizes)."""
  from flax import nnx  # noqa: PLC0415 (optional, with Tunix)

  cfg = tunix_qwen2.ModelConfig(
    num_layers=mc.num_layers,
    vocab_size=mc.vocab_size,
    embed_dim=mc.hidden_size,
    hidden_dim=mc.intermediate_size,
    num_heads=mc.num_heads,
    head_dim=mc.head_dim,
    num_kv_heads=mc.num_kv_heads,
    rope_theta=int(mc.rope_theta),
    norm_eps=mc.rms_norm_eps,
    use_tied_embedding=mc.tie_embeddings,
  )
  model = tunix_qwen2.Qwen2(cfg, rngs=nnx.Rngs(0))
  p = jax.tree.map(np.asarray, params)
  d, h, hkv, dh = mc.hidden_size, mc.num_heads, mc.num_kv_heads, mc.head_dim
  model.embedder.input_embedding.value = jnp.asarray(p["embed"]["embedding"])
  model.final_norm.w.value = jnp.asarray(p["final_norm"]["scale"])
  if not mc.tie_embeddings:
    model.lm_head.w.value = jnp.asarray(p["lm_head"]["kernel"])
  layers = p["layers"]
  for i, layer in enumerate(model.layers):
    attn, mlp = layers["attn"], layers["mlp"]
    layer.input_layernorm.w.value = jnp.asarray(layers["input_norm"]["scale"][i])
    layer.post_attention_layernorm.w.value = jnp.asarray(layers["post_attn_norm"]["scale"][i])
    layer.attn.q_proj.w.value = jnp.asarray(attn["q_proj"]["kernel"][i].reshape(d, h, dh))
    layer.attn.k_proj.w.value = jnp.asarray(attn["k_proj"]["kernel"][i].reshape(d, hkv, dh))
    layer.attn.v_proj.w.value = jnp.asarray(attn["v_proj"]["kernel"][i].reshape(d, hkv, dh))
    layer.attn.o_proj.w.value = jnp.asarray(attn["o_proj"]["kernel"][i].reshape(h, dh, d))
    layer.attn.q_bias.value = jnp.asarray(attn["q_proj"]["bias"][i])
    layer.attn.k_bias.value = jnp.asarray(attn["k_proj"]["bias"][i])
    layer.attn.v_bias.value = jnp.asarray(attn["v_proj"]["bias"][i])
    layer.mlp.gate_proj.kernel.value = jnp.asarray(mlp["gate_proj"]["kernel"][i])
    layer.mlp.up_proj.kernel.value = jnp.asarray(mlp["up_proj"]["kernel"][i])
    layer.mlp.down_proj.kernel.value = jnp.asarray(mlp["down_proj"]["kernel"][i])
  return model


def _tunix_row(tunix, model, mc, prompts, temperature, top_k=0, top_p=1.0) -> Row:
  tsampler, _ = tunix
  p, m, v = _PROMPT.value, _NEW.value, mc.vocab_size
  texts = [" ".join(map(str, x)) for x in prompts]
  cache = tsampler.CacheConfig(
    cache_size=p + m, num_layers=mc.num_layers, num_kv_heads=mc.num_kv_heads, head_dim=mc.head_dim
  )
  kwargs = dict(
    max_generation_steps=m,
    max_prompt_length=p,
    temperature=temperature,
    eos_tokens=[v],  # outside the vocabulary: no row stops early
    return_logprobs=True,
  )
  if temperature > 0:
    kwargs.update(top_p=top_p, top_k=top_k or None, seed=1)

  def make():
    return tsampler.Sampler(model, _IdTokenizer(v), cache)

  def call(sampler):
    out = sampler(texts, **kwargs)
    return np.asarray([np.pad(np.asarray(t)[:m], (0, m - min(len(t), m))) for t in out.tokens])

  return Row(_row_name("tunix", temperature, top_k, top_p), make, call, temperature == 0.0)


# ------------------------------------------------------------------------------------------
# Measurement.


class _CompileEvents:
  """Sums `jax.monitoring` compile durations (XLA backend compile; number of programs)."""

  def __init__(self):
    self.backend_s = 0.0
    self.programs = 0
    jax.monitoring.register_event_duration_secs_listener(self._listen)

  def _listen(self, event, duration, **kwargs):
    del kwargs
    if event == "/jax/core/compile/backend_compile_duration":
      self.backend_s += duration
      self.programs += 1

  def reset(self):
    self.backend_s, self.programs = 0.0, 0


def _first_call(row: Row, events: _CompileEvents) -> dict:
  jax.clear_caches()
  events.reset()
  start, start_cpu = time.perf_counter(), time.process_time()
  sampler = row.make()
  tokens = row.call(sampler)
  return dict(
    wall=time.perf_counter() - start,
    cpu=time.process_time() - start_cpu,
    xla=events.backend_s,
    programs=events.programs,
    sampler=sampler,
    tokens=tokens,
  )


def _compile_table(rows: list[Row], events: _CompileEvents) -> tuple[list[str], dict]:
  """First calls: one untimed warm-up round, then `--compile_rounds` interleaved rounds."""
  for row in rows:
    _first_call(row, events)
  runs = collections.defaultdict(list)
  for _ in range(_ROUNDS.value):
    for row in rows:
      runs[row.name].append(_first_call(row, events))
  med = {
    name: {k: statistics.median(r[k] for r in rs) for k in ("wall", "cpu", "xla", "programs")}
    for name, rs in runs.items()
  }
  lines = [
    f"## Compile: first call of a fresh sampler (B={_BATCH.value}, prompts of {_PROMPT.value} "
    f"tokens, {_NEW.value} new tokens; median of {_ROUNDS.value} rounds)",
    "",
    "| sampler | first call s | first call CPU s | XLA compile s | programs compiled | "
    "rlx / tunix (wall) | rlx / tunix (CPU) |",
    "|---|---:|---:|---:|---:|---:|---:|",
  ]
  for row in rows:
    m = med[row.name]
    other = row.name.replace("rlx", "tunix") if row.name.startswith("rlx") else None
    wall_r = cpu_r = "-"
    if other in med:
      wall_r = f"{m['wall'] / med[other]['wall']:.2f}x"
      cpu_r = f"{m['cpu'] / med[other]['cpu']:.2f}x"
    lines.append(
      f"| {row.name} | {m['wall']:.2f} | {m['cpu']:.2f} | {m['xla']:.2f} | {m['programs']:.0f} | "
      f"{wall_r} | {cpu_r} |"
    )
  single = _PROMPT.value + _NEW.value - 2 <= sampling.SamplerConfig.prefill_chunk
  lines += [
    "",
    "Target: rlx's first call <= 1.5x Tunix's at the same setting. rlx prefill: "
    + (
      "every prefill fits one chunk (prompt_len + new_tokens - 2 <= prefill_chunk), so its "
      "start position compiles as the constant 0."
      if single
      else "a preempted row may need several chunks, so the chunk attention to earlier "
      "pages is compiled in."
    ),
  ]
  last = {name: rs[-1] for name, rs in runs.items()}
  return lines, last


def _speed_table(rows: list[Row], built: dict) -> list[str]:
  calls = {row.name: (row, built[row.name]["sampler"]) for row in rows}
  tokens = {name: row.call(s) for name, (row, s) in calls.items()}  # warm-up
  times = collections.defaultdict(list)
  cpu = collections.defaultdict(list)
  for _ in range(_REPEATS.value):
    for name, (row, s) in calls.items():
      start, start_cpu = time.perf_counter(), time.process_time()
      tokens[name] = row.call(s)
      times[name].append(time.perf_counter() - start)
      cpu[name].append(time.process_time() - start_cpu)
  n = _BATCH.value * _NEW.value
  tps = {name: n / statistics.median(t) for name, t in times.items()}
  greedy = {row.name.split()[0]: row.name for row in rows if row.greedy}
  ref = tokens.get(greedy.get("rlx"))
  lines = [
    f"## Steady state: tokens/s (B={_BATCH.value}, prompts of {_PROMPT.value} tokens, "
    f"{_NEW.value} new tokens, no stop token; median of {_REPEATS.value} warm calls)",
    "",
    "| sampler | wall s | tokens/s | vs own greedy | rlx / tunix | CPU s | same tokens as rlx |",
    "|---|---:|---:|---:|---:|---:|---:|",
  ]
  for row in rows:
    name = row.name
    own = greedy.get(name.split()[0])
    vs_greedy = f"{tps[name] / tps[own]:.2f}x" if own in tps else "-"
    other = name.replace("rlx", "tunix") if name.startswith("rlx") else None
    vs_tunix = f"{tps[name] / tps[other]:.2f}x" if other in tps else "-"
    same = "-"
    if row.greedy and ref is not None:
      same = f"{np.mean(np.all(tokens[name] == ref, axis=1)):.0%}"
    lines.append(
      f"| {name} | {statistics.median(times[name]):.3f} | {tps[name]:.0f} | {vs_greedy} | "
      f"{vs_tunix} | {statistics.median(cpu[name]):.3f} | {same} |"
    )
  lines += ["", "Target: rlx at T=1 (no top-k / top-p) >= 0.95x rlx greedy."]
  return lines


def _decode_ops(row: Row) -> set[str]:
  """Primitive names in the jaxpr of rlx's decode window (traced, not compiled)."""
  sampler = row.make()
  params = jax.eval_shape(lambda: policy.init_params(sampler.model_config, jax.random.key(0)))
  jaxpr = sampler.trace_decode(params).jaxpr
  names = set()

  def walk(x):
    if isinstance(x, jax.extend.core.ClosedJaxpr):
      x = x.jaxpr
    if isinstance(x, jax.extend.core.Jaxpr):
      for eqn in x.eqns:
        names.add(eqn.primitive.name)
        for v in eqn.params.values():
          for sub in v if isinstance(v, tuple | list) else (v,):
            walk(sub)

  walk(jaxpr.jaxpr)
  return names


# ------------------------------------------------------------------------------------------
# Main.


def _rerun_flags() -> list[str]:
  out = []
  for name in flags.FLAGS:
    f = flags.FLAGS[name]
    if f.present and name in _OWN_FLAGS and name != "out":
      value = ",".join(f.value) if isinstance(f.value, list) else f.value
      out.append(f"--{name}={value}")
  return out


_OWN_FLAGS = {v.name for v in list(globals().values()) if isinstance(v, flags.FlagHolder)}


def main(argv):
  del argv
  bad = sorted(set(_SAMPLERS.value) - {"rlx", "tunix"})
  if bad:
    raise app.UsageError(f"--samplers: unknown {bad}; expected a subset of rlx,tunix.")
  temps = [float(t) for t in _TEMPS.value]
  mc = _model_config()
  params = _params(mc)
  prompts = _prompts(0, _BATCH.value, _PROMPT.value, mc.vocab_size)
  settings = [(t, 0, 1.0) for t in temps]
  trunc = [(1.0, 8, 0.9)] if _TRUNC.value else []
  notes = []
  rows, speed_rows = [], []
  if "rlx" in _SAMPLERS.value:
    rows += [_rlx_row(mc, params, prompts, *s) for s in settings]
    speed_rows += [_rlx_row(mc, params, prompts, *s) for s in trunc]
  tunix = _import_tunix() if "tunix" in _SAMPLERS.value else None
  if "tunix" in _SAMPLERS.value and tunix is None:
    msg = f"Tunix is not installed: its rows are skipped (install: `{_INSTALL}`)."
    print(msg, flush=True)
    notes.append(msg)
  if tunix is not None:
    model = _tunix_model(tunix[1], mc, params)
    rows += [_tunix_row(tunix, model, mc, prompts, *s) for s in settings]
    speed_rows += [_tunix_row(tunix, model, mc, prompts, *s) for s in trunc]
  rerun = " ".join(["python", sys.argv[0], *_rerun_flags()])
  device = jax.devices()[0]
  start = time.perf_counter()
  lines = [
    f"# rlx.sampling vs Tunix: compile time and tokens/s ({device.platform}: "
    f"{device.device_kind}, {os.cpu_count()} host cores, load average "
    f"{os.getloadavg()[0]:.1f} at the start)",
    "",
    f"Model: qwen2-style, {mc.num_layers} layers, width {mc.hidden_size}, MLP "
    f"{mc.intermediate_size}, heads {mc.num_heads}/{mc.num_kv_heads}, vocab {mc.vocab_size}, "
    f"float32, the same weights in both samplers (random, std 0.5). rlx: page {_PAGE.value}, "
    f"steps_per_sync "
    f"{_SYNC.value}, a pool of B full sequences.",
    *(["", _NOTE.value] if _NOTE.value else []),
    *(["", *notes] if notes else []),
    "",
  ]
  print("\n".join(lines), flush=True)
  events = _CompileEvents()
  table, built = _compile_table(rows, events)
  for row in speed_rows:  # not in the compile table: build them once
    built[row.name] = _first_call(row, events)
  table += ["", *_speed_table(rows + speed_rows, built)]
  rlx_off = [r for r in rows if r.name.startswith("rlx") and not r.greedy]
  rlx_on = [r for r in speed_rows if r.name.startswith("rlx")]
  if rlx_off:
    ops = _decode_ops(rlx_off[0])
    on = _decode_ops(rlx_on[0]) if rlx_on else set()
    trunc_ops = sorted(o for o in ("sort", "top_k", "cumsum") if o in on) or ["(none)"]
    table += [
      "",
      f"rlx decode window at T=1 without top-k / top-p: sort/top_k primitives in the jaxpr: "
      f"{sorted({'sort', 'top_k'} & ops) or 'none'}"
      + (f" (with top-k / top-p: {', '.join(trunc_ops)})" if rlx_on else "")
      + ".",
    ]
  table += [
    "",
    f"({time.perf_counter() - start:.0f} s, load average {os.getloadavg()[0]:.1f} at the end.) "
    f"Rerun: `{rerun}`",
    "",
  ]
  print("\n".join(table), flush=True)
  lines += table
  if _OUT.value:
    with open(_OUT.value, "w") as f:
      f.write("\n".join(lines))


if __name__ == "__main__":
  app.run(main)
