r"""Learning checks of the rollout levers: FP8 rollout (+ token TIS), partial and async rollouts.

Every variant is the main job (experiments/configs/arithmetic.py, or --config:
experiments/configs/arithmetic_tail.py is the same job on a task with a long
tail of answer lengths) with a few config overrides, run by `rlx.rl.run` one
after the other in this process (never two at once), each in
`--workdir/<variant>_s<seed>`:

  hp            high-precision rollout (the config as it is)
  fp8_tis       rollout.weight_dtype = rollout.kv_dtype = "fp8_e4m3" (W8A8 decoder
                linears + FP8 KV, refreshed after every update) with token-level
                TIS (train.use_rollout_correction, level "token", truncate 2)
  fp8_nocorr    the same FP8 rollout without any correction
  fp8tok_tis / fp8tok_nocorr
                fp8_tis / fp8_nocorr with per-token FP8 KV scales
                (rollout.kv_scale_mode = "per_token": each cached token's own
                scale per KV head, instead of calibrated per-layer, per-head ones)
  sync_host     high precision, host-driven iteration (rl.fused = False): the
                synchronous baseline of the partial rollouts (same driver)
  partial       rollout.over_provision = --over_provision (APRIL, host-driven)
  async_tis     asynchronous rollout (`rl.async_rollout`, host-driven) on 2 host
                devices, the rollout thread on its own one (`mesh.rollout_devices
                = 1`) and the learner on the other, with the decoupled correction
                (token-level TIS from the behaviour to the proximal policy,
                truncate 2): the learner trains on batches its rollout thread
                sampled from an older version while it trained. Its mesh differs,
                so it trains its own warm-up (on its 1-device learner mesh).
  tail_sync / tail_partial
                sync_host / partial with a long response budget:
                sampler.max_new_tokens = --tail_max_new_tokens instead of the
                answer length. Answers are 5 tokens, so only rollouts that miss
                the stop token get longer: they decode to the cap (the long
                tail of RL rollouts whose budget is set for the longest
                response, as max_response_length in verl). The measured
                length distribution is in the table.

All variants share `--iterations` (the optimizer's decay_steps follows) and,
per seed, the supervised warm-up: it depends only on the seed (the evaluation
runs high precision in every variant), so the first variant's warm-up
checkpoint is copied to the others (same params, same before-RL accuracy).

`--config.<field>=value` (after `--config`) overrides a field of the base
config, as for experiments/train_rl.py; a variant's overrides and
`--iterations` are applied after it.

Outputs: `--out` (markdown tables, with every number computed from the runs'
summary.json / metrics.jsonl and the load averages recorded around each run),
`--plots` (PNG curves), and the per-run workdirs (metrics.jsonl, summary.json,
load.json). Rerun (resumes finished runs from their summaries; `--table_only`
only rebuilds the table and plots):

  python experiments/fp8_partial_learning.py --workdir=/tmp/fp8runs \
      --out=experiments/results/fp8_partial_learning.md \
      --plots=experiments/results/fp8_partial_learning
"""

import json
import math
import os
import shutil
import sys
import time

# The asynchronous variants need 2 host devices, set before jax starts; the others run on
# one device either way (only when an async variant is asked for, so the others' runs are
# made exactly as before).
_ASYNC_DEVICES = 2
if (
  __name__ == "__main__"
  and any(a.startswith("--runs=") and "async_" in a for a in sys.argv)
  and "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", "")
):
  os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={_ASYNC_DEVICES}"
  ).strip()

import numpy as np  # noqa: E402 (after the host-device flag)
from absl import app, flags, logging  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from rlx import rl  # noqa: E402

_ROOT = os.path.dirname(os.path.abspath(__file__))
_CONFIG = config_flags.DEFINE_config_file(
  "config",
  os.path.join(_ROOT, "configs", "arithmetic.py"),
  "Base config file (get_config()); --config.<field>=value overrides a field.",
  lock_config=False,
  accept_new_attributes=True,
)
_WORKDIR = flags.DEFINE_string("workdir", "/tmp/fp8runs", "Parent of the per-run workdirs.")
_RUNS = flags.DEFINE_list(
  "runs",
  [
    "hp:0", "fp8_tis:0", "fp8_nocorr:0", "sync_host:0", "partial:0",
    "hp:1", "fp8_tis:1", "hp:2", "fp8_tis:2", "tail_sync:0", "tail_partial:0",
  ],
  "variant:seed pairs, run in this order.",
)  # fmt: skip
_ITERATIONS = flags.DEFINE_integer("iterations", 200, "RL iterations of every variant.")
_OVER = flags.DEFINE_float("over_provision", 2.0, "rollout.over_provision of the partial runs.")
_TAIL = flags.DEFINE_integer("tail_max_new_tokens", 24, "Response budget of the tail_* runs.")
_OUT = flags.DEFINE_string("out", "", "Write the markdown table here.")
_PLOTS = flags.DEFINE_string("plots", "", "Write PNG curves with this path prefix.")
_TABLE_ONLY = flags.DEFINE_bool("table_only", False, "Only rebuild the table and plots.")
_NOTE = flags.DEFINE_string("note", "", "Free text for the table header (e.g. machine load).")
_BREAKDOWN = flags.DEFINE_integer(
  "mismatch_breakdown_prompts",
  0,
  "> 0: also measure which FP8 half causes the mismatch on the seed-0 warmed-up policy "
  "(this many train prompts x G, one rollout per FP8 setting), appended to the table.",
)

VARIANTS = {
  "hp": {},
  "fp8_tis": {
    "rollout.weight_dtype": "fp8_e4m3",
    "rollout.kv_dtype": "fp8_e4m3",
    "train.use_rollout_correction": True,
    "train.rollout_correction_kwargs.level": "token",
    "train.rollout_correction_kwargs.truncate": 2.0,
  },
  "fp8_nocorr": {"rollout.weight_dtype": "fp8_e4m3", "rollout.kv_dtype": "fp8_e4m3"},
  "fp8tok_tis": {
    "rollout.weight_dtype": "fp8_e4m3",
    "rollout.kv_dtype": "fp8_e4m3",
    "rollout.kv_scale_mode": "per_token",
    "train.use_rollout_correction": True,
    "train.rollout_correction_kwargs.level": "token",
    "train.rollout_correction_kwargs.truncate": 2.0,
  },
  "fp8tok_nocorr": {
    "rollout.weight_dtype": "fp8_e4m3",
    "rollout.kv_dtype": "fp8_e4m3",
    "rollout.kv_scale_mode": "per_token",
  },
  "sync_host": {"rl.fused": False},
  "async_tis": {
    "rl.fused": False,
    "rl.async_rollout": True,
    "mesh.num_devices": _ASYNC_DEVICES,
    "mesh.rollout_devices": 1,
    "train.use_rollout_correction": True,
    "train.rollout_correction_kwargs.level": "token",
    "train.rollout_correction_kwargs.truncate": 2.0,
  },
  "partial": {"rl.fused": False, "rollout.over_provision": "OVER"},
  "tail_sync": {"rl.fused": False, "sampler.max_new_tokens": "TAIL"},
  "tail_partial": {
    "rl.fused": False,
    "rollout.over_provision": "OVER",
    "sampler.max_new_tokens": "TAIL",
  },
}


# Each variant's paired baseline (same seed) in the "points − counterpart's" column: the
# static-KV-scale FP8 run for a per-token one, the synchronous run for a partial or an
# asynchronous one.
COUNTERPART = {
  "fp8tok_tis": "fp8_tis",
  "fp8tok_nocorr": "fp8_nocorr",
  "partial": "sync_host",
  "async_tis": "sync_host",
  "tail_partial": "tail_sync",
}


def _paired(stats: dict, variant: str, other: str) -> str:
  """`variant`'s points minus `other`'s on the same seeds, "mean ± std (n)", or "-"."""
  diffs = [
    100 * ((st["after"] - st["before"]) - (o["after"] - o["before"]))
    for (v, seed), st in stats.items()
    if v == variant and (o := stats.get((other, seed))) is not None
  ]
  if variant == other or not diffs:
    return "-"
  spread = f" ± {np.std(diffs, ddof=1):.1f}" if len(diffs) > 1 else ""
  return f"{np.mean(diffs):+.1f}{spread} (n = {len(diffs)})"


def variant_config(base, variant: str, seed: int, iterations: int):
  """The base config with the variant's overrides, `seed` and `iterations`."""
  if variant not in VARIANTS:
    raise ValueError(f"unknown variant {variant!r}; known: {sorted(VARIANTS)}")
  c = base.copy_and_resolve_references()
  c.seed = int(seed)
  c.rl.iterations = int(iterations)
  c.train.optimizer.decay_steps = int(iterations) * int(c.train.mini_batches)
  c.log.progress_bar = False
  c.log.print_summary = False
  for key, value in VARIANTS[variant].items():
    value = {"OVER": _OVER.value, "TAIL": _TAIL.value}.get(value, value)
    node = c
    *parents, leaf = key.split(".")
    for p in parents:
      node = node[p]
    node[leaf] = value
  rl.validate_config(c)
  return c


def _records(workdir):
  path = os.path.join(workdir, "metrics.jsonl")
  return rl.read_metrics(path) if os.path.exists(path) else []


def run_one(base, variant: str, seed: int) -> dict:
  workdir = os.path.join(_WORKDIR.value, f"{variant}_s{seed}")
  config = variant_config(base, variant, seed, _ITERATIONS.value)
  warm = os.path.join(workdir, "warmup")
  # Reuse this seed's warm-up (it depends on the seed only), except across meshes: an
  # asynchronous variant's warm-up key names its own mesh, so it trains its own.
  if not os.path.exists(warm) and not variant.startswith("async"):
    for other in sorted(os.listdir(_WORKDIR.value)) if os.path.isdir(_WORKDIR.value) else []:
      src = os.path.join(_WORKDIR.value, other, "warmup")
      if (
        other.endswith(f"_s{seed}")
        and not other.startswith("async")
        and os.path.exists(os.path.join(src, "0"))
      ):
        os.makedirs(workdir, exist_ok=True)
        shutil.copytree(src, warm)
        shutil.copy(os.path.join(_WORKDIR.value, other, "metrics.jsonl"), workdir)
        _keep_warmup_records(os.path.join(workdir, "metrics.jsonl"))
        break
  fresh = not os.path.exists(os.path.join(workdir, "summary.json"))
  load_start = os.getloadavg()[0]
  t0 = time.time()
  summary = rl.run(config, workdir)
  if fresh:  # the machine's 1-minute load average around this run (a resumed one keeps its own)
    with open(os.path.join(workdir, "load.json"), "w") as f:
      json.dump({"start": load_start, "end": os.getloadavg()[0], "cores": os.cpu_count()}, f)
  print(
    f"{variant} seed {seed}: accuracy {summary['accuracy_before']:.3f} -> "
    f"{summary['accuracy_after']:.3f}, {time.time() - t0:.0f} s",
    flush=True,
  )
  return summary


def _keep_warmup_records(path):
  kept = [r for r in rl.read_metrics(path) if r.get("phase") == "warmup"]
  with open(path, "w") as f:
    for r in kept:
      f.write(json.dumps(r) + "\n")


def _mean(xs):
  xs = [x for x in xs if x is not None and math.isfinite(x)]
  return float(np.mean(xs)) if xs else math.nan


def _median(xs):
  xs = [x for x in xs if x is not None and math.isfinite(x)]
  return float(np.median(xs)) if xs else math.nan


def _load(workdir):
  path = os.path.join(workdir, "load.json")
  if not os.path.exists(path):
    return None
  with open(path) as f:
    return json.load(f)


LEARNER_KEYS = ("time/reward_s", "time/logp_s", "time/train_s")


def run_stats(workdir: str) -> dict | None:
  """Summary numbers of one finished run (None if it has no summary)."""
  path = os.path.join(workdir, "summary.json")
  if not os.path.exists(path):
    return None
  with open(path) as f:
    s = json.load(f)
  records = _records(workdir)
  rl_recs = [r for r in records if r.get("phase") == "rl"]
  evals = [r for r in records if r.get("phase") == "eval"]
  clock = np.cumsum([r["time/iteration_s"] for r in rl_recs])
  at = {r["iteration"]: t for r, t in zip(rl_recs, clock, strict=True)}
  lengths = [r["response_length"] for r in rl_recs]
  return {
    "before": s["accuracy_before"],
    "after": s["accuracy_after"],
    "best_dev_test": s["accuracy_best_dev"],
    "k1": _mean([r.get("mismatch_k1") for r in rl_recs]),
    "k3": _mean([r.get("mismatch_k3") for r in rl_recs]),
    "k3_last": _mean([r.get("mismatch_k3") for r in rl_recs[-20:]]),
    "tis_truncated": _mean([r.get("rollout_correction/frac_truncated") for r in rl_recs]),
    "tis_ess": _mean([r.get("rollout_correction/ess") for r in rl_recs]),
    "refresh_s": s.get("refresh_s_mean"),
    "rl_time_s": s["rl_time_s"],
    "s_per_it": s["seconds_per_iteration"],
    "wall_s": s["wall_time_s"],
    "iterations": s["iterations"],
    "fused": s["fused_rl_step"],
    "length_mean": _mean(lengths),
    "length_max": max(lengths, default=math.nan),
    "rollout_s": _mean([r.get("time/rollout_s") for r in rl_recs]),
    "train_s": _mean([r.get("time/train_s") for r in rl_recs]),
    "stop_fraction": _mean([r["stop_fraction"] for r in rl_recs]),
    "recycled": _mean([r.get("rollout/groups_recycled") for r in rl_recs]),
    # Medians per iteration (host-driven runs log the phases; fused ones only the total).
    "med_rollout_s": _median([r.get("time/rollout_s") for r in rl_recs]),
    "med_logp_s": _median([r.get("time/logp_s") for r in rl_recs]),
    "med_train_s": _median([r.get("time/train_s") for r in rl_recs]),
    "med_iteration_s": _median([r.get("time/iteration_s") for r in rl_recs]),
    "med_rollout_share": _median(
      [
        r["time/rollout_s"] / r["time/iteration_s"]
        for r in rl_recs
        if "time/rollout_s" in r and r.get("time/iteration_s")
      ]
    ),
    "med_prefill_tokens": _median([r.get("rollout/prefill_tokens") for r in rl_recs]),
    "med_resumed": _median([r.get("rollout/groups_resumed") for r in rl_recs]),
    # Asynchronous runs: the learner's wait for a batch, the batches' staleness in updates.
    "med_learner_wait_s": _median([r.get("time/learner_wait_s") for r in rl_recs]),
    # The learner's busy time per iteration: an async iteration less its wait for a batch,
    # a synchronous one's reward + log-probs + train step (as experiments/bench_async.py).
    "med_learner_busy_s": _median(
      [
        r["time/iteration_s"] - r["time/learner_wait_s"]
        if "time/learner_wait_s" in r
        else r["time/reward_s"] + r["time/logp_s"] + r["time/train_s"]
        for r in rl_recs
        if "time/learner_wait_s" in r or all(k in r for k in LEARNER_KEYS)
      ]
    ),
    "staleness_mean": s.get("staleness_mean"),
    "staleness_max": s.get("staleness_max"),
    "load": _load(workdir),
    "off_policy": _mean([r.get("rollout/off_policy_token_fraction") for r in rl_recs]),
    # Dev accuracy from the end of the warm-up (iteration 0) on.
    "dev_curve": [(0, s["warmup_dev_accuracy"])]
    + [(r["iteration"], r["dev_accuracy"]) for r in evals],
    "dev_clock": [(0.0, s["warmup_dev_accuracy"])]
    + [(at[r["iteration"]], r["dev_accuracy"]) for r in evals if r["iteration"] in at],
    "k3_curve": [(r["iteration"], r.get("mismatch_k3", math.nan)) for r in rl_recs],
  }


def mismatch_breakdown(base, num_prompts: int) -> str:
  """k1 / k3 of FP8 weight / KV settings against the float32 trainer, one warmed-up policy.

  The seed-0 warm-up checkpoint (`hp_s0/warmup`), `num_prompts` train prompts
  x G samples at the run's temperature from each sampler setting; the
  trainer's float32 log-probs of those samples (`rlx.policy.token_logprobs`)
  vs the sampler's (`rlx.objectives.rollout_mismatch_kl`). KV scales from
  the trainer's forward over the prompts (as the loop's first calibration).
  """
  import jax  # noqa: PLC0415

  from rlx import objectives, policy, train  # noqa: PLC0415

  config = variant_config(base, "hp", 0, _ITERATIONS.value)
  task = rl.make_task(config)
  mesh = rl.build_mesh(config)
  model_config, _ = rl.build_model(config, task)
  abstract = train.abstract_train_state(model_config, rl.train_config(config), mesh)
  with train.Checkpointer(os.path.join(_WORKDIR.value, "hp_s0", "warmup")) as ckpt:
    params = ckpt.restore(abstract.replace(opt_state=())).state.params  # saved params-only
  prompts = [e.prompt_ids for e in task.split("train")[:num_prompts]]
  g = rl.samples_per_prompt(config)
  temperature = float(config.rl.temperature)
  logprobs = jax.jit(policy.token_logprobs, static_argnums=1, static_argnames=("temperature",))
  lines = [
    "",
    f"## Where the FP8 mismatch comes from (seed-0 warmed-up policy, {num_prompts} prompts "
    f"x G = {g}, T = {temperature})",
    "",
    "| rollout weight_dtype | rollout kv_dtype | kv_scale_mode | mismatch k1 | mismatch k3 |",
    "|---|---|---|---|---|",
  ]
  for weight_dtype, kv_dtype, mode in (
    ("auto", "float32", "static"), ("auto", "fp8_e4m3", "static"),
    ("auto", "fp8_e4m3", "per_token"), ("fp8_e4m3", "float32", "static"),
    ("fp8_e4m3", "fp8_e4m3", "static"), ("fp8_e4m3", "fp8_e4m3", "per_token"),
    ("fp8_e4m3", "fp8_e5m2", "static"), ("fp8_e4m3", "fp8_e5m2", "per_token"),
  ):  # fmt: skip
    c = config.copy_and_resolve_references()
    c.rollout.weight_dtype, c.rollout.kv_dtype = weight_dtype, kv_dtype
    c.rollout.kv_scale_mode = mode
    kwargs = rl.sampler_kwargs(c, task, rows=len(prompts) * g, greedy=False)
    rollout = rl.SyncRollout(
      rl.make_sampler(model_config, kwargs, mesh),
      num_samples=g,
      max_prompt_len=kwargs["max_prompt_len"],
      max_new_tokens=kwargs["max_new_tokens"],
    )
    batch = rollout.collect(params, prompts, jax.random.PRNGKey(0))
    old, _ = logprobs(
      params, model_config, batch.tokens, batch.response_mask, temperature=temperature
    )
    mm = objectives.rollout_mismatch_kl(old, batch.rollout_logp, batch.response_mask)
    lines.append(
      f"| {weight_dtype} | {kv_dtype} | {mode if kv_dtype.startswith('fp8') else '-'} | "
      f"{float(mm.k1):.2e} | {float(mm.k3):.2e} |"
    )
  return "\n".join(lines)


def _fmt(x, spec=".3f"):
  return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def table(stats: dict) -> str:
  """The markdown tables of every finished run."""
  overrides = [f"`{a}`" for a in sys.argv[1:] if a.startswith("--config.")]
  lines = [
    "# FP8 rollout and partial rollouts: learning checks on the arithmetic task",
    "",
    f"Base config: {os.path.relpath(os.path.abspath(_config_file()), os.path.dirname(_ROOT))}"
    + (f" with the command line's overrides {', '.join(overrides)}" if overrides else "")
    + f"; rl.iterations = {_ITERATIONS.value} "
    "(and optimizer.decay_steps = iterations x train.mini_batches) for EVERY variant; "
    "variants as in experiments/fp8_partial_learning.py. Test accuracy = greedy exact "
    "match on the 500 held-out problems, before RL (after the warm-up) and after the last "
    "iteration. "
    "k1 / k3 = the train step's mismatch_k1 / mismatch_k3 (KL(rollout || trainer) of the "
    "sampled tokens: FP8 sampler vs float32 trainer; with partial rollouts also staleness), "
    "mean over iterations. Wall times follow the machine's load (load avg: the 1-minute load "
    "average at the start and at the end of each run, on the machine's cores, where the run "
    "recorded it); accuracy does not depend on it (the runs are deterministic).",
  ]
  if _NOTE.value:
    lines += ["", _NOTE.value]
  lines += [
    "",
    "## Per run",
    "",
    "| variant | seed | test acc before | test acc after | points | best-dev ckpt test acc | "
    "mismatch k1 | mismatch k3 | k3 (last 20 it) | TIS truncated | TIS ESS | refresh s/update | "
    "RL s/it | RL time s | wall s | load avg (start-end / cores) |",
    "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
  ]
  for (variant, seed), st in sorted(
    stats.items(), key=lambda kv: (list(VARIANTS).index(kv[0][0]), kv[0][1])
  ):
    lines.append(
      f"| {variant} | {seed} | {st['before']:.3f} | {st['after']:.3f} | "
      f"{100 * (st['after'] - st['before']):+.1f} | {st['best_dev_test']:.3f} | "
      f"{_fmt(st['k1'], '.2e')} | {_fmt(st['k3'], '.2e')} | {_fmt(st['k3_last'], '.2e')} | "
      f"{_fmt(st['tis_truncated'], '.4f')} | {_fmt(st['tis_ess'])} | {_fmt(st['refresh_s'])} | "
      f"{st['s_per_it']:.2f} | {st['rl_time_s']:.0f} | "
      f"{st['wall_s']:.0f} | {_load_text(st['load'])} |"
    )
  lines += [
    "",
    "## Mean over seeds",
    "",
    "| variant | seeds | test acc after (mean ± std) | points (mean ± std) | "
    "points − hp's on the same seed (mean ± std) | points − the counterpart's on the same "
    "seed (per-token vs static KV scales, partial or async vs synchronous) | mismatch k3 | "
    "RL s/it |",
    "|---|---|---|---|---|---|---|---|",
  ]
  for variant in VARIANTS:
    runs = [st for (v, _), st in stats.items() if v == variant]
    if not runs:
      continue
    after = np.asarray([r["after"] for r in runs])
    pts = 100 * (after - np.asarray([r["before"] for r in runs]))
    sd = (lambda x: f" ± {np.std(x, ddof=1):.1f}") if len(runs) > 1 else (lambda x: "")
    sda = f" ± {np.std(after, ddof=1):.3f}" if len(runs) > 1 else ""
    other = COUNTERPART.get(variant)
    paired = _paired(stats, variant, other) if other else "-"
    paired += f" vs {other}" if paired != "-" else ""
    lines.append(
      f"| {variant} | {len(runs)} | {after.mean():.3f}{sda} | {pts.mean():+.1f}{sd(pts)} | "
      f"{_paired(stats, variant, 'hp')} | {paired} | "
      f"{_fmt(_mean([r['k3'] for r in runs]), '.2e')} | "
      f"{_mean([r['s_per_it'] for r in runs]):.2f} |"
    )
  rollout_rows = [k for k in stats if k[0] in ("sync_host", "partial", "tail_sync", "tail_partial")]
  if rollout_rows:
    lines += [
      "",
      "## Partial vs synchronous rollouts (host-driven)",
      "",
      "| variant | test acc after | RL time s | RL s/it | rollout s/it | train s/it | "
      "response length (mean) | stop fraction | groups recycled / collect | "
      "off-policy token fraction |",
      "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for key in sorted(rollout_rows, key=lambda k: list(VARIANTS).index(k[0])):
      st = stats[key]
      lines.append(
        f"| {key[0]} (seed {key[1]}) | {st['after']:.3f} | {st['rl_time_s']:.0f} | "
        f"{st['s_per_it']:.2f} | {_fmt(st['rollout_s'], '.2f')} | {_fmt(st['train_s'], '.2f')} | "
        f"{st['length_mean']:.2f} | {st['stop_fraction']:.3f} | "
        f"{_fmt(st['recycled'], '.1f')} | {_fmt(st['off_policy'])} |"
      )
    lines += [
      "",
      "## Median per iteration (host-driven runs)",
      "",
      "Medians over the RL iterations of the phase times the loop logs (time/rollout_s, "
      "time/logp_s, time/train_s, time/iteration_s; the first collections' compiles do not "
      "move a median), the rollout's share of its iteration, and per collection the "
      "prefill tokens (the prompt and generated prefix of every resumed group are prefilled "
      "again) and the groups resumed (the loop logs these for partial rollouts only).",
      "",
      "| variant | rollout s | logp s | train s | iteration s | rollout share | "
      "prefill tokens / collect | groups resumed / collect |",
      "|---|---|---|---|---|---|---|---|",
    ]
    for key in sorted(rollout_rows, key=lambda k: list(VARIANTS).index(k[0])):
      st = stats[key]
      lines.append(
        f"| {key[0]} (seed {key[1]}) | {_fmt(st['med_rollout_s'])} | {_fmt(st['med_logp_s'])} | "
        f"{_fmt(st['med_train_s'])} | {_fmt(st['med_iteration_s'])} | "
        f"{_fmt(st['med_rollout_share'], '.0%')} | {_fmt(st['med_prefill_tokens'], '.0f')} | "
        f"{_fmt(st['med_resumed'], '.1f')} |"
      )
    lines += _comparisons(stats)
  lines += _async_section(stats)
  # The note is this text; --table_only only re-reads finished runs (the command reruns them).
  args = [a for a in sys.argv[1:] if not a.startswith("--note") and a != "--table_only"]
  cmd = " ".join(["python", "experiments/fp8_partial_learning.py", *args])
  lines += ["", f"Rerun: `{cmd}`", ""]
  return "\n".join(lines)


def _config_file() -> str:
  return flags.FLAGS["config"].config_filename


def _load_text(load) -> str:
  return "-" if not load else f"{load['start']:.1f}-{load['end']:.1f} / {load['cores']}"


def _comparisons(stats: dict) -> list[str]:
  """One sentence per partial run with its synchronous baseline (same seed), from the tables."""
  out = []
  for partial, sync in (("partial", "sync_host"), ("tail_partial", "tail_sync")):
    for (variant, seed), p in sorted(stats.items()):
      s = stats.get((sync, seed))
      if variant != partial or s is None:
        continue
      out.append(
        f"{partial} vs {sync} (seed {seed}): test accuracy after RL {p['after']:.3f} vs "
        f"{s['after']:.3f}; RL time {p['rl_time_s']:.0f} s vs {s['rl_time_s']:.0f} s "
        f"({p['rl_time_s'] / s['rl_time_s']:.2f}x); median rollout "
        f"{_fmt(p['med_rollout_s'])} s vs {_fmt(s['med_rollout_s'])} s per iteration, "
        f"{_fmt(p['med_rollout_share'], '.0%')} vs {_fmt(s['med_rollout_share'], '.0%')} of it."
      )
  return ["", *out] if out else []


def _async_section(stats: dict) -> list[str]:
  """Asynchronous runs beside the synchronous run of the same seed (none: no lines)."""
  seeds = sorted(seed for (variant, seed) in stats if variant == "async_tis")
  if not seeds:
    return []
  lines = [
    "",
    "## Asynchronous vs synchronous rollouts (host-driven)",
    "",
    "Medians over the RL iterations: the iteration time; the rollout's collection time "
    "(`time/rollout_s`; asynchronous: the rollout thread's, for the batch the iteration "
    "trained on); the learner's busy time (synchronous: reward + log-probs + train step; "
    "asynchronous: the iteration less its wait for a queued batch, `time/learner_wait_s`); "
    "vs slower sync side: the asynchronous median iteration over the larger of the "
    "synchronous run's (same seed) median rollout and learner times (1.00x = perfect "
    "overlap). Staleness: the updates between the version that sampled a token and the one "
    "trained on it, mean and max over the run's tokens (summary.json); TIS truncated: the "
    "fraction of tokens whose behaviour -> proximal weight hit the truncation, mean over "
    "iterations.",
    "",
    "| variant | test acc before | test acc after | points | RL time s | iteration s | "
    "rollout s | learner busy s | learner wait s | vs slower sync side | staleness mean | "
    "staleness max | TIS truncated |",
    "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
  ]
  for seed in seeds:
    for variant in ("sync_host", "async_tis"):
      st, sync = stats.get((variant, seed)), stats.get(("sync_host", seed))
      if st is None:
        continue
      ratio = "-"
      if variant != "sync_host" and sync is not None:
        sides = [sync["med_rollout_s"], sync["med_learner_busy_s"]]
        if not any(math.isnan(x) for x in sides):
          ratio = f"{st['med_iteration_s'] / max(sides):.2f}x"
      lines.append(
        f"| {variant} (seed {seed}) | {st['before']:.3f} | {st['after']:.3f} | "
        f"{100 * (st['after'] - st['before']):+.1f} | {st['rl_time_s']:.0f} | "
        f"{_fmt(st['med_iteration_s'])} | {_fmt(st['med_rollout_s'])} | "
        f"{_fmt(st['med_learner_busy_s'])} | {_fmt(st['med_learner_wait_s'])} | {ratio} | "
        f"{_fmt(st['staleness_mean'], '.2f')} | {_fmt(st['staleness_max'], '.0f')} | "
        f"{_fmt(st['tis_truncated'], '.4f')} |"
      )
  out = []
  for seed in seeds:
    a, s = stats[("async_tis", seed)], stats.get(("sync_host", seed))
    if s is not None:
      out.append(
        f"async_tis vs sync_host (seed {seed}): test accuracy after RL {a['after']:.3f} vs "
        f"{s['after']:.3f}; RL time {a['rl_time_s']:.0f} s vs {s['rl_time_s']:.0f} s "
        f"({a['rl_time_s'] / s['rl_time_s']:.2f}x)."
      )
  return lines + ["", *out] if out else lines


def plots(stats: dict, prefix: str) -> list[str]:
  import matplotlib  # noqa: PLC0415

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # noqa: PLC0415

  colors = {"hp": "C0", "fp8_tis": "C1", "fp8_nocorr": "C3", "sync_host": "C0", "partial": "C2",
            "tail_sync": "C4", "tail_partial": "C5"}  # fmt: skip
  out = []
  fp8_runs = [k for k in stats if k[0] in ("hp", "fp8_tis", "fp8_nocorr")]
  rollout_runs = [k for k in stats if k[0] in ("sync_host", "partial", "tail_sync", "tail_partial")]
  if not fp8_runs:
    return out + _partial_plot(stats, prefix, colors, plt) if rollout_runs else out
  fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
  for (variant, seed), st in sorted(stats.items()):
    if variant not in ("hp", "fp8_tis", "fp8_nocorr"):
      continue
    xs, ys = zip(*st["dev_curve"], strict=True) if st["dev_curve"] else ((), ())
    axes[0].plot(xs, ys, color=colors[variant], marker=".", alpha=0.8, label=f"{variant} s{seed}")
    xs, ys = zip(*st["k3_curve"], strict=True) if st["k3_curve"] else ((), ())
    axes[1].plot(xs, ys, color=colors[variant], alpha=0.6, label=f"{variant} s{seed}")
  axes[0].set(
    xlabel="RL iteration", ylabel="dev greedy accuracy", title="FP8 vs high-precision rollout"
  )
  axes[1].set(
    xlabel="RL iteration",
    ylabel="mismatch k3",
    yscale="log",
    title="rollout vs trainer mismatch k3 (hp: float rounding, ~0, off the log axis)",
  )
  out.append(_finish(fig, axes, f"{prefix}_fp8.png", plt, fontsize=7))
  return out + (_partial_plot(stats, prefix, colors, plt) if rollout_runs else [])


def _finish(fig, axes, path, plt, *, fontsize):
  """Legends, grids and layout of `axes`; saves `fig` to `path` and returns it."""
  for ax in axes:
    ax.legend(fontsize=fontsize)
    ax.grid(alpha=0.3)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return path


def _partial_plot(stats, prefix, colors, plt):
  fig, ax = plt.subplots(figsize=(7, 4.5))
  for (variant, seed), st in sorted(stats.items()):
    if variant not in ("sync_host", "partial", "tail_sync", "tail_partial", "hp") or seed != 0:
      continue
    xs, ys = zip(*st["dev_clock"], strict=True) if st["dev_clock"] else ((), ())
    style = "--" if variant == "hp" else "-"
    ax.plot(xs, ys, style, color=colors[variant], marker=".", label=f"{variant} s{seed}")
  ax.set(xlabel="RL wall-clock (s)", ylabel="dev greedy accuracy",
         title="partial vs synchronous rollouts")  # fmt: skip
  return [_finish(fig, [ax], f"{prefix}_partial.png", plt, fontsize=8)]


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  logging.set_verbosity(logging.WARNING)
  base = _CONFIG.value
  pairs = []
  for item in _RUNS.value:
    variant, _, seed = item.partition(":")
    if variant not in VARIANTS or not seed.isdigit():
      raise app.UsageError(f"--runs entries are variant:seed with a variant of {sorted(VARIANTS)}")
    pairs.append((variant, int(seed)))
  if not _TABLE_ONLY.value:
    for variant, seed in pairs:
      run_one(base, variant, seed)
  stats = {}
  for variant, seed in pairs:
    st = run_stats(os.path.join(_WORKDIR.value, f"{variant}_s{seed}"))
    if st is not None:
      stats[(variant, seed)] = st
  text = table(stats)
  if _BREAKDOWN.value > 0:
    text += mismatch_breakdown(base, _BREAKDOWN.value) + "\n"
  print(text)
  if _OUT.value:
    with open(_OUT.value, "w") as f:
      f.write(text)
  if _PLOTS.value and stats:
    for p in plots(stats, _PLOTS.value):
      print("plot:", p)


if __name__ == "__main__":
  app.run(main)
