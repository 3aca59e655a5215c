"""`Sampler`: continuous-batching generation from a paged KV cache, plus a pure jittable path.

`Sampler.generate` / `generate_requests` validate their inputs and run the host
loop: `rlx.sampling._scheduler.Scheduler` decides between device windows of up
to `steps_per_sync` decode steps what runs (admission, prefix sharing,
preemption, early stop; in the spirit of vLLM's scheduler, Kwon et al. 2023,
https://arxiv.org/abs/2309.06180), `rlx.sampling._pages.PageManager` owns the
pages (free stack, reference counts, shared prompt pages), and the jitted
`rlx.sampling._engine.Engine` runs prefill, page copies and the decode loop.
Prefill compiles at most `prefill_compile_bound(config)` times per sampler
whatever the prompt lengths (once for max_slots <= 8 and prefill_chunk <= 8);
the decode loop compiles once per sampler (fixed shapes; every count,
threshold and scale is a traced argument).

Benchmarking: `Completions.stats` has tokens_per_s (generated tokens over the
call's wall time: warm up first, the first call compiles), decode_steps,
preemptions and peak_pages_used. Static vs continuous batching: the same
`SamplerConfig` with `continuous_batching=False` (waves: a new batch is
admitted only when all slots are idle, windows never end early) vs True.
Pool size: the same work with `num_pages` scaled (a decode step gathers only
the pages its slots' tables name, so its cost follows the tokens).
"""

import dataclasses
import math
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from rlx import _memory, policy
from rlx._mesh_axes import BATCH_AXES
from rlx.sampling._config import SamplerConfig
from rlx.sampling._engine import (
  Knobs,
  KVPool,
  PageState,
  SlotState,
  compile_key,
  empty_slots,
  engine_for,
  stop_id_slots,
)
from rlx.sampling._fp8 import quantize_params
from rlx.sampling._pages import PageManager, copy_plan
from rlx.sampling._scheduler import (
  Request,
  Scheduler,
  prefill_calls,
  prefill_width,
)
from rlx.sampling._scheduler import prefill_compile_bound as prefill_compile_bound
from rlx.sampling._scheduler import prefill_rows as prefill_rows
from rlx.sampling._scheduler import prefill_widths as prefill_widths


class Completions(NamedTuple):
  """Generated samples; rows are prompt-major (row i * num_samples + j = sample j of prompt i).

  Attributes:
    tokens: i32[N, max_new_tokens], right-padded with 0 (a stop token is kept).
    logprobs: f32[N, max_new_tokens], `log softmax(logits / T)[token]` over the
      full vocabulary (greedy: T = 1); 0 on padding.
    lengths: i32[N], generated tokens per row.
    finish_reason: per row "stop" (emitted a stop token), "length", or
      "unfinished" (`generate_requests` stopped before the row ended).
    prompt_index: i32[N], the prompt each row answers.
    stats: tokens_per_s, generated_tokens (new tokens), decode_steps,
      slot_utilisation (new tokens / (decode steps * max_slots)), stopped_early,
      preemptions, peak_pages_used, num_pages, prefill_tokens, prefill_calls,
      syncs, params_updates (in-flight switches to newer params), wall_s.
    versions: i32[N, max_new_tokens], the policy version of the params that
      generated each token of this call (`generate_requests`' `policy_version`,
      then each in-flight update's); -1 on a resumed row's prefix and on padding.
  """

  tokens: np.ndarray
  logprobs: np.ndarray
  lengths: np.ndarray
  finish_reason: tuple[str, ...]
  prompt_index: np.ndarray
  stats: dict[str, float]
  versions: np.ndarray


class Sampler:
  """Jitted paged-KV sampler with continuous batching (module docstring).

  Args:
    model_config: the policy's `rlx.policy.ModelConfig`.
    config: a `SamplerConfig`.
    mesh: optional `rlx.train.make_mesh` mesh: slots are split over the batch
      axes ("data", "fsdp"), KV heads over "tensor"; params may be passed
      sharded as the train state holds them (no host copy).

  Raises:
    ValueError: bad config (stop ids outside the vocabulary, slots not divisible
      by the mesh's batch axes, ...).
    rlx.train.OutOfMemoryError: from `generate` / `generate_requests`, when the
      pool or a prefill / decode program does not fit in device memory; it lists
      the settings that lower it (`memory_advice`).
  """

  def __init__(
    self, model_config: policy.ModelConfig, config: SamplerConfig, mesh: Mesh | None = None
  ):
    if not isinstance(model_config, policy.ModelConfig):
      raise ValueError(
        f"`model_config` must be an rlx.policy.ModelConfig, got {type(model_config).__name__}."
      )
    if not isinstance(config, SamplerConfig):
      raise ValueError(f"`config` must be a SamplerConfig, got {type(config).__name__}.")
    bad = [s for s in config.stop_token_ids if s >= model_config.vocab_size]
    if bad:
      raise ValueError(
        f"`stop_token_ids` {bad} are outside the vocabulary [0, {model_config.vocab_size})."
      )
    if mesh is not None:
      if not isinstance(mesh, Mesh):
        raise ValueError(f"`mesh` must be a jax.sharding.Mesh or None, got {type(mesh).__name__}.")
      shards = int(np.prod([mesh.shape[a] for a in BATCH_AXES if a in mesh.shape]))
      if config.max_slots % shards:
        raise ValueError(
          f"`max_slots`={config.max_slots} must be divisible by the mesh's batch axes "
          f"{BATCH_AXES} (size {shards})."
        )
    self.model_config = model_config
    self.config = config
    self.mesh = mesh
    key = compile_key(config)
    if key.top_k >= model_config.vocab_size:  # top-k over the whole vocabulary is off
      key = dataclasses.replace(key, top_k=0)
    self._engine = engine_for(model_config, key, mesh)
    self._pool = None

  # --------------------------------------------------------------------------------------
  # Device memory.

  def pool_bytes_per_chip(self) -> int:
    """Bytes of the K and V page pools (`[L, Hkv, num_pages, page_size, D]` each) per chip.

    With per-token scales, also their float32 `[L, Hkv, num_pages, page_size]`
    scale pools. The pools are split over the mesh's "tensor" axis (KV heads)
    where it divides the heads, and whole on every chip of the batch axes.
    """
    m, c = self.model_config, self.config
    shape = (m.num_layers, m.num_kv_heads, c.num_pages, c.page_size, m.head_dim)
    sharding = self._engine.pool_sharding()
    if sharding is not None:
      shape = sharding.shard_shape(shape)
    row = shape[-1] * jnp.dtype(c.page_dtype(m.compute_dtype)).itemsize
    if self._engine.per_token:
      row += 4  # one float32 scale per token and KV head
    return 2 * math.prod(shape[:-1]) * row

  def memory_advice(self) -> tuple[str, ...]:
    """The settings that lower the sampler's device memory, with their current values.

    What the `rlx.train.OutOfMemoryError` of a `generate` call that does not fit
    lists. Names are the `rlx.rl.get_config()` fields (`sampler.*`, `rollout.*`,
    `mesh.*`), the `SamplerConfig` fields of the same names where there is no rl
    config field.
    """
    m, c = self.model_config, self.config
    dtype = jnp.dtype(c.page_dtype(m.compute_dtype))
    lines = [
      f"sampler.num_pages (now {c.num_pages} pages of {c.page_size} tokens: the K/V pool "
      f"holds {self.pool_bytes_per_chip() / 2**30:.3g} GiB per chip): fewer pages",
      f"sampler.max_slots (now {c.max_slots}): fewer sequences decoded at once, smaller "
      "decode and prefill activations",
      f"prefill_chunk of the SamplerConfig (now {c.prefill_chunk}): fewer prompt tokens per "
      "row in one prefill call",
    ]
    if dtype.itemsize > 1:
      lines.append(
        f"rollout.kv_dtype = 'fp8_e4m3' (now {dtype.name}): K/V pages of 1 byte per value"
      )
    tensor = int(self.mesh.shape.get("tensor", 1)) if self.mesh is not None else 1
    lines.append(
      f"mesh.tensor (now {tensor}, {m.num_kv_heads} KV heads): split the KV heads, and the "
      "pool, over more chips (the pool is whole on every chip of the data and fsdp axes)"
    )
    return tuple(lines)

  def kv_pool(self) -> KVPool | None:
    """The K/V page pool on device, as the last `generate` / `generate_requests` call left it.

    For inspecting the cache: its dtype, sharding and bytes, or the per-token
    FP8 scales written. Rows that no sequence of that call wrote keep what
    earlier calls wrote there (zeros, and scales 1, where none did). The next
    call reuses (donates) these buffers, which deletes the arrays returned
    here: copy what is to be kept first.

    Returns:
      None before the first call, and after a call that failed while running, else a
      NamedTuple `(k, v, k_scale, v_scale)`: `k` and `v` `[L, Hkv, num_pages,
      page_size, D]` in the page dtype, `k_scale` and `v_scale` float32 `[L,
      Hkv, num_pages, page_size]` with kv_scale_mode "per_token", else None.
    """
    return self._pool

  # --------------------------------------------------------------------------------------
  # Compiled programs.

  def compile_counts(self) -> dict[str, int]:
    """Programs compiled so far by this sampler's jitted device functions.

    Samplers whose configs differ only in values that reach the device traced
    (temperature, top-p value, stop-token values, steps_per_sync,
    continuous_batching) share these functions and so these counts (see
    `shares_compiled_programs`). A call that compiles nothing new leaves them
    unchanged. Counted as the programs JAX traces (one per new abstract
    signature: shapes, dtypes, static values), which a long process keeps
    counting where `jax.jit(...)._cache_size()` reads 0 (`rlx.counted_jit`). Inputs
    of the same signature placed on other devices compile again without a
    new trace; that is not counted.

    Returns:
      {"decode": the decode window (one per sampler: fixed shapes),
       "prefill": chunked prefill (at most
       `rlx.sampling.scheduling.prefill_compile_bound(config)`),
       "copy_pages": the prefix-sharing page copy}.
    """
    traces = self._engine.traces
    return {name: traces[name] for name in ("decode", "prefill", "copy_pages")}

  def shares_compiled_programs(self, other: "Sampler") -> bool:
    """Whether `other` runs the same jitted device functions (and their compiled programs).

    True when the two configs differ only in traced values (`compile_counts`),
    for the same model config and mesh, while the shared programs are cached
    (`clear_compile_cache` drops them).
    """
    if not isinstance(other, Sampler):
      raise ValueError(f"`other` must be a Sampler, got {type(other).__name__}.")
    return self._engine is other._engine

  def trace_decode(
    self, params: policy.Params, *, kv_scales: tuple[Any, Any] | None = None
  ) -> jax.stages.Traced:
    """The decode window that `generate` runs, traced on an idle state (nothing runs).

    For inspecting the program: `.jaxpr` (its primitives), `.lower().as_text()`
    (StableHLO), `.lower().compile().as_text()` (the optimised HLO). It is the
    same jitted function with the same static arguments and shapes as in
    `generate`, so lowering it for a compile adds to `compile_counts()["decode"]`
    only if `generate` has not compiled it yet.

    Args:
      params: the policy params, or their `jax.eval_shape` (abstract leaves).
      kv_scales: as in `generate` (required for FP8 KV); arrays or
        `jax.ShapeDtypeStruct`s.

    Returns:
      A `jax.stages.Traced`.
    """
    cfg, eng = self.config, self._engine
    S, P = cfg.max_slots, cfg.num_pages
    params, pool = self._abstract_params_and_pool(params)
    pages = PageState(
      page_table=np.zeros((S, eng.pages_per_sequence), np.int32),
      refcount=np.zeros((P,), np.int32),
      free_stack=np.arange(P, dtype=np.int32),
      num_free=np.int32(P),
    )
    slots = empty_slots(S, cfg.max_new_tokens)
    page_sh, slot_sh = eng.state_shardings()
    if page_sh is not None:  # placed as `generate` places them
      pages, slots = (
        jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=sh), t, s)
        for t, s in ((pages, page_sh), (slots, slot_sh))
      )
    k_scale, v_scale = self._traced_kv_scales(kv_scales)
    knobs = self._knobs(cfg.steps_per_sync, S + 1)
    return eng.decode.trace(
      params, pool, pages, slots, jax.random.key(0), k_scale, v_scale, knobs, allocate=True
    )

  def trace_prefill(
    self,
    params: policy.Params,
    *,
    rows: int | None = None,
    width: int | None = None,
    kv_scales: tuple[Any, Any] | None = None,
  ) -> jax.stages.Traced:
    """A prefill call of `generate`, traced (nothing runs); like `trace_decode`.

    `generate` runs prefill in calls of `rows` rows x `width` tokens
    (`rlx.sampling.scheduling.prefill_calls`): rows a power of two between 8
    and `max_slots` rounded up to one, width one of
    `rlx.sampling.scheduling.prefill_widths(prefill_chunk)`. The defaults are
    the widest call, every slot admitted at once with a full chunk each.

    Args:
      params: the policy params, or their `jax.eval_shape` (abstract leaves).
      rows: B, rows of the call (default: `max_slots` rounded up to a power of two).
      width: W, tokens per row (default: `prefill_chunk`).
      kv_scales: as in `generate` (required for FP8 KV); arrays or
        `jax.ShapeDtypeStruct`s.

    Returns:
      A `jax.stages.Traced` of `prefill(params, pool, tokens i32[B, W], start
      i32[B], num_new i32[B], page_table i32[B, pages_per_sequence], k_scale,
      v_scale) -> pool` (the pool donated).

    Raises:
      ValueError: `rows` or `width` that no prefill call of this sampler uses.
    """
    cfg, eng = self.config, self._engine
    widest = prefill_rows(cfg.max_slots)
    rows = widest[-1] if rows is None else rows
    width = cfg.prefill_chunk if width is None else width
    if rows not in widest:
      raise ValueError(f"`rows` must be one of the prefill row buckets {widest}, got {rows!r}.")
    widths = prefill_widths(cfg.prefill_chunk)
    if width not in widths:
      raise ValueError(f"`width` must be one of the prefill widths {widths}, got {width!r}.")
    params, pool = self._abstract_params_and_pool(params)
    ints = np.zeros((rows,), np.int32)
    table = np.zeros((rows, eng.pages_per_sequence), np.int32)
    k_scale, v_scale = self._traced_kv_scales(kv_scales)
    tokens = np.zeros((rows, width), np.int32)
    return eng.prefill.trace(params, pool, tokens, ints, ints, table, k_scale, v_scale)

  def _abstract_params_and_pool(self, params):
    """Abstract run params (`quantize_params`) and page pool, with the shardings of a run.

    Leaves that `quantize_params` passes through keep the caller's sharding (e.g. the
    train state's, or FP8 params placed by `rlx.policy.param_shardings`); the pool gets
    the engine's pool sharding.
    """
    cfg, eng = self.config, self._engine
    run = jax.eval_shape(lambda p: quantize_params(p, cfg), params)
    if jax.tree.structure(run) == jax.tree.structure(params):
      run = jax.tree.map(
        lambda r, p: jax.ShapeDtypeStruct(r.shape, r.dtype, sharding=getattr(p, "sharding", None)),
        run,
        params,
      )
    pool = jax.eval_shape(lambda: eng.empty_pool(cfg.num_pages))
    sharding = eng.pool_sharding()
    pool = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), pool)
    return run, pool

  def _traced_kv_scales(self, kv_scales):
    """`_kv_scales` that also takes `jax.ShapeDtypeStruct` scales (returns abstract ones)."""
    if isinstance(kv_scales, tuple | list) and any(
      isinstance(s, jax.ShapeDtypeStruct) for s in kv_scales
    ):
      return jax.eval_shape(self._kv_scales, tuple(kv_scales))
    return self._kv_scales(kv_scales)

  def _knobs(self, max_steps: int, exit_after: int):
    """This sampler's (not the shared engine's) traced sampling knobs."""
    cfg = self.config
    return Knobs(
      temperature=np.float32(cfg.temperature if cfg.temperature > 0 else 1.0),
      top_p=np.float32(cfg.top_p),
      stop_token_ids=np.pad(
        np.asarray(cfg.stop_token_ids, np.int32).reshape(-1),
        (0, stop_id_slots(len(cfg.stop_token_ids)) - len(cfg.stop_token_ids)),
        constant_values=-1,
      ),
      max_steps=np.int32(max_steps),
      exit_after=np.int32(exit_after),
    )

  # --------------------------------------------------------------------------------------
  # Validation.

  def _check_params(self, params):
    """Validates `params` (dense or FP8 linears); returns the params to run (`quantize_params`)."""
    policy.check_params(params, self.model_config, allow_fp8=True)
    return quantize_params(params, self.config)

  def _updated_params(self, update, version: int):
    """The params of a `params_update()` result `(params, version)`, checked."""
    if not isinstance(update, tuple) or len(update) != 2:
      raise ValueError(
        f"`params_update()` must return None or a (params, version) pair, got {type(update)}."
      )
    new_version = _check_version(update[1], "params_update()'s version")
    if new_version < version:
      raise ValueError(
        f"`params_update()` returned version {new_version}, older than the current {version}."
      )
    return self._check_params(update[0]), new_version

  def _kv_scales(self, kv_scales):
    """(k_scale, v_scale) as f32[L, Hkv] arrays."""
    m = self.model_config
    shape = (m.num_layers, m.num_kv_heads)
    fp8 = jnp.dtype(self._engine.page_dtype).itemsize == 1
    if self._engine.per_token:
      if kv_scales is not None:
        raise ValueError(
          "`kv_scales` must be None with kv_scale_mode='per_token' (each token's scale is "
          "computed when its K/V are written)."
        )
      ones = np.ones(shape, np.float32)  # unused: the pool holds the scales
      return ones, ones
    if kv_scales is None:
      if fp8:
        raise ValueError(
          f"`kv_scales` (k_scale, v_scale) are required for kv_dtype={self.config.kv_dtype!r}: "
          "K = page * k_scale (e.g. rlx.policy.kv_absmax(...) / headroom)."
        )
      ones = np.ones(shape, np.float32)  # host array: no device program to compile
      return ones, ones
    if not isinstance(kv_scales, tuple | list) or len(kv_scales) != 2:
      raise ValueError("`kv_scales` must be a pair (k_scale, v_scale) of float arrays.")
    out = []
    for name, s in zip(("k_scale", "v_scale"), kv_scales, strict=True):
      s = jnp.asarray(s)
      if not jnp.issubdtype(s.dtype, jnp.floating):
        raise ValueError(f"`kv_scales` {name} must be a float array, got {s.dtype}.")
      if s.shape == (m.num_layers,):
        s = s[:, None]
      elif s.shape not in ((), shape):
        raise ValueError(
          f"`kv_scales` {name} must be a scalar, [L={m.num_layers}] or [L, Hkv]={shape}, "
          f"got shape {s.shape}."
        )
      out.append(jnp.broadcast_to(s.astype(jnp.float32), shape))
    return tuple(out)

  def _check_prompts(self, prompts) -> list:
    if isinstance(prompts, np.ndarray | jax.Array) and np.ndim(prompts) == 2:
      prompts = list(np.asarray(prompts))
    if not isinstance(prompts, Sequence) or isinstance(prompts, str) or not len(prompts):
      raise ValueError("`prompts` must be a non-empty list of token-id lists.")
    vocab, cap = self.model_config.vocab_size, self.config.max_prompt_len
    out = []
    for i, p in enumerate(prompts):
      arr = np.asarray(p)
      if arr.ndim != 1 or (arr.size and not np.issubdtype(arr.dtype, np.integer)):
        raise ValueError(f"`prompts[{i}]` must be a 1-D list of int token ids, got {p!r:.80}.")
      if arr.size == 0:
        raise ValueError(f"`prompts[{i}]` is empty (a prompt needs at least one token).")
      if arr.size > cap:
        raise ValueError(f"`prompts[{i}]` has {arr.size} tokens > max_prompt_len={cap}.")
      if arr.min() < 0 or arr.max() >= vocab:
        bad = int(arr.max() if arr.max() >= vocab else arr.min())
        raise ValueError(f"`prompts[{i}]` contains token id {bad} outside [0, vocab_size={vocab}).")
      out.append(arr.astype(np.int32))
    return out

  @staticmethod
  def _check_num_samples(num_samples):
    if not isinstance(num_samples, int | np.integer) or isinstance(num_samples, bool):
      raise ValueError(f"`num_samples` must be an int >= 1, got {num_samples!r}.")
    if num_samples < 1:
      raise ValueError(f"`num_samples` must be >= 1, got {num_samples}.")
    return int(num_samples)

  @staticmethod
  def _check_rng(rng):
    if not isinstance(rng, jax.Array | np.ndarray):
      raise ValueError(f"`rng` must be a jax.random key, got {type(rng).__name__}.")
    typed = jax.dtypes.issubdtype(rng.dtype, jax.dtypes.prng_key)
    if not (typed and rng.shape == ()) and not (rng.dtype == np.uint32 and rng.shape == (2,)):
      raise ValueError(
        f"`rng` must be a single key (jax.random.key or PRNGKey), got {rng.dtype}{rng.shape}."
      )
    return rng

  # --------------------------------------------------------------------------------------
  # generate.

  def generate(
    self,
    params: policy.Params,
    prompts: Sequence[Sequence[int]],
    *,
    num_samples: int = 1,
    rng: jax.Array,
    kv_scales: tuple[Any, Any] | None = None,
  ) -> Completions:
    """Samples `num_samples` completions of every prompt.

    Args:
      params: the policy params (host or device arrays, sharded or not; e.g.
        `train_state.params` as is).
      prompts: a list of token-id lists (ragged), each 1..max_prompt_len long.
      num_samples: G >= 1 samples per prompt.
      rng: a `jax.random` key; sample j of prompt i uses
        `fold_in(fold_in(fold_in(rng, i), j), t)` for its t-th token.
      kv_scales: optional (k_scale, v_scale) float arrays, scalar / [L] /
        [L, Hkv] (K = page * k_scale); required for FP8 KV with
        kv_scale_mode "static", None with "per_token". Traced: changing them
        does not recompile.

    Returns:
      `Completions`, N = len(prompts) * num_samples rows, prompt-major.
    """
    prompts = self._check_prompts(prompts)
    num_samples = self._check_num_samples(num_samples)
    rng = self._check_rng(rng)
    params = self._check_params(params)
    k_scale, v_scale = self._kv_scales(kv_scales)
    t0 = time.perf_counter()
    requests = [
      Request(i * num_samples + j, i, j, p) for i, p in enumerate(prompts)
      for j in range(num_samples)
    ]  # fmt: skip
    return self._schedule(params, requests, rng, k_scale, v_scale, t0, stop_when=None)

  def generate_requests(
    self,
    params: policy.Params,
    prompts: Sequence[Sequence[int]],
    *,
    prompt_index: Sequence[int],
    sample_index: Sequence[int],
    rng: jax.Array,
    prefix_tokens: Sequence[Sequence[int]] | None = None,
    prefix_logprobs: Sequence[Sequence[float]] | None = None,
    stop_when: Callable[[np.ndarray], bool] | None = None,
    kv_scales: tuple[Any, Any] | None = None,
    policy_version: int = 0,
    params_update: Callable[[], tuple[policy.Params, int] | None] | None = None,
  ) -> Completions:
    """Generates (or resumes) one sample per row, optionally stopping early.

    The building block of partial rollouts (APRIL, Zhou et al. 2025,
    https://arxiv.org/abs/2509.18521; slime's `partial_rollout`): a row may
    start with a response prefix from an earlier call (its tokens and
    recorded log-probs are kept as they are; the KV of prompt + prefix is
    recomputed by prefill on admission, as after a preemption), and the host
    loop ends at the first scheduling point where `stop_when` says so, handing
    back every unfinished row with what it generated so far.

    Rows are queued FIFO in the given order. Rows without a prefix that share
    a `prompt_index` share the prompt's KV pages (they must have equal
    prompts). Row r's t-th response token (t counts the prefix) is drawn with
    `fold_in(fold_in(fold_in(rng, prompt_index[r]), sample_index[r]), t)`, so
    `generate(params, P, num_samples=G, rng=k)` equals this call with
    prompt-major rows `prompt_index = i`, `sample_index = j`, and a row
    stopped and resumed with the same params and key equals the uninterrupted
    row (up to float rounding of the recomputed K/V).

    In-flight weight updates (PipelineRL, Piche et al. 2025,
    https://arxiv.org/abs/2509.19128): with `params_update`, the host loop asks
    it at every scheduling point (between decode windows) for newer params;
    the running rows continue with them from their next token, their K/V
    cached by the older params staying in place (a preempted row's K/V is
    recomputed by the params current at its re-admission, and a sample
    admitted after the update prefills its prompt with the new params, not
    sharing its siblings' older prompt pages). Each token records the version
    that generated it (`Completions.versions`).

    Args:
      params: the policy params (as in `generate`).
      prompts: N token-id lists, one per row (ragged, 1..max_prompt_len long).
      prompt_index: N ints in [0, 2**31): the row's prompt/group id (rng, sharing).
      sample_index: N ints in [0, 2**31); (prompt_index, sample_index) pairs unique.
      rng: a `jax.random` key.
      prefix_tokens: optional N lists of response tokens already generated,
        each shorter than max_new_tokens (empty: a fresh row).
      prefix_logprobs: N float lists matching `prefix_tokens` (required with it).
      stop_when: optional `f(done bool[N]) -> bool`, called at every
        scheduling point with the rows finished so far (including those
        finished in earlier windows); True ends the call.
      kv_scales: as in `generate`.
      policy_version: int >= 0, the version of `params` (recorded per token).
      params_update: optional `f() -> None | (params, version)`, called after
        every decode window that leaves rows to run (and does not end the call
        on `stop_when`): None
        keeps the current params, a pair switches to them (same structure;
        `version` >= the current one) from the next admission and window on.

    Returns:
      `Completions` with N rows in the given order: tokens / logprobs hold
      prefix + new tokens, `finish_reason` is "stop", "length" or
      "unfinished" (stopped early), `prompt_index` is the given ids,
      `versions` the version of each new token;
      `stats["generated_tokens"]` counts new tokens only.
    """
    prompts = self._check_prompts(prompts)
    n = len(prompts)
    rng = self._check_rng(rng)
    params = self._check_params(params)
    k_scale, v_scale = self._kv_scales(kv_scales)
    ids = {}
    for name, x in (("prompt_index", prompt_index), ("sample_index", sample_index)):
      arr = np.asarray(x)
      if arr.shape != (n,) or (n and not np.issubdtype(arr.dtype, np.integer)):
        raise ValueError(f"`{name}` must be {n} ints (one per prompt), got shape {arr.shape}.")
      if n and (arr.min() < 0 or arr.max() >= 2**31):
        raise ValueError(
          f"`{name}` must be in [0, 2**31), got values in [{arr.min()}, {arr.max()}]."
        )
      ids[name] = arr.astype(np.int64)
    pairs = set(zip(ids["prompt_index"].tolist(), ids["sample_index"].tolist(), strict=True))
    if len(pairs) != n:
      raise ValueError(
        "(`prompt_index`, `sample_index`) pairs must be unique (one row per sample)."
      )
    first: dict[int, np.ndarray] = {}
    for i, p in zip(ids["prompt_index"].tolist(), prompts, strict=True):
      if not np.array_equal(first.setdefault(i, p), p):
        raise ValueError(f"rows with `prompt_index` {i} have different prompts.")
    if (prefix_tokens is None) != (prefix_logprobs is None):
      raise ValueError("`prefix_tokens` and `prefix_logprobs` must be given together.")
    if prefix_tokens is None:
      prefix_tokens = prefix_logprobs = [[] for _ in range(n)]
    if len(prefix_tokens) != n or len(prefix_logprobs) != n:
      raise ValueError(
        f"`prefix_tokens` / `prefix_logprobs` must have one entry per prompt ({n}), got "
        f"{len(prefix_tokens)} / {len(prefix_logprobs)}."
      )
    M, vocab = self.config.max_new_tokens, self.model_config.vocab_size
    requests = []
    for r in range(n):
      toks = np.asarray(prefix_tokens[r], np.int64).reshape(-1)
      lps = np.asarray(prefix_logprobs[r], np.float64).reshape(-1)
      if toks.size != lps.size:
        raise ValueError(
          f"`prefix_logprobs[{r}]` has {lps.size} values for {toks.size} prefix tokens."
        )
      if toks.size >= M:
        raise ValueError(
          f"`prefix_tokens[{r}]` has {toks.size} tokens >= max_new_tokens={M} (a finished row)."
        )
      if toks.size and (toks.min() < 0 or toks.max() >= vocab):
        raise ValueError(f"`prefix_tokens[{r}]` has ids outside [0, vocab_size={vocab}).")
      if not np.isfinite(lps).all() or (lps > 0).any():
        raise ValueError(f"`prefix_logprobs[{r}]` must be finite log-probs <= 0.")
      req = Request(
        r, int(ids["prompt_index"][r]), int(ids["sample_index"][r]), prompts[r],
        tokens=toks.astype(np.int32).tolist(), logprobs=lps.astype(np.float32).tolist(),
      )  # fmt: skip
      req.started = bool(toks.size)  # a prefix's KV is recomputed by prefill (no sharing)
      requests.append(req)
    for name, f in (("stop_when", stop_when), ("params_update", params_update)):
      if f is not None and not callable(f):
        raise ValueError(f"`{name}` must be callable or None, got {type(f).__name__}.")
    version = _check_version(policy_version, "policy_version")
    t0 = time.perf_counter()
    return self._schedule(
      params, requests, rng, k_scale, v_scale, t0,
      stop_when=stop_when, version=version, params_update=params_update,
    )  # fmt: skip

  def _schedule(
    self, params, requests, rng, k_scale, v_scale, t0, *, stop_when, version=0, params_update=None
  ):
    """The host loop of `generate` / `generate_requests` over `requests` (`Scheduler`)."""
    cfg, eng = self.config, self._engine
    S, P = cfg.max_slots, cfg.num_pages
    prefix_tokens = sum(len(r.tokens) for r in requests)
    pages = PageManager(S, eng.pages_per_sequence, P, cfg.page_size)
    sched = Scheduler(cfg, requests, pages, version)
    # The pool buffer is reused across calls (donated through every step): stale
    # page contents are never read, a slot only attends to positions it wrote.
    pool, self._pool = self._pool, None
    if pool is None:
      with _memory.explain_out_of_memory("the sampler's K/V pool", self.memory_advice):
        pool = eng.empty_pool(P)
    page_sh, slot_sh = eng.state_shardings()

    def put(tree, shardings):
      if shardings is None:
        return jax.device_put(tree)
      return jax.device_put(tree, shardings)

    while True:
      if cfg.continuous_batching or not sched.running:
        rows, copies = sched.admit()
        pool = self._prefill(params, pool, rows, k_scale, v_scale, sched.stats)
        if copies:
          pool = eng.copy_pages(pool, *copy_plan(copies, S, P))
      sched.note_pages_in_use()
      if not sched.running:
        break
      exit_after = sched.exit_after(early_stop=stop_when is not None)
      dev_pages, dev_slots = put(pages.state(), page_sh), put(sched.slots, slot_sh)
      with _memory.explain_out_of_memory("the sampler's decode", self.memory_advice):
        pool, dev_pages, dev_slots, info = eng.decode(
          params, pool, dev_pages, dev_slots, rng, k_scale, v_scale,
          self._knobs(cfg.steps_per_sync, exit_after), allocate=True,
        )  # fmt: skip
      sched.end_window(*jax.device_get((dev_pages, dev_slots, info)))
      if stop_when is not None and stop_when(sched.done()):
        sched.abort()
        break
      waiting = sched.running or sched.queue  # no update after the last window
      if params_update is not None and waiting and (update := params_update()) is not None:
        params, new_version = self._updated_params(update, sched.version)
        sched.switch_version(new_version)
    sched.finish()
    self._pool = pool
    return _completions(sched, cfg, prefix_tokens, time.perf_counter() - t0)

  def _prefill(self, params, pool, rows, k_scale, v_scale, stats):
    """Runs the chunked prefill calls of `rows` (`prefill_calls`); returns the pool."""
    eng = self._engine
    for call in prefill_calls(
      rows,
      prefill_chunk=self.config.prefill_chunk,
      max_slots=self.config.max_slots,
      pages_per_sequence=eng.pages_per_sequence,
    ):
      if eng.single_chunk and call.start.any():
        raise RuntimeError("internal: a prefill call past the first chunk of a single-chunk config")
      with _memory.explain_out_of_memory("the sampler's prefill", self.memory_advice):
        pool = eng.prefill(params, pool, *call, k_scale, v_scale)
      stats["prefill_calls"] += 1
      stats["prefill_tokens"] += int(call.num_new.sum())
    return pool

  # --------------------------------------------------------------------------------------
  # Pure jittable path.

  def generate_fn(
    self,
    params: policy.Params,
    prompt_tokens: jax.Array,
    prompt_lengths: jax.Array,
    rng: jax.Array,
    *,
    num_samples: int = 1,
    kv_scales: tuple[Any, Any] | None = None,
  ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Pure, traceable generation of a batch that fits in the slots at once (no host).

    Row r answers prompt `r // num_samples` as its sample `r % num_samples`
    (prompt-major, like `generate`), with the same per-sample keys, so
    `generate_fn(params, jnp.repeat(P, G, 0), jnp.repeat(L, G), rng,
    num_samples=G)` returns the tokens of `generate(params, prompts, num_samples=G,
    rng=rng)` (equal up to float rounding: a different batch shape may round a
    logit differently, which changes a token only at an exact near-tie). Each
    row gets its own `pages_per_sequence` pages (no sharing, no preemption),
    prefill runs in `prefill_chunk` chunks (the last one narrowed to its width
    bucket), decode is one `lax.while_loop` of up to `max_new_tokens` steps.
    Usable inside another `jax.jit`.

    Args:
      params: the policy params.
      prompt_tokens: i32[N, T] left-aligned prompts, T <= max_prompt_len.
      prompt_lengths: i32[N], each in [1, T] (traced values are clipped into it).
      rng: a `jax.random` key.
      num_samples: static G; N must be a multiple of it.
      kv_scales: as in `generate`.

    Returns:
      (tokens i32[N, max_new_tokens] right-padded with 0, logprobs
      f32[N, max_new_tokens] (0 on padding), lengths i32[N], stopped bool[N]
      (True: ended with a stop token, False: hit max_new_tokens)).

    Raises:
      ValueError (statically): N > max_slots, N * pages_per_sequence > num_pages,
      T > max_prompt_len, bad shapes/dtypes.
    """
    cfg, eng = self.config, self._engine
    num_samples = self._check_num_samples(num_samples)
    if np.ndim(prompt_tokens) != 2 or not jnp.issubdtype(
      jnp.result_type(prompt_tokens), jnp.integer
    ):
      raise ValueError(
        f"`prompt_tokens` must be an integer [N, T] array, got "
        f"{jnp.result_type(prompt_tokens)}{np.shape(prompt_tokens)}."
      )
    n, t = np.shape(prompt_tokens)
    if np.shape(prompt_lengths) != (n,) or not jnp.issubdtype(
      jnp.result_type(prompt_lengths), jnp.integer
    ):
      raise ValueError(
        f"`prompt_lengths` must be an integer [{n}] array, got "
        f"{jnp.result_type(prompt_lengths)}{np.shape(prompt_lengths)}."
      )
    if n < 1 or t < 1:
      raise ValueError(f"`prompt_tokens` must be non-empty, got shape {(n, t)}.")
    if t > cfg.max_prompt_len:
      raise ValueError(f"`prompt_tokens` has T={t} > max_prompt_len={cfg.max_prompt_len}.")
    if n > cfg.max_slots:
      raise ValueError(f"generate_fn needs N={n} <= max_slots={cfg.max_slots}.")
    pps = eng.pages_per_sequence
    if n * pps > cfg.num_pages:
      raise ValueError(
        f"generate_fn needs N * pages_per_sequence = {n} * {pps} = {n * pps} pages <= "
        f"num_pages={cfg.num_pages}."
      )
    if n % num_samples:
      raise ValueError(f"N={n} rows must be a multiple of num_samples={num_samples}.")
    if not isinstance(rng, jax.core.Tracer):
      self._check_rng(rng)
    params = self._check_params(params)
    if not isinstance(prompt_tokens, jax.core.Tracer):
      policy.check_tokens(prompt_tokens, self.model_config.vocab_size, "prompt_tokens")
    k_scale, v_scale = (jnp.asarray(s) for s in self._kv_scales(kv_scales))
    prompt_tokens = jnp.asarray(prompt_tokens, jnp.int32)
    lengths = jnp.clip(jnp.asarray(prompt_lengths, jnp.int32), 1, t)
    m = lengths - 1  # tokens prefilled; the last prompt token is fed to decode
    pool = eng.empty_pool(n * pps)
    table = jnp.arange(n * pps, dtype=jnp.int32).reshape(n, pps)
    chunk = cfg.prefill_chunk
    for c in range(math.ceil((t - 1) / chunk)):
      width = prefill_width(t - 1 - c * chunk, chunk)
      piece = prompt_tokens[:, c * chunk : c * chunk + width]
      piece = jnp.pad(piece, ((0, 0), (0, width - piece.shape[1])))
      start = jnp.full((n,), c * chunk, jnp.int32)
      num_new = jnp.clip(m - c * chunk, 0, width)
      pool = eng._prefill(params, pool, piece, start, num_new, table, k_scale, v_scale)
    rows = jnp.arange(n, dtype=jnp.int32)
    M = cfg.max_new_tokens
    slots = SlotState(
      active=jnp.ones((n,), bool),
      length=m,
      last_token=jnp.take_along_axis(prompt_tokens, m[:, None], axis=1)[:, 0],
      num_generated=jnp.zeros((n,), jnp.int32),
      prompt_index=rows // num_samples,
      sample_index=rows % num_samples,
      stopped=jnp.zeros((n,), bool),
      tokens=jnp.zeros((n, M), jnp.int32),
      logprobs=jnp.zeros((n, M), jnp.float32),
    )
    pages = PageState(
      page_table=table,
      refcount=jnp.ones((n * pps,), jnp.int32),
      free_stack=jnp.zeros((n * pps,), jnp.int32),
      num_free=jnp.int32(0),
    )
    _, _, slots, _ = eng._decode_loop(
      params, pool, pages, slots, rng, k_scale, v_scale, self._knobs(M, n + 1), allocate=False,
    )  # fmt: skip
    return slots.tokens, slots.logprobs, slots.num_generated, slots.stopped


def clear_compile_cache() -> None:
  """Drops the jitted device functions that samplers share, with their compiled programs.

  Samplers built afterwards get fresh functions, so their first call traces
  and compiles every program again (with `jax.clear_caches()`: a cold start,
  as in a compile-time benchmark). Samplers already built keep theirs.
  """
  engine_for.cache_clear()


def _completions(sched: Scheduler, config: SamplerConfig, prefix_tokens: int, wall: float):
  """`Completions` of a finished `Scheduler` (rows in request order)."""
  requests, stats = sched.requests, sched.stats
  n, S, P = len(requests), config.max_slots, config.num_pages
  tokens = np.zeros((n, config.max_new_tokens), np.int32)
  logprobs = np.zeros((n, config.max_new_tokens), np.float32)
  versions = np.full((n, config.max_new_tokens), -1, np.int32)
  lengths = np.zeros((n,), np.int32)
  for r in requests:
    g = len(r.tokens)
    tokens[r.row, :g] = r.tokens
    logprobs[r.row, :g] = r.logprobs
    versions[r.row] = r.token_versions(config.max_new_tokens)
    lengths[r.row] = g
  generated = int(lengths.sum()) - prefix_tokens
  steps = int(stats["decode_steps"])
  out_stats = {
    "tokens_per_s": generated / wall if wall > 0 else float("inf"),
    "generated_tokens": generated,
    "decode_steps": steps,
    "slot_utilisation": generated / (steps * S) if steps else 0.0,
    "stopped_early": bool(stats["stopped_early"]),
    "preemptions": int(stats["preemptions"]),
    "peak_pages_used": int(sched.peak_pages),
    "num_pages": P,
    "pages_in_use_at_end": int(sched.pages.in_use),
    "prefill_tokens": int(stats["prefill_tokens"]),
    "prefill_calls": int(stats["prefill_calls"]),
    "syncs": int(stats["syncs"]),
    "params_updates": int(stats["params_updates"]),
    "wall_s": wall,
  }
  return Completions(
    tokens=tokens,
    logprobs=logprobs,
    lengths=lengths,
    finish_reason=tuple(r.finish_reason or "unfinished" for r in requests),
    prompt_index=np.asarray([r.prompt_index for r in requests], np.int32),
    stats=out_stats,
    versions=versions,
  )


def _check_version(version: Any, name: str) -> int:
  """`version` as an int >= 0, or ValueError naming `name`."""
  if isinstance(version, bool) or not isinstance(version, int | np.integer) or version < 0:
    raise ValueError(f"`{name}` must be an int >= 0, got {version!r}.")
  return int(version)
