r"""rlx.sampling against `transformers` generate and a dense-KV JAX sampler, in one run.

Every sampler runs the same weights (a random Qwen2-style policy; the HF
baseline loads them from a checkpoint written by `rlx.policy.save_hf_checkpoint`)
on the same prompts, batch and lengths. Each measurement is the median wall
time of `--repeats` calls after one warm-up (compiling) call, repeats
interleaved across the samplers of a table so that machine load hits them
alike; tokens/s counts generated tokens (a stop token included) over the
whole call (prefill, decode, host scheduling, results back on host). The
tables also report the median process CPU time of a call (all threads of
this process): on a machine shared with other jobs it tracks the work done
more steadily than wall time (spin-waiting thread pools still count).

Samplers:

  rlx            `rlx.sampling.Sampler(...).generate` (paged KV cache,
                 continuous batching, `steps_per_sync` decode steps per
                 device window).
  transformers   `AutoModelForCausalLM.generate` (PyTorch CPU, dynamic KV
                 cache, sdpa attention), left-padded static batches; run with
                 `torch.set_num_threads(n)` for every n in `--torch_threads`.
  dense JAX      `_DenseSampler` below: static batch, left-padded prompts,
                 dense KV cache `[L, B, Hkv, S_max, D]` (one array per layer
                 with `--dense_layers=unroll`, or stacked in the carry of
                 `rlx.policy.layer_scan` with `scan`), prefill in one call,
                 then all decode steps in ONE jitted `lax.while_loop` (no host
                 sync per token), which exits as soon as every row has
                 stopped. This is the simple fast sampler a user would write.
  matmul floor   `_make_matmul_floor`: a jitted `lax.fori_loop` of just the
                 GEMMs of one decode step at batch B (q/k/v/o, gate/up/down
                 per layer, the LM head) with their bias and residual adds;
                 no norms, RoPE, attention, sampling or KV cache.

Tables (`--tables`, any subset, in this order):

  speed    greedy, B prompts of 8-32 tokens, 128 new tokens, no stop token:
           tokens/s of every sampler and ratios against the best
           transformers and the best dense JAX row; "same tokens" is the
           fraction of rows whose tokens equal rlx's (float32 greedy on the
           same weights: the samplers must agree).
  step     decode step time: (T(128 new) - T(16 new)) / 112 per sampler
           (prefill and fixed costs cancel), against the matmul floor.
  tail     long tail: `--tail_requests` prompts sampled at temperature 1 with
           `--tail_stop_ids` stop tokens (the ids V-K..V-1; a random policy
           is near uniform, so each step stops with probability ~K/V: most
           responses short, a few run to the 128-token cap). Static batching
           (a wave of B requests runs until its longest row ends) vs
           continuous batching (a finished slot is refilled at the next
           scheduling point), completed tokens/s.
  prefix   prefix sharing: `--prefix_prompts` prompts of `--prefix_len`
           tokens, G = `--group` samples each (the samples share the
           prompt's full KV pages) vs the same prompts repeated G times with
           G = 1 (no sharing): peak pages used, prefilled tokens, tokens/s.
  pool     the speed workload with the smallest pool that holds B full
           sequences vs a `--pool_factor` times larger pool: tokens/s.
  profile  where the time goes: one speed-workload call of rlx and of the
           dense JAX samplers traced with `jax.profiler` (in a subprocess
           that dumps the optimized HLO), every XLA op's time bucketed by
           the JAX function that emitted it (HLO `op_name` metadata:
           paged/dense attention, KV write, per-layer weight slices of the
           layer scan, GEMMs, other), per decode step.

Rerun (prints the markdown tables; `--out` also writes them to a file):

  python experiments/bench_sampler.py \
    --out=experiments/results/bench_sampler_cpu.md

Defaults: 4 layers, width 256, MLP 768, 8/2 heads, vocab 512, float32, B=32,
128 new tokens; ~10-15 minutes on 2 CPU cores (transformers dominates).
"""

import functools
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from rlx import policy, sampling

_TABLES = flags.DEFINE_list(
  "tables",
  ["speed", "step", "tail", "prefix", "pool", "profile"],
  "Tables to run (in this order).",
)
_LAYERS = flags.DEFINE_integer("layers", 4, "Decoder layers.")
_HIDDEN = flags.DEFINE_integer("hidden", 256, "Model width.")
_INTERMEDIATE = flags.DEFINE_integer("intermediate", 768, "MLP width.")
_HEADS = flags.DEFINE_integer("heads", 8, "Query heads (head_dim = hidden / heads).")
_KV_HEADS = flags.DEFINE_integer("kv_heads", 2, "KV heads.")
_VOCAB = flags.DEFINE_integer("vocab", 512, "Vocabulary size.")
_DTYPE = flags.DEFINE_string("dtype", "float32", "Param / compute / KV dtype.")
_BATCH = flags.DEFINE_integer("batch", 32, "Decode batch B (rlx max_slots, static batch size).")
_MIN_PROMPT = flags.DEFINE_integer("min_prompt", 8, "Shortest prompt (tokens).")
_MAX_PROMPT = flags.DEFINE_integer("max_prompt", 32, "Longest prompt (tokens).")
_NEW = flags.DEFINE_integer("new_tokens", 128, "max_new_tokens.")
_SHORT_NEW = flags.DEFINE_integer(
  "short_new_tokens", 16, "step table: the short run whose time is subtracted."
)
_PAGE = flags.DEFINE_integer("page_size", 16, "rlx KV page size.")
_SYNC = flags.DEFINE_integer("steps_per_sync", 32, "rlx decode steps per device window.")
_PREFILL_CHUNK = flags.DEFINE_integer(
  "prefill_chunk", 0, "rlx prefill_chunk; 0 = the SamplerConfig default."
)
_TORCH_THREADS = flags.DEFINE_list(
  "torch_threads",
  [str(os.cpu_count()), "1"],
  "torch.set_num_threads values, one transformers row each (the best one is the baseline).",
)
_DENSE_LAYERS = flags.DEFINE_list(
  "dense_layers", ["unroll", "scan"], "Dense JAX layer loop(s): 'unroll' and/or 'scan'."
)
_TAIL_REQUESTS = flags.DEFINE_integer("tail_requests", 128, "tail: number of prompts.")
_TAIL_STOPS = flags.DEFINE_integer("tail_stop_ids", 12, "tail: number of stop token ids K.")
_TAIL_HF = flags.DEFINE_bool("tail_transformers", True, "tail: also run transformers.")
_PREFIX_PROMPTS = flags.DEFINE_integer("prefix_prompts", 4, "prefix: number of prompts.")
_PREFIX_LEN = flags.DEFINE_integer("prefix_len", 60, "prefix: prompt length (tokens).")
_GROUP = flags.DEFINE_integer("group", 8, "prefix: samples G per prompt.")
_POOL_FACTOR = flags.DEFINE_integer("pool_factor", 4, "pool: size of the large pool / small.")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Timed calls per sampler (median reported).")
_NOTE = flags.DEFINE_string("note", "", "Free text for the table header (e.g. machine load).")
_OUT = flags.DEFINE_string("out", None, "Optional file to write the markdown tables to.")
_PROFILE_CHILD = flags.DEFINE_string(
  "profile_child", None, "Internal: run the profile measurement, dump to this dir, print JSON."
)


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
    param_dtype=_DTYPE.value,
    compute_dtype=_DTYPE.value,
  )


def _prompts(seed: int, n: int, lo: int, hi: int, vocab: int) -> list[list[int]]:
  """n prompts with lengths uniform in [lo, hi], token ids uniform in [1, vocab)."""
  rng = np.random.default_rng(seed)
  return [rng.integers(1, vocab, int(k)).tolist() for k in rng.integers(lo, hi + 1, n)]


class Result(NamedTuple):
  """One sampler call's output on host: tokens i32[N, M] (0-padded), lengths i32[N]."""

  tokens: np.ndarray
  lengths: np.ndarray
  stats: dict[str, Any]


def _batches(rows: list, batch: int) -> list[list]:
  """Splits rows into static batches of `batch` (the last one padded with its first row)."""
  out = []
  for i in range(0, len(rows), batch):
    chunk = rows[i : i + batch]
    out.append(chunk + [chunk[0]] * (batch - len(chunk)))
  return out


def _left_pad(prompts: list[list[int]], width: int) -> tuple[np.ndarray, np.ndarray]:
  tokens = np.zeros((len(prompts), width), np.int32)
  for i, p in enumerate(prompts):
    tokens[i, width - len(p) :] = p
  return tokens, np.asarray([len(p) for p in prompts], np.int32)


# ------------------------------------------------------------------------------------------
# Baseline: a dense-KV JAX sampler.


class _DenseSampler:
  """Static-batch sampler over a dense KV cache; prefill + ONE `lax.while_loop` of decode steps.

  Cache layout `[B, Hkv, S_max, D]` per layer: the decode dots then read K/V
  without a transpose (17% faster on CPU than `[B, S_max, Hkv, D]`, measured).
  Prompts are left-padded to `max_prompt_len` = P, so every row writes its
  step-t K/V at the same cache column P + t (one `dynamic_update_slice` per
  layer, in place in the loop carry); RoPE positions are per row
  (`len_b + t`) and attention masks the padding columns. The loop exits when
  every row has emitted a stop token or `max_new_tokens` are reached.
  Sampling matches rlx: argmax (greedy) or a categorical draw from
  `logits / T`, with the full-vocabulary `log_softmax(logits / T)[token]`
  recorded (T = 1 for greedy). Layers: "unroll" runs the L blocks as Python-
  unrolled calls of `rlx.policy.layer_qkv` / `layer_finish` with one cache
  array per layer; "scan" runs `rlx.policy.layer_scan` with the stacked
  `[L, B, Hkv, S_max, D]` caches in its carry (what rlx's decode step uses).
  """

  def __init__(self, mc, *, batch, max_prompt_len, max_new_tokens, temperature, stop_ids, layers):
    if layers not in ("unroll", "scan"):
      raise ValueError(f"`layers` must be 'unroll' or 'scan', got {layers!r}.")
    self.mc, self.batch, self.layers = mc, batch, layers
    self.p, self.m, self.temperature = max_prompt_len, max_new_tokens, temperature
    self.stop_ids = np.asarray(stop_ids, np.int32)
    self._generate = jax.jit(self._generate_fn)

  def _sample(self, logits, key):
    if self.temperature == 0.0:
      tok = jnp.argmax(logits, -1).astype(jnp.int32)
      logp = jax.nn.log_softmax(logits, -1)
    else:
      logp = jax.nn.log_softmax(logits / self.temperature, -1)
      tok = jax.random.categorical(key, logp).astype(jnp.int32)
    return tok, jnp.take_along_axis(logp, tok[:, None], -1)[:, 0]

  def _generate_fn(self, params, tokens, lengths, rng):
    mc, b, p, m = self.mc, self.batch, self.p, self.m
    hkv, d, n_layers = mc.num_kv_heads, mc.head_dim, mc.num_layers
    s_max = p + m
    dtype = jnp.dtype(mc.compute_dtype)
    start = p - lengths  # first real column of each row
    scale = np.float32(1.0 / np.sqrt(d))
    heads_first = functools.partial(
      jnp.swapaxes, axis1=1, axis2=2
    )  # [B, T, Hkv, D] -> [B, Hkv, T, D]

    # Prefill: causal over the real columns, K/V of all P columns into the cache.
    col = jnp.arange(p)
    positions = jnp.maximum(col[None] - start[:, None], 0)
    allowed = (col[None, None] <= col[None, :, None]) & (col[None, None] >= start[:, None, None])

    @jax.named_scope("dense_prefill_attention")
    def prefill_attention(q, k, v):
      qg = q.reshape(b, p, hkv, -1, d)
      s = jnp.einsum("bqhgd,bkhd->bhgqk", qg, k, preferred_element_type=jnp.float32) * scale
      s = jnp.where(allowed[:, None, None], s, -1e30)
      pr = jax.nn.softmax(s, -1).astype(dtype)
      return jnp.einsum("bhgqk,bkhd->bqhgd", pr, v).reshape(q.shape)

    cols = jnp.arange(s_max)

    @jax.named_scope("dense_decode_attention")
    def decode_attention(q, kc, vc, t):  # q [B, 1, H, D], caches [B, Hkv, S_max, D]
      valid = (cols[None] >= start[:, None]) & (cols[None] <= p + t)  # [B, S_max]
      qg = q.reshape(b, hkv, -1, d)
      s = jnp.einsum("bhgd,bhsd->bhgs", qg, kc, preferred_element_type=jnp.float32) * scale
      s = jnp.where(valid[:, None, None], s, -1e30)
      pr = jax.nn.softmax(s, -1).astype(dtype)
      return jnp.einsum("bhgs,bhsd->bhgd", pr, vc).reshape(b, 1, -1, d)

    @jax.named_scope("dense_kv_write")
    def write(cache, new, column, layer=None):  # new [B, T, Hkv, D] at cache column `column`
      new = heads_first(new).astype(dtype)
      if layer is None:
        return jax.lax.dynamic_update_slice(cache, new, (0, 0, column, 0))
      return jax.lax.dynamic_update_slice(cache, new[None], (layer, 0, 0, column, 0))

    x = policy.embed(params, mc, tokens)
    if self.layers == "unroll":
      layers = [policy.get_layer(params, i) for i in range(n_layers)]
      zeros = jnp.zeros((b, hkv, s_max, d), dtype)
      ks, vs = [], []
      for layer in layers:
        q, k, v = policy.layer_qkv(layer, mc, x, positions)
        x = policy.layer_finish(layer, mc, x, prefill_attention(q, k, v))
        ks.append(write(zeros, k, 0))
        vs.append(write(zeros, v, 0))
      cache = (ks, vs)
    else:

      def hook(i, q, k, v, cache, *, positions, segment_ids):
        del positions, segment_ids
        kc, vc = cache
        return prefill_attention(q, k, v), (write(kc, k, 0, i), write(vc, v, 0, i))

      zeros = jnp.zeros((n_layers, b, hkv, s_max, d), dtype)
      x, cache = policy.layer_scan(
        params, mc, x, positions, attention_fn=hook, cache=(zeros, zeros)
      )
    hidden = policy.final_norm(params, mc, x[:, -1])
    logits = policy.logits_from_hidden(params, mc, hidden)
    tok, logp = self._sample(logits, jax.random.fold_in(rng, 0))
    stop_ids = jnp.asarray(self.stop_ids)
    done = jnp.isin(tok, stop_ids) if self.stop_ids.size else jnp.zeros((b,), bool)
    out_tok = jnp.zeros((b, m), jnp.int32).at[:, 0].set(tok)
    out_logp = jnp.zeros((b, m), jnp.float32).at[:, 0].set(logp)
    out_len = jnp.ones((b,), jnp.int32)

    @jax.named_scope("dense_decode_step")
    def body(carry):
      t, tok, done, cache, out_tok, out_logp, out_len = carry
      x = policy.embed(params, mc, tok[:, None])
      pos = (lengths + t)[:, None]
      if self.layers == "unroll":
        ks, vs = cache
        new_ks, new_vs = [], []
        for i, layer in enumerate(layers):
          q, k, v = policy.layer_qkv(layer, mc, x, pos)
          kc, vc = write(ks[i], k, p + t), write(vs[i], v, p + t)
          x = policy.layer_finish(layer, mc, x, decode_attention(q, kc, vc, t))
          new_ks.append(kc)
          new_vs.append(vc)
        cache = (new_ks, new_vs)
      else:

        def hook(i, q, k, v, cache, *, positions, segment_ids):
          del positions, segment_ids
          kc, vc = cache
          kc, vc = write(kc, k, p + t, i), write(vc, v, p + t, i)
          return decode_attention(q, kc[i], vc[i], t), (kc, vc)

        x, cache = policy.layer_scan(params, mc, x, pos, attention_fn=hook, cache=cache)
      hidden = policy.final_norm(params, mc, x[:, 0])
      logits = policy.logits_from_hidden(params, mc, hidden)
      tok, logp = self._sample(logits, jax.random.fold_in(rng, t + 1))
      live = ~done
      out_tok = jax.lax.dynamic_update_slice(out_tok, jnp.where(live, tok, 0)[:, None], (0, t + 1))
      out_logp = jax.lax.dynamic_update_slice(
        out_logp, jnp.where(live, logp, 0.0)[:, None], (0, t + 1)
      )
      out_len = out_len + live.astype(jnp.int32)
      if self.stop_ids.size:
        done = done | (live & jnp.isin(tok, stop_ids))
      return t + 1, tok, done, cache, out_tok, out_logp, out_len

    def cond(carry):
      t, _, done = carry[:3]
      return (t < m - 1) & ~jnp.all(done)

    carry = (jnp.int32(0), tok, done, cache, out_tok, out_logp, out_len)
    _, _, _, _, out_tok, out_logp, out_len = jax.lax.while_loop(cond, body, carry)
    return out_tok, out_logp, out_len

  def generate(self, params, prompts: list[list[int]], num_samples: int, seed: int) -> Result:
    """All rows (prompt-major, each prompt repeated `num_samples` times) in static batches."""
    rows = [p for p in prompts for _ in range(num_samples)]
    toks, lens = [], []
    for i, batch in enumerate(_batches(rows, self.batch)):
      tokens, lengths = _left_pad(batch, self.p)
      key = jax.random.fold_in(jax.random.key(seed), i)
      out_tok, _, out_len = self._generate(params, tokens, lengths, key)
      toks.append(np.asarray(out_tok))
      lens.append(np.asarray(out_len))
    n = len(rows)
    return Result(np.concatenate(toks)[:n], np.concatenate(lens)[:n], {})


# ------------------------------------------------------------------------------------------
# Baseline: HF transformers generate.


class _HFSampler:
  """`transformers` generate (PyTorch CPU, KV cache) on the weights saved as an HF checkpoint."""

  def __init__(self, mc, params, *, batch, max_prompt_len, max_new_tokens, temperature, stop_ids):
    import torch
    import transformers

    self.torch = torch
    self.batch, self.p, self.m = batch, max_prompt_len, max_new_tokens
    self.temperature, self.stop_ids = temperature, list(stop_ids)
    with tempfile.TemporaryDirectory() as path:
      policy.save_hf_checkpoint(path, mc, params)
      self.model = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=getattr(torch, mc.param_dtype)
      ).eval()

  def generate(self, prompts, num_samples: int, seed: int, threads: int) -> Result:
    torch = self.torch
    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    rows = [p for p in prompts for _ in range(num_samples)]
    kwargs = dict(max_new_tokens=self.m, pad_token_id=0, top_k=None, top_p=None)
    if self.stop_ids:
      kwargs["eos_token_id"] = self.stop_ids
    else:  # every row runs to max_new_tokens
      kwargs.update(eos_token_id=None, min_new_tokens=self.m)
    if self.temperature == 0.0:
      kwargs.update(do_sample=False, temperature=None)
    else:
      kwargs.update(do_sample=True, temperature=self.temperature)
    toks, lens = [], []
    for batch in _batches(rows, self.batch):
      tokens, lengths = _left_pad(batch, self.p)
      mask = (np.arange(self.p)[None] >= (self.p - lengths)[:, None]).astype(np.int64)
      with torch.inference_mode():
        out = self.model.generate(
          input_ids=torch.from_numpy(tokens.astype(np.int64)),
          attention_mask=torch.from_numpy(mask),
          **kwargs,
        )
      gen = out[:, self.p :].numpy().astype(np.int32)
      gen = np.pad(gen, ((0, 0), (0, self.m - gen.shape[1])))
      length = np.full((len(batch),), gen.shape[1], np.int32)
      if self.stop_ids:
        hit = np.isin(gen, self.stop_ids)
        first = np.where(hit.any(1), hit.argmax(1) + 1, self.m)
        length = first.astype(np.int32)
        gen = np.where(np.arange(self.m)[None] < length[:, None], gen, 0)
      toks.append(gen)
      lens.append(length)
    n = len(rows)
    return Result(np.concatenate(toks)[:n], np.concatenate(lens)[:n], {})


# ------------------------------------------------------------------------------------------
# The matmul floor of one decode step.


def _make_matmul_floor(mc, batch: int, steps: int) -> Callable:
  """A jitted `fori_loop` of `steps` chained decode-step GEMM sets at batch `batch`.

  Per layer: q/k/v projections (+bias), o projection + residual, gate/up
  (summed: the SwiGLU product is not a GEMM), down projection + residual;
  then the LM head, whose first D logits are added back to the residual so
  that every GEMM feeds the next step (nothing is dead code).
  """
  dtype = jnp.dtype(mc.compute_dtype)
  hk = mc.num_kv_heads * mc.head_dim
  d = mc.hidden_size
  v_size = mc.vocab_size

  def lin(p, x):
    y = x @ p["kernel"].astype(dtype)
    return y + p["bias"].astype(dtype) if "bias" in p else y

  @jax.jit
  def run(params, x):
    layers = [policy.get_layer(params, i) for i in range(mc.num_layers)]
    head = policy.lm_head_kernel(params, mc).astype(dtype)

    def step(_, x):
      for layer in layers:
        a, mlp = layer["attn"], layer["mlp"]
        q = lin(a["q_proj"], x)
        kv = lin(a["k_proj"], x) + lin(a["v_proj"], x)
        q = q.at[:, :hk].add(kv)
        x = x + lin(a["o_proj"], q)
        x = x + lin(mlp["down_proj"], lin(mlp["gate_proj"], x) + lin(mlp["up_proj"], x))
      logits = x @ head
      reps = -(-d // v_size)
      return x + jnp.tile(logits, (1, reps))[:, :d] * 1e-3

    return jax.lax.fori_loop(0, steps, step, x)

  return run


# ------------------------------------------------------------------------------------------
# Measurement.


def _measure(calls: dict[str, Callable[[], Result]], repeats: int) -> dict[str, tuple]:
  """Warms every call up once, then times `repeats` rounds interleaved; (median s, Result).

  The median process CPU time of the calls (all threads of this process: the
  work done, less sensitive than wall time to other jobs sharing the cores)
  goes into the returned Result's `stats["cpu_s"]`.
  """
  results = {name: fn() for name, fn in calls.items()}
  times = {name: [] for name in calls}
  cpu = {name: [] for name in calls}
  for _ in range(repeats):
    for name, fn in calls.items():
      start, start_cpu = time.perf_counter(), time.process_time()
      results[name] = fn()
      times[name].append(time.perf_counter() - start)
      cpu[name].append(time.process_time() - start_cpu)
  out = {}
  for name in calls:
    r = results[name]
    if isinstance(r, Result):
      r.stats["cpu_s"] = statistics.median(cpu[name])
    out[name] = (statistics.median(times[name]), r)
  return out


def _rlx_config(**kw) -> sampling.SamplerConfig:
  base = dict(
    max_slots=_BATCH.value,
    page_size=_PAGE.value,
    max_prompt_len=_MAX_PROMPT.value,
    max_new_tokens=_NEW.value,
    kv_dtype=_DTYPE.value,
    temperature=0.0,
    top_k=0,
    top_p=1.0,
    stop_token_ids=(),
    steps_per_sync=_SYNC.value,
  )
  base.update(kw)
  if _PREFILL_CHUNK.value:
    base.setdefault("prefill_chunk", _PREFILL_CHUNK.value)
  if "num_pages" not in base:  # the smallest pool that holds max_slots full sequences
    pps = -(-(base["max_prompt_len"] + base["max_new_tokens"] - 1) // base["page_size"])
    base["num_pages"] = base["max_slots"] * pps
  return sampling.SamplerConfig(**base)


def _rlx_call(mc, cfg, params, prompts, num_samples=1, seed=0) -> Callable[[], Result]:
  sampler = sampling.Sampler(mc, cfg)
  key = jax.random.key(seed)

  def call():
    out = sampler.generate(params, prompts, num_samples=num_samples, rng=key)
    return Result(np.asarray(out.tokens), np.asarray(out.lengths), dict(out.stats))

  return call


def _same(a: Result, b: Result) -> float:
  return float(np.mean(np.all(a.tokens == b.tokens, axis=1)))


# ------------------------------------------------------------------------------------------
# Tables.


def _speed_table(mc, params, hf) -> tuple[list[str], dict]:
  b, m = _BATCH.value, _NEW.value
  prompts = _prompts(0, b, _MIN_PROMPT.value, _MAX_PROMPT.value, mc.vocab_size)
  calls = {"rlx": _rlx_call(mc, _rlx_config(), params, prompts)}
  for mode in _DENSE_LAYERS.value:
    dense = _DenseSampler(
      mc, batch=b, max_prompt_len=_MAX_PROMPT.value, max_new_tokens=m, temperature=0.0,
      stop_ids=(), layers=mode,
    )  # fmt: skip
    calls[f"dense JAX ({mode})"] = functools.partial(dense.generate, params, prompts, 1, 0)
  for n in _torch_threads():
    calls[f"transformers (threads={n})"] = functools.partial(hf.generate, prompts, 1, 0, n)
  res = _measure(calls, _REPEATS.value)
  tps = {k: int(r.lengths.sum()) / s for k, (s, r) in res.items()}
  best_hf = max((v for k, v in tps.items() if k.startswith("transformers")), default=None)
  best_dense = max((v for k, v in tps.items() if k.startswith("dense")), default=None)
  lines = [
    f"## Tokens/s: rlx vs transformers vs dense-KV JAX (greedy, B={b}, prompts "
    f"{_MIN_PROMPT.value}-{_MAX_PROMPT.value} tokens, {m} new tokens, {mc.param_dtype})",
    "",
    "| sampler | wall s | tokens/s | vs best transformers | vs best dense JAX | CPU s "
    "| tokens/CPU-s | vs best transformers (CPU) | vs best dense JAX (CPU) | same tokens as rlx |",
    "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
  ]
  cps = {k: int(r.lengths.sum()) / r.stats["cpu_s"] for k, (_, r) in res.items()}
  cpu_hf = max((v for k, v in cps.items() if k.startswith("transformers")), default=None)
  cpu_dense = max((v for k, v in cps.items() if k.startswith("dense")), default=None)

  def ratio(x, base):
    return f"{x / base:.2f}x" if base else "-"

  for k, (s, r) in res.items():
    lines.append(
      f"| {k} | {s:.3f} | {tps[k]:.0f} | {ratio(tps[k], best_hf)} | {ratio(tps[k], best_dense)} | "
      f"{r.stats['cpu_s']:.3f} | {cps[k]:.0f} | {ratio(cps[k], cpu_hf)} | "
      f"{ratio(cps[k], cpu_dense)} | {100 * _same(r, res['rlx'][1]):.0f}% |"
    )
    if k == "rlx":
      st = r.stats
      rlx_note = (
        f"rlx stats: {st.get('decode_steps')} decode steps in {st.get('syncs')} device windows, "
        f"{st.get('prefill_calls')} prefill calls, peak {st.get('peak_pages_used')} of "
        f"{st.get('num_pages')} pages, {st.get('preemptions')} preemptions."
      )
  lines += ["", rlx_note, "", "Targets: rlx >= 3x transformers and >= 1.3x dense-KV JAX."]
  hf_rows = {k: v for k, v in tps.items() if k.startswith("transformers")}
  best = max(hf_rows, key=hf_rows.get) if hf_rows else None
  return lines, {"best_threads": int(best.split("=")[1].rstrip(")")) if best else None}


def _step_table(mc, params, hf, best_threads: int | None) -> list[str]:
  """Decode step time; transformers runs with `best_threads` (the speed table's best) if set."""
  b, m, short = _BATCH.value, _NEW.value, _SHORT_NEW.value
  if not 1 <= short < m:
    raise app.UsageError(f"--short_new_tokens must be in [1, --new_tokens={m}).")
  prompts = _prompts(0, b, _MIN_PROMPT.value, _MAX_PROMPT.value, mc.vocab_size)
  calls = {}
  for new in (m, short):
    calls[("rlx", new)] = _rlx_call(mc, _rlx_config(max_new_tokens=new), params, prompts)
    for mode in _DENSE_LAYERS.value:
      dense = _DenseSampler(
        mc, batch=b, max_prompt_len=_MAX_PROMPT.value, max_new_tokens=new, temperature=0.0,
        stop_ids=(), layers=mode,
      )  # fmt: skip
      calls[(f"dense JAX ({mode})", new)] = functools.partial(dense.generate, params, prompts, 1, 0)
  threads = _torch_threads()
  hf_threads = best_threads or (threads[0] if threads else None)
  if hf_threads is not None:
    for new in (m, short):
      hf.m = new
      calls[(f"transformers (threads={hf_threads})", new)] = functools.partial(
        _hf_with_length, hf, new, prompts, hf_threads
      )
    hf.m = m
  floor = _make_matmul_floor(mc, b, m - 1)
  x = jnp.asarray(np.random.default_rng(0).normal(size=(b, mc.hidden_size)), mc.compute_dtype)
  calls[("floor", m)] = lambda: jax.block_until_ready(floor(params, x))
  res = _measure(calls, _REPEATS.value)
  floor_ms = 1e3 * res[("floor", m)][0] / (m - 1)
  names = list(dict.fromkeys(k for k, _ in calls if k != "floor"))
  lines = [
    f"## Decode step time vs the matmul floor (B={b}; step = (T({m} new) - T({short} new)) / "
    f"{m - short})",
    "",
    "| sampler | T long s | T short s | step ms | x floor |",
    "|---|---:|---:|---:|---:|",
  ]
  steps = {}
  for name in names:
    t_long, t_short = res[(name, m)][0], res[(name, short)][0]
    steps[name] = step_ms = 1e3 * (t_long - t_short) / (m - short)
    lines.append(
      f"| {name} | {t_long:.3f} | {t_short:.3f} | {step_ms:.2f} | {step_ms / floor_ms:.2f} |"
    )
  lines.append(f"| matmul floor (GEMMs only) | - | - | {floor_ms:.2f} | 1.00 |")
  # The decode step the speed targets ask of rlx, against the GEMMs alone.
  needs = []
  for prefix, factor in (("transformers", 3.0), ("dense JAX", 1.3)):
    best = min((v for k, v in steps.items() if k.startswith(prefix)), default=None)
    if best is not None:
      needs.append(
        f"{factor:g}x {prefix} needs a step of {best / factor:.2f} ms "
        f"({best / factor / floor_ms:.2f}x the matmul floor)"
      )
  if needs:
    lines += ["", "Step time the speed targets require: " + "; ".join(needs) + "."]
  return lines


def _hf_with_length(hf, new, prompts, threads):
  hf.m = new
  return hf.generate(prompts, 1, 0, threads)


def _length_summary(lengths: np.ndarray, cap: int) -> str:
  q = np.percentile(lengths, [50, 90])
  return (
    f"mean {lengths.mean():.1f}, median {q[0]:.0f}, p90 {q[1]:.0f}, "
    f"{100 * np.mean(lengths >= cap):.1f}% at the {cap} cap"
  )


def _tail_table(mc, params, best_threads: int | None) -> list[str]:
  """Long tail; transformers (if on) runs with `best_threads` (the speed table's best) if set."""
  b, m, n, k = _BATCH.value, _NEW.value, _TAIL_REQUESTS.value, _TAIL_STOPS.value
  if not 1 <= k < mc.vocab_size:
    raise app.UsageError(f"--tail_stop_ids must be in [1, vocab={mc.vocab_size}).")
  stops = tuple(range(mc.vocab_size - k, mc.vocab_size))
  prompts = _prompts(1, n, _MIN_PROMPT.value, _MAX_PROMPT.value, mc.vocab_size)
  cfg = functools.partial(_rlx_config, temperature=1.0, stop_token_ids=stops)
  calls = {
    "rlx continuous": _rlx_call(mc, cfg(continuous_batching=True), params, prompts),
    "rlx static": _rlx_call(mc, cfg(continuous_batching=False), params, prompts),
  }
  dense = _DenseSampler(
    mc, batch=b, max_prompt_len=_MAX_PROMPT.value, max_new_tokens=m, temperature=1.0,
    stop_ids=stops, layers=_DENSE_LAYERS.value[0] if _DENSE_LAYERS.value else "unroll",
  )  # fmt: skip
  calls[f"dense JAX static ({dense.layers})"] = functools.partial(
    dense.generate, params, prompts, 1, 0
  )
  threads = _torch_threads()
  if best_threads:
    threads = [best_threads]
  if _TAIL_HF.value and threads:
    hf_tail = _HFSampler(
      mc, params, batch=b, max_prompt_len=_MAX_PROMPT.value, max_new_tokens=m, temperature=1.0,
      stop_ids=stops,
    )  # fmt: skip
    calls[f"transformers static (threads={threads[0]})"] = functools.partial(
      hf_tail.generate, prompts, 1, 0, threads[0]
    )
  res = _measure(calls, _REPEATS.value)
  tps = {name: int(r.lengths.sum()) / s for name, (s, r) in res.items()}
  lines = [
    f"## Long tail: static vs continuous batching ({n} requests, B={b} slots, temperature 1, "
    f"{k} stop ids of {mc.vocab_size}, max {m} new tokens)",
    "",
    "| sampler | wall s | completed tokens | tokens/s | vs rlx static | CPU s "
    "| vs rlx static (CPU) | response lengths |",
    "|---|---:|---:|---:|---:|---:|---:|---|",
  ]
  cps = {name: int(r.lengths.sum()) / r.stats["cpu_s"] for name, (_, r) in res.items()}
  for name, (s, r) in res.items():
    lines.append(
      f"| {name} | {s:.3f} | {int(r.lengths.sum())} | {tps[name]:.0f} | "
      f"{tps[name] / tps['rlx static']:.2f}x | {r.stats['cpu_s']:.3f} | "
      f"{cps[name] / cps['rlx static']:.2f}x | {_length_summary(r.lengths, m)} |"
    )
  st = res["rlx continuous"][1].stats
  lines += [
    "",
    f"rlx continuous: {st.get('decode_steps')} decode steps in {st.get('syncs')} windows; "
    f"rlx static: {res['rlx static'][1].stats.get('decode_steps')} decode steps. "
    "Target: continuous >= 1.5x static.",
  ]
  return lines


def _prefix_table(mc, params) -> list[str]:
  g, n, length, m = _GROUP.value, _PREFIX_PROMPTS.value, _PREFIX_LEN.value, _NEW.value
  prompts = _prompts(2, n, length, length, mc.vocab_size)
  repeated = [p for p in prompts for _ in range(g)]
  cfg = _rlx_config(max_slots=n * g, max_prompt_len=length, temperature=1.0)
  calls = {
    f"G={g} (shared prompt pages)": _rlx_call(mc, cfg, params, prompts, num_samples=g),
    f"G=1, each prompt repeated {g}x": _rlx_call(mc, cfg, params, repeated, num_samples=1),
  }
  res = _measure(calls, _REPEATS.value)
  page = cfg.page_size
  lines = [
    f"## Prefix sharing: {n} prompts x {g} samples, prompts of {length} tokens "
    f"({(length - 1) // page} full pages of {page} shared), {m} new tokens, temperature 1",
    "",
    "| run | peak pages used | prefilled tokens | wall s | tokens/s | ratio | CPU s "
    "| ratio (CPU) |",
    "|---|---:|---:|---:|---:|---:|---:|---:|",
  ]
  base = base_cpu = None
  for name, (s, r) in res.items():
    t, c = int(r.lengths.sum()) / s, int(r.lengths.sum()) / r.stats["cpu_s"]
    base, base_cpu = base or t, base_cpu or c
    lines.append(
      f"| {name} | {r.stats.get('peak_pages_used')} | {r.stats.get('prefill_tokens')} | "
      f"{s:.3f} | {t:.0f} | {t / base:.2f} | {r.stats['cpu_s']:.3f} | {c / base_cpu:.2f} |"
    )
  return lines


def _pool_table(mc, params) -> list[str]:
  b, f = _BATCH.value, _POOL_FACTOR.value
  prompts = _prompts(0, b, _MIN_PROMPT.value, _MAX_PROMPT.value, mc.vocab_size)
  small = _rlx_config()
  large = _rlx_config(num_pages=f * small.num_pages)
  calls = {
    f"{small.num_pages} pages": _rlx_call(mc, small, params, prompts),
    f"{large.num_pages} pages ({f}x)": _rlx_call(mc, large, params, prompts),
  }
  res = _measure(calls, _REPEATS.value)
  lines = [
    f"## Pool size: the speed workload with a {f}x larger page pool",
    "",
    "| pool | peak pages used | wall s | tokens/s | ratio | CPU s | ratio (CPU) |",
    "|---|---:|---:|---:|---:|---:|---:|",
  ]
  base = base_cpu = None
  for name, (s, r) in res.items():
    t, c = int(r.lengths.sum()) / s, int(r.lengths.sum()) / r.stats["cpu_s"]
    base, base_cpu = base or t, base_cpu or c
    lines.append(
      f"| {name} | {r.stats.get('peak_pages_used')} | {s:.3f} | {t:.0f} | {t / base:.2f} | "
      f"{r.stats['cpu_s']:.3f} | {c / base_cpu:.2f} |"
    )
  lines += ["", "Target: the large pool at >= 0.95x."]
  return lines


# ------------------------------------------------------------------------------------------
# Where the time goes: XLA op-level profile of one call (in a subprocess, HLO dumped).

# (bucket, substrings of the HLO op's `op_name` metadata), first match wins. Decode ops are
# those of rlx's decode module (an XLA module named after `_decode_loop`) and the dense
# sampler's `dense_decode_step` scope; everything else counts as "prefill & setup".
_BUCKETS = (
  ("attention: paged (page gather, mask, softmax, dots)", ("paged_attention",)),
  ("attention: dense cache (mask, softmax, dots)", ("dense_decode_attention",)),
  ("KV write", ("jit(_scatter)", "write_kv_pages", "dense_kv_write")),
  ("layer weights sliced per layer (layer scan)", ("dynamic_index_in_dim",)),
  ("GEMMs (q/k/v/o, MLP, LM head)", ("dot_general",)),
)
_OTHER = "other (norms, RoPE, residuals, sampling, page/slot bookkeeping)"
_PREFILL = "prefill & setup (not in the decode step)"
_UNKNOWN = "ops without op_name metadata (copies inserted by XLA)"


def _op_names(dump_dir: str) -> dict[tuple[str, str], str]:
  """(module name, HLO instruction) -> op_name metadata, from the XLA dump's optimized HLO."""
  import glob
  import re

  out = {}
  pattern = re.compile(r'^\s*(?:ROOT )?%([^ ]+) = .*op_name="([^"]*)"')
  for path in sorted(glob.glob(os.path.join(dump_dir, "*.cpu_after_optimizations.txt"))):
    module = os.path.basename(path).split(".")[1]  # module_0042.jit__decode_loop.cpu_...
    with open(path) as f:
      for line in f:
        m = pattern.match(line)
        if m:
          out[(module, m.group(1))] = m.group(2)
  return out


def _bucket(op_name: str | None, module: str) -> str:
  if op_name is None:
    return _UNKNOWN
  if "decode" not in module and "dense_decode_step" not in op_name:
    return _PREFILL
  for name, keys in _BUCKETS:
    if any(k in op_name for k in keys):
      return name
  return _OTHER


def _profile_child(out_dir: str) -> None:
  """Traces one rlx and one dense JAX speed-workload call; prints per-bucket ms as JSON."""
  import glob
  import gzip
  import json

  mc = _model_config()
  params = policy.init_params(mc, jax.random.key(0))
  b, m = _BATCH.value, _NEW.value
  prompts = _prompts(0, b, _MIN_PROMPT.value, _MAX_PROMPT.value, mc.vocab_size)
  calls = {"rlx": _rlx_call(mc, _rlx_config(), params, prompts)}
  for mode in _DENSE_LAYERS.value:
    dense = _DenseSampler(
      mc, batch=b, max_prompt_len=_MAX_PROMPT.value, max_new_tokens=m, temperature=0.0,
      stop_ids=(), layers=mode,
    )  # fmt: skip
    calls[f"dense JAX ({mode})"] = functools.partial(dense.generate, params, prompts, 1, 0)
  for fn in calls.values():
    fn()  # compile
  names = _op_names(os.path.join(out_dir, "hlo"))
  runs = {name: [] for name in calls}
  for r in range(_REPEATS.value):  # interleaved; the median per bucket is reported
    for i, (name, fn) in enumerate(calls.items()):
      trace_dir = os.path.join(out_dir, f"trace_{r}_{i}")
      with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
        start = time.perf_counter()
        fn()
        wall = time.perf_counter() - start
      (path,) = glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True)
      with gzip.open(path) as f:
        events = json.load(f)["traceEvents"]
      ms = {"wall": 1e3 * wall}
      for e in events:
        args = e.get("args", {})
        op, module = args.get("hlo_op"), args.get("hlo_module")
        if e.get("ph") != "X" or op is None or op.split(".")[0] in ("while", "call", "conditional"):
          continue
        key = _bucket(names.get((module, op)), module)
        ms[key] = ms.get(key, 0.0) + e["dur"] / 1e3
      ms["all"] = sum(v for k, v in ms.items() if k != "wall")
      runs[name].append(ms)
  result = {
    name: {k: statistics.median(r.get(k, 0.0) for r in rs) for k in set().union(*rs)}
    for name, rs in runs.items()
  }
  print("PROFILE_JSON " + json.dumps(result), flush=True)


def _profile_table() -> list[str]:
  import json
  import subprocess

  m = _NEW.value
  with tempfile.TemporaryDirectory() as out_dir:
    env = dict(os.environ)
    env["XLA_FLAGS"] = (
      env.get("XLA_FLAGS", "") + f" --xla_dump_to={out_dir}/hlo --xla_dump_hlo_as_text"
    ).strip()
    # The op names come from the HLO dump, which only a compile writes: a program read
    # back from a persistent compilation cache ($JAX_COMPILATION_CACHE_DIR) has none.
    env["JAX_ENABLE_COMPILATION_CACHE"] = "false"
    args = [a for a in sys.argv[1:] if not a.startswith(("--tables", "--out"))]
    proc = subprocess.run(
      [sys.executable, os.path.abspath(__file__), *args, f"--profile_child={out_dir}"],
      env=env, capture_output=True, text=True, timeout=1800,
    )  # fmt: skip
  line = [x for x in proc.stdout.splitlines() if x.startswith("PROFILE_JSON ")]
  if proc.returncode or not line:
    raise RuntimeError(f"profile subprocess failed:\n{proc.stderr[-4000:]}")
  data = json.loads(line[-1][len("PROFILE_JSON ") :])
  names = list(data)
  lines = [
    f"## Where the time goes: XLA CPU op time per decode step (speed workload traced with "
    f"`jax.profiler`, median of {_REPEATS.value} calls; ms summed over ops / {m - 1} steps)",
    "",
    "| bucket | " + " | ".join(names) + " |",
    "|---|" + "---:|" * len(names),
  ]
  rows = [(b, b) for b, _ in _BUCKETS] + [(b, b) for b in (_OTHER, _UNKNOWN, _PREFILL)]
  rows += [("all", "**all device ops**"), ("wall", "wall time of the traced call")]
  for key, label in rows:
    cells = [f"{data[n].get(key, 0.0) / (m - 1):.2f}" for n in names]
    lines.append(f"| {label} | " + " | ".join(cells) + " |")
  lines += [
    "",
    "Buckets come from each HLO op's `op_name` metadata (the JAX function that emitted it); "
    "the profiler adds overhead, so compare columns, not absolute values with other tables.",
  ]
  return lines


# ------------------------------------------------------------------------------------------
# Main.


def _torch_threads() -> list[int]:
  return [int(t) for t in _TORCH_THREADS.value if t]


def _rerun_flags(with_tables: bool = False) -> list[str]:
  """The flags given on the command line (without --tables/--out unless asked), to rerun."""
  out = []
  for name in flags.FLAGS:
    f = flags.FLAGS[name]
    if f.present and name in _OWN_FLAGS and (with_tables or name not in ("tables", "out")):
      if name == "profile_child":
        continue
      value = ",".join(f.value) if isinstance(f.value, list) else f.value
      out.append(f"--{name}={value}")
  return out


_OWN_FLAGS = {v.name for v in list(globals().values()) if isinstance(v, flags.FlagHolder)}


def main(argv):
  del argv
  if _PROFILE_CHILD.value:
    _profile_child(_PROFILE_CHILD.value)
    return
  tables = _TABLES.value
  bad = sorted(set(tables) - {"speed", "step", "tail", "prefix", "pool", "profile"})
  if bad:
    raise app.UsageError(f"--tables: unknown {bad}; expected speed,step,tail,prefix,pool,profile.")
  if set(_DENSE_LAYERS.value) - {"unroll", "scan"}:
    raise app.UsageError(f"--dense_layers must be a subset of unroll,scan: {_DENSE_LAYERS.value}.")
  if not 1 <= _MIN_PROMPT.value <= _MAX_PROMPT.value:
    raise app.UsageError("Need 1 <= --min_prompt <= --max_prompt.")
  mc = _model_config()
  params = policy.init_params(mc, jax.random.key(0))
  hf = None
  if {"speed", "step"} & set(tables) and _torch_threads():
    hf = _HFSampler(
      mc, params, batch=_BATCH.value, max_prompt_len=_MAX_PROMPT.value, max_new_tokens=_NEW.value,
      temperature=0.0, stop_ids=(),
    )  # fmt: skip
  rerun = " ".join(["python", sys.argv[0], *_rerun_flags()])
  load = os.getloadavg()[0]
  device = jax.devices()[0]
  lines = [
    f"# rlx.sampling benchmark ({device.platform}: {device.device_kind}, {os.cpu_count()} host "
    f"cores, load average {load:.1f} at the start)",
    "",
    f"Model: qwen2-style, {mc.num_layers} layers, width {mc.hidden_size}, MLP "
    f"{mc.intermediate_size}, heads {mc.num_heads}/{mc.num_kv_heads}, vocab {mc.vocab_size}, "
    f"{mc.param_dtype}. rlx: page {_PAGE.value}, steps_per_sync {_SYNC.value}, prefill_chunk "
    f"{_PREFILL_CHUNK.value or sampling.SamplerConfig.prefill_chunk} (calls narrowed to the "
    f"prompts' width bucket). Median of "
    f"{_REPEATS.value} calls after a warm-up call, interleaved across the rows of each table.",
  ]
  if _NOTE.value:
    lines += ["", _NOTE.value]
  lines.append("")
  print("\n".join(lines), flush=True)
  best_threads = None
  for name in tables:
    start = time.perf_counter()
    if name == "speed":
      table, speed = _speed_table(mc, params, hf)
      best_threads = speed["best_threads"]
    elif name == "step":
      table = _step_table(mc, params, hf, best_threads)
    elif name == "tail":
      table = _tail_table(mc, params, best_threads)
    elif name == "prefix":
      table = _prefix_table(mc, params)
    elif name == "pool":
      table = _pool_table(mc, params)
    else:
      table = _profile_table()
    table += [
      "",
      f"({time.perf_counter() - start:.0f} s, load average {os.getloadavg()[0]:.1f} at the end.) "
      f"Rerun this table: `{rerun} --tables={name}`",
      "",
    ]
    print("\n".join(table), flush=True)
    lines += table
  rerun_all = " ".join(["python", sys.argv[0], *_rerun_flags(with_tables=True)])
  lines += [f"Rerun all: `{rerun_all}`", ""]
  print(lines[-2], flush=True)
  text = "\n".join(lines)
  if _OUT.value:
    with open(_OUT.value, "w") as f:
      f.write(text)


if __name__ == "__main__":
  app.run(main)
