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
  ("vespo", "k_pos", -1.0, "`k_pos` must be >= 0"),
  ("vespo", "lambda_pos", -0.1, "`lambda_pos` must be >= 0"),
  ("vespo", "k_neg", np.inf, "`k_neg` must be finite"),
  ("vespo", "lambda_neg", np.inf, "`lambda_neg` must be finite"),
  ("sat", "clip_low", 1.0, "`clip_low` must be in"),
  ("sat", "clip_high", -0.1, "`clip_high`"),
  ("sat", "dual_clip", 1.0, "`dual_clip` must be > 1"),
  ("sat", "quantile", 0.0, r"`quantile` must be in \(0.0, 1.0\]"),
  ("sat", "quantile", 1.5, "`quantile`"),
  ("sat", "kernel_power", 0.0, "`kernel_power` must be > 0"),
]


@pytest.mark.parametrize("name, key, value, match", BAD_HYPER)
@pytest.mark.parametrize("as_array", [False, True], ids=["python", "jax_array"])
def test_bad_loss_hyper_parameters(name, key, value, match, as_array):
  value = jnp.float32(value) if as_array else value
  with pytest.raises(ValueError, match=match):
    _loss(name, **{key: value})


@pytest.mark.parametrize("name", sorted(obj.POLICY_LOSS_SPECS))
def test_nan_hyper_parameters_are_rejected(name):
  key = {"sapo": "tau_pos", "vespo": "k_pos", "m2po": "m2_budget"}.get(name, "clip_high")
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
  "sat_clip_bounds": lambda x: obj.sat_clip_bounds(x, x),
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
  first = "mask" if name in MASK_FUNCTIONS else "(logp|old_logp|values|target_logp|log_ratio)"
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


# --- Masks: only 0/1 or bool, checked when concrete. ---------------------------------------------

_W = jnp.ones((2, 3))
MASK_CALLS = {
  "ppo": (lambda m: obj.ppo_clip_loss(X, X, X, m), "mask"),
  "aspo": (lambda m: obj.aspo_loss(X, X, X, m, entropy=X), "mask"),
  "aggregate": (lambda m: obj.aggregate(X, m, "token-mean"), "mask"),
  "aggregate_scale": (lambda m: obj.aggregate_scale(m, "token-mean"), "mask"),
  "kl_penalty": (lambda m: obj.kl_penalty(X, X, "k1", mask=m), "mask"),
  "broadcast_to_tokens": (lambda m: obj.broadcast_to_tokens(jnp.zeros(2), m), "mask"),
  "rollout_correction": (lambda m: obj.rollout_correction(X, X, m), "mask"),
  "sampled_mask": (
    lambda m: obj.rollout_correction(X, X, M, level="sequence", sampled_mask=m),
    "sampled_mask",
  ),
  "m2po_mask": (lambda m: obj.m2po_mask(X, X, m), "mask"),
  "bapo_clip_bounds": (lambda m: obj.bapo_clip_bounds(X, X, X, m), "mask"),
  "sat_clip_bounds": (lambda m: obj.sat_clip_bounds(X, m), "mask"),
  "effective_sample_size": (lambda m: obj.effective_sample_size(_W, m), "valid"),
  "renormalize_weights": (lambda m: obj.renormalize_weights(_W, m), "valid"),
  "vcpo_lr_factor": (lambda m: obj.vcpo_lr_factor(_W.reshape(-1), valid=m.reshape(-1)), "valid"),
}


@pytest.mark.parametrize("name", sorted(MASK_CALLS))
def test_masks_other_than_zero_one_are_rejected(name):
  call, arg = MASK_CALLS[name]
  # A weight (0.5, 2), a sign slip (-1) and NaN would all be read as "counted".
  for bad in (0.5, 2.0, -1.0, np.nan):
    mask = np.ones((2, 3), np.float32)
    mask[1, 2] = bad
    at = r"\(5,\)" if name == "vcpo_lr_factor" else r"\(1, 2\)"
    with pytest.raises(ValueError, match=rf"`{arg}` must hold only 0/1 or bool values.*{at}"):
      call(jnp.asarray(mask))
  call(jnp.ones((2, 3), jnp.int32))  # 0/1 of any dtype, and bool, are fine
  call(jnp.ones((2, 3), bool))


def test_traced_masks_are_read_as_nonzero():
  # Under jit the values are unknown: documented as `mask != 0`.
  f = jax.jit(lambda m: obj.aggregate(jnp.arange(6.0).reshape(2, 3), m, "token-mean"))
  np.testing.assert_allclose(f(jnp.array([[2.0, 0.0, 0.0], [0.0, -1.0, 0.0]])), 2.0)


# --- Data arrays: None, strings and complex values name the argument. ----------------------------


@pytest.mark.parametrize("name", sorted(TOKEN_FUNCTIONS) + sorted(MASK_FUNCTIONS))
def test_data_arrays_must_be_real(name):
  fn = {**TOKEN_FUNCTIONS, **MASK_FUNCTIONS}[name]
  first = "mask" if name in MASK_FUNCTIONS else "(logp|old_logp|values|target_logp|log_ratio)"
  with pytest.raises(ValueError, match=rf"`{first}` must hold real numbers.*complex64"):
    fn(jnp.zeros((2, 3), jnp.complex64))
  with pytest.raises(ValueError, match=rf"`{first}` must hold real numbers.*<U1"):
    fn(np.full((2, 3), "a"))


FLOAT_INPUTS = [
  (name, arg)
  for name, spec in sorted(obj.POLICY_LOSS_SPECS.items())
  if name in obj.POLICY_LOSSES
  for arg in ("logp", "old_logp", "advantages", "is_weights", *spec.extra_inputs)
]


@pytest.mark.parametrize("dtype", [jnp.int32, jnp.bool_])
@pytest.mark.parametrize("name, arg", FLOAT_INPUTS)
def test_loss_data_must_be_floating(name, arg, dtype):
  """An integer log-prob is a caller bug, named on entry instead of failing inside `jax.grad`."""
  spec = obj.get_policy_loss_spec(name)
  data = dict(logp=X, old_logp=X, advantages=X, is_weights=M, **{k: X for k in spec.extra_inputs})
  data[arg] = jnp.zeros((2, 3), dtype)
  logp, old_logp, advantages = data.pop("logp"), data.pop("old_logp"), data.pop("advantages")
  match = rf"`{arg}` must be a floating array .*got dtype {jnp.dtype(dtype)}"
  with pytest.raises(ValueError, match=match):
    spec.fn(logp, old_logp, advantages, M, **data)
  with pytest.raises(ValueError, match=match):  # traced too: the dtype is static
    jax.jit(lambda *a: spec.fn(*a, M, **data))(logp, old_logp, advantages)


@pytest.mark.parametrize(
  "call, arg",
  [
    (lambda: obj.kl_penalty(X, jnp.zeros((2, 3), jnp.int32), "k3"), "ref_logp"),
    (lambda: obj.rollout_correction(X, np.zeros((2, 3), np.int64), M), "rollout_logp"),
    (lambda: obj.token_importance_weights([[0, 0, 0], [0, 0, 0]], X, M), "target_logp"),
    (lambda: obj.rollout_mismatch_kl(jnp.zeros((2, 3), jnp.int8), X, M), "old_logp"),
    (lambda: obj.token_log_ratio(X, jnp.zeros((2, 3), jnp.int32), M), "old_logp"),
  ],
)
def test_log_probabilities_must_be_floating_elsewhere(call, arg):
  with pytest.raises(ValueError, match=rf"`{arg}` must be a floating array"):
    call()


@pytest.mark.parametrize(
  "call, arg",
  [
    (lambda: obj.ppo_clip_loss(None, X, X, M), "logp"),
    (lambda: obj.gspo_loss(X, X, X, None), "mask"),
    (lambda: obj.kl_penalty(X, None, "k1"), "ref_logp"),
    (lambda: obj.rollout_correction(X, X, None), "mask"),
    (lambda: obj.grpo_advantages(None), "rewards"),
    (lambda: obj.broadcast_to_tokens(None, M), "seq_values"),
    (lambda: obj.effective_sample_size(None), "weights"),
  ],
)
def test_missing_data_arrays_name_the_argument(call, arg):
  with pytest.raises(ValueError, match=rf"`{arg}` must be an array, got None"):
    call()


def test_lists_and_low_precision_inputs_are_accepted():
  lp = [[-1.0, -2.0, -0.5], [-0.3, -0.7, -1.1]]
  want = obj.ppo_clip_loss(jnp.asarray(lp), X, X + 1.0, M)[0]
  np.testing.assert_allclose(obj.ppo_clip_loss(lp, X, X + 1.0, M)[0], want)
  got = obj.ppo_clip_loss(jnp.asarray(lp, jnp.bfloat16), X, X + 1.0, M.astype(bool))[0]
  np.testing.assert_allclose(got, want, rtol=1e-2)
  np.testing.assert_allclose(
    obj.grpo_advantages([[1.0, 0.0]]), [[1 / (2**0.5 + 1e-6), -0.707]], 1e-3
  )


# --- Hyper-parameters: real scalars only; flags are bools. ---------------------------------------

# (call taking the value, keyword, whether None is accepted, a valid value).
SCALAR_HYPER = [
  (lambda v: _loss("ppo", clip_low=v), "clip_low", False, 0.5),
  (lambda v: _loss("ppo", dual_clip=v), "dual_clip", True, 3.0),
  (lambda v: _loss("gspo", clip_high=v), "clip_high", False, 0.5),
  (lambda v: _loss("cispo", clip_high=v), "clip_high", False, 0.5),
  (lambda v: _loss("sapo", tau_neg=v), "tau_neg", False, 0.5),
  (lambda v: _loss("ctpo", clip_low=v), "clip_low", False, 0.5),
  (lambda v: _loss("ctpo", position_power=v), "position_power", True, 0.5),
  (lambda v: _loss("minpro", clip_high=v), "clip_high", False, 0.5),
  (lambda v: _loss("aspo", dual_clip=v), "dual_clip", False, 3.0),
  (lambda v: _loss("aspo", high_entropy_fraction=v), "high_entropy_fraction", False, 0.5),
  (lambda v: _loss("vespo", lambda_neg=v), "lambda_neg", False, 0.5),
  (lambda v: _loss("sat", quantile=v), "quantile", False, 0.5),
  (lambda v: _loss("sat", clip_low=v), "clip_low", False, 0.5),
  (lambda v: _loss("ppo", agg_scale=v), "agg_scale", True, 0.5),
  (lambda v: obj.aggregate(X, M, "token-mean", scale=v), "scale", True, 0.5),
  (lambda v: obj.grpo_advantages(jnp.ones((2, 3)), eps=v), "eps", False, 0.5),
  (lambda v: obj.median_advantages(jnp.ones((2, 3)), eps=v), "eps", True, 0.5),
  (lambda v: obj.m2po_mask(X, X, M, tau=v), "tau", False, 0.5),
  (lambda v: obj.rollout_correction(X, X, M, truncate=v), "truncate", True, 2.0),
  (
    lambda v: obj.rollout_correction(X, X, M, reject="token", reject_high=v),
    "reject_high",
    None,
    2.0,
  ),
  (lambda v: obj.rollout_veto_mask(X, X, M, threshold=v), "threshold", False, 0.0001),
  (
    lambda v: obj.rollout_rejection_mask(X, X, M, level="token", low=0.5, high=v),
    "high",
    True,
    2.0,
  ),
  (lambda v: obj.bapo_clip_bounds(X, X, X, M, rho0=v), "rho0", False, 0.5),
  (lambda v: obj.ctpo_clip_scale(M, position_power=v), "position_power", False, 0.5),
  (
    lambda v: obj.adaptive_is_lambda(_W, _W, M, mismatch_kl=0.1, kl_scale=v),
    "kl_scale",
    False,
    0.5,
  ),
]


@pytest.mark.parametrize("index", range(len(SCALAR_HYPER)))
def test_hyper_parameters_must_be_real_scalars(index):
  call, key, none_ok, good = SCALAR_HYPER[index]
  # A string, a complex number and a bool.
  for bad in (str(good), good + 0j, True):
    with pytest.raises(ValueError, match=rf"`{key}` must be a real number"):
      call(bad)
  # A vector would broadcast per token.
  rank0 = r"(be a scalar \(rank 0\)|have rank 0), got shape \(3,\)"
  with pytest.raises(ValueError, match=rf"`{key}` must {rank0}"):
    call(jnp.full((3,), good))
  call(np.float32(good))  # NumPy scalars and 0-d arrays are fine
  call(jnp.asarray(good))
  if none_ok is False:
    with pytest.raises(ValueError, match=rf"`{key}` must be a real number, got None"):
      call(None)
  elif none_ok:
    call(None)


@pytest.mark.parametrize(
  "call, key, match",
  [
    (lambda v: _loss("sapo", tau_pos=v), "tau_pos", "finite"),  # gate 0: no gradient at all
    (lambda v: _loss("ppo", agg_scale=v), "agg_scale", "finite"),  # loss 0
    (lambda v: obj.grpo_advantages(jnp.ones((2, 3)), eps=v), "eps", "finite"),
    (lambda v: obj.m2po_mask(X, X, M, tau=v), "tau", "finite"),
    (lambda v: obj.adaptive_is_lambda(_W, _W, M, mismatch_kl=v), "mismatch_kl", "in"),
  ],
)
def test_infinite_or_negative_hyper_parameters(call, key, match):
  bad = -0.1 if key == "mismatch_kl" else np.inf
  with pytest.raises(ValueError, match=rf"`{key}` must be (>= 0|{match})"):
    call(bad)


@pytest.mark.parametrize(
  "call, key",
  [
    (lambda v: obj.grpo_advantages(jnp.ones((2, 3)), normalize_std=v), "normalize_std"),
    (lambda v: _loss("minpro", inclusive=v), "inclusive"),
    (lambda v: _loss("minpro", cap_prefix=v), "cap_prefix"),
    (lambda v: obj.min_prefix_log_ratio(X, X, M, inclusive=v), "inclusive"),
    (lambda v: obj.rollout_correction(X, X, M, renormalize=v), "renormalize"),
    (lambda v: obj.rollout_correction(X, X, M, adaptive=v), "adaptive"),
  ],
)
def test_flags_must_be_bools(call, key):
  # The string "False" is truthy: it would silently select the other branch.
  with pytest.raises(ValueError, match=rf"`{key}` must be a bool, got 'False'"):
    call("False")
  with pytest.raises(ValueError, match=rf"`{key}` must be a Python bool .* traced"):
    jax.jit(call)(False)
  call(np.bool_(False))


def test_zero_scale_gives_zero_and_weights_must_be_non_negative():
  # A zero denominator gives 0 (documented), whatever the numerator.
  np.testing.assert_array_equal(obj.aggregate(M, M, "token-mean", scale=0.0), 0.0)
  for call, key in [
    (lambda w: obj.effective_sample_size(w), "weights"),
    (lambda w: obj.renormalize_weights(w, jnp.ones(3)), "weights"),
    (lambda w: obj.vcpo_lr_factor(w), "seq_weights"),
  ]:
    for bad in (-1.0, np.inf, np.nan):
      with pytest.raises(ValueError, match=rf"`{key}` must be finite and >= 0.*index \(1,\)"):
        call(jnp.array([1.0, bad, 2.0]))
  # Invalid entries are never read.
  np.testing.assert_allclose(
    obj.effective_sample_size(jnp.array([1.0, np.nan]), jnp.array([1, 0])), 1
  )


@pytest.mark.parametrize("name", ["grpo", "rloo", "median"])
def test_extreme_rewards_keep_their_advantages(name):
  # 1e30 squares to inf in float32; statistics are taken on rewards / 2^k (exact).
  def reference(r):
    r = np.asarray(r, np.float64)
    if name == "rloo":
      return r - (r.sum(1, keepdims=True) - r) / (r.shape[1] - 1)
    mean = np.median(r, axis=1, keepdims=True) if name == "median" else r.mean(1, keepdims=True)
    return (r - mean) / (r.std(1, ddof=1, keepdims=True) + 1e-6)  # the default eps

  for r in ([[1e30, -1e30, 0.0]], [[3e38, -1e38, 1e38]], [[1e-30, -2e-30, 0.0]]):
    got = np.asarray(ADVANTAGES[name](jnp.asarray(r, jnp.float32)))
    want = reference(r)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-6 * np.abs(want).max())
