"""M2PO's clip-radius form (m2po_clip_bounds / m2po_loss): values by hand and properties."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlx import objectives


def _arrays(d, adv):
  """logp = 0, old_logp = d (so log r = -d), one row, all valid."""
  d = np.asarray([d], np.float32)
  return np.zeros_like(d), d, np.asarray([adv], np.float32), np.ones_like(d)


def test_bounds_by_hand():
  # Harmful: A > 0 with r > 1 (d < 0), A < 0 with r < 1 (d > 0).
  # d = -0.1 (A>0, harmful), -0.2 (A>0, harmful), 0.3 (A<0, harmful), 0.5 (A>0, r<1: not).
  logp, old, adv, mask = _arrays([-0.1, -0.2, 0.3, 0.5], [1.0, 1.0, -1.0, 1.0])
  b = objectives.m2po_clip_bounds(logp, old, adv, mask, m2_budget=0.02)
  v = np.array([0.01, 0.04, 0.09])  # the harmful d^2, sorted
  assert float(b.m2) == pytest.approx(v.mean())  # 0.0467 > 0.02: clip
  # Budget sum 0.06. Capping at 0.01 -> 0.03 < 0.06; at 0.04 -> 0.01 + 0.04 * 2 = 0.09 >= 0.06.
  # The reference takes the last breakpoint below: tau^2 = 0.01, tau = 0.1.
  assert float(b.clip_low) == pytest.approx(max(1 - np.exp(-0.1), 0.3))  # the floor, 0.3
  assert float(b.clip_high) == pytest.approx(max(np.expm1(0.1), 0.5))  # the floor, 0.5
  assert float(b.m2_after) == pytest.approx(0.01)
  # No floors: the radii are tau's.
  b = objectives.m2po_clip_bounds(
    logp, old, adv, mask, m2_budget=0.02, min_clip_low=0.0, min_clip_high=0.0
  )
  assert float(b.clip_low) == pytest.approx(1 - np.exp(-0.1), rel=1e-5)
  assert float(b.clip_high) == pytest.approx(np.expm1(0.1), rel=1e-5)
  # Within the budget: no clip at all.
  b = objectives.m2po_clip_bounds(logp, old, adv, mask, m2_budget=0.05)
  assert float(b.clip_low) == 1.0 and np.isinf(float(b.clip_high))
  assert float(b.m2_after) == pytest.approx(v.mean())


def test_first_breakpoint_already_over_budget_clips_to_the_floors():
  logp, old, adv, mask = _arrays([-2.0, -2.0], [1.0, 1.0])
  b = objectives.m2po_clip_bounds(logp, old, adv, mask, m2_budget=0.04)
  assert float(b.m2) == pytest.approx(4.0)
  assert (float(b.clip_low), float(b.clip_high)) == pytest.approx((0.3, 0.5))
  assert float(b.m2_after) == 0.0


def test_loss_is_ppo_with_those_radii_and_masked_tokens_do_not_count():
  rng = np.random.default_rng(0)
  b, t = 4, 6
  logp = jnp.asarray(rng.normal(-1.0, 0.3, (b, t)), jnp.float32)
  old = logp + jnp.asarray(rng.normal(0.0, 0.5, (b, t)), jnp.float32)
  adv = jnp.asarray(np.repeat(rng.normal(size=(b, 1)), t, 1), jnp.float32)
  mask = jnp.asarray(rng.random((b, t)) < 0.8, jnp.float32)
  loss, metrics = objectives.m2po_loss(logp, old, adv, mask)
  bounds = objectives.m2po_clip_bounds(logp, old, adv, mask)
  ref, _ = objectives.ppo_clip_loss(
    logp, old, adv, mask, clip_low=float(bounds.clip_low), clip_high=float(bounds.clip_high)
  )
  assert float(loss) == pytest.approx(float(ref), rel=1e-6)
  assert float(metrics.clip_frac_dual) == 0.0
  # Garbage at masked positions changes nothing.
  junk = jnp.where(mask > 0, old, 1e4)
  assert float(objectives.m2po_loss(logp, junk, adv, mask)[0]) == pytest.approx(float(loss))
  # The radii carry no gradient: the gradient is PPO's at fixed radii.
  g = jax.grad(lambda lp: objectives.m2po_loss(lp, old, adv, mask)[0])(logp)
  g_ref = jax.grad(
    lambda lp: objectives.ppo_clip_loss(
      lp, old, adv, mask, clip_low=bounds.clip_low, clip_high=bounds.clip_high
    )[0]
  )(logp)
  np.testing.assert_allclose(g, g_ref, rtol=1e-6, atol=1e-7)
  # Registered, jit-able.
  assert objectives.get_policy_loss("m2po") is objectives.m2po_loss
  assert float(jax.jit(objectives.m2po_loss)(logp, old, adv, mask)[0]) == pytest.approx(float(loss))


def test_on_policy_means_no_clip():
  logp = jnp.full((2, 3), -1.0)
  b = objectives.m2po_clip_bounds(logp, logp, jnp.ones((2, 3)), jnp.ones((2, 3)))
  assert float(b.m2) == 0.0 and float(b.clip_low) == 1.0 and np.isinf(float(b.clip_high))


@pytest.mark.parametrize(
  ("kwargs", "match"),
  [
    ({"m2_budget": -1.0}, "m2_budget"),
    ({"min_clip_low": 1.5}, "min_clip_low"),
    ({"min_clip_high": -0.1}, "min_clip_high"),
  ],
)
def test_bad_keywords_are_named(kwargs, match):
  logp, old, adv, mask = _arrays([0.1], [1.0])
  with pytest.raises(ValueError, match=match):
    objectives.m2po_clip_bounds(logp, old, adv, mask, **kwargs)
