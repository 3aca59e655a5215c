"""Device side of the sampler: the paged KV cache state, chunked prefill, the decode loop.

State (all device arrays, static shapes; S slots, P pages, L layers):

  KVPool     k, v                    [L, Hkv, P, page, D]  stacked page pools
             k_scale, v_scale        f32[L, Hkv, P, page]  per-token scales
                                     (kv_scale_mode "per_token"; else None)
  PageState  page_table              i32[S, pages_per_sequence]
             refcount                i32[P]   slots (and prompt holders) using a page
             free_stack, num_free    i32[P], i32[]   free pages are free_stack[:num_free]
  SlotState  active, length, last_token, num_generated, prompt_index,
             sample_index, stopped   [S]
             tokens, logprobs        [S, max_new_tokens]

A slot's KV holds its first `length` tokens; `last_token` (position `length`)
is fed to the next decode step, which writes its K/V, attends over
`length + 1` tokens and samples token `num_generated`. So a prompt of n
tokens is prefilled with its first n - 1 tokens and every sampled token comes
out of the decode step (one sampling path). Prefill runs the same layer scan
over a chunk of tokens per row: its attention hook writes the chunk's K/V with
`write_kv_pages` and attends with `rlx.kernels_pallas.paged_prefill_attention`
(causally over the chunk, and over the row's cached pages).

The decode loop is one `lax.while_loop` of up to `steps_per_sync` steps. Each
step (1) pops a page from the free stack for every slot whose next position
starts a new page (a slot that finds none is "blocked": it does not advance
and the loop ends so the host can preempt), (2) runs `rlx.policy.layer_scan`
with the stacked pool in the scan carry: the attention hook writes the
step's K/V into layer i with `write_kv_pages(..., layer=i)` (an in-place
scatter) and reads the slots' pages with `paged_attention` (a gather of the
used pages fused with the layer index; no copy of the pool), (3) samples in
float32 on `[S, V]`. A finished slot keeps its pages until the window
ends: the host releases them (`rlx.sampling._pages.PageManager.release`), so
the device never pushes pages back on the free stack (a reference-count
scatter-add, a prefix count over the pool and a scatter per step: about a
fifth of the decode loop's compile time on CPU), and a page of a slot finished in a window is
reused from the next window on.
"""

import collections
import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from rlx import kernels_pallas, policy
from rlx._jit import counted_jit
from rlx._mesh_axes import BATCH_AXES, TENSOR_AXIS
from rlx.sampling._config import SamplerConfig
from rlx.sampling._sample import sample_from_uniforms, sample_uniforms


class KVPool(NamedTuple):
  """Stacked K and V page pools, `[L, Hkv, P, page_size, D]` each, and their per-token scales.

  `k_scale` / `v_scale`: float32 `[L, Hkv, P, page_size]` with per-token FP8
  scales (`write_kv_pages_per_token`), None with static scales.
  """

  k: jax.Array
  v: jax.Array
  k_scale: jax.Array | None = None
  v_scale: jax.Array | None = None


class PageState(NamedTuple):
  """Page tables, reference counts and the free stack (see module docstring)."""

  page_table: jax.Array  # i32[S, pages_per_sequence]
  refcount: jax.Array  # i32[P]
  free_stack: jax.Array  # i32[P]
  num_free: jax.Array  # i32[]


class SlotState(NamedTuple):
  """Per-slot decode state (see module docstring)."""

  active: jax.Array  # bool[S]
  length: jax.Array  # i32[S]
  last_token: jax.Array  # i32[S]
  num_generated: jax.Array  # i32[S]
  prompt_index: jax.Array  # i32[S]
  sample_index: jax.Array  # i32[S]
  stopped: jax.Array  # bool[S]
  tokens: jax.Array  # i32[S, M]
  logprobs: jax.Array  # f32[S, M]


class Knobs(NamedTuple):
  """Traced scalars of a decode window (changing them never recompiles)."""

  temperature: jax.Array  # f32[] (unused when greedy)
  top_p: jax.Array  # f32[] (unused when top_p == 1)
  stop_token_ids: jax.Array  # i32[stop_id_slots(n)], padded with -1
  max_steps: jax.Array  # i32[]: decode steps at most in this window
  exit_after: jax.Array  # i32[]: end the window once this many slots finished


class LoopInfo(NamedTuple):
  """What one decode window did."""

  steps: jax.Array  # i32[]: decode steps run
  blocked: jax.Array  # bool[S]: slots that found no free page
  peak_pages: jax.Array  # i32[]: most pages in use at once (after a step's allocation)


def empty_slots(num_slots: int, max_new_tokens: int) -> SlotState:
  """Host (numpy) slot state with every slot idle."""
  zeros = np.zeros((num_slots,), np.int32)
  return SlotState(
    active=np.zeros((num_slots,), bool),
    length=zeros.copy(),
    last_token=zeros.copy(),
    num_generated=zeros.copy(),
    prompt_index=zeros.copy(),
    sample_index=zeros.copy(),
    stopped=np.zeros((num_slots,), bool),
    tokens=np.zeros((num_slots, max_new_tokens), np.int32),
    logprobs=np.zeros((num_slots, max_new_tokens), np.float32),
  )


# Deepest model whose decode step is unrolled over its layers (see `Engine`).
_UNROLL_MAX_LAYERS = 16


def _prefix_sums(x):
  """Inclusive prefix sums of an int array along its last axis, in two levels of masked sums.

  The last axis is cut into blocks of ~sqrt(n); each block's prefix sums and the
  blocks' exclusive offsets are masked sums (`sum_j [j <= i] x_j`), which XLA fuses
  into a few elementwise-reduce kernels, where `jnp.cumsum` (a reduce-window)
  becomes about ten kernels on XLA:CPU once n > 16. O(n^1.5) work; integer sums are
  exact in any order.
  """
  *lead, n = x.shape
  b = 1 << max(0, math.ceil(math.log2(math.sqrt(n))))
  nb = -(-n // b)
  xb = jnp.pad(x, [(0, 0)] * len(lead) + [(0, nb * b - n)]).reshape(*lead, nb, b)
  i = jnp.arange(b)
  zero = jnp.zeros((), x.dtype)
  within = jnp.sum(jnp.where(i[None, :] <= i[:, None], xb[..., None, :], zero), axis=-1)
  k = jnp.arange(nb)
  total = within[..., -1]  # [..., nb]
  before = jnp.sum(jnp.where(k[None, :] < k[:, None], total[..., None, :], zero), axis=-1)
  return (within + before[..., None]).reshape(*lead, nb * b)[..., :n]


def stop_id_slots(num_stop_ids: int) -> int:
  """Stop ids are padded with -1 to a multiple of 8, at least 8 (0..8 stop ids share a compile)."""
  return max(1, -(-num_stop_ids // 8)) * 8


def compile_key(config: SamplerConfig) -> SamplerConfig:
  """`config` with every field that only reaches the device as a traced value normalised.

  Samplers whose configs share a compile key share one `Engine` (and its compiled
  functions): temperature (only greedy or not matters), top_p (only on/off),
  stop-token values (only their count, padded by `stop_id_slots`), steps_per_sync
  and continuous_batching.
  """
  return dataclasses.replace(
    config,
    temperature=0.0 if config.temperature == 0.0 else 1.0,
    top_p=1.0 if config.top_p >= 1.0 else 0.5,
    stop_token_ids=(0,) * stop_id_slots(len(config.stop_token_ids)),
    steps_per_sync=1,
    continuous_batching=True,
  )


@functools.lru_cache(maxsize=32)
def engine_for(model_config: policy.ModelConfig, key: SamplerConfig, mesh: Mesh | None):
  """The shared `Engine` of a compile key (`compile_key(config)`)."""
  return Engine(model_config, key, mesh)


class Engine:
  """The jitted device functions of samplers sharing a compile key (own jit caches).

  Args:
    model_config: the policy's `ModelConfig`.
    config: the `SamplerConfig`.
    mesh: optional `rlx.train` mesh: slots over ("data", "fsdp"), KV heads over "tensor".
  """

  def __init__(self, model_config: policy.ModelConfig, config: SamplerConfig, mesh: Mesh | None):
    self.model = model_config
    self.config = config
    self.mesh = mesh
    self.page_dtype = config.page_dtype(model_config.compute_dtype)
    self.per_token = config.kv_scale_mode == "per_token"
    self.pages_per_sequence = config.pages_per_sequence
    self.greedy = config.temperature == 0.0
    self.use_top_p = config.top_p < 1.0
    # When no row can need a second prefill chunk (the longest prefill, a preempted or
    # resumed row's prompt + generated tokens less the one fed to decode, fits in one),
    # every prefill call starts at position 0: prefill then traces `start` as that
    # constant, and XLA drops the attention to earlier pages (a `lax.cond` branch of
    # `paged_prefill_attention`) before compiling: a third less prefill compile time.
    self.single_chunk = config.max_prompt_len + config.max_new_tokens - 2 <= config.prefill_chunk
    # Decode runs its layers unrolled (static weight slices, hoisted out of the decode
    # loop) up to this depth; deeper models keep the one-block scan (compile time).
    self._unroll = model_config.num_layers <= _UNROLL_MAX_LAYERS
    self._batch_axes = None
    self._tensor_axis = None
    if mesh is not None:
      self._batch_axes = tuple(a for a in BATCH_AXES if a in mesh.shape) or None
      if TENSOR_AXIS in mesh.shape and model_config.num_kv_heads % mesh.shape[TENSOR_AXIS] == 0:
        self._tensor_axis = TENSOR_AXIS
    # Programs traced (= compiled) per function: `Sampler.compile_counts`.
    self.traces = collections.Counter()
    self.decode = counted_jit(
      self._decode_loop, self.traces, "decode", static_argnames=("allocate",), donate_argnums=(1,)
    )
    self.prefill = counted_jit(self._prefill, self.traces, "prefill", donate_argnums=(1,))
    self.copy_pages = counted_jit(self._copy_pages, self.traces, "copy_pages", donate_argnums=(0,))

  # --------------------------------------------------------------------------------------
  # Shardings.

  def _spec(self, kind: str) -> PartitionSpec:
    b, t = self._batch_axes, self._tensor_axis
    return {
      "pool": PartitionSpec(None, t),
      "slots": PartitionSpec(b),
      "slots2": PartitionSpec(b, None),
      "q": PartitionSpec(b, t, None),
      "replicated": PartitionSpec(),
    }[kind]

  def sharding(self, kind: str):
    """NamedSharding of a state array kind, or None without a mesh."""
    if self.mesh is None:
      return None
    return NamedSharding(self.mesh, self._spec(kind))

  def _constrain(self, x, kind: str):
    if self.mesh is None:
      return x
    return jax.lax.with_sharding_constraint(x, self.sharding(kind))

  def pool_sharding(self):
    return self.sharding("pool")

  def state_shardings(self):
    """(PageState, SlotState) shardings (None without a mesh)."""
    if self.mesh is None:
      return None, None
    r, s1, s2 = self.sharding("replicated"), self.sharding("slots"), self.sharding("slots2")
    pages = PageState(page_table=s2, refcount=r, free_stack=r, num_free=r)
    slots = SlotState(*([s1] * 7), tokens=s2, logprobs=s2)
    return pages, slots

  def empty_pool(self, num_pages: int) -> KVPool:
    m = self.model
    shape = (m.num_layers, m.num_kv_heads, num_pages, self.config.page_size, m.head_dim)
    zeros = jnp.zeros(shape, self.page_dtype, device=self.pool_sharding())
    pool = KVPool(zeros, jnp.zeros(shape, self.page_dtype, device=self.pool_sharding()))
    if self.per_token:
      ones = jnp.ones(shape[:-1], jnp.float32, device=self.pool_sharding())
      pool = pool._replace(k_scale=ones, v_scale=jnp.ones_like(ones))
    return pool

  def _write(self, pool, k, v, start, page_table, num_new, k_scale, v_scale, layer):
    """Writes K/V of layer `layer` into the pool (and their scales with per-token scales).

    Returns `(pool, k_scale, v_scale)`: the scales the layer's pages are read with
    (the static `[Hkv]` ones passed in, or the pool's per-token scale pools).
    """
    if self.per_token:
      kp, vp, ks, vs = kernels_pallas.write_kv_pages_per_token(
        pool.k, pool.v, pool.k_scale, pool.v_scale, k, v, start, page_table, num_new=num_new,
        layer=layer,
      )  # fmt: skip
      pool = KVPool(*(self._constrain(x, "pool") for x in (kp, vp, ks, vs)))
      return pool, pool.k_scale, pool.v_scale
    kp, vp = kernels_pallas.write_kv_pages(
      pool.k, pool.v, k, v, start, page_table, num_new=num_new, k_scale=k_scale,
      v_scale=v_scale, layer=layer,
    )  # fmt: skip
    return KVPool(self._constrain(kp, "pool"), self._constrain(vp, "pool")), k_scale, v_scale

  # --------------------------------------------------------------------------------------
  # Attention pieces.

  def _paged_attention(self, q, k_pages, v_pages, lengths, page_table, k_scale, v_scale, layer):
    """`paged_attention` of layer `layer` of the stacked pools on the slots.

    The stacked `[L, Hkv, P, page, D]` pools go in whole with the layer index (the
    XLA path gathers the layer's pages from them directly: no per-step copy of a
    layer's pool). Under a mesh: per shard, local slots and KV heads.
    """
    impl = self.config.attention_impl

    layer = jnp.asarray(layer, jnp.int32)

    def attend(q, k_pages, v_pages, lengths, page_table, k_scale, v_scale, layer):
      return kernels_pallas.paged_attention(
        q, k_pages, v_pages, lengths, page_table, k_scale=k_scale, v_scale=v_scale, impl=impl,
        layer=layer,
      )  # fmt: skip

    if self.mesh is None:
      return attend(q, k_pages, v_pages, lengths, page_table, k_scale, v_scale, layer)
    b, t = self._batch_axes, self._tensor_axis
    pool = PartitionSpec(None, t)
    scale = pool if self.per_token else PartitionSpec(t)
    return jax.shard_map(
      attend,
      mesh=self.mesh,
      in_specs=(
        PartitionSpec(b, t),
        pool,
        pool,
        PartitionSpec(b),
        PartitionSpec(b),
        scale,
        scale,
        PartitionSpec(),
      ),  # fmt: skip
      out_specs=PartitionSpec(b, t),
      check_vma=False,
    )(q, k_pages, v_pages, lengths, page_table, k_scale, v_scale, layer)

  # --------------------------------------------------------------------------------------
  # Prefill.

  def _prefill(self, params, pool, tokens, start, num_new, page_table, k_scale, v_scale):
    """Writes the K/V of a chunk of tokens per row into the pool (no logits).

    tokens i32[B, C]: row b holds tokens at positions start[b] + [0, num_new[b]);
    page_table i32[B, pps]: the row's pages (allocated for those positions).
    Rows with num_new = 0 are padding (nothing written). With `single_chunk`
    every start is 0 (the values passed are ignored).
    """
    model = self.model
    c = tokens.shape[1]
    if self.single_chunk:
      start = jnp.zeros_like(start)  # a constant: see `single_chunk`
    positions = start[:, None] + jnp.arange(c, dtype=jnp.int32)[None, :]

    def hook(i, q, k, v, pool, *, positions, segment_ids):
      del segment_ids
      pool, ks, vs = self._write(pool, k, v, start, page_table, num_new, k_scale[i], v_scale[i], i)
      # Reads only positions < start of the written pool (so the write stays in place).
      out = kernels_pallas.paged_prefill_attention(
        q, k, v, pool.k, pool.v, start, num_new, page_table, k_scale=ks, v_scale=vs, layer=i
      )
      return out, pool

    x = policy.embed(params, model, tokens)
    _, pool = policy.layer_scan(params, model, x, positions, attention_fn=hook, cache=pool)
    return pool

  def _copy_pages(self, pool, src, dst):
    """pool[:, :, dst[i]] = pool[:, :, src[i]] for every layer (dst = P: no-op row), scales too."""
    src = jnp.clip(src, 0, pool.k.shape[2] - 1)

    def copy(x):
      return (
        None
        if x is None
        else self._constrain(x.at[:, :, dst].set(x[:, :, src], mode="drop"), "pool")
      )

    return KVPool(*(copy(x) for x in pool))

  # --------------------------------------------------------------------------------------
  # Decode.

  def _allocate(self, pages: PageState, slots: SlotState):
    """Pops one page per slot whose next position starts a page; returns (pages, blocked)."""
    page_size = self.config.page_size
    num_pages = pages.refcount.shape[0]
    num_slots, pps = pages.page_table.shape
    need = slots.active & (slots.length % page_size == 0)
    rank = _prefix_sums(need.astype(jnp.int32)) - 1
    ok = need & (rank < pages.num_free)
    new_page = pages.free_stack[jnp.clip(pages.num_free - 1 - rank, 0, num_pages - 1)]
    column = jnp.where(ok, slots.length // page_size, pps)  # pps: dropped
    table = pages.page_table.at[jnp.arange(num_slots), column].set(new_page, mode="drop")
    refcount = pages.refcount.at[jnp.where(ok, new_page, num_pages)].set(1, mode="drop")
    num_free = pages.num_free - jnp.sum(ok.astype(jnp.int32))
    return PageState(table, refcount, pages.free_stack, num_free), need & ~ok

  def _step(self, params, pool, pages, slots, rng, k_scale, v_scale, knobs, allocate):
    """One decode step for all slots; returns (pool, pages, slots, blocked, done)."""
    cfg, model = self.config, self.model
    if allocate:
      pages, blocked = self._allocate(pages, slots)
    else:
      blocked = jnp.zeros_like(slots.active)
    in_use = pages.refcount.shape[0] - pages.num_free  # after allocation
    run = slots.active & ~blocked
    length = slots.length
    table = pages.page_table
    attend_len = jnp.where(run, length + 1, 0).astype(jnp.int32)

    def hook(i, q, k, v, pool, *, positions, segment_ids):
      del positions, segment_ids
      pool, ks, vs = self._write(
        pool, k[:, 0], v[:, 0], length, table, run.astype(jnp.int32), k_scale[i], v_scale[i], i
      )
      q = self._constrain(q[:, 0], "q")
      out = self._paged_attention(q, pool.k, pool.v, attend_len, table, ks, vs, i)
      return out[:, None], pool

    x = policy.embed(params, model, slots.last_token[:, None])
    x, pool = policy.layer_scan(
      params, model, x, length[:, None], attention_fn=hook, cache=pool, unroll=self._unroll
    )
    hidden = policy.final_norm(params, model, x[:, 0])
    logits = policy.logits_from_hidden(params, model, hidden)  # f32[S, V]
    u = None
    if not self.greedy:
      u = sample_uniforms(rng, slots.prompt_index, slots.sample_index, slots.num_generated)
    token, logp = sample_from_uniforms(
      logits,
      u,
      temperature=0.0 if self.greedy else knobs.temperature,
      top_k=cfg.top_k,
      top_p=knobs.top_p if self.use_top_p else 1.0,
    )
    m = slots.tokens.shape[1]
    rows = jnp.arange(token.shape[0])
    column = jnp.where(run, slots.num_generated, m)  # m: dropped
    tokens = slots.tokens.at[rows, column].set(token, mode="drop")
    logprobs = slots.logprobs.at[rows, column].set(logp, mode="drop")
    step = run.astype(jnp.int32)
    num_generated = slots.num_generated + step
    length = length + step
    stop = run & jnp.any(token[:, None] == knobs.stop_token_ids[None, :], axis=1)
    done = run & (stop | (num_generated >= m))
    slots = SlotState(
      active=slots.active & ~done,
      length=length,
      last_token=jnp.where(run, token, slots.last_token),
      num_generated=num_generated,
      prompt_index=slots.prompt_index,
      sample_index=slots.sample_index,
      stopped=slots.stopped | stop,
      tokens=tokens,
      logprobs=logprobs,
    )
    return pool, pages, slots, blocked, done, in_use

  def _decode_loop(self, params, pool, pages, slots, rng, k_scale, v_scale, knobs, *, allocate):
    """Up to `knobs.max_steps` decode steps in one `lax.while_loop`.

    Stops early when no slot is active, when a slot is blocked (no free page),
    or when `knobs.exit_after` slots have finished in this window. Every knob
    is traced, so the loop compiles once per sampler.
    """
    max_steps, exit_after = knobs.max_steps, knobs.exit_after
    num_slots = slots.active.shape[0]
    num_pages = pages.refcount.shape[0]
    if self._unroll:
      # Slice the stacked layer weights once per window, outside the loop: the step's
      # unrolled layers then read them in place instead of copying them every step.
      stacked = params["layers"]
      layers = [jax.tree.map(lambda a, i=i: a[i], stacked) for i in range(self.model.num_layers)]
      params = {**params, "layers": layers}

    def cond(carry):
      _, _, slots, step, blocked, finished, _ = carry
      return (
        (step < max_steps) & jnp.any(slots.active) & ~jnp.any(blocked) & (finished < exit_after)
      )

    def body(carry):
      pool, pages, slots, step, _, finished, peak = carry
      pool, pages, slots, blocked, done, in_use = self._step(
        params, pool, pages, slots, rng, k_scale, v_scale, knobs, allocate
      )
      finished = finished + jnp.sum(done.astype(jnp.int32))
      peak = jnp.maximum(peak, in_use)
      return pool, pages, slots, step + 1, blocked, finished, peak

    carry = (pool, pages, slots, jnp.int32(0), jnp.zeros((num_slots,), bool), jnp.int32(0),
             num_pages - pages.num_free)  # fmt: skip
    pool, pages, slots, steps, blocked, _, peak = jax.lax.while_loop(cond, body, carry)
    return pool, pages, slots, LoopInfo(steps, blocked, peak)
