"""experiments/compile_tpu.py --smoke: a tiny model's programs compile for v5e:2x2.

One module-wide run of every program (train step, log-probs, score norms, the sampler's prefill and
decode on bf16 / FP8 KV pages and with FP8 linears, the FP8 matmul, the fused RL step),
then checks of its statuses, donation and kernels.
"""

import importlib.util
import pathlib

import numpy as np
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
  # VCPO's per-row score-gradient norms: one forward and backward per row, nothing donated.
  norms = rows["score_norms"]
  assert (norms.status, norms.memory["alias"]) == ("ok", 0)
  assert norms.flops == pytest.approx(3 * logprobs.flops)
  assert norms.bytes == pytest.approx(2 * logprobs.bytes)
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
  # FP8 rollout inside the fused step: the W8A8 matmul kernels besides the attention's.
  fp8 = rows["rl_step_fp8"]
  assert fp8.status == "ok", fp8.status
  assert fp8.mosaic > fused.mosaic and fp8.donated == step.donated
  assert "float8_e4m3fn" in fp8.note and fp8.bytes < fused.bytes


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


def test_out_of_memory_row_gives_the_compilers_line_and_rlx_advice(compile_tpu, v5e_2x2):
  config, load = compile_tpu.smoke_setup(compile_tpu.default_config())
  config.sampler.num_pages = 2**21  # a K/V pool of 2M pages: more than a v5e chip holds
  (row,) = compile_tpu.compile_one("decode", "tiny", "v5e:2x2", config, load)
  assert row.status.startswith("out of memory: JaxRuntimeError: RESOURCE_EXHAUSTED"), row.status
  assert row.memory == {}
  assert any(line.startswith("sampler.num_pages (now 2097152 pages") for line in row.advice)
  assert any("rollout.kv_dtype = 'fp8_e4m3'" in line for line in row.advice)
  table = compile_tpu.markdown([row], load, config, "cmd")
  assert "rlx.train.OutOfMemoryError" in table and "- decode tiny v5e:2x2:" in table


def test_largest_fitting_finds_the_boundary_of_a_linear_memory():
  spec = importlib.util.spec_from_file_location("compile_tpu_search", _PATH)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  capacity = 100.0
  for base, slope, start in ((10.0, 3.0, 4), (50.0, 0.5, 200), (1.0, 7.0, 1), (90.0, 20.0, 3)):
    tried = []

    def probe(n, base=base, slope=slope, tried=tried):
      tried.append(n)
      use = base + slope * n
      return None if use > 1.2 * capacity else use  # far over: the compiler refuses it

    lo, hi = module.largest_fitting(probe, start, capacity, max_probes=12)
    largest = int((capacity - base) // slope)
    assert (lo, hi) == ((largest, largest + 1) if largest >= 1 else (None, 1)), (base, slope)
    assert len(tried) <= 7, tried
  # Nothing fits: (None, 1); every probe fits within the budget: (largest tried, None).
  assert module.largest_fitting(lambda n: None, 8, capacity, 10) == (None, 1)
  lo, hi = module.largest_fitting(lambda n: 1.0, 2, capacity, 3)
  assert hi is None and lo > 2


def test_search_finds_the_largest_page_pool(compile_tpu, v5e_2x2):
  config, load = compile_tpu.smoke_setup(compile_tpu.default_config())
  config.sampler.num_pages = 512
  r = compile_tpu.search_largest("decode", "tiny", "v5e:2x2", config, load, max_probes=4)
  assert (r.size, r.configured, len(r.probes)) == ("num_pages", 512, 4)
  assert r.largest >= 512 and r.smallest_failing > r.largest
  assert r.largest % compile_tpu.POOL_GRANULE == 0
  assert compile_tpu.in_use(r.largest_memory) <= r.capacity
  table = compile_tpu.search_markdown([r], config, "cmd")
  assert f"| decode | tiny | v5e:2x2 | 2x2x1 | num_pages | 512 | {r.largest} |" in table


_CONFIGS = pathlib.Path(__file__).resolve().parents[2] / "experiments" / "configs"


@pytest.mark.parametrize("name", ["gsm8k_v5e", "gsm8k_7b_v5p"])
def test_tpu_configs_name_the_slice_they_were_compiled_for(compile_tpu, name):
  spec = importlib.util.spec_from_file_location(name, _CONFIGS / f"{name}.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  model, topology = module.COMPILED_FOR["model"], module.COMPILED_FOR["topology"]
  assert model in compile_tpu.HF_CONFIGS and topology.split(":")[0] in compile_tpu.CHIPS
  config = module.get_config()
  chips = int(np.prod([int(d) for d in topology.split(":")[1].split("x")]))
  assert config.mesh.data * config.mesh.fsdp * config.mesh.tensor == chips
  assert topology in module.__doc__
  rerun = f"--config=experiments/configs/{name}.py\n--models={model} --topologies={topology}"
  assert rerun in module.__doc__
  results = (_PATH.parent / "results" / "compile_tpu.md").read_text()
  assert f"--config=experiments/configs/{name}.py --models={model} --topologies={topology}" in (
    results
  )


def test_per_token_kv_scale_programs_donate_the_scale_pools(compile_tpu, smoke_rows):
  """`_fp8tok`: the f32 per-token scale pools (4 bytes per token, KV head and layer, for K
  and V) are donated with the FP8 pages, and decode runs the Mosaic attention kernel."""
  config, _, rows = smoke_rows
  mc = compile_tpu.model_config("tiny", config)
  for name in ("decode", "prefill"):
    tok, static = rows[name + "_fp8tok"], rows[name + "_fp8kv"]
    assert tok.status == "ok", tok.status
    assert tok.donated * mc.head_dim == static.donated * (mc.head_dim + 4)
  assert rows["decode_fp8tok"].mosaic >= 1


def test_async_split_compiles_each_side_on_its_own_chips(compile_tpu, v5e_2x2):
  """--rollout_chips: the sampler on the last chips (data-parallel), training on the rest."""
  config, load = compile_tpu.smoke_setup(compile_tpu.default_config())
  split = compile_tpu.split_compile_fn(2)
  rows = compile_tpu.run(
    ["train_step", "decode", "rl_step"], ["tiny"], ["v5e:2x2"], config, load,
    log=lambda _: None, compile_fn=split,
  )  # fmt: skip
  by = {r.program: r for r in rows}
  assert set(by) == {"train_step", "decode"}  # the fused step needs one mesh
  assert (by["train_step"].topology, by["train_step"].mesh) == ("v5e:2x2 train 2/4", "1x2x1")
  assert (by["decode"].topology, by["decode"].mesh) == ("v5e:2x2 rollout 2/4", "2x1x1")
  assert all(r.status == "ok" and 0 < compile_tpu.in_use(r.memory) < r.capacity for r in rows)
  with pytest.raises(compile_tpu.app.UsageError, match="must leave chips to both sides"):
    compile_tpu.split_compile_fn(4)("decode", "tiny", "v5e:2x2", config, load)
