"""`StepSpec`: the train config validated and resolved once, frozen, compared by value."""

import dataclasses

import jax
import jax.numpy as jnp
import ml_collections
import pytest
import train_testlib as tl

from rlx import objectives, train

StepSpec = train.StepSpec


def test_equal_configs_give_equal_specs():
  a = StepSpec.from_config(tl.train_config(loss="gspo", loss_kwargs={"clip_low": 0.1}))
  b = StepSpec.from_config(tl.train_config(loss="gspo", loss_kwargs={"clip_low": 0.1}))
  assert a == b
  assert a != StepSpec.from_config(tl.train_config(loss="gspo", loss_kwargs={"clip_low": 0.2}))
  assert a != StepSpec.from_config(tl.train_config(loss="gspo", micro_batches=2))
  assert a != StepSpec.from_config(tl.train_config(loss="gspo", **{"optimizer.b1": 0.8}))


def test_the_spec_is_frozen_and_shares_nothing_with_the_config():
  cfg = tl.train_config(loss_kwargs={"clip_low": 0.1, "clip_high": 0.3})
  spec = StepSpec.from_config(cfg)
  with pytest.raises(dataclasses.FrozenInstanceError):
    spec.micro_batches = 4
  with pytest.raises(TypeError):
    spec.loss_kwargs["clip_low"] = 0.5
  with pytest.raises(TypeError):
    spec.optimizer["learning_rate"] = 1.0
  cfg.micro_batches = 4
  cfg.loss_kwargs.clip_low = 0.5
  cfg.optimizer.learning_rate = 1.0
  assert spec.micro_batches == 1
  assert dict(spec.loss_kwargs) == {"clip_low": 0.1, "clip_high": 0.3}
  assert spec.optimizer["learning_rate"] == 1e-3


def test_fields_are_resolved_to_plain_values():
  cfg = tl.train_config(loss="gspo", micro_batches=2, kl_coef=1, shuffle=False)
  spec = StepSpec.from_config(cfg)
  assert spec.loss == objectives.get_policy_loss_spec("gspo")
  assert spec.loss_name == "gspo"
  assert spec.agg == "seq-mean-token-mean" == train.resolve_agg(cfg)
  assert type(spec.micro_batches) is int and spec.micro_batches == 2
  assert type(spec.kl_coef) is float and spec.kl_coef == 1.0
  assert spec.shuffle is False
  assert spec.updates_per_step == train.updates_per_step(cfg) == 1
  cfg.agg = "seq-mean-token-sum"
  assert StepSpec.from_config(cfg).agg == "seq-mean-token-sum"
  # Every field of the config that the step reads has its counterpart.
  own = {f.name for f in dataclasses.fields(StepSpec)} - {"loss", "loss_name"}
  assert own <= set(train.get_config().keys())


def test_the_loss_argument_replaces_the_registry_entry():
  gspo = objectives.get_policy_loss_spec("gspo")
  spec = StepSpec.from_config(tl.train_config(), loss=gspo)
  assert spec.loss == gspo and spec.agg == "seq-mean-token-mean"
  assert train.make_train_step(tl.model_config(), tl.train_config(), tl.mesh("single")).spec == (
    StepSpec.from_config(tl.train_config())
  )
  with pytest.raises(ValueError, match="`loss` must be a rlx.objectives.PolicyLossSpec"):
    StepSpec.from_config(tl.train_config(), loss="gspo")


def test_bapo_keywords_are_resolved_for_the_loss():
  with_dual = StepSpec.from_config(tl.train_config(use_bapo=True))
  assert dict(with_dual.bapo_kwargs) == {}
  without_dual = StepSpec.from_config(tl.train_config(use_bapo=True, loss="gspo"))
  assert dict(without_dual.bapo_kwargs) == {"dual_clip": None}
  assert dict(StepSpec.from_config(tl.train_config(loss="gspo")).bapo_kwargs) == {}


def test_an_invalid_config_is_refused_naming_the_field():
  with pytest.raises(ValueError, match="config.micro_batches"):
    StepSpec.from_config(tl.train_config(micro_batches=0))
  with pytest.raises(ValueError, match="config.agg"):
    StepSpec.from_config(tl.train_config(agg="mean"))


def test_the_schedule_of_the_spec_is_the_configs():
  cfg = tl.train_config()
  spec = StepSpec.from_config(cfg)
  want, got = train.make_schedule(cfg), train.schedule_of(spec.optimizer)
  for n in (0, 1, 2, 5, 19, 25):
    assert float(got(n)) == float(want(n))


def test_the_builders_resolve_the_config_once(monkeypatch):
  calls = []
  original = StepSpec.from_config.__func__

  def counting(cls, config, **kwargs):
    calls.append(config)
    return original(cls, config, **kwargs)

  monkeypatch.setattr(StepSpec, "from_config", classmethod(counting))
  mc, m, cfg = tl.model_config(), tl.mesh("single"), tl.train_config(micro_batches=2)
  train.make_train_step(mc, cfg, m)
  assert len(calls) == 1
  train.make_compute_logprobs(mc, cfg, m)
  assert len(calls) == 2


def test_tracing_the_step_never_reads_the_config_again(monkeypatch):
  cfg = tl.train_config(
    use_bapo=True,
    use_m2po=True,
    use_rollout_correction=True,
    use_vcpo=True,
    kl_coef=0.1,
    entropy_coef=0.01,
    micro_batches=2,
    mini_batches=2,
  )
  mc, m = tl.model_config(), tl.mesh("single")
  step = train.make_train_step(mc, cfg, m)
  logprobs = train.make_compute_logprobs(mc, cfg, m)

  def refuse(*args, **kwargs):
    raise AssertionError("the train config was read after the step was built")

  # The config the builders were given is emptied (every section), so any read of it fails.
  sections = [cfg]
  for section in sections:  # grows while it is walked: every nested section
    sections += [v for v in section.values() if isinstance(v, ml_collections.ConfigDict)]
  for section in sections:
    section.unlock()
    for key in list(section.keys()):
      del section[key]
  assert "loss" not in cfg and step.config is cfg
  # A copy of it is refused too: no ConfigDict value is read from here on, nor the
  # config resolved again (StepSpec.from_config, or the registry lookup of its loss).
  for name in ("__getitem__", "items", "values", "iteritems", "to_dict"):
    monkeypatch.setattr(ml_collections.ConfigDict, name, refuse)
  monkeypatch.setattr(StepSpec, "from_config", classmethod(refuse))
  monkeypatch.setattr(objectives, "get_policy_loss_spec", refuse)
  monkeypatch.setattr(objectives, "get_policy_loss", refuse)
  b, s = tl.BATCH, tl.SEQ
  floats = jax.ShapeDtypeStruct((b, s), jnp.float32)
  batch = {
    "tokens": jax.ShapeDtypeStruct((b, s), jnp.int32),
    "loss_mask": floats,
    "advantages": jax.ShapeDtypeStruct((b,), jnp.float32),
    "old_logp": floats,
    "rollout_logp": floats,
    "ref_logp": floats,
  }
  _, metrics = jax.eval_shape(step.step_fn, step.abstract_state, batch)
  assert {"bapo_c_low", "m2po_masked_frac", "vcpo_lr_factor", "kl_loss"} <= set(metrics)
  inputs = {"tokens": batch["tokens"], "loss_mask": floats}
  logp = jax.eval_shape(logprobs.logprobs_fn, step.abstract_state.params, inputs)
  assert logp.shape == (b, s)


def test_make_step_fn_takes_a_config_a_loss_or_a_spec():
  mc, m, cfg = tl.model_config(), tl.mesh("single"), tl.train_config()
  opt = train.make_optimizer(cfg)
  spec = StepSpec.from_config(cfg)
  assert callable(train.make_step_fn(mc, cfg, m, opt))
  assert callable(train.make_step_fn(mc, cfg, m, opt, spec=spec.loss))
  assert callable(train.make_step_fn(mc, cfg, m, opt, spec=spec))
  assert callable(train.make_step_fn(mc, spec, m, opt))
  assert train.as_step_spec(cfg, loss=spec) is spec
  assert train.as_step_spec(spec) is spec
  with pytest.raises(ValueError, match="`spec` must be None"):
    train.make_step_fn(mc, spec, m, opt, spec=spec.loss)
