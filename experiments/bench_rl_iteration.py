r"""Seconds per RL iteration, split rollout / reward / logp / train, host-driven vs fused.

On the main experiment's config (experiments/configs/arithmetic.py: 64 prompts
x G = 8, 2-layer width-64 model, 3-digit addition), from the same params and
rng stream, side by side in one run:

  host   `Learner.iteration`: `Sampler.generate` (continuous batching) ->
         rewards on device -> advantages -> `compute_logprobs` -> train step,
         each phase waited for on host (so the split is exact);
  fused  `make_rl_step`: the same iteration as ONE jitted function
         (`Sampler.generate_fn` inside), timed as a whole.

Each variant runs `--warmup` untimed iterations (compiles) then `--iterations`
timed ones, the two variants alternating iteration by iteration (so load
changes on a shared machine hit both); the table gives medians. The policy
is the freshly initialised model (no warm-up): the iteration's cost depends
on shapes and response lengths, which are 5 tokens either way for this task.

Rerun:

  python experiments/bench_rl_iteration.py --out=experiments/results/bench_rl_iteration_cpu.md
"""

import os
import platform
import statistics
import sys
import time

import jax
import jax.numpy as jnp
from absl import app, flags
from ml_collections import config_flags

from rlx import rl, train

_DEFAULT_CONFIG = os.path.join(
  os.path.dirname(os.path.abspath(__file__)), "configs", "arithmetic.py"
)
_CONFIG = config_flags.DEFINE_config_file("config", _DEFAULT_CONFIG, "RL config file.")
_ITERATIONS = flags.DEFINE_integer("iterations", 20, "Timed iterations per variant.")
_WARMUP = flags.DEFINE_integer("warmup", 2, "Untimed (compiling) iterations per variant.")
_OUT = flags.DEFINE_string("out", "", "Also write the markdown table to this file.")


def main(argv):
  del argv
  config = _CONFIG.value
  task = rl.make_task(config)
  mesh = rl.build_mesh(config)
  model_config, params = rl.build_model(config, task)
  learner = rl.Learner(config, task, model_config, mesh)
  k = learner.group_size
  n = int(config.rl.prompts_per_iteration)
  kwargs = rl.sampler_kwargs(config, task, rows=n * k, greedy=False)
  sampler = rl.make_sampler(model_config, kwargs, mesh)
  rollout = rl.SyncRollout(
    sampler,
    num_samples=k,
    max_prompt_len=kwargs["max_prompt_len"],
    max_new_tokens=kwargs["max_new_tokens"],
  )
  rl_step = rl.make_rl_step(learner, sampler)
  source = rl.PromptSource(task.split("train"), batch_size=n, seed=0)
  batches = [source.next_batch() for _ in range(_WARMUP.value + _ITERATIONS.value)]
  key = jax.random.PRNGKey(0)

  def fresh_state():
    return train.create_train_state(
      params, model_config, learner.train_config, mesh, rng=jax.random.PRNGKey(1)
    )

  host = {"rollout": [], "reward": [], "logp": [], "train": [], "total": []}
  fused = []
  host_state, fused_state = fresh_state(), fresh_state()
  # With a KL term the reference policy is the starting point (the run's
  # warmed-up params); both variants then compute `ref_logp` every iteration.
  ref_params = jax.tree.map(jnp.copy, host_state.params) if learner.uses_ref else None
  compile_host = compile_fused = 0.0
  # The two variants alternate iteration by iteration, so a change in machine
  # load hits both alike (the ratio is measured side by side).
  for i, examples in enumerate(batches):
    rng = jax.random.fold_in(key, i)
    t0 = time.perf_counter()
    host_state, m, _ = learner.iteration(host_state, ref_params, rollout, examples, rng)
    t1 = time.perf_counter()
    fused_state, fm = rl_step.from_examples(fused_state, ref_params, examples, rng)
    jax.block_until_ready(fm)
    t2 = time.perf_counter()
    if i < _WARMUP.value:
      compile_host += t1 - t0
      compile_fused += t2 - t1
      continue
    for name in ("rollout", "reward", "logp", "train"):
      host[name].append(m[f"time/{name}_s"])
    host["total"].append(m["time/iteration_s"])
    fused.append(t2 - t1)

  med = {name: statistics.median(v) for name, v in host.items()}
  fused_s = statistics.median(fused)
  rows = n * k
  tokens = rows * kwargs["max_new_tokens"]
  lines = [
    f"RL iteration on {config.task.name} ({n} prompts x {k} samples = {rows} rows, "
    f"<= {kwargs['max_new_tokens']} new tokens, loss {config.train.loss}, "
    f"{config.train.mini_batches} update(s)/iteration, KL coef {config.train.kl_coef}), "
    f"{jax.devices()[0].platform} "
    f"x{mesh.size}, {os.cpu_count()} cores, {platform.processor() or platform.machine()}; "
    f"medians of {_ITERATIONS.value} iterations after {_WARMUP.value} compiling ones.",
    "",
    "| variant | rollout s | reward+adv s | logp s | train s | total s/iter | rows/s | vs host |",
    "|---|---|---|---|---|---|---|---|",
    f"| host-driven (`Learner.iteration`) | {med['rollout']:.3f} | {med['reward']:.3f} | "
    f"{med['logp']:.3f} | {med['train']:.3f} | {med['total']:.3f} | "
    f"{rows / med['total']:.0f} | 1.00x |",
    f"| fused (`make_rl_step`, one jit) | - | - | - | - | {fused_s:.3f} | {rows / fused_s:.0f} | "
    f"{med['total'] / fused_s:.2f}x |",
    "",
    f"Compile + first {_WARMUP.value} iterations: host {compile_host:.1f} s, fused "
    f"{compile_fused:.1f} s. Up to {tokens} sampled tokens per iteration.",
    "",
    "Command: `python experiments/bench_rl_iteration.py "
    + " ".join(a for a in sys.argv[1:] if not a.startswith("--out"))
    + "`",
  ]
  table = "\n".join(lines)
  print(table)
  if _OUT.value:
    with open(_OUT.value, "w") as f:
      f.write(table + "\n")


if __name__ == "__main__":
  app.run(main)
