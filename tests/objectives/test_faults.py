"""Bad input to the public objectives: hyper-parameter bounds, zero-size arrays, non-finite rewards.

Each class of fault is checked across every function it applies to: a value
known at call time (Python number or concrete `jax.Array`) is checked, a traced
one passes through.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlx import objectives as obj

X = jnp.zeros((2, 3))
M = jnp.ones((2, 3))


def _loss(name, **hyper):
  spec = obj.get_policy_loss_spec(name)
  extra = {k: X for k in spec.extra_inputs}
  return spec.fn(X, X, X, M, **extra, **hyper)


# (loss, keyword, bad value, message fragment). Every bound of every loss.
BAD_HYPER = [
  ("ppo", "clip_low", 1.0, r"`clip_low` must be in \[0.0, 1.0\)"),
  ("ppo", "clip_low", 1.5, "remove it"),
  ("ppo", "clip_low", -0.1, "`clip_low`"),
  ("ppo", "clip_high", -0.1, "`clip_high` must be >= 0"),
  ("ppo", "dual_clip", 1.0, "`dual_clip` must be > 1"),
  ("gspo", "clip_low", 1.0, "`clip_low` must be in"),
  ("gspo", "clip_high", -1e-4, "`clip_high`"),
  ("minpro", "clip_low", 1.2, "`clip_low` must be in"),
  ("minpro", "clip_high", -0.2, "`clip_high`"),
  ("minpro", "dual_clip", 0.5, "`dual_clip`"),
  ("cispo", "clip_low", 1.5, r"`clip_low` must be in \[0.0, 1.0\]"),
  ("cispo", "clip_low", -0.5, "`clip_low`"),
  ("cispo", "clip_high", -0.2, "`clip_high`"),
  ("aspo", "clip_low", 1.0, "`clip_low` must be in"),
  ("aspo", "clip_high", -0.2, "`clip_high`"),
  ("aspo", "high_entropy_clip_low", 1.0, "`high_entropy_clip_low` must be in"),
  ("aspo", "high_entropy_clip_high", -0.4, "`high_entropy_clip_high`"),
  ("aspo", "dual_clip", 1.0, "`dual_clip`"),
  ("aspo", "positive_dual_clip", 0.5, "`positive_dual_clip`"),
  ("aspo", "high_entropy_fraction", -0.1, "`high_entropy_fraction`"),
  ("ctpo", "clip_low", -0.01, "`clip_low`"),
  ("ctpo", "clip_high", -0.01, "`clip_high`"),
  ("ctpo", "dual_clip", 0.0, "`dual_clip` must be > 0"),
  ("ctpo", "position_power", np.inf, "`position_power`"),
  ("sapo", "tau_pos", 0.0, "`tau_pos` must be > 0"),
  ("sapo", "tau_neg", -1.0, "`tau_neg`"),
]


@pytest.mark.parametrize("name, key, value, match", BAD_HYPER)
@pytest.mark.parametrize("as_array", [False, True], ids=["python", "jax_array"])
def test_bad_loss_hyper_parameters(name, key, value, match, as_array):
  value = jnp.float32(value) if as_array else value
  with pytest.raises(ValueError, match=match):
    _loss(name, **{key: value})


@pytest.mark.parametrize("name", sorted(obj.POLICY_LOSS_SPECS))
def test_nan_hyper_parameters_are_rejected(name):
  key = {"sapo": "tau_pos"}.get(name, "clip_high")
  with pytest.raises(ValueError, match=f"`{key}`.*nan"):
    _loss(name, **{key: jnp.float32(np.nan)})


def test_edge_values_that_are_valid():
  # CISPO's default clip_low = 1 means no lower truncation; a zero-width PPO window.
  _loss("cispo", clip_low=1.0)
  _loss("ppo", clip_low=0.0, clip_high=0.0, dual_clip=None)
  _loss("ppo", clip_low=jnp.float32(0.999), dual_clip=jnp.float32(1.001))


def test_traced_hyper_parameters_are_not_checked():
  # Inside jit the value is unknown: an adaptive bound passes through.
  f = jax.jit(lambda c: obj.ppo_clip_loss(X, X, X, M, clip_low=c)[0])
  np.testing.assert_allclose(f(jnp.float32(1.5)), 0.0)  # A = 0 everywhere
  # ASPO's entropy fraction fixes a quantile at trace time: it must be static.
  g = jax.jit(lambda q: obj.aspo_loss(X, X, X, M, entropy=X, high_entropy_fraction=q)[0])
  with pytest.raises(ValueError, match="`high_entropy_fraction` must be a Python float"):
    g(0.2)


@pytest.mark.parametrize(
  "call, match",
  [
    (lambda v: obj.aggregate(X, M, "token-mean", scale=v(-1.0)), "`scale` must be >= 0"),
    (lambda v: obj.ppo_clip_loss(X, X, X, M, agg_scale=v(-1.0)), "`agg_scale`"),
    (lambda v: obj.grpo_advantages(jnp.ones((2, 3)), eps=v(-1e-6)), "`eps`"),
    (lambda v: obj.median_advantages(jnp.ones((2, 3)), eps=v(-1.0)), "`eps`"),
    (lambda v: obj.m2po_mask(X, X, M, tau=v(-0.1)), "`tau`"),
    (lambda v: obj.rollout_correction(X, X, M, truncate=v(0.0)), "`truncate`"),
    (lambda v: obj.rollout_correction(X, X, M, ais_kl_scale=v(0.0)), "`ais_kl_scale`"),
    (lambda v: obj.rollout_correction(X, X, M, veto_threshold=v(-1.0)), "`veto_threshold`"),
    (lambda v: obj.bapo_clip_bounds(X, X, X, M, c_low=v(0.0)), "`c_low`"),
    (lambda v: obj.bapo_clip_bounds(X, X, X, M, c_low_max=v(1.2)), "`c_low_max`"),
    (lambda v: obj.bapo_clip_bounds(X, X, X, M, c_high=v(0.9)), "`c_high` must be >= 1"),
    (lambda v: obj.bapo_clip_bounds(X, X, X, M, delta=v(0.0)), "`delta`"),
    (lambda v: obj.bapo_clip_bounds(X, X, X, M, rho0=v(0.0)), "`rho0`"),
    (lambda v: obj.bapo_clip_bounds(X, X, X, M, dual_clip=v(2.0)), "`c_high_max`"),
    (lambda v: obj.ctpo_clip_scale(M, position_power=v(np.nan)), "`position_power`"),
  ],
)
@pytest.mark.parametrize("kind", ["python", "jax_array"])
def test_bad_hyper_parameters_elsewhere(call, match, kind):
  wrap = float if kind == "python" else jnp.float32
  with pytest.raises(ValueError, match=match):
    call(wrap)


def test_median_mad_needs_positive_eps():
  binary = jnp.array([[1.0, 1.0, 0.0], [0.0, 0.0, 1.0]])
  for eps in (0.0, jnp.float32(0.0)):
    with pytest.raises(ValueError, match="`eps` must be > 0 with scale='mad'"):
      obj.median_advantages(binary, scale="mad", eps=eps)
  # The default eps = 1e-3 gives the reference's finite (large) values.
  adv, _ = obj.median_advantages(binary, scale="mad")
  np.testing.assert_allclose(adv, [[0.0, 0.0, -1e3], [0.0, 0.0, 1e3]], rtol=1e-5)


# Every public function that takes [B, T] data, called with B = 0 or T = 0.
TOKEN_FUNCTIONS = {
  **{
    f"loss_{name}": functools.partial(
      lambda x, spec: spec.fn(x, x, x, x, **{k: x for k in spec.extra_inputs}), spec=spec
    )
    for name, spec in obj.POLICY_LOSS_SPECS.items()
  },
  "token_log_ratio": lambda x: obj.token_log_ratio(x, x, x),
  "cumulative_log_ratio": lambda x: obj.cumulative_log_ratio(x, x, x),
  "sequence_log_ratio": lambda x: obj.sequence_log_ratio(x, x, x),
  "min_prefix_log_ratio": lambda x: obj.min_prefix_log_ratio(x, x, x),
  "aggregate": lambda x: obj.aggregate(x, x, "token-mean"),
  "kl_penalty": lambda x: obj.kl_penalty(x, x, "k3", mask=x),
  "rollout_correction": lambda x: obj.rollout_correction(x, x, x),
  "rollout_mismatch_kl": lambda x: obj.rollout_mismatch_kl(x, x, x),
  "rollout_veto_mask": lambda x: obj.rollout_veto_mask(x, x, x, threshold=1e-4),
  "rollout_rejection_mask": lambda x: obj.rollout_rejection_mask(x, x, x, level="token", high=2),
  "token_importance_weights": lambda x: obj.token_importance_weights(x, x, x),
  "sequence_importance_weights": lambda x: obj.sequence_importance_weights(x, x, x),
  "m2po_mask": lambda x: obj.m2po_mask(x, x, x),
  "bapo_clip_bounds": lambda x: obj.bapo_clip_bounds(x, x, x, x),
}
MASK_FUNCTIONS = {
  "aggregate_scale": lambda x: obj.aggregate_scale(x, "token-mean"),
  "ctpo_clip_scale": lambda x: obj.ctpo_clip_scale(x),
  "broadcast_to_tokens": lambda x: obj.broadcast_to_tokens(jnp.zeros(x.shape[:1]), x),
}


@pytest.mark.parametrize("shape", [(0, 3), (2, 0)], ids=["B0", "T0"])
@pytest.mark.parametrize("name", sorted(TOKEN_FUNCTIONS) + sorted(MASK_FUNCTIONS))
def test_zero_size_token_arrays(name, shape):
  fn = {**TOKEN_FUNCTIONS, **MASK_FUNCTIONS}[name]
  first = "mask" if name in MASK_FUNCTIONS else "(logp|old_logp|values|target_logp)"
  with pytest.raises(ValueError, match=rf"`{first}` must be \[B, T\] with B >= 1.*zero-size"):
    fn(jnp.zeros(shape))


@pytest.mark.parametrize("shape", [(0, 3), (2, 0)], ids=["groups0", "G0"])
@pytest.mark.parametrize(
  "fn",
  [obj.grpo_advantages, obj.drgrpo_advantages, obj.rloo_advantages, obj.median_advantages],
)
def test_zero_size_rewards(fn, shape):
  with pytest.raises(ValueError, match="`rewards` must be .*zero-size"):
    fn(jnp.zeros(shape))


def test_zero_size_weights():
  with pytest.raises(ValueError, match="`seq_weights`"):
    obj.vcpo_lr_factor(jnp.zeros((0,)))
  with pytest.raises(ValueError, match="`weights`.*zero-size"):
    obj.renormalize_weights(jnp.zeros((0,)), jnp.zeros((0,)))


ADVANTAGES = {
  "grpo": obj.grpo_advantages,
  "drgrpo": obj.drgrpo_advantages,
  "rloo": obj.rloo_advantages,
  "median": lambda r: obj.median_advantages(r)[0],
}


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("name", sorted(ADVANTAGES))
def test_non_finite_rewards_raise_eagerly_naming_the_group(name, bad):
  rewards = np.array([[1.0, 0.0, 1.0], [0.0, 1.0, 0.0], [1.0, 1.0, 0.0]], np.float32)
  rewards[2, 1] = bad
  for as_jax in (False, True):
    r = jnp.asarray(rewards) if as_jax else rewards
    with pytest.raises(ValueError, match=r"`rewards` must be finite: group 2 .* sample 1"):
      ADVANTAGES[name](r)


# Group 0 holds a NaN and an inf; group 1 is clean; group 2 is all NaN.
JIT_REWARDS = jnp.array(
  [[1.0, jnp.nan, 0.0, 2.0, jnp.inf], [1.0, 0.0, 0.0, 2.0, 1.0], [jnp.nan] * 5], jnp.float32
)


def _clean_group_reference(fn):
  """Advantages of group 0's finite members scored as a group of their own."""
  return np.asarray(fn(jnp.array([[1.0, 0.0, 2.0]])))[0]


@pytest.mark.parametrize("name", ["grpo", "drgrpo", "rloo"])
def test_non_finite_rewards_are_contained_under_jit(name):
  fn = ADVANTAGES[name]
  adv = np.asarray(jax.jit(fn)(JIT_REWARDS))
  assert np.isfinite(adv).all()
  # The non-finite members get 0, the finite ones the scores of their finite group.
  np.testing.assert_array_equal(adv[0, [1, 4]], 0.0)
  np.testing.assert_allclose(adv[0, [0, 2, 3]], _clean_group_reference(fn), rtol=1e-6)
  # By hand for group 0's finite rewards {1, 0, 2}: mean 1, unbiased std 1.
  want = {"grpo": [0.0, -1.0, 1.0], "drgrpo": [0.0, -1.0, 1.0], "rloo": [0.0, -1.5, 1.5]}
  np.testing.assert_allclose(adv[0, [0, 2, 3]], want[name], rtol=1e-5)
  # Other groups are untouched; an all-NaN group is all 0.
  np.testing.assert_allclose(adv[1], np.asarray(fn(JIT_REWARDS[1:2]))[0], rtol=1e-6)
  np.testing.assert_array_equal(adv[2], 0.0)


def test_non_finite_rewards_are_contained_under_jit_median():
  adv, keep = jax.jit(obj.median_advantages)(JIT_REWARDS)
  adv, keep = np.asarray(adv), np.asarray(keep)
  assert np.isfinite(adv).all()
  # Group 0: finite {1, 0, 2} -> median 1 (index 0) is the pivot, std 1.
  np.testing.assert_array_equal(keep[0], [0, 0, 1, 1, 0])
  np.testing.assert_allclose(adv[0], [0.0, 0.0, -1 / (1 + 1e-6), 1 / (1 + 1e-6), 0.0], 1e-6)
  ref_adv, ref_keep = obj.median_advantages(JIT_REWARDS[1:2])
  np.testing.assert_allclose(adv[1], ref_adv[0], rtol=1e-6)
  np.testing.assert_array_equal(keep[1], ref_keep[0])
  np.testing.assert_array_equal(adv[2], 0.0)
  np.testing.assert_array_equal(keep[2], 0.0)
