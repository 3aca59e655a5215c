"""What a user sees: `metrics.jsonl`, TensorBoard event files (tensorboardX) and PNG plots."""

import json
import math
import os
from collections.abc import Iterable
from typing import Any

PLOTS = (
  ("reward_mean", "reward (train rollouts)"),
  ("dev_accuracy", "held-out greedy accuracy (dev)"),
  ("approx_kl", "KL(old || new), approx"),
  ("clip_frac", "clip fraction"),
  ("response_length", "response length (tokens)"),
  ("entropy", "entropy (nats / token)"),
)
TIME_KEYS = ("time/rollout_s", "time/reward_s", "time/logp_s", "time/train_s", "time/fused_s")


class MetricsLog:
  """Appends records to `workdir/metrics.jsonl` and TensorBoard scalars to `workdir/tensorboard`.

  On resume from RL iteration k, records of later iterations (written before
  a crash, after the last checkpoint) are dropped from the JSONL file and
  purged from TensorBoard (`purge_step`), so the log equals a straight run's.
  """

  def __init__(self, workdir: str, *, resume_iteration: int, tensorboard: bool = True):
    self.path = os.path.join(workdir, "metrics.jsonl")
    kept = [r for r in read_metrics(self.path) if r.get("iteration", 0) <= resume_iteration]
    tmp = self.path + ".tmp"
    with open(tmp, "w") as f:
      for r in kept:
        f.write(json.dumps(r) + "\n")
    os.replace(tmp, self.path)
    self._file = open(self.path, "a")  # noqa: SIM115
    self._tb = None
    if tensorboard:
      import tensorboardX  # noqa: PLC0415

      self._tb = tensorboardX.SummaryWriter(
        os.path.join(workdir, "tensorboard"), purge_step=resume_iteration + 1
      )

  def write(self, record: dict[str, Any]) -> None:
    """Writes one record: {"phase": ..., "iteration" or "step": n, name: value, ...}."""
    self._file.write(json.dumps(record) + "\n")
    self._file.flush()
    if self._tb is not None:
      phase = record.get("phase", "rl")
      step = int(record.get("iteration", record.get("step", 0)))
      for k, v in record.items():
        if k in ("phase", "iteration", "step") or not isinstance(v, int | float):
          continue
        self._tb.add_scalar(f"{phase}/{k}", float(v), step)

  def close(self) -> None:
    self._file.close()
    if self._tb is not None:
      self._tb.close()


def read_metrics(path: str) -> list[dict]:
  """The records of a metrics.jsonl file ([] if missing; a torn last line is ignored)."""
  if not os.path.exists(path):
    return []
  out = []
  with open(path) as f:
    for line in f:
      try:
        out.append(json.loads(line))
      except json.JSONDecodeError:
        break
  return out


def _series(records: Iterable[dict], key: str) -> tuple[list, list]:
  xs, ys = [], []
  for r in records:
    v = r.get(key)
    if isinstance(v, int | float) and not math.isnan(v):
      xs.append(r["iteration"])
      ys.append(v)
  return xs, ys


def plot_run(workdir: str, *, accuracy_before: float | None, accuracy_after: float | None) -> str:
  """Writes `workdir/plots/rl_curves.png` from metrics.jsonl and returns its path.

  Panels: reward, held-out accuracy (dev curve + test before/after), KL, clip
  fraction, response length, entropy, and the time split per iteration.
  """
  # A Figure without pyplot: no global backend switch (inline plots in a
  # notebook that calls this keep working) and nothing left open.
  from matplotlib.figure import Figure  # noqa: PLC0415

  records = [
    r
    for r in read_metrics(os.path.join(workdir, "metrics.jsonl"))
    if r.get("phase") in ("rl", "eval")
  ]
  rl = [r for r in records if r.get("phase") == "rl"]
  ev = [r for r in records if r.get("phase") == "eval"]
  fig = Figure(figsize=(18, 7.5))
  axes = fig.subplots(2, 4)
  axes = axes.ravel()
  for ax, (key, title) in zip(axes, PLOTS, strict=False):
    xs, ys = _series(ev if key == "dev_accuracy" else rl, key)
    if key == "clip_frac" and not xs:
      xs, ys = _series(rl, "clip_frac_low")
    ax.plot(xs, ys, marker="." if len(xs) < 30 else None)
    if key == "dev_accuracy":
      last = max([r["iteration"] for r in rl], default=0)
      if accuracy_before is not None:
        ax.scatter([0], [accuracy_before], color="C3", zorder=3, label="test, before RL")
      if accuracy_after is not None:
        ax.scatter([last], [accuracy_after], color="C2", zorder=3, label="test, after RL")
      ax.legend(loc="lower right")
    ax.set_title(title)
    ax.set_xlabel("RL iteration")
    ax.grid(alpha=0.3)
  ax = axes[len(PLOTS)]
  bottom = None
  import numpy as np  # noqa: PLC0415

  for key in TIME_KEYS:
    xs, ys = _series(rl, key)
    if not xs:
      continue
    ys = np.asarray(ys)
    ax.bar(xs, ys, bottom=bottom, width=1.0, label=key.split("/")[1].removesuffix("_s"))
    bottom = ys if bottom is None else bottom + ys
  if bottom is not None and len(bottom) > 2:
    # The first iterations compile: cap the axis so the steady state is visible.
    ax.set_ylim(0, 3 * float(np.median(bottom[2:])) + 1e-6)
  ax.set_title("seconds per iteration (first ones compile: off the scale)")
  ax.set_xlabel("RL iteration")
  ax.legend(loc="upper right")
  axes[-1].axis("off")
  fig.tight_layout()
  out_dir = os.path.join(workdir, "plots")
  os.makedirs(out_dir, exist_ok=True)
  path = os.path.join(out_dir, "rl_curves.png")
  fig.savefig(path, dpi=90)
  return path
