"""The RL run configuration: `get_config()` defaults and `validate_config`.

One `ml_collections.ConfigDict` describes a whole run (task, model, mesh,
sampler, train step, RL loop, supervised warm-up, evaluation, checkpoints,
logging). `experiments/configs/*.py` start from these defaults and the
command line overrides any field (`--config.rl.num_samples=4`), including
keywords the config does not list yet in the free-form sections (a loss's
`--config.train.loss_kwargs.dual_clip=3.0`, a task's
`--config.task.kwargs.size=10`): `validate_config` checks them against the
function they feed, and names any other unknown field with its closest valid
one. User code (a registered loss or task) comes in through `config.imports`.
"""

import difflib
import importlib
import importlib.util
import inspect
import os
import sys
from typing import Any

import ml_collections

from rlx import _choices, objectives, tasks, train
from rlx.rl import _advantages, _cache, _staleness

BASELINES = _advantages.BASELINES
# config.rl.reward: "auto" = the task's JAX reward when it has one, else the host reward.
REWARD_MODES = ("auto", "jax", "host")
# Sections whose keys are free-form: keyword arguments of a function, checked
# against its signature. `task.<name>` sections (one per task) are free-form too.
FREE_FORM = (
  "train.loss_kwargs",
  "train.bapo_kwargs",
  "train.m2po_kwargs",
  "train.rollout_correction_kwargs",
  "task.kwargs",
)
# Fields compared when a workdir is resumed: all but these (they change how a
# run is shown, or where user code lives, not what it computes).
NOT_COMPARED = ("log.", "imports", "warmup.init_from", "compilation_cache_dir")
# rollout.weight_dtype / rollout.kv_dtype choices (rlx.sampling.SamplerConfig's).
WEIGHT_DTYPES = _choices.WEIGHT_DTYPES
OLD_LOGP_MODES = ("current", "behaviour", "sampler", "ewma")
KV_DTYPES = _choices.KV_DTYPE_NAMES  # "auto": the model's compute dtype
FP8_DTYPES = tuple(_choices.FP8_DTYPES)
KV_SCALE_MODES = _choices.KV_SCALE_MODES


def get_config() -> ml_collections.ConfigDict:
  """Default RL config: the tiny arithmetic task, GRPO, CPU-sized.

  Returns:
    A `ml_collections.ConfigDict`; every field is commented where it is set
    (here and in the `_add_*` section builders below).
  """
  c = ml_collections.ConfigDict()
  # Seed of everything: model init, data order, rollouts, train-step shuffles.
  c.seed = 0
  # User code imported before the config is validated, so that its
  # rlx.objectives.register_policy_loss / rlx.tasks.register_task calls count:
  # comma-separated module names (importable, e.g. "mypkg.losses") or paths of
  # .py files (e.g. "my_loss.py", relative to the working directory).
  c.imports = ""
  # JAX's persistent compilation cache: a directory where compiled programs
  # are kept, so re-running an experiment (another seed, a resumed run, the
  # next grid point of a sweep) loads them instead of compiling again
  # (tracing still runs). "" = $RLX_COMPILATION_CACHE_DIR when set, else off.
  # It never changes results, so a workdir's config check ignores it.
  c.compilation_cache_dir = ""

  _add_task_model_and_rollout(c)
  _add_train_and_rl(c)
  _add_async(c)
  _add_warmup_eval_and_outputs(c)
  return c


def _add_task_model_and_rollout(c: ml_collections.ConfigDict) -> None:
  """`get_config`'s task, model, mesh, sampler and rollout sections."""
  # --- task (rlx.tasks.make_task(name, **task_kwargs(config))) ---
  c.task = ml_collections.ConfigDict()
  c.task.name = "arithmetic"  # a key of rlx.tasks.TASKS
  # Keyword arguments of the task's factory: those of the section named after
  # the task (`config.task.arithmetic`, `config.task.<your task>`), updated by
  # `config.task.kwargs`. A config file for one task fills its own section, so
  # choosing another task (--config.task.name=...) passes it none of them.
  c.task.kwargs = ml_collections.ConfigDict()
  c.task.arithmetic = ml_collections.ConfigDict()  # rlx.tasks.ArithmeticTask keywords
  c.task.gsm8k = ml_collections.ConfigDict()  # rlx.tasks.GSM8KTask keywords

  # --- model ---
  c.model = ml_collections.ConfigDict()
  # Path of a Hugging Face checkpoint directory (config.json + safetensors);
  # "" = a freshly initialised rlx.policy.ModelConfig.small(...) with the
  # sizes below and the task tokenizer's vocabulary (needs the warm-up).
  c.model.hf_checkpoint = ""
  # Architecture of the fresh model; with `hf_checkpoint` it comes from the
  # checkpoint's config.json and these must stay at their defaults.
  c.model.family = "qwen2"  # qwen2 | qwen3 | llama
  c.model.hidden_size = 64
  c.model.num_layers = 2
  c.model.num_heads = 4
  c.model.num_kv_heads = 2
  c.model.head_dim = 16
  c.model.intermediate_size = 192
  # Parameter / activation dtypes ("float32" | "bfloat16"); an HF checkpoint's
  # weights are converted to `param_dtype` on load.
  c.model.param_dtype = "float32"
  c.model.compute_dtype = "float32"
  # Recompute each decoder block's activations in the backward pass
  # (`jax.checkpoint`): less activation memory for one more forward.
  c.model.remat = False

  # --- mesh (rlx.train.make_mesh); one of the sizes may be -1 = the rest ---
  c.mesh = ml_collections.ConfigDict()
  c.mesh.data = -1
  c.mesh.fsdp = 1
  c.mesh.tensor = 1
  # Use only the first `num_devices` devices (0 = all of jax.devices()).
  c.mesh.num_devices = 0
  # With rl.async_rollout: the last `rollout_devices` of those devices sample
  # (their own mesh, data-parallel), the rest train (mesh.data / fsdp / tensor
  # over them). 0 = both sides share every device.
  c.mesh.rollout_devices = 0

  # --- sampler (rlx.sampling.SamplerConfig; the temperature is rl.temperature) ---
  c.sampler = ml_collections.ConfigDict()
  c.sampler.max_slots = 0  # concurrent sequences; 0 = one slot per rollout row
  c.sampler.page_size = 8  # tokens per KV page
  c.sampler.num_pages = 0  # page pool size; 0 = enough for every slot at full length
  c.sampler.max_new_tokens = 0  # 0 = the task's max_answer_len
  c.sampler.top_k = 0  # 0 = no top-k truncation
  c.sampler.top_p = 1.0  # 1.0 = no nucleus truncation
  c.sampler.steps_per_sync = 16  # decode steps per device loop between host syncs

  # --- rollouts ---
  c.rollout = ml_collections.ConfigDict()
  # Partial rollouts (APRIL, rlx.sampling.RolloutEngine): > 1 keeps
  # ceil(over_provision * prompts_per_iteration) groups in flight, stops each
  # collection once prompts_per_iteration groups are complete and resumes the
  # unfinished ones first next iteration with the newer policy (their tokens
  # keep the log-prob and version of the policy that sampled them; the buffer
  # is checkpointed). 1.0 = synchronous (Sampler.generate every iteration).
  # Partial rollouts run the host-driven iteration (rl.fused is ignored).
  c.rollout.over_provision = 1.0
  # FP8 rollout (rlx.sampling.SamplerConfig weight_dtype / kv_dtype). The
  # trainer, its log-probs (old_logp) and the greedy evaluation keep the
  # high-precision params; only the rollout sampler runs FP8.
  # weight_dtype: "auto" = the params as they are | "fp8_e4m3" | "fp8_e5m2":
  # every decoder linear runs W8A8 with 128x128 weight blocks (embeddings and
  # LM head stay high precision), re-quantized on device after every update
  # (rlx.sampling.quantize_params; params are traced, nothing recompiles).
  c.rollout.weight_dtype = "auto"
  # KV cache dtype of the rollout sampler: "float32" | "bfloat16" | "auto"
  # (the model's compute dtype) | "fp8_e4m3" | "fp8_e5m2". FP8 KV uses
  # per-layer, per-KV-head scales recalibrated after every update from the
  # trainer's own forward over the batch it just trained on
  # (rlx.sampling.calibrate_kv_scales, vLLM's headroom K 200 / V 100; before
  # the first update: over the first rl.prompts_per_iteration prompts of the
  # train split); they are checkpointed. The greedy evaluation uses "auto" instead of an FP8 dtype.
  # With FP8 on, the train step's mismatch_k1 / mismatch_k3 metrics are the
  # FP8-vs-high-precision log-prob mismatch (rollout_logp from the FP8
  # sampler vs the trainer's old_logp; plus staleness with partial rollouts),
  # and train.use_rollout_correction corrects it (e.g. token TIS). Each
  # refresh's cost is the metric time/refresh_s; in the fused rl_step the
  # refresh runs inside the one compiled program (not timed separately). With
  # rl.async_rollout the rollout thread refreshes instead (below).
  # (A config that still sets `sampler.kv_dtype` is read as this field.)
  c.rollout.kv_dtype = "float32"
  # How an FP8 KV cache is scaled: "static" = the calibrated per-layer, per-KV-head
  # scales above; "per_token" = each cached token's own scale per KV head
  # (amax / fp8 max, written with its K/V; no calibration, nothing checkpointed;
  # rlx.sampling.SamplerConfig.kv_scale_mode). Needs an FP8 rollout.kv_dtype.
  c.rollout.kv_scale_mode = "static"


def _add_train_and_rl(c: ml_collections.ConfigDict) -> None:
  """`get_config`'s train-step and RL-loop sections."""
  # --- the train step (rlx.train.get_config(); its fields, see there) ---
  c.train = train.get_config()
  # Open like the rest (command-line overrides may add keys); `validate_config`
  # names a field that is not one of rlx.train.get_config()'s.
  c.train.unlock()
  c.train.loss = "ppo"  # any key of rlx.objectives.POLICY_LOSSES
  c.train.optimizer.learning_rate = 3e-4
  c.train.max_grad_norm = 1.0
  c.train.report_throughput = False  # timed by the loop instead
  # The trainer's temperature: the train step's log-probs (logp, old_logp and
  # the KL reference's ref_logp) are log softmax(logits / train.temperature),
  # while the behaviour log-probs rollout_logp stay those the sampler sampled
  # from (at rl.temperature). 0 = rl.temperature: the trainer optimises the
  # distribution it sampled from. A different value trains the policy at
  # train.temperature on samples drawn at rl.temperature (as in scripts that
  # sample sharpened and train at T = 1); the PPO ratio old_logp -> logp is
  # then between trainer-temperature distributions, and the mismatch_k1 /
  # mismatch_k3 metrics include the temperature gap. With
  # train.use_rollout_correction the TIS/MIS weights exp(old_logp -
  # rollout_logp) correct the samples towards the trainer's distribution
  # (truncated, so the correction is partial when the temperatures differ a
  # lot); without it the update is the trainer-temperature policy gradient
  # evaluated on the sampler's draws (biased towards the sampler's modes).
  c.train.temperature = 0.0
  # Cosine decay length in optimizer updates; 0 = the run's total updates
  # (rl.iterations x train.ppo_epochs x train.mini_batches), so any run length
  # decays to its end. A number > 0 is used as given.
  c.train.optimizer.decay_steps = 0

  # --- the RL loop ---
  c.rl = ml_collections.ConfigDict()
  c.rl.iterations = 200  # RL iterations (one rollout batch + train step each)
  c.rl.prompts_per_iteration = 64  # prompts (groups) per iteration
  # G: samples per prompt that carry gradient. The median baseline (MC-GRPO)
  # samples G + 1 and drops one pivot per group, so G must be even there.
  c.rl.num_samples = 8
  # grpo | drgrpo | rloo | median | vcpo. "vcpo": VCPO's minimum-variance
  # off-policy baseline (https://arxiv.org/abs/2602.17616), the group's rewards
  # weighted by w_i^2 ||grad log pi(tau_i)||^2 (sequence IS weight to the
  # sampler, score-gradient norm at the learner's params), over the group's
  # reward std (rlx.rl.vcpo_row_advantages). Costs one backward pass per
  # response each iteration (plus a forward pass when rl.old_logp is not
  # "current"), vectorised over B / train.micro_batches rows at once: each of
  # those rows holds a full, gathered gradient on every device, so raise
  # train.micro_batches for a big model.
  c.rl.baseline = "grpo"
  # Sampling temperature of the rollouts; also the train step's unless
  # train.temperature is set.
  c.rl.temperature = 1.0
  # Run each iteration as ONE jitted function (rlx.rl.make_rl_step: sample ->
  # JAX reward -> advantages -> log-probs -> update) when the task has a JAX
  # reward and the batch fits the sampler's slots; otherwise host-driven.
  # FP8 rollout works in both (the fused step quantizes and recalibrates
  # inside its one program).
  c.rl.fused = True
  # Where rewards are computed: "auto" = on device with the task's jax_reward
  # when it has one, else on host; "jax" requires a jax_reward; "host" always
  # calls task.reward.
  c.rl.reward = "auto"
  # Stop early once the dev greedy accuracy reaches this (evaluated every
  # eval.every iterations); 0 = always run rl.iterations.
  c.rl.target_dev_accuracy = 0.0
  # Wall-clock budget of the RL phase in seconds (0 = none): stops after the
  # iteration that crosses it, with a warning; the summary records it.
  c.rl.max_time_s = 0.0
  # Controlled staleness (M2PO's definition, in optimizer updates): the batch
  # whose first update is u is sampled by the params of version u - k
  # (rlx.rl.RolloutParams). 0 = on-policy. A multiple of the updates of one
  # iteration (train.ppo_epochs x train.mini_batches). Staleness > 0 runs the
  # host-driven iteration (rl.fused is ignored).
  c.rl.staleness = 0
  # "fixed": a ring of the last k / M + 1 param versions, every batch exactly k
  # stale; "periodic": the rollout params are refreshed every k updates
  # (staleness 0, M, ..., k - M at a batch's first update).
  c.rl.staleness_mode = "fixed"
  # Where the held versions live: "device" | "host" (NumPy copies, put on the
  # mesh for each rollout; for a model whose ring does not fit on device).
  c.rl.staleness_ring = "device"
  # What the train step's old_logp (the PPO ratio's denominator, the policy
  # the clip is centred on) is computed with:
  #   "current"   the learner's params before the batch's first update (the
  #               proximal policy of decoupled PPO; the behaviour log-probs
  #               rollout_logp stay separate, for train.use_rollout_correction
  #               / use_m2po to weight or mask behaviour -> proximal);
  #   "behaviour" the params that sampled the batch (the held version),
  #               recomputed by the trainer: PPO's ratio to the behaviour
  #               policy, as in off-policy PPO on stale data; the same as
  #               "current" at staleness 0. Not with partial rollouts, whose
  #               rows mix versions;
  #   "sampler"   the sampler's recorded rollout_logp (the behaviour policy
  #               as sampled, FP8 / sampler numerics included; needs no
  #               forward pass);
  #   "ewma"      PPO-EWMA's proximal policy (Hilton et al. 2021,
  #               https://arxiv.org/abs/2110.00641): an exponentially
  #               weighted average of the learner's params, decay
  #               rl.ewma_decay per iteration (rlx.rl.ProximalEwma; held by the
  #               loop and checkpointed). Pair it with
  #               train.use_rollout_correction for the behaviour weight.
  c.rl.old_logp = "current"
  # beta of rl.old_logp = "ewma", in (0, 1): params j iterations back weigh
  # beta^j (0.9: a centre of mass about 9 iterations back, rlx's choice).
  c.rl.ewma_decay = 0.9


def _add_async(c: ml_collections.ConfigDict) -> None:
  """`get_config`'s asynchronous-rollout fields (in `c.rl`)."""
  # Asynchronous rollout (rlx.rl.AsyncRollout; AReaL / PipelineRL): a thread
  # samples with the latest published params into a queue of at most
  # rl.async_queue_size batches while the learner trains, and the learner
  # publishes its params after every update. A batch's staleness then depends
  # on timing (the run is not bit-reproducible). With rl.old_logp = "current"
  # the objective is decoupled PPO: the clip is centred on the learner's
  # params before the update (proximal), and train.use_rollout_correction
  # weights behaviour -> proximal with the sampler's rollout_logp. With
  # rollout.over_provision > 1 (partial rollouts) the weights are updated in
  # flight: samples being generated continue with each newly published version.
  # FP8 rollout runs in the rollout thread: each version's params are
  # quantized as it takes them (in flight too), and the static KV scales are
  # recalibrated before a collection that starts with a newer version, over
  # its last batch (async/kv_refreshes, async/kv_refresh_s; the quantization
  # is part of the rollout's time).
  # With rl.old_logp = "behaviour" each queued batch keeps the params version
  # that sampled it, copied back to the train mesh for its old_logp (not with
  # partial rollouts, whose batches mix versions). Not with rl.staleness (the
  # lag is the thread's).
  c.rl.async_rollout = False
  c.rl.async_queue_size = 1
  # The most optimizer updates a batch may lag at its first update under
  # rl.async_rollout (0 = no bound); an older batch is dropped or kept as
  # rl.stale_batches says, and counted (async/dropped_total, async/stale_kept_total).
  c.rl.max_staleness = 0
  c.rl.stale_batches = "drop"  # drop | keep


def _add_warmup_eval_and_outputs(c: ml_collections.ConfigDict) -> None:
  """`get_config`'s warm-up, evaluation, checkpoint and logging sections."""
  # --- supervised warm-up (cross-entropy on the task's gold completions) ---
  c.warmup = ml_collections.ConfigDict()
  c.warmup.enabled = True  # the tiny model has no pretrained weights
  # Stop as soon as the dev greedy accuracy reaches this threshold.
  c.warmup.target_dev_accuracy = 0.3
  # Safety cap: if the threshold is not reached in this many steps the run
  # stops with an error (or warns and continues if warmup.on_cap == "warn").
  c.warmup.max_steps = 3000
  c.warmup.on_cap = "raise"  # raise | warn
  c.warmup.batch_size = 64  # sequences per warm-up step
  c.warmup.learning_rate = 3e-3
  # Global-norm gradient clipping of the warm-up's AdamW steps (a finite
  # number >= 0; 0 = no clipping), as `train.max_grad_norm` for the RL steps.
  c.warmup.max_grad_norm = 1.0
  c.warmup.eval_every = 50  # warm-up steps between dev evaluations
  # Reuse the warm-up of another run instead of training one: a workdir (its
  # warmup/ checkpoint) or a warm-up checkpoint directory. Its warm-up config
  # (seed, task, model, mesh, sampler, warm-up and evaluation sizes) must equal
  # this run's (`warmup_key`). "" = train (or resume) this run's own warm-up.
  # rlx.rl.run_sweep sets it for the runs of a grid that share a warm-up.
  c.warmup.init_from = ""

  # --- evaluation (greedy accuracy, exact-match reward) ---
  c.eval = ml_collections.ConfigDict()
  c.eval.every = 10  # RL iterations between dev evaluations (0 = never)
  c.eval.dev_examples = 256  # dev examples per evaluation (0 = the whole split)
  c.eval.test_examples = 1000  # held-out test examples before / after (0 = all)

  # --- checkpoints (orbax, in workdir/checkpoints) ---
  c.checkpoint = ml_collections.ConfigDict()
  c.checkpoint.every = 25  # RL iterations between checkpoints (the last is always saved)
  c.checkpoint.max_to_keep = 2

  # --- what the user sees ---
  c.log = ml_collections.ConfigDict()
  c.log.progress_bar = True  # tqdm bar: iteration, reward, accuracy, tokens/s
  c.log.tensorboard = True  # TensorBoard event files in workdir/tensorboard
  c.log.plots = True  # PNG plots in workdir/plots at the end
  c.log.print_summary = True  # before/after table on stdout at the end


def validate_config(config: ml_collections.ConfigDict) -> None:
  """Raises ValueError naming the first invalid field of an RL config.

  Imports `config.imports` first (user code that registers losses and tasks),
  then checks that every field is one of `get_config()`'s (an unknown one is
  named with its closest valid field), every value, the task's keyword
  arguments against its factory and the loss's against its signature.
  """
  import_user_code(config)
  check_fields(config)
  _cache.compilation_cache_dir(config.get("compilation_cache_dir", ""))
  rl = config.rl
  if not isinstance(config.model.remat, bool):
    raise ValueError(f"`config.model.remat` must be a bool, got {config.model.remat!r}.")
  if config.train.loss not in objectives.POLICY_LOSSES:
    raise ValueError(
      f"`config.train.loss` must be one of {sorted(objectives.POLICY_LOSSES)} (register a "
      "loss with rlx.objectives.register_policy_loss in a module named by `config.imports`), "
      f"got {config.train.loss!r}."
    )
  _choice(rl.baseline, BASELINES, "config.rl.baseline")
  over = config.rollout.over_provision
  if isinstance(over, bool) or not isinstance(over, int | float) or not 1.0 <= over < float("inf"):
    raise ValueError(
      f"`config.rollout.over_provision` must be a finite number >= 1 (1 = synchronous), "
      f"got {over!r}."
    )
  _choice(config.rollout.weight_dtype, WEIGHT_DTYPES, "config.rollout.weight_dtype")
  kv_dtype(config)
  _choice(config.rollout.kv_scale_mode, KV_SCALE_MODES, "config.rollout.kv_scale_mode")
  if config.rollout.kv_scale_mode == "per_token" and kv_dtype(config) not in FP8_DTYPES:
    raise ValueError(
      "`config.rollout.kv_scale_mode`='per_token' needs an FP8 `config.rollout.kv_dtype` "
      f"({sorted(FP8_DTYPES)}), got {kv_dtype(config)!r}."
    )
  _choice(rl.reward, REWARD_MODES, "config.rl.reward")
  _choice(rl.old_logp, OLD_LOGP_MODES, "config.rl.old_logp")
  _choice(rl.staleness_ring, _staleness.RING_PLACES, "config.rl.staleness_ring")
  d = rl.ewma_decay
  if isinstance(d, bool) or not isinstance(d, int | float) or not 0.0 < d < 1.0:
    raise ValueError(f"`config.rl.ewma_decay` must be a number in (0, 1), got {d!r}.")
  if rl.old_logp == "behaviour" and over > 1.0:
    raise ValueError(
      "`config.rl.old_logp`='behaviour' needs one params version per batch; partial rollouts "
      "(`config.rollout.over_provision` > 1) mix versions within a row. Use 'sampler' (the "
      "recorded per-token behaviour log-probs) or 'current'."
    )
  if rl.old_logp == "sampler":
    for name in ("use_rollout_correction", "use_m2po", "use_vcpo"):
      if config.train.get(name) is True:
        raise ValueError(
          f"`config.train.{name}` compares old_logp with the sampler's rollout_logp, which "
          "`config.rl.old_logp`='sampler' makes the same arrays: it would do nothing. Use "
          "'current' (decoupled PPO: weight behaviour -> proximal) or 'behaviour'."
        )
  _choice(config.warmup.on_cap, ("raise", "warn"), "config.warmup.on_cap")
  g = rl.num_samples
  if not isinstance(g, int) or g < 1:
    raise ValueError(f"`config.rl.num_samples` must be an int >= 1, got {g!r}.")
  if rl.baseline in ("grpo", "drgrpo", "rloo", "vcpo") and g < 2:
    raise ValueError(
      f"`config.rl.num_samples` must be >= 2 for the {rl.baseline!r} baseline (a group "
      f"baseline needs at least two samples per prompt), got {g}."
    )
  if rl.baseline == "median" and (g < 2 or g % 2):
    raise ValueError(
      "`config.rl.num_samples` must be even and >= 2 for the 'median' baseline: MC-GRPO "
      f"samples G + 1 (odd) rollouts per prompt and drops the median pivot, got G = {g}."
    )
  for name in ("iterations", "prompts_per_iteration"):
    value = rl[name]
    if not isinstance(value, int) or value < 1:
      raise ValueError(f"`config.rl.{name}` must be an int >= 1, got {value!r}.")
  if not rl.temperature > 0:
    raise ValueError(
      f"`config.rl.temperature` must be > 0 for RL rollouts, got {rl.temperature!r}."
    )
  if not (isinstance(config.train.temperature, (int, float)) and config.train.temperature >= 0):
    raise ValueError(
      "`config.train.temperature` must be a number >= 0 (0 = the rollout's rl.temperature), "
      f"got {config.train.temperature!r}."
    )
  for name in ("max_steps", "batch_size", "eval_every"):
    value = config.warmup[name]
    if not isinstance(value, int) or value < 1:
      raise ValueError(f"`config.warmup.{name}` must be an int >= 1, got {value!r}.")
  clip = config.warmup.max_grad_norm
  if isinstance(clip, bool) or not isinstance(clip, int | float) or not 0 <= clip < float("inf"):
    raise ValueError(
      f"`config.warmup.max_grad_norm` must be a finite number >= 0 (0 = no clipping), got {clip!r}."
    )
  for name in ("target_dev_accuracy",):
    for section in ("warmup", "rl"):
      value = config[section][name]
      if not 0.0 <= value <= 1.0:
        raise ValueError(f"`config.{section}.{name}` must be in [0, 1], got {value!r}.")
  for name in ("every", "dev_examples", "test_examples"):
    if config.eval[name] < 0:
      raise ValueError(f"`config.eval.{name}` must be >= 0, got {config.eval[name]!r}.")
  if config.checkpoint.every < 1:
    raise ValueError(f"`config.checkpoint.every` must be >= 1, got {config.checkpoint.every!r}.")
  _check_task_kwargs(config)
  check_loss_kwarg_types(config)
  train_cfg = train_config(config)
  try:
    train.validate_config(train_cfg)
  except ValueError as e:  # name the field as this config has it
    raise ValueError(str(e).replace("`config.", "`config.train.")) from None
  _staleness.check_staleness(rl.staleness, rl.staleness_mode, train.updates_per_step(train_cfg))
  _check_async(config)


def _check_async(config: ml_collections.ConfigDict) -> None:
  """Raises ValueError naming an invalid asynchronous-rollout setting or combination."""
  rl = config.rl
  if not isinstance(rl.async_rollout, bool):
    raise ValueError(f"`config.rl.async_rollout` must be a bool, got {rl.async_rollout!r}.")
  for name in ("async_queue_size", "max_staleness"):
    value = rl[name]
    least = 1 if name == "async_queue_size" else 0
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
      raise ValueError(f"`config.rl.{name}` must be an int >= {least}, got {value!r}.")
  _choice(rl.stale_batches, ("drop", "keep"), "config.rl.stale_batches")
  n = config.mesh.rollout_devices
  if isinstance(n, bool) or not isinstance(n, int) or n < 0:
    raise ValueError(f"`config.mesh.rollout_devices` must be an int >= 0, got {n!r}.")
  if n and not rl.async_rollout:
    raise ValueError(
      "`config.mesh.rollout_devices` > 0 splits the devices for asynchronous rollout; set "
      "`config.rl.async_rollout = True` (or leave it at 0)."
    )
  if not rl.async_rollout:
    return
  unsupported = {
    "`config.rl.staleness` > 0 (controlled staleness)": rl.staleness > 0,
  }
  for what, bad in unsupported.items():
    if bad:
      raise ValueError(f"`config.rl.async_rollout` does not support {what} yet.")


def train_config(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """The `rlx.train` config of the run: `config.train` with its temperature resolved.

  `train.temperature = 0` becomes `rl.temperature` (the trainer's softmax is
  the sampler's).

  `optimizer.decay_steps = 0` becomes the run's total optimizer updates
  (`rl.iterations x ppo_epochs x mini_batches`; at least `warmup_steps + 1`,
  so a run shorter than the LR warm-up still has a valid schedule).
  """
  cfg = ml_collections.ConfigDict(config.train.to_dict())
  cfg.temperature = float(config.train.temperature or config.rl.temperature)
  if not cfg.optimizer.decay_steps:
    total = int(config.rl.iterations) * train.updates_per_step(cfg)
    cfg.optimizer.decay_steps = max(total, int(cfg.optimizer.warmup_steps) + 1)
  return cfg


def task_kwargs(config: ml_collections.ConfigDict) -> dict[str, Any]:
  """The task factory's keyword arguments: `config.task.<name>` updated by `task.kwargs`."""
  name = config.task.name
  own = config.task[name] if name in config.task and name not in ("name", "kwargs") else None
  out = _plain(own)
  out.update(_plain(config.task.kwargs))
  return out


def _plain(section: Any) -> dict[str, Any]:
  if section is None:
    return {}
  return section.to_dict() if isinstance(section, ml_collections.ConfigDict) else dict(section)


def make_task(config: ml_collections.ConfigDict) -> Any:
  """Builds the run's task: `rlx.tasks.make_task(config.task.name, **task_kwargs(config))`."""
  return tasks.make_task(config.task.name, **task_kwargs(config))


def import_user_code(config: ml_collections.ConfigDict) -> list[Any]:
  """Imports the modules and .py files of `config.imports` (once each); returns them.

  A module name is imported with `importlib.import_module`; a path ending in
  `.py` is loaded as a module named after the file (a file imported before
  by the same path is not re-executed, so its registrations happen once).

  Raises:
    ValueError: naming the entry that cannot be found or fails to import.
  """
  value = config.get("imports", "")
  if isinstance(value, list | tuple):
    entries = [str(v).strip() for v in value]
  elif isinstance(value, str):
    entries = [v.strip() for v in value.split(",")]
  else:
    raise ValueError(
      f"`config.imports` must be a comma-separated str of modules / .py paths, got {value!r}."
    )
  modules = []
  for entry in filter(None, entries):
    try:
      modules.append(_import(entry))
    except Exception as e:
      if isinstance(e, ValueError) and str(e).startswith("`config.imports`"):
        raise
      raise ValueError(
        f"`config.imports`: importing {entry!r} failed: {type(e).__name__}: {e}"
      ) from e
  return modules


def _import(entry: str) -> Any:
  if not entry.endswith(".py"):
    return importlib.import_module(entry)
  path = os.path.abspath(os.path.expanduser(entry))
  if not os.path.isfile(path):
    raise ValueError(f"`config.imports`: {entry!r} is not a file (looked at {path}).")
  for module in list(sys.modules.values()):
    if getattr(module, "__file__", None) == path:
      return module
  name = "rlx_user_" + os.path.splitext(os.path.basename(path))[0].replace("-", "_")
  if os.path.dirname(path) not in sys.path:  # as for a script: its siblings import
    sys.path.insert(0, os.path.dirname(path))
  spec = importlib.util.spec_from_file_location(name, path)
  module = importlib.util.module_from_spec(spec)
  sys.modules[name] = module
  try:
    spec.loader.exec_module(module)
  except BaseException:
    del sys.modules[name]
    raise
  return module


def check_fields(config: ml_collections.ConfigDict) -> None:
  """Every field of `config` is one of `get_config()`'s; the free-form sections excepted.

  Raises:
    ValueError: naming an unknown field and the closest valid one, or a
      section that is missing.
  """
  _check_section(config, get_config(), "")


def _check_section(config: Any, defaults: ml_collections.ConfigDict, prefix: str) -> None:
  if not isinstance(config, ml_collections.ConfigDict | dict):
    raise ValueError(f"`config.{prefix[:-1]}` must be a config section, got {config!r}.")
  for key in config.keys():
    path = prefix + key
    if path in FREE_FORM or (prefix == "task." and key != "name"):
      continue  # keyword arguments, checked against their function
    if path == "sampler.kv_dtype":
      continue  # read as rollout.kv_dtype (see kv_dtype)
    if key not in defaults:
      close = difflib.get_close_matches(key, list(defaults.keys()), n=1, cutoff=0.6)
      hint = (
        f"did you mean `config.{prefix}{close[0]}`?"
        if close
        else f"the fields here are {sorted(defaults.keys())}."
      )
      raise ValueError(f"`config.{path}` is not a config field; {hint}")
    if isinstance(defaults[key], ml_collections.ConfigDict):
      _check_section(config[key], defaults[key], path + ".")
  for key in defaults.keys():
    if key not in config and prefix + key not in FREE_FORM and prefix != "task.":
      raise ValueError(f"`config.{prefix + key}` is missing (build configs from get_config()).")


def check_loss_kwarg_types(config: ml_collections.ConfigDict) -> None:
  """Each `train.loss_kwargs` value has the kind of its keyword's default in the loss.

  A keyword whose default is a number takes a real number (not a bool or a
  str), one whose default is a bool takes a bool, one whose default is a str
  takes a str; a default of None accepts anything (the loss checks it). So a
  command-line typo such as `--config.train.loss_kwargs.clip=abc` is named
  here, not deep inside the first compiled step.

  Raises:
    ValueError: naming the keyword, its value and the expected kind.
  """
  if config.train.loss not in objectives.POLICY_LOSS_SPECS:
    return  # named by validate_config
  fn = objectives.get_policy_loss_spec(config.train.loss).fn
  params = inspect.signature(fn).parameters
  for key, value in _plain(config.train.loss_kwargs).items():
    if key not in params:
      continue  # an unknown keyword: named by the train config's check
    default = params[key].default
    if default is None or default is inspect.Parameter.empty:
      continue
    if isinstance(default, bool):
      ok, kind = isinstance(value, bool), "a bool"
    elif isinstance(default, int | float):
      ok = isinstance(value, int | float) and not isinstance(value, bool)
      kind = "a real number"
    elif isinstance(default, str):
      ok, kind = isinstance(value, str), "a str"
    else:
      continue
    if not ok:
      raise ValueError(
        f"`config.train.loss_kwargs.{key}` must be {kind} (the default of {fn.__name__}'s "
        f"`{key}` is {default!r}), got {value!r}."
      )


def loss_kwargs_with_defaults(config: ml_collections.ConfigDict) -> dict[str, Any]:
  """`train.loss_kwargs` with the loss's own defaults filled in (what the loss is called with)."""
  out = {}
  if config.train.loss in objectives.POLICY_LOSS_SPECS:
    spec = objectives.get_policy_loss_spec(config.train.loss)
    params = inspect.signature(spec.fn).parameters
    out = {k: params[k].default for k in spec.hyperparameters()}
  out.update(_plain(config.train.loss_kwargs))
  return out


def _check_task_kwargs(config: ml_collections.ConfigDict) -> None:
  """The task's keyword arguments against its registered factory's signature."""
  name = config.task.name
  if name not in tasks.TASKS:
    raise ValueError(
      f"`config.task.name` must be one of {sorted(tasks.TASKS)} (register a task with "
      f"rlx.tasks.register_task in a module named by `config.imports`), got {name!r}."
    )
  factory = tasks.TASKS[name]
  try:
    params = inspect.signature(factory).parameters.values()
  except (TypeError, ValueError):
    return  # no signature to check against (a builtin): the factory checks its arguments
  if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
    return
  allowed = sorted(
    p.name
    for p in params
    if p.kind in (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
  )
  unknown = sorted(set(task_kwargs(config)) - set(allowed))
  if unknown:
    where = "`config.task.kwargs`"
    if name in config.task and name not in ("name", "kwargs"):
      where += f" / `config.task.{name}`"
    raise ValueError(f"{where}: unknown keywords {unknown}; task {name!r} takes {allowed}.")


def kv_dtype(config: ml_collections.ConfigDict) -> str:
  """The rollout KV dtype: `config.rollout.kv_dtype` (or a legacy `config.sampler.kv_dtype`).

  Raises:
    ValueError: an unknown dtype, or both fields set to different values.
  """
  value = config.rollout.kv_dtype
  legacy = config.sampler.get("kv_dtype") if "kv_dtype" in config.sampler else None
  if legacy is not None and legacy != value:
    if value != "float32":
      raise ValueError(
        f"`config.sampler.kv_dtype`={legacy!r} and `config.rollout.kv_dtype`={value!r} "
        "disagree; the KV dtype is `config.rollout.kv_dtype` (remove the sampler field)."
      )
    value = legacy
  _choice(value, KV_DTYPES, "config.rollout.kv_dtype")
  return str(value)


def fp8_rollout(config: ml_collections.ConfigDict) -> bool:
  """Whether the rollout sampler runs FP8 weights or an FP8 KV cache."""
  return config.rollout.weight_dtype in FP8_DTYPES or kv_dtype(config) in FP8_DTYPES


def samples_per_prompt(config: ml_collections.ConfigDict) -> int:
  """Rollouts sampled per prompt: G, or G + 1 for the median baseline."""
  g = int(config.rl.num_samples)
  return g + 1 if config.rl.baseline == "median" else g


_choice = _choices.check_choice
