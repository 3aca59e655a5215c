"""rlx.rl: config validation, advantages by baseline, batch layout, prompt cursor (no model)."""

import ast
import importlib.util
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import rl_test_utils

from rlx import objectives, rl, sampling

_CONFIGS = os.path.join(os.path.dirname(__file__), "..", "..", "experiments", "configs")


def _experiment_config(name):
  spec = importlib.util.spec_from_file_location(name, os.path.join(_CONFIGS, f"{name}.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config()


@pytest.mark.parametrize(
  "overrides, match",
  [
    ({"train.loss": "nope"}, "config.train.loss"),
    ({"rl.baseline": "mean"}, "config.rl.baseline"),
    ({"rl.num_samples": 1}, "must be >= 2 for the 'grpo'"),
    ({"rl.num_samples": 1, "rl.baseline": "rloo"}, "must be >= 2 for the 'rloo'"),
    ({"rl.num_samples": 3, "rl.baseline": "median"}, "even and >= 2 for the 'median'"),
    ({"rl.temperature": 0.0}, "config.rl.temperature"),
    ({"rl.iterations": 0}, "config.rl.iterations"),
    ({"rl.rollout": "async"}, "`config.rl.rollout` is not a config field"),
    ({"warmup.target_dev_accuracy": 1.5}, "config.warmup.target_dev_accuracy"),
    ({"warmup.on_cap": "ignore"}, "config.warmup.on_cap"),
    ({"train.kl_kind": "k9"}, "config.train.kl_kind"),
    ({"checkpoint.every": 0}, "config.checkpoint.every"),
    # Corrections of old_logp vs rollout_logp do nothing when old_logp IS rollout_logp.
    (
      {"rl.old_logp": "sampler", "train.use_rollout_correction": True},
      "`config.train.use_rollout_correction` compares old_logp with the sampler's",
    ),
    ({"rl.old_logp": "sampler", "train.use_m2po": True}, "`config.train.use_m2po` compares"),
    ({"rl.old_logp": "sampler", "train.use_vcpo": True}, "`config.train.use_vcpo` compares"),
  ],
)
def test_bad_config_raises(overrides, match):
  with pytest.raises(ValueError, match=match):
    rl.validate_config(rl_test_utils.tiny_config(**overrides))


def _choices_named(error: pytest.ExceptionInfo) -> tuple:
  """The choices a `must be one of (...)` error lists."""
  (choices,) = re.findall(r"must be one of (\(.*?\)), got", str(error.value))
  return ast.literal_eval(choices)


def test_shared_choices_have_one_source():
  # The config takes exactly rl.BASELINES: each of them, nothing else (the error lists them).
  for baseline in rl.BASELINES:
    rl.validate_config(rl_test_utils.tiny_config(**{"rl.baseline": baseline}))
  with pytest.raises(ValueError, match="`config.rl.baseline` must be one of") as error:
    rl.validate_config(rl_test_utils.tiny_config(**{"rl.baseline": "mean"}))
  assert _choices_named(error) == rl.BASELINES
  # Every baseline runs through the learner in test_rl_loop.py; the names group_advantages
  # knows are among them.
  with pytest.raises(ValueError, match="`baseline` must be one of") as error:
    rl.group_advantages(jnp.arange(10.0), 5, "mean")
  assert set(_choices_named(error)) <= set(rl.BASELINES)
  # The rollout's KV dtypes are the sampler's: "auto" and each of rlx.sampling.KV_DTYPES.
  with pytest.raises(ValueError, match="`config.rollout.kv_dtype` must be one of") as error:
    rl.validate_config(rl_test_utils.tiny_config(**{"rollout.kv_dtype": "int8"}))
  assert _choices_named(error) == ("auto", *sampling.KV_DTYPES)
  with pytest.raises(ValueError, match="`kv_dtype` must be one of") as error:
    sampling.SamplerConfig(kv_dtype="int8")
  assert _choices_named(error) == ("auto", *sampling.KV_DTYPES)
  with pytest.raises(ValueError, match="`config.rl.reward` must be one of"):
    rl.validate_config(rl_test_utils.tiny_config(**{"rl.reward": "device"}))


def test_unknown_task_raises_before_any_work(tmp_path):
  with pytest.raises(ValueError, match=r"`config.task.name` must be one of .*got 'nope'"):
    rl.run(rl_test_utils.tiny_config(**{"task.name": "nope"}), str(tmp_path))


def test_default_and_experiment_configs_validate():
  rl.validate_config(rl.get_config())
  assert rl.samples_per_prompt(rl_test_utils.tiny_config(**{"rl.baseline": "median"})) == 5
  assert rl.train_config(rl_test_utils.tiny_config(**{"rl.temperature": 0.7})).temperature == 0.7


def test_long_tail_config_is_the_main_job_on_a_task_with_a_length_tail():
  base, tail = _experiment_config("arithmetic"), _experiment_config("arithmetic_tail")
  for config in (base, tail):
    rl.validate_config(config)
  assert tail.rl.to_dict() == base.rl.to_dict() and tail.train.to_dict() == base.train.to_dict()
  lengths = {}
  for name, config in (("base", base), ("tail", tail)):
    task = rl.make_task(config)
    lengths[name] = np.array([len(e.target_ids) for e in task.split("train")])
  assert set(lengths["base"]) == {5}  # every answer 4 digits + <eos>: no tail
  short, long = np.percentile(lengths["tail"], [50, 99])
  assert short <= 5 and long >= 10 and lengths["tail"].max() >= 11  # 10-11 digits + <eos>


def test_scratchpad_config_is_the_main_job_with_long_scratchpad_responses():
  base, pad = _experiment_config("arithmetic"), _experiment_config("arithmetic_scratchpad")
  rl.validate_config(pad)
  assert pad.rl.to_dict() == base.rl.to_dict() and pad.train.to_dict() == base.train.to_dict()
  task = rl.make_task(pad)
  lengths = np.array([len(e.target_ids) for e in task.split("train")])
  assert all("*" in e.answer for e in task.split("train")[:50])  # steps, then the answer
  median, high = np.percentile(lengths, [50, 99])
  assert lengths.min() >= 26 and 50 <= median <= 80 and high >= 130  # a long tail
  assert lengths.max() <= task.max_answer_len == 147


# "vcpo" needs score-gradient norms as well as rewards: tests/rl/test_rl_vcpo.py.
@pytest.mark.parametrize("baseline", [b for b in rl.BASELINES if b != "vcpo"])
def test_group_advantages_match_objectives(baseline):
  k = 5 if baseline == "median" else 4
  rewards = jnp.asarray(np.random.default_rng(0).integers(0, 2, 3 * k), jnp.float32)
  adv, keep = jax.jit(rl.group_advantages, static_argnums=(1, 2))(rewards, k, baseline)
  grouped = rewards.reshape(3, k)
  if baseline == "median":
    want, want_keep = jax.jit(objectives.median_advantages)(grouped)
    np.testing.assert_array_equal(np.asarray(keep).reshape(3, k).sum(1), [k - 1] * 3)
  else:
    fn = {
      "grpo": objectives.grpo_advantages,
      "drgrpo": objectives.drgrpo_advantages,
      "rloo": objectives.rloo_advantages,
    }[baseline]
    want, want_keep = jax.jit(fn)(grouped), jnp.ones_like(grouped)
  np.testing.assert_allclose(np.asarray(adv), np.asarray(want).reshape(-1), rtol=1e-6)
  np.testing.assert_array_equal(np.asarray(keep), np.asarray(want_keep).reshape(-1))


def test_group_advantages_bad_inputs():
  with pytest.raises(ValueError, match="baseline"):
    rl.group_advantages(jnp.zeros(8), 4, "mean")
  with pytest.raises(ValueError, match="multiple of group_size=3"):
    rl.group_advantages(jnp.zeros(8), 3, "grpo")
  with pytest.raises(ValueError, match="odd number"):
    rl.group_advantages(jnp.zeros(8), 4, "median")


def test_build_rollout_batch_layout():
  prompts = np.asarray([[5, 6, 7], [8, 9, 0]], np.int32)
  plen = np.asarray([3, 2], np.int32)
  resp = np.asarray([[1, 2, 0, 0], [3, 4, 2, 0]], np.int32)
  logp = np.asarray([[-0.1, -0.2, 0, 0], [-0.3, -0.4, -0.5, 0]], np.float32)
  rlen = np.asarray([2, 3], np.int32)
  b = jax.jit(rl.build_rollout_batch)(
    prompts, plen, resp, logp, rlen, np.asarray([False, True]), np.asarray([0, 0]), 7
  )
  np.testing.assert_array_equal(b.tokens, [[5, 6, 7, 1, 2, 0, 0], [8, 9, 3, 4, 2, 0, 0]])
  np.testing.assert_array_equal(b.prompt_mask[1], [1, 1, 0, 0, 0, 0, 0])
  np.testing.assert_array_equal(b.response_mask[0], [0, 0, 0, 1, 1, 0, 0])
  np.testing.assert_allclose(b.rollout_logp[1], [0, 0, -0.3, -0.4, -0.5, 0, 0])
  np.testing.assert_array_equal(b.policy_version[0], [-1, -1, -1, 7, 7, -1, -1])
  assert b.finish_reasons == ["length", "stop"]
  assert b.responses() == [[1, 2], [3, 4, 2]]
  completion, lengths = jax.jit(rl.response_arrays)(b)
  np.testing.assert_array_equal(completion[1, :4], [3, 4, 2, 0])
  tb = jax.jit(rl.train_batch)(
    b.with_rewards([1.0, 0.0]), jnp.asarray([0.5, -0.5]), jnp.asarray([1.0, 0.0])
  )
  np.testing.assert_array_equal(tb["loss_mask"][1], np.zeros(7))
  np.testing.assert_array_equal(tb["loss_mask"][0], b.response_mask[0])
  with pytest.raises(ValueError, match="rewards"):
    b.with_rewards([1.0])
  with pytest.raises(ValueError, match=r"`rewards` must be finite; rows \[1\] are not \(\[nan\]\)"):
    b.with_rewards([1.0, float("nan")])
  jax.jit(lambda r: b.with_rewards(r).rewards)(jnp.asarray([1.0, jnp.nan]))  # traced: no check
  with pytest.raises(ValueError, match="response_lengths"):
    rl.build_rollout_batch(prompts, plen, resp, logp, rlen[:1], rlen, rlen, 0)


def test_prompt_source_resumes_exactly():
  examples = list(range(10))
  a = rl.PromptSource(examples, batch_size=4, seed=3)
  first = [a.next_batch() for _ in range(2)]
  b = rl.PromptSource(examples, batch_size=4, seed=3, cursor=a.cursor)
  rest_a, rest_b = [a.next_batch() for _ in range(3)], [b.next_batch() for _ in range(3)]
  assert rest_a == rest_b
  seen = [x for batch in first + rest_a for x in batch]
  assert sorted(seen[:10]) == examples  # an epoch covers every example once
  with pytest.raises(ValueError, match="empty"):
    rl.PromptSource([], batch_size=2, seed=0)


def test_pad_prompts_rejects_long_or_empty():
  with pytest.raises(ValueError, match="outside"):
    rl.pad_prompts([[1, 2, 3]], 2)
  with pytest.raises(ValueError, match="empty"):
    rl.pad_prompts([], 2)


def test_sweep_grid_and_table():
  grid = rl.parse_grid("train.loss=ppo,cispo;rl.num_samples=4,8")
  assert grid == {"train.loss": ["ppo", "cispo"], "rl.num_samples": [4, 8]}
  points = rl.grid_points(grid)
  assert len(points) == 4 and points[1] == {"train.loss": "ppo", "rl.num_samples": 8}
  assert rl.grid_points(rl.parse_grid("")) == [{}]
  with pytest.raises(ValueError, match="field=v1,v2"):
    rl.parse_grid("train.loss")
  rows = [
    {
      "point": "loss=ppo",
      "loss": "ppo",
      "baseline": "grpo",
      "seed": s,
      "accuracy_before": 0.3,
      "accuracy_after": a,
      "improvement_points": 100 * (a - 0.3),
      "wall_time_s": 100.0,
      "iterations": 5,
    }
    for s, a in ((0, 0.7), (1, 0.8))
  ]
  other = [
    dict(r, point="loss=cispo", loss="cispo", accuracy_after=b, improvement_points=100 * (b - 0.3))
    for r, b in zip(rows, (0.6, 0.9), strict=True)
  ]
  table = rl.sweep_table(rows + other)
  assert "| loss=ppo | ppo | grpo | 2 | 0.300 (0.300..0.300) | 0.750 (0.700..0.800) |" in table
  # Paired with the first point seed by seed: -10 and +10 points -> mean 0, sd 14.1.
  assert "| +45.0 (+30.0..+60.0) | +0.0 ± 14.1 (n=2) | 100 (100..100) |" in table
  assert "| +45.0 (+40.0..+50.0) | - | 100 (100..100) |" in table
