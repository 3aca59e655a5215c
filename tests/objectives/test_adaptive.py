"""Tests for the adaptive clipping helpers: BAPO bounds, M2PO mask, VCPO lr factor."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized

from rlx import objectives as obj


def _bapo_numpy(ratio, adv, mask, c_low=0.6, c_high=1.2, lmax=0.9, hmax=3.0, d=0.05, rho0=0.5):
  """Plain-Python BAPO loop counting gradient-carrying tokens only."""
  ratio, adv, mask = (np.asarray(x, np.float64) for x in (ratio, adv, mask))

  def share(lo, hi):
    p = np.sum(mask * (adv > 0) * (ratio <= hi) * ratio * adv)
    n = np.sum(mask * (adv < 0) * (ratio >= lo) * (ratio <= 3.0) * ratio * -adv)
    return 1.0 if p + n == 0 else p / (p + n)

  k_low = k_high = 0
  n_low = int(np.floor((lmax - c_low) / d + 1e-4))
  n_high = int(np.floor((hmax - c_high) / d + 1e-4))
  while share(c_low + k_low * d, c_high + k_high * d) < rho0 and (k_low < n_low or k_high < n_high):
    if k_low < n_low:
      k_low += 1
    else:
      k_high += 1
  lo, hi = min(c_low + k_low * d, lmax), min(c_high + k_high * d, hmax)
  return lo, hi, share(lo, hi)


class BapoTest(chex.TestCase):
  @chex.variants(with_jit=True, without_jit=True)
  def test_balanced_batch_keeps_initial_bounds(self):
    logp = jnp.zeros((2, 3))
    adv = jnp.array([[1.0, 1.0, 1.0], [-1.0, -1.0, 0.0]])
    b = self.variant(obj.bapo_clip_bounds)(logp, logp, adv, jnp.ones((2, 3)))
    np.testing.assert_allclose([b.c_low, b.c_high], [0.6, 1.2], rtol=1e-6)
    np.testing.assert_allclose(b.positive_share, 0.6, rtol=1e-6)

  @chex.variants(with_jit=True, without_jit=True)
  def test_raising_c_low_drops_negative_mass(self):
    # Negative tokens at r = 0.72 and 0.82 leave N once c_low passes them.
    ratio = np.array([[1.0, 0.72, 0.82, 1.0]], np.float32)
    adv = np.array([[1.0, -1.0, -1.0, -1.0]], np.float32)
    old = jnp.zeros((1, 4))
    b = self.variant(obj.bapo_clip_bounds)(jnp.log(ratio), old, adv, jnp.ones((1, 4)))
    # P = 1; N = 0.72 + 0.82 + 1: c_low 0.75 drops 0.72 (share 1/2.82), 0.85 drops 0.82.
    np.testing.assert_allclose(b.c_low, 0.85, rtol=1e-6)
    np.testing.assert_allclose(b.c_high, 1.2, rtol=1e-6)
    np.testing.assert_allclose(b.positive_share, 0.5, rtol=1e-6)

  @chex.variants(with_jit=True, without_jit=True)
  def test_raises_c_high_after_c_low_is_at_max(self):
    # P needs the positive token at r = 1.47 (clipped at 1.2, no gradient) to count.
    ratio = np.array([[1.47, 1.0, 1.0]], np.float32)
    adv = np.array([[1.0, -1.0, 0.5]], np.float32)
    b = self.variant(obj.bapo_clip_bounds)(jnp.log(ratio), jnp.zeros((1, 3)), adv, jnp.ones((1, 3)))
    np.testing.assert_allclose(b.c_low, 0.9, rtol=1e-6)
    np.testing.assert_allclose(b.c_high, 1.5, rtol=1e-5)
    np.testing.assert_allclose(b.positive_share, 1.97 / 2.97, rtol=1e-5)

  @chex.variants(with_jit=True, without_jit=True)
  def test_random_batches_match_reference_and_stay_within_max(self):
    rng = np.random.default_rng(0)
    fn = self.variant(obj.bapo_clip_bounds)
    for _ in range(6):
      ratio = np.exp(rng.normal(scale=0.5, size=(4, 8))).astype(np.float32)
      adv = rng.normal(loc=-0.4, size=(4, 8)).astype(np.float32)
      mask = (rng.random((4, 8)) < 0.8).astype(np.float32)
      b = fn(jnp.log(ratio), jnp.zeros((4, 8)), adv, mask)
      lo, hi, share = _bapo_numpy(ratio, adv, mask)
      np.testing.assert_allclose([b.c_low, b.c_high, b.positive_share], [lo, hi, share], 1e-5)
      assert 0.6 <= b.c_low <= 0.9 + 1e-6 and 1.2 <= b.c_high <= 3.0 + 1e-6
      assert b.positive_share >= 0.5 or (b.c_low >= 0.9 - 1e-6 and b.c_high >= 3.0 - 1e-6)

  def test_no_gradient_and_nan_padding(self):
    logp = jnp.array([[0.2, -0.4, jnp.nan]])
    adv = jnp.array([[1.0, -2.0, jnp.nan]])
    mask = jnp.array([[1, 1, 0]])

    def f(lp):
      b = obj.bapo_clip_bounds(lp, jnp.zeros((1, 3)), adv, mask)
      return b.c_low + b.c_high + b.positive_share

    value, grad = jax.value_and_grad(f)(logp)
    assert np.isfinite(value)
    np.testing.assert_array_equal(grad, 0.0)

  def test_errors(self):
    x = jnp.zeros((2, 3))
    with pytest.raises(ValueError, match="advantages"):
      obj.bapo_clip_bounds(x, x, jnp.zeros((3, 2)), x)
    with pytest.raises(ValueError, match="c_low"):
      obj.bapo_clip_bounds(x, x, x, x, c_low=0.95)
    with pytest.raises(ValueError, match="c_high"):
      obj.bapo_clip_bounds(x, x, x, x, c_high=3.5)
    with pytest.raises(ValueError, match="delta"):
      obj.bapo_clip_bounds(x, x, x, x, delta=0.0)
    with pytest.raises(ValueError, match="rho0"):
      obj.bapo_clip_bounds(x, x, x, x, rho0=1.5)


def _m2po_numpy(second, valid, tau):
  """Brute force: the fewest largest values to drop so the remaining mean <= tau."""
  values = np.sort(second[valid])[::-1]
  n = values.size
  for k in range(n + 1):
    rest = values[k:]
    if rest.size == 0 or rest.mean() <= tau:
      return k
  raise AssertionError


class M2poTest(chex.TestCase):
  @chex.variants(with_jit=True, without_jit=True)
  def test_hand_case(self):
    lr = jnp.array([[0.1, 0.5, -0.6, 0.0], [0.05, 0.0, 0.3, 9.0]])
    mask = jnp.array([[1, 1, 1, 1], [1, 1, 1, 0]])
    # Valid squares: .01 .25 .36 0 .0025 0 .09 (sum .7125, mean .102): drop .36
    # (mean .0589), then .25 (mean .0205 <= .04).
    got = self.variant(obj.m2po_mask)(jnp.zeros((2, 4)), -lr, mask)
    np.testing.assert_array_equal(got, [[1, 0, 0, 1], [1, 1, 1, 0]])
    assert got.dtype == mask.dtype

  @chex.variants(with_jit=True, without_jit=True)
  def test_random_against_brute_force(self):
    rng = np.random.default_rng(0)
    fn = self.variant(functools.partial(obj.m2po_mask, tau=0.04))
    for trial in range(8):
      scale = [0.05, 0.2, 0.5, 1.0][trial % 4]
      lr = rng.normal(scale=scale, size=(3, 10)).astype(np.float32)
      if trial % 2:
        lr = np.round(lr, 1)  # ties
      valid = rng.random((3, 10)) < 0.8
      got = np.asarray(fn(jnp.zeros((3, 10)), jnp.asarray(-lr), jnp.asarray(valid)))
      assert not np.any(got & ~valid)
      second = np.square(lr)
      k = _m2po_numpy(second, valid, 0.04)
      dropped = valid & ~got
      assert dropped.sum() == k
      kept = second[got]
      assert kept.size == 0 or kept.mean() <= 0.04 + 1e-6
      if k:  # the dropped tokens are the largest ones
        assert second[dropped].min() >= second[got].max(initial=0.0)

  @chex.variants(with_jit=True, without_jit=True)
  def test_within_bound_keeps_everything_and_nan_padding(self):
    old = jnp.array([[-1.0, -2.0, jnp.nan], [-0.5, jnp.inf, -1.0]])
    rollout = jnp.array([[-1.1, -2.1, -3.0], [-0.4, -1.0, jnp.nan]])
    mask = jnp.array([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    got = self.variant(obj.m2po_mask)(old, rollout, mask)
    np.testing.assert_array_equal(got, mask)

  def test_outlier_beyond_the_exp_clamp_counts_in_full(self):
    # 20000 matching tokens and one with log-ratio 30: the true second moment is
    # 900 / 20001 > 0.04, so the outlier is masked (clamped to 20 it would read
    # 400 / 20001 < 0.04 and stay).
    lr = jnp.zeros((1, 20001)).at[0, 7].set(30.0)
    got = jax.jit(obj.m2po_mask)(jnp.zeros((1, 20001)), -lr, jnp.ones((1, 20001)))
    np.testing.assert_array_equal(np.flatnonzero(np.asarray(got) == 0), [7])

  def test_tau_zero_drops_every_mismatched_token(self):
    lr = jnp.array([[0.0, 0.1, 0.0, -0.2]])
    got = obj.m2po_mask(jnp.zeros((1, 4)), lr, jnp.ones((1, 4), bool), tau=0.0)
    np.testing.assert_array_equal(got, [[True, False, True, False]])

  def test_no_gradient(self):
    f = lambda o, r: jnp.sum(obj.m2po_mask(o, r, jnp.ones((1, 3)), tau=0.01))
    g_old, g_rollout = jax.grad(f, argnums=(0, 1))(jnp.array([[0.0, 0.5, -0.1]]), jnp.zeros((1, 3)))
    np.testing.assert_array_equal(g_old, 0.0)
    np.testing.assert_array_equal(g_rollout, 0.0)

  def test_errors(self):
    x = jnp.zeros((2, 3))
    with pytest.raises(ValueError, match="rollout_logp"):
      obj.m2po_mask(x, jnp.zeros((2, 2)), x)
    with pytest.raises(ValueError, match="tau"):
      obj.m2po_mask(x, x, x, tau=-0.1)


class VcpoTest(chex.TestCase):
  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.named_parameters(
    ("hand", [1.0, 1.0, 2.0], 16.0 / 18.0),
    ("equal", [0.5, 0.5, 0.5, 0.5], 1.0),
    ("degenerate", [3.0, 0.0, 0.0, 0.0], 0.25),
    ("huge", [1e30, 1e30], 1.0),
  )
  def test_values(self, weights, want):
    rho, factor = self.variant(obj.vcpo_lr_factor)(jnp.array(weights))
    np.testing.assert_allclose(rho, want, rtol=1e-5)
    np.testing.assert_allclose(factor, np.sqrt(min(1.0, want)), rtol=1e-5)

  @chex.variants(with_jit=True, without_jit=True)
  def test_valid_mask_and_empty(self):
    fn = self.variant(obj.vcpo_lr_factor)
    rho, factor = fn(jnp.array([1.0, jnp.nan, 2.0, 1.0]), valid=jnp.array([1, 0, 1, 1]))
    np.testing.assert_allclose([rho, factor], [16.0 / 18.0, np.sqrt(16.0 / 18.0)], rtol=1e-5)
    rho, factor = fn(jnp.array([1.0, 2.0]), valid=jnp.array([False, False]))
    np.testing.assert_allclose([rho, factor], [1.0, 1.0])

  def test_errors(self):
    with pytest.raises(ValueError, match="seq_weights"):
      obj.vcpo_lr_factor(jnp.ones((2, 3)))
    with pytest.raises(ValueError, match="valid"):
      obj.vcpo_lr_factor(jnp.ones((3,)), valid=jnp.ones((2,)))
