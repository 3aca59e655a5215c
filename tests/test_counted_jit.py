"""`rlx.counted_jit`: one count per traced program, the jitted function's signature kept."""

import collections
import inspect

import jax
import jax.numpy as jnp
import numpy as np

import rlx
from rlx import counted_jit


def test_public_and_documented():
  assert rlx.__all__ == ("counted_jit",)
  assert list(inspect.signature(counted_jit).parameters) == ["fun", "counts", "name", "jit_kwargs"]
  assert "counted_jit" in rlx.__doc__ and "Args:" in inspect.getdoc(counted_jit)


def test_counts_one_trace_per_signature_and_keeps_jit_arguments():
  counts = collections.Counter()

  def scale(x, factor, *, twice):
    return x * factor * (2 if twice else 1)

  f = counted_jit(scale, counts, "scale", static_argnames=("twice",), donate_argnums=(0,))
  for _ in range(3):
    np.testing.assert_array_equal(f(jnp.ones(3), 2.0, twice=False), 2 * np.ones(3))
  assert counts == {"scale": 1}  # new values, same program
  f(jnp.ones(3), 5.0, twice=True)  # a static argument: a new program
  f(jnp.ones((2, 2)), 2.0, twice=False)  # a new shape: a new program
  assert counts == {"scale": 3}
  f.lower(jnp.ones(4), 1.0, twice=False)  # lowering traces too (an AOT compile)
  assert counts == {"scale": 4}
  x = jnp.ones(3)
  f(x, 1.0, twice=False)
  assert x.is_deleted()  # donate_argnums reached jax.jit through the kept signature


def test_counters_are_per_name_and_shared_between_functions():
  counts = collections.Counter()
  f = counted_jit(jnp.sin, counts, "sin")
  g = counted_jit(jnp.cos, counts, "cos")
  f(jnp.ones(2))
  g(jnp.ones(2))
  g(jnp.ones(3))
  assert counts == {"sin": 1, "cos": 2}
  assert jax.jit(jnp.sin)(1.0) == f(1.0)
