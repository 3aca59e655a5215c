"""VCPO's closed-form off-policy optimal baseline and its advantages, against hand values."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import absltest

from rlx.objectives import drgrpo_advantages, vcpo_advantages, vcpo_baseline

# One group of four: W_i = ||g_i||^2 w_i^2 = [1, 1, 4, 9].
REWARDS = np.array([[1.0, 0.0, 0.0, 1.0]], np.float32)
GRAD_NORMS = np.array([[1.0, 2.0, 1.0, 3.0]], np.float32)
WEIGHTS = np.array([[1.0, 0.5, 2.0, 1.0]], np.float32)


class VcpoBaselineTest(chex.TestCase):
  @chex.variants(with_jit=True, without_jit=True)
  def test_hand_values(self):
    b = self.variant(vcpo_baseline)(REWARDS, GRAD_NORMS, WEIGHTS)
    # (1 * 1 + 1 * 0 + 4 * 0 + 9 * 1) / (1 + 1 + 4 + 9 + 1e-8) = 10 / 15.
    np.testing.assert_allclose(b, [10 / 15], rtol=1e-6)
    adv = self.variant(vcpo_advantages)(REWARDS, GRAD_NORMS, WEIGHTS)
    # Population std of {1, 0, 0, 1} is 0.5: A = (R - 2/3) / 0.5.
    np.testing.assert_allclose(adv, [[2 / 3, -4 / 3, -4 / 3, 2 / 3]], rtol=1e-5)
    raw = vcpo_advantages(REWARDS, GRAD_NORMS, WEIGHTS, normalize_std=False)
    np.testing.assert_allclose(raw, [[1 / 3, -2 / 3, -2 / 3, 1 / 3]], rtol=1e-5)

  def test_groups_are_independent(self):
    rewards = np.array([[1.0, 0.0, 0.0, 1.0], [2.0, 4.0, 6.0, 8.0]], np.float32)
    norms = np.array([[1.0, 2.0, 1.0, 3.0], [1.0, 1.0, 1.0, 0.0]], np.float32)
    weights = np.array([[1.0, 0.5, 2.0, 1.0], [1.0, 2.0, 3.0, 5.0]], np.float32)
    # Group 1: W = [1, 4, 9, 0] -> b = (2 + 16 + 54) / 14.
    np.testing.assert_allclose(
      vcpo_baseline(rewards, norms, weights), [10 / 15, 72 / 14], rtol=1e-6
    )

  def test_equal_weights_give_the_group_mean(self):
    rng = np.random.default_rng(0)
    rewards = rng.normal(size=(3, 5)).astype(np.float32)
    ones = np.ones((3, 5), np.float32)
    np.testing.assert_allclose(
      vcpo_baseline(rewards, 2 * ones, 3 * ones), rewards.mean(axis=1), rtol=1e-5, atol=1e-6
    )
    np.testing.assert_allclose(
      vcpo_advantages(rewards, ones, ones, normalize_std=False),
      drgrpo_advantages(rewards),
      rtol=1e-5,
      atol=1e-6,
    )

  def test_minimises_the_weighted_second_moment(self):
    """The paper's property: b* minimises sum_i W_i (R_i - b)^2 over constant b."""
    rng = np.random.default_rng(1)
    rewards = rng.normal(size=(1, 8))
    norms = rng.uniform(0.1, 3.0, (1, 8))
    weights = rng.lognormal(0.0, 1.0, (1, 8))
    w2g2 = (norms * weights) ** 2

    def second_moment(b):
      return float(np.sum(w2g2 * (rewards - b) ** 2))

    b = float(vcpo_baseline(*(jnp.asarray(a, jnp.float32) for a in (rewards, norms, weights)))[0])
    grid = np.linspace(rewards.min(), rewards.max(), 401)
    best = grid[np.argmin([second_moment(g) for g in grid])]
    self.assertAlmostEqual(b, best, delta=(rewards.max() - rewards.min()) / 400)
    self.assertLess(second_moment(b), second_moment(rewards.mean()))

  def test_edge_cases(self):
    zeros = np.zeros((1, 4), np.float32)
    # Every W = 0: the baseline is 0 (0 / eps), advantages are R / sigma.
    np.testing.assert_allclose(vcpo_baseline(REWARDS, zeros, WEIGHTS), [0.0])
    np.testing.assert_allclose(vcpo_advantages(REWARDS, GRAD_NORMS, zeros), REWARDS / 0.5)
    # A constant group has std 0: no division, advantages are R - b = 0.
    same = np.full((1, 4), 0.7, np.float32)
    np.testing.assert_allclose(vcpo_advantages(same, GRAD_NORMS, WEIGHTS), 0.0, atol=1e-6)

  def test_non_finite_rewards_under_jit_are_left_out(self):
    rewards = np.array([[1.0, np.nan, 0.0, 1.0]], np.float32)
    b = jax.jit(vcpo_baseline)(rewards, GRAD_NORMS, WEIGHTS)
    # W = [1, -, 4, 9] over the finite members: (1 + 9) / 14.
    np.testing.assert_allclose(b, [10 / 14], rtol=1e-6)
    adv = jax.jit(vcpo_advantages)(rewards, GRAD_NORMS, WEIGHTS)
    self.assertTrue(np.isfinite(adv).all())
    self.assertEqual(float(adv[0, 1]), 0.0)

  def test_bad_inputs(self):
    with pytest.raises(ValueError, match="`rewards` must be finite: group 0"):
      vcpo_baseline(np.array([[1.0, np.inf]], np.float32), np.ones((1, 2)), np.ones((1, 2)))
    with pytest.raises(ValueError, match="`grad_norms` must have the shape of `rewards`"):
      vcpo_baseline(REWARDS, GRAD_NORMS[:, :2], WEIGHTS)
    with pytest.raises(ValueError, match=r"`seq_weights` must be finite and >= 0.*index \(0, 2\)"):
      vcpo_baseline(REWARDS, GRAD_NORMS, np.array([[1.0, 1.0, -1.0, 1.0]], np.float32))
    with pytest.raises(ValueError, match="`grad_norms` must be a floating array"):
      vcpo_baseline(REWARDS, np.ones((1, 4), np.int32), WEIGHTS)
    with pytest.raises(ValueError, match="`eps` must be >= 0"):
      vcpo_baseline(REWARDS, GRAD_NORMS, WEIGHTS, eps=-1.0)
    with pytest.raises(ValueError, match="`normalize_std` must be a bool"):
      vcpo_advantages(REWARDS, GRAD_NORMS, WEIGHTS, normalize_std="yes")


if __name__ == "__main__":
  absltest.main()
