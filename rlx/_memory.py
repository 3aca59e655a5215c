"""Out-of-device-memory errors that say which settings to change.

XLA reports a program that does not fit a chip as a `jax.errors.JaxRuntimeError`
whose message starts with RESOURCE_EXHAUSTED: at compile time (e.g. "Ran out of
memory on HBM, the total memory required for HLO temporaries (45.03G) exceeds
available HBM (31.25G)" from the TPU compiler) or when a buffer cannot be
allocated at run time. `explain_out_of_memory` turns it into an
`OutOfMemoryError` that keeps the compiler's line and lists the settings that
lower the program's memory, with their current values; every other error
passes through unchanged.
"""

import contextlib
from collections.abc import Callable, Iterator, Sequence

import jax

# Markers of XLA's out-of-memory statuses (compile-time HBM checks and allocation failures).
_MARKERS = ("RESOURCE_EXHAUSTED", "Out of memory", "out of memory", "Ran out of memory")


class OutOfMemoryError(MemoryError):
  """A program does not fit in device memory; the message lists what to change.

  Attributes:
    program: the program that did not fit (e.g. "train_step").
    advice: the settings that lower its memory, one line each.
  """

  def __init__(self, message: str, program: str, advice: tuple[str, ...]):
    super().__init__(message)
    self.program = program
    self.advice = advice


def is_out_of_memory(error: BaseException) -> bool:
  """Whether `error` is XLA's out-of-memory status (at compile or at run time)."""
  return isinstance(error, jax.errors.JaxRuntimeError) and any(
    marker in str(error) for marker in _MARKERS
  )


def compiler_line(error: BaseException) -> str:
  """The line of `error`'s message that states the shortage (else its first line)."""
  lines = [line.strip() for line in str(error).splitlines() if line.strip()]
  return next(
    (line for line in lines if any(m in line for m in _MARKERS)), lines[0] if lines else ""
  )


def out_of_memory_error(
  error: BaseException, program: str, advice: Sequence[str]
) -> OutOfMemoryError:
  """An `OutOfMemoryError` for `program`, quoting `error` and listing `advice`."""
  advice = tuple(advice)
  lines = [f"{program} does not fit in device memory: {compiler_line(error)}"]
  if advice:
    lines.append("To lower its memory, change one of:")
    lines += [f"  - {line}" for line in advice]
  return OutOfMemoryError("\n".join(lines), program, advice)


@contextlib.contextmanager
def explain_out_of_memory(
  program: str, advice: Sequence[str] | Callable[[], Sequence[str]]
) -> Iterator[None]:
  """Re-raises XLA's out-of-memory error inside the block as an `OutOfMemoryError`.

  `advice` (or a callable giving it, evaluated only on an error) lists the
  settings to change; the original error is chained as `__cause__`.
  """
  try:
    yield
  except jax.errors.JaxRuntimeError as e:
    if not is_out_of_memory(e):
      raise
    lines = advice() if callable(advice) else advice
    raise out_of_memory_error(e, program, lines) from e
