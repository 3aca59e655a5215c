"""Supervised warm-up: cross-entropy on a task's gold completions, stopped on dev accuracy.

A freshly initialised model never samples a correct answer, so RL from
reward alone has nothing to reinforce. The warm-up trains next-token
cross-entropy on `Example.target_ids` until the dev greedy accuracy reaches
a threshold (not a fixed step count), then hands the params to RL. It is the
usual "SFT then RL" recipe (DeepSeek-R1, https://arxiv.org/abs/2501.12948),
kept deliberately short so that RL has most of the task left to learn.
"""

import concurrent.futures
import dataclasses
import functools
import json
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

from rlx import policy, train
from rlx.rl import _data


class WarmupCapError(RuntimeError):
  """The warm-up hit `max_steps` before reaching its dev-accuracy threshold."""


@dataclasses.dataclass(frozen=True)
class WarmupResult:
  """Outcome of `supervised_warmup`.

  Attributes:
    params: the warmed-up params (device pytree on the mesh).
    steps: optimizer steps taken.
    dev_accuracy: the last dev greedy accuracy measured.
    reached: whether `dev_accuracy >= target`.
    history: list of {"step", "loss", "dev_accuracy"} records at each evaluation
      (the loss of the last step before it; None at step 0).
  """

  params: Any
  steps: int
  dev_accuracy: float
  reached: bool
  history: list


def sft_batch(examples: Sequence[Any], width: int) -> dict[str, np.ndarray]:
  """`tokens i32[N, width]` = prompt ++ target (right-padded), `loss_mask` on the target."""
  tokens = np.zeros((len(examples), width), np.int32)
  mask = np.zeros((len(examples), width), np.float32)
  for i, e in enumerate(examples):
    if not e.target_ids:
      raise ValueError(
        "The supervised warm-up needs examples with `target_ids` (gold completions)."
      )
    seq = list(e.prompt_ids) + list(e.target_ids)
    if len(seq) > width:
      raise ValueError(f"prompt + target of {len(seq)} tokens exceeds the width {width}.")
    tokens[i, : len(seq)] = seq
    mask[i, len(e.prompt_ids) : len(seq)] = 1.0
  return {"tokens": tokens, "loss_mask": mask}


def make_sft_step(model_config: Any, train_cfg: ml_collections.ConfigDict) -> Callable:
  """`step(state, batch) -> (state, loss)`: one optimizer step on token-mean cross-entropy.

    loss = -sum(logp * loss_mask) / max(sum(loss_mask), 1)

  The optimizer is `rlx.train.make_optimizer(train_cfg)`: AdamW after
  global-norm clipping at `train_cfg.max_grad_norm` (0 = no clipping; the
  warm-up sets it from `config.warmup.max_grad_norm`). The state is a
  `rlx.train.create_train_state` state (params and optimizer state sharded
  as the RL train state), the batch is placed by `rlx.train.shard_batch`, and
  the differentiated forward is unrolled by the train step's rule
  (`train_cfg.unroll_max_layers`).

  Why this is not `rlx.train.make_train_step` with a cross-entropy loss: that
  step's objective is a policy loss of `(logp, old_logp, advantages, mask)`
  and its batch must carry `old_logp` and `advantages` (host-checked), so
  cross-entropy would be a registered loss ignoring two all-zero inputs; more
  to the point, it compiles a different program: the update runs inside
  `lax.scan`s over epochs, mini-batches and micro-batches with a float32
  gradient accumulator, a non-finite guard (`where(finite, new, old)`), the
  explicit FSDP all-gather of `gather_fsdp_params` and sharding constraints.
  Its float rounding differs from this step's (on one CPU device with the
  tiny arithmetic config the first step's loss differs in the last bit and
  the params by ~1e-7 after one step; with an FSDP axis of 2 the logged
  losses differ), and a warm-up's results must stay what they were: a warm-up
  is identified by `rlx.rl.warmup_key` and reused by other runs
  (`warmup.init_from`) and by resumed ones. What the train step has and this
  one lacks: micro-batching (one forward/backward per `warmup.batch_size`
  batch; lower it to save memory), per-layer FSDP gathering, and skipping a
  non-finite update.

  Cached per (model config, train config), so repeated warm-ups in one
  process compile once.
  """
  return _sft_step(model_config, train_cfg.to_json())


@functools.lru_cache(maxsize=8)
def _sft_step(model_config: Any, train_cfg_json: str) -> Callable:
  cfg = ml_collections.ConfigDict(json.loads(train_cfg_json))
  optimizer = train.make_optimizer(cfg)
  # As in rlx.train's step: the layers unrolled in the differentiated forward
  # of a shallow model (no stacked per-layer residuals in the backward pass).
  unroll = int(model_config.num_layers) <= int(cfg.unroll_max_layers)

  def step(state: train.TrainState, batch: dict):
    def loss_fn(params):
      logp, _ = policy.token_logprobs(
        params, model_config, batch["tokens"], batch["loss_mask"], unroll=unroll
      )
      mask = batch["loss_mask"]
      return -jnp.sum(logp * mask) / jnp.maximum(jnp.sum(mask), 1.0)

    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    return state.replace(step=state.step + 1, params=params, opt_state=opt_state), loss

  return jax.jit(step, donate_argnums=0)


def supervised_warmup(
  params: Any,
  model_config: Any,
  mesh: Any,
  task: Any,
  config: ml_collections.ConfigDict,
  *,
  evaluate: Callable[[Any], float],
  seq_len: int,
  seed: int,
  log: Callable[[dict], None] = lambda record: None,
  wrap_step: Callable[[Callable], Callable] = lambda step: step,
) -> WarmupResult:
  """Cross-entropy training until `evaluate(params) >= config.warmup.target_dev_accuracy`.

  Args:
    params: initial params.
    model_config: the `rlx.policy.ModelConfig`.
    mesh: the `rlx.train` mesh.
    task: the task (its train split's `target_ids` are the labels).
    config: the RL config (`warmup` section read: learning_rate, max_grad_norm,
      batch_size, eval_every, max_steps, target_dev_accuracy, on_cap).
    evaluate: params -> dev greedy accuracy.
    seq_len: the padded sequence width (max_prompt_len + max_new_tokens).
    seed: seed of the warm-up data order.
    log: called with each evaluation record (`loss` None at step 0).
    wrap_step: applied to the jitted step (e.g. a first-compile note).

  Returns:
    A `WarmupResult`.

  Raises:
    WarmupCapError: `max_steps` reached below the threshold with on_cap="raise".
  """
  w = config.warmup
  cfg = train.get_config()
  cfg.optimizer.learning_rate = float(w.learning_rate)
  cfg.max_grad_norm = float(w.max_grad_norm)
  state = train.create_train_state(params, model_config, cfg, mesh, rng=jax.random.PRNGKey(seed))
  jitted = make_sft_step(model_config, cfg)
  step_fn = wrap_step(jitted)
  source = _data.PromptSource(task.split("train"), batch_size=int(w.batch_size), seed=seed)

  def next_batch():
    return train.shard_batch(sft_batch(source.next_batch(), seq_len), mesh)

  batch = next_batch()
  # The step compiles in a thread while the first dev evaluation (and its
  # sampler's compile) runs: XLA's compile releases the GIL.
  pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="rlx-compile")
  ahead = pool.submit(lambda: jitted.lower(state, batch).compile())
  pool.shutdown(wait=False)
  history = []
  accuracy = evaluate(state.params)
  history.append({"step": 0, "loss": None, "dev_accuracy": accuracy})
  log(history[-1])
  ahead.result()
  steps = 0
  loss = jnp.nan
  while accuracy < w.target_dev_accuracy and steps < w.max_steps:
    if steps:
      batch = next_batch()
    state, loss = step_fn(state, batch)
    steps += 1
    if steps % w.eval_every == 0 or steps == w.max_steps:
      accuracy = evaluate(state.params)
      history.append({"step": steps, "loss": float(loss), "dev_accuracy": accuracy})
      log(history[-1])
  reached = accuracy >= w.target_dev_accuracy
  if not reached:
    message = (
      f"Supervised warm-up reached dev accuracy {accuracy:.3f} < target "
      f"{w.target_dev_accuracy} after warmup.max_steps={w.max_steps} steps (task "
      f"{task.name!r}); raise warmup.max_steps / warmup.learning_rate or lower the target."
    )
    if w.on_cap == "raise":
      raise WarmupCapError(message)
    warnings.warn(message, stacklevel=2)
  return WarmupResult(state.params, steps, accuracy, reached, history)
