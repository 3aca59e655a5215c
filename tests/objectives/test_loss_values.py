"""Hand-computed values (loss, metrics, per-token gradients) for every policy loss.

Inputs are built from chosen ratios r: old_logp is fixed and logp = old_logp +
log r, so the expected numbers below follow from the formulas by hand.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest

from rlx.objectives import (
  aspo_loss,
  cispo_loss,
  ctpo_loss,
  gspo_loss,
  minpro_loss,
  ppo_clip_loss,
  sapo_loss,
)

NAN = np.nan


def from_ratios(ratios, old_logp=-1.0):
  """(logp, old_logp) float32 with exp(logp - old_logp) = ratios; NaN stays NaN."""
  ratios = np.asarray(ratios, np.float64)
  old = np.where(np.isnan(ratios), NAN, old_logp)
  return (old + np.log(ratios)).astype(np.float32), old.astype(np.float32)


def value_and_grad(test, fn, *args):
  """Runs `fn` (variant-wrapped) and its gradient w.r.t. the first argument."""
  f = test.variant(jax.value_and_grad(fn, has_aux=True))
  (loss, metrics), grad = f(*args)
  return loss, metrics, grad


# PPO case: ratios/advantages of a 2 x 3 batch, the last token of row 1 padded.
PPO_R = [[1.5, 0.5, 1.1], [0.5, 2.0, NAN]]
PPO_A = np.array([[1.0, -1.0, 2.0], [1.0, -1.0, NAN]], np.float32)
PPO_M = np.array([[1, 1, 1], [1, 1, 0]], np.float32)
PPO_W = np.array([[2.0, 1.0, 1.0], [1.0, 0.5, NAN]], np.float32)


class PolicyLossValuesTest(chex.TestCase):
  @chex.variants(with_jit=True, without_jit=True)
  def test_ppo(self):
    lp, olp = from_ratios(PPO_R)
    # Per token L = max(-A r, -A clip(r, 0.8, 1.2)):
    #   r=1.5,A=1 -> -1.2 (clip high); r=0.5,A=-1 -> 0.8 (clip low);
    #   r=1.1,A=2 -> -2.2; r=0.5,A=1 -> -0.5; r=2,A=-1 -> 2.0.
    loss, metrics, grad = value_and_grad(self, lambda x: ppo_clip_loss(x, olp, PPO_A, PPO_M), lp)
    np.testing.assert_allclose(loss, (-1.2 + 0.8 - 2.2 - 0.5 + 2.0) / 5, rtol=1e-5)
    # dL/dlp = -A r / 5 where unclipped, 0 where clipped.
    np.testing.assert_allclose(
      grad, [[0.0, 0.0, -2.2 / 5], [-0.5 / 5, 2.0 / 5, 0.0]], rtol=1e-5, atol=1e-7
    )
    np.testing.assert_allclose(metrics.clip_frac_high, 1 / 5)
    np.testing.assert_allclose(metrics.clip_frac_low, 1 / 5)
    np.testing.assert_allclose(metrics.clip_frac_dual, 0.0)
    np.testing.assert_allclose(metrics.ratio_mean, (1.5 + 0.5 + 1.1 + 0.5 + 2.0) / 5, rtol=1e-5)
    np.testing.assert_allclose(metrics.ratio_max, 2.0, rtol=1e-5)
    kl = -(np.log(1.5) + np.log(0.5) + np.log(1.1) + np.log(0.5) + np.log(2.0)) / 5
    np.testing.assert_allclose(metrics.approx_kl, kl, rtol=1e-4)
    np.testing.assert_allclose(metrics.is_weight_mean, 1.0)

  @chex.variants(with_jit=True, without_jit=True)
  def test_ppo_dual_clip_clip_higher_and_is_weights(self):
    lp, olp = from_ratios(PPO_R)
    # Dual clip c=1.5: r=2, A=-1 -> min(2.0, 1.5) = 1.5 (no gradient).
    # clip_high=0.6: r=1.5, A=1 is no longer clipped -> -1.5.
    # is_weights multiply after clipping: 2*(-1.5) + 0.8 - 2.2 - 0.5 + 0.5*1.5.
    fn = lambda x: ppo_clip_loss(
      x, olp, PPO_A, PPO_M, clip_high=0.6, dual_clip=1.5, is_weights=PPO_W
    )
    loss, metrics, grad = value_and_grad(self, fn, lp)
    np.testing.assert_allclose(loss, (-3.0 + 0.8 - 2.2 - 0.5 + 0.75) / 5, rtol=1e-5)
    np.testing.assert_allclose(
      grad, [[-3.0 / 5, 0.0, -2.2 / 5], [-0.5 / 5, 0.0, 0.0]], rtol=1e-5, atol=1e-7
    )
    np.testing.assert_allclose(metrics.clip_frac_high, 0.0)
    np.testing.assert_allclose(metrics.clip_frac_dual, 1 / 5)
    np.testing.assert_allclose(metrics.is_weight_mean, (2 + 1 + 1 + 1 + 0.5) / 5, rtol=1e-6)

  @chex.variants(with_jit=True, without_jit=True)
  def test_gspo(self):
    # Sequence ratios: row 0 sqrt(2) (token ratios 2, 1), row 1 1, row 2 1/sqrt(2).
    lp, olp = from_ratios([[2.0, 1.0, NAN], [1.0, 1.0, 1.0], [0.5, 1.0, NAN]])
    adv = np.array([[1.0, 1.0, NAN], [-2.0, -2.0, -2.0], [-1.0, -1.0, NAN]], np.float32)
    mask = np.array([[1, 1, 0], [1, 1, 1], [1, 1, 0]], np.float32)
    s2 = np.sqrt(2.0)
    # Default window [1 - 3e-4, 1 + 4e-4]: row 0 clipped high at 1.0004 (A>0),
    # row 2 clipped low at 0.9997 (A<0); seq-mean-token-mean.
    loss, metrics, grad = value_and_grad(self, lambda x: gspo_loss(x, olp, adv, mask), lp)
    np.testing.assert_allclose(loss, (-1.0004 + 2.0 + 0.9997) / 3, rtol=1e-5)
    # Row 1 unclipped: dL/dlp_t = -A w / (n_i * num_seqs) = 2 / 9.
    np.testing.assert_allclose(grad, [[0, 0, 0], [2 / 9] * 3, [0, 0, 0]], rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(metrics.clip_frac_high, 2 / 7, rtol=1e-6)
    np.testing.assert_allclose(metrics.clip_frac_low, 2 / 7, rtol=1e-6)
    np.testing.assert_allclose(metrics.ratio_max, s2, rtol=1e-5)
    # Wide window: the value is the sequence ratio (geometric mean of token ratios).
    loss, _, grad = value_and_grad(
      self, lambda x: gspo_loss(x, olp, adv, mask, clip_low=0.5, clip_high=0.5), lp
    )
    np.testing.assert_allclose(loss, (-s2 + 2.0 + 1 / s2) / 3, rtol=1e-5)
    np.testing.assert_allclose(grad[0, :2], [-s2 / 6] * 2, rtol=1e-5)
    np.testing.assert_allclose(grad[2, :2], [1 / s2 / 6] * 2, rtol=1e-5)

  @chex.variants(with_jit=True, without_jit=True)
  def test_minpro(self):
    lp, olp = from_ratios([[0.5, 1.5, 1.1]])
    adv = np.ones((1, 3), np.float32)
    mask = np.ones((1, 3), np.float32)
    # PPO terms: -0.5, -1.2 (clipped), -1.1. Strict prefix minima: 1, 0.5, 0.5.
    loss, metrics, grad = value_and_grad(self, lambda x: minpro_loss(x, olp, adv, mask), lp)
    np.testing.assert_allclose(loss, (-0.5 - 0.6 - 0.55) / 3, rtol=1e-5)
    np.testing.assert_allclose(grad, [[-0.5 / 3, 0.0, -0.55 / 3]], rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(metrics.ratio_max, 0.75, rtol=1e-5)  # 0.5 * 1.5
    # Inclusive prefix: minima 0.5, 0.5, 0.5.
    loss, _, _ = value_and_grad(self, lambda x: minpro_loss(x, olp, adv, mask, inclusive=True), lp)
    np.testing.assert_allclose(loss, (-0.25 - 0.6 - 0.55) / 3, rtol=1e-5)

  @chex.variants(with_jit=True, without_jit=True)
  def test_minpro_cap_prefix(self):
    lp, olp = from_ratios([[1.5, 1.1, 1.2]])
    adv = np.ones((1, 3), np.float32)
    mask = np.ones((1, 3), np.float32)
    # PPO terms: -1.2 (clipped), -1.1, -1.2. Strict prefix minima: 1, 1.5, 1.1.
    loss, _, _ = value_and_grad(self, lambda x: minpro_loss(x, olp, adv, mask), lp)
    np.testing.assert_allclose(loss, (-1.2 - 1.65 - 1.32) / 3, rtol=1e-5)
    loss, _, _ = value_and_grad(self, lambda x: minpro_loss(x, olp, adv, mask, cap_prefix=True), lp)
    np.testing.assert_allclose(loss, (-1.2 - 1.1 - 1.2) / 3, rtol=1e-5)

  @chex.variants(with_jit=True, without_jit=True)
  def test_cispo(self):
    lp = np.array([[-1.0, -2.0]], np.float32)
    olp = lp - np.log([[1.5, 0.5]]).astype(np.float32)
    adv = np.array([[1.0, -1.0]], np.float32)
    mask = np.ones((1, 2), np.float32)
    # Weights sg(clip(r, 0, 1.2)) = 1.2, 0.5; L = -w A lp = 1.2, -1.0.
    loss, metrics, grad = value_and_grad(self, lambda x: cispo_loss(x, olp, adv, mask), lp)
    np.testing.assert_allclose(loss, (1.2 - 1.0) / 2, rtol=1e-5)
    # Gradients are never zeroed: -w A / 2.
    np.testing.assert_allclose(grad, [[-1.2 / 2, 0.5 / 2]], rtol=1e-5)
    np.testing.assert_allclose(metrics.clip_frac_high, 0.5)
    np.testing.assert_allclose(metrics.clip_frac_low, 0.0)
    # With a lower bound 0.8 the second weight is truncated too.
    loss, metrics, grad = value_and_grad(
      self, lambda x: cispo_loss(x, olp, adv, mask, clip_low=0.2), lp
    )
    np.testing.assert_allclose(grad, [[-1.2 / 2, 0.8 / 2]], rtol=1e-5)
    np.testing.assert_allclose(metrics.clip_frac_low, 0.5)

  @chex.variants(with_jit=True, without_jit=True)
  def test_sapo(self):
    lp, olp = from_ratios([[1.0, 2.0, 0.5]])
    adv = np.array([[1.0, -1.0, 2.0]], np.float32)
    mask = np.ones((1, 3), np.float32)
    sig = lambda z: 1.0 / (1.0 + np.exp(-z))
    # f(r) = 4/tau sigmoid(tau (r - 1)); tau = 1 for A > 0, 1.05 otherwise.
    f1 = 4.0 * sig(0.0)  # = 2
    f2 = 4.0 / 1.05 * sig(1.05)
    f3 = 4.0 * sig(-0.5)
    loss, metrics, grad = value_and_grad(self, lambda x: sapo_loss(x, olp, adv, mask), lp)
    np.testing.assert_allclose(loss, (-f1 * 1 + f2 - 2 * f3) / 3, rtol=1e-5)
    # dL/dlp = -A f'(r) r, f'(r) = 4 sig(tau (r-1)) (1 - sig(...)); f'(1) = 1.
    g1 = -1.0
    g2 = 4 * sig(1.05) * (1 - sig(1.05)) * 2.0
    g3 = -2.0 * 4 * sig(-0.5) * (1 - sig(-0.5)) * 0.5
    np.testing.assert_allclose(grad, [[g1 / 3, g2 / 3, g3 / 3]], rtol=1e-5)
    np.testing.assert_allclose(metrics.clip_frac_high, 0.0)

  @chex.variants(with_jit=True, without_jit=True)
  def test_aspo(self):
    lp, olp = from_ratios([[0.5, 1.5, 0.5, 4.0, 2.0]])
    adv = np.array([[1.0, 1.0, -1.0, -1.0, -1.0]], np.float32)
    mask = np.ones((1, 5), np.float32)
    # A>0: value -A / min(r, 1.2), gradient -A / r inside the clip, 0 above:
    #   r=0.5 -> -2 (grad -2); r=1.5 -> -1/1.2 (grad 0).
    # A<0: r=0.5 -> 0.8 (clipped low, grad 0); r=4 > 3 -> soft dual clip, value
    #   -A c = 3, grad -A c = 3; r=2 -> 2 (grad -A r = 2).
    loss, metrics, grad = value_and_grad(self, lambda x: aspo_loss(x, olp, adv, mask), lp)
    np.testing.assert_allclose(loss, (-2.0 - 1 / 1.2 + 0.8 + 3.0 + 2.0) / 5, rtol=1e-5)
    np.testing.assert_allclose(grad, [[-2 / 5, 0.0, 0.0, 3 / 5, 2 / 5]], rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(metrics.clip_frac_high, 1 / 5)
    np.testing.assert_allclose(metrics.clip_frac_low, 1 / 5)
    np.testing.assert_allclose(metrics.clip_frac_dual, 1 / 5)

  @chex.variants(with_jit=True, without_jit=True)
  def test_aspo_positive_dual_clip_caps_the_flipped_weight(self):
    lp, olp = from_ratios([[0.25, 0.5, 0.1]])
    adv = np.array([[1.0, 1.0, 2.0]], np.float32)
    mask = np.ones((1, 3), np.float32)
    # A > 0 below 1/c = 1/3 (reference `positive_clip_ratio_c` = 3): the flipped
    # weight 1/r is capped at c, value -A c (continuous at r = 1/c), gradient -A c:
    #   r=0.25 -> -3 (grad -3); r=0.5 -> -2 (grad -2, 1/r = 2 < 3); r=0.1, A=2 -> -6 (grad -6).
    loss, metrics, grad = value_and_grad(self, lambda x: aspo_loss(x, olp, adv, mask), lp)
    np.testing.assert_allclose(loss, (-3.0 - 2.0 - 6.0) / 3, rtol=1e-5)
    np.testing.assert_allclose(grad, [[-3 / 3, -2 / 3, -6 / 3]], rtol=1e-5)
    np.testing.assert_allclose(metrics.clip_frac_dual, 2 / 3)
    # Disabled: the flipped weight 1/r is unbounded (4 and 10).
    fn = lambda x: aspo_loss(x, olp, adv, mask, positive_dual_clip=None)
    loss, metrics, grad = value_and_grad(self, fn, lp)
    np.testing.assert_allclose(loss, (-4.0 - 2.0 - 20.0) / 3, rtol=1e-5)
    np.testing.assert_allclose(grad, [[-4 / 3, -2 / 3, -20 / 3]], rtol=1e-5)
    np.testing.assert_allclose(metrics.clip_frac_dual, 0.0)

  def test_aspo_entropy_quantile_is_per_sequence(self):
    # Reference: torch.nanquantile(entropy, 0.8, dim=-1) over each sequence's valid
    # tokens. Row 1's entropies are all larger than row 0's, but each row's own
    # top 20% (token 4; row 0's padded 9.0 is ignored) gets the wider clip 0.4.
    lp, olp = from_ratios([[1.3] * 5 + [NAN], [1.3] * 6])
    adv = np.array([[1.0] * 5 + [NAN], [1.0] * 6], np.float32)
    mask = np.array([[1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1]], np.float32)
    entropy = np.array([[0.1, 0.2, 0.3, 0.4, 5.0, 9.0], [5.0, 6.0, 7.0, 8.0, 9.0, 1.0]], np.float32)

    def fn(x, fraction):
      return aspo_loss(x, olp, adv, mask, entropy=entropy, high_entropy_fraction=fraction)[0]

    run = jax.jit(jax.value_and_grad(fn), static_argnums=1)
    loss, grad = run(lp, 0.2)
    # Row 1 (6 tokens): quantile 0.8 is 8.0, so only 9.0 (token 4) is above it.
    # Clipped tokens (r = 1.3 > 1.2): value -1/1.2, no gradient; wide ones: -1/1.3.
    np.testing.assert_allclose(loss, (-9 / 1.2 - 2 / 1.3) / 11, rtol=1e-5)
    expected = np.zeros((2, 6), np.float32)
    expected[:, 4] = -1 / 1.3 / 11
    np.testing.assert_allclose(grad, expected, rtol=1e-5, atol=1e-7)
    # high_entropy_fraction = 1: every valid token gets the wider clip.
    np.testing.assert_allclose(run(lp, 1.0)[0], -1 / 1.3, rtol=1e-5)

  @chex.variants(with_jit=True, without_jit=True)
  def test_aspo_high_entropy_tokens_get_the_wider_clip(self):
    lp, olp = from_ratios([[1.3, 1.0, 1.0, 1.0, 1.3, NAN]])
    adv = np.array([[1.0] * 5 + [NAN]], np.float32)
    mask = np.array([[1, 1, 1, 1, 1, 0]], np.float32)
    # Entropy 5.0 is the top 20% of the 5 valid tokens (the padded 9.0 is ignored).
    entropy = np.array([[0.1, 0.2, 0.3, 0.4, 5.0, 9.0]], np.float32)
    fn = lambda x: aspo_loss(x, olp, adv, mask, entropy=entropy)
    loss, metrics, grad = value_and_grad(self, fn, lp)
    # Token 0 (low entropy, eps 0.2) is clipped at 1.2; token 4 (eps 0.4) is not.
    np.testing.assert_allclose(loss, (-1 / 1.2 - 3.0 - 1 / 1.3) / 5, rtol=1e-5)
    np.testing.assert_allclose(
      grad, [[0.0, -1 / 5, -1 / 5, -1 / 5, -1 / 1.3 / 5, 0.0]], rtol=1e-5, atol=1e-7
    )
    np.testing.assert_allclose(metrics.clip_frac_high, 1 / 5)


class CtpoValuesTest(chex.TestCase):
  @chex.variants(with_jit=True, without_jit=True)
  def test_cumprod(self):
    # delta = 0.04, 0.04, -0.1 -> S = 0.04, 0.08, -0.02 at t = 1, 2, 3.
    old = np.full((1, 3), -1.0, np.float32)
    lp = old + np.array([[0.04, 0.04, -0.1]], np.float32)
    adv = np.array([[1.0, 1.0, -1.0]], np.float32)
    mask = np.ones((1, 3), np.float32)
    # Windows (log space) [-0.025 sqrt(t), 0.05 sqrt(t)]:
    #   t=1: 0.04 inside -> -e^0.04 (grad -e^0.04)
    #   t=2: 0.08 > 0.05 sqrt 2 -> -e^(0.05 sqrt 2) (grad 0)
    #   t=3: -0.02 inside, A<0 -> e^-0.02 (grad e^-0.02); dual e^(0.05 sqrt 3) inactive.
    loss, metrics, grad = value_and_grad(
      self, lambda x: ctpo_loss(x, old, adv, mask), jnp.asarray(lp)
    )
    expected = (-np.exp(0.04) - np.exp(0.05 * np.sqrt(2)) + np.exp(-0.02)) / 3
    np.testing.assert_allclose(loss, expected, rtol=1e-5)
    np.testing.assert_allclose(
      grad, [[-np.exp(0.04) / 3, 0.0, np.exp(-0.02) / 3]], rtol=1e-5, atol=1e-7
    )
    np.testing.assert_allclose(metrics.clip_frac_high, 1 / 3)
    np.testing.assert_allclose(metrics.ratio_max, np.exp(0.08), rtol=1e-5)

  @chex.variants(with_jit=True, without_jit=True)
  def test_geomean(self):
    # S / t = 0.04, 0.04, -0.02/3; p = -0.5 -> window [-0.025, 0.05] / sqrt(t).
    old = np.full((1, 3), -1.0, np.float32)
    lp = old + np.array([[0.04, 0.04, -0.1]], np.float32)
    adv = np.array([[1.0, 1.0, -1.0]], np.float32)
    mask = np.ones((1, 3), np.float32)
    loss, _, grad = value_and_grad(
      self, lambda x: ctpo_loss(x, old, adv, mask, variant="geomean"), jnp.asarray(lp)
    )
    expected = (-np.exp(0.04) - np.exp(0.05 / np.sqrt(2)) + np.exp(-0.02 / 3)) / 3
    np.testing.assert_allclose(loss, expected, rtol=1e-5)
    np.testing.assert_allclose(
      grad, [[-np.exp(0.04) / 3, 0.0, np.exp(-0.02 / 3) / 3]], rtol=1e-5, atol=1e-7
    )


if __name__ == "__main__":
  absltest.main()
