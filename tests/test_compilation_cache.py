"""`config.compilation_cache_dir` (or `$RLX_COMPILATION_CACHE_DIR`): JAX's compilation cache."""

import os
import subprocess
import sys
import textwrap

import pytest

from rlx import rl

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_cache_dir_comes_from_the_config_else_the_environment(monkeypatch, tmp_path):
  monkeypatch.delenv("RLX_COMPILATION_CACHE_DIR", raising=False)
  assert rl.get_config().compilation_cache_dir == ""
  assert rl.compilation_cache_dir("") == ""
  assert rl.compilation_cache_dir(str(tmp_path / "a")) == str(tmp_path / "a")
  monkeypatch.setenv("RLX_COMPILATION_CACHE_DIR", str(tmp_path / "env"))
  assert rl.compilation_cache_dir("") == str(tmp_path / "env")
  assert rl.compilation_cache_dir(str(tmp_path / "a")) == str(tmp_path / "a")  # config wins
  with pytest.raises(ValueError, match=r"config\.compilation_cache_dir"):
    rl.compilation_cache_dir(3)
  with pytest.raises(ValueError, match="path"):
    rl.enable_compilation_cache("")


def test_the_cache_dir_is_not_part_of_what_a_run_computes():

  assert "compilation_cache_dir" in rl.NOT_COMPARED


_PROGRAM = textwrap.dedent(
  """
  import logging, sys
  import jax, jax.numpy as jnp
  from rlx import rl
  jax.jit(jnp.sin)(1.0).block_until_ready()  # a compile before the cache is turned on
  rl.enable_compilation_cache(sys.argv[1])
  rl.enable_compilation_cache(sys.argv[1])  # again: a no-op
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  hits = []
  class Hits(logging.Handler):
    def emit(self, record):
      if "cache hit" in record.getMessage():
        hits.append(record.getMessage())
  log = logging.getLogger("jax._src.compiler")
  log.setLevel(logging.DEBUG)
  log.addHandler(Hits())
  @jax.jit
  def f(x):
    for _ in range(30):
      x = jnp.tanh(x @ x + 1.0)
    return x
  f(jnp.ones((4, 4))).block_until_ready()
  print("HITS", sum("jit_f" in h for h in hits))
  """
)


def test_a_second_process_reads_the_programs_the_first_compiled(tmp_path):
  cache = str(tmp_path / "cache")
  # Not the test session's cache (tests/conftest.py hands it to subprocesses).
  env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_")}
  env["JAX_PLATFORMS"] = "cpu"
  out = []
  for _ in range(2):
    proc = subprocess.run(
      [sys.executable, "-c", _PROGRAM, cache],
      capture_output=True,
      text=True,
      env=env,
      cwd=ROOT,
      timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out.append(proc.stdout.split("HITS")[-1].strip())
    assert any(name.startswith("jit_f-") for name in os.listdir(cache))
  assert out == ["0", "1"], out  # compiled and written, then read back
