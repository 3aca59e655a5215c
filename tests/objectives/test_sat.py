"""SAT's staleness-adaptive radii, the SAT loss, and per-token clip bounds in PPO / GSPO.

Expected radii follow the paper's equations by hand: q is the ceil(0.9 n)-th
smallest |d|, psi(u) = 1 / (1 + (u / q)^2), only gated tokens (|d| > q > 0)
shrink, and only on the side of sign(d).
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest

from rlx.objectives import (
  gspo_loss,
  ppo_clip_loss,
  sat_clip_bounds,
  sat_loss,
  sequence_log_ratio,
  token_log_ratio,
)

NAN = np.nan


def hill(u, q):
  return 1.0 / (1.0 + (u / q) ** 2)


def outlier_batch(big_advantages):
  """Two rows of 10 tokens: 9 at log-ratio 0.01 (A = 1) and one outlier each.

  Row 0's last token has ratio 1.15, row 1's ratio 0.87; `big_advantages` are
  their advantages. 18 of 20 |d| are 0.01, so q = 0.01 and only the outliers gate.
  """
  d = np.full((2, 10), 0.01)
  d[0, 9], d[1, 9] = np.log(1.15), np.log(0.87)
  old = np.full((2, 10), -1.0, np.float32)
  logp = (old + d).astype(np.float32)
  adv = np.ones((2, 10), np.float32)
  adv[0, 9], adv[1, 9] = big_advantages
  return logp, old, adv, np.ones((2, 10), np.float32)


class SatClipBoundsTest(chex.TestCase):
  @chex.variants(with_jit=True, without_jit=True)
  def test_hand_values(self):
    d = np.array([[0.0, 0.1, -0.1, 0.2, -0.2, NAN], [0.3, -0.3, 0.4, 0.5, -0.8, NAN]], np.float32)
    mask = np.array([[1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 0]], np.float32)
    b = self.variant(lambda x, m: sat_clip_bounds(x, m, clip_low=0.2, clip_high=0.3))(d, mask)
    # Sorted |d| over the 10 valid tokens: 0, .1, .1, .2, .2, .3, .3, .4, .5, .8;
    # ceil(0.9 * 10) = 9th smallest: q = 0.5. Only -0.8 is strictly above it.
    np.testing.assert_allclose(b.threshold, 0.5, rtol=1e-6)
    np.testing.assert_allclose(b.gate_rate, 0.1, rtol=1e-6)
    low = np.full((2, 6), 0.2)
    low[1, 4] = 0.2 * hill(0.8, 0.5)  # d < 0: only the lower radius shrinks
    np.testing.assert_allclose(b.clip_low, low, rtol=1e-6)
    np.testing.assert_allclose(b.clip_high, np.full((2, 6), 0.3), rtol=1e-6)
    # The same with a positive outlier: only the upper radius shrinks.
    b = sat_clip_bounds(-d, mask, clip_low=0.2, clip_high=0.3)
    high = np.full((2, 6), 0.3)
    high[1, 4] = 0.3 * hill(0.8, 0.5)
    np.testing.assert_allclose(b.clip_high, high, rtol=1e-6)
    np.testing.assert_allclose(b.clip_low, np.full((2, 6), 0.2), rtol=1e-6)

  def test_quantile_level_and_kernel_power(self):
    d = np.array([[0.1, 0.2, 0.3, 0.4]], np.float32)
    mask = np.ones((1, 4), np.float32)
    # quantile 0.5: ceil(2) = 2nd smallest = 0.2; 0.3 and 0.4 gate; p = 1.
    b = sat_clip_bounds(d, mask, clip_high=0.2, quantile=0.5, kernel_power=1.0)
    np.testing.assert_allclose(b.threshold, 0.2, rtol=1e-6)
    want = 0.2 / (1.0 + np.array([0.1, 0.2, 0.3, 0.4]) / 0.2)
    want[:2] = 0.2
    np.testing.assert_allclose(b.clip_high[0], want, rtol=1e-6)
    np.testing.assert_allclose(b.gate_rate, 0.5)
    # quantile 1: q is the largest |d|, nothing is strictly above it.
    b = sat_clip_bounds(d, mask, quantile=1.0)
    np.testing.assert_allclose(b.threshold, 0.4, rtol=1e-6)
    np.testing.assert_allclose(b.gate_rate, 0.0)

  def test_ties_and_zero_reference_do_not_gate(self):
    mask = np.ones((1, 10), np.float32)
    # Every |d| equal: q equals them and the gate |d| > q is strict.
    b = sat_clip_bounds(np.full((1, 10), 0.3, np.float32), mask)
    np.testing.assert_allclose(b.gate_rate, 0.0)
    np.testing.assert_allclose(b.clip_high, 0.2)
    # Nine zeros: q = 0, so the q > 0 branch keeps the large token at its radius.
    d = np.zeros((1, 10), np.float32)
    d[0, 3] = 1.0
    b = sat_clip_bounds(d, mask)
    np.testing.assert_allclose(b.threshold, 0.0)
    np.testing.assert_allclose(b.clip_high, 0.2)
    # No valid token at all.
    b = sat_clip_bounds(d, np.zeros((1, 10), np.float32))
    np.testing.assert_allclose([b.threshold, b.gate_rate], [0.0, 0.0])

  def test_radii_stay_inside_ppo_interval(self):
    """Proposition 4.1 (i): 0 < c <= 1, so both radii shrink or stay, never grow."""
    rng = np.random.default_rng(0)
    d = rng.standard_t(2, size=(8, 50)).astype(np.float32)
    mask = (rng.random((8, 50)) < 0.8).astype(np.float32)
    b = sat_clip_bounds(d, mask, clip_low=0.2, clip_high=0.28)
    low, high = np.asarray(b.clip_low), np.asarray(b.clip_high)
    self.assertTrue(((low > 0) & (low <= 0.2)).all() and ((high > 0) & (high <= 0.28)).all())
    # A gated token moves exactly one endpoint, the one of sign(d).
    moved_low, moved_high = low < 0.2, high < np.float32(0.28)
    self.assertFalse((moved_low & moved_high).any())
    self.assertTrue((d[moved_low] < 0).all() and (d[moved_high] > 0).all())
    self.assertLessEqual(float(b.gate_rate), 0.1 + 1e-6)

  def test_bad_arguments(self):
    d, m = jnp.zeros((2, 3)), jnp.ones((2, 3))
    for kwargs, match in [
      (dict(quantile=0.0), "`quantile` must be in \\(0.0, 1.0\\]"),
      (dict(quantile=1.5), "`quantile`"),
      (dict(kernel_power=0.0), "`kernel_power` must be > 0"),
      (dict(kernel_power=np.inf), "`kernel_power` must be finite"),
      (dict(clip_low=1.0), "`clip_low` must be in"),
      (dict(clip_high=jnp.ones((2, 3))), "`clip_high` must be a scalar"),
    ]:
      with self.assertRaisesRegex(ValueError, match):
        sat_clip_bounds(d, m, **kwargs)
    with self.assertRaisesRegex(ValueError, "`log_ratio` must be a floating array"):
      sat_clip_bounds(jnp.zeros((2, 3), jnp.int32), m)
    with self.assertRaisesRegex(ValueError, "`mask` must have the shape of `log_ratio`"):
      sat_clip_bounds(d, m[:, :2])


class SatLossTest(chex.TestCase):
  @chex.variants(with_jit=True, without_jit=True)
  def test_newly_clipped_outward_bands(self):
    """Prop. 4.1 (iii): SAT zeroes the gradient where PPO keeps its outward derivative."""
    # Row 0: r = 1.15, A = +1 (outward above 1); row 1: r = 0.87, A = -1 (outward below).
    logp, old, adv, mask = outlier_batch((1.0, -1.0))
    fn = self.variant(jax.value_and_grad(lambda x: sat_loss(x, old, adv, mask)[0]))
    loss, grad = fn(logp)
    c_plus = hill(np.log(1.15), 0.01)
    c_minus = hill(-np.log(0.87), 0.01)
    r_small = np.exp(0.01)
    # Ordinary tokens: -A r (inside every window). Outliers: clipped at SAT's endpoint.
    want = (18 * -r_small - (1.0 + 0.2 * c_plus) + (1.0 - 0.2 * c_minus)) / 20
    np.testing.assert_allclose(loss, want, rtol=1e-5)
    expected = np.full((2, 10), -r_small / 20)
    expected[:, 9] = 0.0
    np.testing.assert_allclose(grad, expected, rtol=1e-5, atol=1e-8)
    # PPO's window [0.8, 1.2] holds both outliers: their gradient flows there.
    ppo_grad = jax.grad(lambda x: ppo_clip_loss(x, old, adv, mask)[0])(logp)
    np.testing.assert_allclose(ppo_grad[:, 9], [-1.15 / 20, 0.87 / 20], rtol=1e-5)
    _, metrics = sat_loss(logp, old, adv, mask)
    np.testing.assert_allclose([metrics.clip_frac_high, metrics.clip_frac_low], [0.05, 0.05])

  @chex.variants(with_jit=True, without_jit=True)
  def test_pull_back_updates_keep_their_gradient(self):
    # Same ratios, advantages flipped: moving r back towards 1 is never clipped.
    logp, old, adv, mask = outlier_batch((-1.0, 1.0))
    sat = self.variant(jax.value_and_grad(lambda x: sat_loss(x, old, adv, mask)[0]))(logp)
    ppo = jax.value_and_grad(lambda x: ppo_clip_loss(x, old, adv, mask)[0])(logp)
    np.testing.assert_allclose(sat[0], ppo[0], rtol=1e-6)
    np.testing.assert_allclose(sat[1], ppo[1], rtol=1e-6)
    np.testing.assert_allclose(sat[1][:, 9], [1.15 / 20, -0.87 / 20], rtol=1e-5)

  def test_pointwise_pessimism_and_equivalence_with_ppo_per_token_bounds(self):
    rng = np.random.default_rng(1)
    old = -rng.uniform(0.1, 3.0, (6, 20)).astype(np.float32)
    logp = (old + 0.3 * rng.standard_t(3, size=(6, 20))).astype(np.float32)
    adv = rng.normal(size=(6, 20)).astype(np.float32)
    mask = (rng.random((6, 20)) < 0.9).astype(np.float32)
    loss, metrics = sat_loss(logp, old, adv, mask)
    # SAT = PPO with the per-token radii of sat_clip_bounds on the same log-ratio.
    b = sat_clip_bounds(token_log_ratio(logp, old, mask), mask)
    composed, composed_metrics = ppo_clip_loss(
      logp, old, adv, mask, clip_low=b.clip_low, clip_high=b.clip_high
    )
    np.testing.assert_allclose(loss, composed, rtol=1e-6)
    np.testing.assert_allclose(metrics.clip_frac_low, composed_metrics.clip_frac_low)
    self.assertGreater(float(b.gate_rate), 0.0)
    # Prop. 4.1 (ii): S_SAT <= S_PPO per token (NumPy, from the radii), so the
    # loss is at least PPO's.
    valid = mask > 0
    r = np.exp(np.clip(logp - old, -20, 20))[valid]
    a = adv[valid]
    lo, hi = np.asarray(b.clip_low)[valid], np.asarray(b.clip_high)[valid]
    per_sat = np.maximum(-a * r, -a * np.clip(r, 1 - lo, 1 + hi))
    per_ppo = np.maximum(-a * r, -a * np.clip(r, 0.8, 1.2))
    self.assertTrue((per_sat >= per_ppo - 1e-7).all())
    self.assertTrue((per_sat > per_ppo + 1e-6).any())
    np.testing.assert_allclose(loss, per_sat.mean(), rtol=1e-5)
    ppo, _ = ppo_clip_loss(logp, old, adv, mask)
    self.assertGreaterEqual(float(loss), float(ppo))

  def test_on_policy_is_ppo(self):
    rng = np.random.default_rng(2)
    old = -rng.uniform(0.1, 3.0, (3, 5)).astype(np.float32)
    adv = rng.normal(size=(3, 5)).astype(np.float32)
    mask = np.ones((3, 5), np.float32)
    grad_sat = jax.grad(lambda x: sat_loss(x, old, adv, mask)[0])(old)
    grad_ppo = jax.grad(lambda x: ppo_clip_loss(x, old, adv, mask)[0])(old)
    np.testing.assert_allclose(grad_sat, grad_ppo, rtol=1e-6)
    np.testing.assert_allclose(grad_sat, -adv / 15, rtol=1e-5)

  def test_threshold_is_the_quantile_of_the_batch_passed_in(self):
    # Row 1 alone has q = |d| of its own tokens (all equal: nothing gates);
    # together with row 0's near-zero tokens its tokens are the tail and shrink.
    d = np.array([[0.01] * 9, [0.15] * 9], np.float32)
    old = np.full((2, 9), -1.0, np.float32)
    logp = old + d
    adv = np.ones((2, 9), np.float32)
    mask = np.ones((2, 9), np.float32)
    alone, _ = sat_loss(logp[1:], old[1:], adv[1:], mask[1:])
    np.testing.assert_allclose(alone, -np.exp(0.15), rtol=1e-6)
    together, _ = sat_loss(logp, old, adv, mask)
    # 18 tokens, ceil(16.2) = 17th smallest |d| = 0.15: ties, nothing gates.
    np.testing.assert_allclose(together, (-9 * np.exp(0.01) - 9 * np.exp(0.15)) / 18, rtol=1e-6)
    # With quantile 0.5 the reference is 0.01 and row 1 is the tail.
    half, _ = sat_loss(logp, old, adv, mask, quantile=0.5)
    capped = 1.0 + 0.2 * hill(0.15, 0.01)
    np.testing.assert_allclose(half, (-9 * np.exp(0.01) - 9 * capped) / 18, rtol=1e-5)

  def test_bad_hyper_parameters(self):
    x, m = jnp.zeros((2, 3)), jnp.ones((2, 3))
    for kwargs, match in [
      (dict(quantile=0.0), "`quantile`"),
      (dict(kernel_power=-1.0), "`kernel_power`"),
      (dict(clip_low=1.0), "`clip_low` must be in"),
      (dict(dual_clip=1.0), "`dual_clip` must be > 1"),
    ]:
      with self.assertRaisesRegex(ValueError, match):
        sat_loss(x, x, x, m, **kwargs)


class PerTokenClipBoundsTest(chex.TestCase):
  @chex.variants(with_jit=True, without_jit=True)
  def test_ppo_hand_values(self):
    # Ratios 1.3 (A = 1), 0.7 (A = -1), 1.3 (A = 1), one padded token.
    old = np.full((2, 2), -1.0, np.float32)
    logp = (old + np.log([[1.3, 0.7], [1.3, 1.0]])).astype(np.float32)
    adv = np.array([[1.0, -1.0], [1.0, NAN]], np.float32)
    mask = np.array([[1, 1], [1, 0]], np.float32)
    low = np.array([[0.2, 0.4], [0.2, NAN]], np.float32)  # token 1: window down to 0.6
    high = np.array([[0.5, 0.2], [0.1, NAN]], np.float32)  # token 2: capped at 1.1
    fn = lambda x: ppo_clip_loss(x, old, adv, mask, clip_low=low, clip_high=high)[0]
    loss, grad = self.variant(jax.value_and_grad(fn))(logp)
    # -1.3 (inside [0.8, 1.5]), 0.7 (inside [0.6, 1.2]), -1.1 (clipped at 1.1).
    np.testing.assert_allclose(loss, (-1.3 + 0.7 - 1.1) / 3, rtol=1e-5)
    np.testing.assert_allclose(grad, [[-1.3 / 3, 0.7 / 3], [0.0, 0.0]], rtol=1e-5, atol=1e-8)

  def test_constant_arrays_equal_scalars(self):
    rng = np.random.default_rng(3)
    old = -rng.uniform(0.1, 3.0, (4, 6)).astype(np.float32)
    logp = (old + 0.4 * rng.normal(size=(4, 6))).astype(np.float32)
    adv = rng.normal(size=(4, 6)).astype(np.float32)
    mask = (rng.random((4, 6)) < 0.8).astype(np.float32)
    ones = np.ones((4, 6), np.float32)
    for fn, lo, hi in ((ppo_clip_loss, 0.2, 0.28), (gspo_loss, 3e-4, 4e-4)):
      scalar = jax.value_and_grad(
        lambda x, f=fn, a=lo, b=hi: f(x, old, adv, mask, clip_low=a, clip_high=b)[0]
      )(logp)
      arrays = jax.value_and_grad(
        lambda x, f=fn, a=lo, b=hi: f(x, old, adv, mask, clip_low=a * ones, clip_high=b * ones)[0]
      )(logp)
      np.testing.assert_allclose(arrays[0], scalar[0], rtol=1e-6)
      np.testing.assert_allclose(arrays[1], scalar[1], rtol=1e-6, atol=1e-9)

  def test_sat_gspo_composition(self):
    # SAT-GSPO (the paper's Eq. 20): SAT radii from the sequence log-ratio broadcast
    # over each sequence's tokens. 9 sequences at ratio e^0.001, one at e^0.01 (A > 0).
    seq = np.full(10, 0.001)
    seq[9] = 0.01
    old = np.full((10, 2), -1.0, np.float32)
    logp = (old + seq[:, None]).astype(np.float32)
    adv = np.ones((10, 2), np.float32)
    mask = np.ones((10, 2), np.float32)
    s = np.asarray(sequence_log_ratio(logp, old, mask))
    b = sat_clip_bounds(np.repeat(s[:, None], 2, axis=1), mask, clip_low=0.02, clip_high=0.02)
    # q = 0.001 (the 18th smallest of 20 broadcast scores): row 9 is capped at 1 + 0.02 c.
    cap = 1.0 + 0.02 * hill(0.01, 0.001)
    np.testing.assert_allclose(b.clip_high[9], cap - 1.0, rtol=1e-4)
    loss, _ = gspo_loss(logp, old, adv, mask, clip_low=b.clip_low, clip_high=b.clip_high)
    np.testing.assert_allclose(loss, (-9 * np.exp(0.001) - cap) / 10, rtol=1e-5)

  def test_shape_dtype_and_range_errors(self):
    x, m = jnp.zeros((2, 3)), jnp.ones((2, 3))
    with self.assertRaisesRegex(
      ValueError, r"`clip_low` must be a scalar \(rank 0\), got shape \(3,\); .*`logp` \(2, 3\)"
    ):
      ppo_clip_loss(x, x, x, m, clip_low=jnp.full((3,), 0.2))
    with self.assertRaisesRegex(ValueError, r"`clip_high` must be a scalar .*got shape \(3, 2\)"):
      gspo_loss(x, x, x, m, clip_high=jnp.full((3, 2), 0.2))
    with self.assertRaisesRegex(ValueError, "`clip_high` must be a floating array"):
      ppo_clip_loss(x, x, x, m, clip_high=jnp.ones((2, 3), jnp.int32))
    bad = np.full((2, 3), 0.2, np.float32)
    bad[1, 2] = 1.0
    with self.assertRaisesRegex(
      ValueError,
      r"`clip_low` must be in \[0.0, 1.0\) at every valid token, got 1.0 at index \(1, 2\)",
    ):
      ppo_clip_loss(x, x, x, m, clip_low=bad)
    with self.assertRaisesRegex(ValueError, r"`clip_high` must be >= 0.0 at every valid token"):
      ppo_clip_loss(x, x, x, m, clip_high=-np.ones((2, 3), np.float32))
    # Traced per-token bounds pass unchecked (e.g. computed inside a jitted step).
    f = jax.jit(lambda c: ppo_clip_loss(x, x, x, m, clip_low=c)[0])
    np.testing.assert_allclose(f(jnp.full((2, 3), 1.5)), 0.0)

  def test_bounds_get_no_gradient(self):
    old = np.full((1, 2), -1.0, np.float32)
    logp = (old + np.log([[1.3, 0.9]])).astype(np.float32)
    adv, mask = np.ones((1, 2), np.float32), np.ones((1, 2), np.float32)
    grad = jax.grad(lambda c: ppo_clip_loss(logp, old, adv, mask, clip_low=c, clip_high=c)[0])(
      jnp.full((1, 2), 0.2)
    )
    np.testing.assert_array_equal(grad, 0.0)


if __name__ == "__main__":
  absltest.main()
