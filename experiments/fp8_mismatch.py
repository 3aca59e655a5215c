r"""Where the FP8 KV-cache rollout mismatch comes from: a fake-quantization study.

Method. For each policy (the main job's warmed-up policy, experiments/configs/
arithmetic.py after its supervised warm-up, and the same architecture with its
random initial weights; one per `--seeds` seed) and each quantization VARIANT,
K and V are quantized and dequantized in float32 inside a reference forward
(`rlx.policy.forward` with an `attention_fn` that rounds K / V before
`rlx.policy.dense_causal_attention`), and that fake-quantized policy samples
`--prompts` train prompts x G responses at temperature T (one full forward per
new token; the same random numbers for every variant). The rollout log-probs
are the fake-quantized policy's, the trainer's are the exact float32 forward's
on the same tokens, and

  k1 = mean_t (log q_t - log p_t),   k3 = mean_t (p_t / q_t - 1 - log(p_t / q_t))

over the sampled response tokens (q: rollout, p: trainer) are the train step's
`mismatch_k1 / mismatch_k3` (`rlx.objectives.rollout_mismatch_kl`, J. Schulman,
http://joschu.net/blog/kl-approx.html), plus the exact per-token KL(q || p)
over the whole vocabulary ("KL", no sampling noise). "K rel err" / "V rel err"
are ||K~ - K|| / ||K|| over the evaluated tokens (what one rounding costs),
"K sat" the fraction of K values clipped at the format's max (static scales).

Variants (K and V alike unless a row says "K only" / "V only"):
  format       e4m3 (float8_e4m3fn, 3 mantissa bits, max 448), e5m2 (2 bits),
               e3m4 (4 bits, max 15.5; not in rlx's sampler), int8 (uniform,
               symmetric, 127 levels), bf16 / fp16 (unscaled references),
               noise (x (1 + sigma N(0, 1)), a format-free relative error)
  granularity  layer (one scale per layer), head (per layer and KV head: rlx's
               sampler's static scales), channel (per layer, KV head and head dim),
               all three calibrated; page (per page of `page_size` tokens and
               KV head) and token (per token and KV head), dynamic: the amax
               of the values themselves maps to the format's max (a page's
               amax over the tokens written so far; token: the sampler's
               kv_scale_mode "per_token")
  calibration  static scales = amax / headroom (vLLM's FP8 KV cache: K 200,
               V 100 for the FP8 formats; int8: 127, e3m4: 448/200 of 15.5),
               amax over `rollout` (prompt + response of another batch from
               the same policy: what the RL loop recalibrates on after an
               update), `prompts` (the prompt tokens only: the loop's first
               calibration) or `same` (the evaluated sequences themselves)

rlx's sampler (`rlx.sampling`, kv_dtype fp8_e4m3) is run too, with per-[layer,
KV head] scales from the `rollout` calibration and with per-token scales, so the
fake-quant "e4m3 / head" and "e4m3 / token" rows can be checked against the real
FP8 pages (`--sampler_check`).

Sharpness: per layer, attention score statistics (score = q.k / sqrt(Dh), the
query positions that predict response tokens): RMS score, mean max attention
probability, attention entropy, and the RMS change of the scores when K is
rounded to e4m3 (per-head scales); and the output: logit standard deviation
over the vocabulary at T, entropy at T, and the per-token KL when the final
hidden state (before the LM head) gets a 2^-5 relative Gaussian error.

References: Micikevicius et al., "FP8 Formats for Deep Learning" (2022),
https://arxiv.org/abs/2209.05433 (e4m3 / e5m2); vLLM's FP8 KV cache,
https://docs.vllm.ai/en/latest/features/quantization/quantized_kvcache.html
(per-tensor / per-head scales, `calculate_kv_scales`); KIVI (Liu et al. 2024,
https://arxiv.org/abs/2402.02750) for per-channel K / per-token V granularity.

  python experiments/fp8_mismatch.py --seeds=0,1 --prompts=32 \
      --out=experiments/results/fp8_mismatch.md
"""

import ast
import functools
import importlib.util
import os
import sys
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags, logging

from rlx import objectives, policy, rl, sampling, train

_ROOT = os.path.dirname(os.path.abspath(__file__))
_CONFIG = flags.DEFINE_string(
  "config", os.path.join(_ROOT, "configs", "arithmetic.py"), "Main-job config file."
)
_WORKDIR = flags.DEFINE_string(
  "workdir", "/tmp/rlx_fp8_mismatch", "Holds the cached warm-up of each seed (<workdir>/s<seed>)."
)
_SEEDS = flags.DEFINE_list("seeds", ["0", "1"], "Seeds of the warmed-up and random policies.")
_PROMPTS = flags.DEFINE_integer("prompts", 32, "Train prompts per evaluation (x G samples).")
_TEMPS = flags.DEFINE_list(
  "temperatures", ["0.5", "1.0"], "Extra sampling temperatures of the e4m3 / head row."
)
_SAMPLER = flags.DEFINE_bool("sampler_check", True, "Also run rlx's FP8 sampler.")
_SMOKE = flags.DEFINE_bool(
  "smoke", False, "Tiny run (seconds): no warm-up (the init twice), few variants, no sampler."
)
_OUT = flags.DEFINE_string("out", "", "Write the markdown tables here.")
_SET = flags.DEFINE_list(
  "set", [], "Config overrides key=value (e.g. model.family=qwen2), applied after the file's."
)

FORMATS = {
  "e4m3": jnp.float8_e4m3fn,
  "e5m2": jnp.float8_e5m2,
  "e3m4": jnp.float8_e3m4,
  "bf16": jnp.bfloat16,
  "fp16": jnp.float16,
}
NOISE_SIGMA = 2.0**-5


class Quant(NamedTuple):
  """How one of K / V is rounded (static: part of the jitted program)."""

  fmt: str = "none"  # none | e4m3 | e5m2 | e3m4 | int8 | bf16 | fp16 | noise
  mode: str = "static"  # static (scale array) | token | page (dynamic)


class Variant(NamedTuple):
  name: str
  k: Quant
  v: Quant
  gran: str = "head"  # layer | head | channel (static scales) or token | page
  calib: str = "rollout"  # rollout | prompts | same
  k_headroom: float | None = None  # None: the format's default
  v_headroom: float | None = None
  temperature: float | None = None  # None: the config's


def qmax(fmt: str) -> float:
  """Largest representable magnitude of a scaled format (int8: 127)."""
  return 127.0 if fmt == "int8" else float(jnp.finfo(FORMATS[fmt]).max)


def default_headroom(fmt: str, which: str) -> float:
  """What the calibration amax maps to: vLLM's 200 (K) / 100 (V) for FP8; int8 127; e3m4 scaled."""
  if fmt == "int8":
    return 127.0
  vllm = 200.0 if which == "k" else 100.0
  if fmt == "e3m4":
    return qmax(fmt) * vllm / 448.0
  return vllm


def round_trip(x, quant: Quant, scale, key):
  """x f32 [B, S, Hkv, Dh] quantized and dequantized; `scale` broadcastable (static mode)."""
  fmt = quant.fmt
  if fmt == "none":
    return x
  if fmt in ("bf16", "fp16"):
    return x.astype(FORMATS[fmt]).astype(jnp.float32)
  if fmt == "noise":
    return x * (1.0 + NOISE_SIGMA * jax.random.normal(key, x.shape, jnp.float32))
  y = x / scale
  if fmt == "int8":
    y = jnp.clip(jnp.round(y), -127.0, 127.0)
  else:
    m = qmax(fmt)
    y = jnp.clip(y, -m, m).astype(FORMATS[fmt]).astype(jnp.float32)
  return y * scale


def dynamic_scale(x, quant: Quant, length, page_size: int):
  """Per-token or per-page amax / format max over positions < `length` (x [B, S, Hkv, Dh])."""
  a = jnp.max(jnp.abs(x), axis=-1, keepdims=True)  # [B, S, Hkv, 1]
  if quant.mode == "page":
    b, s, h, _ = a.shape
    valid = (jnp.arange(s) < length)[None, :, None, None]
    a = jnp.where(valid, a, 0.0)
    pad = -s % page_size
    a = jnp.pad(a, ((0, 0), (0, pad), (0, 0), (0, 0)))
    a = jnp.max(a.reshape(b, -1, page_size, h, 1), axis=2, keepdims=True)
    a = jnp.broadcast_to(a, (b, a.shape[1], page_size, h, 1)).reshape(b, -1, h, 1)[:, :s]
  return jnp.maximum(a, 1e-10) / qmax(quant.fmt)


def make_attention(kq: Quant, vq: Quant, k_scale, v_scale, length, page_size: int):
  """An `attention_fn` for `rlx.policy.forward` that fake-quantizes K and V first."""

  def attention(index, q, k, v, *, positions, segment_ids):
    del positions
    key = jax.random.fold_in(jax.random.PRNGKey(1234), index)
    out = []
    for x, quant, scale, i in ((k, kq, k_scale, 0), (v, vq, v_scale, 1)):
      x = x.astype(jnp.float32)
      if quant.fmt not in ("none", "bf16", "fp16", "noise"):
        if quant.mode == "static":
          scale = scale[index][None, None]
        else:
          scale = dynamic_scale(x, quant, length, page_size)
      out.append(round_trip(x, quant, scale, jax.random.fold_in(key, i)).astype(k.dtype))
    return policy.dense_causal_attention(q, out[0], out[1], segment_ids)

  return attention


@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4))
def _logits(params, model_config, kq, vq, page_size, tokens, length, k_scale, v_scale):
  attention = make_attention(kq, vq, k_scale, v_scale, length, page_size)
  return policy.forward(params, model_config, tokens, attention_fn=attention)


def sample(
  params, model_config, variant, scales, prompts, g, new_tokens, temperature, rng, eos, page_size
):
  """Autoregressive sampling from the fake-quantized policy (a full forward per token).

  Returns (tokens i32[B, W], mask [B, W] on response tokens up to the first
  EOS, rollout logp [B, W], rollout full log-softmax [B, W, V]).
  """
  p = np.repeat(np.asarray(prompts, np.int32), g, 0)
  b, plen = p.shape
  width = plen + new_tokens
  tokens = np.zeros((b, width), np.int32)
  tokens[:, :plen] = p
  logp = np.zeros((b, width), np.float32)
  full = np.zeros((b, width, model_config.vocab_size), np.float32)
  for t in range(plen, width):
    logits = _logits(
      params, model_config, variant.k, variant.v, page_size, jnp.asarray(tokens), t, *scales
    )
    lp = jax.nn.log_softmax(logits[:, t - 1] / temperature, axis=-1)
    tok = jax.random.categorical(jax.random.fold_in(rng, t), lp, axis=-1)
    tokens[:, t] = np.asarray(tok)
    lp = np.asarray(lp)
    full[:, t] = lp
    logp[:, t] = lp[np.arange(b), tokens[:, t]]
  resp = np.zeros((b, width), bool)
  resp[:, plen:] = True
  is_eos = (tokens == eos) & resp
  after = np.cumsum(is_eos, axis=1) - is_eos  # EOS seen strictly before
  return tokens, resp & (after == 0), logp, full


def exact_full(params, model_config, tokens, temperature):
  """Exact float32 log-softmax at T, aligned so [:, t] predicts tokens[:, t]."""
  logits = _logits(
    params, model_config, Quant(), Quant(), 8, jnp.asarray(tokens), 0, *_dummy(model_config)
  )
  lp = np.asarray(jax.nn.log_softmax(logits / temperature, axis=-1))
  out = np.zeros_like(lp)
  out[:, 1:] = lp[:, :-1]
  return out


def _dummy(model_config):
  z = jnp.ones((model_config.num_layers, model_config.num_kv_heads, model_config.head_dim))
  return z, z


@functools.partial(jax.jit, static_argnums=(1,))
def _record(params, model_config, tokens):
  """K, V [L, B, S, Hkv, Dh] and scores [L, B, Hkv, G, S, S] of the exact forward."""
  b, s = tokens.shape
  lc = model_config
  hd, hkv, g = lc.head_dim, lc.num_kv_heads, lc.num_heads // lc.num_kv_heads
  positions = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32)[None], (b, s))

  def hook(index, q, k, v, cache, *, positions, segment_ids):
    del positions
    ks, vs, sc, qs = cache
    qg = q.reshape(b, s, hkv, g, hd).astype(jnp.float32)
    scores = jnp.einsum("bqhgd,bkhd->bhgqk", qg, k.astype(jnp.float32)) / np.sqrt(hd)
    cache = (
      ks.at[index].set(k.astype(jnp.float32)),
      vs.at[index].set(v.astype(jnp.float32)),
      sc.at[index].set(scores),
      qs.at[index].set(qg),
    )
    return policy.dense_causal_attention(q, k, v, segment_ids), cache

  shape = (lc.num_layers, b, s, hkv, hd)
  cache = (
    jnp.zeros(shape),
    jnp.zeros(shape),
    jnp.zeros((lc.num_layers, b, hkv, g, s, s)),
    jnp.zeros((lc.num_layers, b, s, hkv, g, hd)),
  )
  x = policy.embed(params, model_config, tokens)
  _, cache = policy.layer_scan(params, model_config, x, positions, attention_fn=hook, cache=cache)
  hidden = policy.forward(params, model_config, tokens, return_hidden=True)
  return cache, hidden


def static_scales(kv, mask, gran, k_headroom, v_headroom):
  """amax over the valid tokens of recorded (K, V) [L, B, S, Hkv, Dh] at `gran`, / headroom."""
  out = []
  for x, hr in zip(kv, (k_headroom, v_headroom), strict=True):
    a = np.where(mask[None, :, :, None, None], np.abs(x), 0.0).max(axis=(1, 2))  # [L, Hkv, Dh]
    if gran in ("head", "layer"):
      a = np.broadcast_to(a.max(axis=-1, keepdims=True), a.shape)
    if gran == "layer":
      a = np.broadcast_to(a.max(axis=(1, 2), keepdims=True), a.shape)
    out.append(jnp.asarray(np.maximum(a, 1e-10) / hr, jnp.float32))
  return tuple(out)


def variants(smoke: bool) -> list[Variant]:
  v = []
  grid_formats = ("e4m3", "int8") if smoke else ("e4m3", "e5m2", "e3m4", "int8")
  grans = ("head", "token") if smoke else ("layer", "head", "channel", "page", "token")
  for fmt in grid_formats:
    for gran in grans:
      mode = gran if gran in ("token", "page") else "static"
      v.append(Variant(f"{fmt} / {gran}", Quant(fmt, mode), Quant(fmt, mode), gran))
  if smoke:
    v.append(Variant("e4m3 / head, K only", Quant("e4m3"), Quant(), "head"))
    v.append(Variant("noise 2^-5, K and V", Quant("noise"), Quant("noise"), "head"))
    return v
  for fmt in ("bf16", "fp16"):
    v.append(Variant(f"{fmt} (no scale)", Quant(fmt), Quant(fmt), "head"))
  for gran, mode in (("head", "static"), ("token", "token")):
    v.append(Variant(f"e4m3 / {gran}, K only", Quant("e4m3", mode), Quant(), gran))
    v.append(Variant(f"e4m3 / {gran}, V only", Quant(), Quant("e4m3", mode), gran))
  v.append(Variant("int8 / token, K only", Quant("int8", "token"), Quant(), "token"))
  v.append(Variant("int8 / token, V only", Quant(), Quant("int8", "token"), "token"))
  v.append(Variant("e4m3 / head, calib prompts", Quant("e4m3"), Quant("e4m3"), calib="prompts"))
  v.append(Variant("e4m3 / head, calib same", Quant("e4m3"), Quant("e4m3"), calib="same"))
  v.append(
    Variant(
      "e4m3 / head, headroom 448", Quant("e4m3"), Quant("e4m3"), k_headroom=448.0, v_headroom=448.0
    )
  )
  v.append(
    Variant(
      "e4m3 / head, headroom 20/10", Quant("e4m3"), Quant("e4m3"), k_headroom=20.0, v_headroom=10.0
    )
  )
  v.append(Variant("noise 2^-5, K and V", Quant("noise"), Quant("noise")))
  v.append(Variant("noise 2^-5, K only", Quant("noise"), Quant()))
  v.append(Variant("noise 2^-5, V only", Quant(), Quant("noise")))
  for t in _TEMPS.value:
    v.append(Variant(f"e4m3 / head, T = {t}", Quant("e4m3"), Quant("e4m3"), temperature=float(t)))
  return v


def load_config(smoke: bool):
  spec = importlib.util.spec_from_file_location("base_config", _CONFIG.value)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  c = module.get_config()
  c.log.progress_bar = False
  c.log.print_summary = False
  for item in _SET.value:
    key, _, value = item.partition("=")
    try:
      value = ast.literal_eval(value)
    except (ValueError, SyntaxError):
      pass
    node = c
    *parents, leaf = key.split(".")
    for name in parents:
      node = node[name]
    node[leaf] = value
  if smoke:
    c.eval.dev_examples = 8
    c.eval.test_examples = 8
    c.rl.prompts_per_iteration = 2
    c.rl.num_samples = 2
  return c


def policies(config, seed: int):
  """(model_config, task, {"warmed-up": params, "random": params}, warm-up info, mesh).

  The pieces `rlx.rl.run` starts from, built with the public `rlx.rl` functions:
  the task, mesh and model, the learner's train config, the greedy evaluation
  (sized as the run's) and the run's cached warm-up (`rlx.rl.warm_start`).
  """
  c = config.copy_and_resolve_references()
  c.seed = int(seed)
  spec = rl.RunSpec.from_config(c)  # validates c
  task = rl.make_task(c)
  mesh = rl.build_mesh(c)
  model_config, init_params = rl.build_model(c, task)
  learner = rl.Learner(c, task, model_config, mesh)
  if _SMOKE.value:  # no warm-up (its compiles take most of a smoke run): both are the init
    info = {"steps": 0, "dev_accuracy": None}
    models = {"warmed-up": init_params, "random": init_params}
    return c, model_config, task, models, info, mesh
  rollout_kwargs = rl.sampler_kwargs(c, task, rows=spec.rows, greedy=False)
  seq_len = rollout_kwargs["max_prompt_len"] + rollout_kwargs["max_new_tokens"]
  evaluate = rl.GreedyEvaluator(c, task, model_config, mesh)
  abstract = train.abstract_train_state(model_config, learner.train_config, mesh)
  warm = rl.warm_start(
    c,
    os.path.join(_WORKDIR.value, f"s{seed}"),
    init_params=init_params,
    model_config=model_config,
    train_cfg=learner.train_config,
    mesh=mesh,
    task=task,
    abstract=abstract,
    evaluate=evaluate,
    seq_len=seq_len,
  )
  models = {"warmed-up": warm.state.params, "random": init_params}
  return c, model_config, task, models, warm.info, mesh


def mismatch(exact_logp, rollout_logp, mask):
  mm = objectives.rollout_mismatch_kl(exact_logp, rollout_logp, mask)
  return float(mm.k1), float(mm.k3)


def full_kl(q_full, p_full, mask):
  """Mean over valid tokens of KL(q || p) over the vocabulary."""
  kl = np.sum(np.exp(q_full) * (q_full - p_full), axis=-1)
  return float(np.sum(kl * mask) / max(mask.sum(), 1))


def gather(full, tokens):
  return np.take_along_axis(full, tokens[..., None], axis=-1)[..., 0]


def analyse(c, model_config, task, params, mesh, smoke: bool, rng):
  """Rows of the variant table and the sharpness numbers of one policy."""
  g = rl.samples_per_prompt(c)
  temperature = float(c.rl.temperature)
  page_size = int(c.sampler.page_size)
  train_prompts = [e.prompt_ids for e in task.split("train")]
  n = _PROMPTS.value
  prompts, calib_prompts = train_prompts[:n], train_prompts[n : 2 * n]
  new = len(task.split("train")[0].target_ids)
  eos = int(task.tokenizer.eos_id)
  none = Variant("exact", Quant(), Quant())
  dummy = _dummy(model_config)
  # Exact samples: the "same" calibration, the sharpness numbers; another batch calibrates.
  tokens0, mask0, _, _ = sample(
    params, model_config, none, dummy, prompts, g, new, temperature, rng, eos, page_size
  )
  ctok, cmask, _, _ = sample(
    params,
    model_config,
    none,
    dummy,
    calib_prompts,
    g,
    new,
    temperature,
    jax.random.fold_in(rng, 7),
    eos,
    page_size,
  )
  cmask_full = cmask.copy()
  cmask_full[:, : len(prompts[0])] = True
  (ck, cv, _, _), _ = _record(params, model_config, jnp.asarray(ctok))
  (k0, v0, scores, qs), hidden = _record(params, model_config, jnp.asarray(tokens0))
  k0, v0, ck, cv = (np.asarray(x) for x in (k0, v0, ck, cv))
  mask0_full = mask0.copy()
  mask0_full[:, : len(prompts[0])] = True
  prompt_mask = np.zeros_like(mask0)
  prompt_mask[:, : len(prompts[0])] = True
  calib_kv = {
    "rollout": ((ck, cv), cmask_full),
    "prompts": ((k0, v0), prompt_mask),
    "same": ((k0, v0), mask0_full),
  }
  # rlx's own calibration of the "rollout" batch equals the per-head scales used here.
  rlx_k, rlx_v = sampling.calibrate_kv_scales(params, model_config, jnp.asarray(ctok), cmask_full)
  mine = static_scales((ck, cv), cmask_full, "head", 200.0, 100.0)
  np.testing.assert_allclose(np.asarray(mine[0])[..., 0], np.asarray(rlx_k), rtol=1e-5)
  np.testing.assert_allclose(np.asarray(mine[1])[..., 0], np.asarray(rlx_v), rtol=1e-5)

  rows = []
  for var in variants(smoke):
    t = var.temperature or temperature
    fmt = var.k.fmt if var.k.fmt != "none" else var.v.fmt
    hk = var.k_headroom or (default_headroom(fmt, "k") if fmt in FORMATS or fmt == "int8" else 1)
    hv = var.v_headroom or (default_headroom(fmt, "v") if fmt in FORMATS or fmt == "int8" else 1)
    (kv, cm) = calib_kv[var.calib]
    scales = static_scales(
      kv, cm, var.gran if var.gran in ("layer", "head", "channel") else "head", hk, hv
    )
    toks, mask, rlogp, rfull = sample(
      params, model_config, var, scales, prompts, g, new, t, rng, eos, page_size
    )
    pfull = exact_full(params, model_config, toks, t)
    k1, k3 = mismatch(gather(pfull, toks), rlogp, mask)
    # One rounding of the exact K / V of the exact samples (error size, saturation).
    errs, sats = [], []
    for x, quant, scale in ((k0, var.k, scales[0]), (v0, var.v, scales[1])):
      xs = jnp.asarray(x)
      if quant.fmt in ("none",):
        errs.append(0.0)
        sats.append(0.0)
        continue
      per_layer = []
      sat = 0.0
      for li in range(x.shape[0]):
        if quant.fmt in ("bf16", "fp16", "noise"):
          s = None
        elif quant.mode == "static":
          s = scale[li][None, None]
        else:
          s = dynamic_scale(xs[li], quant, x.shape[2], page_size)
        y = round_trip(xs[li], quant, s, jax.random.PRNGKey(li))
        per_layer.append(np.asarray(y))
        if s is not None and quant.mode == "static":  # dynamic: the amax maps to the max
          sat += float(np.mean(np.abs(x[li] / np.asarray(s)) > qmax(quant.fmt))) / x.shape[0]
      y = np.stack(per_layer)
      m = mask0_full[None, :, :, None, None]
      errs.append(float(np.sqrt(np.sum(((y - x) * m) ** 2) / np.sum((x * m) ** 2))))
      sats.append(sat)
    rows.append((var.name, t, k1, k3, full_kl(rfull, pfull, mask), errs[0], errs[1], sats[0]))

  sharp = sharpness(
    params,
    model_config,
    tokens0,
    mask0,
    k0,
    scores,
    qs,
    hidden,
    temperature,
    calib_kv["rollout"],
    rng,
  )
  check = None
  if _SAMPLER.value and not smoke:
    check = sampler_check(
      c, task, model_config, params, mesh, prompts, (rlx_k, rlx_v), calib_kv["rollout"], page_size
    )
  return rows, sharp, check


def sharpness(params, model_config, tokens, mask, k0, scores, qs, hidden, temperature, calib, rng):
  """Attention / output sharpness numbers on the exact samples (dict of named floats)."""
  del rng
  scores = np.asarray(scores)  # [L, B, Hkv, G, S, S]
  qs = np.asarray(qs)  # [L, B, S, Hkv, G, Dh]
  s = tokens.shape[1]
  # Query positions that predict response tokens: t - 1 for every valid response t.
  qmask = np.zeros_like(mask)
  qmask[:, :-1] = mask[:, 1:]
  causal = np.tril(np.ones((s, s), bool))
  out = {}
  kv, cm = calib
  ks = static_scales(kv, cm, "head", 200.0, 100.0)[0]
  for li in range(scores.shape[0]):
    sc = scores[li]
    allowed = np.broadcast_to(
      causal[None, None, None] & qmask[:, None, None, :, None].astype(bool), sc.shape
    )
    w = np.where(causal[None, None, None], sc, -np.inf)
    p = np.exp(w - w.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    qsel = np.broadcast_to(qmask[:, None, None, :].astype(bool), p.shape[:-1])
    out[f"L{li} RMS score"] = float(np.sqrt(np.mean(sc[allowed] ** 2)))
    out[f"L{li} max score"] = float(np.max(np.abs(sc[allowed])))
    out[f"L{li} max attn prob"] = float(np.mean(p.max(-1)[qsel]))
    ent = -np.sum(np.where(p > 0, p * np.log(np.where(p > 0, p, 1)), 0), axis=-1)
    out[f"L{li} attn entropy"] = float(np.mean(ent[qsel]))
    # Score change when K is rounded to e4m3 with per-head scales.
    k = k0[li]
    kq = np.asarray(round_trip(jnp.asarray(k), Quant("e4m3"), ks[li][None, None], None))
    dsc = np.einsum("bqhgd,bkhd->bhgqk", qs[li], kq - k) / np.sqrt(k.shape[-1])
    out[f"L{li} RMS score error (e4m3 K)"] = float(np.sqrt(np.mean(dsc[allowed] ** 2)))
    out[f"L{li} RMS |k|"] = float(np.sqrt(np.mean(np.sum(k**2, -1))))
    out[f"L{li} RMS |q|"] = float(np.sqrt(np.mean(np.sum(qs[li] ** 2, -1))))
  hidden = np.asarray(hidden)
  head = functools.partial(policy.logits_from_hidden, params, model_config)
  lp = np.asarray(jax.nn.log_softmax(head(jnp.asarray(hidden)) / temperature))
  noise = np.asarray(jax.random.normal(jax.random.PRNGKey(5), hidden.shape))
  hn = hidden * (1 + NOISE_SIGMA * noise)
  lpn = np.asarray(jax.nn.log_softmax(head(jnp.asarray(hn)) / temperature))
  logits_t = np.asarray(head(jnp.asarray(hidden)))
  logits_t = logits_t / temperature
  qm = qmask.astype(bool)
  out["logit std at T"] = float(np.mean(logits_t.std(-1)[qm]))
  out["entropy at T"] = float(np.mean(-np.sum(np.exp(lp) * lp, -1)[qm]))
  out["max prob at T"] = float(np.mean(np.exp(lp).max(-1)[qm]))
  kl = np.sum(np.exp(lpn) * (lpn - lp), -1)
  out["KL, final hidden x (1 + 2^-5 N)"] = float(np.mean(kl[qm]))
  return out


def sampler_check(c, task, model_config, params, mesh, prompts, rlx_scales, calib, page_size):
  """k1 / k3 of rlx's sampler (float32 KV, FP8 e4m3 KV with per-head scales, FP8 e4m3 KV with
  per-token scales: `kv_scale_mode="per_token"`) vs the exact forward.

  Also the fake-quant e4m3 / head (e4m3 / token) log-probs on the sampler's own FP8
  samples ("fake vs sampler": k3 of the sampler's log-probs against them).
  """
  del calib
  g = rl.samples_per_prompt(c)
  t = float(c.rl.temperature)
  logprobs = jax.jit(policy.token_logprobs, static_argnums=1, static_argnames=("temperature",))
  out = {}
  for name, kv_dtype, mode in (
    ("float32", "float32", "static"), ("fp8_e4m3", "fp8_e4m3", "static"),
    ("fp8_e4m3 / token", "fp8_e4m3", "per_token"),
  ):  # fmt: skip
    cc = c.copy_and_resolve_references()
    cc.rollout.kv_dtype, cc.rollout.kv_scale_mode = kv_dtype, mode
    kwargs = rl.sampler_kwargs(cc, task, rows=len(prompts) * g, greedy=False)
    rollout = rl.SyncRollout(
      rl.make_sampler(model_config, kwargs, mesh),
      num_samples=g,
      max_prompt_len=kwargs["max_prompt_len"],
      max_new_tokens=kwargs["max_new_tokens"],
    )
    if rollout.fp8 is not None and rollout.fp8.kv_fp8:
      rollout.fp8.kv_scales = rollout.fp8.place(rlx_scales)
    batch = rollout.collect(params, prompts, jax.random.PRNGKey(3))
    old, _ = logprobs(params, model_config, batch.tokens, batch.response_mask, temperature=t)
    k1, k3 = mismatch(old, batch.rollout_logp, batch.response_mask)
    row = {"k1": k1, "k3": k3}
    if kv_dtype != "float32":
      ks = jnp.asarray(
        np.broadcast_to(
          np.asarray(rlx_scales[0])[..., None], (*rlx_scales[0].shape, model_config.head_dim)
        )
      )
      vs = jnp.asarray(
        np.broadcast_to(
          np.asarray(rlx_scales[1])[..., None], (*rlx_scales[1].shape, model_config.head_dim)
        )
      )
      toks = np.asarray(batch.tokens)
      quant = Quant("e4m3", "token") if mode == "per_token" else Quant("e4m3")
      logits = _logits(
        params,
        model_config,
        quant,
        quant,
        page_size,
        jnp.asarray(toks),
        toks.shape[1],
        ks,
        vs,
      )
      fake, _ = policy.logprobs_from_logits(logits, toks, batch.response_mask, temperature=t)
      row["fake k1"], row["fake k3"] = mismatch(old, fake, batch.response_mask)
      row["fake vs sampler k3"] = mismatch(fake, batch.rollout_logp, batch.response_mask)[1]
    out[name] = row
  return out


def fmt_row(cells):
  return "| " + " | ".join(cells) + " |"


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  logging.set_verbosity(logging.WARNING)
  smoke = _SMOKE.value
  config = load_config(smoke)
  seeds = [int(s) for s in _SEEDS.value]
  t0 = time.time()
  results, sharps, checks, infos = {}, {}, {}, {}
  for seed in seeds:
    c, model_config, task, models, info, mesh = policies(config, seed)
    infos[seed] = info
    for kind, params in models.items():
      rows, sharp, check = analyse(
        c, model_config, task, params, mesh, smoke, jax.random.PRNGKey(100 + seed)
      )
      results[(kind, seed)], sharps[(kind, seed)], checks[(kind, seed)] = rows, sharp, check
      print(f"{kind} seed {seed}: {time.time() - t0:.0f} s", flush=True)
  keys = [(k, s) for k in ("warmed-up", "random") for s in seeds]
  g = rl.samples_per_prompt(c)
  lines = [
    "# FP8 KV-cache rollout mismatch: fake-quantization study",
    "",
    f"Policies: {os.path.relpath(_CONFIG.value, os.path.dirname(_ROOT))} "
    f"({model_config.num_layers} layers, width {model_config.hidden_size}, "
    f"{model_config.num_heads} heads / {model_config.num_kv_heads} KV heads, head dim "
    f"{model_config.head_dim}, QK-norm {model_config.qk_norm}) after its supervised warm-up "
    "(`warmed-up`), and the same model at its initial random weights (`random`), seeds "
    f"{', '.join(map(str, seeds))}. Warm-ups: "
    + "; ".join(
      f"seed {s}: {infos[s]['steps']} steps, dev acc {infos[s]['dev_accuracy']}" for s in seeds
    )
    + f". {_PROMPTS.value} train prompts x G = {g} samples per variant, "
    f"T = {c.rl.temperature} unless the row says otherwise. Method and quantities: the "
    "docstring of experiments/fp8_mismatch.py.",
    "",
    "## k3 per variant (mismatch k3 = KL(rollout || trainer) estimator on sampled tokens)",
    "",
    fmt_row(["variant", "T", *[f"k3 {k} s{s}" for k, s in keys]]),
    "|" + "---|" * (2 + len(keys)),
  ]
  names = [r[0] for r in results[keys[0]]]
  for i, name in enumerate(names):
    r0 = results[keys[0]][i]
    lines.append(fmt_row([name, f"{r0[1]:g}", *[f"{results[k][i][3]:.2e}" for k in keys]]))
  lines += [
    "",
    "## All quantities per variant",
    "",
    "k1, k3: sampled-token estimators; KL: exact KL(rollout || trainer) over the vocabulary, "
    "mean per response token; K / V rel err: ||X~ - X|| / ||X|| of one rounding of the exact "
    "samples' K / V (all layers); K sat: fraction of K values above the format max (static "
    "scales; 0 for dynamic ones).",
    "",
    fmt_row(["policy", "variant", "T", "k1", "k3", "KL", "K rel err", "V rel err", "K sat"]),
    "|" + "---|" * 9,
  ]
  for k in keys:
    for name, t, k1, k3, kl, ek, ev, sat in results[k]:
      lines.append(
        fmt_row(
          [
            f"{k[0]} s{k[1]}",
            name,
            f"{t:g}",
            f"{k1:.2e}",
            f"{k3:.2e}",
            f"{kl:.2e}",
            f"{ek:.4f}",
            f"{ev:.4f}",
            f"{sat:.4f}",
          ]
        )
      )
  lines += [
    "",
    "## Sharpness (exact samples)",
    "",
    fmt_row(["quantity", *[f"{k} s{s}" for k, s in keys]]),
    "|" + "---|" * (1 + len(keys)),
  ]
  for q in sharps[keys[0]]:
    lines.append(fmt_row([q, *[f"{sharps[k][q]:.4g}" for k in keys]]))
  if _SAMPLER.value and not smoke:
    lines += [
      "",
      "## rlx's sampler vs fake quantization (per-[layer, KV head] scales of the `rollout` "
      "calibration, or per-token scales)",
      "",
      "sampler k1 / k3: rlx.sampling rollout (its own samples) vs the exact trainer; fake k1 / "
      "k3: the fake-quant e4m3 / head (fp8_e4m3 / token: e4m3 / token) log-probs of the same "
      "samples vs the trainer; fake vs sampler k3: the sampler's log-probs vs the fake-quant "
      "ones.",
      "",
      fmt_row(
        [
          "policy",
          "kv_dtype",
          "sampler k1",
          "sampler k3",
          "fake k1",
          "fake k3",
          "fake vs sampler k3",
        ]
      ),
      "|" + "---|" * 7,
    ]
    for k in keys:
      for kv_dtype, row in checks[k].items():
        cells = [row.get(n) for n in ("k1", "k3", "fake k1", "fake k3", "fake vs sampler k3")]
        lines.append(
          fmt_row([f"{k[0]} s{k[1]}", kv_dtype, *["-" if x is None else f"{x:.2e}" for x in cells]])
        )
  cmd = " ".join(["python", "experiments/fp8_mismatch.py", *sys.argv[1:]])
  lines += ["", f"Rerun: `{cmd}` ({time.time() - t0:.0f} s)", ""]
  text = "\n".join(lines)
  print(text)
  if _OUT.value:
    with open(_OUT.value, "w") as f:
      f.write(text)


if __name__ == "__main__":
  app.run(main)
