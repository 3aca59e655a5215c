r"""GSM8K-format math with Qwen2.5-7B-Instruct on a TPU v5p-8 slice (v5p:2x2x1, 95 GiB per chip).

  python experiments/train_rl.py --config=experiments/configs/gsm8k_7b_v5p.py \
      --workdir=/tmp/rlx_gsm8k_7b \
      --config.model.hf_checkpoint=/path/to/Qwen2.5-7B-Instruct \
      --config.task.gsm8k.tokenizer=/path/to/Qwen2.5-7B-Instruct \
      --config.task.gsm8k.train_path=/path/to/gsm8k/train.jsonl \
      --config.task.gsm8k.test_path=/path/to/gsm8k/test.jsonl

experiments/configs/gsm8k_hf.py's settings (bfloat16, 64 prompts x 8 samples of
up to 512 answer tokens, 8 micro-batches, 2 mini-batches, a 256-slot sampler
with 10,240 pages of 16 tokens, bf16 KV) on the slice's 4 chips as fsdp 4,
with a 7B model. Compiled for v5p:2x2x1 by the real TPU compiler without
chips, with 256-token prompts (experiments/results/compile_tpu.md; rerun:
`python experiments/compile_tpu.py --config=experiments/configs/gsm8k_7b_v5p.py
--models=qwen2.5-7b --topologies=v5p:2x2x1`): the train step holds 67.2 of
95 GiB per chip, the sampler's prefill / decode about 23 GiB. The 7B train
step does not fit a v5e or v6e slice of 4 or 8 chips at these settings.
"""

import importlib.util
import os

# The model shapes (experiments/compile_tpu.py's HF_CONFIGS) and the TPU topology this
# config was compiled for.
COMPILED_FOR = {"model": "qwen2.5-7b", "topology": "v5p:2x2x1"}


def _base():
  path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gsm8k_hf.py")
  spec = importlib.util.spec_from_file_location("gsm8k_hf_base", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config()


def get_config():
  c = _base()
  c.mesh.data = 1  # 4 chips, all FSDP: the 7B state sharded 4 ways
  c.mesh.fsdp = 4
  c.mesh.tensor = 1
  return c
