r"""Which objective survives stale data: losses x controlled staleness x seeds on the main job.

  python experiments/staleness_study.py --seeds=0,1,2 --workdir=/tmp/rlx_staleness \
      --out=experiments/results/staleness_study.md

Every cell is the main job (experiments/configs/arithmetic.py; any
`--config.<field>=...` overrides it) with `rl.staleness = k` (M2PO's
definition, in optimizer updates: the batch whose first update is u was
sampled by the params of update u - k; `rl.staleness_mode = "fixed"`) and one
of the objectives below. The grid runs on `rlx.rl.run_sweep`: one workdir per
cell and seed under `--workdir`, a rerun resumes an interrupted grid and reads
finished cells back, and the runs of a seed share one warm-up. Every cell runs
the host-driven iteration (`rl.fused = False`), so every cell reports the same
metrics, the off-policy ESS included.

Which log-probs enter which term (mu = the behaviour policy that sampled the
batch, pi_prox = the learner before the batch's first update, pi = the policy
being trained):

  ppo            PPO clip of pi / mu (rl.old_logp = "behaviour": mu recomputed
                 by the trainer): PPO run naively on stale data.
  gspo ctpo      the same ratio to mu, at sequence level (GSPO), as cumulative
  vespo sat      token products (CTPO), through VESPO's gamma kernel on the
  bapo           sequence ratio, SAT's staleness-contracted clip, BAPO's
                 adaptive bounds: each method's own ratio to the sampling policy.
  m2po           M2PO (https://arxiv.org/abs/2510.01161) as its public code
                 computes it: PPO clip of pi / mu with batch-wide radii set by a
                 second-moment budget 0.04 on the harmful tokens' log-ratios
                 (rlx.objectives.m2po_loss; no clip within the budget; radii
                 floored at 0.3 / 0.5, the defaults of the reference's
                 function, which its released scripts leave unset: their runs
                 clip without floors).
  m2po_mask      the paper's masking form: the tokens of largest
                 (log pi_prox / mu)^2 masked until its mean is <= 0.04
                 (rlx.objectives.m2po_mask), and the ratio to the behaviour
                 policy, factored as pi / pi_prox (PPO-clipped) times the
                 untruncated weight pi_prox / mu (train.use_rollout_correction,
                 truncate None; bounded on the kept tokens by the mask).
                 At the batch's first update pi = pi_prox, so the mask's
                 statistic is M2PO's, log pi / mu.
  m2po_mask_only the mask alone on the proximal route (no behaviour weight): the
                 gradient treats mu's samples as pi_prox's.
  decoupled_ppo  PPO clip of pi / pi_prox times the behaviour weight
                 pi_prox / mu, detached and truncated at 2 (Hilton et al. 2021,
                 https://arxiv.org/abs/2110.00641; train.use_rollout_correction).
  ppo_ewma       the same with pi_prox = PPO-EWMA's average of past params
                 (rl.old_logp = "ewma", decay rl.ewma_decay per iteration).
  vcpo           decoupled_ppo plus VCPO's two variance controls (Huang et al.
                 2026, https://arxiv.org/abs/2602.17616): every update scaled
                 by sqrt(min(1, ESS)) of the sequence weights pi_prox / mu
                 (train.use_vcpo), and the minimum-variance baseline, rewards
                 weighted by w^2 ||grad log pi_prox||^2 (rl.baseline = "vcpo").
                 VCPO's recipes weight the loss by the sequence IS weight
                 truncated at 8 instead; here decoupled_ppo's token weight
                 (truncated at 2) stays, so the pair isolates VCPO's two parts.

At staleness 0, mu = pi_prox and every row but ppo_ewma is its plain
on-policy method.
Per cell the table gives the final test accuracy (500 problems, greedy), the
best dev accuracy, the collapse count (a run whose last dev accuracy is more
than 20 points below its peak; the dev split is 200 problems, evaluated every 10
iterations), the deepest dip below the running peak (recovered or not), the
mean clip / mask fractions, the
sequence-level ESS of pi_prox / mu (`rlx.rl.offpolicy_metrics`) and the
per-token entropy over the first and last 10 iterations, and per objective
the paired differences, seed by seed, from its own staleness-0 cell and from
the `--reference` objective at the same staleness (ppo by default).
"""

import json
import os
import shlex
import statistics
import sys

from absl import app, flags, logging
from ml_collections import config_flags

from rlx import rl, train

_DEFAULT_CONFIG = os.path.join(
  os.path.dirname(os.path.abspath(__file__)), "configs", "arithmetic.py"
)
# name -> the config fields that make the objective (see the module docstring).
METHODS = {
  "ppo": {"train.loss": "ppo", "rl.old_logp": "behaviour"},
  "gspo": {"train.loss": "gspo", "rl.old_logp": "behaviour"},
  "ctpo": {"train.loss": "ctpo", "rl.old_logp": "behaviour"},
  "m2po": {"train.loss": "m2po", "rl.old_logp": "behaviour"},
  "m2po_mask": {
    "train.loss": "ppo",
    "train.use_m2po": True,
    "train.use_rollout_correction": True,
    "train.rollout_correction_kwargs.truncate": None,
    "rl.old_logp": "current",
  },
  "m2po_mask_only": {"train.loss": "ppo", "train.use_m2po": True, "rl.old_logp": "current"},
  "vespo": {"train.loss": "vespo", "rl.old_logp": "behaviour"},
  "sat": {"train.loss": "sat", "rl.old_logp": "behaviour"},
  "bapo": {"train.loss": "ppo", "train.use_bapo": True, "rl.old_logp": "behaviour"},
  "decoupled_ppo": {
    "train.loss": "ppo",
    "train.use_rollout_correction": True,
    "rl.old_logp": "current",
  },
  "ppo_ewma": {
    "train.loss": "ppo",
    "train.use_rollout_correction": True,
    "rl.old_logp": "ewma",
  },
  "vcpo": {
    "train.loss": "ppo",
    "train.use_rollout_correction": True,
    "train.use_vcpo": True,
    "rl.baseline": "vcpo",
    "rl.old_logp": "current",
  },
}


def _define_flags() -> None:
  """The command line (defined only when run as a script, so tests can import the module)."""
  config_flags.DEFINE_config_file(
    "config", _DEFAULT_CONFIG, "Base RL config file.", lock_config=False,
    accept_new_attributes=True,
  )  # fmt: skip
  flags.DEFINE_list("methods", list(METHODS), f"Objectives, of {list(METHODS)}.")
  flags.DEFINE_list("staleness", ["0", "4", "16", "64"], "rl.staleness values.")
  flags.DEFINE_list("seeds", ["0", "1", "2"], "Seeds of every cell.")
  flags.DEFINE_string(
    "reference", "ppo", "The objective every other one is paired with at the same staleness."
  )
  flags.DEFINE_string("workdir", "/tmp/rlx_staleness", "Root output directory.")
  flags.DEFINE_string("out", "", "Also write the tables (and plots beside) to this file.")
  flags.DEFINE_string("note", "", "A paragraph for the --out file.")


COLLAPSE_DROP = 0.20  # the run ends more than 20 dev-accuracy points below its peak
_EDGE = 10  # iterations averaged for the entropy at the start and at the end


def cell_points(methods, staleness):
  """One grid point per (objective, staleness), in table order."""
  return [{**METHODS[m], "rl.staleness": int(k)} for m in methods for k in staleness]


def _mean(records, key):
  vals = [r[key] for r in records if r.get(key) is not None]
  return statistics.mean(vals) if vals else None


def run_stats(workdir: str, warmup_dev: float) -> dict:
  """Per-run figures from its metrics.jsonl (see the module docstring)."""
  records = rl.read_metrics(os.path.join(workdir, "metrics.jsonl"))
  it = [r for r in records if r["phase"] == "rl"]
  ev = [r for r in records if r["phase"] == "eval"]
  dev = [warmup_dev] + [r["dev_accuracy"] for r in ev]
  peak, drop = dev[0], 0.0
  for a in dev:
    peak = max(peak, a)
    drop = max(drop, peak - a)
  clip = [r["clip_frac_low"] + r["clip_frac_high"] + r["clip_frac_dual"] for r in it]
  masked = [
    r.get("m2po_masked_frac", 0.0)
    + r.get("rollout_correction/frac_rejected", 0.0)
    + r.get("rollout_correction/frac_truncated", 0.0)
    for r in it
  ]
  return {
    "best_dev": max(dev),
    "final_dev": dev[-1],
    "max_drop": drop,  # the deepest dip below the running peak, recovered or not
    "collapsed": max(dev) - dev[-1] > COLLAPSE_DROP,
    "clip_frac": statistics.mean(clip),
    "mask_frac": statistics.mean(masked),
    "ess": _mean(it, "offpolicy_ess"),
    "offpolicy_k3": _mean(it, "offpolicy_k3"),
    "entropy_start": _mean(it[:_EDGE], "entropy"),
    "entropy_end": _mean(it[-_EDGE:], "entropy"),
    "staleness_mean": _mean(it, "staleness_mean"),
    "dev_curve": [[0, warmup_dev]] + [[r["iteration"], r["dev_accuracy"]] for r in ev],
    "entropy_curve": [r["entropy"] for r in it],
  }


def _fmt(vals, fmt):
  vals = [v for v in vals if v is not None]
  if not vals:
    return "-"
  if len(vals) == 1:
    return format(vals[0], fmt)
  return (
    f"{format(statistics.mean(vals), fmt)} ({format(min(vals), fmt)}..{format(max(vals), fmt)})"
  )


def _paired(rows, base_rows, key, scale=1.0):
  base = {r["seed"]: r[key] for r in base_rows}
  diffs = [scale * (r[key] - base[r["seed"]]) for r in rows if r["seed"] in base]
  if not diffs:
    return "-"
  sd = statistics.stdev(diffs) if len(diffs) > 1 else 0.0
  return f"{statistics.mean(diffs):+.1f} ± {sd:.1f} (n={len(diffs)})"


def study_table(cells: dict, reference: str = "ppo") -> str:
  """Markdown: one row per (objective, staleness), mean (min..max) over seeds.

  Each row is paired seed by seed with its own staleness-0 cell and with the
  `reference` objective's cell at the same staleness.
  """
  lines = [
    "| objective | staleness | seeds | test acc. after | vs own staleness 0, paired (points) "
    f"| vs {reference} at this staleness, paired (points) | best dev acc. | collapses "
    "| deepest dip "
    "| clip frac. | mask / trunc. frac. | ESS "
    "| entropy start -> end |",
    "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
  ]
  for (method, k), rows in cells.items():
    base = cells.get((method, 0), [])
    paired = "-" if k == 0 else _paired(rows, base, "accuracy_after", 100.0)
    ref = cells.get((reference, k), [])
    vs_ref = "-" if method == reference else _paired(rows, ref, "accuracy_after", 100.0)
    ent = f"{_fmt([r['entropy_start'] for r in rows], '.3f')} -> " + _fmt(
      [r["entropy_end"] for r in rows], ".3f"
    )
    lines.append(
      f"| {method} | {k} | {len(rows)} | {_fmt([r['accuracy_after'] for r in rows], '.3f')} | "
      f"{paired} | {vs_ref} | {_fmt([r['best_dev'] for r in rows], '.3f')} | "
      f"{sum(r['collapsed'] for r in rows)}/{len(rows)} | "
      f"{_fmt([r['max_drop'] for r in rows], '.3f')} | "
      f"{_fmt([r['clip_frac'] for r in rows], '.3f')} | "
      f"{_fmt([r['mask_frac'] for r in rows], '.3f')} | {_fmt([r['ess'] for r in rows], '.3f')} "
      f"| {ent} |"
    )
  return "\n".join(lines)


def summary_table(cells: dict, methods, staleness) -> str:
  """Markdown: test accuracy after RL, objective x staleness (mean over seeds, collapses)."""
  head = "| objective | " + " | ".join(f"staleness {k}" for k in staleness) + " |"
  lines = [head, "|---|" + "---|" * len(staleness)]
  for m in methods:
    row = []
    for k in staleness:
      rows = cells.get((m, int(k)), [])
      if not rows:
        row.append("-")
        continue
      acc = statistics.mean(r["accuracy_after"] for r in rows)
      n_col = sum(r["collapsed"] for r in rows)
      row.append(f"{acc:.3f}" + (f" ({n_col} collapsed)" if n_col else ""))
    lines.append(f"| {m} | " + " | ".join(row) + " |")
  return "\n".join(lines)


def plot_study(cells: dict, methods, staleness, path: str) -> str:
  """Dev accuracy (top) and entropy (bottom) per objective, one colour per staleness."""
  from matplotlib.figure import Figure  # noqa: PLC0415

  n = len(methods)
  fig = Figure(figsize=(3.2 * n, 6.4))
  axes = fig.subplots(2, n, squeeze=False, sharey="row")
  for j, m in enumerate(methods):
    top, bottom = axes[0][j], axes[1][j]
    for c, k in enumerate(staleness):
      for i, r in enumerate(cells.get((m, int(k)), [])):
        x, y = zip(*r["dev_curve"], strict=True)
        label = f"staleness {k}" if i == 0 else None
        top.plot(x, y, color=f"C{c}", alpha=0.7, label=label)
        bottom.plot(
          range(1, len(r["entropy_curve"]) + 1),
          r["entropy_curve"],
          color=f"C{c}",
          alpha=0.5,
          linewidth=0.8,
        )
    top.set_title(m)
    top.grid(alpha=0.3)
    bottom.grid(alpha=0.3)
    bottom.set_xlabel("RL iteration")
  axes[0][0].set_ylabel("dev greedy accuracy")
  axes[1][0].set_ylabel("entropy (nats / token)")
  axes[0][0].legend(fontsize=7)
  fig.tight_layout()
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  fig.savefig(path, dpi=80)
  return path


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)
  fl = flags.FLAGS
  methods = list(fl.methods)
  unknown = [m for m in methods if m not in METHODS]
  if unknown:
    raise app.UsageError(f"--methods: unknown {unknown}; expected some of {list(METHODS)}.")
  staleness = [int(k) for k in fl.staleness]
  seeds = [int(x) for x in fl.seeds]
  config = fl.config
  config.log.progress_bar = False
  config.log.print_summary = False
  config.rl.fused = False
  if not any(a.lstrip("-").startswith("config.eval.every") for a in sys.argv[1:]):
    config.eval.every = 10  # finer dev curves for the collapse count
  points = cell_points(methods, staleness)
  rows = rl.run_sweep(config, points, seeds, fl.workdir)
  keys = [(m, k) for m in methods for k in staleness]  # the order of `points`
  cells: dict = {}
  for i, row in enumerate(rows):  # run_sweep's order: every seed of a point, point by point
    stats = run_stats(row["workdir"], row["warmup_dev_accuracy"])
    cells.setdefault(keys[i // len(seeds)], []).append({**row, **stats})
  summary = summary_table(cells, methods, staleness)
  table = study_table(cells, fl.reference)
  plot = plot_study(cells, methods, staleness, os.path.join(fl.workdir, "study.png"))
  with open(os.path.join(fl.workdir, "study.json"), "w") as out:
    json.dump({f"{m}/{k}": rs for (m, k), rs in cells.items()}, out, indent=1)
  args = [a for a in sys.argv[1:] if not a.startswith(("--note=", "-note="))]
  rerun = "python experiments/staleness_study.py " + shlex.join(args)
  print(summary, table, f"plot: {plot}", f"Rerun: {rerun}", sep="\n\n")
  if fl.out:
    out_plot = os.path.splitext(fl.out)[0] + ".png"
    os.makedirs(os.path.dirname(os.path.abspath(out_plot)), exist_ok=True)
    plot_study(cells, methods, staleness, out_plot)
    with open(fl.out, "w") as out:
      out.write(
        f"# Staleness study: {', '.join(methods)} x staleness "
        f"{', '.join(map(str, staleness))} x seeds {','.join(fl.seeds)}\n\n"
        f"Config {os.path.relpath(flags.FLAGS['config'].config_filename)} with rl.fused = False, "
        f"eval.every = {config.eval.every}; {config.rl.iterations} iterations of "
        f"{train.updates_per_step(rl.train_config(config))} optimizer updates each. "
        f"Plot: {os.path.basename(out_plot)} (dev accuracy, top; entropy, bottom).\n\n"
        + (f"{fl.note}\n\n" if fl.note else "")
        + "## Test accuracy after RL (mean over seeds)\n\n"
        + summary
        + "\n\n## Every cell\n\n"
        + table
        + f"\n\nRerun: `{rerun}`\n"
      )
    print(f"wrote {fl.out} and {out_plot}")


if __name__ == "__main__":
  _define_flags()
  app.run(main)
