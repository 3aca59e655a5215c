"""rlx.sampling: the jitted paged-KV sampler with continuous batching.

  cfg = SamplerConfig(max_slots=32, page_size=16, num_pages=512, max_prompt_len=64,
                      max_new_tokens=128, kv_dtype="float32", temperature=1.0, top_k=0,
                      top_p=1.0, stop_token_ids=(), steps_per_sync=32)
  sampler = Sampler(model_config, cfg, mesh=None)
  out = sampler.generate(params, prompts, num_samples=4, rng=key)      # host-scheduled
  # out.tokens i32[N, M], out.logprobs f32[N, M], out.lengths i32[N],
  # out.finish_reason ("stop" | "length" per row), out.prompt_index i32[N], out.stats
  tokens, logprobs, lengths, stopped = sampler.generate_fn(             # pure, jittable
      params, prompt_tokens, prompt_lengths, key, num_samples=1)

FP8 rollout (W8A8 linears + FP8 KV), refreshed after every policy update:

  cfg = SamplerConfig(..., weight_dtype="fp8_e4m3", kv_dtype="fp8_e4m3")
  rollout_params = quantize_params(train_params, cfg)            # jitted, on device
  kv_scales = calibrate_kv_scales(train_params, model_config, tokens, mask)  # amax / headroom
  out = sampler.generate(rollout_params, prompts, rng=key, kv_scales=kv_scales)

Partial rollouts (APRIL over-provisioning, a checkpointable FIFO buffer of
unfinished groups, per-token behaviour log-probs and versions):

  engine = RolloutEngine(sampler, num_samples=G, target_groups=64, over_provision=2.0)
  out = engine.collect(params, source, key, policy_version=v)   # source(n) -> n (key, ids)
  # out: PartialRollouts of 64 complete groups; engine.state_dict() goes in the checkpoint
  sampler.generate_requests(params, rows, prompt_index=..., sample_index=..., rng=key,
                            prefix_tokens=..., prefix_logprobs=..., stop_when=f)  # resume

Compiled programs (e.g. to check that a call did not recompile):

  sampler.compile_counts()       # {"decode": 1, "prefill": 1, "copy_pages": 1}
  sampler.shares_compiled_programs(other)   # configs differ only in traced values
  sampler.trace_decode(params).jaxpr        # the decode window, traced (or .lower())
  fp8_compile_counts()           # {"quantize_params": n, "calibrate_kv_scales": n}
  clear_compile_cache()          # next samplers compile afresh (cold-start benchmarks)

The K/V cache a call left (its dtype, sharding, bytes, per-token FP8 scales):

  pool = sampler.kv_pool()       # (k, v, k_scale, v_scale); the next call donates it

The draw: `sample_uniforms(rng, prompt_index, sample_index, step)` is
`key_uniforms(sample_keys(...))` fused, and `inverse_cdf(weights, u)` turns
one uniform per row into a token.

Rows are prompt-major: row i * num_samples + j is sample j of prompt i. The
decode step is the policy's own layer scan (`rlx.policy.layer_scan`) with the
stacked page pool in its carry and `rlx.kernels_pallas.paged_attention` /
`write_kv_pages` as the attention hook; see `rlx.sampling._engine` (device
side) and `rlx.sampling.scheduling` (the host side, public: `Scheduler` for
admission, preemption and chunked prefill, `PageManager` for the free stack,
reference counts and prefix sharing).
"""

from rlx.sampling import scheduling
from rlx.sampling._config import (
  KV_DTYPES,
  WEIGHT_DTYPES,
  SamplerConfig,
)
from rlx.sampling._fp8 import (
  K_HEADROOM,
  V_HEADROOM,
  calibrate_kv_scales,
  fp8_compile_counts,
  kv_scales_from_absmax,
  quantize_params,
)
from rlx.sampling._partial import (
  PartialRollouts,
  RolloutEngine,
)
from rlx.sampling._sample import (
  inverse_cdf,
  key_uniforms,
  sample_keys,
  sample_tokens,
  sample_uniforms,
)
from rlx.sampling._sampler import (
  Completions,
  Sampler,
  clear_compile_cache,
)

__all__ = (
  "KV_DTYPES",
  "K_HEADROOM",
  "V_HEADROOM",
  "WEIGHT_DTYPES",
  "calibrate_kv_scales",
  "clear_compile_cache",
  "fp8_compile_counts",
  "inverse_cdf",
  "key_uniforms",
  "kv_scales_from_absmax",
  "quantize_params",
  "Completions",
  "PartialRollouts",
  "RolloutEngine",
  "SamplerConfig",
  "Sampler",
  "sample_keys",
  "sample_tokens",
  "sample_uniforms",
  "scheduling",
)
