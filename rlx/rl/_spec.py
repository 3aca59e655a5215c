"""`RunSpec`: an RL config validated and resolved once, into what `rlx.rl.run`'s loop reads.

`run` turns the `ConfigDict` into one frozen `RunSpec` before it builds
anything: the loop, the rollout driver and the summary read its plain Python
values, so no part re-reads or re-converts a field, and a config changed
after the run started changes nothing the run does. The pieces built from the
config's sections keep their own resolved forms: the train step its
`rlx.train.StepSpec`, the sampler its `SamplerConfig`, the `Learner` its
train config.

  spec = RunSpec.from_config(config)       # validates, then resolves
  spec.iterations, spec.rows, spec.fused   # 200, 512, True
"""

import dataclasses

import ml_collections

from rlx.rl import _cache, _config


@dataclasses.dataclass(frozen=True)
class RunSpec:
  """The settings of an RL run's loop, resolved from a validated config (frozen).

  Attributes:
    seed: `config.seed`.
    iterations: `rl.iterations`.
    prompts_per_iteration: N, `rl.prompts_per_iteration`.
    samples_per_prompt: K, rows per prompt (`rlx.rl.samples_per_prompt`: G,
      or G + 1 with the median baseline).
    loss: `train.loss`.
    baseline: `rl.baseline`.
    fused: `rl.fused` (the driver also needs a JAX reward, on-policy data and
      the batch in the sampler's slots to fuse).
    over_provision: `rollout.over_provision` (> 1: APRIL partial rollouts).
    staleness: `rl.staleness`, in optimizer updates.
    staleness_mode: `rl.staleness_mode`.
    staleness_ring: `rl.staleness_ring`.
    old_logp: `rl.old_logp`.
    ewma_decay: `rl.ewma_decay` (with `old_logp = "ewma"`).
    async_rollout: `rl.async_rollout`.
    async_queue_size: `rl.async_queue_size`.
    max_staleness: `rl.max_staleness` (0 = no bound).
    stale_batches: `rl.stale_batches` ("drop" | "keep").
    target_dev_accuracy: `rl.target_dev_accuracy` (0 = none).
    max_time_s: `rl.max_time_s` (0 = none).
    eval_every: `eval.every` (0 = never).
    dev_examples: `eval.dev_examples` (0 = the whole split).
    test_examples: `eval.test_examples` (0 = the whole split).
    checkpoint_every: `checkpoint.every`.
    max_to_keep: `checkpoint.max_to_keep`.
    progress: `log.progress_bar` (also the first-call compile notes).
    tensorboard: `log.tensorboard`.
    plots: `log.plots`.
    print_summary: `log.print_summary`.
    compilation_cache_dir: the persistent compilation cache's directory
      (`compilation_cache_dir` or `$RLX_COMPILATION_CACHE_DIR`; "" = off).
  """

  seed: int
  iterations: int
  prompts_per_iteration: int
  samples_per_prompt: int
  loss: str
  baseline: str
  fused: bool
  over_provision: float
  staleness: int
  staleness_mode: str
  staleness_ring: str
  old_logp: str
  ewma_decay: float
  async_rollout: bool
  async_queue_size: int
  max_staleness: int
  stale_batches: str
  target_dev_accuracy: float
  max_time_s: float
  eval_every: int
  dev_examples: int
  test_examples: int
  checkpoint_every: int
  max_to_keep: int
  progress: bool
  tensorboard: bool
  plots: bool
  print_summary: bool
  compilation_cache_dir: str

  @property
  def rows(self) -> int:
    """Rollout rows per iteration: N x K."""
    return self.prompts_per_iteration * self.samples_per_prompt

  @property
  def partial(self) -> bool:
    """Whether APRIL partial rollouts are on (`over_provision` > 1)."""
    return self.over_provision > 1.0

  @classmethod
  def from_config(cls, config: ml_collections.ConfigDict) -> "RunSpec":
    """Validates `config` (`rlx.rl.validate_config`) and resolves it.

    Raises:
      ValueError: naming the first invalid field.
    """
    _config.validate_config(config)
    rl, log = config.rl, config.log
    return cls(
      seed=int(config.seed),
      iterations=int(rl.iterations),
      prompts_per_iteration=int(rl.prompts_per_iteration),
      samples_per_prompt=_config.samples_per_prompt(config),
      loss=str(config.train.loss),
      baseline=str(rl.baseline),
      fused=bool(rl.fused),
      over_provision=float(config.rollout.over_provision),
      staleness=int(rl.staleness),
      staleness_mode=str(rl.staleness_mode),
      staleness_ring=str(rl.staleness_ring),
      old_logp=str(rl.old_logp),
      ewma_decay=float(rl.ewma_decay),
      async_rollout=bool(rl.async_rollout),
      async_queue_size=int(rl.async_queue_size),
      max_staleness=int(rl.max_staleness),
      stale_batches=str(rl.stale_batches),
      target_dev_accuracy=float(rl.target_dev_accuracy),
      max_time_s=float(rl.max_time_s),
      eval_every=int(config.eval.every),
      dev_examples=int(config.eval.dev_examples),
      test_examples=int(config.eval.test_examples),
      checkpoint_every=int(config.checkpoint.every),
      max_to_keep=int(config.checkpoint.max_to_keep),
      progress=bool(log.progress_bar),
      tensorboard=bool(log.tensorboard),
      plots=bool(log.plots),
      print_summary=bool(log.print_summary),
      compilation_cache_dir=_cache.compilation_cache_dir(config.get("compilation_cache_dir", "")),
    )
