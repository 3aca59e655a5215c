"""The RL config as a researcher extends it: imports, per-task kwargs, typos, schedules, logs."""

import json
import os
import sys

import numpy as np
import pytest
import rl_test_utils

from rlx import objectives, rl, tasks

LOSS_FILE = """
import jax.numpy as jnp
from rlx import objectives

CALLS = []


def file_loss(logp, old_logp, advantages, mask, *, scale=1.0, is_weights=None,
              agg="token-mean", agg_scale=None):
  ratio = jnp.exp(logp - old_logp)
  loss = objectives.aggregate(-scale * ratio * advantages, mask, agg, scale=agg_scale)
  return loss, objectives.policy_loss_metrics(mask, log_ratio=logp - old_logp, ratio=ratio)


CALLS.append(1)
objectives.register_policy_loss("file_loss", file_loss)
"""


def test_imports_a_py_path_once_and_registers_its_loss(policy_loss_registry, tmp_path, monkeypatch):
  path = tmp_path / "my_losses.py"
  path.write_text(LOSS_FILE)
  monkeypatch.chdir(tmp_path)
  config = rl.get_config()
  config.imports = "my_losses.py"
  config.train.loss = "file_loss"
  config.train.loss_kwargs.scale = 2.0
  rl.validate_config(config)
  assert "file_loss" in objectives.POLICY_LOSSES
  (module,) = rl.import_user_code(config)  # the same module: not executed again
  assert module.CALLS == [1]
  config.train.loss_kwargs.clip_low = 0.1
  with pytest.raises(ValueError, match=r"unknown keywords \['clip_low'\]; file_loss takes"):
    rl.validate_config(config)
  sys.modules.pop(module.__name__)


def test_imports_name_what_fails():
  config = rl.get_config()
  config.imports = "no_such_module_xyz"
  with pytest.raises(ValueError, match=r"`config.imports`: importing 'no_such_module_xyz' failed"):
    rl.validate_config(config)
  config.imports = "missing/file.py"
  with pytest.raises(ValueError, match=r"`config.imports`: 'missing/file.py' is not a file"):
    rl.validate_config(config)
  config.imports = "json, os.path"  # module names, comma-separated
  assert [m.__name__ for m in rl.import_user_code(config)] == ["json", "posixpath"]


def test_unregistered_loss_names_the_registration_route():
  config = rl.get_config()
  config.train.loss = "my_loss"
  with pytest.raises(
    ValueError, match="register_policy_loss in a module named by `config.imports`"
  ):
    rl.validate_config(config)


def test_task_gets_only_its_own_kwargs():
  config = rl.get_config()
  config.task.arithmetic.num_digits = 2
  assert rl.task_kwargs(config) == {"num_digits": 2}
  config.task.kwargs.train_size = 50
  assert rl.task_kwargs(config) == {"num_digits": 2, "train_size": 50}
  config.task.name = "gsm8k"  # another task: none of arithmetic's
  assert rl.task_kwargs(config) == {"train_size": 50}
  tasks.register_task("kw_task", lambda *, size=3: None, overwrite=True)
  config.task.name = "kw_task"
  config.task.kwargs.size = 4
  del config.task.kwargs["train_size"]
  assert rl.task_kwargs(config) == {"size": 4}
  config.task.kwargs.sise = 4
  with pytest.raises(
    ValueError, match=r"unknown keywords \['sise'\]; task 'kw_task' takes \['size'\]"
  ):
    rl.validate_config(config)


def test_the_main_job_config_passes_no_arithmetic_or_ppo_kwargs_to_other_choices():
  import importlib.util  # noqa: PLC0415

  path = os.path.join(
    os.path.dirname(__file__), "..", "..", "experiments", "configs", "arithmetic.py"
  )
  spec = importlib.util.spec_from_file_location("arithmetic_cfg", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  config = module.get_config()
  assert config.train.loss_kwargs.to_dict() == {}  # gspo / ctpo keep their own clip defaults
  assert config.task.kwargs.to_dict() == {}
  config.task.name = "gsm8k"
  assert rl.task_kwargs(config) == {}


def test_typos_are_named_with_the_closest_field():
  config = rl.get_config()
  config.rl.temprature = 0.5
  with pytest.raises(
    ValueError,
    match=r"`config.rl.temprature` is not a config field; did you mean `config.rl.temperature`\?",
  ):
    rl.validate_config(config)
  config = rl.get_config()
  config.train.optimizer.learnin_rate = 1e-3
  with pytest.raises(ValueError, match=r"did you mean `config.train.optimizer.learning_rate`\?"):
    rl.validate_config(config)
  config = rl.get_config()
  config.zzz = 1
  with pytest.raises(ValueError, match=r"`config.zzz` is not a config field; the fields here are"):
    rl.validate_config(config)
  config = rl.get_config()
  del config.eval["every"]
  with pytest.raises(ValueError, match=r"`config.eval.every` is missing"):
    rl.validate_config(config)


@pytest.mark.parametrize(
  ("iterations", "mini", "epochs", "warmup", "explicit", "expected"),
  [(400, 2, 1, 10, 0, 800), (100, 2, 2, 10, 0, 400), (3, 1, 1, 10, 0, 11), (100, 2, 1, 10, 50, 50)],
)
def test_decay_follows_the_run_length(iterations, mini, epochs, warmup, explicit, expected):
  config = rl.get_config()
  config.rl.iterations = iterations
  config.train.mini_batches = mini
  config.train.ppo_epochs = epochs
  config.train.optimizer.warmup_steps = warmup
  config.train.optimizer.decay_steps = explicit
  rl.validate_config(config)
  assert rl.train_config(config).optimizer.decay_steps == expected


def test_metrics_lines_are_strict_json(tmp_path):
  log = rl.MetricsLog(str(tmp_path), resume_iteration=0, tensorboard=False)
  log.write({"phase": "rl", "iteration": 1, "a": float("nan"), "b": np.float32("inf"), "c": 1.5})
  log.close()
  (line,) = (tmp_path / "metrics.jsonl").read_text().splitlines()
  assert json.loads(line) == {"phase": "rl", "iteration": 1, "a": None, "b": None, "c": 1.5}
  assert "NaN" not in line and "Infinity" not in line


def test_run_figure_shows_both_clip_sides_and_starts_at_the_warmup(tmp_path):
  log = rl.MetricsLog(str(tmp_path), resume_iteration=0, tensorboard=False)
  log.write({"phase": "warmup", "step": 0, "loss": None, "dev_accuracy": 0.1})
  log.write({"phase": "warmup", "step": 5, "loss": 1.0, "dev_accuracy": 0.32})
  for i in (1, 2):
    log.write(
      {
        "phase": "rl",
        "iteration": i,
        "reward_mean": 0.5,
        "clip_frac_low": 0.01,
        "clip_frac_high": 0.2 * i,
        "clip_frac_dual": 0.0,
      }
    )
  log.write({"phase": "eval", "iteration": 2, "dev_accuracy": 0.5})
  log.close()
  fig = rl.run_figure(str(tmp_path), accuracy_before=0.3, accuracy_after=0.6)
  axes = {ax.get_title(): ax for ax in fig.axes}
  clip = axes["clip fraction (low / high / dual)"]
  lines = {line.get_label(): list(line.get_ydata()) for line in clip.get_lines()}
  assert lines == {"low": [0.01, 0.01], "high": [0.2, 0.4]}  # an all-zero dual side is left out
  (dev,) = axes["held-out greedy accuracy (dev)"].get_lines()
  assert list(dev.get_xdata()) == [0, 2] and list(dev.get_ydata()) == [0.32, 0.5]


def test_warmup_key_and_init_from_errors(tmp_path):
  a, b = rl.get_config(), rl.get_config()
  assert rl.warmup_key(a) == rl.warmup_key(b)
  b.warmup.init_from = "/elsewhere"  # where it comes from is not what it is
  b.train.loss = "cispo"  # nor is the RL config
  assert rl.warmup_key(a) == rl.warmup_key(b)
  b.seed = 1
  assert rl.warmup_key(a) != rl.warmup_key(b)
  config = rl_test_utils.tiny_config(**{"warmup.init_from": str(tmp_path / "nowhere")})
  with pytest.raises(ValueError, match=r"`config.warmup.init_from`=.*nowhere' holds no warm-up"):
    rl.run(config, str(tmp_path / "run"))


def test_a_failed_start_does_not_lock_the_workdir(tmp_path):
  workdir = str(tmp_path / "run")
  first = rl_test_utils.tiny_config(**{"warmup.init_from": str(tmp_path / "nowhere")})
  with pytest.raises(ValueError, match="holds no warm-up"):
    rl.run(first, workdir)
  # Nothing was saved, so a corrected config may use the same workdir (it fails later here
  # for the same kind of reason, not because the workdir holds another run).
  second = rl_test_utils.tiny_config(
    **{"warmup.init_from": str(tmp_path / "elsewhere"), "rl.temperature": 0.7}
  )
  with pytest.raises(ValueError, match="elsewhere' holds no warm-up"):
    rl.run(second, workdir)


def test_loss_kwargs_of_the_wrong_kind_are_named():
  config = rl.get_config()
  config.train.loss_kwargs.clip_low = "abc"
  with pytest.raises(
    ValueError, match=r"`config.train.loss_kwargs.clip_low` must be a real number .*got 'abc'"
  ):
    rl.validate_config(config)
  config = rl.get_config()
  config.train.loss_kwargs.clip_low = True
  with pytest.raises(ValueError, match="must be a real number"):
    rl.validate_config(config)
  config = rl.get_config()
  config.train.loss_kwargs.clip_low = 0.1
  config.train.loss_kwargs.dual_clip = 3  # default None: the loss checks it
  rl.validate_config(config)


def test_a_sweep_checks_every_point_before_running(tmp_path):
  base = rl_test_utils.tiny_config()
  with pytest.raises(ValueError, match=r"Grid point loss=nope \(seed 0\): `config.train.loss`"):
    rl.run_sweep(base, {"train.loss": ["ppo", "nope"]}, [0], str(tmp_path))
  assert not os.listdir(tmp_path)  # nothing ran
  # Explicit points: settings that go together, checked the same way.
  points = [{"train.loss": "ppo", "rl.old_logp": "behaviour"}, {"train.loss": "ppo"}]
  bad = [*points, {"train.loss": "ppo", "rl.old_logp": "proximal"}]
  with pytest.raises(ValueError, match=r"Grid point loss=ppo,old_logp=proximal .*rl.old_logp"):
    rl.run_sweep(base, bad, [0], str(tmp_path))
  with pytest.raises(ValueError, match="lists a point twice"):
    rl.run_sweep(base, [points[1], points[1]], [0], str(tmp_path))
  assert not os.listdir(tmp_path)


def test_an_imported_file_can_import_its_siblings(tmp_path, monkeypatch):
  (tmp_path / "helpers_sibling.py").write_text("VALUE = 7\n")
  (tmp_path / "uses_sibling.py").write_text(
    "import helpers_sibling\nVALUE = helpers_sibling.VALUE\n"
  )
  monkeypatch.chdir(tmp_path)
  monkeypatch.setattr(sys, "path", list(sys.path))
  config = rl.get_config()
  config.imports = "uses_sibling.py"
  (module,) = rl.import_user_code(config)
  assert module.VALUE == 7
  sys.modules.pop(module.__name__)
  sys.modules.pop("helpers_sibling")


def test_warmup_shows_progress_and_first_compile_notes(tmp_path, capfd):
  # 10 warm-up steps (capped, with a warning): the bar and the notes, not the accuracy.
  config = rl_test_utils.tiny_config(
    **{
      "log.progress_bar": True,
      "rl.iterations": 1,
      "eval.every": 1,
      "checkpoint.every": 1,
      "warmup.max_steps": 10,
      "warmup.eval_every": 5,
      "warmup.on_cap": "warn",
    }
  )
  with pytest.warns(UserWarning, match="warmup.max_steps=10"):
    summary = rl.run(config, str(tmp_path))
  err = capfd.readouterr().err
  assert summary["warmup_steps"] == 10
  assert "warm-up:" in err and "dev_acc=" in err  # the warm-up's progress bar
  for what in ("the greedy evaluation sampler", "the warm-up step"):
    assert f"rlx: compiling {what} (first call) ..." in err
    assert f"rlx: {what}: first call took" in err
  assert "RL iteration (sampler, log-probs, train step) (first call) ..." in err or (
    "fused RL iteration (sampler + reward + train step) (first call) ..." in err
  )
