"""experiments/staleness_study.py: valid grid points and per-run figures computed right."""

import importlib.util
import json
import pathlib

import pytest
import rl_test_utils

from rlx import rl

_PATH = pathlib.Path(__file__).resolve().parents[2] / "experiments" / "staleness_study.py"


@pytest.fixture(scope="module")
def study():
  spec = importlib.util.spec_from_file_location("staleness_study", _PATH)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)  # defines no flags: they are defined under __main__
  return module


def test_every_cell_is_a_valid_config_with_its_old_logp(study):
  points = study.cell_points(list(study.METHODS), [0, 4, 64])
  assert len(points) == 3 * len(study.METHODS)
  for point in points:
    config = rl_test_utils.tiny_config(**point)
    rl.validate_config(config)
  modes = {m: study.METHODS[m]["rl.old_logp"] for m in study.METHODS}
  # The ratio to the behaviour policy for the plain objectives; the proximal
  # policy for the decoupled ones (their mask / weight is behaviour -> proximal).
  assert modes["ppo"] == modes["vespo"] == modes["sat"] == "behaviour"
  assert modes["m2po_mask"] == modes["decoupled_ppo"] == "current" and modes["ppo_ewma"] == "ewma"
  assert study.METHODS["m2po"] == {"train.loss": "m2po", "rl.old_logp": "behaviour"}
  m2po = study.METHODS["m2po_mask"]
  assert m2po["train.use_m2po"] and m2po["train.use_rollout_correction"]
  assert m2po["train.rollout_correction_kwargs.truncate"] is None  # M2PO's ratio to mu, whole
  # VCPO = decoupled PPO plus its ESS step scaling and its minimum-variance baseline.
  assert study.METHODS["vcpo"] == {
    **study.METHODS["decoupled_ppo"],
    "train.use_vcpo": True,
    "rl.baseline": "vcpo",
  }


def _write(workdir, records):
  with open(workdir / "metrics.jsonl", "w") as f:
    for r in records:
      f.write(json.dumps(r) + "\n")


def _rl(i, **kw):
  base = {"phase": "rl", "iteration": i, "clip_frac_low": 0.1, "clip_frac_high": 0.2}
  return {**base, "clip_frac_dual": 0.0, "entropy": 0.5, **kw}


def test_run_stats_by_hand(study, tmp_path):
  records = [{"phase": "warmup", "step": 0, "dev_accuracy": 0.0}]
  records += [_rl(i, entropy=float(i), offpolicy_ess=0.5, m2po_masked_frac=0.25) for i in (1, 2)]
  records += [{"phase": "eval", "iteration": 2, "dev_accuracy": 0.7}]
  records += [_rl(3, entropy=3.0, offpolicy_ess=0.8)]  # no mask metric: counts as 0
  records += [{"phase": "eval", "iteration": 3, "dev_accuracy": 0.45}]
  _write(tmp_path, records)
  s = study.run_stats(str(tmp_path), warmup_dev=0.3)
  assert s["best_dev"] == 0.7 and s["final_dev"] == 0.45
  assert s["max_drop"] == pytest.approx(0.25) and s["collapsed"]  # ends 25 points below 0.7
  assert s["clip_frac"] == pytest.approx(0.3)
  assert s["mask_frac"] == pytest.approx(0.5 / 3)
  assert s["ess"] == pytest.approx(0.6)
  assert s["entropy_start"] == pytest.approx(2.0) and s["entropy_end"] == pytest.approx(2.0)
  assert s["dev_curve"] == [[0, 0.3], [2, 0.7], [3, 0.45]]
  # Ending exactly 20 points below the peak is no collapse; nor is a dip that recovers.
  records[-1] = {"phase": "eval", "iteration": 3, "dev_accuracy": 0.5}
  _write(tmp_path, records)
  assert not study.run_stats(str(tmp_path), warmup_dev=0.3)["collapsed"]
  records += [{"phase": "eval", "iteration": 4, "dev_accuracy": 0.2}]
  records += [{"phase": "eval", "iteration": 5, "dev_accuracy": 0.65}]
  _write(tmp_path, records)
  s = study.run_stats(str(tmp_path), warmup_dev=0.3)
  assert s["max_drop"] == pytest.approx(0.5) and not s["collapsed"]


def test_tables_pair_each_cell_with_its_own_staleness_zero(study):
  def row(seed, acc):
    return {
      "seed": seed, "accuracy_after": acc, "best_dev": acc, "collapsed": acc < 0.5, "max_drop": 0.1,
      "clip_frac": 0.1, "mask_frac": 0.0, "ess": 1.0, "entropy_start": 0.5, "entropy_end": 0.4,
    }  # fmt: skip

  cells = {
    ("ppo", 0): [row(0, 0.8), row(1, 0.9)],
    ("ppo", 4): [row(0, 0.7), row(1, 0.4)],
    ("vespo", 4): [row(0, 0.75), row(1, 0.6)],
  }
  table = study.study_table(cells)
  assert "| ppo | 4 | 2 | 0.550 (0.400..0.700) | -30.0 ± 28.3 (n=2) | - |" in table
  # No staleness-0 cell of its own; +5 and +20 points over ppo seed by seed.
  assert "| vespo | 4 | 2 | 0.675 (0.600..0.750) | - | +12.5 ± 10.6 (n=2) |" in table
  assert "| 1/2 |" in table
  # Paired with another reference objective: ppo's row gains the column, vespo's loses it.
  table = study.study_table(cells, reference="vespo")
  assert "| vs vespo at this staleness, paired (points) |" in table
  assert "| ppo | 4 | 2 | 0.550 (0.400..0.700) | -30.0 ± 28.3 (n=2) | -12.5 ± 10.6 (n=2) |" in table
  assert "| vespo | 4 | 2 | 0.675 (0.600..0.750) | - | - |" in table
  summary = study.summary_table(cells, ["ppo"], [0, 4])
  assert "| ppo | 0.850 | 0.550 (1 collapsed) |" in summary
