"""Tests for the per-token KL estimators."""

import functools

import chex
import jax
import jax.numpy as jnp
import jax.test_util
import numpy as np
import pytest
from absl.testing import parameterized

from rlx import objectives as obj

# Delta = logp - ref = [0.5, -1.0, 0.0, -30.0]
LOGP = jnp.array([[-1.0, -2.0, -0.7, -31.0]])
REF = jnp.array([[-1.5, -1.0, -0.7, -1.0]])
X = -np.array([0.5, -1.0, 0.0, -30.0])  # ref - logp
K3 = np.clip(np.exp(np.clip(X, -20, 20)) - np.clip(X, -20, 20) - 1.0, -10, 10)
EXPECTED = {
  "k1": [0.5, -1.0, 0.0, -30.0],
  "abs": [0.5, 1.0, 0.0, 30.0],
  "k2": [0.125, 0.5, 0.0, 450.0],
  "k3": K3,
  "low_var_kl": K3,
  "k3+": K3,
}


class KlPenaltyTest(chex.TestCase):
  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.parameters(*obj.KL_KINDS)
  def test_hand_values(self, kind):
    got = self.variant(functools.partial(obj.kl_penalty, kind=kind))(LOGP, REF)
    np.testing.assert_allclose(got[0], EXPECTED[kind], rtol=1e-5, atol=1e-6)
    assert got.dtype == jnp.float32
    # k3 of 0.5: e^-0.5 + 0.5 - 1; of -1: e - 2; clamped to 10 at -30.
    if kind == "k3":
      np.testing.assert_allclose(got[0, :2], [np.exp(-0.5) - 0.5, np.e - 2.0], rtol=1e-5)
      assert got[0, 3] == 10.0

  @chex.variants(with_jit=True, without_jit=True)
  def test_gradients(self):
    logp = jnp.array([[-1.0, -2.0, -0.3]])
    ref = jnp.array([[-1.5, -1.0, -0.6]])
    delta = np.asarray(logp - ref)

    def grad(kind):
      f = lambda lp: jnp.sum(obj.kl_penalty(lp, ref, kind))
      return self.variant(jax.grad(f))(logp)

    np.testing.assert_allclose(grad("k1"), np.ones_like(delta))
    np.testing.assert_allclose(grad("abs"), np.sign(delta))
    np.testing.assert_allclose(grad("k2"), delta, rtol=1e-6)
    # d/dlp (e^x - x - 1), x = ref - lp: 1 - e^x.
    np.testing.assert_allclose(grad("k3"), 1.0 - np.exp(-delta), rtol=1e-5)
    # k3+: value of k3, gradient of k2.
    np.testing.assert_allclose(grad("k3+"), delta, rtol=1e-6)

  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.parameters(*obj.KL_KINDS)
  def test_mask_makes_nan_padding_harmless(self, kind):
    logp = jnp.array([[-1.0, jnp.nan, -2.0], [-0.5, -0.2, jnp.inf]])
    ref = jnp.array([[-1.2, -3.0, jnp.nan], [-0.4, -0.2, -1.0]])
    mask = jnp.array([[1, 0, 0], [1, 1, 0]])

    def total(lp):
      return jnp.sum(obj.kl_penalty(lp, ref, kind, mask=mask))

    value, grad = self.variant(jax.value_and_grad(total))(logp)
    assert np.isfinite(value)
    assert np.all(np.isfinite(grad))
    np.testing.assert_array_equal(np.asarray(grad)[np.asarray(mask) == 0], 0.0)
    out = obj.kl_penalty(logp, ref, kind, mask=mask)
    np.testing.assert_array_equal(np.asarray(out)[np.asarray(mask) == 0], 0.0)
    # Valid positions equal the unmasked computation on clean inputs.
    clean = obj.kl_penalty(jnp.nan_to_num(logp), jnp.nan_to_num(ref), kind)
    np.testing.assert_allclose(
      np.asarray(out)[np.asarray(mask) == 1], np.asarray(clean)[np.asarray(mask) == 1]
    )

  @parameterized.parameters("k1", "k2", "k3")
  def test_check_grads(self, kind):
    logp = jnp.array([[-1.0, -2.0, -0.3]])
    ref = jnp.array([[-1.5, -1.0, -0.6]])
    jax.test_util.check_grads(
      lambda lp: jnp.sum(obj.kl_penalty(lp, ref, kind)), (logp,), order=1, modes=("rev",)
    )

  @parameterized.parameters(*obj.KL_KINDS)
  def test_extreme_log_ratios_are_finite(self, kind):
    logp = jnp.array([[1e4, -1e4, 0.0]])
    ref = jnp.zeros((1, 3))
    value, grad = jax.value_and_grad(lambda lp: jnp.sum(obj.kl_penalty(lp, ref, kind)))(logp)
    # Delta = (1e4, -1e4, 0). k3 is clamped to 10 at both extremes (no gradient
    # there) and is 0 with zero gradient at Delta = 0; k3+ has k3's value and
    # k2's gradient Delta.
    want_value, want_grad = {
      "k1": (0.0, [1.0, 1.0, 1.0]),
      "abs": (2e4, [1.0, -1.0, 1.0]),  # JAX: d|x|/dx = 1 at x = 0
      "k2": (1e8, [1e4, -1e4, 0.0]),
      "k3": (20.0, [0.0, 0.0, 0.0]),
      "low_var_kl": (20.0, [0.0, 0.0, 0.0]),
      "k3+": (20.0, [1e4, -1e4, 0.0]),
    }[kind]
    np.testing.assert_allclose(value, want_value, rtol=1e-6)
    np.testing.assert_allclose(grad, [want_grad], rtol=1e-6)

  def test_identical_policies_give_zero(self):
    lp = jnp.array([[-1.0, -2.0], [-0.1, -5.0]])
    for kind in obj.KL_KINDS:
      np.testing.assert_allclose(obj.kl_penalty(lp, lp, kind), 0.0, atol=1e-7)

  def test_low_precision_input(self):
    lp = jnp.array([[-1.0, -2.0]], jnp.bfloat16)
    assert obj.kl_penalty(lp, lp + 0.5, "k3").dtype == jnp.float32

  def test_errors(self):
    lp = jnp.zeros((2, 3))
    with pytest.raises(ValueError, match="kind"):
      obj.kl_penalty(lp, lp, "k4")
    with pytest.raises(ValueError, match="ref_logp"):
      obj.kl_penalty(lp, jnp.zeros((2, 4)), "k1")
    with pytest.raises(ValueError, match="mask"):
      obj.kl_penalty(lp, lp, "k1", mask=jnp.ones((3, 2)))
    with pytest.raises(ValueError, match="logp"):
      obj.kl_penalty(jnp.zeros((6,)), jnp.zeros((6,)), "k1")
