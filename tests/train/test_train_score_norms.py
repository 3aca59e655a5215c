"""`ComputeLogprobs.score_norms`: per-row score-gradient norms on 1, 2 and 8 devices."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import train_testlib as tl

from rlx import policy, train


def _direct_norms(batch: dict) -> np.ndarray:
  """||grad sum_s logp[b, s]|| of each row, one unsharded `jax.grad` per row (one program)."""
  params = policy.init_params(tl.model_config(), jax.random.PRNGKey(0))

  @jax.jit
  def row_norm(p, tokens, mask):
    def sequence_logp(q):
      logp, _ = policy.token_logprobs(q, tl.model_config(), tokens[None], mask[None])
      return jnp.sum(logp)

    grads = jax.grad(sequence_logp)(p)
    return jnp.sqrt(sum(jnp.sum(jnp.square(g.astype(jnp.float32))) for g in jax.tree.leaves(grads)))

  rows = zip(batch["tokens"], batch["loss_mask"] != 0, strict=True)
  return np.asarray([float(row_norm(params, jnp.asarray(t), jnp.asarray(m))) for t, m in rows])


@pytest.mark.parametrize(
  ("layout", "micro_batches"),
  [("single", 1), ("single", 4), ("data2", 2), ("data8", 1), ("fsdp8", 1), ("d2f2t2", 2)],
)
def test_score_norms_equal_one_gradient_per_row(layout, micro_batches):
  m, cfg, _, logprobs = tl.fns(layout, micro_batches=micro_batches)
  state = tl.init_state(m, cfg)
  batch = tl.make_batch(5)
  batch["loss_mask"][3] = 0.0  # a row without loss tokens has no score gradient
  inputs = train.shard_batch({k: batch[k] for k in ("tokens", "loss_mask")}, m)
  got = np.asarray(logprobs.score_norms(state, inputs))
  assert got.shape == (tl.BATCH,) and got.dtype == np.float32
  want = _direct_norms(batch)
  np.testing.assert_allclose(got, want, rtol=2e-4, atol=1e-6)
  assert got[3] == 0.0 and np.all(np.delete(got, 3) > 0)
  # The pure function traced inside another jit gives the same values.
  pure = jax.jit(logprobs.score_norms_fn)(state.params, inputs)
  np.testing.assert_allclose(np.asarray(pure), got, rtol=1e-5, atol=1e-7)


def test_score_norms_checks_the_batch():
  m, cfg, _, logprobs = tl.fns("data8")
  state = tl.init_state(m, cfg)
  batch = tl.make_batch(0)
  with pytest.raises(ValueError, match=r"Batch size 12 must be divisible by .* = 8"):
    logprobs.score_norms(state, {k: batch[k][:12] for k in ("tokens", "loss_mask")})
  with pytest.raises(ValueError, match="`batch` needs `tokens` and `loss_mask`"):
    logprobs.score_norms(state, {"tokens": batch["tokens"]})
