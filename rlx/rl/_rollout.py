"""The rollout side of the loop: `collect(params, prompts, rng) -> RolloutBatch`.

`SyncRollout` implements it over `rlx.sampling.Sampler.generate` (every
iteration samples fresh from the current params). `PartialRollout` runs
APRIL-style over-provisioning with recycled unfinished groups (Zhou et al.
2025, https://arxiv.org/abs/2509.18521) over `rlx.sampling.RolloutEngine`:
it decides how many prompts it consumes, so it PULLS them from a source
(`collect_groups(params, source, rng, policy_version=v) -> (batch, keys)`)
and its buffer is checkpointed with the data cursor.

FP8 rollout (`config.rollout.weight_dtype` / `kv_dtype`): both engines take
an `Fp8Refresh`, which holds the rollout params (FP8 decoder linears,
`rlx.sampling.quantize_params`) and the FP8 KV scales
(`rlx.sampling.calibrate_kv_scales` over the trainer's forward) and is
refreshed after every policy update (`refresh(params, batch)`).
"""

import collections
import math
import time
from collections.abc import Sequence
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from rlx._jit import counted_jit
from rlx._mesh_axes import BATCH_AXES
from rlx.rl import _batch, _config


class Rollout(Protocol):
  """A rollout engine: G samples for each prompt, packed as a `RolloutBatch`."""

  def collect(
    self, params: Any, prompts: Sequence[Sequence[int]], rng: jax.Array, *, policy_version: int = 0
  ) -> _batch.RolloutBatch:
    """Samples `num_samples` responses per prompt with `params`.

    Args:
      params: the policy params (a device pytree on the sampler's mesh).
      prompts: N token-id lists.
      rng: PRNG key of this collection.
      policy_version: version number of `params`, recorded per token.

    Returns:
      A `RolloutBatch` of N * num_samples prompt-major rows (rewards NaN).
    """


def sampler_kwargs(
  config: ml_collections.ConfigDict, task: Any, *, rows: int, greedy: bool
) -> dict[str, Any]:
  """The `rlx.sampling.SamplerConfig` fields of a run (rollout or greedy eval).

  Zero pool sizes in `config.sampler` mean "enough for `rows` sequences at full
  length at once": max_slots = rows, num_pages = rows * pages per sequence.

  Args:
    config: the RL config.
    task: the `rlx.tasks.Task` (prompt/answer lengths, stop tokens).
    rows: the largest number of sequences one `generate` call holds.
    greedy: temperature 0 (evaluation) instead of `config.rl.temperature`;
      the evaluation keeps high precision: weight_dtype "auto", and "auto"
      (the compute dtype) instead of an FP8 `config.rollout.kv_dtype`.

  Returns:
    A dict of SamplerConfig keyword arguments.
  """
  s = config.sampler
  kv_dtype = _config.kv_dtype(config)
  weight_dtype = str(config.rollout.weight_dtype)
  if greedy:  # the evaluation runs the high-precision policy
    weight_dtype = "auto"
    kv_dtype = "auto" if kv_dtype in _config.FP8_DTYPES else kv_dtype
  max_new = int(s.max_new_tokens) or int(task.max_answer_len)
  max_prompt = int(task.max_prompt_len)
  slots = int(s.max_slots) or int(rows)
  pages_per_sequence = math.ceil((max_prompt + max_new) / int(s.page_size))
  num_pages = int(s.num_pages) or slots * pages_per_sequence
  return dict(
    max_slots=slots,
    page_size=int(s.page_size),
    num_pages=num_pages,
    max_prompt_len=max_prompt,
    max_new_tokens=max_new,
    kv_dtype=kv_dtype,
    kv_scale_mode="static" if greedy else str(config.rollout.kv_scale_mode),
    weight_dtype=weight_dtype,
    temperature=0.0 if greedy else float(config.rl.temperature),
    top_k=int(s.top_k),
    top_p=float(s.top_p),
    stop_token_ids=tuple(int(t) for t in task.stop_token_ids),
    steps_per_sync=int(s.steps_per_sync),
  )


def make_sampler(model_config: Any, kwargs: dict[str, Any], mesh: Any) -> Any:
  """`rlx.sampling.Sampler(model_config, SamplerConfig(**kwargs), mesh=mesh)`."""
  from rlx import sampling  # noqa: PLC0415 (the sampler is optional at import time)

  return sampling.Sampler(model_config, sampling.SamplerConfig(**kwargs), mesh=mesh)


def pad_prompts(prompts: Sequence[Sequence[int]], width: int) -> tuple[np.ndarray, np.ndarray]:
  """Prompts as `(tokens i32[N, width] right-padded with 0, lengths i32[N])`."""
  if not len(prompts):
    raise ValueError("`prompts` is empty.")
  lengths = np.asarray([len(p) for p in prompts], np.int32)
  if lengths.min() < 1 or lengths.max() > width:
    bad = [i for i, n in enumerate(lengths) if n < 1 or n > width]
    raise ValueError(f"prompts {bad[:5]} have lengths outside [1, {width}] (max_prompt_len).")
  tokens = np.zeros((len(prompts), width), np.int32)
  for i, p in enumerate(prompts):
    tokens[i, : len(p)] = p
  return tokens, lengths


_build = jax.jit(_batch.build_rollout_batch)

FP8_DTYPES = _config.FP8_DTYPES


class Fp8Refresh:
  """The FP8 rollout policy of a sampler, refreshed from the trainer's params after each update.

  FP8 rollout with a high-precision trainer, as in slime and verl
  (https://github.com/THUDM/slime, https://github.com/volcengine/verl: the
  rollout engine re-quantizes at every weight sync; DeepSeek-V3,
  https://arxiv.org/abs/2412.19437 Sec. 3.3, for the 128x128 weight blocks;
  vLLM's FP8 KV cache, https://github.com/vllm-project/vllm, for the scales):
  after every update (1) the decoder linears are re-quantized on device
  (`rlx.sampling.quantize_params`, jitted once; on a mesh straight into
  `rlx.policy.param_shardings(..., fp8_linears=True)`), and (2) with an FP8
  KV cache the per-layer, per-KV-head K/V scales are recalibrated from the
  trainer's own forward over a batch it already has (the rollout batch it
  just trained on; `rlx.sampling.calibrate_kv_scales`, vLLM's headroom).
  Params and scales are traced values of the sampler: nothing recompiles.
  With asynchronous rollout (`rlx.rl.AsyncRollout`) the rollout thread does
  both instead, when it takes a newer version.

  With per-token KV scales (`SamplerConfig.kv_scale_mode` "per_token") there
  is nothing to calibrate: the sampler scales each token as it writes it.

  Attributes:
    weight_fp8: whether the linears are FP8.
    kv_fp8: whether the KV cache is FP8 with static scales (calibrated here).
    params: the last refreshed rollout params (None before the first refresh).
    kv_scales: (k_scale, v_scale) f32[L, Hkv], or None (before the first
      calibration, or without FP8 KV).
    last_refresh_s: seconds of the last `refresh` (device work waited for).
  """

  def __init__(self, sampler: Any):
    from rlx import policy, sampling  # noqa: PLC0415 (the sampler is optional at import time)

    cfg = getattr(sampler, "config", None)
    if not isinstance(cfg, sampling.SamplerConfig):
      raise ValueError(f"`sampler` must have a SamplerConfig `config`, got {type(cfg).__name__}.")
    self.sampler_config = cfg
    self.model_config = sampler.model_config
    self.weight_fp8 = cfg.weight_dtype in FP8_DTYPES
    # Static FP8 KV scales are calibrated here; per-token ones are the sampler's own.
    self.kv_fp8 = cfg.kv_dtype in FP8_DTYPES and cfg.kv_scale_mode == "static"
    if not (self.weight_fp8 or cfg.kv_dtype in FP8_DTYPES):
      raise ValueError(
        f"Fp8Refresh needs a sampler with an FP8 weight_dtype or kv_dtype, got "
        f"weight_dtype={cfg.weight_dtype!r}, kv_dtype={cfg.kv_dtype!r}."
      )
    mesh = getattr(sampler, "mesh", None)
    shardings = None
    if mesh is not None and self.weight_fp8:
      shardings = policy.param_shardings(self.model_config, mesh, fp8_linears=True)
    self._traces = collections.Counter()
    self._quantize = counted_jit(
      lambda p: sampling.quantize_params(p, cfg), self._traces, "quantize", out_shardings=shardings
    )
    # KV scales live replicated on the mesh, however they were computed (one jit cache key).
    self._replicated = None
    if mesh is not None:
      self._replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    self._calibrate = sampling.calibrate_kv_scales
    self.params = None
    self._source = None
    self.kv_scales: tuple[jax.Array, jax.Array] | None = None
    self.last_refresh_s = 0.0

  def compile_counts(self) -> dict[str, int]:
    """Programs compiled so far by this refresh's jitted quantization of the rollout params.

    One per params structure and sharding: refreshing after every update leaves it unchanged.

    Returns:
      {"quantize": n}.
    """
    return {"quantize": self._traces["quantize"]}

  def rollout_params(self, params: Any) -> Any:
    """The params the sampler runs for the trainer's `params` (quantized once per update)."""
    if not self.weight_fp8:
      return params
    if params is not self._source:
      self.params, self._source = self._quantize(params), params
    return self.params

  def calibrate(self, params: Any, tokens: Any, mask: Any) -> None:
    """KV scales from the trainer's forward with `params` over tokens i32[B, S] where `mask`.

    The forward runs on the mesh `params` live on (the learner's, or the
    rollout side's with asynchronous rollout), its rows split over the mesh's
    batch axes where they divide evenly (else replicated); the scales are then
    placed on the sampler's mesh.
    """
    if self.kv_fp8:
      mesh = getattr(getattr(jax.tree.leaves(params)[0], "sharding", None), "mesh", None)
      if isinstance(mesh, jax.sharding.Mesh) and set(BATCH_AXES) <= set(mesh.axis_names):
        split = np.shape(tokens)[0] % math.prod(mesh.shape[a] for a in BATCH_AXES) == 0
        spec = jax.sharding.PartitionSpec(BATCH_AXES if split else None)
        where = jax.sharding.NamedSharding(mesh, spec)
        tokens, mask = (jax.device_put(x, where) for x in (tokens, mask))
      self.kv_scales = self.place(self._calibrate(params, self.model_config, tokens, mask))

  def place(self, kv_scales: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
    """The scales replicated on the sampler's mesh (a sharding constraint under jit)."""
    if self._replicated is None:
      return kv_scales
    if any(isinstance(x, jax.core.Tracer) for x in kv_scales):
      return tuple(jax.lax.with_sharding_constraint(x, self._replicated) for x in kv_scales)
    return tuple(jax.device_put(x, self._replicated) for x in kv_scales)

  def calibrate_prompts(
    self, params: Any, prompts: Sequence[Sequence[int]], *, num_samples: int, width: int
  ) -> None:
    """The first calibration, before any rollout: over the prompts (each repeated K times).

    The rows are laid out like a rollout batch ([N * K, width], prompt
    positions only), so the calibration forward compiles once for both.
    """
    tokens, lengths = pad_prompts(prompts, width)
    mask = np.arange(width)[None, :] < lengths[:, None]
    k = int(num_samples)
    self.calibrate(params, np.repeat(tokens, k, 0), np.repeat(mask, k, 0))

  def time_refresh(
    self, params: Any, prompts: Sequence[Sequence[int]], *, num_samples: int, width: int
  ) -> float:
    """Seconds of one refresh (re-quantize + recalibrate) over a prompt batch, state untouched.

    For the fused step, which refreshes inside its program: the same work run
    standalone once after a warm-up call (so compile time is excluded).
    """
    saved = (self.params, self._source, self.kv_scales)
    tokens, lengths = pad_prompts(prompts, width)
    k = int(num_samples)
    mask = np.repeat(np.arange(width)[None, :] < lengths[:, None], k, 0)
    tokens = np.repeat(tokens, k, 0)
    seconds = []
    for _ in range(2):
      self._source = None
      t0 = time.perf_counter()
      out = [self.rollout_params(params)]
      self.calibrate(params, tokens, mask)
      jax.block_until_ready([out, self.kv_scales])
      seconds.append(time.perf_counter() - t0)
    self.params, self._source, self.kv_scales = saved
    return seconds[-1]

  def refresh(self, params: Any, batch: _batch.RolloutBatch) -> float:
    """After an update: re-quantize `params` and recalibrate on `batch`; returns the seconds."""
    t0 = time.perf_counter()
    out = []
    if self.weight_fp8:
      out.append(self.rollout_params(params))
    if self.kv_fp8:
      self.calibrate(params, batch.tokens, batch.prompt_mask | batch.response_mask)
      out.append(self.kv_scales)
    jax.block_until_ready(out)
    self.last_refresh_s = time.perf_counter() - t0
    return self.last_refresh_s

  def generate_kwargs(self) -> dict[str, Any]:
    """`{"kv_scales": ...}` for the sampler (empty without FP8 KV)."""
    if not self.kv_fp8:
      return {}
    if self.kv_scales is None:
      raise ValueError(
        "FP8 KV needs calibrated scales before the first rollout: call "
        "`calibrate_prompts(params, prompts, ...)` or `refresh(params, batch)` first."
      )
    return {"kv_scales": self.kv_scales}

  def state_dict(self) -> dict[str, np.ndarray]:
    """The KV scales as host arrays (empty without them), for the checkpoint."""
    if self.kv_scales is None:
      return {}
    k, v = (np.asarray(x, np.float32) for x in self.kv_scales)
    return {"k_scale": k, "v_scale": v}

  def load_state_dict(self, state: dict[str, Any]) -> None:
    """Restores `state_dict()`'s scales (the rollout params follow from the train params)."""
    if not state:
      self.kv_scales = None
      return
    m = self.model_config
    shape = (m.num_layers, m.num_kv_heads)
    out = []
    for name in ("k_scale", "v_scale"):
      if name not in state or np.shape(state[name]) != shape:
        raise ValueError(
          f"KV scale state must hold {name} of shape {shape}, got "
          f"{np.shape(state[name]) if name in state else 'nothing'}."
        )
      out.append(jnp.asarray(state[name], jnp.float32))
    self.kv_scales = self.place((out[0], out[1]))


def make_fp8_refresh(sampler: Any) -> "Fp8Refresh | None":
  """An `Fp8Refresh` for `sampler` when its config asks for FP8 weights or KV, else None."""
  cfg = getattr(sampler, "config", None)
  if getattr(cfg, "weight_dtype", None) in FP8_DTYPES or getattr(cfg, "kv_dtype", None) in (
    FP8_DTYPES
  ):
    return Fp8Refresh(sampler)
  return None


# The sampler's counts of a collection, as `SyncRollout.metrics` reports them.
SAMPLER_COUNTS = (
  "decode_steps", "syncs", "prefill_tokens", "prefill_calls", "generated_tokens", "preemptions",
)  # fmt: skip


class _Fp8Rollout:
  """What both rollout engines share: their `Fp8Refresh` (None without FP8) and its refresh."""

  fp8: "Fp8Refresh | None"

  @property
  def refresh(self):
    """`refresh(params, batch) -> seconds` of the FP8 rollout policy, or None (no FP8)."""
    return None if self.fp8 is None else self.fp8.refresh


class SyncRollout(_Fp8Rollout):
  """Synchronous rollouts: `sampler.generate` with the current params, every call.

  Attributes:
    sampler: an `rlx.sampling.Sampler` (or anything with its `generate`).
    num_samples: K, samples per prompt.
    max_prompt_len, max_new_tokens: the sampler's static lengths; the batch
      width is their sum.
    fp8: the `Fp8Refresh` of an FP8 sampler (made from the sampler's config
      when not given), else None. `collect` then samples with its rollout
      params and KV scales (calibrated on the first prompts if none yet);
      `refresh(params, batch)` after each update re-quantizes and recalibrates.
  """

  def __init__(
    self,
    sampler: Any,
    *,
    num_samples: int,
    max_prompt_len: int,
    max_new_tokens: int,
    fp8: Fp8Refresh | None = None,
  ):
    if num_samples < 1:
      raise ValueError(f"`num_samples` must be >= 1, got {num_samples}.")
    self.sampler = sampler
    self.num_samples = int(num_samples)
    self.max_prompt_len = int(max_prompt_len)
    self.max_new_tokens = int(max_new_tokens)
    self.fp8 = fp8 if fp8 is not None else make_fp8_refresh(sampler)
    self.last_stats: dict[str, Any] = {}

  def metrics(self) -> dict[str, float]:
    """The sampler's counts of the last collection (`SAMPLER_COUNTS`), under `rollout/`."""
    st = self.last_stats
    return {f"rollout/{k}": float(st[k]) for k in SAMPLER_COUNTS if k in st}

  def collect(
    self, params: Any, prompts: Sequence[Sequence[int]], rng: jax.Array, *, policy_version: int = 0
  ) -> _batch.RolloutBatch:
    """See `Rollout.collect`."""
    prompt_tokens, prompt_lengths = pad_prompts(prompts, self.max_prompt_len)
    kwargs = {}
    if self.fp8 is not None:
      if self.fp8.kv_fp8 and self.fp8.kv_scales is None:
        self.fp8.calibrate_prompts(
          params, prompts, num_samples=self.num_samples,
          width=self.max_prompt_len + self.max_new_tokens,
        )  # fmt: skip
      kwargs = self.fp8.generate_kwargs()
      params = self.fp8.rollout_params(params)
    out = self.sampler.generate(
      params, [list(p) for p in prompts], num_samples=self.num_samples, rng=rng, **kwargs
    )
    n = len(prompts) * self.num_samples
    tokens = jnp.asarray(out.tokens)
    if tokens.shape != (n, self.max_new_tokens):
      raise ValueError(
        f"The sampler returned tokens of shape {tokens.shape}, expected "
        f"[N * num_samples, max_new_tokens] = {(n, self.max_new_tokens)}."
      )
    group = np.asarray(out.prompt_index, np.int32)
    expected = np.repeat(np.arange(len(prompts), dtype=np.int32), self.num_samples)
    if not np.array_equal(group, expected):
      raise ValueError("The sampler's rows are not prompt-major (row i*G + j = prompt i).")
    stopped = np.asarray([r == "stop" for r in out.finish_reason], bool)
    self.last_stats = dict(out.stats)
    return _build(
      np.repeat(prompt_tokens, self.num_samples, axis=0),
      np.repeat(prompt_lengths, self.num_samples),
      tokens,
      jnp.asarray(out.logprobs, jnp.float32),
      jnp.asarray(out.lengths, jnp.int32),
      stopped,
      group,
      np.int32(policy_version),
    )


def _quantized_updates(params_update: Any, fp8: Fp8Refresh) -> Any:
  """`params_update` whose new params come back as the FP8 rollout params (`fp8.rollout_params`)."""

  def update() -> tuple[Any, int] | None:
    new = params_update()
    return None if new is None else (fp8.rollout_params(new[0]), new[1])

  return update


def _spread(values: jax.Array, prompt_lengths: jax.Array, width: int, fill: int) -> jax.Array:
  """Per-response-token values [B, T] laid out on the batch's [B, width] sequence positions."""
  b, t = values.shape
  pos = jnp.arange(width, dtype=jnp.int32)[None, :]
  index = jnp.clip(pos - prompt_lengths[:, None], 0, t - 1)
  return jnp.take_along_axis(values, jnp.broadcast_to(index, (b, width)), axis=1)


@jax.jit
def _build_partial(
  prompt_tokens, prompt_lengths, tokens, logprobs, versions, lengths, stopped, group
):
  batch = _batch.build_rollout_batch(
    prompt_tokens, prompt_lengths, tokens, logprobs, lengths, stopped, group, 0
  )
  spread = _spread(versions, batch.prompt_lengths, batch.tokens.shape[1], -1)
  return batch.replace(policy_version=jnp.where(batch.response_mask, spread, -1))


class PartialRollout(_Fp8Rollout):
  """APRIL partial rollouts for the loop, over `rlx.sampling.RolloutEngine`.

  Over-provisioning (Zhou et al. 2025, https://arxiv.org/abs/2509.18521):
  `ceil(over_provision * target_groups)` groups share the sampler's slots,
  the collection stops once `target_groups` are complete, and the unfinished
  ones are resumed first at the next collection by the newer policy. The
  batch carries each token's behaviour log-prob and policy version (CoPRIS,
  https://arxiv.org/abs/2511.02755), so the trainer's rollout correction
  weights (old_logp - rollout_logp) see the staleness of recycled tokens.

  Prompt flow: `collect_groups` PULLS prompts from `source(n)` (n `(key,
  prompt ids)` pairs, e.g. the examples' indices in their split): as many as
  it launches, so the source's cursor and `state_dict()` checkpointed
  together resume exactly. It returns the batch and the keys of its groups
  (rows group-major), which the loop maps back to its examples.
  """

  def __init__(
    self,
    sampler: Any,
    *,
    num_samples: int,
    target_groups: int,
    over_provision: float,
    fp8: Fp8Refresh | None = None,
  ):
    from rlx import sampling  # noqa: PLC0415 (the sampler is optional at import time)

    self.engine = sampling.RolloutEngine(
      sampler,
      num_samples=num_samples,
      target_groups=target_groups,
      over_provision=over_provision,
    )
    self.num_samples = int(num_samples)
    self.fp8 = fp8 if fp8 is not None else make_fp8_refresh(sampler)
    self.last_stats: dict[str, Any] = {}

  def collect_groups(
    self,
    params: Any,
    source: Any,
    rng: jax.Array,
    *,
    policy_version: int,
    params_update: Any = None,
  ) -> tuple[_batch.RolloutBatch, np.ndarray]:
    """One collection: `(RolloutBatch of target_groups * G rows, i64[target_groups] keys)`.

    With FP8 KV the scales must be calibrated first (`fp8.calibrate_prompts`
    or `fp8.refresh`): the prompts are pulled inside the collection.
    `params_update` (`f() -> None | (params, version)`) updates the weights in
    flight (`rlx.sampling.RolloutEngine.collect`). With FP8 rollout each
    update's params are quantized as they arrive (`fp8.rollout_params`); the
    static KV scales stay the collection's, since the K/V already cached was
    written with them (`fp8.refresh` recalibrates between collections).
    """
    kwargs = {}
    if self.fp8 is not None:
      kwargs = self.fp8.generate_kwargs()
      params = self.fp8.rollout_params(params)
      if params_update is not None:
        params_update = _quantized_updates(params_update, self.fp8)
    out = self.engine.collect(
      params,
      source,
      rng,
      policy_version=int(policy_version),
      params_update=params_update,
      **kwargs,
    )
    self.last_stats = dict(out.stats)
    batch = _build_partial(
      out.prompt_tokens, out.prompt_lengths, out.tokens, out.logprobs, out.versions,
      out.lengths, out.stopped, out.group_index,
    )  # fmt: skip
    return batch, out.keys

  def metrics(self) -> dict[str, float]:
    """Host floats of the last collection, under `rollout/`."""
    st = self.last_stats
    out = {
      f"rollout/{k}": float(st[k])
      for k in (
        "groups_returned", "groups_recycled", "groups_fresh", "groups_resumed",
        "off_policy_token_fraction", "mean_staleness", "max_staleness",
        "slot_utilisation", "tokens_per_s", "prefill_tokens", "decode_steps", "syncs",
        "params_updates",
      )
    }  # fmt: skip
    for s, n in st["staleness_histogram"].items():
      out[f"rollout/staleness_{s}_tokens"] = float(n)
    return out

  def state_dict(self) -> dict[str, np.ndarray]:
    """The buffer (see `rlx.sampling.RolloutEngine.state_dict`)."""
    return self.engine.state_dict()

  def load_state_dict(self, state: dict[str, Any]) -> None:
    self.engine.load_state_dict(state)
