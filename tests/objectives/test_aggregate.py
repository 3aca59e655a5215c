"""Tests for rlx.objectives.aggregate / aggregate_scale."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized
from jax import test_util as jtu

from rlx.objectives import AGG_MODES, aggregate, aggregate_scale

NAN = np.nan
# 3 x 4 batch: row 0 has 3 valid tokens, row 1 none, row 2 one.
VALUES = np.array([[1.0, 2.0, 3.0, NAN], [NAN, NAN, NAN, NAN], [4.0, NAN, NAN, NAN]], np.float32)
MASK = np.array([[1, 1, 1, 0], [0, 0, 0, 0], [1, 0, 0, 0]], np.float32)
# Hand-computed: token sums 6 and 4 (total 10), 4 valid tokens, 2 non-empty
# sequences, T = 4; per-sequence means 2 and 4. The empty row 1 is excluded
# from every sequence mean.
EXPECTED = {
  "token-mean": 10.0 / 4,
  "seq-mean-token-sum": (6.0 + 4.0) / 2,
  "seq-mean-token-mean": (2.0 + 4.0) / 2,
  # Mean over the 2 sequences of (token sum / T): (6 / 4 + 4 / 4) / 2.
  "seq-mean-token-sum-norm": (6.0 / 4 + 4.0 / 4) / 2,
}
EXPECTED_SCALE = {
  "token-mean": 4.0,
  "seq-mean-token-sum": 2.0,
  "seq-mean-token-mean": 2.0,
  "seq-mean-token-sum-norm": 2.0 * 4.0,
}
MODES = [(m, m) for m in AGG_MODES]


class AggregateTest(chex.TestCase):
  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.named_parameters(*MODES)
  def test_hand_values(self, mode):
    out = self.variant(lambda v, m: aggregate(v, m, mode))(VALUES, MASK)
    self.assertEqual(out.dtype, jnp.float32)
    np.testing.assert_allclose(out, EXPECTED[mode], rtol=1e-6)

  @parameterized.named_parameters(*MODES)
  def test_scale(self, mode):
    np.testing.assert_allclose(aggregate_scale(MASK, mode), EXPECTED_SCALE[mode])
    numerator = EXPECTED[mode] * EXPECTED_SCALE[mode]
    np.testing.assert_allclose(aggregate(VALUES, MASK, mode, scale=8.0), numerator / 8.0, 1e-6)
    # A traced scale works under jit.
    jitted = jax.jit(lambda v, m, s: aggregate(v, m, mode, scale=s))
    np.testing.assert_allclose(jitted(VALUES, MASK, jnp.float32(5.0)), numerator / 5.0, 1e-6)

  def test_seq_mean_token_sum_norm_custom_constant(self):
    # A constant other than the default |V| * T, e.g. TRL's B * T counting the empty row.
    out = aggregate(VALUES, MASK, "seq-mean-token-sum-norm", scale=3 * 4)
    np.testing.assert_allclose(out, 10.0 / 12, rtol=1e-6)

  def test_seq_mean_token_sum_norm_micro_batches_hand_values(self):
    # 4 sequences of T = 2: token sums 3, 0 (empty row), 5, -1 -> |V| = 3.
    values = np.array([[1.0, 2.0], [9.0, 9.0], [5.0, 7.0], [-1.0, 0.0]], np.float32)
    mask = np.array([[1, 1], [0, 0], [1, 0], [1, 0]], np.float32)
    want = (3.0 / 2 + 5.0 / 2 - 1.0 / 2) / 3
    np.testing.assert_allclose(aggregate(values, mask, "seq-mean-token-sum-norm"), want, 1e-6)
    scale = aggregate_scale(mask, "seq-mean-token-sum-norm")
    np.testing.assert_allclose(scale, 3 * 2)
    halves = [
      aggregate(values[i : i + 2], mask[i : i + 2], "seq-mean-token-sum-norm", scale=scale)
      for i in (0, 2)
    ]
    # First half holds sequence sums 3 and the empty row, second 5 and -1.
    np.testing.assert_allclose(halves, [3.0 / 6, 4.0 / 6], rtol=1e-6)
    np.testing.assert_allclose(sum(halves), want, rtol=1e-6)
    # Without the global scale each half would use its own |V|: 3/2/1 and 4/2/2.
    np.testing.assert_allclose(
      aggregate(values[:2], mask[:2], "seq-mean-token-sum-norm"), 3.0 / 2, rtol=1e-6
    )

  @parameterized.named_parameters(*MODES)
  def test_empty_mask_gives_zero(self, mode):
    out = aggregate(VALUES, np.zeros_like(MASK), mode)
    np.testing.assert_allclose(out, 0.0)
    self.assertTrue(
      np.isfinite(jax.grad(lambda v: aggregate(v, np.zeros_like(MASK), mode))(VALUES)).all()
    )

  @parameterized.named_parameters(*MODES)
  def test_micro_batches_with_global_scale_sum_to_full_batch(self, mode):
    rng = np.random.default_rng(1)
    values = rng.normal(size=(6, 5)).astype(np.float32)
    mask = (rng.uniform(size=(6, 5)) < 0.6).astype(np.float32)
    mask[3] = 0.0  # a sequence without valid tokens inside one micro-batch
    values[mask == 0] = np.nan

    def full(v):
      return aggregate(v, mask, mode)

    scale = aggregate_scale(mask, mode)

    def micro(v):
      return sum(aggregate(v[i : i + 2], mask[i : i + 2], mode, scale=scale) for i in (0, 2, 4))

    np.testing.assert_allclose(micro(values), full(values), rtol=1e-5)
    g_full, g_micro = jax.grad(full)(values), jax.grad(micro)(values)
    self.assertTrue(np.isfinite(g_full).all())
    np.testing.assert_allclose(g_micro, g_full, rtol=1e-5, atol=1e-7)

  @parameterized.named_parameters(*MODES)
  def test_nan_padding_does_not_reach_gradient(self, mode):
    values = np.where(MASK == 0, np.inf, VALUES).astype(np.float32)
    grad = jax.grad(lambda v: aggregate(v, MASK, mode))(values)
    self.assertTrue(np.isfinite(grad).all())
    np.testing.assert_array_equal(grad[MASK == 0], 0.0)

  @parameterized.named_parameters(*MODES)
  def test_check_grads(self, mode):
    values = jnp.asarray(np.nan_to_num(VALUES), jnp.float32)
    jtu.check_grads(lambda v: aggregate(v, MASK, mode), (values,), order=2, eps=1e-2)

  def test_bool_mask_and_bf16_values(self):
    out = aggregate(
      jnp.asarray(np.nan_to_num(VALUES), jnp.bfloat16), MASK.astype(bool), "token-mean"
    )
    self.assertEqual(out.dtype, jnp.float32)
    np.testing.assert_allclose(out, 2.5, rtol=1e-6)

  def test_validation(self):
    with self.assertRaisesRegex(ValueError, "`mode` must be one of"):
      aggregate(VALUES, MASK, "mean")
    with self.assertRaisesRegex(ValueError, "`mode` must be one of"):
      aggregate_scale(MASK, "sum")
    with self.assertRaisesRegex(ValueError, "`values` must have rank 2"):
      aggregate(VALUES[0], MASK[0], "token-mean")
    with self.assertRaisesRegex(ValueError, "`mask` must have the shape of `values`"):
      aggregate(VALUES, MASK[:, :3], "token-mean")
    with self.assertRaisesRegex(ValueError, "`scale` must have rank 0"):
      aggregate(VALUES, MASK, "token-mean", scale=jnp.ones(2))
    with self.assertRaisesRegex(ValueError, "`scale` must be >= 0"):
      aggregate(VALUES, MASK, "token-mean", scale=-1.0)
    with self.assertRaisesRegex(ValueError, "`mask` must have rank 2"):
      aggregate_scale(MASK[0], "token-mean")


if __name__ == "__main__":
  absltest.main()
