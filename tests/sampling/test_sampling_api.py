"""Public surface of rlx.sampling, bad inputs (rejected before any work), the sampling math."""

import ast
import dataclasses
import inspect
import re
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from scipy import stats

from rlx import kernels_pallas, policy, sampling, train

MODEL = policy.ModelConfig.small(
  "llama", vocab_size=32, hidden_size=32, intermediate_size=64, head_dim=8
)
CFG = sampling.SamplerConfig(
  max_slots=2, page_size=4, num_pages=8, max_prompt_len=6, max_new_tokens=4, prefill_chunk=4
)


def test_public_names_and_signatures():
  assert set(sampling.__all__) == {n for n in dir(sampling) if not n.startswith("_")}
  assert set(sampling.__all__) == {
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
  }
  fields = [f.name for f in dataclasses.fields(sampling.SamplerConfig)]
  for name in (
    "max_slots",
    "page_size",
    "num_pages",
    "max_prompt_len",
    "max_new_tokens",
    "kv_dtype",
    "weight_dtype",
    "temperature",
    "top_k",
    "top_p",
    "stop_token_ids",
    "steps_per_sync",
  ):
    assert name in fields
  assert list(inspect.signature(sampling.Sampler).parameters) == ["model_config", "config", "mesh"]
  gen = inspect.signature(sampling.Sampler.generate).parameters
  assert list(gen)[:3] == ["self", "params", "prompts"]
  for name in ("num_samples", "rng", "kv_scales"):
    assert gen[name].kind is inspect.Parameter.KEYWORD_ONLY
  fn = inspect.signature(sampling.Sampler.generate_fn).parameters
  assert list(fn)[:5] == ["self", "params", "prompt_tokens", "prompt_lengths", "rng"]
  assert sampling.Completions._fields == (
    "tokens",
    "logprobs",
    "lengths",
    "finish_reason",
    "prompt_index",
    "stats",
    "versions",
  )


def test_sampling_does_not_import_train():
  """rlx.sampling reads the mesh axes and dtype names from their own low modules."""
  code = textwrap.dedent(
    """
    import sys
    import jax
    import numpy as np
    from jax.sharding import Mesh
    from rlx import policy, sampling
    model = policy.ModelConfig.small(
      "llama", vocab_size=32, hidden_size=32, intermediate_size=64, head_dim=8
    )
    config = sampling.SamplerConfig(
      max_slots=2, page_size=4, num_pages=8, max_prompt_len=6, max_new_tokens=4
    )
    mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1, 1), ("data", "fsdp", "tensor"))
    sampling.Sampler(model, config, mesh)
    loaded = sorted(m for m in sys.modules if m == "rlx.train" or m.startswith("rlx.train."))
    assert not loaded, loaded
    """
  )
  subprocess.run([sys.executable, "-c", code], check=True, timeout=300)


def _offered(call) -> tuple:
  """The choices listed by the ValueError of `call` ("`name` must be one of (...), got ...")."""
  with pytest.raises(ValueError, match="one of") as info:
    call()
  return ast.literal_eval(re.search(r"one of (\(.*\)), got", str(info.value)).group(1))


def test_shared_names_have_one_source():
  """The configs and kernels that check a named choice offer the same set."""
  kv_dtypes = _offered(lambda: dataclasses.replace(CFG, kv_dtype="int8"))
  assert kv_dtypes == ("auto", *sampling.KV_DTYPES)  # "auto": the model's compute dtype
  assert _offered(lambda: dataclasses.replace(CFG, weight_dtype="fp8")) == sampling.WEIGHT_DTYPES
  assert set(sampling.WEIGHT_DTYPES) - {"auto"} <= set(sampling.KV_DTYPES)  # the FP8 formats
  impls = _offered(lambda: kernels_pallas.resolve_impl("cuda", False, "cpu"))
  assert _offered(lambda: dataclasses.replace(CFG, attention_impl="cuda")) == impls
  assert {"auto", "xla"} <= set(impls)
  # The sampler splits its slots over the train mesh's batch axes.
  assert train.BATCH_AXES == train.MESH_AXES[:2]
  mesh = Mesh(np.array(jax.devices()[:2]).reshape(2, 1, 1), train.MESH_AXES)
  with pytest.raises(ValueError, match=re.escape(f"batch axes {train.BATCH_AXES} (size 2)")):
    sampling.Sampler(MODEL, dataclasses.replace(CFG, max_slots=3), mesh)


def _fresh_sampler(model, config):
  """A sampler whose device functions have traced nothing yet (its first call compiles)."""
  sampler = sampling.Sampler(model, config)
  if any(sampler.compile_counts().values()):  # an earlier sampler's functions: start afresh
    sampling.clear_compile_cache()
    sampler = sampling.Sampler(model, config)
  assert not any(sampler.compile_counts().values())
  return sampler


@pytest.mark.parametrize(
  ("overrides", "match"),
  [
    (dict(temperature=-0.1), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-1), "top_k"),
    (dict(kv_dtype="int8"), "kv_dtype"),
    (dict(weight_dtype="fp8"), "weight_dtype"),
    (dict(num_pages=2), "smaller than one full sequence"),
    (dict(max_slots=0), "max_slots"),
    (dict(steps_per_sync=0), "steps_per_sync"),
    (dict(stop_token_ids=(-1,)), "stop_token_ids"),
    (dict(attention_impl="cuda"), "attention_impl"),
  ],
)
def test_bad_config_is_named(overrides, match):
  with pytest.raises(ValueError, match=match):
    dataclasses.replace(CFG, **overrides)


def test_bad_inputs_fail_before_any_work():
  params = policy.init_params(MODEL, jax.random.key(0))
  # No prefill, decode or page copy may run: the first call of any of them traces (counted).
  sampler = _fresh_sampler(MODEL, CFG)
  key = jax.random.key(0)
  cases = [
    (dict(prompts=[[1, 2], []]), "prompts\\[1\\]` is empty"),
    (dict(prompts=[[1] * 7]), "max_prompt_len=6"),
    (dict(prompts=[[1, 32]]), "token id 32 outside"),
    (dict(prompts=[[-1]]), "token id -1 outside"),
    (dict(prompts=[]), "non-empty list"),
    (dict(prompts=[[1.5]]), "int token ids"),
    (dict(num_samples=0), "num_samples"),
    (dict(num_samples=1.0), "num_samples"),
    (dict(rng=0), "rng"),
    (dict(params={**params, "final_norm": {"scale": jnp.ones(3)}}), "final_norm/scale"),
    (dict(kv_scales=(jnp.ones(3), jnp.ones(3))), "kv_scales"),
  ]
  for overrides, match in cases:
    kwargs = dict(params=params, prompts=[[1, 2]], num_samples=1, rng=key) | overrides
    with pytest.raises(ValueError, match=match):
      sampler.generate(
        kwargs["params"], kwargs["prompts"], num_samples=kwargs["num_samples"], rng=kwargs["rng"],
        kv_scales=kwargs.get("kv_scales"),
      )  # fmt: skip
  assert sampler.compile_counts() == {"decode": 0, "prefill": 0, "copy_pages": 0}
  with pytest.raises(ValueError, match="stop_token_ids"):
    sampling.Sampler(MODEL, dataclasses.replace(CFG, stop_token_ids=(32,)))
  fp8 = sampling.Sampler(MODEL, dataclasses.replace(CFG, kv_dtype="fp8_e4m3"))
  with pytest.raises(ValueError, match="kv_scales"):
    fp8.generate(params, [[1, 2]], rng=key)
  with pytest.raises(ValueError, match="prompt_tokens"):
    sampler.generate_fn(params, np.ones((2, 7), np.int32), np.ones(2, np.int32), key)
  with pytest.raises(ValueError, match="prompt_lengths"):
    sampler.generate_fn(params, np.ones((2, 3), np.int32), np.ones(3, np.int32), key)


def test_fp8_kv_runs_close_to_float32():
  rng = np.random.default_rng(0)
  params = jax.tree.map(
    lambda x: x + jnp.asarray(0.3 * rng.normal(size=x.shape), x.dtype),
    policy.init_params(MODEL, jax.random.key(0)),
  )
  prompts = [[1, 2, 3, 4, 5], [6, 7]]
  tokens = np.asarray([[1, 2, 3, 4, 5, 0], [6, 7, 0, 0, 0, 0]], np.int32)
  k_amax, v_amax = policy.kv_absmax(params, MODEL, tokens, tokens > 0)
  scales = (k_amax / 200.0, v_amax / 100.0)
  ref = sampling.Sampler(MODEL, dataclasses.replace(CFG, temperature=0.0))
  fp8 = sampling.Sampler(MODEL, dataclasses.replace(CFG, temperature=0.0, kv_dtype="fp8_e4m3"))
  assert fp8.kv_pool() is None  # no call yet
  a = ref.generate(params, prompts, rng=jax.random.key(0))
  b = fp8.generate(params, prompts, rng=jax.random.key(0), kv_scales=scales)
  # The pools the calls left: [L, Hkv, P, page, D] in the page dtype, no per-token scales.
  shape = (MODEL.num_layers, MODEL.num_kv_heads, CFG.num_pages, CFG.page_size, MODEL.head_dim)
  for sampler, dtype in ((ref, jnp.float32), (fp8, jnp.float8_e4m3fn)):
    pool = sampler.kv_pool()
    assert pool.k.shape == pool.v.shape == shape and pool.k.dtype == pool.v.dtype == dtype
    assert pool.k_scale is None and pool.v_scale is None
  assert b.stats["pages_in_use_at_end"] == 0
  # FP8 KV perturbs the logits slightly; the first tokens (short contexts) agree.
  np.testing.assert_array_equal(a.tokens[:, :1], b.tokens[:, :1])
  np.testing.assert_allclose(a.logprobs[:, 0], b.logprobs[:, 0], atol=0.1)
  # Scales are traced arrays: recalibrating them never recompiles.
  fp8.generate(params, prompts, rng=jax.random.key(0), kv_scales=(k_amax / 150.0, v_amax / 90.0))
  counts = fp8.compile_counts()
  assert counts["decode"] == 1 and counts["prefill"] == 1


# ------------------------------------------------------------------------------------------
# sample_tokens on a tiny vocabulary (no model).

_LOGITS = jnp.asarray([[2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, 0.2]], jnp.float32)


def _draw(n, **kw):
  keys = jax.random.split(jax.random.key(0), n)
  logits = jnp.broadcast_to(_LOGITS, (n, _LOGITS.shape[1]))
  return jax.jit(lambda k, x: sampling.sample_tokens(x, k, **kw))(keys, logits)


def test_temperature_samples_match_softmax_chi_square():
  n = 20000
  tokens, logp = _draw(n, temperature=1.3, top_k=0, top_p=1.0)
  probs = np.asarray(jax.nn.softmax(_LOGITS[0] / 1.3), np.float64)
  probs /= probs.sum()
  counts = np.bincount(np.asarray(tokens), minlength=8)
  result = stats.chisquare(counts, probs * n)
  assert result.pvalue > 1e-3, (counts, probs * n)
  np.testing.assert_allclose(logp, np.log(probs)[np.asarray(tokens)], rtol=1e-5)


@pytest.mark.parametrize(
  ("top_k", "top_p", "allowed"),
  [
    (3, 1.0, {0, 6, 1}),  # the 3 largest logits
    (0, 0.6, {0, 6}),  # softmax: 0.38, 0.23 (mass before each < 0.6), then 0.14 (0.61 before)
    (4, 0.5, {0, 6}),
  ],
)
def test_top_k_top_p_exclusion_and_full_vocab_logprob(top_k, top_p, allowed):
  n = 4000
  tokens, logp = _draw(n, temperature=1.0, top_k=top_k, top_p=top_p)
  seen = set(np.asarray(tokens).tolist())
  assert seen == allowed
  # Kept tokens are drawn in proportion to their softmax.
  probs = np.asarray(jax.nn.softmax(_LOGITS[0]))
  kept = np.asarray(sorted(allowed))
  counts = np.bincount(np.asarray(tokens), minlength=8)[kept]
  expected = probs[kept].astype(np.float64) / probs[kept].astype(np.float64).sum() * n
  assert stats.chisquare(counts, expected).pvalue > 1e-3
  # The recorded log-prob is over the FULL vocabulary, not the truncated one.
  np.testing.assert_allclose(logp, np.log(probs)[np.asarray(tokens)], rtol=1e-5)


def test_greedy_logprob_is_temperature_one_and_keys_fold_in():
  tokens, logp = sampling.sample_tokens(
    _LOGITS, jax.random.split(jax.random.key(0), 1), temperature=0.0, top_k=0, top_p=1.0
  )
  assert int(tokens[0]) == 0
  np.testing.assert_allclose(logp, jax.nn.log_softmax(_LOGITS[0])[0], rtol=1e-6)
  rng = jax.random.key(3)
  keys = sampling.sample_keys(rng, jnp.asarray([2]), jnp.asarray([1]), jnp.asarray([5]))
  want = jax.random.fold_in(jax.random.fold_in(jax.random.fold_in(rng, 2), 1), 5)
  np.testing.assert_array_equal(jax.random.key_data(keys[0]), jax.random.key_data(want))
