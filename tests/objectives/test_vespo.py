"""VESPO: hand-computed loss and gradients, and the properties its reference code relies on.

Expected values use the kernel in its product form `phi(w) = w^k exp(lam (1 - w))`,
computed with NumPy from chosen token ratios, not the log-space code path.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest

from rlx.objectives import vespo_loss

NAN = np.nan


def from_log_ratios(log_ratios, old_logp=-1.0):
  """(logp, old_logp) float32 with logp - old_logp = log_ratios; NaN stays NaN (padding)."""
  d = np.asarray(log_ratios, np.float64)
  old = np.where(np.isnan(d), NAN, old_logp)
  return (old + d).astype(np.float32), old.astype(np.float32)


def phi(w, k, lam):
  return w**k * np.exp(lam * (1.0 - w))


def value_and_grad(test, fn, logp):
  (loss, metrics), grad = test.variant(jax.value_and_grad(fn, has_aux=True))(jnp.asarray(logp))
  return loss, metrics, grad


class VespoTest(chex.TestCase):
  @chex.variants(with_jit=True, without_jit=True)
  def test_hand_values_both_kernels(self):
    # Row 0: ratios 1.2, 0.9 (third token padded), A = +1 -> w = 1.08, (k, lam) = (2, 3).
    # Row 1: ratios 0.5, 0.8, 1.5, A = -1 -> w = 0.6, (k, lam) = (3, 2).
    lp, olp = from_log_ratios([np.log([1.2, 0.9, NAN]), np.log([0.5, 0.8, 1.5])])
    adv = np.array([[1.0, 1.0, NAN], [-1.0, -1.0, -1.0]], np.float32)
    mask = np.array([[1, 1, 0], [1, 1, 1]], np.float32)
    phi0, phi1 = phi(1.08, 2.0, 3.0), phi(0.6, 3.0, 2.0)
    loss, metrics, grad = value_and_grad(self, lambda x: vespo_loss(x, olp, adv, mask), lp)
    per_token = [-phi0 * lp[0, :2], phi1 * lp[1]]
    np.testing.assert_allclose(loss, np.concatenate(per_token).sum() / 5, rtol=1e-5)
    # d L / d lp_it = -phi_i A_it / 5 (phi detached: REINFORCE-style).
    np.testing.assert_allclose(
      grad, [[-phi0 / 5, -phi0 / 5, 0.0], [phi1 / 5] * 3], rtol=1e-5, atol=1e-8
    )
    # ratio metrics read the sequence ratio, broadcast over each sequence's tokens.
    np.testing.assert_allclose(metrics.ratio_mean, (2 * 1.08 + 3 * 0.6) / 5, rtol=1e-5)
    np.testing.assert_allclose(metrics.ratio_max, 1.08, rtol=1e-5)
    kl = -np.log([1.2, 0.9, 0.5, 0.8, 1.5]).sum() / 5
    np.testing.assert_allclose(metrics.approx_kl, kl, rtol=1e-4)
    for frac in (metrics.clip_frac_low, metrics.clip_frac_high, metrics.clip_frac_dual):
      np.testing.assert_allclose(frac, 0.0)

  @chex.variants(with_jit=True, without_jit=True)
  def test_phi_of_one_is_one_so_on_policy_is_reinforce(self):
    rng = np.random.default_rng(0)
    olp = -rng.uniform(0.1, 2.0, (3, 4)).astype(np.float32)
    adv = rng.normal(size=(3, 4)).astype(np.float32)
    mask = np.ones((3, 4), np.float32)
    for hyper in ({}, dict(k_pos=0.5, lambda_pos=7.0, k_neg=5.0, lambda_neg=0.3)):
      _, _, grad = value_and_grad(self, lambda x, h=hyper: vespo_loss(x, olp, adv, mask, **h), olp)
      np.testing.assert_allclose(grad, -adv / 12, rtol=1e-5, atol=1e-8)

  @chex.variants(with_jit=True, without_jit=True)
  def test_true_sequence_ratio_without_length_normalisation(self):
    # Four tokens of ratio 1.1: w = 1.1^4 (GSPO's geometric mean would be 1.1).
    lp, olp = from_log_ratios([[np.log(1.1)] * 4])
    adv, mask = np.ones((1, 4), np.float32), np.ones((1, 4), np.float32)
    _, metrics, grad = value_and_grad(self, lambda x: vespo_loss(x, olp, adv, mask), lp)
    np.testing.assert_allclose(metrics.ratio_max, 1.1**4, rtol=1e-5)
    np.testing.assert_allclose(grad, np.full((1, 4), -phi(1.1**4, 2.0, 3.0) / 4), rtol=1e-5)

  @chex.variants(with_jit=True, without_jit=True)
  def test_token_and_sequence_clamps_and_weight_floor(self):
    # Row 0: token log-ratios 30 and -25 clamp to +20 and -20: s = 0, phi = 1.
    # Row 1: -15 and -15 sum to -30, clamped to -20; w = e^-20 < 1e-8, so the
    # kernel's log w is floored at log 1e-8 (A < 0: k = 3, lam = 2).
    lp, olp = from_log_ratios([[30.0, -25.0], [-15.0, -15.0]])
    adv = np.array([[1.0, 1.0], [-1.0, -1.0]], np.float32)
    mask = np.ones((2, 2), np.float32)
    _, metrics, grad = value_and_grad(self, lambda x: vespo_loss(x, olp, adv, mask), lp)
    tiny = np.exp(2.0 + 3.0 * np.log(1e-8) - 2.0 * np.exp(-20.0))
    np.testing.assert_allclose(grad[0], [-1 / 4, -1 / 4], rtol=1e-5)
    np.testing.assert_allclose(grad[1], [tiny / 4, tiny / 4], rtol=1e-4)
    np.testing.assert_allclose(metrics.ratio_mean, (2 * 1.0 + 2 * np.exp(-20.0)) / 4, rtol=1e-5)

  @chex.variants(with_jit=True, without_jit=True)
  def test_is_weights_join_the_ratio_in_log_space(self):
    # Row 0: token ratios 1.2, 0.9 and TIS weights 2, 0.5: w = 1.08 * 1 (unchanged).
    # Row 1: ratios 0.5, 0.8, 1.5 and weights 1, 1, 2: w = 0.6 * 2 = 1.2.
    lp, olp = from_log_ratios([np.log([1.2, 0.9, NAN]), np.log([0.5, 0.8, 1.5])])
    adv = np.array([[1.0, 1.0, NAN], [-1.0, -1.0, -1.0]], np.float32)
    mask = np.array([[1, 1, 0], [1, 1, 1]], np.float32)
    rho = np.array([[2.0, 0.5, NAN], [1.0, 1.0, 2.0]], np.float32)
    fn = lambda x: vespo_loss(x, olp, adv, mask, is_weights=rho)
    _, metrics, grad = value_and_grad(self, fn, lp)
    phi0, phi1 = phi(1.08, 2.0, 3.0), phi(1.2, 3.0, 2.0)
    # Not multiplied into the per-token loss: the gradient is -phi(w) A / n.
    np.testing.assert_allclose(
      grad, [[-phi0 / 5, -phi0 / 5, 0.0], [phi1 / 5] * 3], rtol=1e-5, atol=1e-8
    )
    np.testing.assert_allclose(metrics.ratio_max, 1.2, rtol=1e-5)
    np.testing.assert_allclose(metrics.is_weight_mean, (2 + 0.5 + 1 + 1 + 2) / 5, rtol=1e-6)
    # A zero weight is floored at 1e-8 (log -18.4): the sequence's weight all but vanishes.
    zero = np.array([[0.0, 1.0, NAN], [1.0, 1.0, 1.0]], np.float32)
    _, _, grad = value_and_grad(self, lambda x: vespo_loss(x, olp, adv, mask, is_weights=zero), lp)
    np.testing.assert_allclose(grad[0, :2], -phi(1.08 * 1e-8, 2.0, 3.0) / 5, rtol=1e-4)

  @chex.variants(with_jit=True, without_jit=True)
  def test_lambda_floor_and_non_finite_kernel_gives_zero(self):
    lp, olp = from_log_ratios([[np.log(2.0)], [20.0]])
    adv, mask = np.ones((2, 1), np.float32), np.ones((2, 1), np.float32)
    # lambda_pos = 0 is floored at 1e-4: phi(2) = 2^2 e^{1e-4 (1 - 2)}.
    _, _, grad = value_and_grad(self, lambda x: vespo_loss(x, olp, adv, mask, lambda_pos=0.0), lp)
    np.testing.assert_allclose(grad[0], [-phi(2.0, 2.0, 1e-4) / 2], rtol=1e-5)
    # k = 5000 at w = e^20: log phi = 1e-4 + 1e5 - 1e-4 e^20 overflows -> phi = 0.
    fn = lambda x: vespo_loss(x, olp, adv, mask, k_pos=5000.0, lambda_pos=0.0)
    loss, _, grad = value_and_grad(self, fn, lp)
    self.assertTrue(np.isfinite(loss))
    np.testing.assert_array_equal(grad[1], 0.0)

  @chex.variants(with_jit=True, without_jit=True)
  def test_kernel_sign_is_read_at_the_first_valid_token(self):
    # Token 0 is masked (its advantage -5 is ignored): the sequence advantage is +1.
    lp, olp = from_log_ratios([[NAN, np.log(1.5), 0.0]])
    adv = np.array([[-5.0, 1.0, 1.0]], np.float32)
    mask = np.array([[0, 1, 1]], np.float32)
    _, _, grad = value_and_grad(self, lambda x: vespo_loss(x, olp, adv, mask), lp)
    np.testing.assert_array_equal(grad[0, 0], 0.0)
    np.testing.assert_allclose(grad[0, 1:], [-phi(1.5, 2.0, 3.0) / 2] * 2, rtol=1e-5)

  def test_kernel_peaks_at_k_over_lambda_and_down_weights_stale_sequences(self):
    # The paper's property: phi is maximal at w = k / lam and decays on both sides.
    ws = np.array([0.05, 0.3, 2 / 3, 1.0, 3.0, 10.0], np.float32)
    adv = np.ones((6, 1), np.float32)
    mask = np.ones((6, 1), np.float32)
    lp, olp = from_log_ratios(np.log(ws)[:, None])
    grad = jax.grad(lambda x: vespo_loss(x, olp, adv, mask, agg="seq-mean-token-sum")[0])(lp)
    weights = -np.asarray(grad)[:, 0] * 6
    np.testing.assert_allclose(weights, phi(ws.astype(np.float64), 2.0, 3.0), rtol=1e-5)
    self.assertEqual(int(np.argmax(weights)), 2)
    self.assertLess(weights[0], 0.1)
    self.assertLess(weights[-1], 1e-9)

  def test_aggregation_modes(self):
    lp, olp = from_log_ratios([np.log([1.2, 0.9, NAN]), np.log([0.5, 0.8, 1.5])])
    adv = np.array([[1.0, 1.0, NAN], [-1.0, -1.0, -1.0]], np.float32)
    mask = np.array([[1, 1, 0], [1, 1, 1]], np.float32)
    phi0, phi1 = phi(1.08, 2.0, 3.0), phi(0.6, 3.0, 2.0)
    row0, row1 = -phi0 * lp[0, :2].sum(), phi1 * lp[1].sum()
    loss, _ = vespo_loss(lp, olp, adv, mask, agg="seq-mean-token-mean")
    np.testing.assert_allclose(loss, (row0 / 2 + row1 / 3) / 2, rtol=1e-5)
    loss, _ = vespo_loss(lp, olp, adv, mask, agg="seq-mean-token-sum")
    np.testing.assert_allclose(loss, (row0 + row1) / 2, rtol=1e-5)

  def test_bad_hyper_parameters(self):
    x, m = jnp.zeros((2, 3)), jnp.ones((2, 3))
    for key, value, match in [
      ("k_pos", -1.0, "`k_pos` must be >= 0"),
      ("lambda_neg", -0.5, "`lambda_neg` must be >= 0"),
      ("k_neg", np.inf, "`k_neg` must be finite"),
      ("lambda_pos", np.nan, "`lambda_pos`"),
    ]:
      with self.assertRaisesRegex(ValueError, match):
        vespo_loss(x, x, x, m, **{key: value})


if __name__ == "__main__":
  absltest.main()
