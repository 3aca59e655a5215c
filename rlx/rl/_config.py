"""The RL run configuration: `get_config()` defaults and `validate_config`.

One `ml_collections.ConfigDict` describes a whole run (task, model, mesh,
sampler, train step, RL loop, supervised warm-up, evaluation, checkpoints,
logging). `experiments/configs/*.py` start from these defaults and the
command line overrides any field (`--config.rl.num_samples=4`).
"""

from typing import Any

import ml_collections

from rlx import objectives, train

BASELINES = ("grpo", "drgrpo", "rloo", "median")
ROLLOUTS = ("sync",)
# rollout.weight_dtype / rollout.kv_dtype choices (rlx.sampling.SamplerConfig's).
WEIGHT_DTYPES = ("auto", "fp8_e4m3", "fp8_e5m2")
KV_DTYPES = ("float32", "bfloat16", "auto", "fp8_e4m3", "fp8_e5m2")
FP8_DTYPES = ("fp8_e4m3", "fp8_e5m2")


def get_config() -> ml_collections.ConfigDict:
  """Default RL config: the tiny arithmetic task, GRPO, CPU-sized.

  Returns:
    A `ml_collections.ConfigDict`; every field is commented below.
  """
  c = ml_collections.ConfigDict()
  # Seed of everything: model init, data order, rollouts, train-step shuffles.
  c.seed = 0

  # --- task (rlx.tasks.make_task(name, **kwargs)) ---
  c.task = ml_collections.ConfigDict()
  c.task.name = "arithmetic"  # a key of rlx.tasks.TASKS
  c.task.kwargs = ml_collections.ConfigDict()  # passed to the task constructor

  # --- model ---
  c.model = ml_collections.ConfigDict()
  # Path of a Hugging Face checkpoint directory (config.json + safetensors);
  # "" = a freshly initialised rlx.policy.ModelConfig.small(...) with the
  # sizes below and the task tokenizer's vocabulary (needs the warm-up).
  c.model.hf_checkpoint = ""
  c.model.family = "qwen2"  # qwen2 | qwen3 | llama (fresh model only)
  c.model.hidden_size = 64
  c.model.num_layers = 2
  c.model.num_heads = 4
  c.model.num_kv_heads = 2
  c.model.head_dim = 16
  c.model.intermediate_size = 192
  # Parameter / activation dtypes ("float32" | "bfloat16").
  c.model.param_dtype = "float32"
  c.model.compute_dtype = "float32"

  # --- mesh (rlx.train.make_mesh); one of the sizes may be -1 = the rest ---
  c.mesh = ml_collections.ConfigDict()
  c.mesh.data = -1
  c.mesh.fsdp = 1
  c.mesh.tensor = 1
  # Use only the first `num_devices` devices (0 = all of jax.devices()).
  c.mesh.num_devices = 0

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
  # refresh runs inside the one compiled program (not timed separately).
  # (A config that still sets `sampler.kv_dtype` is read as this field.)
  c.rollout.kv_dtype = "float32"

  # --- the train step (rlx.train.get_config(); its fields, see there) ---
  c.train = train.get_config()
  c.train.loss = "ppo"  # any key of rlx.objectives.POLICY_LOSSES
  c.train.optimizer.learning_rate = 3e-4
  c.train.max_grad_norm = 1.0
  c.train.report_throughput = False  # timed by the loop instead

  # --- the RL loop ---
  c.rl = ml_collections.ConfigDict()
  c.rl.iterations = 200  # RL iterations (one rollout batch + train step each)
  c.rl.prompts_per_iteration = 64  # prompts (groups) per iteration
  # G: samples per prompt that carry gradient. The median baseline (MC-GRPO)
  # samples G + 1 and drops one pivot per group, so G must be even there.
  c.rl.num_samples = 8
  c.rl.baseline = "grpo"  # grpo | drgrpo | rloo | median
  # Sampling temperature of the rollouts, also the train step's temperature
  # (the trainer's log-probs use the same softmax the sampler sampled from).
  c.rl.temperature = 1.0
  c.rl.rollout = "sync"  # rollout engine: sync = Sampler.generate every iteration
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
  c.warmup.eval_every = 50  # warm-up steps between dev evaluations

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
  return c


def validate_config(config: ml_collections.ConfigDict) -> None:
  """Raises ValueError naming the first invalid field of an RL config."""
  rl = config.rl
  if config.train.loss not in objectives.POLICY_LOSSES:
    raise ValueError(
      f"`config.train.loss` must be one of {sorted(objectives.POLICY_LOSSES)}, "
      f"got {config.train.loss!r}."
    )
  _choice(rl.baseline, BASELINES, "config.rl.baseline")
  _choice(rl.rollout, ROLLOUTS, "config.rl.rollout")
  over = config.rollout.over_provision
  if isinstance(over, bool) or not isinstance(over, int | float) or not 1.0 <= over < float("inf"):
    raise ValueError(
      f"`config.rollout.over_provision` must be a finite number >= 1 (1 = synchronous), "
      f"got {over!r}."
    )
  _choice(config.rollout.weight_dtype, WEIGHT_DTYPES, "config.rollout.weight_dtype")
  kv_dtype(config)
  _choice(rl.reward, ("auto", "jax", "host"), "config.rl.reward")
  _choice(config.warmup.on_cap, ("raise", "warn"), "config.warmup.on_cap")
  g = rl.num_samples
  if not isinstance(g, int) or g < 1:
    raise ValueError(f"`config.rl.num_samples` must be an int >= 1, got {g!r}.")
  if rl.baseline in ("grpo", "drgrpo", "rloo") and g < 2:
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
  for name in ("max_steps", "batch_size", "eval_every"):
    value = config.warmup[name]
    if not isinstance(value, int) or value < 1:
      raise ValueError(f"`config.warmup.{name}` must be an int >= 1, got {value!r}.")
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
  train_cfg = train_config(config)
  train.validate_config(train_cfg)


def train_config(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """The `rlx.train` config of the run: `config.train` with the rollout temperature."""
  cfg = ml_collections.ConfigDict(config.train.to_dict())
  cfg.temperature = float(config.rl.temperature)
  return cfg


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


def _choice(value: Any, choices: tuple, name: str) -> None:
  if value not in choices:
    raise ValueError(f"`{name}` must be one of {choices}, got {value!r}.")
