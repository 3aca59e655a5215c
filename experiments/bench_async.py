r"""Asynchronous vs synchronous RL iterations: where each side's time goes, one process.

For each task (the main job, experiments/configs/arithmetic.py, and the
rollout-bound scratchpad task, experiments/configs/arithmetic_scratchpad.py)
the same warmed-up policy runs `--iterations` RL iterations four ways:

  sync            the host-driven synchronous iteration (`rl.fused = False`):
                  rollout, then reward / log-probs / train step, on every device;
  async shared    `rl.async_rollout`: the rollout thread samples into a queue of
                  one batch while the learner trains, both on every device;
  async split     the same with `mesh.rollout_devices = --rollout_devices`: the
                  rollout on its own devices, the learner on the rest;
  async split + TIS
                  async split with `train.use_rollout_correction` (token-level
                  truncated IS from the behaviour policy to the proximal one,
                  the decoupled PPO objective of AReaL);
  async split + partial
                  async split + TIS with APRIL partial rollouts
                  (`rollout.over_provision = 2`) in the rollout thread, whose
                  samples in flight take each published version (PipelineRL's
                  in-flight weight update).

Per run, means per iteration over the iterations after the first `--skip` (compiles):
the iteration's wall time; the rollout side's busy time per iteration (sync:
`time/rollout_s`; async: the thread's collecting time, `async/rollout_busy_s`
over the window) and idle share; the learner's busy time (sync: reward +
log-probs + train; async: the iteration less its wait for a batch,
`time/learner_wait_s`) and idle share; and the async iteration over the slower
side of the synchronous one (overlap would make it 1.0x; the target is at most
1.15x). The warm-up is the task config's own; the scratchpad task's is
`--warmup_steps` steps, evaluated once (it is there to teach the format, so
response lengths are those of a trained policy, not to solve the task); async shared
reuses the sync run's warm-up (`warmup.init_from`), async split trains its
own on its learner's devices (a different mesh, so a different warm-up key),
which async split + TIS and + partial reuse.
Accuracy after so few iterations is reported, not compared.

Rerun (prints the markdown table; `--out` also writes it):
  python experiments/bench_async.py --out=experiments/results/bench_async_cpu.md
"""

import importlib.util
import os
import platform
import sys

if __name__ == "__main__" and "--xla_force_host_platform_device_count" not in os.environ.get(
  "XLA_FLAGS", ""
):  # host devices must be set before jax starts
  os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"
  ).strip()

import jax
from absl import app, flags, logging

from rlx import rl

_HERE = os.path.dirname(os.path.abspath(__file__))
TASKS = {
  "main job": os.path.join(_HERE, "configs", "arithmetic.py"),
  "scratchpad": os.path.join(_HERE, "configs", "arithmetic_scratchpad.py"),
}
MODES = ("sync", "async shared", "async split", "async split + TIS", "async split + partial")
# Tasks whose warm-up is capped at --warmup_steps: it teaches the response format (so the
# lengths are a trained policy's), not the task. The main job keeps its own warm-up.
FORMAT_WARMUP = ("scratchpad",)


def load_config(path: str):
  """The `get_config()` of an experiments config file."""
  spec = importlib.util.spec_from_file_location("bench_async_config", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config()


def mode_config(base, mode: str, *, iterations: int, devices: int, rollout_devices: int):
  """The run config of one mode (`base` unchanged)."""
  c = base.copy_and_resolve_references()
  c.rl.iterations = iterations
  c.rl.fused = False
  c.mesh.num_devices = devices
  c.eval.every = 0  # no dev evaluations inside the timed iterations
  c.checkpoint.every = iterations
  c.log.progress_bar = False
  c.log.print_summary = False
  c.log.plots = False
  c.log.tensorboard = False
  if mode != "sync":
    c.rl.async_rollout = True
    c.rl.async_queue_size = 1
  if mode.startswith("async split"):
    c.mesh.rollout_devices = rollout_devices
  if mode.endswith(("+ TIS", "+ partial")):  # decoupled PPO's behaviour -> proximal weight
    c.train.use_rollout_correction = True  # (token-level TIS)
  if mode.endswith("+ partial"):  # APRIL in the rollout thread, weights updated in flight
    c.rollout.over_provision = 2.0
  return c


def side_times(records: list[dict], skip: int) -> dict[str, float]:
  """Means per iteration over the records after `skip`: wall time, each side's busy time, idle."""
  rows = records[skip:]
  if not rows or not skip:
    raise ValueError(f"Need 1 <= --skip < --iterations, got skip {skip} of {len(records)}.")
  n = len(rows)
  iteration = sum(r["time/iteration_s"] for r in rows) / n
  if "async/rollout_busy_s" in rows[0]:
    # The thread's collecting seconds over the window (a running total the learner reads).
    rollout = (rows[-1]["async/rollout_busy_s"] - records[skip - 1]["async/rollout_busy_s"]) / n
    learner = sum(r["time/iteration_s"] - r["time/learner_wait_s"] for r in rows) / n
  else:
    rollout = sum(r["time/rollout_s"] for r in rows) / n
    learner = sum(r["time/reward_s"] + r["time/logp_s"] + r["time/train_s"] for r in rows) / n
  return {
    "iteration_s": iteration,
    "rollout_busy_s": rollout,
    "rollout_idle": max(0.0, 1.0 - rollout / iteration),
    "learner_busy_s": learner,
    "learner_idle": max(0.0, 1.0 - learner / iteration),
    "response_length": sum(r["response_length"] for r in rows) / n,
  }


def run_task(name: str, args: dict, workdir: str) -> list[dict]:
  """Every mode of one task; returns one row per mode."""
  base = load_config(TASKS[name])
  if name in FORMAT_WARMUP:  # a fixed warm-up that teaches the format, evaluated once
    base.warmup.max_steps = base.warmup.eval_every = args["warmup_steps"]
    base.warmup.on_cap = "warn"
  base.eval.test_examples = args["test_examples"]
  task_dir = os.path.join(workdir, name.replace(" ", "_"))
  rows = []
  for mode in MODES:
    c = mode_config(
      base,
      mode,
      iterations=args["iterations"],
      devices=args["devices"],
      rollout_devices=args["rollout_devices"],
    )
    if mode == "async shared":  # the sync run's warm-up (same devices, same warm-up key)
      c.warmup.init_from = os.path.join(task_dir, "sync")
    if mode in ("async split + TIS", "async split + partial"):  # async split's (same meshes)
      c.warmup.init_from = os.path.join(task_dir, "async_split")
    run_dir = os.path.join(task_dir, mode.replace(" + ", "_").replace(" ", "_"))
    summary = rl.run(c, run_dir)
    records = [
      r for r in rl.read_metrics(os.path.join(run_dir, "metrics.jsonl")) if r["phase"] == "rl"
    ]
    times = side_times(records, args["skip"])
    rows.append(
      {
        "task": name,
        "mode": mode,
        **times,
        "accuracy_after": summary["accuracy_after"],
        "staleness_mean": summary["staleness_mean"],
      }
    )
  sync = rows[0]
  slower = max(sync["rollout_busy_s"], sync["learner_busy_s"])
  for row in rows:
    row["vs_slower_sync_side"] = row["iteration_s"] / slower
    row["rollout_share_sync"] = sync["rollout_busy_s"] / sync["iteration_s"]
  return rows


def table(rows: list[dict], args: dict, command: str) -> list[str]:
  """The markdown report."""
  lines = [
    "# Asynchronous vs synchronous RL iterations (CPU)",
    "",
    f"{args['devices']} host devices (`--xla_force_host_platform_device_count`) on "
    f"{os.cpu_count()} CPU cores ({platform.processor() or platform.machine()}), jax "
    f"{jax.__version__}; {args['iterations']} iterations per run, means over the last "
    f"{args['iterations'] - args['skip']}; async split = {args['rollout_devices']} rollout "
    "device(s), the rest train. Busy = seconds per iteration the side computes; idle = the "
    "rest of the iteration. The last column is the iteration over the slower side of the "
    "synchronous iteration (1.00x = perfect overlap).",
    "",
    "| task | mode | response tokens | iteration s | rollout busy s | rollout idle | "
    "learner busy s | learner idle | rollout share (sync) | staleness | test acc | "
    "vs slower sync side |",
    "|---|---|---|---|---|---|---|---|---|---|---|---|",
  ]
  for r in rows:
    lines.append(
      f"| {r['task']} | {r['mode']} | {r['response_length']:.1f} | {r['iteration_s']:.3f} | "
      f"{r['rollout_busy_s']:.3f} | {100 * r['rollout_idle']:.0f}% | "
      f"{r['learner_busy_s']:.3f} | {100 * r['learner_idle']:.0f}% | "
      f"{100 * r['rollout_share_sync']:.0f}% | {r['staleness_mean']:.2f} | "
      f"{r['accuracy_after']:.3f} | {r['vs_slower_sync_side']:.2f}x |"
    )
  lines += ["", "Rerun:", "", "```", command, "```"]
  return lines


if __name__ == "__main__":
  _ITERS = flags.DEFINE_integer("iterations", 12, "RL iterations per run.")
  _SKIP = flags.DEFINE_integer("skip", 4, "First iterations left out of the medians.")
  _DEVICES = flags.DEFINE_integer("devices", 2, "Host devices used.")
  _ROLLOUT = flags.DEFINE_integer("rollout_devices", 1, "Rollout devices of `async split`.")
  _WARM = flags.DEFINE_integer("warmup_steps", 300, "Warm-up steps of the scratchpad task.")
  _TEST = flags.DEFINE_integer("test_examples", 200, "Held-out examples evaluated after RL.")
  _TASKS = flags.DEFINE_list("tasks", list(TASKS), f"Tasks, of {list(TASKS)}.")
  _WORKDIR = flags.DEFINE_string("workdir", "/tmp/rlx_bench_async", "Run directories.")
  _OUT = flags.DEFINE_string("out", "", "Also write the table here.")

  def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)
    args = {
      "iterations": _ITERS.value,
      "skip": _SKIP.value,
      "devices": _DEVICES.value,
      "rollout_devices": _ROLLOUT.value,
      "warmup_steps": _WARM.value,
      "test_examples": _TEST.value,
    }
    if len(jax.devices()) < args["devices"]:
      raise app.UsageError(f"--devices={args['devices']} > the {len(jax.devices())} devices.")
    rows = [row for name in _TASKS.value for row in run_task(name, args, _WORKDIR.value)]
    command = "python experiments/bench_async.py " + " ".join(sys.argv[1:])
    lines = table(rows, args, command.strip())
    print("\n".join(lines))
    if _OUT.value:
      with open(_OUT.value, "w") as f:
        f.write("\n".join(lines) + "\n")

  app.run(main)
