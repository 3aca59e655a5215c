"""The sharded train step: sharding invariance, micro/mini-batching, losses, NaN skipping."""

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import train_testlib as tl

from rlx import objectives, policy, train


@functools.cache
def _single_device_run():
  state, history = tl.run_steps("single", 3)
  return tl.host_params(state), history


def _max_diff(a, b):
  return max(float(np.max(np.abs(x - y))) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("layout", ["d2f2t2", "data8"])
def test_sharded_step_equals_single_device(layout):
  ref_params, ref_history = _single_device_run()
  state, history = tl.run_steps(layout, 3)
  assert _max_diff(tl.host_params(state), ref_params) < 1e-5
  for got, want in zip(history, ref_history, strict=True):
    np.testing.assert_allclose(got["loss"], want["loss"], rtol=1e-5, atol=1e-6)
  # The state stays on the mesh with the policy's partition rules.
  m = tl.mesh(layout)
  want = train.param_shardings(tl.model_config(), m)
  for leaf, sharding in zip(jax.tree.leaves(state.params), jax.tree.leaves(want), strict=True):
    assert leaf.sharding.is_equivalent_to(sharding, leaf.ndim)
  assert int(state.step) == 3


def test_params_actually_move_and_metrics_are_reported():
  ref_params, history = _single_device_run()
  init = tl.host_params(tl.init_state(tl.mesh("single"), tl.train_config()))
  assert _max_diff(ref_params, init) > 1e-4
  batch = tl.make_batch(0)
  first = history[0]
  assert first["tokens"] == batch["loss_mask"].sum()
  for name in (
    "loss",
    "policy_loss",
    "kl_loss",
    "entropy_loss",
    "entropy",
    "clip_frac_low",
    "clip_frac_high",
    "clip_frac_dual",
    "approx_kl",
    "ratio_mean",
    "ratio_max",
    "is_weight_mean",
    "mismatch_k1",
    "grad_norm",
    "update_norm",
    "param_norm",
    "learning_rate",
    "skipped",
    "skipped_total",
  ):
    if name == "mismatch_k1":
      assert name not in first  # no rollout_logp in this batch
      continue
    assert np.isfinite(first[name]), name
  # On-policy first update: ratio == 1, nothing clipped, lr = warmup 0 at update 0.
  np.testing.assert_allclose(first["ratio_mean"], 1.0, atol=1e-6)
  assert first["clip_frac_low"] == first["clip_frac_high"] == 0.0
  assert first["learning_rate"] == 0.0 and history[1]["learning_rate"] == pytest.approx(5e-4)
  assert first["entropy"] > 0 and first["grad_norm"] > 0 and first["skipped"] == 0
  assert [h["step"] for h in history] == [0, 1, 2]
  # Asynchronous by default: no host-timed metrics (see test_train_throughput.py).
  assert "step_time_s" not in first and "tokens_per_second" not in first


def test_unrolled_layers_equal_the_layer_scan():
  """The differentiated forward unrolls the layers (unroll_max_layers=4 >= 2); same values."""
  assert tl.model_config().num_layers <= tl.train_config().unroll_max_layers
  ref_params, ref_history = _single_device_run()
  state, history = tl.run_steps("single", 3, unroll_max_layers=0)
  assert _max_diff(tl.host_params(state), ref_params) < 1e-6
  for got, want in zip(history, ref_history, strict=True):
    for name in ("loss", "grad_norm", "entropy", "update_norm"):
      np.testing.assert_allclose(got[name], want[name], rtol=1e-6, atol=1e-7, err_msg=name)


def test_micro_batched_equals_full_batch():
  ref_params, ref_history = _single_device_run()
  state, history = tl.run_steps("single", 3, micro_batches=4)
  assert _max_diff(tl.host_params(state), ref_params) < 1e-6
  for got, want in zip(history, ref_history, strict=True):
    for name in ("loss", "policy_loss", "entropy", "grad_norm", "clip_frac_high", "approx_kl"):
      np.testing.assert_allclose(got[name], want[name], rtol=1e-6, atol=1e-6, err_msg=name)


def test_micro_batched_equals_full_batch_seq_mean_token_mean():
  """The mini-batch denominator makes micro-batching exact for sequence means too."""
  _, full = tl.run_steps("single", 1, agg="seq-mean-token-mean")
  _, micro = tl.run_steps("single", 1, agg="seq-mean-token-mean", micro_batches=4)
  for name in ("loss", "policy_loss", "entropy_loss", "grad_norm"):
    np.testing.assert_allclose(micro[0][name], full[0][name], rtol=1e-6, err_msg=name)
  # ... and it is a different quantity from the token mean.
  assert abs(full[0]["loss"] - _single_device_run()[1][0]["loss"]) > 1e-4


def test_epochs_and_shuffled_mini_batches_equal_sequential_updates():
  """2 epochs x 2 shuffled mini-batches == 4 one-update steps on those mini-batches.

  Epoch e permutes the rows with fold_in(fold_in(rng, step), e); mini-batch k
  of the permuted batch holds its rows k, k + 2, ...
  """
  m, cfg, step_fn, logprobs = tl.fns("single", ppo_epochs=2, mini_batches=2, shuffle=True)
  state = tl.init_state(m, cfg)
  batch = tl.prepare(tl.make_batch(0), m, state, tl.fns("single")[3])
  host = {k: np.asarray(v) for k, v in batch.items()}
  step_rng = jax.random.fold_in(state.rng, state.step)
  state, metrics = step_fn(state, batch)
  metrics = train.to_host(metrics)
  # Four optimizer updates happened in the one step.
  assert int(state.opt_state[1][0].count) == 4
  np.testing.assert_allclose(
    metrics["learning_rate"], np.mean([train.make_schedule(cfg)(n) for n in range(4)]), rtol=1e-6
  )
  assert int(state.step) == 1

  _, _, one_update, _ = tl.fns("single")
  ref = tl.init_state(m, cfg)
  for epoch in range(2):
    perm = np.asarray(jax.random.permutation(jax.random.fold_in(step_rng, epoch), tl.BATCH))
    assert sorted(perm) != list(perm)  # really shuffled
    for part in range(2):
      rows = perm[part::2]
      ref, _ = one_update(ref, {k: v[rows] for k, v in host.items()})
  assert _max_diff(tl.host_params(state), tl.host_params(ref)) < 1e-6
  # Later updates are off-policy: the ratio moved away from 1.
  assert metrics["ratio_max"] > 1.0


def _nan_batch(m, state, logprobs):
  """Finite inputs (they pass the host checks) whose loss overflows to non-finite.

  Row 0's advantage is the largest float32: its loss tokens sum past float32's
  range. (A NaN input on a loss token is refused on host instead.)
  """
  batch = tl.make_batch(1)
  batch["advantages"][0] = np.finfo(np.float32).max
  return tl.prepare(batch, m, state, logprobs)


def test_nan_batch_is_skipped_and_reported():
  m, cfg, step_fn, logprobs = tl.fns("single")
  state, _ = tl.run_steps("single", 1)
  before = tl.host_params(state)
  opt_before = [np.asarray(x) for x in jax.tree.leaves(jax.device_get(state.opt_state))]
  state, metrics = step_fn(state, _nan_batch(m, state, logprobs))
  metrics = train.to_host(metrics)
  assert metrics["skipped"] == 1 and metrics["skipped_total"] == 1
  assert not np.isfinite(metrics["loss"])
  assert metrics["update_norm"] == 0
  for got, want in zip(tl.host_params(state), before, strict=True):
    np.testing.assert_array_equal(got, want)
  opt_after = [np.asarray(x) for x in jax.tree.leaves(jax.device_get(state.opt_state))]
  for got, want in zip(opt_after, opt_before, strict=True):
    np.testing.assert_array_equal(got, want)
  assert int(state.step) == 2 and int(state.skipped) == 1
  # The next finite batch trains normally.
  state, metrics = step_fn(state, tl.prepare(tl.make_batch(2), m, state, logprobs))
  metrics = train.to_host(metrics)
  assert metrics["skipped"] == 0 and metrics["skipped_total"] == 1
  assert np.isfinite(tl.host_params(state)[0]).all()
  assert _max_diff(tl.host_params(state), before) > 0


def test_nonfinite_raise_mode():
  m, cfg, step_fn, logprobs = tl.fns("single")
  raising = dataclasses.replace(step_fn, nonfinite="raise")
  state = tl.init_state(m, cfg)
  before = tl.host_params(state)
  opt_before = [np.asarray(x) for x in jax.tree.leaves(jax.device_get(state.opt_state))]
  with pytest.raises(train.NonFiniteError, match="non-finite") as info:
    raising(state, _nan_batch(m, state, logprobs))
  assert info.value.metrics["skipped"] == 1
  assert "tokens_per_second" not in info.value.metrics  # default: no host timing
  for got, want in zip(tl.host_params(info.value.state), before, strict=True):
    np.testing.assert_array_equal(got, want)
  opt_after = jax.tree.leaves(jax.device_get(info.value.state.opt_state))
  for got, want in zip(opt_after, opt_before, strict=True):
    np.testing.assert_array_equal(np.asarray(got), want)


# Each non-default loss runs paired with one KL estimator, so one compile per
# loss also covers every kl_kind (ppo + k3+ run in the composition test below).
_KL_KIND_FOR_LOSS = {
  "gspo": "k1",
  "ctpo": "abs",
  "minpro": "k2",
  "cispo": "k3",
  "sapo": "low_var_kl",
  "aspo": "k3+",
  "vespo": "k1",
  "sat": "k3",
  "m2po": "abs",
}


@functools.cache
def _reference_params(layout: str):
  m = tl.mesh(layout)
  params = policy.init_params(tl.model_config(), jax.random.PRNGKey(7))
  return train.shard_params(params, tl.model_config(), m)


@pytest.mark.parametrize("loss", sorted(set(objectives.POLICY_LOSSES) - {"ppo"}))
def test_every_policy_loss_and_kl_kind_runs_through_the_step(loss):
  kind = _KL_KIND_FOR_LOSS[loss]
  kl_coef = 0.05
  m, cfg, step_fn, _ = tl.fns("single", loss=loss, kl_coef=kl_coef, kl_kind=kind)
  logprobs = tl.fns("single")[3]

  def run(zero_advantages: bool):
    state = tl.init_state(m, cfg)
    host = tl.make_batch(0)
    if zero_advantages:
      host["advantages"] = np.zeros_like(host["advantages"])
    batch = tl.prepare(host, m, state, logprobs, ref_params=_reference_params("single"))
    _, metrics = step_fn(state, batch)
    return batch, train.to_host(metrics)

  batch, metrics = run(zero_advantages=False)
  assert metrics["skipped"] == 0
  assert np.isfinite(metrics["loss"]) and metrics["grad_norm"] > 0
  # kl_loss is objectives.kl_penalty(kind) of the current policy (== old_logp
  # at the first update) against the reference, aggregated like the loss.
  mask = np.asarray(batch["loss_mask"]) != 0
  per_token = objectives.kl_penalty(
    np.asarray(batch["old_logp"]), np.asarray(batch["ref_logp"]), kind, mask=mask
  )
  want = objectives.aggregate(per_token, mask, train.resolve_agg(cfg))
  assert float(want) > 1e-3  # the reference really differs
  np.testing.assert_allclose(metrics["kl_loss"], want, rtol=1e-4)
  np.testing.assert_allclose(
    metrics["loss"], metrics["policy_loss"] + kl_coef * metrics["kl_loss"], rtol=1e-5
  )
  # With zero advantages the policy loss has zero gradient: the whole
  # gradient comes from the KL term, so it is differentiated for every kind.
  _, zero = run(zero_advantages=True)
  assert zero["policy_loss"] == 0.0
  np.testing.assert_allclose(zero["kl_loss"], metrics["kl_loss"], rtol=1e-6)
  assert zero["grad_norm"] > 1e-4


def test_bapo_m2po_correction_kl_entropy_compose():
  """Every whole-batch transform at once, each checked against an independent numpy value.

  M2PO drops the outlier tokens from the loss, but the sequence-level IS
  weights (correction and VCPO) are the ratios of the sequences as SAMPLED.
  """
  overrides = dict(
    use_bapo=True,
    use_m2po=True,
    use_rollout_correction=True,
    rollout_correction_kwargs={"level": "sequence", "truncate": None},
    use_vcpo=True,
    kl_coef=0.1,
    kl_kind="k3+",
    entropy_coef=0.01,
    micro_batches=2,
    agg="seq-mean-token-mean",
  )
  m, cfg, step_fn, _ = tl.fns("single", **overrides)
  state = tl.init_state(m, cfg)
  logprobs = tl.fns("single")[3]
  host = tl.make_batch(0)
  batch = tl.prepare(host, m, state, logprobs, rollout=True, ref_params=_reference_params("single"))
  sampled = host["loss_mask"] != 0
  old = np.asarray(batch["old_logp"], np.float64)
  rollout = np.asarray(batch["rollout_logp"], np.float64)
  rows = np.flatnonzero(sampled.any(axis=1))[:4]
  cols = np.argmax(sampled[rows], axis=1)
  rollout[rows, cols] += 3.0  # outliers that M2PO must drop (3^2 >> 0.04)
  batch.update(train.shard_batch({"rollout_logp": rollout.astype(np.float32)}, m))
  state, metrics = step_fn(state, batch)
  metrics = train.to_host(metrics)
  assert metrics["skipped"] == 0
  assert metrics["kl_loss"] > 0  # a different reference policy
  want = metrics["policy_loss"] + 0.1 * metrics["kl_loss"] - 0.01 * metrics["entropy_loss"]
  np.testing.assert_allclose(metrics["loss"], want, rtol=1e-5)

  # M2PO: the final loss mask drops the outliers (and nothing is rejected).
  keep = np.asarray(
    objectives.m2po_mask(old.astype(np.float32), rollout.astype(np.float32), sampled)
  ).astype(bool)
  final = sampled & keep
  assert not final[rows, cols].any()
  assert metrics["tokens"] == final.sum()
  np.testing.assert_allclose(metrics["m2po_masked_frac"], 1 - final.sum() / sampled.sum())
  # Sequence weights over the sampled tokens, averaged over the loss tokens.
  seq_w = np.exp(np.clip(np.sum(np.where(sampled, old - rollout, 0.0), axis=1), -20, 20))
  want_w = np.sum(final * seq_w[:, None]) / final.sum()
  np.testing.assert_allclose(metrics["is_weight_mean"], want_w, rtol=1e-4)
  seq_w_after_m2po = np.exp(np.sum(np.where(final, old - rollout, 0.0), axis=1))
  assert abs(np.sum(final * seq_w_after_m2po[:, None]) / final.sum() - want_w) > 0.1 * want_w
  # VCPO: normalised ESS of the same sequence weights.
  valid = sampled.any(axis=1)
  w = seq_w[valid]
  np.testing.assert_allclose(metrics["vcpo_ess"], w.sum() ** 2 / (w.size * (w**2).sum()), rtol=1e-4)
  np.testing.assert_allclose(metrics["vcpo_lr_factor"], np.sqrt(min(1.0, metrics["vcpo_ess"])))
  # Mismatch KL of the sampled tokens, under stable names.
  log_rho = np.where(sampled, old - rollout, 0.0)
  n = sampled.sum()
  np.testing.assert_allclose(metrics["mismatch_k1"], np.sum(-log_rho) / n, rtol=1e-4, atol=1e-6)
  k3 = np.where(sampled, np.exp(log_rho) - 1 - log_rho, 0.0)
  np.testing.assert_allclose(metrics["mismatch_k3"], k3.sum() / n, rtol=1e-4)
  assert "rollout_correction/ess" in metrics and "rollout_correction/mismatch_k3" not in metrics
  # BAPO on-policy (r = 1 at the first update): the share is that of |A| mass
  # over the loss tokens; below rho0 = 0.5 no bound can change it, so both go
  # to their maxima.
  adv = host["advantages"][:, None] * final
  share = adv[adv > 0].sum() / np.abs(adv).sum()
  np.testing.assert_allclose(metrics["bapo_positive_share"], share, rtol=1e-5)
  bounds = (metrics["bapo_c_low"], metrics["bapo_c_high"])
  np.testing.assert_allclose(bounds, (0.6, 1.2) if share >= 0.5 else (0.9, 3.0), atol=1e-6)


def test_mismatch_metrics_have_stable_names_without_correction():
  m, cfg, step_fn, logprobs = tl.fns("single")
  state = tl.init_state(m, cfg)
  batch = tl.prepare(tl.make_batch(0), m, state, logprobs, rollout=True)
  _, metrics = step_fn(state, batch)
  want = objectives.rollout_mismatch_kl(
    batch["old_logp"], batch["rollout_logp"], batch["loss_mask"]
  )
  metrics = train.to_host(metrics)
  np.testing.assert_allclose(metrics["mismatch_k1"], want.k1, rtol=1e-6)
  np.testing.assert_allclose(metrics["mismatch_k3"], want.k3, rtol=1e-6)
  assert not any(name.startswith("rollout_correction/") for name in metrics)


def test_compute_logprobs_matches_policy_forward():
  m, cfg, _, logprobs = tl.fns("data8")
  state = tl.init_state(m, cfg)
  batch = tl.make_batch(3)
  got = np.asarray(
    logprobs(state, train.shard_batch({k: batch[k] for k in ("tokens", "loss_mask")}, m))
  )
  params = policy.init_params(tl.model_config(), jax.random.PRNGKey(0))
  want, _ = policy.token_logprobs(
    params, tl.model_config(), jnp.asarray(batch["tokens"]), jnp.asarray(batch["loss_mask"])
  )
  np.testing.assert_allclose(got, np.asarray(want), atol=1e-5)
  assert np.all(got[batch["loss_mask"] == 0] == 0)


def test_batch_validation_errors():
  m, cfg, step_fn, logprobs = tl.fns("single")
  state = tl.init_state(m, cfg)
  good = tl.prepare(tl.make_batch(0), m, state, logprobs)
  with pytest.raises(ValueError, match="missing \\['old_logp'\\]"):
    step_fn(state, {k: v for k, v in good.items() if k != "old_logp"})
  with pytest.raises(ValueError, match="unknown \\['reward'\\]"):
    step_fn(state, dict(good, reward=good["advantages"]))
  with pytest.raises(ValueError, match="`advantages` must have shape"):
    step_fn(state, dict(good, advantages=good["advantages"][:, None]))
  with pytest.raises(ValueError, match="`ref_logp` is required"):
    tl.fns("single", kl_coef=0.1)[2](state, good)
  with pytest.raises(ValueError, match="divisible by mini_batches"):
    tl.fns("single", mini_batches=3)[2](state, good)
  with pytest.raises(ValueError, match=r"Batch size 12 must be divisible by .* = 8"):
    tl.fns("data8")[2](state, {k: v[:12] for k, v in good.items()})
  with pytest.raises(ValueError, match="`state` must be a rlx.train.TrainState"):
    step_fn(state.params, good)
  with pytest.raises(ValueError, match="`batch` must be a dict"):
    step_fn(state, list(good.values()))
  with pytest.raises(ValueError, match="`params` does not match the config: missing"):
    logprobs({"embed": state.params["embed"]}, good)
  with pytest.raises(ValueError, match="config.loss"):
    train.make_train_step(tl.model_config(), tl.train_config(loss="trpo"), m)
  with pytest.raises(ValueError, match="use_bapo"):
    train.make_train_step(tl.model_config(), tl.train_config(loss="sapo", use_bapo=True), m)


def _hlo_computations(hlo: str) -> dict[str, str]:
  """Compiled HLO text -> {computation name: its text}."""
  out = {}
  for block in re.split(r"\n(?=\S)", hlo):
    match = re.match(r"(?:ENTRY )?%?([\w.\-]+) \(", block)
    if match:
      out[match.group(1)] = block
  return out


def _result_shapes(line: str, op: str) -> list[tuple[int, ...]]:
  """Array shapes of the result type of an `op` instruction line (tuples flattened)."""
  result_type = line.split(" = ", 1)[1].split(f" {op}(", 1)[0]
  return [
    tuple(int(d) for d in dims.split(",") if d)
    for dims in re.findall(r"[a-z]+\d*\[([\d,]*)\]", result_type)
  ]


def test_fsdp_params_are_gathered_one_layer_at_a_time():
  """ZeRO-3 in the compiled step: each layer's weights are all-gathered inside the layer loop.

  For every FSDP-sharded stacked layer weight [L, ...], the compiled (SPMD
  partitioned) step must (a) all-gather its one-layer slice inside a while-loop
  body, and (b) never hold the gathered whole stack: no all-gather produces it
  and no while loop carries it (e.g. as a residual saved for the backward
  pass). Whole-model gathering (`gather_fsdp_per_layer=False`) fails (a) and (b).
  """
  layout = "d2f2t2"  # the compile is shared with test_sharded_step_equals_single_device
  m, cfg, step_fn, logprobs = tl.fns(layout)
  state = tl.init_state(m, cfg)
  batch = tl.prepare(tl.make_batch(0), m, state, logprobs)
  hlo = step_fn.lower(state, batch).compile().as_text()

  mc = tl.model_config()
  shapes = jax.eval_shape(functools.partial(policy.init_params, mc), jax.random.PRNGKey(0))
  stored = train.param_shardings(mc, m)["layers"]
  gathered = train.gathered_layer_shardings(mc, m)
  per_layer, stacks = {}, {}
  for (path, leaf), store, gather in zip(
    jax.tree_util.tree_leaves_with_path(shapes["layers"]),
    jax.tree.leaves(stored),
    jax.tree.leaves(gathered),
    strict=True,
  ):
    one = gather.shard_shape(leaf.shape[1:])
    if store.shard_shape(leaf.shape)[1:] != one:  # sharded over "fsdp"
      name = jax.tree_util.keystr(path)
      per_layer[name] = one
      stacks[name] = (mc.num_layers,) + one
  assert len(per_layer) == 7  # q, k, v, o, gate, up, down kernels

  computations = _hlo_computations(hlo)
  names = set(computations)
  calls = {
    name: set(re.findall(r"%([\w.\-]+)", text)) & names - {name}
    for name, text in computations.items()
  }
  in_loop = set(re.findall(r"body=%([\w.\-]+)", hlo))
  frontier = list(in_loop)
  while frontier:
    for callee in calls[frontier.pop()] - in_loop:
      in_loop.add(callee)
      frontier.append(callee)
  gathers_in_loop, gathers, loop_state = set(), set(), set()
  for name, text in computations.items():
    for line in text.splitlines():
      for op in ("all-gather", "all-gather-start"):
        if f" {op}(" in line:
          result = _result_shapes(line, op)
          gathers.update(result)
          if name in in_loop:
            gathers_in_loop.update(result)
      if " while(" in line:
        loop_state.update(_result_shapes(line, "while"))
  assert gathers, "no all-gather found in the compiled step"
  # Loops legitimately carry the stored (sharded) params, grads and moments; a
  # gathered stack whose shape equals one of those cannot be told apart.
  stored_shapes = {
    sharding.shard_shape(leaf.shape)
    for leaf, sharding in zip(
      jax.tree.leaves(shapes), jax.tree.leaves(train.param_shardings(mc, m)), strict=True
    )
  }
  checked_loop_state = 0
  for name, one in per_layer.items():
    assert one in gathers_in_loop or (1,) + one in gathers_in_loop, (name, sorted(gathers))
    assert stacks[name] not in gathers, (name, "gathered whole stack")
    if stacks[name] not in stored_shapes:
      assert stacks[name] not in loop_state, (name, "gathered stack carried by a loop")
      checked_loop_state += 1
  assert checked_loop_state >= 4


def test_logged_learning_rate_follows_the_update_counter_for_any_chain():
  """lr = schedule(n), n = updates applied before (step, skips), whatever the chain's counters.

  The chain holds several `count` leaves (MultiSteps' inner Adam and schedule
  counters advance every 2nd update), so no optimizer-state counter gives n.
  """
  mc = tl.model_config()
  cfg = tl.train_config(mini_batches=2)
  schedule = train.make_schedule(cfg)
  inner = optax.chain(
    optax.clip_by_global_norm(1.0),
    optax.scale_by_adam(),
    optax.scale_by_schedule(lambda n: -schedule(n)),
  )
  optimizer = optax.MultiSteps(inner, every_k_schedule=2).gradient_transformation()
  m = tl.mesh("single")
  step = train.make_train_step(mc, cfg, m, optimizer=optimizer)
  params = policy.init_params(mc, jax.random.PRNGKey(0))
  state = train.create_train_state(
    params, mc, cfg, m, rng=jax.random.PRNGKey(1), optimizer=optimizer
  )
  logprobs = tl.fns("single")[3]
  lrs, skipped = [], []
  for i in range(3):
    batch = tl.prepare(tl.make_batch(i), m, state, logprobs)
    if i == 1:  # every update of this step is skipped
      huge = np.full(tl.BATCH, np.finfo(np.float32).max, np.float32)  # finite; loss overflows
      batch["advantages"] = train.shard_batch({"a": huge}, m)["a"]
    state, metrics = step(state, batch)
    metrics = train.to_host(metrics)
    lrs.append(float(metrics["learning_rate"]))
    skipped.append(int(metrics["skipped"]))
  assert skipped == [0, 2, 0]
  counts = [
    int(leaf)
    for path, leaf in jax.tree_util.tree_leaves_with_path(state.opt_state)
    if getattr(path[-1], "name", None) == "count"
  ]
  assert len(counts) >= 2 and max(counts) < 4  # 4 updates applied, no counter says 4
  s = [float(schedule(n)) for n in range(4)]
  np.testing.assert_allclose(lrs, [(s[0] + s[1]) / 2, s[2], (s[2] + s[3]) / 2], rtol=1e-6)
  assert len(set(lrs)) == 3


def test_step_fn_and_logprobs_fn_trace_inside_another_jit():
  """The pure functions compose into one jitted iteration equal to the host-side calls."""
  m, cfg, step_fn, logprobs = tl.fns("single")
  host = tl.make_batch(0)
  host.pop("rollout_noise")
  batch = train.shard_batch(host, m)

  @jax.jit
  def iteration(state, batch):
    old_logp = logprobs.logprobs_fn(state.params, batch)
    return step_fn.step_fn(state, dict(batch, old_logp=old_logp))

  got_state, got = iteration(tl.init_state(m, cfg), batch)
  state = tl.init_state(m, cfg)
  want_state, want = step_fn(state, dict(batch, old_logp=logprobs(state, batch)))
  assert _max_diff(tl.host_params(got_state), tl.host_params(want_state)) < 1e-6
  got, want = train.to_host(got), train.to_host(want)
  for name in ("loss", "grad_norm", "entropy", "learning_rate"):
    np.testing.assert_allclose(got[name], want[name], rtol=1e-6, err_msg=name)
