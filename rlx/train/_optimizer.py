"""The optax optimizer and learning-rate schedule of a train config."""

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
  opt = config.optimizer
  lr = float(opt.learning_rate)
  warmup = int(opt.warmup_steps)
  if opt.schedule == "constant":
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
    decay_steps=int(opt.decay_steps),
    end_value=lr * float(opt.end_lr_ratio),
  )


def make_optimizer(config: ml_collections.ConfigDict) -> optax.GradientTransformation:
  """Global-norm clipping (if `max_grad_norm > 0`) followed by AdamW.

  Args:
    config: a train config (`get_config()`).

  Returns:
    The optax transformation applied once per mini-batch update.
  """
  opt = config.optimizer
  adamw = optax.adamw(
    make_schedule(config),
    b1=float(opt.b1),
    b2=float(opt.b2),
    eps=float(opt.eps),
    weight_decay=float(opt.weight_decay),
  )
  if config.max_grad_norm > 0:
    return optax.chain(optax.clip_by_global_norm(float(config.max_grad_norm)), adamw)
  return adamw
