r"""GSM8K-format math with Qwen2.5-1.5B-Instruct on a TPU v5e-8 slice (v5e:2x4, 16 GiB per chip).

  python experiments/train_rl.py --config=experiments/configs/gsm8k_v5e.py \
      --workdir=/tmp/rlx_gsm8k_v5e \
      --config.model.hf_checkpoint=/path/to/Qwen2.5-1.5B-Instruct \
      --config.task.gsm8k.tokenizer=/path/to/Qwen2.5-1.5B-Instruct \
      --config.task.gsm8k.train_path=/path/to/gsm8k/train.jsonl \
      --config.task.gsm8k.test_path=/path/to/gsm8k/test.jsonl

experiments/configs/gsm8k_hf.py's settings (bfloat16, 64 prompts x 8 samples of
up to 512 answer tokens, 8 micro-batches, 2 mini-batches, a 256-slot sampler
with 10,240 pages of 16 tokens, bf16 KV) on 8 chips as data 2 x fsdp 4, with a
1.5B model. Compiled for v5e:2x4 by the real TPU compiler without chips, with
256-token prompts (experiments/results/compile_tpu.md; rerun:
`python experiments/compile_tpu.py --config=experiments/configs/gsm8k_v5e.py
--models=qwen2.5-1.5b --topologies=v5e:2x4`): the train step holds 14.9 of
16 GiB per chip, the sampler's prefill / decode about 10 GiB. The fused RL step
(`rl.fused = True`, every row in a slot at once) does not fit this slice; this
config keeps the host-driven loop.
"""

import importlib.util
import os

# The model shapes (experiments/compile_tpu.py's HF_CONFIGS) and the TPU topology this
# config was compiled for.
COMPILED_FOR = {"model": "qwen2.5-1.5b", "topology": "v5e:2x4"}


def _base():
  path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gsm8k_hf.py")
  spec = importlib.util.spec_from_file_location("gsm8k_hf_base", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config()


def get_config():
  c = _base()
  c.mesh.data = 2  # 8 chips: 2 x 4
  c.mesh.fsdp = 4
  c.mesh.tensor = 1
  c.rl.fused = False  # the fused step needs every row in a slot: out of HBM on v5e:2x4
  return c
