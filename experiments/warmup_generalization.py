r"""Does the supervised warm-up memorise its training problems? Train vs held-out greedy accuracy.

  python experiments/warmup_generalization.py \
      '--grid=task.arithmetic.train_size=5000,50000;warmup.learning_rate=5e-4,1e-3' \
      --seeds=0,2,3,5,7 \
      --out=experiments/results/warmup_generalization.md

Each cell runs the main job's warm-up alone (experiments/configs/arithmetic.py,
any `--config.<field>=...` overrides it; `rlx.rl.supervised_warmup` with the
same seed, data order, dev evaluation and stopping rule as `rlx.rl.run`) at
one point of `--grid` (e.g. a training-set size and a warm-up learning rate),
then measures the greedy accuracy of the warmed-up policy on the first `--train_examples` training
problems (all of them seen by the warm-up) and on the test split. A warm-up
that memorises shows a train accuracy well above its test accuracy, and RL
then starts from a policy whose right answers on the training prompts, the
prompts RL samples, are partly recalled rather than computed.
"""

import shlex
import sys
import time

import numpy as np
from absl import app, flags
from ml_collections import config_flags

from rlx import train
from rlx.rl import (
  build_mesh,
  build_model,
  greedy_accuracy,
  grid_points,
  make_sampler,
  make_task,
  parse_grid,
  sampler_kwargs,
  samples_per_prompt,
  supervised_warmup,
)

if __name__ == "__main__":
  _CONFIG = config_flags.DEFINE_config_file(
    "config", "experiments/configs/arithmetic.py", "Base config file (get_config())."
  )
  _GRID = flags.DEFINE_string(
    "grid",
    "task.arithmetic.train_size=5000,50000;warmup.learning_rate=5e-4,1e-3",
    "field=v1,v2;field=v1,... over config fields (their product), as experiments/sweep.py.",
  )
  _SEEDS = flags.DEFINE_list("seeds", ["0"], "Seeds of every cell.")
  _TRAIN_EXAMPLES = flags.DEFINE_integer(
    "train_examples", 500, "Training problems (the first ones) whose greedy accuracy is measured."
  )
  _OUT = flags.DEFINE_string("out", "", "Write the markdown table here too.")


def _first(examples, n):
  return examples[:n] if n else examples  # 0 = the whole split, as in rlx.rl.run


def warmup_cell(config, train_examples: int) -> dict:
  """The warm-up of `config` and its greedy accuracy on train / dev / test problems."""
  task = make_task(config)
  mesh = build_mesh(config)
  model_config, params = build_model(config, task)
  dev = _first(task.split("dev"), int(config.eval.dev_examples))
  test = _first(task.split("test"), int(config.eval.test_examples))
  seen = task.split("train")[:train_examples]
  # The dev evaluator as rlx.rl.run builds it (slots = the dev set, rounded up
  # to the mesh's batch axes), so the warm-up stops where the main job's does.
  eval_batch = min(max(len(dev), 1), 512)
  kwargs = sampler_kwargs(config, task, rows=eval_batch, greedy=True)
  shards = train.batch_axis_size(mesh)
  kwargs["max_slots"] = -(-min(kwargs["max_slots"], eval_batch) // shards) * shards
  sampler = make_sampler(model_config, kwargs, mesh)
  rollout = sampler_kwargs(
    config,
    task,
    rows=int(config.rl.prompts_per_iteration) * samples_per_prompt(config),
    greedy=False,
  )

  def accuracy(p, examples):
    return greedy_accuracy(sampler, p, task, examples, batch_size=eval_batch)

  t0 = time.perf_counter()
  result = supervised_warmup(
    params,
    model_config,
    mesh,
    task,
    config,
    evaluate=lambda p: accuracy(p, dev),
    seq_len=rollout["max_prompt_len"] + rollout["max_new_tokens"],
    seed=int(config.seed),
  )
  seconds = time.perf_counter() - t0
  train_size = len(task.split("train"))
  return {
    "steps": result.steps,
    "epochs": result.steps * int(config.warmup.batch_size) / train_size,
    "dev": result.dev_accuracy,
    "loss": result.history[-1]["loss"],  # of the last step before the last evaluation
    "train": accuracy(result.params, seen),
    "test": accuracy(result.params, test),
    "seconds": seconds,
  }


def _mean_range(values, fmt):
  v = np.asarray(values, np.float64)
  return f"{fmt.format(v.mean())} ({fmt.format(v.min())}..{fmt.format(v.max())})"


def main(argv):
  del argv
  base = _CONFIG.value
  seeds = [int(s) for s in _SEEDS.value]
  rows = []
  for point in grid_points(parse_grid(_GRID.value)):
    name = ",".join(f"{k.split('.')[-1]}={v}" for k, v in point.items()) or "base"
    cells = []
    for seed in seeds:
      c = base.copy_and_resolve_references()
      c.update_from_flattened_dict(point)
      c.seed = seed
      cell = warmup_cell(c, _TRAIN_EXAMPLES.value)
      cells.append(cell)
      print(
        f"{name} seed={seed}: {cell['steps']} steps ({cell['epochs']:.1f} epochs), "
        f"train {cell['train']:.3f} / test {cell['test']:.3f}",
        flush=True,
      )
    gaps = [100 * (x["train"] - x["test"]) for x in cells]
    rows.append(
      f"| {name} | {len(seeds)} | {_mean_range([x['steps'] for x in cells], '{:.0f}')} | "
      f"{_mean_range([x['epochs'] for x in cells], '{:.1f}')} | "
      f"{_mean_range([x['train'] for x in cells], '{:.3f}')} | "
      f"{_mean_range([x['test'] for x in cells], '{:.3f}')} | "
      f"{_mean_range(gaps, '{:+.1f}')} | {_mean_range([x['seconds'] for x in cells], '{:.0f}')} |"
    )
  # The command as given (flags and --config overrides), to rerun it.
  argv_line = shlex.join(["python", "experiments/warmup_generalization.py", *sys.argv[1:]])
  lines = [
    "# The warm-up: train vs held-out greedy accuracy when it stops",
    "",
    f"Base config experiments/configs/arithmetic.py; the warm-up stops at dev greedy accuracy "
    f">= {base.warmup.target_dev_accuracy} (evaluated every {base.warmup.eval_every} steps, batch "
    f"{base.warmup.batch_size}). 'train' is the greedy accuracy on the first "
    f"{_TRAIN_EXAMPLES.value} training problems (seen by the warm-up), 'test' on "
    f"{base.eval.test_examples} test problems; the gap is train - test in points, per seed. "
    "Mean (min..max) over the seeds.",
    "",
    "| config | seeds | steps | epochs | train accuracy | test accuracy | gap (points) | "
    "warm-up time (s) |",
    "|---|---|---|---|---|---|---|---|",
    *rows,
    "",
    f"Rerun: `{argv_line}`",
  ]
  text = "\n".join(lines) + "\n"
  print(text)
  if _OUT.value:
    with open(_OUT.value, "w") as f:
      f.write(text)


if __name__ == "__main__":
  app.run(main)
