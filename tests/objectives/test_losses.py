"""Behaviour tests shared by every policy loss of rlx.objectives (POLICY_LOSSES).

Hand-computed values per loss live in test_loss_values.py, CTPO's position
window in test_ctpo.py, VESPO's kernel in test_vespo.py, SAT's radii in test_sat.py.
"""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized
from jax import test_util as jtu

import rlx.objectives
from rlx.objectives import (
  AGG_MODES,
  POLICY_LOSSES,
  PolicyLossMetrics,
  aggregate,
  aggregate_scale,
  get_policy_loss,
)

NAMES = tuple(POLICY_LOSSES)
NAMED = [(n, n) for n in NAMES]
DATA_KEYS = ("logp", "old_logp", "advantages", "mask", "is_weights", "entropy")
# Hyper-parameters that make every clip inactive for small log-ratios (the
# policy-gradient reduction test); GSPO/CTPO defaults are tight by design.
WIDE = {
  "ppo": dict(clip_low=0.5, clip_high=0.5),
  "gspo": dict(clip_low=0.5, clip_high=0.5),
  "ctpo": dict(clip_low=1.0, clip_high=1.0, dual_clip=1.0),
  "minpro": dict(clip_low=0.5, clip_high=0.5),
  "cispo": dict(clip_low=0.5, clip_high=0.5),
  "sapo": dict(),
  "aspo": dict(clip_low=0.5, clip_high=0.5),
  "vespo": dict(),
  "sat": dict(clip_low=0.5, clip_high=0.5),
  "m2po": dict(),
}
# VESPO folds `is_weights` into its sequence ratio instead of multiplying the
# per-token loss; where a test expects the multiplied form it gets weights 1.
FOLDS_IS_WEIGHTS = ("vespo",)
# SAT's tail threshold is the quantile of the batch passed in (the paper's
# micro-batch quantile), so splitting a batch can change its loss by design.
# M2PO's radii likewise come from the second moment of the batch passed in.
BATCH_RELATIVE = ("sat", "m2po")
DEFAULT_AGG = {"gspo": "seq-mean-token-mean"}
# Non-default values of every float hyper-parameter (and agg_scale), traced under jit.
TRACED = {
  "ppo": dict(clip_low=0.1, clip_high=0.3, dual_clip=2.0, agg_scale=7.0),
  "gspo": dict(clip_low=0.1, clip_high=0.3, agg_scale=3.0),
  "ctpo": dict(clip_low=0.1, clip_high=0.3, dual_clip=0.2, position_power=0.4, agg_scale=7.0),
  "minpro": dict(clip_low=0.1, clip_high=0.3, dual_clip=2.0, agg_scale=7.0),
  "cispo": dict(clip_low=0.1, clip_high=0.3, agg_scale=7.0),
  "sapo": dict(tau_pos=0.7, tau_neg=1.3, agg_scale=7.0),
  "aspo": dict(
    clip_low=0.1,
    clip_high=0.3,
    high_entropy_clip_low=0.3,
    high_entropy_clip_high=0.5,
    dual_clip=2.0,
    positive_dual_clip=1.5,
    agg_scale=7.0,
  ),
  "vespo": dict(k_pos=1.5, lambda_pos=2.5, k_neg=2.5, lambda_neg=1.5, agg_scale=7.0),
  "sat": dict(
    clip_low=0.1, clip_high=0.3, dual_clip=2.0, quantile=0.8, kernel_power=1.5, agg_scale=7.0
  ),
  "m2po": dict(m2_budget=0.01, min_clip_low=0.2, min_clip_high=0.4, agg_scale=7.0),
}


def make_data(seed=0, *, batch=4, length=7, noise=0.3, pad=np.nan):
  """Random `[B, T]` loss inputs with a masked middle token and right padding."""
  rng = np.random.default_rng(seed)
  old_logp = -rng.uniform(0.1, 3.0, (batch, length))
  logp = old_logp + rng.normal(0.0, noise, (batch, length))
  advantages = rng.normal(size=(batch, 1)) + 0.3 * rng.normal(size=(batch, length))
  lengths = rng.integers(2, length + 1, size=batch)
  lengths[0] = length
  mask = (np.arange(length)[None, :] < lengths[:, None]).astype(np.float32)
  mask[0, 2] = 0.0  # a masked span (e.g. a tool output) inside a sequence
  data = dict(
    logp=logp,
    old_logp=old_logp,
    advantages=advantages,
    mask=mask,
    is_weights=rng.uniform(0.5, 1.5, (batch, length)),
    entropy=rng.uniform(0.0, 3.0, (batch, length)),
  )
  data = {k: v.astype(np.float32) for k, v in data.items()}
  for key in DATA_KEYS:
    if key != "mask":
      data[key][mask == 0] = pad
  return data


def loss_fn(name, agg=None, **hyper):
  """`f(logp, old_logp, advantages, mask, is_weights, entropy) -> (loss, metrics)`."""
  spec = rlx.objectives.get_policy_loss_spec(name)
  loss = spec.fn
  agg = agg or DEFAULT_AGG.get(name, "token-mean")

  def f(logp, old_logp, advantages, mask, is_weights, entropy):
    extra = {key: {"entropy": entropy}[key] for key in spec.extra_inputs}
    return loss(logp, old_logp, advantages, mask, is_weights=is_weights, agg=agg, **hyper, **extra)

  return f


def call(f, data):
  return f(*(data[k] for k in DATA_KEYS))


GRAD_ARGNUMS = (0, 1, 2, 4, 5)  # logp, old_logp, advantages, is_weights, entropy


def evaluate(name, aggs, **hyper):
  """One function computing, for every mode in `aggs`, loss, metrics and gradients.

  Returns `g(logp, old_logp, advantages, mask, is_weights, entropy) ->
  (losses [len(aggs)], [metrics per agg], grads)` where `grads[k]` is the
  Jacobian of the losses w.r.t. argument `GRAD_ARGNUMS[k]`, `[len(aggs), B, T]`.
  Bundling keeps the number of jit compilations to one per call site.
  """
  fns = [loss_fn(name, agg=agg, **hyper) for agg in aggs]

  def g(*args):
    def losses(*diff):
      full = list(args)
      for k, value in zip(GRAD_ARGNUMS, diff, strict=True):
        full[k] = value
      outs = [f(*full) for f in fns]
      values = jnp.stack([o[0] for o in outs])
      return values, (values, [o[1] for o in outs])

    diff = tuple(args[k] for k in GRAD_ARGNUMS)
    argnums = tuple(k for k, d in enumerate(diff) if d is not None)
    jac, (values, metrics) = jax.jacrev(
      lambda *d: losses(*(d[argnums.index(k)] if k in argnums else None for k in range(5))),
      argnums=tuple(range(len(argnums))),
      has_aux=True,
    )(*(diff[k] for k in argnums))
    grads = [None] * len(GRAD_ARGNUMS)
    for pos, k in enumerate(argnums):
      grads[k] = jac[pos]
    return values, metrics, grads

  return g


def assert_metrics_close(test, a, b, **tol):
  test.assertIsInstance(a, PolicyLossMetrics)
  for field, x, y in zip(PolicyLossMetrics._fields, a, b, strict=True):
    np.testing.assert_allclose(x, y, err_msg=field, **tol)


class PolicyLossBehaviourTest(chex.TestCase):
  def test_registry(self):
    self.assertEqual(
      set(NAMES),
      {"ppo", "gspo", "ctpo", "minpro", "cispo", "sapo", "aspo", "vespo", "sat", "m2po"},
    )
    data = make_data(0, pad=0.0)
    args = (data["logp"], data["old_logp"], data["advantages"], data["mask"])
    for name in NAMES:
      spec = rlx.objectives.get_policy_loss_spec(name)
      # The registered function runs with exactly the declared extra inputs, and
      # its default aggregation is the declared one.
      extra = {key: data[key] for key in spec.extra_inputs}
      default, _ = get_policy_loss(name)(*args, **extra)
      explicit, _ = POLICY_LOSSES[name](*args, **extra, agg=spec.default_agg)
      np.testing.assert_array_equal(default, explicit, err_msg=name)
      if spec.default_agg != "token-mean":
        other, _ = POLICY_LOSSES[name](*args, **extra, agg="token-mean")
        self.assertNotAlmostEqual(float(other), float(default), msg=name)
      with self.assertRaises(TypeError, msg=name):
        get_policy_loss(name)(*args, **extra, not_an_input=data["logp"])
    with self.assertRaisesRegex(ValueError, "must be one of .*'ppo'.*'aspo'.*got 'grpo'"):
      get_policy_loss("grpo")

  def test_public_api(self):
    for public in (
      "AGG_MODES",
      "CTPO_VARIANTS",
      "POLICY_LOSSES",
      "PolicyLossMetrics",
      "aggregate",
      "aggregate_scale",
      "aspo_loss",
      "cispo_loss",
      "ctpo_clip_scale",
      "ctpo_loss",
      "cumulative_log_ratio",
      "get_policy_loss",
      "gspo_loss",
      "min_prefix_log_ratio",
      "minpro_loss",
      "ppo_clip_loss",
      "sapo_loss",
      "sequence_log_ratio",
      "token_log_ratio",
    ):
      self.assertTrue(hasattr(rlx.objectives, public), msg=public)
    self.assertEqual(
      PolicyLossMetrics._fields,
      (
        "clip_frac_low",
        "clip_frac_high",
        "clip_frac_dual",
        "approx_kl",
        "ratio_mean",
        "ratio_max",
        "is_weight_mean",
      ),
    )

  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.named_parameters(*NAMED)
  def test_on_policy_gradient_is_policy_gradient(self, name):
    """logp == old_logp, no clip active: grad = grad of aggregate(-w A logp)."""
    data = make_data(1)
    data["logp"] = data["old_logp"].copy()
    if name in FOLDS_IS_WEIGHTS:
      data["is_weights"] = np.where(data["mask"] > 0, 1.0, np.nan).astype(np.float32)
    aggs = (DEFAULT_AGG.get(name, "token-mean"), "seq-mean-token-sum")
    losses, metrics, grads = call(self.variant(evaluate(name, aggs, **WIDE[name])), data)
    weight = np.nan_to_num(data["is_weights"] * data["advantages"])
    for k, agg in enumerate(aggs):
      expected = jax.grad(lambda lp, a=agg: aggregate(-weight * lp, data["mask"], a))(
        np.nan_to_num(data["logp"])
      )
      np.testing.assert_allclose(grads[0][k], expected, rtol=1e-5, atol=1e-7, err_msg=agg)
      self.assertEqual(losses.dtype, jnp.float32)
      np.testing.assert_allclose(metrics[k].ratio_mean, 1.0, rtol=1e-6)
      np.testing.assert_allclose(metrics[k].approx_kl, 0.0, atol=1e-7)
      for frac in (metrics[k].clip_frac_low, metrics[k].clip_frac_high, metrics[k].clip_frac_dual):
        np.testing.assert_allclose(frac, 0.0)

  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.named_parameters(*NAMED)
  def test_masking_a_token_equals_deleting_it(self, name):
    data = make_data(2)
    # Row 0 has a masked token at index 2 and full length: delete it by
    # shifting the rest left and padding at the end (T is unchanged).
    deleted = {}
    for key, value in data.items():
      value = value.copy()
      fill = 0.0 if key == "mask" else np.nan
      value[0] = np.concatenate([value[0, :2], value[0, 3:], [fill]])
      deleted[key] = value
    g = self.variant(evaluate(name, AGG_MODES))
    loss_a, metrics_a, grads_a = call(g, data)
    loss_b, metrics_b, grads_b = call(g, deleted)
    np.testing.assert_allclose(loss_a, loss_b, rtol=1e-5, atol=1e-7)
    for m_a, m_b in zip(metrics_a, metrics_b, strict=True):
      assert_metrics_close(self, m_a, m_b, rtol=1e-5, atol=1e-7)
    grad_a, grad_b = grads_a[0], grads_b[0]
    np.testing.assert_allclose(grad_a[:, 0, 2], 0.0)
    np.testing.assert_allclose(
      np.concatenate([grad_a[:, 0, :2], grad_a[:, 0, 3:]], axis=-1),
      grad_b[:, 0, :-1],
      rtol=1e-5,
      atol=1e-7,
    )
    np.testing.assert_allclose(grad_a[:, 1:], grad_b[:, 1:], rtol=1e-5, atol=1e-7)

  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.named_parameters(*NAMED)
  def test_permuting_sequences_changes_nothing(self, name):
    data = make_data(3)
    perm = np.array([2, 0, 3, 1])
    permuted = {k: v[perm] for k, v in data.items()}
    g = self.variant(evaluate(name, (DEFAULT_AGG.get(name, "token-mean"),)))
    loss_a, metrics_a, grads_a = call(g, data)
    loss_b, metrics_b, grads_b = call(g, permuted)
    np.testing.assert_allclose(loss_a, loss_b, rtol=1e-5, atol=1e-7)
    assert_metrics_close(self, metrics_a[0], metrics_b[0], rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(grads_a[0][:, perm], grads_b[0], rtol=1e-5, atol=1e-7)

  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.named_parameters(*NAMED)
  def test_no_gradient_through_stop_gradient_inputs(self, name):
    data = make_data(4, pad=0.0)
    _, _, grads = call(self.variant(evaluate(name, AGG_MODES)), data)
    self.assertGreater(float(jnp.abs(grads[0]).sum()), 0.0)
    # old_logp, advantages, is_weights, entropy (entropy only feeds ASPO).
    for g in grads[1:]:
      np.testing.assert_array_equal(g, 0.0)

  @parameterized.named_parameters(*[(n, n) for n in NAMES if n not in BATCH_RELATIVE])
  def test_micro_batches_with_global_scale_equal_full_batch(self, name):
    data = make_data(5, batch=6)
    data["mask"][4] = 0.0  # a sequence without valid tokens
    for key in DATA_KEYS:
      if key != "mask":
        data[key][4] = np.nan
    # ASPO's entropy quantile is per sequence, so splitting the batch changes nothing.
    full_fns = [loss_fn(name, agg=agg) for agg in AGG_MODES]

    @jax.jit
    def full_and_micro(logp):
      def full(lp):
        d = {**data, "logp": lp}
        return jnp.stack([call(f, d)[0] for f in full_fns])

      def micro(lp):
        totals = []
        for agg in AGG_MODES:
          f = loss_fn(name, agg=agg, agg_scale=aggregate_scale(data["mask"], agg))
          total = 0.0
          for i in (0, 2, 4):
            part = {k: None if v is None else v[i : i + 2] for k, v in data.items()}
            part["logp"] = lp[i : i + 2]
            total = total + call(f, part)[0]
          totals.append(total)
        return jnp.stack(totals)

      return full(logp), micro(logp), jax.jacrev(full)(logp), jax.jacrev(micro)(logp)

    full, micro, jac_full, jac_micro = full_and_micro(data["logp"])
    np.testing.assert_allclose(micro, full, rtol=1e-5)
    self.assertTrue(np.isfinite(jac_full).all())
    np.testing.assert_allclose(jac_micro, jac_full, rtol=1e-5, atol=1e-7)

  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.named_parameters(*NAMED)
  def test_extreme_inputs_are_finite(self, name):
    g = self.variant(evaluate(name, AGG_MODES))
    rng = np.random.default_rng(0)
    for pad in (np.nan, np.inf, -np.inf):
      data = make_data(6, pad=pad)
      sign = rng.choice([-1.0, 1.0], size=data["logp"].shape).astype(np.float32)
      data["logp"] = data["old_logp"] + 1e4 * sign  # log-ratios of +-1e4 (padding stays)
      losses, metrics, grads = call(g, data)
      self.assertTrue(np.isfinite(losses).all(), msg=f"{pad}")
      for agg_metrics in metrics:
        for field, value in zip(PolicyLossMetrics._fields, agg_metrics, strict=True):
          self.assertTrue(np.isfinite(value), msg=f"{field} {pad}")
          self.assertEqual(value.dtype, jnp.float32)
      for grad in grads:
        self.assertTrue(np.isfinite(grad).all(), msg=f"{pad}")

  @parameterized.named_parameters(*NAMED)
  def test_low_precision_inputs_compute_in_float32(self, name):
    data = make_data(7, pad=0.0)
    f = loss_fn(name)
    bf16 = {k: jnp.asarray(v, jnp.bfloat16) for k, v in data.items()}
    loss_bf16, metrics = call(f, bf16)
    self.assertEqual(loss_bf16.dtype, jnp.float32)
    self.assertTrue(all(m.dtype == jnp.float32 for m in metrics))
    up = {k: np.asarray(v, np.float32) for k, v in bf16.items()}
    np.testing.assert_allclose(loss_bf16, call(f, up)[0], rtol=1e-5, atol=1e-6)

  @parameterized.named_parameters(*NAMED)
  def test_traced_hyper_parameters(self, name):
    """Every float hyper-parameter may be a traced scalar (e.g. BAPO bounds under jit)."""
    hyper = TRACED[name]
    data = make_data(8)

    def traced(values):
      return call(loss_fn(name, **values), data)

    expected = traced(hyper)
    got = jax.jit(traced)({k: jnp.float32(v) for k, v in hyper.items()})
    for a, b in zip(jax.tree.leaves(expected), jax.tree.leaves(got), strict=True):
      np.testing.assert_allclose(b, a, rtol=1e-6, atol=1e-7)

  @parameterized.named_parameters(
    ("ppo", "ppo", {}),
    ("ppo_dual", "ppo", dict(dual_clip=3.0)),
    ("gspo", "gspo", {}),
    ("ctpo", "ctpo", {}),
    ("minpro", "minpro", {}),
    ("aspo", "aspo", {}),
    ("sat", "sat", {}),
  )
  def test_gradient_at_a_clip_bound_is_the_unclipped_gradient(self, name, extra):
    """A ratio exactly at a bound is inside the closed window: full gradient (as torch.clamp).

    On-policy with a zero-width window, every ratio (1) sits on both bounds.
    A 50/50 tie split (jnp.clip / jnp.maximum) would give 5/8 of the gradient.
    """
    data = make_data(1, pad=0.0)
    data["logp"] = data["old_logp"].copy()
    data["entropy"] = None
    f = loss_fn(name, clip_low=0.0, clip_high=0.0, **extra)
    grad = jax.jit(jax.grad(lambda lp: call(f, {**data, "logp": lp})[0]))(data["logp"])
    weight = data["is_weights"] * data["advantages"]
    agg = DEFAULT_AGG.get(name, "token-mean")
    expected = jax.grad(lambda lp: aggregate(-weight * lp, data["mask"], agg))(data["logp"])
    np.testing.assert_allclose(grad, expected, rtol=1e-5, atol=1e-7)

  @parameterized.named_parameters(("ppo", "ppo"), ("sapo", "sapo"))
  def test_check_grads(self, name):
    """Where the loss is smooth in logp (PPO away from clip kinks, SAPO).

    The other losses are surrogates whose value uses detached terms
    (sg(S_t) + lp - sg(lp), sg(weight) * lp, ...): their autodiff gradient is by
    design not the finite difference of their value, so check_grads does not apply.
    """
    data = make_data(9, noise=0.05, pad=0.0)
    args = [jnp.asarray(data[k]) for k in DATA_KEYS]
    f = loss_fn(name, clip_low=0.5, clip_high=0.5) if name == "ppo" else loss_fn(name)
    jtu.check_grads(lambda lp: f(lp, *args[1:])[0], (args[0],), order=1, modes=["rev"], eps=1e-2)


class PolicyLossValidationTest(parameterized.TestCase):
  @parameterized.named_parameters(*NAMED)
  def test_shapes_and_modes(self, name):
    data = make_data(0, pad=0.0)
    loss = get_policy_loss(name)
    lp, olp, a, m = (data[k] for k in ("logp", "old_logp", "advantages", "mask"))
    with self.assertRaisesRegex(ValueError, "`logp` must have rank 2"):
      loss(lp[0], olp[0], a[0], m[0])
    with self.assertRaisesRegex(ValueError, "`old_logp` must have the shape of `logp`"):
      loss(lp, olp[:, :3], a, m)
    with self.assertRaisesRegex(ValueError, "`advantages` must have the shape"):
      loss(lp, olp, a[:, :1], m)
    with self.assertRaisesRegex(ValueError, "`mask` must have the shape"):
      loss(lp, olp, a, m.T)
    with self.assertRaisesRegex(ValueError, "`is_weights` must have the shape"):
      loss(lp, olp, a, m, is_weights=m[:2])
    with self.assertRaisesRegex(ValueError, "`agg` must be one of"):
      loss(lp, olp, a, m, agg="sum")
    with self.assertRaisesRegex(ValueError, "`agg_scale` must be >= 0"):
      loss(lp, olp, a, m, agg_scale=-2.0)

  @parameterized.named_parameters(
    ("ppo_low", "ppo", dict(clip_low=-0.1), "clip_low"),
    ("ppo_high", "ppo", dict(clip_high=-0.1), "clip_high"),
    ("ppo_dual", "ppo", dict(dual_clip=0.9), "dual_clip"),
    ("gspo_low", "gspo", dict(clip_low=-1e-4), "clip_low"),
    ("gspo_high", "gspo", dict(clip_high=-1e-4), "clip_high"),
    ("ctpo_low", "ctpo", dict(clip_low=-0.01), "clip_low"),
    ("ctpo_high", "ctpo", dict(clip_high=-0.01), "clip_high"),
    ("ctpo_dual", "ctpo", dict(dual_clip=0.0), "dual_clip"),
    ("ctpo_variant", "ctpo", dict(variant="sum"), "variant"),
    ("minpro_low", "minpro", dict(clip_low=-0.2), "clip_low"),
    ("minpro_dual", "minpro", dict(dual_clip=1.0), "dual_clip"),
    ("cispo_high", "cispo", dict(clip_high=-0.2), "clip_high"),
    ("sapo_tau", "sapo", dict(tau_pos=0.0), "tau_pos"),
    ("sapo_tau_neg", "sapo", dict(tau_neg=-1.0), "tau_neg"),
    ("aspo_high_entropy", "aspo", dict(high_entropy_clip_low=-0.4), "high_entropy_clip_low"),
    ("aspo_dual", "aspo", dict(dual_clip=0.5), "dual_clip"),
    ("aspo_positive_dual", "aspo", dict(positive_dual_clip=1.0), "positive_dual_clip"),
    ("aspo_fraction", "aspo", dict(high_entropy_fraction=1.5), "high_entropy_fraction"),
    ("vespo_k", "vespo", dict(k_pos=-1.0), "k_pos"),
    ("vespo_lambda", "vespo", dict(lambda_neg=-1.0), "lambda_neg"),
    ("sat_low", "sat", dict(clip_low=1.0), "clip_low"),
    ("sat_quantile", "sat", dict(quantile=0.0), "quantile"),
    ("sat_power", "sat", dict(kernel_power=0.0), "kernel_power"),
  )
  def test_bad_hyper_parameters(self, name, hyper, arg):
    data = make_data(0, pad=0.0)
    loss = get_policy_loss(name)
    with self.assertRaisesRegex(ValueError, f"`{arg}`"):
      loss(data["logp"], data["old_logp"], data["advantages"], data["mask"], **hyper)

  def test_aspo_entropy_shape(self):
    data = make_data(0, pad=0.0)
    loss = functools.partial(
      get_policy_loss("aspo"), data["logp"], data["old_logp"], data["advantages"], data["mask"]
    )
    with self.assertRaisesRegex(ValueError, "`entropy` must have the shape"):
      loss(entropy=data["entropy"][:, :2])


if __name__ == "__main__":
  absltest.main()
