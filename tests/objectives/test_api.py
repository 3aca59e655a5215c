"""The public surface of rlx.objectives and the policy-loss registry's declarations."""

import inspect

import jax.numpy as jnp
import numpy as np
import pytest

import rlx.objectives as obj

PUBLIC = {
  "adaptive_is_lambda",
  "AGG_MODES",
  "aggregate",
  "aggregate_scale",
  "aspo_loss",
  "bapo_clip_bounds",
  "BAPO_DUAL_CLIP",
  "BapoClipBounds",
  "broadcast_to_tokens",
  "cispo_loss",
  "ctpo_clip_scale",
  "ctpo_loss",
  "CTPO_VARIANTS",
  "cumulative_log_ratio",
  "drgrpo_advantages",
  "effective_sample_size",
  "get_policy_loss",
  "get_policy_loss_spec",
  "grpo_advantages",
  "gspo_loss",
  "KL_KINDS",
  "kl_penalty",
  "M2poClipBounds",
  "m2po_clip_bounds",
  "m2po_loss",
  "m2po_mask",
  "median_advantages",
  "min_prefix_log_ratio",
  "minpro_loss",
  "MismatchKL",
  "POLICY_LOSS_SPECS",
  "POLICY_LOSSES",
  "policy_loss_metrics",
  "policy_loss_spec",
  "PolicyLossMetrics",
  "PolicyLossSpec",
  "ppo_clip_loss",
  "register_policy_loss",
  "renormalize_weights",
  "rloo_advantages",
  "rollout_correction",
  "rollout_mismatch_kl",
  "rollout_rejection_mask",
  "rollout_veto_mask",
  "RolloutCorrectionMetrics",
  "sapo_loss",
  "sat_clip_bounds",
  "sat_loss",
  "SatClipBounds",
  "sequence_importance_weights",
  "sequence_log_ratio",
  "token_importance_weights",
  "token_log_ratio",
  "unregister_policy_loss",
  "vcpo_advantages",
  "vcpo_baseline",
  "vcpo_lr_factor",
  "vespo_loss",
}

# Keyword-only parameters every policy loss has that are neither data inputs
# nor loss-specific hyper-parameters.
_COMMON = {"is_weights", "agg", "agg_scale"}


def test_exact_public_surface():
  assert set(obj.__all__) == PUBLIC
  assert len(obj.__all__) == len(set(obj.__all__))
  for name in obj.__all__:
    assert getattr(obj, name) is not None, name
  exported = {n for n in vars(obj) if not n.startswith("_")}
  assert exported == PUBLIC, exported ^ PUBLIC
  namespace = {}
  exec("from rlx.objectives import *", namespace)
  assert PUBLIC <= set(namespace)


def test_registry_is_read_only_and_consistent():
  assert set(obj.POLICY_LOSS_SPECS) == {
    "ppo",
    "gspo",
    "ctpo",
    "minpro",
    "cispo",
    "sapo",
    "aspo",
    "vespo",
    "sat",
    "m2po",
  }
  assert dict(obj.POLICY_LOSSES) == {k: s.fn for k, s in obj.POLICY_LOSS_SPECS.items()}
  with pytest.raises(TypeError):
    obj.POLICY_LOSS_SPECS["mine"] = obj.POLICY_LOSS_SPECS["ppo"]
  with pytest.raises(TypeError):
    obj.POLICY_LOSSES["mine"] = obj.ppo_clip_loss
  with pytest.raises(ValueError, match=r"must be one of .*'ppo'.*'aspo'.*got 'grpo'"):
    obj.get_policy_loss_spec("grpo")
  with pytest.raises(ValueError, match="must be one of"):
    obj.get_policy_loss_spec(["ppo"])


@pytest.mark.parametrize("name", sorted(obj.POLICY_LOSS_SPECS))
def test_spec_matches_signature(name):
  spec = obj.get_policy_loss_spec(name)
  assert isinstance(spec, obj.PolicyLossSpec)
  assert obj.get_policy_loss(name) is spec.fn
  params = inspect.signature(spec.fn).parameters
  positional = [p for p, v in params.items() if v.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]
  assert positional == ["logp", "old_logp", "advantages", "mask"]
  keywords = {p: v for p, v in params.items() if v.kind is inspect.Parameter.KEYWORD_ONLY}
  assert _COMMON <= set(keywords)
  assert spec.default_agg == keywords["agg"].default
  assert spec.default_agg in obj.AGG_MODES
  # Extra data inputs: keyword arrays annotated [B, T] with default None.
  data_keywords = {
    p
    for p, v in keywords.items()
    if p not in _COMMON and v.default is None and "'B T'" in str(v.annotation)
  }
  assert set(spec.extra_inputs) == data_keywords
  assert set(spec.clip_keywords) <= {"clip_low", "clip_high", "dual_clip"}
  assert set(spec.clip_keywords) <= set(keywords)


def test_which_losses_take_ppo_ratio_bounds():
  # CTPO's window is log-space and position-scaled, SAPO has temperatures, VESPO a
  # kernel; SAT's clips are PPO's nominal radii (contracted per token on the tail).
  declared = {n: s.clip_keywords for n, s in obj.POLICY_LOSS_SPECS.items() if s.clip_keywords}
  assert set(declared) == {"ppo", "gspo", "minpro", "cispo", "aspo", "sat"}
  assert "dual_clip" not in declared["gspo"] + declared["cispo"]


@pytest.mark.parametrize(
  "name", sorted(n for n, s in obj.POLICY_LOSS_SPECS.items() if s.clip_keywords)
)
def test_clip_keywords_follow_ppo_convention(name):
  """Ratio bounds `[1 - clip_low, 1 + clip_high]` and dual clip `c`: each declared
  keyword changes the loss where PPO's convention says it should."""
  spec = obj.get_policy_loss_spec(name)
  # One sequence of one token, so token, sequence and prefix ratios coincide.
  one = jnp.ones((1, 1))

  def loss(ratio, adv, **kw):
    lp = jnp.log(jnp.full((1, 1), ratio, jnp.float32))
    extra = {k: jnp.zeros((1, 1)) for k in spec.extra_inputs}
    return float(spec.fn(lp, jnp.zeros((1, 1)), adv * one, one, **extra, **kw)[0])

  # A > 0 at r = 1.3: clip_high = 0.2 caps the ratio at 1.2 (PPO/GSPO/MinPRO give
  # the capped value -1.2 A, CISPO its weight, ASPO its flipped value -A / 1.2);
  # clip_high = 0.5 leaves r = 1.3 untouched.
  if "clip_high" in spec.clip_keywords:
    capped = loss(1.3, 1.0, clip_high=0.2)
    free = loss(1.3, 1.0, clip_high=0.5)
    assert capped != pytest.approx(free)
    expected_free = {"aspo": -1 / 1.3, "cispo": -1.3 * np.log(1.3)}.get(name, -1.3)
    assert free == pytest.approx(expected_free, rel=1e-5)
  # A < 0 at r = 0.7: clip_low = 0.2 holds the ratio at 0.8, clip_low = 0.5 does not.
  if "clip_low" in spec.clip_keywords:
    held = loss(0.7, -1.0, clip_low=0.2)
    free = loss(0.7, -1.0, clip_low=0.5)
    expected_held = {"cispo": 0.8 * np.log(0.7)}.get(name, 0.8)
    assert held == pytest.approx(expected_held, rel=1e-5)
    assert free != pytest.approx(held)
  # A < 0 at r = 4: dual clip c = 3 caps the loss at -A c.
  if "dual_clip" in spec.clip_keywords:
    assert loss(4.0, -1.0, clip_high=5.0, dual_clip=3.0) == pytest.approx(3.0, rel=1e-5)
    assert loss(4.0, -1.0, clip_high=5.0, dual_clip=5.0) == pytest.approx(4.0, rel=1e-5)


def test_bapo_clip_kwargs_feed_ppo():
  logp = jnp.log(jnp.array([[1.0, 0.72, 0.82, 1.0]]))
  adv = jnp.array([[1.0, -1.0, -1.0, -1.0]])
  b = obj.bapo_clip_bounds(logp, jnp.zeros((1, 4)), adv, jnp.ones((1, 4)))
  assert float(b.dual_clip) == obj.BAPO_DUAL_CLIP == 3.0
  kw = b.clip_kwargs()
  assert set(kw) == set(obj.get_policy_loss_spec("ppo").clip_keywords)
  np.testing.assert_allclose([kw["clip_low"], kw["clip_high"]], [0.15, 0.2], rtol=1e-5)
  assert obj.bapo_clip_bounds(logp, logp, adv, jnp.ones((1, 4)), dual_clip=None).dual_clip is None
