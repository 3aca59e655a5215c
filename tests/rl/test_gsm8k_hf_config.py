"""experiments/configs/gsm8k_hf.py end to end on a tiny random HF checkpoint and JSONL data.

The config a GPU/TPU user runs (HF checkpoint in bfloat16, GSM8K-format data,
chat template, host reward, 2 x 4 data/FSDP mesh, token TIS, micro- and
mini-batches) runs here unchanged except for its sizes: a random Qwen2
checkpoint written by `transformers`, the test's tokenizer, 8 fake CPU devices.
"""

import importlib.util
import json
import math
import os
import shutil

import jax
import numpy as np
import pytest
import torch
import transformers

from rlx import rl, train

_CONFIG_PATH = os.path.join(
  os.path.dirname(__file__), "..", "..", "experiments", "configs", "gsm8k_hf.py"
)
RECORDS = [
  {"question": f"Tom has {a} apples and buys {b} more. How many apples?", "answer": f"#### {a + b}"}
  for a, b in [(3, 4), (5, 1), (2, 2), (7, 8), (6, 3), (9, 1), (4, 4), (8, 2)]
]


def _load_config():
  spec = importlib.util.spec_from_file_location("gsm8k_hf_config", _CONFIG_PATH)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, hf_tokenizer_dir):
  """A random Qwen2 checkpoint with the test tokenizer in the same directory."""
  directory = tmp_path_factory.mktemp("qwen2_gsm8k")
  vocab = json.loads((hf_tokenizer_dir / "tokenizer.json").read_text())["model"]["vocab"]
  hf_config = transformers.Qwen2Config(
    vocab_size=len(vocab),
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    tie_word_embeddings=False,
  )
  torch.manual_seed(0)
  transformers.Qwen2ForCausalLM(hf_config).save_pretrained(directory)
  for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
    shutil.copy(hf_tokenizer_dir / name, directory / name)
  data = tmp_path_factory.mktemp("gsm8k_data")
  for split, records in (("train", RECORDS[:6]), ("test", RECORDS[6:])):
    (data / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
  return directory, data


def test_gsm8k_hf_config_runs_on_a_mesh(checkpoint, tmp_path):
  directory, data = checkpoint
  c = _load_config()
  # Only paths and sizes change; mesh, dtypes, loss, correction and batching are the config's.
  c.model.hf_checkpoint = str(directory)
  c.task.kwargs.tokenizer = str(directory)
  c.task.kwargs.train_path = str(data / "train.jsonl")
  c.task.kwargs.test_path = str(data / "test.jsonl")
  c.task.kwargs.dev_size = 2
  c.task.kwargs.max_answer_len = 8
  c.sampler.max_slots = 32
  c.sampler.num_pages = 32 * 8
  c.sampler.steps_per_sync = 4
  # 4 prompts x G = 8: 2 mini-batches x 2 micro-batches of 8 rows, one per device.
  c.rl.prompts_per_iteration = 4
  c.rl.iterations = 2
  c.train.micro_batches = 2
  c.eval.every = 2
  c.eval.dev_examples = 2  # fewer than the 8 devices: eval slots round up
  c.checkpoint.every = 1
  c.log.progress_bar = False
  c.log.print_summary = False
  c.log.plots = False
  # A random checkpoint rarely answers right, so every group can have zero advantage and
  # a zero policy gradient: a small entropy bonus gives the updates a reward-free
  # gradient, so the check that they moved the params does not hang on a lucky sample.
  c.train.entropy_coef = 0.01
  summary = rl.run(c, str(tmp_path))
  assert summary["iterations"] == 2 and summary["task"] == "gsm8k"
  # The config's bfloat16 params are what trained, and the two updates moved them.
  task = rl.make_task(c)
  model_config, initial = rl.build_model(c, task)
  assert {str(x.dtype) for x in jax.tree.leaves(initial)} == {"bfloat16"}
  abstract = train.abstract_train_state(model_config, rl.train_config(c), rl.build_mesh(c))
  with train.Checkpointer(tmp_path / "checkpoints") as ckpt:
    final = ckpt.restore(abstract).state
  assert int(train.to_host(final.step)) == 2
  leaves = [np.asarray(x, np.float32) for x in jax.tree.leaves(train.to_host(final.params))]
  assert {str(x.dtype) for x in jax.tree.leaves(final.params)} == {"bfloat16"}
  moved = [
    np.abs(a - np.asarray(b, np.float32)).max()
    for a, b in zip(leaves, jax.tree.leaves(initial), strict=True)
  ]
  assert max(moved) > 0, "the two updates left every parameter unchanged"
  rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
  steps = [r for r in rows if r.get("phase") == "rl"]
  assert [r["iteration"] for r in steps] == [1, 2]
  for r in steps:
    assert r["tokens"] > 0 and math.isfinite(r["loss"]) and r["grad_norm"] > 0
    # A bfloat16 model samples and scores in bfloat16: the mismatch is measured, not zero.
    assert np.isfinite(r["mismatch_k3"])
  assert os.listdir(tmp_path / "checkpoints")
