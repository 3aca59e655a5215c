"""Tests for rollout-mismatch correction: TIS, MIS rejection, veto, AIS."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized

from rlx import objectives as obj

# log rho = old_logp - rollout_logp at the valid tokens; (0, 3) is padding (NaN).
LOG_RHO = np.array([[0.1, 1.0, -0.2, 0.0], [0.0, -0.5, 0.3, -2.0]], np.float32)
MASK = np.array([[1, 1, 1, 0], [1, 1, 1, 1]], np.float32)
OLD = jnp.array([[-1.0, -2.0, -0.5, jnp.nan], [-0.3, -1.2, -2.0, -0.7]])
ROLLOUT = jnp.where(jnp.asarray(MASK) > 0, OLD - LOG_RHO, jnp.inf)
VALID = MASK > 0


def _ess(w):
  w = np.asarray(w, np.float64)
  return w.sum() ** 2 / (w.size * np.square(w).sum())


def _run(variant, **kwargs):
  return variant(functools.partial(obj.rollout_correction, **kwargs))(OLD, ROLLOUT, MASK)


class RolloutCorrectionTest(chex.TestCase):
  @chex.variants(with_jit=True, without_jit=True)
  def test_token_tis_hand_values(self):
    w, new_mask, m = _run(self.variant)
    raw = np.exp(LOG_RHO)
    want = np.where(VALID, np.minimum(raw, 2.0), 0.0)
    np.testing.assert_allclose(w, want, rtol=1e-6)
    np.testing.assert_array_equal(new_mask, MASK)
    lr = LOG_RHO[VALID]
    np.testing.assert_allclose(m.mismatch_k1, -lr.mean(), rtol=1e-5)
    np.testing.assert_allclose(m.mismatch_k3, (np.exp(lr) - 1 - lr).mean(), rtol=1e-5)
    np.testing.assert_allclose(m.frac_truncated, 1 / 7, rtol=1e-6)
    np.testing.assert_allclose(m.frac_rejected, 0.0)
    np.testing.assert_allclose(m.ess, _ess(want[VALID]), rtol=1e-5)
    np.testing.assert_allclose(m.ess_raw, _ess(raw[VALID]), rtol=1e-5)
    np.testing.assert_allclose(m.weight_mean, want[VALID].mean(), rtol=1e-6)
    np.testing.assert_allclose(m.weight_max, 2.0)
    np.testing.assert_allclose(m.ais_lambda, 1.0)

  @chex.variants(with_jit=True, without_jit=True)
  def test_sequence_tis_hand_values(self):
    w, _, m = _run(self.variant, level="sequence")
    # Sequence log-ratios 0.9 -> e^0.9 truncated to 2; -2.2 -> e^-2.2.
    want = np.where(VALID, np.array([[2.0], [np.exp(-2.2)]]), 0.0)
    np.testing.assert_allclose(w, want, rtol=1e-5)
    np.testing.assert_allclose(m.frac_truncated, 3 / 7, rtol=1e-6)
    np.testing.assert_allclose(m.ess, _ess([2.0, np.exp(-2.2)]), rtol=1e-5)
    np.testing.assert_allclose(m.ess_raw, _ess([np.exp(0.9), np.exp(-2.2)]), rtol=1e-5)
    # Untruncated.
    w, _, m = _run(self.variant, level="sequence", truncate=None)
    np.testing.assert_allclose(w[0, :3], np.exp(0.9), rtol=1e-5)
    np.testing.assert_allclose(m.frac_truncated, 0.0)

  @chex.variants(with_jit=True, without_jit=True)
  def test_renormalize(self):
    w, _, _ = _run(self.variant, renormalize=True)
    base = np.minimum(np.exp(LOG_RHO), 2.0)
    np.testing.assert_allclose(w, np.where(VALID, base / base[VALID].mean(), 0.0), rtol=1e-5)
    w, _, _ = _run(self.variant, level="sequence", renormalize=True)
    seq = np.array([2.0, np.exp(-2.2)])
    np.testing.assert_allclose(w[:, 0], seq / seq.mean(), rtol=1e-5)

  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.named_parameters(
    # ratio in [0.5, 2]: e^1 and e^-2 are out.
    ("token_ratio", "token", "ratio", 0.5, 2.0, [[1, 0, 1, 0], [1, 1, 1, 0]]),
    # k1 = -log rho >= 0 keeps tokens where the sampler was at least as likely.
    ("token_k1", "token", "k1", 0.0, None, [[0, 0, 1, 0], [1, 1, 0, 1]]),
    # k3(1) = e - 2 and k3(-2) = e^-2 + 1 exceed 0.5.
    ("token_k3", "token", "k3", None, 0.5, [[1, 0, 1, 0], [1, 1, 1, 0]]),
    # seq-sum k1: -0.9 and 2.2.
    ("seq_sum_k1", "seq-sum", "k1", None, 1.0, [[1, 1, 1, 0], [0, 0, 0, 0]]),
    # seq-sum ratio: e^0.9 and e^-2.2.
    ("seq_sum_ratio", "seq-sum", "ratio", 0.2, 5.0, [[1, 1, 1, 0], [0, 0, 0, 0]]),
    # seq-mean ratio (geometric mean): e^0.3 and e^-0.55.
    ("seq_mean_ratio", "seq-mean", "ratio", 0.7, 1.5, [[1, 1, 1, 0], [0, 0, 0, 0]]),
    # seq-max k2: 0.5 and 2.
    ("seq_max_k2", "seq-max", "k2", None, 1.0, [[1, 1, 1, 0], [0, 0, 0, 0]]),
    # seq-max ratio: e^1 and e^0.3.
    ("seq_max_ratio", "seq-max", "ratio", None, 2.0, [[0, 0, 0, 0], [1, 1, 1, 1]]),
  )
  def test_rejection(self, reject, statistic, low, high, want_mask):
    w, new_mask, m = _run(
      self.variant,
      reject=reject,
      reject_statistic=statistic,
      reject_low=low,
      reject_high=high,
    )
    want_mask = np.array(want_mask, np.float32)
    np.testing.assert_array_equal(new_mask, want_mask)
    np.testing.assert_array_equal(np.asarray(w)[want_mask == 0], 0.0)
    np.testing.assert_allclose(m.frac_rejected, (7 - want_mask.sum()) / 7, rtol=1e-6)
    np.testing.assert_allclose(m.frac_vetoed, 0.0)
    # Mismatch KL is reported over the input mask, before rejection.
    np.testing.assert_allclose(m.mismatch_k1, -LOG_RHO[VALID].mean(), rtol=1e-5)

  @chex.variants(with_jit=True, without_jit=True)
  def test_veto_rejects_whole_sequence(self):
    w, new_mask, m = _run(self.variant, veto_threshold=0.2)  # e^-2 < 0.2 in sequence 1
    np.testing.assert_array_equal(new_mask, [[1, 1, 1, 0], [0, 0, 0, 0]])
    np.testing.assert_array_equal(np.asarray(w)[1], 0.0)
    np.testing.assert_allclose(m.frac_vetoed, 4 / 7, rtol=1e-6)
    np.testing.assert_allclose(m.frac_rejected, 4 / 7, rtol=1e-6)
    _, new_mask, _ = _run(self.variant, veto_threshold=1e-4)
    np.testing.assert_array_equal(new_mask, MASK)

  def test_veto_and_rejection_see_ratios_beyond_the_clamp(self):
    # rho = e^-30 (below the +-20 weight clamp) in sequence 0, token 0.
    old, rollout, mask = jnp.zeros((2, 2)), jnp.array([[30.0, 0.0], [0.0, 0.0]]), jnp.ones((2, 2))
    vetoed = [[0, 0], [1, 1]]
    rejected = [[0, 1], [1, 1]]
    for kwargs, want in (
      ({"veto_threshold": 1e-12}, vetoed),
      ({"reject": "token", "reject_low": 1e-11}, rejected),
      ({"reject": "token", "reject_statistic": "k1", "reject_high": 25.0}, rejected),
      ({"reject": "seq-sum", "reject_statistic": "k2", "reject_high": 400.0}, vetoed),
    ):
      _, new_mask, _ = obj.rollout_correction(old, rollout, mask, **kwargs)
      np.testing.assert_array_equal(new_mask, want, err_msg=str(kwargs))

  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.named_parameters(
    ("token", {}),
    ("sequence", {"level": "sequence"}),
    ("none_reject", {"level": None, "reject": "token", "reject_low": 0.5, "reject_high": 2.0}),
    ("adaptive_renorm", {"adaptive": True, "renormalize": True, "veto_threshold": 1e-4}),
    ("seq_reject", {"reject": "seq-mean", "reject_statistic": "k3", "reject_high": 1e-3}),
  )
  def test_identical_policies(self, kwargs):
    old = jnp.array([[-1.0, -2.0, -0.5, jnp.nan], [-0.3, -1.2, -2.0, -0.7]])
    fn = self.variant(functools.partial(obj.rollout_correction, **kwargs))
    w, new_mask, m = fn(old, old, jnp.asarray(MASK, bool))
    np.testing.assert_allclose(w, MASK, atol=1e-6)
    assert new_mask.dtype == jnp.bool_
    np.testing.assert_array_equal(new_mask, VALID)
    np.testing.assert_allclose(m.mismatch_k1, 0.0, atol=1e-7)
    np.testing.assert_allclose(m.mismatch_k3, 0.0, atol=1e-7)
    np.testing.assert_allclose([m.ess, m.ess_raw], 1.0, rtol=1e-6)
    np.testing.assert_allclose([m.frac_truncated, m.frac_rejected], 0.0)
    if kwargs.get("adaptive"):
      np.testing.assert_allclose(m.ais_lambda, 0.0, atol=1e-7)

  @chex.variants(with_jit=True, without_jit=True)
  def test_ais_mixing(self):
    kw = {"adaptive": True, "truncate": None}
    fn = self.variant(functools.partial(obj.rollout_correction, **kw))
    mask = jnp.ones((2, 16))
    old = jnp.zeros((2, 16))
    # Reliable weights, mismatch KL >> ais_kl_scale: lambda near ESS.
    lr = jnp.tile(jnp.array([0.3, -0.3]), 16).reshape(2, 16)
    w, _, m = fn(old, old - lr, mask)
    raw = np.exp(np.asarray(lr))
    kl = np.mean(raw - 1 - np.asarray(lr))
    want_lambda = (1 - np.exp(-kl / 1e-3)) * _ess(raw) ** 2
    np.testing.assert_allclose(m.ais_lambda, want_lambda, rtol=1e-4)
    assert m.ais_lambda > 0.8
    np.testing.assert_allclose(w, 1 + want_lambda * (raw - 1), rtol=1e-4)
    # Degenerate weights (one token dominates): lambda moves to the safe side, 0.
    lr = jnp.zeros((2, 16)).at[0, 3].set(15.0)
    w, _, m = fn(old, old - lr, mask)
    assert m.ess_raw < 0.05
    assert m.ais_lambda < 0.01
    np.testing.assert_allclose(np.delete(np.asarray(w).ravel(), 3), 1.0, atol=1e-5)
    assert w[0, 3] < 1.0 + 0.01 * np.exp(15.0)
    # Tiny mismatch (KL << ais_kl_scale): lambda small even with reliable weights.
    lr = jnp.tile(jnp.array([0.003, -0.003]), 16).reshape(2, 16)
    _, _, m = fn(old, old - lr, mask)
    assert 0.0 < m.ais_lambda < 0.01

  @chex.variants(with_jit=True, without_jit=True)
  def test_weights_carry_no_gradient(self):
    def total(old, rollout):
      w, _, m = obj.rollout_correction(old, rollout, MASK, adaptive=True, renormalize=True)
      return jnp.sum(w) + m.ess + m.ais_lambda

    old = jnp.nan_to_num(OLD)
    rollout = jnp.nan_to_num(ROLLOUT, posinf=0.0)
    g_old, g_rollout = self.variant(jax.grad(total, argnums=(0, 1)))(old, rollout)
    np.testing.assert_array_equal(g_old, 0.0)
    np.testing.assert_array_equal(g_rollout, 0.0)

  @chex.variants(with_jit=True, without_jit=True)
  def test_masked_tokens_never_matter(self):
    kw = {"level": "sequence", "adaptive": True, "reject": "seq-max", "reject_high": 5.0}
    fn = self.variant(functools.partial(obj.rollout_correction, **kw))
    a = fn(OLD, ROLLOUT, MASK)
    other_old = jnp.where(VALID, OLD, -jnp.inf)
    other_rollout = jnp.where(VALID, ROLLOUT, jnp.nan)
    b = fn(other_old, other_rollout, MASK)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
      np.testing.assert_array_equal(x, y)
      assert np.all(np.isfinite(x))

  def test_extreme_log_ratios_are_finite(self):
    old = jnp.zeros((2, 3))
    rollout = jnp.array([[1e4, -1e4, 0.0], [-1e4, -1e4, 5.0]])
    # Clamped log rho = old - rollout: (-20, 20, 0 | 20, 20, -5).
    log_rho = np.array([[-20.0, 20.0, 0.0], [20.0, 20.0, -5.0]])
    k3 = np.mean(np.exp(log_rho) - 1 - log_rho)  # huge: severity = 1
    for level in ("token", "sequence"):
      w, _, m = obj.rollout_correction(
        old, rollout, jnp.ones((2, 3)), level=level, adaptive=True, renormalize=True
      )
      assert np.all(np.isfinite(w))
      assert all(np.isfinite(x) for x in m)
      # The same pipeline in float64 by hand.
      if level == "token":
        raw = np.exp(log_rho).ravel()
      else:
        raw = np.exp(np.clip(log_rho.sum(axis=1), -20, 20))  # e^0 and e^20
      trunc = np.minimum(raw, 2.0)
      lam = (1 - np.exp(-k3 / 1e-3)) * _ess(raw) * _ess(trunc)
      mixed = 1 + lam * (trunc - 1)
      want = mixed / mixed.mean()
      want = want.reshape(2, 3) if level == "token" else np.repeat(want[:, None], 3, axis=1)
      np.testing.assert_allclose(m.mismatch_k3, k3, rtol=1e-5)
      np.testing.assert_allclose(m.ais_lambda, lam, rtol=1e-4)
      np.testing.assert_allclose(m.ess_raw, _ess(raw), rtol=1e-4)
      np.testing.assert_allclose(w, want, rtol=1e-4)

  def test_bfloat16_inputs(self):
    w, _, m = obj.rollout_correction(
      OLD.astype(jnp.bfloat16), ROLLOUT.astype(jnp.bfloat16), MASK, level="token"
    )
    assert w.dtype == jnp.float32 and m.ess.dtype == jnp.float32

  def test_errors(self):
    f = functools.partial(obj.rollout_correction, OLD, ROLLOUT, MASK)
    with pytest.raises(ValueError, match="level"):
      f(level="batch")
    with pytest.raises(ValueError, match="reject"):
      f(reject="seq", reject_high=1.0)
    with pytest.raises(ValueError, match="reject_statistic"):
      f(reject="token", reject_statistic="k4", reject_high=1.0)
    with pytest.raises(ValueError, match="reject_low"):
      f(reject="token")
    with pytest.raises(ValueError, match="reject"):
      f(reject_high=2.0)
    with pytest.raises(ValueError, match="reject_low"):
      f(reject="token", reject_low=2.0, reject_high=0.5)
    with pytest.raises(ValueError, match="truncate"):
      f(truncate=0.0)
    with pytest.raises(ValueError, match="veto_threshold"):
      f(veto_threshold=-1.0)
    with pytest.raises(ValueError, match="adaptive"):
      f(level=None, adaptive=True)
    with pytest.raises(ValueError, match="rollout_logp"):
      obj.rollout_correction(OLD, ROLLOUT[:, :3], MASK)
    with pytest.raises(ValueError, match="mask"):
      obj.rollout_correction(OLD, ROLLOUT, MASK[:1])
