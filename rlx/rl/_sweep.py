"""A small grid of configs x seeds, run sequentially, with one comparison table and plot.

What a researcher needs to compare a new loss (or baseline, or G) against the
default: every grid point runs `rlx.rl.run` once per seed in its own workdir
(resumable like any run: a finished run whose recorded config equals the
requested one is read back, a different one is refused), then the summaries
are tabulated (mean and spread over seeds) and the dev-accuracy curves are
drawn on one figure. Runs whose warm-ups are identical (same seed and warm-up
config, `rlx.rl.warmup_key`) share one: the first trains it, the others start
from it (`warmup.init_from`).
"""

import contextlib
import copy
import itertools
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import ml_collections

from rlx.rl import _config, _logging, _run, _warmstart

ROW_KEYS = (
  "loss",
  "baseline",
  "accuracy_before",
  "accuracy_after",
  "improvement_points",
  "wall_time_s",
  "iterations",
  "warmup_steps",
  "warmup_dev_accuracy",
  "warmup_reused_from",
)


def parse_grid(spec: str) -> dict[str, list[Any]]:
  """`"train.loss=ppo,cispo;rl.num_samples=4,8"` -> {"train.loss": [...], ...}.

  Values are parsed as JSON where possible (numbers, true/false), else kept
  as strings.
  """
  grid: dict[str, list[Any]] = {}
  for part in filter(None, (p.strip() for p in spec.split(";"))):
    if "=" not in part:
      raise ValueError(f"Grid entry {part!r} must look like field=v1,v2.")
    key, values = part.split("=", 1)
    parsed = []
    for v in values.split(","):
      try:
        parsed.append(json.loads(v))
      except json.JSONDecodeError:
        parsed.append(v)
    grid[key.strip()] = parsed
  return grid


def _set(config: ml_collections.ConfigDict, key: str, value: Any) -> None:
  """Sets a grid field; a new key only in a free-form section (a loss's or task's kwargs)."""
  node = config
  *parents, leaf = key.split(".")
  for p in parents:
    if p not in node:
      raise ValueError(f"Grid field {key!r} is not a config field.")
    node = node[p]
  parent = ".".join(parents)
  free = parent in _config.FREE_FORM or (len(parents) == 2 and parents[0] == "task")
  if leaf not in node and not free:
    raise ValueError(f"Grid field {key!r} is not a config field.")
  with node.unlocked() if hasattr(node, "unlocked") else contextlib.nullcontext():
    node[leaf] = value


def grid_points(grid: Mapping[str, Sequence[Any]]) -> list[dict[str, Any]]:
  """The product of the grid's values, one dict per point (insertion order)."""
  keys = list(grid)
  return [dict(zip(keys, values, strict=True)) for values in itertools.product(*grid.values())]


def point_name(point: Mapping[str, Any]) -> str:
  """A readable name of a grid point, e.g. 'loss=cispo,num_samples=4'."""
  return ",".join(f"{k.split('.')[-1]}={v}" for k, v in point.items()) or "base"


def format_sweep_row(row: Mapping[str, Any]) -> str:
  """One line per finished run: config, seed, result, time (what `sweep.py` prints)."""
  warm = " (warm-up reused)" if row.get("warmup_reused_from") else ""
  return (
    f"[{row['index']}/{row['total']}] {row['point']} seed={row['seed']}: test accuracy "
    f"{row['accuracy_before']:.3f} -> {row['accuracy_after']:.3f} "
    f"({row['improvement_points']:+.1f} points), {row['seconds']:.0f} s{warm}"
  )


def _print_row(row: Mapping[str, Any]) -> None:
  print(format_sweep_row(row), file=sys.stdout, flush=True)


def run_sweep(
  base: ml_collections.ConfigDict,
  grid: Mapping[str, Sequence[Any]] | Sequence[Mapping[str, Any]],
  seeds: Sequence[int],
  workdir: str,
  *,
  share_warmup: bool = True,
  report: Callable[[dict[str, Any]], None] | None = _print_row,
) -> list[dict[str, Any]]:
  """Runs every grid point x seed sequentially; returns one row per run.

  Args:
    base: the base RL config.
    grid: config field -> values to try (their product is run), or the list
      of points itself, each a dict of config field -> value (for settings
      that only make sense together, e.g. a loss with its old_logp mode).
    seeds: the seeds (`config.seed`) of each point.
    workdir: root directory; each run gets `workdir/<point>/seed_<s>`.
    share_warmup: runs with equal `warmup_key`s (same seed, task, model,
      warm-up, ...) reuse the first one's warm-up (`warmup.init_from`) instead
      of training it again (ignored where the base config sets init_from).
    report: called with each row once its run is done (default: prints
      `format_sweep_row`); None is silent.

  Returns:
    Rows with the point, the seed, the run's workdir, its summary figures
    (`ROW_KEYS`) and `seconds` (this call's time for the run).
  """
  if not seeds:
    raise ValueError("`seeds` is empty.")
  if isinstance(grid, Mapping):
    points = grid_points(grid)
  else:
    points = [dict(p) for p in grid]
    names = [point_name(p) for p in points]
    if len(set(names)) != len(names):
      raise ValueError(f"`grid` lists a point twice: {names}.")
  runs = []
  for point in points:
    for seed in seeds:
      config = copy.deepcopy(base)
      for key, value in point.items():
        _set(config, key, value)
      config.seed = int(seed)
      try:  # every point is checked before the first run starts
        _config.validate_config(config)
      except ValueError as e:
        raise ValueError(f"Grid point {point_name(point)} (seed {seed}): {e}") from None
      runs.append((point, seed, config))
  total = len(runs)
  warmups: dict[str, str] = {}  # warm-up key -> workdir of a run holding that warm-up
  rows = []
  for point, seed, config in runs:
    run_dir = os.path.join(workdir, point_name(point).replace("/", "_"), f"seed_{seed}")
    key = None
    if share_warmup and config.warmup.enabled and not config.warmup.init_from:
      key = json.dumps(_warmstart.warmup_key(config), sort_keys=True)
      if key in warmups and warmups[key] != run_dir:
        config.warmup.init_from = warmups[key]
    t0 = time.perf_counter()
    summary = _run.run(config, run_dir)
    if key is not None:
      warmups.setdefault(key, run_dir)
    row = {
      "point": point_name(point),
      "seed": int(seed),
      "workdir": run_dir,
      **{k: summary.get(k) for k in ROW_KEYS},
      "seconds": time.perf_counter() - t0,
      "index": len(rows) + 1,
      "total": total,
    }
    rows.append(row)
    if report is not None:
      report(row)
  return rows


def sweep_table(rows: Sequence[Mapping[str, Any]]) -> str:
  """Markdown table: per grid point, mean (min..max) over seeds, and the paired difference.

  The last column compares each point with the first one seed by seed (same
  seed, hence the same warm-up when it is shared): the mean improvement
  difference in points, its sample standard deviation over the seeds both
  points ran, and that number of seeds.
  """
  lines = [
    "| config | loss | baseline | seeds | accuracy before | accuracy after | improvement (points) "
    "| vs first point, paired (points) | wall time (s) |",
    "|---|---|---|---|---|---|---|---|---|",
  ]
  points = list(dict.fromkeys(r["point"] for r in rows))
  first = {r["seed"]: r["improvement_points"] for r in rows if r["point"] == points[0]}
  for p in points:
    rs = [r for r in rows if r["point"] == p]

    def cell(key, fmt, rs=rs):
      vals = [r[key] for r in rs]
      if len(vals) == 1:
        return format(vals[0], fmt)
      return (
        f"{format(statistics.mean(vals), fmt)} ({format(min(vals), fmt)}..{format(max(vals), fmt)})"
      )

    diffs = [r["improvement_points"] - first[r["seed"]] for r in rs if r["seed"] in first]
    if p == points[0] or not diffs:
      paired = "-"
    else:
      sd = statistics.stdev(diffs) if len(diffs) > 1 else 0.0
      paired = f"{statistics.mean(diffs):+.1f} ± {sd:.1f} (n={len(diffs)})"
    names = {k: ", ".join(sorted({str(r.get(k)) for r in rs})) for k in ("loss", "baseline")}
    lines.append(
      f"| {p} | {names['loss']} | {names['baseline']} | {len(rs)} | "
      f"{cell('accuracy_before', '.3f')} | {cell('accuracy_after', '.3f')} | "
      f"{cell('improvement_points', '+.1f')} | {paired} | {cell('wall_time_s', '.0f')} |"
    )
  return "\n".join(lines)


def plot_sweep(rows: Sequence[Mapping[str, Any]], path: str) -> str:
  """Dev-accuracy curves of every run (one colour per grid point) into one PNG."""
  # A Figure without pyplot: no global backend switch (inline plots in a
  # notebook that calls this keep working) and nothing left open.
  from matplotlib.figure import Figure  # noqa: PLC0415

  points = list(dict.fromkeys(r["point"] for r in rows))
  fig = Figure(figsize=(13, 4.5))
  ax, bx = fig.subplots(1, 2)
  for i, p in enumerate(points):
    for j, r in enumerate(x for x in rows if x["point"] == p):
      records = _logging.read_metrics(os.path.join(r["workdir"], "metrics.jsonl"))
      ev = [x for x in records if x.get("phase") == "eval"]
      ax.plot(
        [0] + [x["iteration"] for x in ev],
        # The dev curve starts at the warm-up's end (its dev accuracy).
        [r.get("warmup_dev_accuracy", r["accuracy_before"])] + [x["dev_accuracy"] for x in ev],
        color=f"C{i}",
        alpha=0.8,
        label=p if j == 0 else None,
      )
    after = [r["accuracy_after"] for r in rows if r["point"] == p]
    before = [r["accuracy_before"] for r in rows if r["point"] == p]
    bx.scatter([i] * len(after), after, color=f"C{i}", label=None)
    bx.scatter([i] * len(before), before, color=f"C{i}", marker="x")
  ax.set_xlabel("RL iteration")
  ax.set_ylabel("dev greedy accuracy")
  ax.legend(fontsize=8)
  ax.grid(alpha=0.3)
  bx.set_xticks(range(len(points)), points, rotation=20, fontsize=8)
  bx.set_ylabel("test greedy accuracy (x: before RL, o: after)")
  bx.grid(alpha=0.3)
  fig.tight_layout()
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  fig.savefig(path, dpi=90)
  return path
