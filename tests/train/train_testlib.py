"""Shared fixtures of the rlx.train tests (also imported by their subprocess workers).

A tiny policy (2 layers, width 32, vocab 64) and deterministic synthetic RL
batches: prompt tokens, a response of varying length, right padding, and
per-sequence advantages. Built step functions are cached per (layout, config)
so each compiles once per test session.
"""

import functools
import json
from typing import Any

import jax
import numpy as np

from rlx import policy, train

VOCAB = 64
BATCH = 16
SEQ = 24
PROMPT = 6

LAYOUTS = {
  "single": (1, 1, 1),
  "data8": (8, 1, 1),
  "fsdp8": (1, 8, 1),
  "d2f2t2": (2, 2, 2),
  "d2f2": (2, 2, 1),
  "data4": (4, 1, 1),
  "data2": (2, 1, 1),
}


def model_config() -> policy.ModelConfig:
  return policy.ModelConfig.small(
    vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_heads=4, num_kv_heads=2, head_dim=8
  )


def train_config(**overrides: Any):
  """The default train config with lr 1e-3, warmup 2, cosine decay, weight decay."""
  cfg = train.get_config()
  cfg.optimizer.learning_rate = 1e-3
  cfg.optimizer.warmup_steps = 2
  cfg.optimizer.schedule = "warmup_cosine"
  cfg.optimizer.decay_steps = 20
  cfg.optimizer.weight_decay = 0.01
  for key, value in overrides.items():
    target = cfg
    parts = key.split(".")
    for part in parts[:-1]:
      target = target[part]
    target[parts[-1]] = value
  return cfg


def overrides_key(overrides: dict) -> str:
  return json.dumps(overrides, sort_keys=True)


def mesh(layout: str):
  data, fsdp, tensor = LAYOUTS[layout]
  n = data * fsdp * tensor
  return train.make_mesh(data, fsdp, tensor, devices=jax.devices()[:n])


@functools.cache
def _fns(layout: str, key: str):
  overrides = json.loads(key)
  cfg = train_config(**overrides)
  m = mesh(layout)
  mc = model_config()
  return m, cfg, train.make_train_step(mc, cfg, m), train.make_compute_logprobs(mc, cfg, m)


def fns(layout: str, **overrides: Any):
  """(mesh, config, train_step, compute_logprobs), cached per layout/config."""
  return _fns(layout, overrides_key(overrides))


def init_state(m, cfg, seed: int = 0):
  params = policy.init_params(model_config(), jax.random.PRNGKey(seed))
  return train.create_train_state(params, model_config(), cfg, m, rng=jax.random.PRNGKey(seed + 1))


def make_batch(step: int, *, batch: int = BATCH, seq: int = SEQ, seed: int = 0) -> dict:
  """A deterministic rollout batch for `step` (numpy, global)."""
  rng = np.random.default_rng([seed, step])
  tokens = rng.integers(1, VOCAB, (batch, seq)).astype(np.int32)
  lengths = rng.integers(3, seq - PROMPT + 1, batch)
  pos = np.arange(seq)[None, :]
  loss_mask = (pos >= PROMPT) & (pos < PROMPT + lengths[:, None])
  tokens = np.where(pos < PROMPT + lengths[:, None], tokens, 0).astype(np.int32)
  advantages = rng.normal(size=batch).astype(np.float32)
  rollout_noise = 0.05 * rng.normal(size=(batch, seq)).astype(np.float32)
  return {
    "tokens": tokens,
    "loss_mask": loss_mask.astype(np.float32),
    "advantages": advantages,
    "rollout_noise": rollout_noise,
  }


def prepare(batch: dict, m, state, compute_logprobs, *, rollout: bool = False, ref_params=None):
  """Shards `batch` and adds old_logp (and rollout_logp / ref_logp)."""
  batch = dict(batch)
  noise = batch.pop("rollout_noise")
  out = train.shard_batch(batch, m)
  out["old_logp"] = compute_logprobs(state, out)
  if rollout:
    mask = batch["loss_mask"] != 0
    rollout_logp = np.where(mask, np.asarray(jax.device_get(out["old_logp"])) + noise, 0.0)
    out.update(train.shard_batch({"rollout_logp": rollout_logp.astype(np.float32)}, m))
  if ref_params is not None:
    out["ref_logp"] = compute_logprobs(ref_params, out)
  return out


def run_steps(
  layout: str, steps: int, *, start: int = 0, state=None, rollout: bool = False, **overrides: Any
):
  """Runs `steps` train steps on batches `start..start+steps-1`; returns (state, metrics).

  old_logp comes from the layout's default-config `compute_logprobs` (the
  forward does not depend on the step's batching options).
  """
  m, cfg, step_fn, _ = fns(layout, **overrides)
  logprobs = fns(layout)[3]
  if state is None:
    state = init_state(m, cfg)
  history = []
  for i in range(start, start + steps):
    batch = prepare(make_batch(i), m, state, logprobs, rollout=rollout)
    state, metrics = step_fn(state, batch)
    history.append(train.to_host(metrics))
  return state, history


def host_params(state) -> list[np.ndarray]:
  return [np.asarray(x) for x in jax.tree.leaves(jax.device_get(state.params))]


def shares_buffer(a: Any, b: Any) -> bool:
  """Whether two `jax.Array`s have a device buffer in common (False for non-arrays)."""
  if not (isinstance(a, jax.Array) and isinstance(b, jax.Array)):
    return False
  if a.is_deleted() or b.is_deleted():
    return False
  buffers = {(s.device, s.data.unsafe_buffer_pointer()) for s in a.addressable_shards}
  return any((s.device, s.data.unsafe_buffer_pointer()) in buffers for s in b.addressable_shards)
