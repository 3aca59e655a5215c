"""Controlled staleness: which params sample the next batch, and the staleness of its tokens.

Staleness is counted in optimizer updates, as M2PO defines it (Zheng et al.
2025, https://arxiv.org/abs/2510.01161): a token sampled by the params of
version `v` (the number of updates applied to them) and trained at update `u`
has staleness `u - v`. `rl.staleness = k` makes the batch whose FIRST update
is `u` come from the params of version `u - k` (from the oldest version kept
while fewer than k updates have happened); with `M` updates per batch
(`train.ppo_epochs x train.mini_batches`), the batch's j-th update trains it
at staleness `k + j`. Two ways to hold those params:

  fixed     a ring of the last k / M + 1 param versions (one per iteration);
            every batch is exactly k updates stale once the ring is full.
  periodic  the rollout params are refreshed every k updates, as in systems
            that sync weights to the inference engine at an interval
            (e.g. slime's / verl's async modes): a batch's staleness runs
            through 0, M, ..., k - M.

Sampling with the old params at the time the batch is trained gives the same
batches as sampling them k updates earlier and queueing them, with the same
random key per iteration, so a run is reproducible and resumable (the held
versions are checkpointed).
"""

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

STALENESS_MODES = ("fixed", "periodic")
RING_PLACES = ("device", "host")


def check_staleness(staleness: Any, mode: Any, updates_per_iteration: int) -> None:
  """Raises ValueError naming `config.rl.staleness` / `staleness_mode` when they are invalid."""
  if isinstance(staleness, bool) or not isinstance(staleness, int | np.integer) or staleness < 0:
    raise ValueError(f"`config.rl.staleness` must be an int >= 0 (updates), got {staleness!r}.")
  if mode not in STALENESS_MODES:
    raise ValueError(f"`config.rl.staleness_mode` must be one of {STALENESS_MODES}, got {mode!r}.")
  m = int(updates_per_iteration)
  if staleness % m:
    raise ValueError(
      f"`config.rl.staleness`={staleness} must be a multiple of the {m} optimizer updates of "
      "one RL iteration (train.ppo_epochs x train.mini_batches): the params exist at "
      "iteration boundaries only."
    )


class RolloutParams:
  """The params (and their version) that sample each batch, for `rl.staleness = k`.

  `select(params, version)` is called before each rollout with the learner's
  current params and version `u` (its update count) and returns
  `(rollout_params, rollout_version)`; with k = 0 that is its input, without
  a copy. Held versions are copies (the train step donates the live params):
  on the device, or as NumPy arrays on the host (`place="host"`, for models
  whose ring does not fit next to the trainer; put back on the mesh by
  `put` for each rollout).

  Attributes:
    staleness: k, in optimizer updates.
    mode: "fixed" or "periodic".
    updates_per_iteration: M, optimizer updates per batch.
  """

  def __init__(
    self,
    staleness: int,
    mode: str = "fixed",
    *,
    updates_per_iteration: int = 1,
    place: str = "device",
    put: Callable[[Any], Any] | None = None,
  ):
    """Args:
    staleness: k >= 0, a multiple of `updates_per_iteration`.
    mode: "fixed" (a ring of versions) or "periodic" (an interval refresh).
    updates_per_iteration: M >= 1, the optimizer updates one batch makes.
    place: where held versions live, "device" or "host".
    put: host tree -> device tree on the sampler's mesh (e.g.
      `rlx.train.shard_params(tree, model_config, mesh)`); needed for
      `place="host"` and for `load_state_dict`.
    """
    if isinstance(updates_per_iteration, bool) or int(updates_per_iteration) < 1:
      raise ValueError(f"`updates_per_iteration` must be >= 1, got {updates_per_iteration!r}.")
    check_staleness(staleness, mode, updates_per_iteration)
    if place not in RING_PLACES:
      raise ValueError(f"`config.rl.staleness_ring` must be one of {RING_PLACES}, got {place!r}.")
    if place == "host" and put is None:
      raise ValueError("`put` (host tree -> device tree) is needed with place='host'.")
    self.staleness = int(staleness)
    self.mode = mode
    self.updates_per_iteration = int(updates_per_iteration)
    self.place = place
    self._put = put
    self._held: list[tuple[int, Any]] = []  # (version, params), oldest first

  @property
  def versions(self) -> list[int]:
    """The versions held now, oldest first."""
    return [v for v, _ in self._held]

  def _copy(self, params: Any) -> Any:
    if self.place == "host":
      return jax.tree.map(lambda x: np.array(x, copy=True), params)
    return jax.tree.map(jnp.copy, params)

  def _device(self, params: Any) -> Any:
    return self._put(params) if self.place == "host" else params

  def select(self, params: Any, version: int) -> tuple[Any, int]:
    """`(rollout_params, rollout_version)` for the batch whose first update is `version`.

    Args:
      params: the learner's current params (device pytree).
      version: their version u (optimizer updates applied), non-decreasing
        from call to call.

    Returns:
      The params of version `max(u - k, oldest held)` ("fixed"), or of the
      last refresh ("periodic"), and that version.
    """
    version = int(version)
    if self._held and version < self._held[-1][0]:
      raise ValueError(
        f"`version`={version} is older than the newest held version {self._held[-1][0]}."
      )
    k = self.staleness
    if k == 0:
      return params, version
    if self.mode == "fixed":
      if not self._held or self._held[-1][0] != version:
        self._held.append((version, self._copy(params)))
      while len(self._held) > 1 and self._held[0][0] < version - k:
        self._held.pop(0)
    elif not self._held or version - self._held[-1][0] >= k:
      self._held = [(version, self._copy(params))]
    held_version, held = self._held[0]
    return self._device(held), held_version

  def state_dict(self) -> dict[str, Any]:
    """The held versions as host arrays, for the checkpoint (empty with k = 0)."""
    if not self._held:
      return {}
    return {
      "versions": np.asarray(self.versions, np.int32),
      "params": {
        str(i): jax.tree.map(lambda x: np.array(x, copy=True), p)
        for i, (_, p) in enumerate(self._held)
      },
    }

  def load_state_dict(self, state: dict[str, Any] | None) -> None:
    """Restores `state_dict()` (host trees put back with `put`, or kept on host)."""
    if not state:
      self._held = []
      return
    versions = [int(v) for v in np.asarray(state["versions"]).reshape(-1)]
    trees = state["params"]
    if len(trees) != len(versions):
      raise ValueError(
        f"Staleness state holds {len(versions)} versions but {len(trees)} param trees."
      )
    held = []
    for i, v in enumerate(versions):
      tree = trees[str(i)] if isinstance(trees, dict) else trees[i]
      if self.place == "device":
        if self._put is None:
          raise ValueError("`put` is needed to restore held versions onto the device.")
        tree = self._put(tree)
      held.append((v, tree))
    self._held = held


class ProximalEwma:
  """PPO-EWMA's proximal policy: an exponentially weighted average of past params.

  Hilton et al. 2021, "Batch size-invariance for policy optimization",
  https://arxiv.org/abs/2110.00641 (the decoupled objective's proximal policy
  `pi_prox`, reference code https://github.com/openai/ppo-ewma, `EwmaModel`):
  the average starts as a copy of the params and, with decay `beta` and a
  running total weight `W` (1 at the start), each `update(params)` does

    W'        = beta * W + 1
    theta_avg = (beta * W / W') * theta_avg + params / W'

  the bias-corrected EWMA, so early on it is the plain mean of the params so
  far, later it weights params `j` updates back by `beta^j`. Its log-probs
  stand in for the exact old log-probs when those are too expensive or
  missing (the clip is centred on it; the behaviour weight pi_prox / mu goes
  through `train.use_rollout_correction`).

  The loop updates it once per RL iteration, after the iteration's M
  optimizer updates, with the params at the iteration boundary: with M = 1
  that is the reference's per-update rule; with M > 1 the M updates of one
  batch count as one step of the average (the reference updates it between
  mini-batches too). Its log-probs are computed once per batch, before the
  batch's first update, like every other `rl.old_logp` mode.

  Attributes:
    decay: beta in (0, 1).
    total_weight: W.
    params: the average (a device pytree), None before `select` first runs.
  """

  def __init__(self, decay: float, *, put: Callable[[Any], Any] | None = None):
    """Args:
    decay: beta in (0, 1) (`config.rl.ewma_decay`).
    put: host tree -> device tree on the learner's mesh, for `load_state_dict`.
    """
    if isinstance(decay, bool) or not isinstance(decay, int | float) or not 0.0 < decay < 1.0:
      raise ValueError(f"`config.rl.ewma_decay` must be a number in (0, 1), got {decay!r}.")
    self.decay = float(decay)
    self.total_weight = 1.0
    self.params = None
    self._put = put
    self._update = None  # jitted at the first update, out_shardings = the average's

  def select(self, params: Any) -> Any:
    """The proximal params; the first call starts the average at a copy of `params`."""
    if self.params is None:
      self.params = jax.tree.map(jnp.copy, params)
      self.total_weight = 1.0
    return self.params

  def update(self, params: Any) -> None:
    """Folds the learner's new params into the average (see the class docstring)."""
    if self.params is None:
      self.select(params)
      return
    new_total = self.decay * self.total_weight + 1.0
    keep = jnp.float32(self.decay * self.total_weight / new_total)
    if self._update is None:  # keep the params' layout (jit would pick its own otherwise)
      shardings = jax.tree.map(lambda x: x.sharding, self.params)
      self._update = jax.jit(_ewma_update, donate_argnums=(0,), out_shardings=shardings)
    self.params = self._update(self.params, params, keep, jnp.float32(1.0 / new_total))
    self.total_weight = new_total

  def state_dict(self) -> dict[str, Any]:
    """The average as host arrays and its total weight (empty before the first `select`)."""
    if self.params is None:
      return {}
    return {
      "total_weight": np.float64(self.total_weight),
      "params": jax.tree.map(lambda x: np.array(x, copy=True), self.params),
    }

  def load_state_dict(self, state: dict[str, Any] | None) -> None:
    """Restores `state_dict()` onto the device with `put`."""
    if not state:
      self.params, self.total_weight = None, 1.0
      return
    if self._put is None:
      raise ValueError("`put` is needed to restore the proximal params onto the device.")
    self.params = self._put(state["params"])
    self.total_weight = float(np.asarray(state["total_weight"]))
    self._update = None


def _ewma_update(avg: Any, params: Any, keep: jax.Array, new: jax.Array) -> Any:
  return jax.tree.map(
    lambda a, p: (keep * a.astype(jnp.float32) + new * p.astype(jnp.float32)).astype(a.dtype),
    avg,
    params,
  )


def staleness_metrics(
  policy_version: Any, response_mask: Any, learner_version: int
) -> dict[str, Any]:
  """Staleness of a batch's response tokens at its first update, `u - v` per token.

  Args:
    policy_version: i32[B, S] version of the params that sampled each token.
    response_mask: bool[B, S] the response tokens.
    learner_version: u, the learner's version at the batch's first update.

  Returns:
    `staleness_mean`, `staleness_min`, `staleness_max` (floats over the
    response tokens; 0 with none) and `staleness_hist` ({"s": token count}).
  """
  versions = np.asarray(policy_version)
  mask = np.asarray(response_mask).astype(bool)
  if versions.shape != mask.shape or versions.ndim != 2:
    raise ValueError(
      f"`policy_version` {versions.shape} and `response_mask` {mask.shape} must be the same "
      "[B, S] shape."
    )
  stale = int(learner_version) - versions[mask].astype(np.int64)
  if stale.size == 0:
    return {"staleness_mean": 0.0, "staleness_min": 0.0, "staleness_max": 0.0, "staleness_hist": {}}
  if stale.min() < 0:
    raise ValueError(
      f"A token's policy version {int(versions[mask].max())} is newer than the learner's "
      f"{learner_version}."
    )
  values, counts = np.unique(stale, return_counts=True)
  return {
    "staleness_mean": float(stale.mean()),
    "staleness_min": float(stale.min()),
    "staleness_max": float(stale.max()),
    "staleness_hist": {str(int(v)): int(c) for v, c in zip(values, counts, strict=True)},
  }


def merge_histograms(hists: list[dict[str, int]]) -> dict[str, int]:
  """The sum of `staleness_hist` dicts, keys in increasing staleness."""
  total: dict[int, int] = {}
  for h in hists:
    for k, c in (h or {}).items():
      total[int(k)] = total.get(int(k), 0) + int(c)
  return {str(k): total[k] for k in sorted(total)}
