"""Tests for rlx.objectives ratio helpers (token, cumulative, sequence, min-prefix)."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized
from jax import test_util as jtu

from rlx.objectives import (
  cumulative_log_ratio,
  min_prefix_log_ratio,
  sequence_log_ratio,
  token_log_ratio,
)

NAN = np.nan
# Token log-ratios of a 2 x 4 batch; row 0 has a masked span at index 2, row 1 is
# right-padded after two tokens. NaN sits in every masked position.
DELTA = np.array([[0.1, -0.3, NAN, 0.2], [0.5, -0.1, NAN, NAN]], np.float32)
MASK = np.array([[1, 1, 0, 1], [1, 1, 0, 0]], np.float32)
OLD = np.array([[-1.0, -2.0, NAN, -0.5], [-0.7, -1.2, NAN, NAN]], np.float32)
LOGP = OLD + DELTA


class RatiosTest(chex.TestCase):
  @chex.variants(with_jit=True, without_jit=True)
  def test_token_log_ratio_values_and_clamp(self):
    logp = jnp.array([[0.0, 50.0, -30.0, NAN]])
    old = jnp.array([[-0.5, 0.0, 0.0, 0.0]])
    mask = jnp.array([[1, 1, 1, 0]])
    out = self.variant(token_log_ratio)(logp, old, mask)
    np.testing.assert_allclose(out, [[0.5, 20.0, -20.0, 0.0]], rtol=1e-6)

  @chex.variants(with_jit=True, without_jit=True)
  def test_cumulative_skips_masked_span(self):
    out = self.variant(cumulative_log_ratio)(LOGP, OLD, MASK)
    # Row 0: 0.1, 0.1-0.3, (masked -> 0), -0.2+0.2 ; row 1: 0.5, 0.4, 0, 0.
    np.testing.assert_allclose(out, [[0.1, -0.2, 0.0, 0.0], [0.5, 0.4, 0.0, 0.0]], atol=1e-6)

  @chex.variants(with_jit=True, without_jit=True)
  def test_sequence_log_ratio_is_length_normalised_without_clamp(self):
    out = self.variant(sequence_log_ratio)(LOGP, OLD, MASK)
    np.testing.assert_allclose(out, [0.0 / 3, 0.4 / 2], atol=1e-6)
    # No per-token clamp: a 30-nat token moves the mean by 30 / n.
    big = self.variant(sequence_log_ratio)(
      jnp.array([[30.0, 0.0]]), jnp.zeros((1, 2)), jnp.ones((1, 2))
    )
    np.testing.assert_allclose(big, [15.0], rtol=1e-6)
    # A sequence without valid tokens gives 0.
    empty = self.variant(sequence_log_ratio)(jnp.ones((1, 3)), jnp.zeros((1, 3)), jnp.zeros((1, 3)))
    np.testing.assert_allclose(empty, [0.0])

  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.named_parameters(
    # Row 0 valid deltas 0.1, -0.3, (masked), 0.2; row 1: 0.5, -0.1.
    ("strict", False, [[0.0, 0.1, 0.0, -0.3], [0.0, 0.5, 0.0, 0.0]]),
    ("inclusive", True, [[0.1, -0.3, 0.0, -0.3], [0.5, -0.1, 0.0, 0.0]]),
  )
  def test_min_prefix(self, inclusive, expected):
    fn = self.variant(lambda a, b, m: min_prefix_log_ratio(a, b, m, inclusive=inclusive))
    np.testing.assert_allclose(fn(LOGP, OLD, MASK), expected, atol=1e-6)

  def test_min_prefix_ignores_masked_values(self):
    # A very small ratio at a masked position must not lower later minima.
    logp = jnp.array([[0.2, -15.0, 0.3]])
    out = min_prefix_log_ratio(logp, jnp.zeros((1, 3)), jnp.array([[1, 0, 1]]))
    np.testing.assert_allclose(out, [[0.0, 0.0, 0.2]], atol=1e-6)

  @parameterized.named_parameters(
    ("token", token_log_ratio),
    ("cumulative", cumulative_log_ratio),
    ("sequence", sequence_log_ratio),
    ("min_prefix", min_prefix_log_ratio),
  )
  def test_nan_padding_gives_finite_values_and_gradients(self, fn):
    out = fn(LOGP, OLD, MASK)
    self.assertTrue(np.all(np.isfinite(out)))
    # The same values as with zero padding (NaN never reaches a valid entry).
    np.testing.assert_array_equal(out, fn(np.nan_to_num(LOGP), np.nan_to_num(OLD), MASK))
    grad = jax.grad(lambda a, b: jnp.sum(fn(a, b, MASK)), argnums=(0, 1))(LOGP, OLD)
    for g in grad:
      self.assertTrue(np.all(np.isfinite(g)))
      np.testing.assert_array_equal(np.asarray(g)[MASK == 0], 0.0)

  @parameterized.named_parameters(
    ("token", token_log_ratio),
    ("cumulative", cumulative_log_ratio),
    ("sequence", sequence_log_ratio),
  )
  def test_check_grads(self, fn):
    rng = np.random.default_rng(0)
    old = jnp.asarray(-rng.uniform(0.5, 2.0, (2, 4)), jnp.float32)
    logp = old + jnp.asarray(rng.normal(0, 0.3, (2, 4)), jnp.float32)
    mask = jnp.array([[1, 1, 0, 1], [1, 1, 1, 0]])
    jtu.check_grads(lambda a, b: fn(a, b, mask), (logp, old), order=1, modes=["rev"], eps=1e-2)

  @parameterized.named_parameters(
    ("token", token_log_ratio),
    ("cumulative", cumulative_log_ratio),
    ("sequence", sequence_log_ratio),
    ("min_prefix", min_prefix_log_ratio),
  )
  def test_validation(self, fn):
    x = jnp.zeros((2, 3))
    with self.assertRaisesRegex(ValueError, "`logp` must have rank 2"):
      fn(jnp.zeros(3), jnp.zeros(3), jnp.ones(3))
    with self.assertRaisesRegex(ValueError, "`old_logp`"):
      fn(x, jnp.zeros((2, 4)), jnp.ones((2, 3)))
    with self.assertRaisesRegex(ValueError, "`mask`"):
      fn(x, x, jnp.ones((3, 2)))


if __name__ == "__main__":
  absltest.main()
