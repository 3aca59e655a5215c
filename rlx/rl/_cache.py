"""JAX's persistent compilation cache for RL runs (`config.compilation_cache_dir`).

A re-run of an experiment (another seed, a resumed run, the next grid point of
a sweep with the same shapes) then loads the XLA executables its first run
compiled instead of compiling them again. Tracing and lowering still run; only
XLA's compile is skipped. See
https://docs.jax.dev/en/latest/persistent_compilation_cache.html.
"""

import os

import jax
from jax.experimental.compilation_cache import compilation_cache

ENV_VAR = "RLX_COMPILATION_CACHE_DIR"
# Programs that compile faster than this are not written (JAX's default is 1 s;
# the main job's programs compile in ~1-10 s on a CPU).
MIN_COMPILE_TIME_S = 0.5


def compilation_cache_dir(configured: str = "") -> str:
  """The cache directory a run uses: `configured`, else `$RLX_COMPILATION_CACHE_DIR`, else ''.

  Args:
    configured: `config.compilation_cache_dir` ('' = the environment variable).

  Returns:
    An absolute path, or '' when no cache is asked for.
  """
  if not isinstance(configured, str):
    raise ValueError(
      f"`config.compilation_cache_dir` must be a str (a directory, or '' for ${ENV_VAR}), "
      f"got {configured!r}."
    )
  path = configured or os.environ.get(ENV_VAR, "")
  return os.path.abspath(os.path.expanduser(path)) if path else ""


def enable_compilation_cache(path: str) -> None:
  """Turns on JAX's persistent compilation cache in `path` (created) for this process.

  Safe to call after other programs have compiled (the cache is re-initialised
  when its directory changes) and again with the same path (nothing happens).

  Args:
    path: the cache directory; programs compiled in >= `MIN_COMPILE_TIME_S`
      are written there and read back by later processes on the same machine,
      JAX version and backend.
  """
  if not path:
    raise ValueError("enable_compilation_cache: `path` must be a non-empty directory path.")
  path = os.path.abspath(os.path.expanduser(path))
  if jax.config.jax_compilation_cache_dir == path:
    return
  os.makedirs(path, exist_ok=True)
  jax.config.update("jax_compilation_cache_dir", path)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_TIME_S)
  # A compile before this call initialised the cache as off: start it again.
  compilation_cache.reset_cache()
