"""Chunked `token_logprobs` equals the naive full-logits computation (values and grads)."""

import contextlib
import functools
import io

import jax
import jax.ad_checkpoint
import jax.numpy as jnp
import numpy as np
import pytest

from rlx import policy


@pytest.fixture(scope="module")
def model():
  config = policy.ModelConfig.small("qwen3", vocab_size=97, tie_embeddings=True)
  params = policy.init_params(config, jax.random.key(0))
  params = jax.tree_util.tree_map(lambda x: x * 5.0 if x.ndim >= 2 else x, params)
  return config, params


def _batch(b=3, s=11, vocab=97, seed=0):
  rng = np.random.default_rng(seed)
  tokens = jnp.asarray(rng.integers(0, vocab, (b, s)), jnp.int32)
  mask = np.zeros((b, s), np.float32)
  mask[0, 3:] = 1
  mask[1, 2:7] = 1
  mask[2, 1:] = 1
  return tokens, jnp.asarray(mask)


@functools.partial(jax.jit, static_argnums=1)
def _naive(params, config, tokens, mask, temperature=1.0):
  logits = policy.forward(params, config, tokens)
  return policy.logprobs_from_logits(logits, tokens, mask, temperature=temperature)


_chunked = jax.jit(policy.token_logprobs, static_argnums=1, static_argnames="chunk_size")


def test_logprobs_from_logits_hand_computed():
  logits = jnp.asarray([[[0.0, 1.0, 2.0], [1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]])
  tokens = jnp.asarray([[0, 2, 1]])
  mask = jnp.asarray([[1, 1, 0]])
  logp, entropy = policy.logprobs_from_logits(logits, tokens, mask, temperature=2.0)
  z = np.array([0.0, 0.5, 1.0])
  lse = np.log(np.exp(z).sum())
  p = np.exp(z - lse)
  np.testing.assert_allclose(logp, [[0.0, 1.0 - lse, 0.0]], rtol=1e-6)
  np.testing.assert_allclose(entropy, [[0.0, -(p * np.log(p)).sum(), 0.0]], rtol=1e-6)


@pytest.mark.parametrize("chunk_size, temperature", [(1, 1.0), (4, 0.7), (64, 1.3)])
def test_chunked_equals_naive(model, chunk_size, temperature):
  config, params = model
  tokens, mask = _batch()
  logp, entropy = _chunked(
    params, config, tokens, mask, temperature=temperature, chunk_size=chunk_size
  )
  ref_logp, ref_entropy = _naive(params, config, tokens, mask, temperature)
  assert logp.shape == entropy.shape == tokens.shape
  assert float(jnp.max(jnp.abs(ref_logp))) > 1.0  # non-trivial distributions
  np.testing.assert_allclose(logp, ref_logp, atol=1e-5)
  np.testing.assert_allclose(entropy, ref_entropy, atol=1e-5)
  assert np.all(np.asarray(logp)[np.asarray(mask) == 0] == 0)
  assert np.all(np.asarray(entropy)[:, 0] == 0)


def test_chunked_gradients_equal_naive(model):
  config, params = model
  tokens, mask = _batch()
  weights = jnp.asarray(np.random.default_rng(1).normal(size=tokens.shape), jnp.float32)

  def objective(fn):
    def f(p):
      logp, entropy = fn(p)
      return jnp.sum(weights * logp) + 0.3 * jnp.sum(entropy)

    return f

  chunked = objective(
    lambda p: policy.token_logprobs(p, config, tokens, mask, temperature=0.9, chunk_size=4)
  )
  naive = objective(lambda p: _naive(p, config, tokens, mask, 0.9))
  g1 = jax.jit(jax.grad(chunked))(params)
  g2 = jax.jit(jax.grad(naive))(params)
  for (path, a), b in zip(
    jax.tree_util.tree_leaves_with_path(g1), jax.tree_util.tree_leaves(g2), strict=True
  ):
    scale = float(jnp.max(jnp.abs(b))) + 1e-6
    np.testing.assert_allclose(a / scale, b / scale, atol=2e-5, err_msg=str(path))


def test_single_token(model):
  config, params = model
  tokens, mask = _batch()
  logp, entropy = policy.token_logprobs(params, config, tokens[:, :1], mask[:, :1])
  assert logp.shape == (3, 1) and np.all(np.asarray(logp) == 0)


def test_errors(model):
  config, params = model
  tokens, mask = _batch()
  with pytest.raises(ValueError, match="mask"):
    policy.token_logprobs(params, config, tokens, mask[:, :3])
  with pytest.raises(ValueError, match="temperature"):
    policy.token_logprobs(params, config, tokens, mask, temperature=0.0)
  with pytest.raises(ValueError, match="chunk_size"):
    policy.token_logprobs(params, config, tokens, mask, chunk_size=0)
  with pytest.raises(ValueError, match="token id 97 outside"):
    policy.token_logprobs(params, config, tokens.at[1, 4].set(97), mask)
  with pytest.raises(ValueError, match="logits"):
    policy.logprobs_from_logits(jnp.zeros((3, 10, 97)), tokens, mask)
  with pytest.raises(ValueError, match="outside"):
    policy.logprobs_from_logits(jnp.zeros((3, 11, 50)), tokens.at[0, 0].set(60), mask)


@pytest.mark.parametrize("bad_id", [-1, -97, 97, 200])
def test_out_of_range_ids_under_jit_give_nan_not_another_token(model, bad_id):
  """Traced ids cannot be checked: -1 must not read as V - 1 (nor V + k be clamped)."""
  config, params = model
  tokens, mask = _batch()
  bad = tokens.at[1, 4].set(bad_id)
  forward = jax.jit(policy.forward, static_argnums=1)
  clean_logits, logits = np.asarray(forward(params, config, tokens)), forward(params, config, bad)
  logits = np.asarray(logits)
  # The bad position and every later one attending to it (earlier ones may be NaN too:
  # masked attention weights are 0 and 0 * NaN = NaN); the other rows are untouched.
  assert np.isnan(logits[1, 4:]).all()
  np.testing.assert_array_equal(logits[[0, 2]], clean_logits[[0, 2]])
  for fn in (_chunked, _naive):
    clean_logp, _ = fn(params, config, tokens, mask)
    logp, _ = fn(params, config, bad, mask)
    logp, clean_logp = np.asarray(logp), np.asarray(clean_logp)
    assert np.isnan(logp[1, 4]), "the log-prob OF the bad id"
    assert np.isnan(logp[1, 5:7]).all(), "the log-probs after it"
    np.testing.assert_array_equal(logp[1, 7:], 0.0)  # masked out
    np.testing.assert_array_equal(logp[[0, 2]], clean_logp[[0, 2]])


def _scale_kernels(tree, factor):
  return jax.tree_util.tree_map_with_path(
    lambda path, x: x * factor if path[-1].key == "kernel" else x, tree
  )


def test_layer_params_fn_is_applied_to_each_layer_inside_the_scan(model):
  """A hook scaling each layer's kernels == scaling the stacked kernels (values and grads)."""
  config, params = model
  tokens, mask = _batch()
  weights = jnp.asarray(np.random.default_rng(2).normal(size=tokens.shape), jnp.float32)

  def objective(p, hook):
    logp, entropy = policy.token_logprobs(
      p, config, tokens, mask, chunk_size=4, layer_params_fn=hook
    )
    return jnp.sum(weights * logp) + 0.3 * jnp.sum(entropy), logp

  hooked = jax.jit(
    jax.value_and_grad(
      lambda p: objective(p, lambda layer: _scale_kernels(layer, 1.5)), has_aux=True
    )
  )
  direct = jax.jit(jax.value_and_grad(lambda p: objective(p, None), has_aux=True))
  (_, logp), grads = hooked(params)
  scaled = dict(params, layers=_scale_kernels(params["layers"], 1.5))
  (_, want_logp), want = direct(scaled)
  assert float(jnp.max(jnp.abs(logp - direct(params)[0][1]))) > 1e-3  # the hook matters
  np.testing.assert_allclose(logp, want_logp, atol=1e-5)
  # d/dW f(1.5 W) = 1.5 f'(1.5 W) for layer kernels; other grads are unchanged.
  want["layers"] = _scale_kernels(want["layers"], 1.5)
  for (path, a), b in zip(
    jax.tree_util.tree_leaves_with_path(grads), jax.tree_util.tree_leaves(want), strict=True
  ):
    scale = float(jnp.max(jnp.abs(b))) + 1e-6
    np.testing.assert_allclose(a / scale, b / scale, atol=2e-5, err_msg=str(path))

  # The hook sees one layer's slice (no [L] axis), traced once by the scan.
  seen = []

  def recording(layer):
    seen.append(jax.tree_util.tree_map(jnp.shape, layer))
    return layer

  jax.eval_shape(lambda p: policy.forward(p, config, tokens, layer_params_fn=recording), params)
  assert seen == [jax.tree_util.tree_map(lambda x: x.shape[1:], params["layers"])]


def test_layer_params_fn_outputs_are_recomputed_not_saved(model):
  """Only argument params are saved for the backward pass, never the hook's [L, ...] outputs.

  (This is what keeps one gathered layer alive at a time in FSDP training.)
  """
  config, params = model
  tokens, mask = _batch()
  stacked = {tuple(x.shape) for x in jax.tree_util.tree_leaves(params["layers"]) if x.ndim == 3}

  def saved(hook):
    f = lambda p: jnp.sum(policy.token_logprobs(p, config, tokens, mask, layer_params_fn=hook)[0])
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
      jax.ad_checkpoint.print_saved_residuals(f, params)
    lines = out.getvalue().splitlines()
    assert any("from the argument" in line for line in lines)  # the format we parse
    return [
      line
      for line in lines
      if "from the argument" not in line
      and any(line.startswith(f"f32[{','.join(map(str, s))}]") for s in stacked)
    ]

  assert saved(lambda layer: _scale_kernels(layer, 1.5)) == []
  # Control: without the hook's remat, scaling the stacked kernels before the
  # forward saves the scaled [L, ...] kernels, and the parser finds them.
  f = lambda p: jnp.sum(
    policy.token_logprobs(dict(p, layers=_scale_kernels(p["layers"], 1.5)), config, tokens, mask)[0]
  )
  out = io.StringIO()
  with contextlib.redirect_stdout(out):
    jax.ad_checkpoint.print_saved_residuals(f, params)
  assert any(
    "from the argument" not in line
    and any(line.startswith(f"f32[{','.join(map(str, s))}]") for s in stacked)
    for line in out.getvalue().splitlines()
  )


def test_layer_params_fn_errors(model):
  config, params = model
  tokens, _ = _batch()

  def fwd(hook):
    return jax.eval_shape(lambda p: policy.forward(p, config, tokens, layer_params_fn=hook), params)

  with pytest.raises(ValueError, match="`layer_params_fn` must be callable"):
    fwd(3)
  with pytest.raises(ValueError, match="`layer_params_fn` must return the tree structure"):
    fwd(lambda layer: {k: v for k, v in layer.items() if k != "mlp"})
  with pytest.raises(ValueError, match="changed the shape of layers/attn/q_proj/kernel"):
    fwd(
      lambda layer: dict(
        layer, attn=dict(layer["attn"], q_proj={"kernel": layer["attn"]["q_proj"]["kernel"][:2]})
      )
    )


@pytest.mark.parametrize("fn", ["token_logprobs", "logprobs_from_logits"])
def test_bad_input_names_the_argument(model, fn):
  config, params = model
  tokens, mask = _batch(s=5)
  logits = jnp.zeros((3, 5, 97))

  def call(tokens=tokens, mask=mask, **kw):
    if fn == "token_logprobs":
      return policy.token_logprobs(params, config, tokens, mask, **kw)
    return policy.logprobs_from_logits(
      logits[: tokens.shape[0], : tokens.shape[1]], tokens, mask, **kw
    )

  # Temperature: a real scalar, finite and > 0 when known (0 gave NaN, -1 flipped the
  # distribution, inf made it uniform, a vector broadcast over the vocabulary).
  for bad in ("1.0", None, True, 0.5 + 0j):
    with pytest.raises(ValueError, match="`temperature` must be a real number"):
      call(temperature=bad)
  for bad in (np.float32(0.0), jnp.float32(-1.0), np.inf, np.nan):
    with pytest.raises(ValueError, match="`temperature` must be finite and > 0"):
      call(temperature=bad)
  with pytest.raises(ValueError, match=r"`temperature` must be a scalar \(rank 0\)"):
    call(temperature=jnp.ones(3))
  # Masks of another dtype or missing; zero-size batches.
  with pytest.raises(ValueError, match="`mask` must hold bool, int or float"):
    call(mask=np.full(tokens.shape, "a"))
  with pytest.raises(ValueError, match="`mask` must be an array .* got None"):
    call(mask=None)
  for shape in [(0, 5), (2, 0)]:
    with pytest.raises(ValueError, match=r"`tokens` must be \[B, S\] with B >= 1 .*zero-size"):
      call(tokens=jnp.zeros(shape, jnp.int32), mask=jnp.zeros(shape))
  # NumPy temperatures are fine (the full model pass is covered by the tests above).
  if fn == "logprobs_from_logits":
    want = call(temperature=0.7)[0]
    np.testing.assert_allclose(call(temperature=np.float32(0.7))[0], want, rtol=1e-6)


def test_chunk_size_and_config_types(model):
  config, params = model
  tokens, mask = _batch(s=5)
  want = policy.token_logprobs(params, config, tokens, mask, chunk_size=2)[0]
  got = policy.token_logprobs(params, config, tokens, mask, chunk_size=np.int64(2))[0]
  np.testing.assert_array_equal(got, want)
  for bad in (True, 2.0, "2"):
    with pytest.raises(ValueError, match="`chunk_size` must be a positive int"):
      policy.token_logprobs(params, config, tokens, mask, chunk_size=bad)
  with pytest.raises(ValueError, match="`config` must be a rlx.policy.ModelConfig"):
    policy.token_logprobs(params, "qwen3", tokens, mask)
  # Logits as a nested list or ints are read as numbers; strings are refused.
  logits = np.asarray(jax.random.normal(jax.random.key(1), (3, 5, 97)))
  ref = policy.logprobs_from_logits(logits, tokens, mask)[0]
  np.testing.assert_allclose(policy.logprobs_from_logits(logits.tolist(), tokens, mask)[0], ref)
  with pytest.raises(ValueError, match="`logits` must hold real numbers"):
    policy.logprobs_from_logits(np.full((3, 5, 97), "a"), tokens, mask)
  with pytest.raises(ValueError, match="`logits` must have V >= 1"):
    policy.logprobs_from_logits(jnp.zeros((3, 5, 0)), tokens * 0, mask)
