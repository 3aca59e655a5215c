"""A researcher's own loss in the train step: by registered name, by `make_train_step(loss=)`."""

import jax.numpy as jnp
import numpy as np
import pytest
import train_testlib as tl

from rlx import objectives, train


def my_ppo(
  logp, old_logp, advantages, mask, *, eps=0.2, is_weights=None, agg="token-mean", agg_scale=None
):
  log_ratio = jnp.clip(logp - old_logp, -20.0, 20.0)
  ratio = jnp.exp(log_ratio)
  per_token = jnp.maximum(-advantages * ratio, -advantages * jnp.clip(ratio, 1 - eps, 1 + eps))
  loss = objectives.aggregate(per_token, mask, agg, scale=agg_scale)
  return loss, objectives.policy_loss_metrics(mask, log_ratio=log_ratio, ratio=ratio)


def entropy_only(
  logp,
  old_logp,
  advantages,
  mask,
  *,
  entropy=None,
  is_weights=None,
  agg="token-mean",
  agg_scale=None,
):
  """-H: its whole gradient flows through the entropy input (zero when detached)."""
  zero = jnp.zeros_like(logp)
  loss = -objectives.aggregate(entropy, mask, agg, scale=agg_scale)
  return loss, objectives.policy_loss_metrics(mask, log_ratio=zero, ratio=jnp.exp(zero))


def _two_steps(cfg, **kwargs):
  m = tl.mesh("single")
  step = train.make_train_step(tl.model_config(), cfg, m, **kwargs)
  logprobs = train.make_compute_logprobs(tl.model_config(), cfg, m)
  state = tl.init_state(m, cfg)
  out = []
  for i in range(2):
    state, metrics = step(state, tl.prepare(tl.make_batch(i), m, state, logprobs))
    out.append(train.to_host(metrics))
  return state, out


def test_registered_name_and_loss_argument_equal_the_builtin(policy_loss_registry):
  ref_state, ref = _two_steps(tl.train_config(loss="ppo"))
  objectives.register_policy_loss("my_ppo", my_ppo)
  cfg = tl.train_config(loss="my_ppo")
  cfg.loss_kwargs.eps = 0.2
  by_name_state, by_name = _two_steps(cfg)
  by_arg_state, by_arg = _two_steps(tl.train_config(), loss=my_ppo)
  for state, metrics in ((by_name_state, by_name), (by_arg_state, by_arg)):
    for a, b in zip(metrics, ref, strict=True):
      np.testing.assert_allclose(a["loss"], b["loss"], rtol=1e-5)
      np.testing.assert_allclose(a["grad_norm"], b["grad_norm"], rtol=1e-5)
    for x, y in zip(tl.host_params(state), tl.host_params(ref_state), strict=True):
      np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)


def test_loss_kwargs_are_checked_against_the_custom_loss(policy_loss_registry):
  objectives.register_policy_loss("my_ppo", my_ppo)
  cfg = tl.train_config(loss="my_ppo")
  cfg.loss_kwargs.clip_low = 0.1
  with pytest.raises(ValueError, match=r"unknown keywords \['clip_low'\]; my_ppo takes \['eps'\]"):
    train.make_train_step(tl.model_config(), cfg, tl.mesh("single"))
  with pytest.raises(ValueError, match=r"`loss` must be one of .*got 'nope'"):
    train.make_train_step(tl.model_config(), tl.train_config(), tl.mesh("single"), loss="nope")


def test_differentiable_entropy_reaches_the_params(policy_loss_registry):
  objectives.register_policy_loss("ent_detached", entropy_only, extra_inputs=("entropy",))
  objectives.register_policy_loss(
    "ent_grad", entropy_only, extra_inputs=("entropy",), differentiable_entropy=True
  )
  _, detached = _two_steps(tl.train_config(loss="ent_detached"))
  _, live = _two_steps(tl.train_config(loss="ent_grad"))
  # (The update of a zero gradient is AdamW's weight decay alone.)
  assert detached[1]["grad_norm"] == 0.0
  assert live[1]["grad_norm"] > 1e-3 and live[1]["update_norm"] > detached[1]["update_norm"]
