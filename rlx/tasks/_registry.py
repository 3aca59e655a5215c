"""Name -> task factory registry (`make_task("arithmetic", num_digits=3)`)."""

import types
from collections.abc import Callable, Mapping

from rlx.tasks._base import Task

_FACTORIES: dict[str, Callable[..., Task]] = {}

TASKS: Mapping[str, Callable[..., Task]] = types.MappingProxyType(_FACTORIES)
"""Read-only view: task name -> factory `(**kwargs) -> Task`."""


def register_task(name: str, factory: Callable[..., Task], *, overwrite: bool = False) -> None:
  """Adds `factory` to `TASKS` under `name` (so configs can name a custom task).

  Args:
    name: the registry key.
    factory: a callable `(**kwargs) -> Task`, e.g. a `Task` subclass.
    overwrite: replace an existing entry instead of raising.
  """
  if not isinstance(name, str) or not name:
    raise ValueError(f"Task name must be a non-empty str, got {name!r}.")
  if not callable(factory):
    raise ValueError(f"Task {name!r}: factory must be callable, got {type(factory).__name__}.")
  if name in _FACTORIES and not overwrite:
    raise ValueError(f"Task {name!r} is already registered; pass overwrite=True to replace it.")
  _FACTORIES[name] = factory


def make_task(name: str, **kwargs) -> Task:
  """Builds the registered task `name` with `kwargs`; unknown names list `TASKS`."""
  if not isinstance(name, str) or name not in _FACTORIES:
    raise ValueError(f"Unknown task {name!r}; registered tasks: {sorted(_FACTORIES)}.")
  task = _FACTORIES[name](**kwargs)
  if not isinstance(task, Task):
    raise ValueError(
      f"Task {name!r}: its factory returned {type(task).__name__}, not a rlx.tasks.Task."
    )
  return task
