"""`register_policy_loss`: a researcher's own loss joins the registry, validated like a built-in."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rlx.objectives as obj


def my_ppo(
  logp, old_logp, advantages, mask, *, eps=0.2, is_weights=None, agg="token-mean", agg_scale=None
):
  log_ratio = jnp.clip(logp - old_logp, -20.0, 20.0)
  ratio = jnp.exp(log_ratio)
  per_token = jnp.maximum(-advantages * ratio, -advantages * jnp.clip(ratio, 1 - eps, 1 + eps))
  if is_weights is not None:
    per_token = per_token * jax.lax.stop_gradient(is_weights)
  loss = obj.aggregate(per_token, mask, agg, scale=agg_scale)
  return loss, obj.policy_loss_metrics(mask, log_ratio=log_ratio, ratio=ratio)


def test_registered_loss_appears_everywhere(policy_loss_registry):
  spec = obj.register_policy_loss("my_ppo", my_ppo)
  assert obj.POLICY_LOSS_SPECS["my_ppo"] is spec
  assert obj.POLICY_LOSSES["my_ppo"] is my_ppo
  assert obj.get_policy_loss("my_ppo") is my_ppo
  assert "my_ppo" in obj.POLICY_LOSSES and len(obj.POLICY_LOSSES) == 11
  assert spec.default_agg == "token-mean" and spec.extra_inputs == () and spec.clip_keywords == ()
  assert spec.hyperparameters() == ("eps",)
  with pytest.raises(TypeError):
    obj.POLICY_LOSS_SPECS["x"] = spec


def test_registered_loss_equals_the_builtin_it_reimplements(policy_loss_registry):
  obj.register_policy_loss("my_ppo", my_ppo)
  rng = np.random.default_rng(0)
  logp = jnp.asarray(rng.normal(size=(3, 4)) * 0.3 - 1.0, jnp.float32)
  old = jnp.asarray(rng.normal(size=(3, 4)) * 0.3 - 1.0, jnp.float32)
  adv = jnp.asarray(rng.normal(size=(3, 4)), jnp.float32)
  mask = jnp.asarray(rng.random((3, 4)) < 0.7, jnp.float32)
  mine, m1 = obj.get_policy_loss("my_ppo")(logp, old, adv, mask, eps=0.2)
  ref, m2 = obj.ppo_clip_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.2)
  np.testing.assert_allclose(mine, ref, rtol=1e-6)
  np.testing.assert_allclose(m1.approx_kl, m2.approx_kl, rtol=1e-6)
  np.testing.assert_allclose(m1.ratio_mean, m2.ratio_mean, rtol=1e-6)


def test_name_rules(policy_loss_registry):
  obj.register_policy_loss("mine", my_ppo)
  with pytest.raises(ValueError, match="already registered; pass overwrite=True"):
    obj.register_policy_loss("mine", my_ppo)
  obj.register_policy_loss("mine", my_ppo, overwrite=True)
  with pytest.raises(ValueError, match="built-in loss"):
    obj.register_policy_loss("ppo", my_ppo, overwrite=True)
  for bad in ("", " x", 3):
    with pytest.raises(ValueError, match="`name` must be a non-empty str"):
      obj.register_policy_loss(bad, my_ppo)


def test_unregister_frees_the_name_and_returns_what_re_registers_it(policy_loss_registry):
  builtins = dict(obj.POLICY_LOSS_SPECS)
  spec = obj.register_policy_loss("mine", my_ppo, default_agg="seq-mean-token-mean")
  assert obj.unregister_policy_loss("mine") is spec
  assert dict(obj.POLICY_LOSS_SPECS) == builtins and "mine" not in obj.POLICY_LOSSES
  with pytest.raises(ValueError, match=r"`name` must be one of .*got 'mine'"):
    obj.get_policy_loss("mine")
  with pytest.raises(ValueError, match=r"must be a registered loss, one of \(\), got 'mine'"):
    obj.unregister_policy_loss("mine")
  again = obj.register_policy_loss(  # the name is free again: no `overwrite`
    "mine",
    spec.fn,
    extra_inputs=spec.extra_inputs,
    clip_keywords=spec.clip_keywords,
    default_agg=spec.default_agg,
    differentiable_entropy=spec.differentiable_entropy,
  )
  assert again == spec and obj.POLICY_LOSS_SPECS["mine"] is again
  for name in builtins:
    with pytest.raises(ValueError, match="is a built-in loss and cannot be removed"):
      obj.unregister_policy_loss(name)
  with pytest.raises(ValueError, match=r"one of \('mine',\), got 3"):
    obj.unregister_policy_loss(3)
  assert set(obj.POLICY_LOSS_SPECS) == {*builtins, "mine"}


def test_contract_is_checked(policy_loss_registry):
  def positional(logp, old_logp, adv, mask, *, is_weights=None, agg="token-mean", agg_scale=None):
    return my_ppo(logp, old_logp, adv, mask)

  with pytest.raises(ValueError, match=r"positional parameters must be \('logp', 'old_logp', "):
    obj.register_policy_loss("a", positional)

  def no_common(logp, old_logp, advantages, mask, *, agg="token-mean"):
    return my_ppo(logp, old_logp, advantages, mask)

  with pytest.raises(ValueError, match=r"missing \['is_weights', 'agg_scale'\]"):
    obj.register_policy_loss("b", no_common)
  with pytest.raises(ValueError, match=r"`extra_inputs` of my_ppo: \['values'\] cannot be"):
    obj.register_policy_loss("c", my_ppo, extra_inputs=("values",))
  with pytest.raises(ValueError, match=r"\['entropy'\] are not keyword-only parameters"):
    obj.register_policy_loss("d", my_ppo, extra_inputs=("entropy",))
  with pytest.raises(ValueError, match=r"\['clip_low'\] are not keyword-only parameters"):
    obj.register_policy_loss("e", my_ppo, clip_keywords=("clip_low",))
  with pytest.raises(ValueError, match="differentiable_entropy.*needs 'entropy'"):
    obj.register_policy_loss("f", my_ppo, differentiable_entropy=True)
  with pytest.raises(ValueError, match="default aggregation.*got 'sum'"):
    obj.register_policy_loss("g", my_ppo, default_agg="sum")

  def bad_return(
    logp, old_logp, advantages, mask, *, is_weights=None, agg="token-mean", agg_scale=None
  ):
    return jnp.sum(logp * mask)

  with pytest.raises(ValueError, match="must return \\(loss, metrics\\)"):
    obj.register_policy_loss("h", bad_return)

  def raises(
    logp, old_logp, advantages, mask, *, is_weights=None, agg="token-mean", agg_scale=None
  ):
    return logp @ mask  # [2, 3] @ [2, 3]: shapes do not match

  with pytest.raises(ValueError, match="failed when traced on \\[2, 3\\] float32 inputs"):
    obj.register_policy_loss("i", raises)
  assert not {"a", "b", "c", "d", "e", "f", "g", "h", "i"} & set(obj.POLICY_LOSSES)


def test_builtins_pass_the_output_check():
  for name, spec in obj.POLICY_LOSS_SPECS.items():
    assert (
      obj.policy_loss_spec(
        spec.fn, extra_inputs=spec.extra_inputs, clip_keywords=spec.clip_keywords
      )
      == spec
    ), name


def test_policy_loss_metrics_checks_shapes_and_takes_float_masks():
  m = obj.policy_loss_metrics(
    jnp.array([[1.0, 0.0]]), log_ratio=jnp.zeros((1, 2)), ratio=jnp.array([[2.0, 5.0]])
  )
  assert float(m.ratio_mean) == 2.0 and float(m.ratio_max) == 2.0
  with pytest.raises(ValueError, match="must have the shape of `valid`"):
    obj.policy_loss_metrics(jnp.ones((1, 2)), log_ratio=jnp.zeros((2, 2)), ratio=jnp.ones((1, 2)))
