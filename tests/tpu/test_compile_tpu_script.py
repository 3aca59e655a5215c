"""experiments/compile_tpu.py --smoke: a tiny model's programs compile for v5e:2x2.

One module-wide run of every program (train step, log-probs, the sampler's prefill and
decode on bf16 / FP8 KV pages and with FP8 linears, the FP8 matmul, the fused RL step),
then checks of its statuses, donation and kernels.
"""

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


@pytest.fixture(scope="module")
def smoke_rows(compile_tpu, v5e_2x2):  # v5e_2x2: skips without libtpu
  config, load = compile_tpu.smoke_setup(compile_tpu.default_config())
  rows = compile_tpu.run(
    compile_tpu.PROGRAMS, ["tiny"], ["v5e:2x2"], config, load, log=lambda _: None
  )
  return config, load, {r.program: r for r in rows}


def test_smoke_run_compiles_and_reports(compile_tpu, smoke_rows):
  config, load, rows = smoke_rows
  assert {(r.status, r.mesh) for r in rows.values()} >= {("ok", "2x2x1")}
  step, logprobs = rows["train_step"], rows["compute_logprobs"]
  assert (step.status, logprobs.status) == ("ok", "ok")
  assert step.memory["argument"] > 0 and step.memory["temp"] > 0
  assert step.memory["alias"] > 0  # the donated state
  assert logprobs.memory["alias"] == 0
  assert 0 < compile_tpu.in_use(step.memory) < step.capacity
  # The backward pass makes a train step ~3x the FLOPs of a forward over the same tokens.
  assert step.flops == pytest.approx(3 * logprobs.flops)
  assert step.bytes > logprobs.bytes > 0
  assert step.tokens_per_s == pytest.approx(load.rows * load.seq_len / step.roofline_s)
  table = compile_tpu.markdown(
    list(rows.values()), load, config, "python experiments/compile_tpu.py --smoke"
  )
  assert "| train_step | tiny | v5e:2x2 | 2x2x1 | ok |" in table
  assert "| decode_fp8kv | tiny | v5e:2x2 | 2x2x1 | ok |" in table
  assert "Rerun: `python experiments/compile_tpu.py --smoke`" in table
  assert "https://cloud.google.com/tpu/docs/v5e" in table


def _padded_pool(row, compile_tpu, config) -> int:
  """The pool's per-chip bytes with head_dim padded to TPU's 128 lanes."""
  mc = compile_tpu.model_config("tiny", config)
  return row.donated * (-(-mc.head_dim // 128) * 128) // mc.head_dim


@pytest.mark.parametrize("kv", ["", "_fp8kv"])
def test_sampler_programs_update_the_page_pool_in_place(compile_tpu, smoke_rows, kv):
  config, _, rows = smoke_rows
  decode, prefill = rows["decode" + kv], rows["prefill" + kv]
  assert (decode.status, prefill.status) == ("ok", "ok")
  # The donated K/V pools are the aliased bytes (both programs return the pool in place).
  pool = _padded_pool(decode, compile_tpu, config)
  assert decode.donated == prefill.donated > 0
  assert decode.memory["alias"] == prefill.memory["alias"] == pool
  assert 2 * decode.donated == rows["decode"].donated * (1 if kv else 2)  # FP8 pages: 1 byte
  assert decode.mosaic >= 1  # the paged-attention Mosaic kernel, under the sampler's shard_map
  assert prefill.mosaic == 0  # prefill attention is XLA math
  # A decode step makes one token per slot.
  assert decode.tokens_per_s == pytest.approx(config.sampler.max_slots / decode.roofline_s)


def test_fp8_rollout_programs_compile_with_the_fp8_matmul_kernel(compile_tpu, smoke_rows):
  # W8A8 linears: the Mosaic FP8 matmul runs per chip in a shard_map (XLA cannot partition
  # a Mosaic call on activations sharded over the mesh), beside the paged attention.
  config, _, rows = smoke_rows
  for name in ("decode", "prefill"):
    fp8, fp8kv = rows[name + "_fp8"], rows[name + "_fp8kv"]
    assert fp8.status == "ok", fp8.status
    assert fp8.mosaic > fp8kv.mosaic  # the matmul kernels besides the attention's
    assert fp8.donated == fp8kv.donated > 0  # the same FP8 page pool
    assert fp8.memory["alias"] == _padded_pool(fp8, compile_tpu, config)


def test_fp8_matmul_and_fused_step_compile(compile_tpu, smoke_rows):
  config, load, rows = smoke_rows
  matmuls = [r for name, r in rows.items() if name.startswith("fp8_matmul ")]
  assert [r.program for r in matmuls] == [
    "fp8_matmul q/k/v/o",
    "fp8_matmul gate/up",
    "fp8_matmul down",
  ]
  for r in matmuls:
    assert r.status == "ok" and r.mosaic == 1 and r.memory["alias"] == 0
    assert r.memory["output"] >= 2 * 2 * 128  # this chip's 2 rows of bf16 outputs
  fused, step = rows["rl_step"], rows["train_step"]
  assert fused.status == "ok" and fused.mosaic >= 1  # the sampler's paged attention inside
  assert fused.donated == step.donated > 0  # the train state
  assert fused.donated <= fused.memory["alias"] <= 1.01 * fused.donated  # tiles pad a few
  assert fused.flops > step.flops + rows["compute_logprobs"].flops


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
