"""The supervised warm-up's gradient clip (`config.warmup.max_grad_norm`) and its warm-up key."""

import json

import jax
import ml_collections
import numpy as np
import optax
import pytest
import rl_test_utils

from rlx import rl


def _one_step(max_grad_norm):
  """Init params and the params after one warm-up step (no dev evaluation: accuracy 0)."""
  config = rl_test_utils.tiny_config(
    **{
      "warmup.max_steps": 1,
      "warmup.eval_every": 1,
      "warmup.on_cap": "warn",
      "warmup.max_grad_norm": max_grad_norm,
    }
  )
  rl.validate_config(config)
  task = rl.make_task(config)
  model_config, params = rl.build_model(config, task)
  mesh = rl.build_mesh(config)
  with pytest.warns(UserWarning, match="max_steps=1"):
    result = rl.supervised_warmup(
      params, model_config, mesh, task, config, evaluate=lambda p: 0.0,
      seq_len=task.max_prompt_len + task.max_answer_len, seed=0,
    )  # fmt: skip
  assert result.steps == 1
  delta = jax.tree.map(lambda new, old: np.asarray(new) - np.asarray(old), result.params, params)
  return result, float(optax.tree.norm(delta))


def test_the_clip_takes_effect():
  default, full = _one_step(1.0)
  tiny, tiny_norm = _one_step(1e-10)
  off, off_norm = _one_step(0.0)
  # The step's loss is computed before its update: the same whatever the clip.
  assert default.history[1]["loss"] == tiny.history[1]["loss"] == off.history[1]["loss"]
  # Clipped to 1e-10, the gradient is far below AdamW's eps: the update nearly vanishes.
  assert 0 < tiny_norm < 1e-3 * full
  # No clipping (0) differs from clipping at 1 (the first gradient's norm exceeds 1).
  assert not rl_test_utils.params_allclose(off.params, default.params)
  assert off_norm > 0.5 * full


@pytest.mark.parametrize("value", [-1.0, float("inf"), float("nan"), None, "1.0"])
def test_bad_max_grad_norm_is_named(value):
  config = rl_test_utils.tiny_config().to_dict()
  config["warmup"]["max_grad_norm"] = value  # a plain dict: no ConfigDict type coercion
  with pytest.raises(ValueError, match=r"`config.warmup.max_grad_norm` must be a finite number"):
    rl.validate_config(ml_collections.ConfigDict(config))


def test_a_saved_key_without_the_clip_field_is_the_default_warmup(tmp_path):
  config = rl.get_config()
  key = rl.warmup_key(config)
  old = json.loads(json.dumps(key))
  del old["warmup"]["max_grad_norm"]  # saved before the field existed
  assert rl.read_warmup_key(str(tmp_path)) is None
  (tmp_path / "warmup_key.json").write_text(json.dumps(old))
  assert rl.read_warmup_key(str(tmp_path)) == key
  config.warmup.max_grad_norm = 0.0
  assert rl.read_warmup_key(str(tmp_path)) != rl.warmup_key(config)
