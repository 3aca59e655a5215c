"""experiments/warmup_generalization.py: its warm-up is the one `rlx.rl.run` trains."""

import importlib.util
import json
import pathlib

import rl_test_utils

from rlx import rl

_PATH = pathlib.Path(__file__).resolve().parents[2] / "experiments" / "warmup_generalization.py"


def test_the_warmup_cell_trains_the_run_warmup_and_measures_three_splits(tmp_path):
  spec = importlib.util.spec_from_file_location("warmup_generalization", _PATH)
  study = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(study)  # defines no flags: they are defined under __main__
  overrides = {
    "warmup.max_steps": 6,
    "warmup.eval_every": 2,
    "warmup.on_cap": "warn",
    "rl.iterations": 1,
  }
  cell = study.warmup_cell(rl_test_utils.tiny_config(**overrides), train_examples=16)
  rl.run(rl_test_utils.tiny_config(**overrides), str(tmp_path))
  records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  warm = [r for r in records if r["phase"] == "warmup"]
  summary = json.loads((tmp_path / "summary.json").read_text())
  # Same init, data order and step as the run's warm-up: the same steps, loss and dev accuracy.
  assert cell["steps"] == summary["warmup_steps"] == 6
  assert cell["loss"] == warm[-1]["loss"]
  assert cell["dev"] == summary["warmup_dev_accuracy"]
  assert cell["test"] == summary["accuracy_before"]  # the same 64 test problems, same params
  assert cell["epochs"] == 6 * 64 / 2000
  assert 0.0 <= cell["train"] <= 1.0
