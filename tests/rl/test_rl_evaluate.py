"""`rl.GreedyEvaluator`: the run's greedy evaluation, built once and shared by scripts."""

import pytest
import rl_test_utils

from rlx import rl


def test_evaluator_cuts_the_splits_sizes_its_sampler_and_scores_greedily():
  config = rl_test_utils.tiny_config(**{"eval.dev_examples": 6, "eval.test_examples": 0})
  task = rl.make_task(config)
  mesh = rl.build_mesh(config)
  model_config, params = rl.build_model(config, task)
  evaluate = rl.GreedyEvaluator(config, task, model_config, mesh)
  assert list(evaluate.dev) == list(task.split("dev")[:6])
  assert list(evaluate.test) == list(task.split("test"))  # 0 = the whole split
  assert evaluate.batch_size == 6 and evaluate.sampler.config.temperature == 0.0
  dev = evaluate(params, "dev")
  assert dev == rl.greedy_accuracy(evaluate.sampler, params, task, evaluate.dev, batch_size=6)
  assert evaluate(params, list(evaluate.dev)) == dev
  with pytest.raises(ValueError, match="'dev', 'test' or examples"):
    evaluate(params, "train")
