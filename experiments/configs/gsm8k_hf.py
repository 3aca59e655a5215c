r"""GSM8K-format math with a Hugging Face checkpoint on a GPU node or TPU slice.

  python experiments/train_rl.py --config=experiments/configs/gsm8k_hf.py \
      --workdir=/tmp/rlx_gsm8k \
      --config.model.hf_checkpoint=/path/to/Qwen2.5-0.5B-Instruct \
      --config.task.gsm8k.tokenizer=/path/to/Qwen2.5-0.5B-Instruct \
      --config.task.gsm8k.train_path=/path/to/gsm8k/train.jsonl \
      --config.task.gsm8k.test_path=/path/to/gsm8k/test.jsonl

The checkpoint directory holds config.json, *.safetensors and the tokenizer;
the data files are JSONL or Parquet records with `question` / `answer` fields
(GSM8K's "#### 42" solutions). The reward is the task's numeric answer check
on the host (no warm-up: the model is pretrained).

Sized for Qwen2.5-0.5B on 8 accelerators (data 2 x fsdp 4). Compiled without chips
for TPU v5e:2x4 and v6e:2x4 (and v5e:2x2 / v5p:2x2x1 as fsdp 4) with 256-token
prompts, every program fits (experiments/results/compile_tpu.md; rerun:
`python experiments/compile_tpu.py --models=qwen2.5-0.5b --topologies=v5e:2x4`):
the train step holds 8.63 of 16 GiB per v5e chip, and on 1 or 8 H200
(experiments/results/compile_cuda.md) 106 / 10 GiB of 131. Larger models:
experiments/configs/gsm8k_v5e.py (1.5B), gsm8k_7b_v5p.py (7B).
"""

from rlx import rl


def get_config():
  c = rl.get_config()  # every field is documented in rlx/rl/_config.py
  c.seed = 0
  # Task: rlx.tasks.GSM8KTask; the tokenizer (and chat template) come from the checkpoint.
  c.task.name = "gsm8k"
  c.task.gsm8k.tokenizer = ""  # set to the checkpoint directory (same as model.hf_checkpoint)
  c.task.gsm8k.train_path = ""  # JSONL / Parquet
  c.task.gsm8k.test_path = ""  # held-out file (JSONL / Parquet)
  c.task.gsm8k.question_field = "question"
  c.task.gsm8k.answer_field = "answer"
  c.task.gsm8k.answer_format = "####"  # or "boxed"
  c.task.gsm8k.max_answer_len = 512  # completion token budget (= sampler max_new_tokens)
  c.task.gsm8k.format_reward = 0.0
  # Model: an HF checkpoint in bfloat16.
  c.model.hf_checkpoint = ""  # path of the checkpoint directory
  c.model.param_dtype = "bfloat16"
  c.model.compute_dtype = "bfloat16"
  # Mesh: 8 accelerators as 2-way data x 4-way FSDP (tensor parallel for big models).
  c.mesh.data = 2
  c.mesh.fsdp = 4
  c.mesh.tensor = 1
  c.mesh.num_devices = 0  # all devices
  # Sampler pool: 256 concurrent sequences, 16-token pages, bf16 KV cache.
  c.sampler.max_slots = 256
  c.sampler.page_size = 16
  c.sampler.num_pages = 256 * 40  # ~640 tokens per slot on average
  c.rollout.kv_dtype = "bfloat16"  # or "fp8_e4m3" (+ rollout.weight_dtype) for FP8 rollout
  c.sampler.steps_per_sync = 32
  # Loss, baseline, KL, rollout correction.
  c.train.loss = "ppo"
  # PPO's keywords: a different train.loss needs its own train.loss_kwargs.
  c.train.loss_kwargs.clip_low = 0.2
  c.train.loss_kwargs.clip_high = 0.28  # DAPO clip-higher
  c.train.agg = "token-mean"
  c.train.optimizer.learning_rate = 1e-6
  c.train.max_grad_norm = 1.0
  c.train.kl_coef = 0.0
  c.train.use_rollout_correction = True  # token TIS on the bf16-sampler vs trainer mismatch
  c.train.rollout_correction_kwargs.level = "token"  # token-level IS weights
  c.train.rollout_correction_kwargs.truncate = 2.0  # TIS: weights capped at 2
  c.train.micro_batches = 8  # gradient accumulation
  c.train.mini_batches = 2  # optimizer updates per rollout batch
  c.rl.baseline = "grpo"
  c.rl.num_samples = 8
  c.rl.prompts_per_iteration = 64
  c.rl.iterations = 500
  c.rl.temperature = 1.0
  c.rl.fused = False  # host reward (math checker) between the jitted sampler and step
  c.warmup.enabled = False  # pretrained
  c.eval.every = 25
  c.eval.dev_examples = 200
  c.eval.test_examples = 0  # the whole test split
  c.checkpoint.every = 25
  c.checkpoint.max_to_keep = 3
  return c
