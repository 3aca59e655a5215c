"""The researcher's workflow as a new user runs it: the README's own loss and task files,
run through experiments/train_rl.py and experiments/sweep.py from the command line."""

import json
import math
import os
import re
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = os.path.join(REPO, "tests", "rl", "tiny_arithmetic_config.py")
# Sizes that make the README's command a seconds-long run (the fields exist in
# every config; the loss, task and imports come from the README's command).
SMALL = [
  "--config.warmup.enabled=False",
  "--config.rl.iterations=2",
  "--config.rl.prompts_per_iteration=4",
  "--config.rl.num_samples=2",
  "--config.eval.every=1",
  "--config.eval.dev_examples=8",
  "--config.eval.test_examples=8",
  "--config.checkpoint.every=1",
  "--config.log.plots=False",
]


def _readme():
  with open(os.path.join(REPO, "README.md")) as f:
    return f.read()


def _user_files(directory):
  """Writes the README's `# my_*.py` snippets into `directory`; returns the README command."""
  text = _readme()
  blocks = re.findall(r"```python\n(# (my_\w+\.py)[^\n]*\n.*?)```", text, re.S)
  assert {name for _, name in blocks} == {"my_loss.py", "my_task.py"}
  for code, name in blocks:
    (directory / name).write_text(code)
  command = re.search(
    r"```bash\n(python experiments/train_rl.py --config\.imports=[^\n]*)\n```", text
  )
  assert command, "the README shows the command that runs the custom loss and task"
  return command.group(1).split()


def _run(args, cwd, timeout=600):
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=os.environ.get("RLX_TEST_XLA_FLAGS", ""))
  return subprocess.run(
    [sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
  )


def _replace_workdir(args, workdir):
  return [a for a in args if not a.startswith("--workdir=")] + [f"--workdir={workdir}"]


def _strict_json_lines(path):
  with open(path) as f:
    lines = f.read().splitlines()
  for line in lines:
    json.loads(line, parse_constant=lambda c: pytest.fail(f"non-JSON constant {c} in {path}"))
  return [json.loads(line) for line in lines]


def _tensorboard_tags(directory):
  """{tag: [(step, value), ...]} of every event file under `directory` (TFRecord framing)."""
  import struct  # noqa: PLC0415

  from tensorboardX.proto import event_pb2  # noqa: PLC0415

  tags = {}
  for root, _, files in os.walk(directory):
    for name in files:
      if "tfevents" not in name:
        continue
      with open(os.path.join(root, name), "rb") as f:
        data = f.read()
      offset = 0
      while offset < len(data):
        (length,) = struct.unpack("<Q", data[offset : offset + 8])
        event = event_pb2.Event.FromString(data[offset + 12 : offset + 12 + length])
        offset += 12 + length + 4
        for value in event.summary.value:
          tags.setdefault(value.tag, []).append((event.step, value.simple_value))
  return tags


def test_readme_loss_and_task_from_the_command_line(tmp_path):
  command = _user_files(tmp_path)
  assert command[:2] == ["python", "experiments/train_rl.py"]
  script = os.path.join(REPO, command[1])
  workdir = tmp_path / "run"
  args = [script, *_replace_workdir(command[2:], workdir), *SMALL]
  result = _run(args, tmp_path)
  assert result.returncode == 0, result.stderr[-3000:]
  summary = json.loads((workdir / "summary.json").read_text())
  assert summary["task"] == "copy" and summary["loss"] == "my_loss"
  assert summary["config"]["train"]["loss_kwargs"] == {"clip": 0.1}
  assert summary["config"]["task"]["kwargs"] == {}  # the default config's arithmetic kwargs stay
  assert summary["iterations"] == 2 and summary["skipped_updates"] == 0
  records = _strict_json_lines(workdir / "metrics.jsonl")
  rl_records = [r for r in records if r.get("phase") == "rl"]
  assert len(rl_records) == 2 and all(math.isfinite(r["loss"]) for r in rl_records)
  # A first compile is announced; the summary table names the loss and baseline.
  assert "rlx: compiling the" in result.stderr
  assert "loss 'my_loss', baseline 'grpo'" in result.stdout
  before = (workdir / "summary.json").read_text()

  # The finished workdir keeps its record: the same command returns it, another config is refused.
  again = _run(args, tmp_path)
  assert again.returncode == 0, again.stderr[-3000:]
  assert (workdir / "summary.json").read_text() == before
  ppo = [
    "--config.train.loss=ppo" if a == "--config.train.loss=my_loss" else a
    for a in args
    if not a.startswith("--config.train.loss_kwargs.")
  ]
  other = _run(ppo, tmp_path)
  assert other.returncode != 0
  assert "holds a run of a different config (train.loss: 'my_loss' -> 'ppo'" in other.stderr
  assert (workdir / "summary.json").read_text() == before

  # Any keyword of the chosen loss (or task) is a command-line field; others are named.
  bad = _run([*args[: -len(SMALL)], "--config.train.loss_kwargs.clip_low=0.1"], tmp_path)
  assert bad.returncode != 0
  assert "`config.train.loss_kwargs` has unknown keywords ['clip_low']; my_loss takes" in (
    bad.stderr
  )
  bad = _run([*args, "--config.task.kwargs.size=3"], tmp_path)
  assert "`config.task.kwargs`: unknown keywords ['size']; task 'copy' takes []" in bad.stderr
  typo = _run([*args, "--config.rl.temprature=0.5"], tmp_path)
  assert "`config.rl.temprature` is not a config field; did you mean `config.rl.temperature`?" in (
    typo.stderr
  )


def test_sweep_script_with_a_custom_loss_shares_warmups(tmp_path):
  """sweep.py: the README's loss against PPO over one seed; the second run reuses the warm-up."""
  _user_files(tmp_path)
  root = tmp_path / "sweep"
  args = [
    os.path.join(REPO, "experiments", "sweep.py"),
    f"--config={TINY}",
    "--config.imports=my_loss.py",
    "--config.task.name=arithmetic",
    "--config.warmup.enabled=True",
    "--config.rl.iterations=2",
    "--config.eval.every=1",
    "--grid=train.loss=ppo,my_loss",
    "--seeds=0",
    f"--workdir={root}",
  ]
  result = _run(args, tmp_path)
  assert result.returncode == 0, result.stderr[-3000:]
  lines = [line for line in result.stdout.splitlines() if line.startswith("[")]
  assert len(lines) == 2, result.stdout
  assert lines[0].startswith("[1/2] loss=ppo seed=0: test accuracy ")
  assert lines[1].startswith("[2/2] loss=my_loss seed=0: test accuracy ")
  assert lines[1].endswith("(warm-up reused)") and not lines[0].endswith("(warm-up reused)")
  rows = json.loads((root / "sweep.json").read_text())
  first, second = rows
  assert second["warmup_reused_from"] == os.path.join(first["workdir"], "warmup")
  assert second["warmup_steps"] == first["warmup_steps"] > 0
  assert second["accuracy_before"] == first["accuracy_before"]
  assert "| loss=my_loss | my_loss | grpo | 1 |" in (root / "sweep.md").read_text()
  # TensorBoard: warm-up curves, RL curves, the test accuracy before / after, hparams.
  tags = _tensorboard_tags(os.path.join(first["workdir"], "tensorboard"))
  assert len(tags["warmup/dev_accuracy"]) >= 2 and "warmup/loss" in tags
  assert [s for s, _ in tags["rl/reward_mean"]] == [1, 2]
  accuracy = dict(tags["test/accuracy"])
  assert accuracy[0] == pytest.approx(first["accuracy_before"])
  assert accuracy[2] == pytest.approx(first["accuracy_after"])
  assert os.path.isdir(os.path.join(first["workdir"], "tensorboard", "hparams"))
  # The reused warm-up's curve is in the second run's log too.
  warm = [
    r
    for r in _strict_json_lines(os.path.join(second["workdir"], "metrics.jsonl"))
    if r["phase"] == "warmup"
  ]
  assert warm and warm[0]["loss"] is None and warm[-1]["step"] == first["warmup_steps"]

  # Re-running the grid reads the finished runs back (same rows, nothing retrained).
  again = _run(args, tmp_path)
  assert again.returncode == 0, again.stderr[-3000:]
  rows_again = json.loads((root / "sweep.json").read_text())
  for a, b in zip(rows, rows_again, strict=True):
    assert a["accuracy_after"] == b["accuracy_after"] and a["wall_time_s"] == b["wall_time_s"]
  # ... but not under another base config.
  changed = _run([*args, "--config.rl.temperature=0.7"], tmp_path)
  assert changed.returncode != 0
  assert "holds a run of a different config (rl.temperature: 1.0 -> 0.7)" in changed.stderr
