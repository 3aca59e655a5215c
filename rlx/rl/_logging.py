"""What a user sees: `metrics.jsonl`, TensorBoard event files (tensorboardX), PNG plots, notes.

metrics.jsonl is strict JSON: a non-finite value is written as `null`.
"""

import json
import math
import os
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

PLOTS = (
  ("reward_mean", "reward (train rollouts)"),
  ("dev_accuracy", "held-out greedy accuracy (dev)"),
  ("approx_kl", "KL(old || new), approx"),
  ("clip_frac", "clip fraction (low / high / dual)"),
  ("response_length", "response length (tokens)"),
  ("entropy", "entropy (nats / token)"),
)
TIME_KEYS = ("time/rollout_s", "time/reward_s", "time/logp_s", "time/train_s", "time/fused_s")
CLIP_KEYS = ("clip_frac_low", "clip_frac_high", "clip_frac_dual")


def finite_or_none(value: Any) -> Any:
  """`value` with every non-finite float (NaN, +-inf) replaced by None, recursively."""
  if isinstance(value, Mapping):
    return {k: finite_or_none(v) for k, v in value.items()}
  if isinstance(value, list | tuple):
    return [finite_or_none(v) for v in value]
  if isinstance(value, float) and not math.isfinite(value):
    return None
  if hasattr(value, "dtype") and getattr(value, "shape", None) == ():  # numpy / jax scalars
    value = value.item()
    return None if isinstance(value, float) and not math.isfinite(value) else value
  return value


def dumps(record: Any) -> str:
  """One strict-JSON line (non-finite floats as null)."""
  return json.dumps(finite_or_none(record), allow_nan=False, default=str)


def note(message: str) -> None:
  """A one-line note on stderr (e.g. a first compile), shown above a progress bar."""
  try:
    import tqdm  # noqa: PLC0415

    tqdm.tqdm.write(message, file=sys.stderr)
  except ImportError:  # pragma: no cover - tqdm is a dependency
    print(message, file=sys.stderr, flush=True)


def note_first_call(fn: Callable, what: str, *, enabled: bool = True) -> Callable:
  """`fn`, noting on stderr before its first call that `what` compiles, and how long it took."""
  if not enabled:
    return fn
  done = False

  def wrapped(*args, **kwargs):
    nonlocal done
    if done:
      return fn(*args, **kwargs)
    note(f"rlx: compiling {what} (first call) ...")
    t0 = time.perf_counter()
    out = fn(*args, **kwargs)
    done = True
    note(f"rlx: {what}: first call took {time.perf_counter() - t0:.1f} s")
    return out

  return wrapped


class MetricsLog:
  """Appends records to `workdir/metrics.jsonl` and TensorBoard scalars to `workdir/tensorboard`.

  On resume from RL iteration k, records of later iterations (written before
  a crash, after the last checkpoint) are dropped from the JSONL file and
  purged from TensorBoard (`purge_step`), so the log equals a straight run's.
  """

  def __init__(
    self,
    workdir: str,
    *,
    resume_iteration: int | None,
    tensorboard: bool = True,
    tensorboard_subdir: str = "",
  ):
    """Opens the log of `workdir`, dropping records past `resume_iteration`.

    Args:
      workdir: the run's directory.
      resume_iteration: the RL iteration resumed from (0: a new run); records
        of later iterations are dropped, warm-up records (no "iteration") kept.
        None: the log of a warm-up (re)starting: earlier warm-up records are
        dropped, nothing else.
      tensorboard: also write TensorBoard scalars.
      tensorboard_subdir: a sub-directory of `workdir/tensorboard` for the
        event files (the warm-up's curves are their own TensorBoard run, so
        the RL run's purge on resume never touches them).
    """
    self.path = os.path.join(workdir, "metrics.jsonl")
    if resume_iteration is None:
      kept = [r for r in read_metrics(self.path) if r.get("phase") != "warmup"]
    else:
      kept = [r for r in read_metrics(self.path) if r.get("iteration", 0) <= resume_iteration]
    tmp = self.path + ".tmp"
    with open(tmp, "w") as f:
      for r in kept:
        f.write(dumps(r) + "\n")
    os.replace(tmp, self.path)
    self._file = open(self.path, "a")  # noqa: SIM115
    self._tb = None
    if tensorboard:
      import tensorboardX  # noqa: PLC0415

      self._tb = tensorboardX.SummaryWriter(
        os.path.join(workdir, "tensorboard", tensorboard_subdir),
        # Events past the resumed iteration (a killed process's) are dropped;
        # a warm-up that (re)starts drops all of its earlier ones.
        purge_step=0 if resume_iteration is None else resume_iteration + 1,
      )

  def write(self, record: dict[str, Any]) -> None:
    """Writes one record: {"phase": ..., "iteration" or "step": n, name: value, ...}."""
    self._file.write(dumps(record) + "\n")
    self._file.flush()
    if self._tb is not None:
      phase = record.get("phase", "rl")
      step = int(record.get("iteration", record.get("step", 0)))
      for k, v in record.items():
        if k in ("phase", "iteration", "step") or not isinstance(v, int | float):
          continue
        if isinstance(v, bool) or not math.isfinite(v):
          continue
        self._tb.add_scalar(f"{phase}/{k}", float(v), step)

  def scalar(self, tag: str, value: float, step: int) -> None:
    """One TensorBoard scalar (no JSONL record), e.g. the test accuracy before / after."""
    if self._tb is not None:
      self._tb.add_scalar(tag, float(value), int(step))

  def hparams(self, hparams: Mapping[str, Any], metrics: Mapping[str, float]) -> None:
    """The run's config fields and headline figures in TensorBoard's HParams tab."""
    if self._tb is None:
      return
    values = {
      k: (v if isinstance(v, int | float | str | bool) else str(v)) for k, v in hparams.items()
    }
    self._tb.add_hparams(
      values,
      {k: float(v) for k, v in metrics.items() if isinstance(v, int | float)},
      name="hparams",
    )

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


def run_figure(
  workdir: str,
  *,
  accuracy_before: float | None,
  accuracy_after: float | None,
  warmup_dev_accuracy: float | None = None,
) -> Any:
  """The learning-curve `matplotlib.figure.Figure` of `workdir/metrics.jsonl` (see `plot_run`).

  Panels: reward, held-out accuracy (dev curve from the warm-up's end at
  iteration 0 + test before/after), KL, clip fractions (low, high and dual
  sides), response length, entropy, and the time split per iteration.
  `warmup_dev_accuracy` (default: the last warm-up record's) is the dev
  curve's first point.
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
  if warmup_dev_accuracy is None:
    warm = [
      r
      for r in read_metrics(os.path.join(workdir, "metrics.jsonl"))
      if r.get("phase") == "warmup" and r.get("dev_accuracy") is not None
    ]
    warmup_dev_accuracy = warm[-1]["dev_accuracy"] if warm else None
  if warmup_dev_accuracy is not None:
    ev = [{"iteration": 0, "dev_accuracy": warmup_dev_accuracy}] + ev
  fig = Figure(figsize=(18, 7.5))
  axes = fig.subplots(2, 4)
  axes = axes.ravel()
  for ax, (key, title) in zip(axes, PLOTS, strict=False):
    if key == "clip_frac":
      for side in CLIP_KEYS:
        xs, ys = _series(rl, side)
        if xs and (side != "clip_frac_dual" or any(ys)):
          ax.plot(xs, ys, marker="." if len(xs) < 30 else None, label=side.split("_")[-1])
      if ax.get_lines():
        ax.legend(loc="upper right")
    else:
      xs, ys = _series(ev if key == "dev_accuracy" else rl, key)
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
  if bottom is not None:
    ax.legend(loc="upper right")
  axes[-1].axis("off")
  fig.tight_layout()
  return fig


def plot_run(
  workdir: str,
  *,
  accuracy_before: float | None,
  accuracy_after: float | None,
  warmup_dev_accuracy: float | None = None,
) -> str:
  """Writes `run_figure(...)` to `workdir/plots/rl_curves.png` and returns its path."""
  fig = run_figure(
    workdir,
    accuracy_before=accuracy_before,
    accuracy_after=accuracy_after,
    warmup_dev_accuracy=warmup_dev_accuracy,
  )
  out_dir = os.path.join(workdir, "plots")
  os.makedirs(out_dir, exist_ok=True)
  path = os.path.join(out_dir, "rl_curves.png")
  fig.savefig(path, dpi=90)
  return path
