"""ModelConfig, parameters, the forward pass and the decode-ready attention interface."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlx import kernels_pallas, policy

FAMILIES = ("qwen2", "qwen3", "llama")


def _llama3_config(**overrides):
  base = dict(
    rope_theta=500000.0,
    rope_scaling=policy.RopeScaling(8.0, 1.0, 4.0, 64),
    attention_bias=True,
    attention_out_bias=True,
  )
  base.update(overrides)
  return policy.ModelConfig.small("llama", **base)


@pytest.fixture(scope="module")
def models():
  """family -> (config, params) with O(1) random norms and biases."""
  out = {}
  for i, family in enumerate(FAMILIES):
    config = _llama3_config() if family == "llama" else policy.ModelConfig.small(family)
    out[family] = (config, _perturbed_init(config, jax.random.key(i)))
  return out


def _perturbed_init(config, rng):
  """init_params plus N(0, 0.2) noise on every leaf (numpy, so nothing compiles)."""
  noise = np.random.default_rng(int(jax.random.randint(rng, (), 0, 2**30)))
  return jax.tree_util.tree_map(
    lambda x: x + jnp.asarray(0.2 * noise.normal(size=x.shape), x.dtype),
    policy.init_params(config, rng),
  )


_forward = jax.jit(
  policy.forward, static_argnums=1, static_argnames=("attention_fn", "return_hidden")
)


def _tokens(b=2, s=9, seed=0, vocab=128):
  return jnp.asarray(np.random.default_rng(seed).integers(0, vocab, (b, s)), jnp.int32)


# ----------------------------------------------------------------------------
# Config.


@pytest.mark.parametrize("family", FAMILIES)
def test_config_hf_round_trip_and_hashable(family):
  config = _llama3_config() if family == "llama" else policy.ModelConfig.small(family)
  assert policy.ModelConfig.from_hf_config(config.to_hf_config()) == config
  assert hash(config) == hash(dataclasses.replace(config))
  # Usable as a static jit argument.
  f = jax.jit(lambda c, x: x * c.hidden_size, static_argnums=0)
  assert float(f(config, 1.0)) == 64.0


def test_config_legacy_rope_layout():
  hf = _llama3_config().to_hf_config()
  del hf["rope_parameters"]
  hf["rope_scaling"] = {
    "type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
  }
  config = policy.ModelConfig.from_hf_config(hf)
  assert config.rope_scaling == policy.RopeScaling(8.0, 1.0, 4.0, 64)
  assert config.rope_theta == 500000.0
  hf["rope_scaling"] = None  # transformers 4.x layout without scaling
  hf["rope_theta"] = 1e6
  config = policy.ModelConfig.from_hf_config(hf)
  assert config.rope_scaling is None and config.rope_theta == 1e6


@pytest.mark.parametrize(
  "field, value, match",
  [
    ("rope_parameters", {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}, "'yarn'"),
    ("use_sliding_window", True, "use_sliding_window"),
    ("layer_types", ["full_attention", "sliding_attention"], "sliding_attention"),
    ("hidden_act", "gelu", "hidden_act"),
    ("mlp_bias", True, "mlp_bias"),
    ("quantization_config", {"quant_method": "fp8"}, "quantization_config"),
    ("model_type", "gemma", "gemma"),
  ],
)
def test_config_rejects_unsupported_fields(field, value, match):
  hf = policy.ModelConfig.small("llama").to_hf_config()
  hf[field] = value
  with pytest.raises(ValueError, match=match):
    policy.ModelConfig.from_hf_config(hf)


def test_config_validation():
  with pytest.raises(ValueError, match="num_kv_heads"):
    policy.ModelConfig.small("qwen2", num_kv_heads=3)
  with pytest.raises(ValueError, match="family"):
    policy.ModelConfig.small("mistral")
  with pytest.raises(ValueError, match="param_dtype"):
    policy.ModelConfig.small("qwen2", param_dtype="int8")
  assert policy.ModelConfig.small("qwen2", param_dtype=jnp.bfloat16).param_dtype == "bfloat16"


def test_llama3_rope_frequencies_by_band():
  config = _llama3_config(head_dim=16)
  plain = policy.rope_inv_freq(dataclasses.replace(config, rope_scaling=None))
  scaled = policy.rope_inv_freq(config)
  wavelen = 2 * np.pi / plain
  high = wavelen < 64 / 4.0  # kept
  low = wavelen > 64 / 1.0  # divided by factor
  assert high.any() and low.any() and (~high & ~low).any()
  np.testing.assert_allclose(scaled[high], plain[high], rtol=1e-6)
  np.testing.assert_allclose(scaled[low], plain[low] / 8.0, rtol=1e-6)
  mid = ~high & ~low
  assert np.all(scaled[mid] < plain[mid]) and np.all(scaled[mid] > plain[mid] / 8.0)


# ----------------------------------------------------------------------------
# Parameters.


@pytest.mark.parametrize("family", FAMILIES)
def test_init_params_structure(family, models):
  config, params = models[family]
  shapes = jax.tree_util.tree_map(lambda x: tuple(x.shape), params)
  assert shapes == policy.param_shapes(config)
  if family == "qwen3":
    bf16 = dataclasses.replace(config, param_dtype="bfloat16")
    leaves = jax.tree_util.tree_leaves(
      jax.eval_shape(lambda k: policy.init_params(bf16, k), jax.random.key(0))
    )
    assert all(x.dtype == jnp.bfloat16 for x in leaves)


def test_check_params_names_problems(models):
  config, params = models["qwen3"]
  bad = jax.tree_util.tree_map(lambda x: x, params)
  del bad["layers"]["attn"]["q_norm"]
  bad["final_norm"]["scale"] = jnp.ones((3,))
  with pytest.raises(ValueError) as info:
    policy.forward(bad, config, _tokens())
  assert "missing layers/attn/q_norm/scale" in str(info.value)
  assert "final_norm/scale has shape (3,), expected (64,)" in str(info.value)


# ----------------------------------------------------------------------------
# Forward: shapes, errors, packing, remat.


def test_forward_shapes_and_errors(models):
  config, params = models["qwen2"]
  tokens = _tokens()
  assert _forward(params, config, tokens).shape == (2, 9, 128)
  hidden = _forward(params, config, tokens, return_hidden=True)
  assert hidden.shape == (2, 9, 64)
  np.testing.assert_allclose(
    policy.logits_from_hidden(params, config, hidden),
    _forward(params, config, tokens),
    atol=1e-5,
  )
  with pytest.raises(ValueError, match="tokens"):
    policy.forward(params, config, tokens[0])
  with pytest.raises(ValueError, match="positions"):
    policy.forward(params, config, tokens, tokens[:, :3])
  with pytest.raises(ValueError, match="segment_ids"):
    policy.forward(params, config, tokens, segment_ids=jnp.ones((2, 9)))
  with pytest.raises(ValueError, match="integer"):
    policy.forward(params, config, tokens.astype(jnp.float32))


def test_packed_segments_equal_separate_rows(models):
  config, params = models["llama"]
  a, b = _tokens(1, 5, seed=1)[0], _tokens(1, 4, seed=2)[0]
  pad = lambda x: jnp.concatenate([x, jnp.zeros(12 - x.shape[0], jnp.int32)])
  rows = jnp.stack([jnp.concatenate([a, b, jnp.zeros(3, jnp.int32)]), pad(a), pad(b)])
  segments = jnp.asarray([[1] * 5 + [2] * 4 + [0] * 3, [1] * 12, [1] * 12], jnp.int32)
  np.testing.assert_array_equal(
    policy.positions_from_segments(segments[:1]), [[0, 1, 2, 3, 4, 0, 1, 2, 3, 0, 1, 2]]
  )
  out = _forward(params, config, rows, segment_ids=segments)
  np.testing.assert_allclose(out[0, :5], out[1, :5], atol=1e-5)
  np.testing.assert_allclose(out[0, 5:9], out[2, :4], atol=1e-5)


def test_remat_same_values_and_grads(models):
  config, params = models["qwen3"]
  tokens = _tokens(2, 5)

  def loss(p, c):
    return jnp.mean(jax.nn.log_softmax(policy.forward(p, c, tokens)) ** 2)

  remat = dataclasses.replace(config, remat=True)
  v1, g1 = jax.jit(jax.value_and_grad(loss), static_argnums=1)(params, config)
  v2, g2 = jax.jit(jax.value_and_grad(loss), static_argnums=1)(params, remat)
  np.testing.assert_allclose(v1, v2, rtol=1e-6)
  jax.tree_util.tree_map(
    lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-5), g1, g2
  )


# ----------------------------------------------------------------------------
# Decode-ready attention interface.


def _loop_attention(layer_index, q, k, v, *, positions, segment_ids):
  """Independent dense causal GQA attention: explicit loop over query heads."""
  del layer_index
  b, s, h, d = q.shape
  group = h // k.shape[2]
  causal = positions[:, :, None] >= positions[:, None, :]  # [B, Sq, Sk]
  if segment_ids is not None:
    causal &= segment_ids[:, :, None] == segment_ids[:, None, :]
  outs = []
  for head in range(h):
    kh, vh = k[:, :, head // group], v[:, :, head // group]
    scores = jnp.einsum("bqd,bkd->bqk", q[:, :, head], kh) / np.sqrt(d)
    scores = jnp.where(causal, scores, -jnp.inf)
    outs.append(jnp.einsum("bqk,bkd->bqd", jax.nn.softmax(scores, -1), vh))
  return jnp.stack(outs, axis=2)


@pytest.mark.parametrize("family", FAMILIES)
def test_external_attention_fn_matches_default(family, models):
  config, params = models[family]
  tokens = _tokens(3, 8)
  segments = jnp.asarray([[1] * 8, [1] * 5 + [0] * 3, [1] * 3 + [2] * 5], jnp.int32)
  ref = _forward(params, config, tokens, segment_ids=segments)
  ext = _forward(params, config, tokens, segment_ids=segments, attention_fn=_loop_attention)
  np.testing.assert_allclose(ext, ref, atol=1e-4)

  seen = []

  def recording(layer_index, q, k, v, **kw):
    seen.append((q.shape, k.shape, v.shape))
    return _loop_attention(layer_index, q, k, v, **kw)

  jax.eval_shape(lambda p: policy.forward(p, config, tokens, attention_fn=recording), params)
  hkv = (3, 8, config.num_kv_heads, config.head_dim)
  assert seen == [((3, 8, config.num_heads, config.head_dim), hkv, hkv)]  # traced once in scan

  with pytest.raises(ValueError, match="attn_out"):
    jax.eval_shape(
      lambda p: policy.forward(p, config, tokens, attention_fn=lambda i, q, k, v, **kw: q[..., :2]),
      params,
    )


PAGE = 4


@functools.partial(jax.jit, static_argnums=1)
def _paged_decode(params, config, tokens):
  """Token-by-token decoding through `layer_scan` with a stacked paged KV pool in its carry.

  One `lax.fori_loop` step feeds token t of every row at position t: the hook writes
  its K/V into the `[L, Hkv, P, page, D]` pool (`write_kv_pages(..., layer=i)`) and
  attends over the row's pages with `paged_attention`, as a sampler's decode step does.
  Rows use interleaved, non-contiguous pages.
  """
  b, s = tokens.shape
  pages_per_row = -(-s // PAGE)
  shape = (config.num_layers, config.num_kv_heads, b * pages_per_row, PAGE, config.head_dim)
  pool = (jnp.full(shape, jnp.nan), jnp.full(shape, jnp.nan))  # unwritten rows must never be read
  table = jnp.arange(b * pages_per_row, dtype=jnp.int32).reshape(pages_per_row, b).T

  def step(t, carry):
    pool, logits = carry
    length = jnp.full((b,), t, jnp.int32)

    def hook(i, q, k, v, pool, *, positions, segment_ids):
      del positions, segment_ids
      k_pool, v_pool = kernels_pallas.write_kv_pages(
        *pool, k[:, 0], v[:, 0], length, table, layer=i
      )
      out = kernels_pallas.paged_attention(q[:, 0], k_pool[i], v_pool[i], length + 1, table)
      return out[:, None], (k_pool, v_pool)

    x = policy.embed(params, config, jax.lax.dynamic_slice_in_dim(tokens, t, 1, axis=1))
    x, pool = policy.layer_scan(params, config, x, length[:, None], attention_fn=hook, cache=pool)
    step_logits = policy.logits_from_hidden(params, config, policy.final_norm(params, config, x))
    return pool, jax.lax.dynamic_update_slice_in_dim(logits, step_logits, t, axis=1)

  logits = jnp.zeros((b, s, config.vocab_size), jnp.float32)
  return jax.lax.fori_loop(0, s, step, (pool, logits))[1]


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_layer_scan_drives_a_paged_kv_decode(family, models):
  """Decoding with the paged pool in the layer-scan carry reproduces the forward logits."""
  config, params = models[family]
  tokens = _tokens(2, 6, seed=3)
  ref = _forward(params, config, tokens)
  np.testing.assert_allclose(_paged_decode(params, config, tokens), ref, atol=1e-4)


def test_layer_scan_cache_in_carry_and_checks(models):
  config, params = models["qwen2"]
  tokens = _tokens(2, 5, seed=5)
  x = policy.embed(params, config, tokens)
  positions = jnp.broadcast_to(jnp.arange(5), (2, 5))

  def hook(i, q, k, v, cache, *, positions, segment_ids):
    return policy.dense_causal_attention(q, k, v), cache.at[i].add(i + 1)

  out, cache = policy.layer_scan(
    params, config, x, positions, attention_fn=hook, cache=jnp.zeros(config.num_layers)
  )
  np.testing.assert_array_equal(cache, np.arange(1, config.num_layers + 1))
  hidden = _forward(params, config, tokens, return_hidden=True)
  np.testing.assert_allclose(policy.final_norm(params, config, out), hidden, atol=1e-5)


def test_layer_scan_unrolled_equals_the_scan(models):
  """unroll=True (stacked or per-layer list weights) runs the same math, static layer ids."""
  config, params = models["qwen2"]
  tokens = _tokens(2, 5, seed=6)
  x = policy.embed(params, config, tokens)
  positions = jnp.broadcast_to(jnp.arange(5), (2, 5))
  seen = []

  def hook(i, q, k, v, cache, *, positions, segment_ids):
    seen.append(i)
    return policy.dense_causal_attention(q, k, v), cache.at[i].add(i + 1)

  run = lambda p, unroll: policy.layer_scan(
    p, config, x, positions, attention_fn=hook, cache=jnp.zeros(config.num_layers),
    unroll=unroll,
  )  # fmt: skip
  want, want_cache = run(params, False)
  got, cache = run(params, True)
  ids = [int(i) for i in seen[1 : 1 + config.num_layers]]  # constants, in order
  assert ids == list(range(config.num_layers))
  np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
  np.testing.assert_array_equal(cache, want_cache)
  layers = [policy.get_layer(params, i) for i in range(config.num_layers)]
  got_list, _ = run({**params, "layers": layers}, True)
  np.testing.assert_allclose(got_list, got, atol=1e-6)
  with pytest.raises(ValueError, match="unroll=True"):
    run({**params, "layers": layers}, False)
  with pytest.raises(ValueError, match="entries"):
    run({**params, "layers": layers[:-1]}, True)
  with pytest.raises(ValueError, match="`unroll` must be a bool"):
    run(params, 2)


def test_kv_absmax_matches_per_layer_computation(models):
  config, params = models["qwen3"]
  tokens = _tokens(2, 5, seed=4)
  mask = jnp.asarray([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0]])
  k_amax, v_amax = jax.jit(policy.kv_absmax, static_argnums=1)(params, config, tokens, mask)
  assert k_amax.shape == v_amax.shape == (config.num_layers, config.num_kv_heads)
  x = policy.embed(params, config, tokens)
  positions = jnp.broadcast_to(jnp.arange(5), (2, 5))
  valid = np.asarray(mask, bool)
  for i in range(config.num_layers):
    layer = policy.get_layer(params, i)
    q, k, v = policy.layer_qkv(layer, config, x, positions)
    for got, t in ((k_amax[i], k), (v_amax[i], v)):
      want = np.abs(np.asarray(t))[valid].max(axis=(0, 2))  # [Hkv]
      np.testing.assert_allclose(got, want, rtol=1e-5)
    x = policy.layer_finish(layer, config, x, policy.dense_causal_attention(q, k, v))
  # The per-layer parameter hook runs inside kv_absmax's layer scan too.
  double_v = lambda layer: {**layer, "attn": {**layer["attn"], "v_proj": jax.tree.map(
    lambda a: 2 * a, layer["attn"]["v_proj"])}}  # fmt: skip
  k2, v2 = policy.kv_absmax(params, config, tokens, mask, layer_params_fn=double_v)
  np.testing.assert_allclose(k2[0], k_amax[0], rtol=1e-6)  # layer 0 keys unchanged
  np.testing.assert_allclose(v2[0], 2 * v_amax[0], rtol=1e-5)


def test_config_from_transformers4_style_dicts():
  """config.json layouts as published for Qwen2.5 / Qwen3 / Llama-3.2 (pre-transformers-5)."""
  qwen25 = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "hidden_act": "silu",
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_attention_heads": 14,
    "num_hidden_layers": 24,
    "num_key_value_heads": 2,
    "max_position_embeddings": 32768,
    "max_window_layers": 21,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000.0,
    "sliding_window": 32768,
    "use_sliding_window": False,
    "use_mrope": False,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "vocab_size": 151936,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
  }
  c = policy.ModelConfig.from_hf_config(qwen25)
  assert (c.family, c.head_dim, c.num_kv_heads, c.tie_embeddings) == ("qwen2", 64, 2, True)
  assert c.attention_bias and not c.attention_out_bias and not c.qk_norm
  assert (c.param_dtype, c.compute_dtype, c.rope_theta) == ("bfloat16", "bfloat16", 1e6)

  qwen3 = dict(qwen25, architectures=["Qwen3ForCausalLM"], model_type="qwen3", head_dim=128)
  qwen3.update(attention_bias=False, hidden_size=1024, num_attention_heads=16, sliding_window=None)
  c = policy.ModelConfig.from_hf_config(qwen3)
  assert (c.head_dim, c.qk_norm, c.attention_bias) == (128, True, False)

  llama32 = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "attention_bias": False,
    "head_dim": 64,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "max_position_embeddings": 131072,
    "mlp_bias": False,
    "num_attention_heads": 32,
    "num_hidden_layers": 16,
    "num_key_value_heads": 8,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
      "factor": 32.0,
      "high_freq_factor": 4.0,
      "low_freq_factor": 1.0,
      "original_max_position_embeddings": 8192,
      "rope_type": "llama3",
    },
    "rope_theta": 500000.0,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "vocab_size": 128256,
    "eos_token_id": [128001, 128008, 128009],
  }
  c = policy.ModelConfig.from_hf_config(llama32, param_dtype="float32")
  assert c.rope_scaling == policy.RopeScaling(32.0, 1.0, 4.0, 8192)
  assert c.eos_token_id == (128001, 128008, 128009) and hash(c)
  assert (c.param_dtype, c.compute_dtype) == ("float32", "float32")
  assert policy.ModelConfig.from_hf_config(c.to_hf_config()) == c


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_linear_matches_fake_quant(fmt):
  """`linear` on an Fp8Kernel == fake-quant f32 math, widths 160 -> 200 (partial edge blocks)."""
  rng = np.random.default_rng(1)
  w = jnp.asarray(rng.normal(size=(1, 160, 200)), jnp.float32)
  x = jnp.asarray(rng.normal(size=(3, 5, 160)), jnp.float32)
  bias = jnp.asarray(rng.normal(size=(200,)), jnp.float32)
  tree = {"layers": {g: {} for g, _ in policy.LINEAR_KERNELS}}
  for g, n in policy.LINEAR_KERNELS:
    tree["layers"][g][n] = {"kernel": w}
  kernel = policy.quantize_linears(tree, fmt)["layers"]["attn"]["q_proj"]["kernel"]
  k = jax.tree.map(lambda a: a[0], kernel)
  dtype = {"fp8_e4m3": jnp.float8_e4m3fn, "fp8_e5m2": jnp.float8_e5m2}[fmt]
  assert k.scale.shape == (2, 2) and k.values.dtype == dtype
  y = policy.linear({"kernel": k, "bias": bias}, x, jnp.float32)
  x_q, x_s = kernels_pallas.quantize_fp8_per_token_group(x.reshape(15, 160), 128, dtype)
  x_deq = x_q.astype(jnp.float32) * jnp.repeat(x_s, 128, axis=1)[:, :160]
  want = jnp.dot(x_deq, k.dequantize(), precision="highest").reshape(3, 5, 200) + bias
  np.testing.assert_allclose(np.asarray(y), np.asarray(want), rtol=1e-5, atol=1e-4)
  dense = jnp.einsum("bsk,kn->bsn", x, w[0]) + bias
  rel = float(jnp.linalg.norm(y - dense) / jnp.linalg.norm(dense))
  assert 0 < rel < (0.05 if fmt == "fp8_e4m3" else 0.1)  # quantized (not zero) and small


def test_fp8_forward_same_decoder_and_hook(models):
  """FP8 params run through the same forward; a layer hook passes FP8 kernels unchanged."""
  config, params = models["qwen3"]
  q = policy.quantize_linears(params)
  tokens = jnp.asarray(np.random.default_rng(2).integers(0, config.vocab_size, (2, 6)))
  fwd = jax.jit(policy.forward, static_argnums=1, static_argnames="layer_params_fn")
  dense, fp8 = fwd(params, config, tokens), fwd(q, config, tokens)
  hooked = fwd(q, config, tokens, layer_params_fn=lambda layer: layer)
  np.testing.assert_array_equal(np.asarray(hooked), np.asarray(fp8))
  rel = float(jnp.linalg.norm(fp8 - dense) / jnp.linalg.norm(dense))
  assert 0 < rel < 0.25, rel  # quantized (not identical), but the same model
  cast = jax.tree.map(lambda x: x, q)
  k = cast["layers"]["mlp"]["up_proj"]["kernel"]
  cast["layers"]["mlp"]["up_proj"]["kernel"] = policy.Fp8Kernel(
    k.values.astype(jnp.float32), k.scale
  )
  with pytest.raises(ValueError, match="Fp8Kernel"):
    policy.forward(cast, config, tokens)
