"""The optax optimizer and learning-rate schedule of a train config.

The schedule is a function of the optimizer-update counter; the train step
logs `schedule(n)` with n computed from its own `TrainState` (see
`update_counter`), so the reported learning rate does not depend on how the
optimizer chain names or nests its internal counters.
"""

from collections.abc import Mapping
from typing import Any

import jax
import ml_collections
import optax

from rlx.train import _config


def make_schedule(config: ml_collections.ConfigDict) -> optax.Schedule:
  """Learning-rate schedule over optimizer updates.

  "constant": lr·min(1, (n+1)/warmup) — linear warmup, then constant.
  "warmup_cosine": linear warmup from 0 to lr over `warmup_steps`, then
  cosine decay to `end_lr_ratio·lr` at `decay_steps` (optax
  `warmup_cosine_decay_schedule`).

  Args:
    config: a train config (`get_config()`), its `optimizer` section is read.

  Returns:
    An optax schedule `n -> lr` (n = optimizer update count).
  """
  _config.validate_config(config)
  return schedule_of(config.optimizer)


def make_optimizer(config: ml_collections.ConfigDict) -> optax.GradientTransformation:
  """Global-norm clipping (if `max_grad_norm > 0`) followed by AdamW.

  Args:
    config: a train config (`get_config()`).

  Returns:
    The optax transformation applied once per mini-batch update.
  """
  _config.validate_config(config)
  return optimizer_of(config.optimizer, float(config.max_grad_norm))


def schedule_of(opt: Mapping[str, Any]) -> optax.Schedule:
  """`make_schedule` of a validated `optimizer` section (a ConfigDict or a `StepSpec.optimizer`)."""
  lr = float(opt["learning_rate"])
  warmup = int(opt["warmup_steps"])
  if opt["schedule"] == "constant":
    if warmup == 0:
      return optax.constant_schedule(lr)
    return optax.join_schedules(
      [optax.linear_schedule(lr / warmup, lr, warmup - 1), optax.constant_schedule(lr)],
      [warmup],
    )
  return optax.warmup_cosine_decay_schedule(
    init_value=0.0,
    peak_value=lr,
    warmup_steps=warmup,
    decay_steps=int(opt["decay_steps"]),
    end_value=lr * float(opt["end_lr_ratio"]),
  )


def optimizer_of(opt: Mapping[str, Any], max_grad_norm: float) -> optax.GradientTransformation:
  """`make_optimizer` of a validated `optimizer` section and `max_grad_norm` (0 = no clipping)."""
  adamw = optax.adamw(
    schedule_of(opt),
    b1=float(opt["b1"]),
    b2=float(opt["b2"]),
    eps=float(opt["eps"]),
    weight_decay=float(opt["weight_decay"]),
  )
  if max_grad_norm > 0:
    return optax.chain(optax.clip_by_global_norm(float(max_grad_norm)), adamw)
  return adamw


def updates_per_step(config: ml_collections.ConfigDict) -> int:
  """Optimizer updates in one train step: `ppo_epochs * mini_batches`."""
  return int(config.ppo_epochs) * int(config.mini_batches)


def update_counter(step: jax.Array, update_index: jax.Array, skipped: jax.Array, per_step: int):
  """Optimizer updates applied before update `update_index` of train step `step`.

    n = step * per_step + update_index - skipped

  A skipped (non-finite) update keeps the optimizer state, so it does not
  advance the optimizer's own schedule counter; `skipped` is the number of
  updates skipped before this one (`TrainState.skipped` plus those of this
  step so far). For a state from `create_train_state` (fresh optimizer) n is
  the count at which `make_schedule(config)` is evaluated by the optimizer.

  Args:
    step: i32[] `TrainState.step` of the running step.
    update_index: i32[] index of the update within the step, in [0, per_step).
    skipped: i32[] updates skipped before this one.
    per_step: `updates_per_step(config)`.

  Returns:
    i32[] the update counter n.
  """
  return step * per_step + update_index - skipped
