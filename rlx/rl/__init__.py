"""rlx.rl: the RL loop as a library (rollout -> reward -> advantages -> log-probs -> update).

  summary = rlx.rl.run(rlx.rl.get_config(), "/tmp/rlx_arithmetic")

Pieces, for a custom loop:
  learner = Learner(config, task, model_config, mesh)       # jitted log-probs / train step
  rollout = SyncRollout(sampler, num_samples=K, ...)        # collect(params, prompts, rng)
  state, metrics, batch = learner.iteration(state, ref_params, rollout, examples, rng)
  state, metrics, batch = learner.update(state, ref_params, batch, examples)  # collected elsewhere
  rl_step = make_rl_step(learner, sampler)                  # the same iteration as ONE jit
  state, metrics = rl_step.from_examples(state, ref_params, examples, rng)
Both run the update written once, `learner.update_fn(pieces, state, ref_params,
batch)`: `update` with jitted `UpdatePieces` and phase timing, `make_rl_step`
traced inside its program. `run` resolves the config once into a frozen
`RunSpec` and checkpoints a `RunCursor` (where the run stands).

Stale data (config.rl.staleness = k updates): `RolloutParams` holds the params
that sample each batch (a ring of versions, or an interval refresh):
  params_k, v = rollout_params.select(state.params, learner.version(state))
  state, metrics, batch = learner.iteration(
      state, ref_params, rollout, examples, rng, rollout_params=params_k, rollout_version=v)
PPO-EWMA (config.rl.old_logp = "ewma"): `ProximalEwma` holds the proximal
params whose log-probs are old_logp: `learner.iteration(...,
proximal_params=ewma.select(state.params))`, then `ewma.update(state.params)`.

Warm-up: `supervised_warmup(...)` trains it; `warm_start(config, workdir, ...)` is
`run`'s cached one (resumed from `workdir/warmup`, reused from
`config.warmup.init_from` or trained) and returns a `WarmStart` (state, info).

FP8 rollout (config.rollout.weight_dtype / kv_dtype): SyncRollout over an FP8
sampler holds an `Fp8Refresh` (`rollout.fp8`): the rollout params and KV
scales, re-quantized / recalibrated by `Learner.iteration` after every update
(with `AsyncRollout`, by the rollout thread when it takes a newer version).
"""

from rlx.rl._advantages import (
  group_advantages,
  vcpo_row_advantages,
)
from rlx.rl._async import AsyncRollout
from rlx.rl._batch import (
  FINISH_REASONS,
  RolloutBatch,
  build_rollout_batch,
  response_arrays,
  train_batch,
)
from rlx.rl._cache import (
  compilation_cache_dir,
  enable_compilation_cache,
)
from rlx.rl._config import (
  BASELINES,
  NOT_COMPARED,
  check_fields,
  get_config,
  import_user_code,
  make_task,
  samples_per_prompt,
  task_kwargs,
  train_config,
  validate_config,
)
from rlx.rl._data import (
  PromptSource,
)
from rlx.rl._evaluate import (
  GreedyEvaluator,
  greedy_accuracy,
)
from rlx.rl._learner import (
  Learner,
  RLStep,
  UpdatePieces,
  make_rl_step,
  offpolicy_metrics,
)
from rlx.rl._logging import (
  MetricsLog,
  plot_run,
  read_metrics,
  run_figure,
)
from rlx.rl._rollout import (
  Fp8Refresh,
  PartialRollout,
  Rollout,
  SyncRollout,
  make_sampler,
  pad_prompts,
  sampler_kwargs,
)
from rlx.rl._run import (
  SUPERVISED_NOTE,
  RunCursor,
  build_mesh,
  build_model,
  build_rollout_mesh,
  format_summary,
  run,
)
from rlx.rl._spec import RunSpec
from rlx.rl._staleness import (
  STALENESS_MODES,
  ProximalEwma,
  RolloutParams,
  staleness_metrics,
)
from rlx.rl._sweep import (
  format_sweep_row,
  grid_points,
  parse_grid,
  plot_sweep,
  run_sweep,
  sweep_table,
)
from rlx.rl._warmstart import (
  WarmStart,
  read_warmup_key,
  warm_start,
  warmup_key,
)
from rlx.rl._warmup import (
  WarmupCapError,
  WarmupResult,
  supervised_warmup,
)

__all__ = (
  "BASELINES",
  "FINISH_REASONS",
  "Fp8Refresh",
  "Learner",
  "MetricsLog",
  "NOT_COMPARED",
  "PartialRollout",
  "PromptSource",
  "RLStep",
  "UpdatePieces",
  "Rollout",
  "RolloutBatch",
  "ProximalEwma",
  "RolloutParams",
  "STALENESS_MODES",
  "SUPERVISED_NOTE",
  "SyncRollout",
  "WarmupCapError",
  "WarmupResult",
  "WarmStart",
  "build_mesh",
  "build_rollout_mesh",
  "AsyncRollout",
  "build_model",
  "build_rollout_batch",
  "check_fields",
  "compilation_cache_dir",
  "enable_compilation_cache",
  "format_summary",
  "format_sweep_row",
  "get_config",
  "GreedyEvaluator",
  "greedy_accuracy",
  "import_user_code",
  "grid_points",
  "group_advantages",
  "vcpo_row_advantages",
  "make_rl_step",
  "offpolicy_metrics",
  "make_sampler",
  "make_task",
  "pad_prompts",
  "parse_grid",
  "plot_run",
  "plot_sweep",
  "read_metrics",
  "read_warmup_key",
  "response_arrays",
  "run",
  "RunCursor",
  "RunSpec",
  "run_figure",
  "run_sweep",
  "sampler_kwargs",
  "samples_per_prompt",
  "staleness_metrics",
  "supervised_warmup",
  "task_kwargs",
  "sweep_table",
  "train_batch",
  "train_config",
  "validate_config",
  "warm_start",
  "warmup_key",
)
