"""experiments/compile_cuda.py: deviceless CUDA compiles of rlx's programs (no GPU needed).

The target-config tests run everywhere; the compile tests need the CUDA PJRT plugin
and `ptxas` (`pip install -e ".[cuda-compile]"`: jax-cuda12-plugin 0.10.2 and the
`nvidia-cuda-nvcc-cu12` wheel; or a CUDA toolkit), and skip without them (CI installs
only the dev and tpu extras). One
module-wide `--smoke` run compiles every program of a tiny model on 2 H200.
"""

import importlib.util
import pathlib
import shutil

import pytest

_PATH = pathlib.Path(__file__).resolve().parents[2] / "experiments" / "compile_cuda.py"


@pytest.fixture(scope="module")
def compile_cuda():
  spec = importlib.util.spec_from_file_location("compile_cuda", _PATH)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def _ptxas_missing() -> bool:
  """No `ptxas` where XLA looks: the nvcc wheel, the PATH, /usr/local/cuda."""
  places = [pathlib.Path("/usr/local/cuda/bin/ptxas")]
  if importlib.util.find_spec("nvidia") is not None:
    wheel = importlib.util.find_spec("nvidia.cuda_nvcc")
    locations = (wheel.submodule_search_locations or []) if wheel else []
    places += [pathlib.Path(p) / "bin" / "ptxas" for p in locations]
  return shutil.which("ptxas") is None and not any(p.exists() for p in places)


@pytest.fixture(scope="module")
def cuda(compile_cuda):
  if reason := compile_cuda.cuda_plugin_missing():
    pytest.skip(f"deviceless CUDA compiles need the plugin: {reason}")
  if _ptxas_missing():
    pytest.skip("no ptxas: pip install nvidia-cuda-nvcc-cu12 (or a CUDA toolkit on the PATH)")
  return compile_cuda


def test_h200_target_config_is_the_h100_one_with_its_memory(compile_cuda):
  h100, h200 = (compile_cuda.target_config(g).splitlines() for g in ("h100", "h200"))
  changed = {
    (a.split(":")[0].strip(), b.split(":")[1].strip())
    for a, b in zip(h100, h200, strict=True)
    if a != b
  }
  assert changed == {
    ("device_memory_size", "141000000000"),
    ("memory_bandwidth", "4800000000000"),
    ("name", '"NVIDIA H200 141GB HBM3e"'),
    ("device_description_str", '"NVIDIA H200 141GB HBM3e"'),
  }
  assert "feature_extension: ACCELERATED_FEATURES" in "\n".join(h200)  # sm_90a
  assert compile_cuda.parse_gpus("h200:8") == ("h200", 8)
  with pytest.raises(ValueError, match="want <gpu>:<count>"):
    compile_cuda.parse_gpus("a100:8")


def test_topology_has_compile_only_h200s(cuda):
  devices = cuda.gpu_devices("h200:8")
  assert len(devices) == 8
  assert {d.device_kind for d in devices} == {"NVIDIA H200 141GB HBM3e"}
  assert {d.platform for d in devices} == {"gpu"}  # jax's name for the CUDA platform


@pytest.fixture(scope="module")
def smoke_rows(cuda):
  config, load, gpus = cuda.smoke_setup(cuda.compile_tpu.default_config())
  rows = cuda.run(cuda.PROGRAMS, ["tiny"], gpus, config, load, log=lambda _: None)
  return config, load, {r.program: r for r in rows}


def test_smoke_run_compiles_every_program(cuda, smoke_rows):
  config, load, rows = smoke_rows
  assert {r.program: r.status for r in rows.values()} == dict.fromkeys(rows, "ok")
  assert {r.mesh for r in rows.values()} == {"1x2x1"}
  step, logprobs = rows["train_step"], rows["compute_logprobs"]
  assert step.memory["argument"] > 0 and step.memory["temp"] > 0
  assert step.donated <= step.memory["alias"]  # the train state updated in place
  assert logprobs.memory["alias"] == 0
  assert 0 < cuda.compile_tpu.in_use(step.memory) < step.capacity
  assert step.flops == pytest.approx(3 * logprobs.flops)
  table = cuda.markdown(
    list(rows.values()), load, config, "python experiments/compile_cuda.py --smoke"
  )
  assert "| decode_fp8 | tiny | h200:2 | 1x2x1 | ok |" in table
  assert "https://www.nvidia.com/en-us/data-center/h200/" in table


def test_sampler_and_fp8_programs_use_the_triton_kernels(smoke_rows):
  _, _, rows = smoke_rows
  for kv in ("", "_fp8kv", "_fp8"):
    decode, prefill = rows["decode" + kv], rows["prefill" + kv]
    assert decode.donated == prefill.donated > 0  # the K/V page pool, donated ...
    assert decode.memory["alias"] == prefill.memory["alias"] == decode.donated  # ... and aliased
    assert decode.mosaic >= 1  # the paged-attention Triton kernel
  assert rows["decode"].donated == 2 * rows["decode_fp8kv"].donated  # FP8 pages: 1 byte
  # W8A8 linears: the Triton FP8 matmul beside the attention kernel.
  assert rows["decode_fp8"].mosaic > rows["decode_fp8kv"].mosaic
  assert rows["prefill_fp8"].mosaic > rows["prefill_fp8kv"].mosaic
  matmuls = [r for name, r in rows.items() if name.startswith("fp8_matmul ")]
  assert len(matmuls) == 3 and all(r.mosaic == 1 for r in matmuls)
  assert rows["rl_step"].mosaic >= 1 and rows["rl_step"].donated == rows["train_step"].donated


def test_per_token_kv_scale_programs_use_the_triton_kernel(smoke_rows):
  _, _, rows = smoke_rows
  decode, prefill = rows["decode_fp8tok"], rows["prefill_fp8tok"]
  assert decode.status == prefill.status == "ok"
  assert decode.donated == prefill.donated > rows["decode_fp8kv"].donated  # + the scale pools
  assert decode.memory["alias"] == decode.donated and decode.mosaic >= 1
