"""Tests for group advantages (GRPO, Dr.GRPO, RLOO), MC-GRPO median baseline, broadcasting."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized

from rlx import objectives as obj


class GroupAdvantagesTest(chex.TestCase):
  @chex.variants(with_jit=True, without_jit=True)
  def test_grpo_hand_values(self):
    rewards = jnp.array([[1.0, 0.0, 0.0, 1.0], [2.0, 2.0, 2.0, 2.0], [0.0, 1.0, 2.0, 3.0]])
    got = self.variant(obj.grpo_advantages)(rewards)
    # Group 0: mean 0.5, unbiased std sqrt(1/3); group 2: mean 1.5, std sqrt(5/3).
    a0 = 0.5 / (np.sqrt(1.0 / 3.0) + 1e-6)
    s2 = np.sqrt(5.0 / 3.0) + 1e-6
    want = np.array(
      [[a0, -a0, -a0, a0], [0.0, 0.0, 0.0, 0.0], [-1.5 / s2, -0.5 / s2, 0.5 / s2, 1.5 / s2]]
    )
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert got.dtype == jnp.float32

  def test_grpo_equal_rewards_with_zero_eps_give_zero_not_nan(self):
    got = obj.grpo_advantages(jnp.array([[1.0, 1.0, 1.0], [0.0, 1.0, 2.0]]), eps=0.0)
    np.testing.assert_allclose(got, [[0.0, 0.0, 0.0], [-1.0, 0.0, 1.0]], rtol=1e-6)

  @chex.variants(with_jit=True, without_jit=True)
  def test_grpo_singleton_group_uses_mean0_std1(self):
    rewards = jnp.array([[3.0], [-1.0]])
    np.testing.assert_allclose(
      self.variant(obj.grpo_advantages)(rewards), [[3.0 / (1 + 1e-6)], [-1.0 / (1 + 1e-6)]]
    )
    np.testing.assert_allclose(self.variant(obj.drgrpo_advantages)(rewards), [[3.0], [-1.0]])
    np.testing.assert_allclose(self.variant(obj.rloo_advantages)(rewards), [[3.0], [-1.0]])

  @chex.variants(with_jit=True, without_jit=True)
  def test_drgrpo_and_rloo_hand_values(self):
    rewards = jnp.array([[1.0, 2.0, 3.0], [0.0, 0.0, 3.0]])
    np.testing.assert_allclose(
      self.variant(obj.drgrpo_advantages)(rewards), [[-1.0, 0.0, 1.0], [-1.0, -1.0, 2.0]]
    )
    drgrpo = self.variant(functools.partial(obj.grpo_advantages, normalize_std=False))
    np.testing.assert_allclose(drgrpo(rewards), [[-1.0, 0.0, 1.0], [-1.0, -1.0, 2.0]])
    # RLOO: s_i - mean of the others.
    np.testing.assert_allclose(
      self.variant(obj.rloo_advantages)(rewards), [[-1.5, 0.0, 1.5], [-1.5, -1.5, 3.0]]
    )

  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.named_parameters(
    ("grpo", obj.grpo_advantages),
    ("drgrpo", obj.drgrpo_advantages),
    ("rloo", obj.rloo_advantages),
  )
  def test_zero_mean_and_permutation_equivariance(self, fn):
    rng = np.random.default_rng(0)
    rewards = rng.normal(size=(5, 6)).astype(np.float32)
    f = self.variant(fn)
    adv = np.asarray(f(jnp.asarray(rewards)))
    np.testing.assert_allclose(adv.mean(axis=1), 0.0, atol=1e-5)
    within = rng.permutation(6)
    among = rng.permutation(5)
    np.testing.assert_allclose(f(jnp.asarray(rewards[:, within])), adv[:, within], atol=1e-5)
    np.testing.assert_allclose(f(jnp.asarray(rewards[among])), adv[among], atol=1e-5)

  def test_low_precision_input_computes_in_float32(self):
    rewards = jnp.array([[1.0, 0.0, 0.0, 1.0]], jnp.bfloat16)
    for fn in (obj.grpo_advantages, obj.drgrpo_advantages, obj.rloo_advantages):
      assert fn(rewards).dtype == jnp.float32

  def test_errors(self):
    for fn in (obj.grpo_advantages, obj.drgrpo_advantages, obj.rloo_advantages):
      with pytest.raises(ValueError, match="rewards"):
        fn(jnp.zeros((4,)))
      with pytest.raises(ValueError, match="rewards"):
        fn(jnp.zeros((2, 0)))
    with pytest.raises(ValueError, match="eps"):
      obj.grpo_advantages(jnp.zeros((2, 3)), eps=-1.0)


class BroadcastTest(chex.TestCase):
  @chex.variants(with_jit=True, without_jit=True)
  def test_broadcast_hand_values_and_nan_safety(self):
    values = jnp.array([2.0, -1.0, jnp.nan])
    mask = jnp.array([[1, 1, 0], [0, 1, 1], [0, 0, 0]])
    got = self.variant(obj.broadcast_to_tokens)(values, mask)
    np.testing.assert_array_equal(got, [[2.0, 2.0, 0.0], [0.0, -1.0, -1.0], [0.0, 0.0, 0.0]])
    assert got.dtype == jnp.float32

  def test_flattened_group_advantages(self):
    adv = obj.grpo_advantages(jnp.array([[1.0, 0.0], [0.0, 1.0]]))
    mask = jnp.ones((4, 3), bool)
    got = obj.broadcast_to_tokens(adv.reshape(-1), mask)
    np.testing.assert_allclose(got, np.repeat(np.asarray(adv).reshape(-1, 1), 3, axis=1))

  def test_errors(self):
    with pytest.raises(ValueError, match="seq_values"):
      obj.broadcast_to_tokens(jnp.zeros((2, 2)), jnp.ones((4, 3)))
    with pytest.raises(ValueError, match="seq_values"):
      obj.broadcast_to_tokens(jnp.zeros((3,)), jnp.ones((4, 3)))
    with pytest.raises(ValueError, match="mask"):
      obj.broadcast_to_tokens(jnp.zeros((4,)), jnp.ones((4,)))


class MedianAdvantagesTest(chex.TestCase):
  @chex.variants(with_jit=True, without_jit=True)
  def test_hand_values_each_scale(self):
    rewards = jnp.array([[0.0, 3.0, 1.0, 5.0, 2.0]])  # median 2 at index 4
    centered = np.array([[-2.0, 1.0, -1.0, 3.0, 0.0]])
    keep_want = np.array([[1.0, 1.0, 1.0, 1.0, 0.0]])

    adv, keep = self.variant(functools.partial(obj.median_advantages, scale="none"))(rewards)
    np.testing.assert_allclose(adv, centered)
    np.testing.assert_array_equal(keep, keep_want)

    # MAD = median(|[-2, 1, -1, 3, 0]|) = 1; reference eps 1e-3.
    adv, keep = self.variant(functools.partial(obj.median_advantages, scale="mad"))(rewards)
    np.testing.assert_allclose(adv, centered / (1.0 + 1e-3), rtol=1e-6)
    np.testing.assert_array_equal(keep, keep_want)

    std = np.std([0.0, 3.0, 1.0, 5.0, 2.0], ddof=1)
    adv, keep = self.variant(obj.median_advantages)(rewards)  # default "std"
    np.testing.assert_allclose(adv, centered / (std + 1e-6), rtol=1e-6)
    np.testing.assert_array_equal(keep, keep_want)
    assert adv.dtype == keep.dtype == jnp.float32

  @chex.variants(with_jit=True, without_jit=True)
  def test_one_pivot_per_group_and_ties(self):
    rewards = jnp.array(
      [
        [1.0, 0.0, 0.0, 1.0, 1.0],  # binary: median 1, three tied
        [1.0, 1.0, 1.0, 1.0, 1.0],  # all tied
        [0.0, 0.0, 0.0, 1.0, 0.0],
      ]
    )
    adv, keep = self.variant(obj.median_advantages)(rewards)
    adv, keep = np.asarray(adv), np.asarray(keep)
    # Exactly one pivot dropped per group: G + 1 = 5 -> G = 4 gradient-carrying.
    np.testing.assert_array_equal(keep.sum(axis=1), [4.0, 4.0, 4.0])
    # The pivot has the median reward; every rollout at the median has A = 0 and
    # the non-pivot ties keep mask 1.
    med = np.median(np.asarray(rewards), axis=1, keepdims=True)
    at_median = np.asarray(rewards) == med
    np.testing.assert_array_equal(adv[at_median], 0.0)
    assert np.all(at_median[keep == 0])
    assert np.all(adv[~at_median] != 0.0)
    # Stable sort: among ties the pivot is fixed by index order.
    np.testing.assert_array_equal(keep[0], [0.0, 1.0, 1.0, 1.0, 1.0])
    np.testing.assert_array_equal(keep[1], [1.0, 1.0, 0.0, 1.0, 1.0])
    np.testing.assert_array_equal(keep[2], [1.0, 1.0, 0.0, 1.0, 1.0])

  def test_binary_reward_mad_quirk(self):
    adv, _ = obj.median_advantages(jnp.array([[1.0, 0.0, 0.0, 1.0, 1.0]]), scale="mad")
    # MAD = 0, so the minority gets -(1 / 1e-3) = -1000; the majority 0.
    np.testing.assert_allclose(adv, [[0.0, -1000.0, -1000.0, 0.0, 0.0]], rtol=1e-5)
    adv, _ = obj.median_advantages(jnp.array([[1.0, 0.0, 0.0, 1.0, 1.0]]))
    assert np.max(np.abs(adv)) < 2.0  # "std" keeps binary advantages O(1)

  def test_random_groups_properties(self):
    rng = np.random.default_rng(1)
    rewards = rng.integers(0, 3, size=(16, 7)).astype(np.float32)  # many ties
    adv, keep = obj.median_advantages(jnp.asarray(rewards), scale="none")
    adv, keep = np.asarray(adv), np.asarray(keep)
    np.testing.assert_array_equal((keep == 0).sum(axis=1), 1)
    np.testing.assert_allclose(adv, rewards - np.median(rewards, axis=1, keepdims=True))
    pivot_rewards = rewards[keep == 0]
    np.testing.assert_array_equal(pivot_rewards, np.median(rewards, axis=1))

  def test_pivot_carries_no_gradient_in_a_loss(self):
    """G + 1 rollouts -> exactly G carry gradient once the keep-mask enters the loss mask."""

    @jax.jit
    def run(rewards, logp):
      adv, keep = obj.median_advantages(rewards)
      mask = jnp.ones((10, 4)) * keep.reshape(-1, 1)
      tokens_adv = obj.broadcast_to_tokens(adv.reshape(-1), mask)
      loss = lambda lp: obj.ppo_clip_loss(lp, jax.lax.stop_gradient(lp), tokens_adv, mask)[0]
      return keep, tokens_adv, jax.grad(loss)(logp)

    rewards = jnp.array([[1.0, 0.0, 0.0, 1.0, 1.0], [0.2, 0.9, 0.5, 0.1, 0.7]])
    logp = jnp.asarray(np.random.default_rng(0).normal(size=(10, 4)), jnp.float32)
    keep, tokens_adv, grad = run(rewards, logp)
    has_grad = np.asarray(jnp.any(grad != 0, axis=1)).reshape(2, 5)
    # Group 0: pivot index 0; its tied rollouts 3, 4 (A = 0) count in the
    # denominator but have no gradient. Group 1: pivot 2 (median 0.5).
    np.testing.assert_array_equal(has_grad, [[0, 1, 1, 0, 0], [1, 1, 0, 1, 1]])
    np.testing.assert_array_equal(np.asarray(keep), [[0, 1, 1, 1, 1], [1, 1, 0, 1, 1]])
    # Token-mean over the 8 x 4 kept tokens: d/dlp = -A / 32 on kept rows.
    np.testing.assert_allclose(grad, -np.asarray(tokens_adv) / 32.0, rtol=1e-6)

  def test_errors(self):
    with pytest.raises(ValueError, match="odd"):
      obj.median_advantages(jnp.zeros((2, 4)))
    with pytest.raises(ValueError, match="odd"):
      obj.median_advantages(jnp.zeros((2, 1)))
    with pytest.raises(ValueError, match="scale"):
      obj.median_advantages(jnp.zeros((2, 3)), scale="iqr")
    with pytest.raises(ValueError, match="rewards"):
      obj.median_advantages(jnp.zeros((3,)))
    with pytest.raises(ValueError, match="eps"):
      obj.median_advantages(jnp.zeros((2, 3)), eps=-1.0)
