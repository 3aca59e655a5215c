"""Hand-computed tests of the public pieces `rollout_correction` is composed of."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlx import objectives as obj

# log rho = old - rollout at the valid tokens; (0, 3) is NaN padding.
LOG_RHO = np.array([[0.1, 1.0, -0.2, 0.0], [0.0, -0.5, 0.3, -2.0]], np.float32)
MASK = np.array([[1, 1, 1, 0], [1, 1, 1, 1]], np.float32)
VALID = MASK > 0
OLD = jnp.array([[-1.0, -2.0, -0.5, jnp.nan], [-0.3, -1.2, -2.0, -0.7]])
ROLLOUT = jnp.where(VALID, OLD - LOG_RHO, jnp.inf)


def _ess(w):
  w = np.asarray(w, np.float64)
  return w.sum() ** 2 / (w.size * np.square(w).sum())


def test_effective_sample_size():
  np.testing.assert_allclose(obj.effective_sample_size(jnp.array([1.0, 3.0])), 16 / 20, 1e-6)
  # Equal weights -> 1; one weight carrying everything -> 1/n.
  np.testing.assert_allclose(obj.effective_sample_size(jnp.full((5,), 7.0)), 1.0, 1e-6)
  np.testing.assert_allclose(obj.effective_sample_size(jnp.array([0.0, 0.0, 2.0, 0.0])), 0.25)
  # Invalid entries (NaN here) are ignored; e^20-sized weights do not overflow.
  w = jnp.array([[jnp.exp(20.0), jnp.nan], [jnp.exp(20.0), 1.0]])
  valid = jnp.array([[1, 0], [1, 1]])
  np.testing.assert_allclose(obj.effective_sample_size(w, valid), _ess([1, 1, np.exp(-20)]), 1e-5)
  # No valid entry or all-zero weights: 1.
  np.testing.assert_allclose(obj.effective_sample_size(w, jnp.zeros((2, 2))), 1.0)
  np.testing.assert_allclose(obj.effective_sample_size(jnp.zeros(3)), 1.0)
  assert jax.jit(obj.effective_sample_size)(jnp.array([1.0, 3.0])).dtype == jnp.float32
  with pytest.raises(ValueError, match="`valid` must have the shape of `weights`"):
    obj.effective_sample_size(jnp.ones(3), jnp.ones(2))
  with pytest.raises(ValueError, match="`weights` must be .*zero-size"):
    obj.effective_sample_size(jnp.ones((0,)))


def test_vcpo_uses_the_same_ess():
  w = jnp.array([0.5, 2.0, 4.0, 9.0])
  valid = jnp.array([True, True, False, True])
  ess, factor = obj.vcpo_lr_factor(w, valid=valid)
  np.testing.assert_allclose(ess, obj.effective_sample_size(w, valid), rtol=1e-7)
  np.testing.assert_allclose(ess, _ess([0.5, 2.0, 9.0]), rtol=1e-6)
  np.testing.assert_allclose(factor, np.sqrt(_ess([0.5, 2.0, 9.0])), rtol=1e-6)


def test_rollout_mismatch_kl():
  m = obj.rollout_mismatch_kl(OLD, ROLLOUT, MASK)
  assert isinstance(m, obj.MismatchKL)
  lr = LOG_RHO[VALID].astype(np.float64)
  np.testing.assert_allclose(m.k1, -lr.mean(), rtol=1e-5)
  np.testing.assert_allclose(m.k3, (np.exp(lr) - 1 - lr).mean(), rtol=1e-5)
  # Same numbers as the correction's metrics, whatever the correction does.
  for kwargs in ({}, {"level": None, "reject": "token", "reject_high": 1.5}):
    _, _, rc = obj.rollout_correction(OLD, ROLLOUT, MASK, **kwargs)
    np.testing.assert_allclose([rc.mismatch_k1, rc.mismatch_k3], [m.k1, m.k3], rtol=1e-6)
  # A k3 beyond verl's +-10 penalty clamp is reported in full: log rho = -12.
  big = obj.rollout_mismatch_kl(jnp.zeros((1, 1)), jnp.full((1, 1), 12.0), jnp.ones((1, 1)))
  np.testing.assert_allclose(big.k3, np.exp(-12.0) - 1 + 12, rtol=1e-6)
  np.testing.assert_allclose(big.k1, 12.0, rtol=1e-6)
  empty = obj.rollout_mismatch_kl(OLD, ROLLOUT, jnp.zeros((2, 4)))
  np.testing.assert_array_equal([empty.k1, empty.k3], 0.0)


def test_rollout_veto_mask():
  keep = obj.rollout_veto_mask(OLD, ROLLOUT, MASK, threshold=0.2)  # e^-2 < 0.2 in row 1
  assert keep.dtype == jnp.bool_
  np.testing.assert_array_equal(keep, [[1, 1, 1, 0], [0, 0, 0, 0]])
  np.testing.assert_array_equal(obj.rollout_veto_mask(OLD, ROLLOUT, MASK, threshold=0.1), VALID)
  # Beyond the +-20 clamp: rho = e^-30 is below 1e-12.
  old, rollout = jnp.zeros((2, 2)), jnp.array([[30.0, 0.0], [0.0, 0.0]])
  keep = obj.rollout_veto_mask(old, rollout, jnp.ones((2, 2)), threshold=1e-12)
  np.testing.assert_array_equal(keep, [[0, 0], [1, 1]])
  with pytest.raises(ValueError, match="`threshold` must be > 0"):
    obj.rollout_veto_mask(OLD, ROLLOUT, MASK, threshold=jnp.float32(0.0))


@pytest.mark.parametrize(
  "level, statistic, low, high, want",
  [
    # rho in [0.5, 2]: e^1 and e^-2 are out.
    ("token", "ratio", 0.5, 2.0, [[1, 0, 1, 0], [1, 1, 1, 0]]),
    # k2 = (log rho)^2 / 2 <= 0.1: 0.005, 0.5, 0.02 | 0, 0.125, 0.045, 2.
    ("token", "k2", None, 0.1, [[1, 0, 1, 0], [1, 0, 1, 0]]),
    # seq-mean k1 = -(0.9 / 3), -(-2.2 / 4) = -0.3, 0.55.
    ("seq-mean", "k1", -0.5, 0.5, [[1, 1, 1, 0], [0, 0, 0, 0]]),
    # seq-max k3: max(e^1 - 2, ...) = 0.718 and e^-2 + 1 = 1.135.
    ("seq-max", "k3", None, 1.0, [[1, 1, 1, 0], [0, 0, 0, 0]]),
    # seq-sum ratio: e^0.9 = 2.46 and e^-2.2 = 0.11.
    ("seq-sum", "ratio", 0.1, 2.0, [[0, 0, 0, 0], [1, 1, 1, 1]]),
  ],
)
def test_rollout_rejection_mask(level, statistic, low, high, want):
  keep = obj.rollout_rejection_mask(
    OLD, ROLLOUT, MASK, level=level, statistic=statistic, low=low, high=high
  )
  np.testing.assert_array_equal(keep, want)


def test_rollout_rejection_mask_errors():
  f = obj.rollout_rejection_mask
  with pytest.raises(ValueError, match="needs `low` and/or `high`"):
    f(OLD, ROLLOUT, MASK, level="token")
  with pytest.raises(ValueError, match="`level` must be one of"):
    f(OLD, ROLLOUT, MASK, level="batch", high=1.0)
  with pytest.raises(ValueError, match="`statistic` must be one of"):
    f(OLD, ROLLOUT, MASK, level="token", statistic="k4", high=1.0)
  with pytest.raises(ValueError, match="`low`"):
    f(OLD, ROLLOUT, MASK, level="token", low=jnp.float32(2.0), high=jnp.float32(1.0))
  with pytest.raises(ValueError, match="`low` must be >= 0"):
    f(OLD, ROLLOUT, MASK, level="token", low=-1.0)


def test_token_and_sequence_importance_weights():
  w = obj.token_importance_weights(OLD, ROLLOUT, MASK)
  np.testing.assert_allclose(w, np.where(VALID, np.exp(LOG_RHO), 0.0), rtol=1e-6)
  seq = obj.sequence_importance_weights(OLD, ROLLOUT, MASK)
  np.testing.assert_allclose(seq, np.exp([0.9, -2.2]), rtol=1e-5)
  # Per-token and summed clamps: log rho = 30 and 5 -> 20 + 5 = 25 -> e^20.
  old = jnp.zeros((2, 2))
  rollout = jnp.array([[-30.0, -5.0], [0.0, 0.0]])
  np.testing.assert_allclose(
    obj.sequence_importance_weights(old, rollout, jnp.ones((2, 2))), [np.exp(20.0), 1.0], 1e-6
  )
  # An empty sequence has weight 1; nothing is differentiated.
  np.testing.assert_allclose(obj.sequence_importance_weights(old, rollout, jnp.zeros((2, 2))), 1.0)
  g = jax.grad(lambda o: jnp.sum(obj.sequence_importance_weights(o, rollout, jnp.ones((2, 2)))))
  np.testing.assert_array_equal(g(old), 0.0)


def test_renormalize_weights():
  w = jnp.array([1.0, 3.0, 100.0])
  valid = jnp.array([True, True, False])
  np.testing.assert_allclose(obj.renormalize_weights(w, valid), [0.5, 1.5, 50.0], rtol=1e-6)
  np.testing.assert_allclose(obj.renormalize_weights(w, jnp.zeros(3, bool)), w)
  with pytest.raises(ValueError, match="`valid` must have the shape of `weights`"):
    obj.renormalize_weights(w, valid[:2])


def test_adaptive_is_lambda():
  raw = jnp.array([1.0, 4.0, 2.0])
  weights = jnp.minimum(raw, 2.0)
  valid = jnp.array([True, True, True])
  lam = obj.adaptive_is_lambda(raw, weights, valid, mismatch_kl=2e-3, kl_scale=1e-3)
  want = (1 - np.exp(-2.0)) * _ess([1, 4, 2]) * _ess([1, 2, 2])
  np.testing.assert_allclose(lam, want, rtol=1e-5)
  # Identical policies: KL 0 -> lambda 0.
  np.testing.assert_allclose(
    obj.adaptive_is_lambda(raw, weights, valid, mismatch_kl=jnp.float32(0.0)), 0.0
  )
  with pytest.raises(ValueError, match="`kl_scale` must be > 0"):
    obj.adaptive_is_lambda(raw, weights, valid, mismatch_kl=1.0, kl_scale=jnp.float32(-1.0))
  with pytest.raises(ValueError, match="`weights` must have the shape of `raw_weights`"):
    obj.adaptive_is_lambda(raw, weights[:2], valid, mismatch_kl=1.0)


def test_rollout_correction_is_the_composition_of_its_pieces():
  kw = dict(
    level="sequence",
    truncate=2.0,
    adaptive=True,
    renormalize=True,
    reject="token",
    reject_high=2.0,
    veto_threshold=0.1,
  )
  w, new_mask, m = obj.rollout_correction(OLD, ROLLOUT, MASK, **kw)
  keep = obj.rollout_veto_mask(OLD, ROLLOUT, MASK, threshold=0.1)
  keep &= obj.rollout_rejection_mask(OLD, ROLLOUT, MASK, level="token", high=2.0)
  units = jnp.any(keep, axis=1)
  raw = obj.sequence_importance_weights(OLD, ROLLOUT, MASK)
  trunc = jnp.minimum(raw, 2.0)
  kl = obj.rollout_mismatch_kl(OLD, ROLLOUT, keep).k3
  lam = obj.adaptive_is_lambda(raw, trunc, units, mismatch_kl=kl)
  seq = obj.renormalize_weights(1 + lam * (trunc - 1), units)
  np.testing.assert_array_equal(new_mask, keep)
  np.testing.assert_allclose(w, jnp.where(keep, seq[:, None], 0.0), rtol=1e-6)
  np.testing.assert_allclose(m.ais_lambda, lam, rtol=1e-6)
  np.testing.assert_allclose(m.ess_raw, obj.effective_sample_size(raw, units), rtol=1e-6)


def test_sequence_weights_use_the_sampled_tokens():
  # A filter (e.g. M2PO) removed token (1, 3) with log rho = -2 from the mask.
  filtered = MASK.copy()
  filtered[1, 3] = 0
  w, new_mask, _ = obj.rollout_correction(
    OLD, ROLLOUT, filtered, level="sequence", truncate=None, sampled_mask=MASK
  )
  np.testing.assert_array_equal(new_mask, filtered)
  # Row 1's weight is e^(0 - 0.5 + 0.3 - 2) over all four sampled tokens.
  np.testing.assert_allclose(w[1, :3], np.exp(-2.2), rtol=1e-5)
  np.testing.assert_array_equal(w[1, 3], 0.0)
  # Without it the weight covers only the filtered mask: e^(-0.2).
  w, _, _ = obj.rollout_correction(OLD, ROLLOUT, filtered, level="sequence", truncate=None)
  np.testing.assert_allclose(w[1, :3], np.exp(-0.2), rtol=1e-5)
  with pytest.raises(ValueError, match=r"`sampled_mask` must cover `mask`: token \(1, 3\)"):
    obj.rollout_correction(OLD, ROLLOUT, MASK, level="sequence", sampled_mask=filtered)
  with pytest.raises(ValueError, match="`sampled_mask` must have the shape"):
    obj.rollout_correction(OLD, ROLLOUT, MASK, sampled_mask=MASK[:, :2])
