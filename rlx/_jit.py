"""`rlx.counted_jit`: `jax.jit` that counts the programs it traces.

  counts = collections.Counter()
  step = rlx.counted_jit(step_fn, counts, "step", donate_argnums=(0,))
  ...                                  # calls, lowering
  assert counts["step"] == 1           # one program: nothing recompiled

`jax.jit(f)._cache_size()` reads the size of the function's C++ dispatch cache,
which is not a count of compiles: JAX keeps those caches in one LRU over all jitted
functions (8192 of them in jax 0.10), and once a process holds more, a new
function gets no entry at all and reads 0 however often it compiled (its calls
take the slower Python dispatch path instead). A long test session, a notebook or
an in-process sweep gets there. Counting traces instead does not depend on
that cache: JAX traces a function once per new abstract signature (shapes,
dtypes, static arguments), and each trace is a program it lowers and compiles
(or loads from the persistent compilation cache). Not counted: a compile
without a new trace, as when arguments of the same signature are committed
to other devices, and an ahead-of-time `.lower(...).compile()` of an
already traced signature. Imports nothing of rlx.
"""

import collections
import functools
from collections.abc import Callable
from typing import Any

import jax


def counted_jit(
  fun: Callable[..., Any], counts: collections.Counter, name: str, **jit_kwargs: Any
) -> Any:
  """`jax.jit(fun, **jit_kwargs)` that adds 1 to `counts[name]` each time it traces `fun`.

  JAX traces once per new abstract signature (shapes, dtypes, static
  arguments), and each trace is a program it compiles (or loads from the
  persistent compilation cache), so the count is the programs built, however
  many jitted functions the process holds (`jax.jit(f)._cache_size()` reads 0
  once they overflow JAX's dispatch-cache LRU). Not counted: a compile without
  a new trace (arguments of a traced signature committed to other devices, an
  ahead-of-time `.lower(...).compile()` of a traced signature).

  Args:
    fun: the function to jit (its signature is kept, so `static_argnames` and
      `donate_argnums` work as on `fun`).
    counts: the counter to update (shared by the caller's jitted functions).
    name: the key of this function's traces.
    **jit_kwargs: passed to `jax.jit`.

  Returns:
    The jitted function (`lower`, `trace`, `eval_shape` count as traces too).
  """

  @functools.wraps(fun)
  def traced(*args, **kwargs):
    counts[name] += 1
    return fun(*args, **kwargs)

  return jax.jit(traced, **jit_kwargs)
