"""experiments/compile_tpu.py --smoke: a tiny model's programs compile for v5e:2x2."""

import importlib.util
import pathlib

import pytest

_PATH = pathlib.Path(__file__).resolve().parents[2] / "experiments" / "compile_tpu.py"


@pytest.fixture(scope="module")
def compile_tpu():
  spec = importlib.util.spec_from_file_location("compile_tpu", _PATH)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_smoke_run_compiles_and_reports(compile_tpu, v5e_2x2):  # v5e_2x2: skips without libtpu
  config, load = compile_tpu.smoke_setup(compile_tpu.default_config())
  rows = compile_tpu.run(
    compile_tpu.PROGRAMS, ["tiny"], ["v5e:2x2"], config, load, log=lambda _: None
  )
  assert [(r.program, r.status, r.mesh) for r in rows] == [
    ("train_step", "ok", "2x2x1"),
    ("compute_logprobs", "ok", "2x2x1"),
  ]
  step, logprobs = rows
  assert step.memory["argument"] > 0 and step.memory["temp"] > 0
  assert step.memory["alias"] > 0  # the donated state
  assert logprobs.memory["alias"] == 0
  assert 0 < compile_tpu.in_use(step.memory) < step.capacity
  # The backward pass makes a train step ~3x the FLOPs of a forward over the same tokens.
  assert step.flops == pytest.approx(3 * logprobs.flops)
  assert step.bytes > logprobs.bytes > 0
  assert step.tokens_per_s == pytest.approx(load.rows * load.seq_len / step.roofline_s)
  table = compile_tpu.markdown(rows, load, config, "python experiments/compile_tpu.py --smoke")
  assert "| train_step | tiny | v5e:2x2 | 2x2x1 | ok |" in table
  assert "Rerun: `python experiments/compile_tpu.py --smoke`" in table
  assert "https://cloud.google.com/tpu/docs/v5e" in table


def test_workload_follows_the_gsm8k_config(compile_tpu):
  config = compile_tpu.default_config()
  load = compile_tpu.workload(config, prompt_len=256)
  assert load.rows == config.rl.prompts_per_iteration * config.rl.num_samples
  assert load.seq_len == 256 + config.task.gsm8k.max_answer_len
  mc = compile_tpu.model_config("qwen2.5-0.5b", config)
  assert (mc.num_layers, mc.hidden_size, mc.num_heads, mc.num_kv_heads, mc.head_dim) == (
    24, 896, 14, 2, 64,
  )  # fmt: skip
  assert mc.tie_embeddings and mc.param_dtype == "bfloat16"
  assert compile_tpu.model_config("qwen3-8b", config).qk_norm
  with pytest.raises(ValueError, match="Unknown model"):
    compile_tpu.model_config("gpt2", config)
