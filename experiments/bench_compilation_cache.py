r"""What JAX's persistent compilation cache saves a re-run of the main job.

  python experiments/bench_compilation_cache.py --iterations=20

Runs `experiments/train_rl.py` (the main-job config, `--config.rl.iterations`
shortened) three times in fresh processes, each in a new workdir: without the
cache, then twice with `RLX_COMPILATION_CACHE_DIR` pointing at a new empty
directory (the first of the two fills it, the second reads it). Prints the
wall-clock of each process and the first-call times of the programs as the run
reports them (`rlx: ... first call took X s`, or the wait for a program compiled
ahead in a thread), and writes the table with its rerun command to `--out`.
"""

import os
import re
import subprocess
import sys
import tempfile
import time

from absl import app, flags

_ITERATIONS = flags.DEFINE_integer("iterations", 20, "RL iterations of each run.")
_OUT = flags.DEFINE_string("out", "", "Write the table to this markdown file.")

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_NOTE = re.compile(
  r"rlx: (?:the )?(?P<what>[^:\r\n]+?):? (?P<kind>first call took|compiled during the "
  r"warm-up \(waited) (?P<s>[0-9.]+) s"
)


def _run(workdir: str, cache: str | None) -> tuple[float, dict[str, float]]:
  env = dict(os.environ)
  env.pop("RLX_COMPILATION_CACHE_DIR", None)
  if cache:
    env["RLX_COMPILATION_CACHE_DIR"] = cache
  cmd = [
    sys.executable,
    os.path.join(_ROOT, "experiments", "train_rl.py"),
    f"--workdir={workdir}",
    f"--config.rl.iterations={_ITERATIONS.value}",
  ]
  t0 = time.perf_counter()
  proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=_ROOT)
  wall = time.perf_counter() - t0
  if proc.returncode:
    raise RuntimeError(f"{cmd} failed:\n{proc.stderr[-3000:]}")
  text = (proc.stdout + proc.stderr).replace("\r", "\n")
  notes = {}
  for m in _NOTE.finditer(text):
    what = m.group("what").strip()
    key = f"{what}: first call" if m.group("kind").startswith("first") else f"{what}: wait"
    notes[key] = float(m.group("s"))
  return wall, notes


def main(argv):
  del argv
  with tempfile.TemporaryDirectory() as tmp:
    cache = os.path.join(tmp, "cache")
    runs = [
      ("no cache", _run(os.path.join(tmp, "a"), None)),
      ("cache, empty (fills it)", _run(os.path.join(tmp, "b"), cache)),
      ("cache, filled (re-run)", _run(os.path.join(tmp, "c"), cache)),
    ]
  names = list(dict.fromkeys(k for _, (_, notes) in runs for k in notes))
  lines = [
    f"# Persistent compilation cache: the main job ({_ITERATIONS.value} RL iterations) re-run",
    "",
    f"Load average at the end: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores. Seconds.",
    "",
    "| run | process wall-clock | " + " | ".join(names) + " |",
    "|---|---|" + "---|" * len(names),
  ]
  for label, (wall, notes) in runs:
    cells = " | ".join(f"{notes[n]:.1f}" if n in notes else "-" for n in names)
    lines.append(f"| {label} | {wall:.1f} | {cells} |")
  lines += [
    "",
    "A program compiled ahead in a thread shows the time the run waited for it.",
    "",
    f"Command: `python experiments/bench_compilation_cache.py --iterations={_ITERATIONS.value}`",
  ]
  table = "\n".join(lines)
  print(table)
  if _OUT.value:
    with open(_OUT.value, "w") as f:
      f.write(table + "\n")


if __name__ == "__main__":
  app.run(main)
