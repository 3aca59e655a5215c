"""Bad input and misuse: clear errors before dispatch, and a state that owns its buffers."""

import jax
import numpy as np
import pytest
import train_testlib as tl

from rlx import policy, train


def _good_batch(m, state, logprobs):
  return tl.prepare(tl.make_batch(0), m, state, logprobs)


@pytest.mark.parametrize("bad_id", [-1, -100, tl.VOCAB, tl.VOCAB + 7])
@pytest.mark.parametrize("on_device", [False, True])
def test_token_ids_out_of_range_are_rejected_before_dispatch(bad_id, on_device):
  m, cfg, step_fn, logprobs = tl.fns("single")
  state = tl.init_state(m, cfg)
  batch = {k: np.array(v) for k, v in _good_batch(m, state, logprobs).items()}
  row, col = 3, int(np.argmax(batch["loss_mask"][3]))  # a response token
  batch["tokens"][row, col] = bad_id
  if on_device:
    batch = train.shard_batch(batch, m)
  match = rf"batch\['tokens'\]` ids must be in \[0, vocab_size={tl.VOCAB}\)"
  with pytest.raises(ValueError, match=match):
    step_fn(state, batch)
  with pytest.raises(ValueError, match=match):
    logprobs(state, batch)
  # Nothing ran: the state was not donated and is still usable.
  assert not jax.tree.leaves(state.params)[0].is_deleted()
  assert int(state.step) == 0


@pytest.mark.parametrize("bad_id", [-1, tl.VOCAB])
def test_token_ids_out_of_range_inside_a_traced_step_never_train_on_another_token(bad_id):
  """The pure step has no host checks: a bad id gives a NaN loss, so the update is skipped."""
  m, cfg, step_fn, logprobs = tl.fns("single")
  state = tl.init_state(m, cfg)
  batch = {k: np.array(v) for k, v in _good_batch(m, state, logprobs).items()}
  row, col = 3, int(np.argmax(batch["loss_mask"][3]))  # a response token
  batch["tokens"][row, col] = bad_id
  new_state, metrics = jax.jit(step_fn.step_fn)(state, train.shard_batch(batch, m))
  metrics = train.to_host(metrics)
  assert not np.isfinite(metrics["loss"])
  assert metrics["skipped"] == 1
  for got, want in zip(tl.host_params(new_state), tl.host_params(state), strict=True):
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("bad_value", [0.5, 2.0, -1.0])
@pytest.mark.parametrize("on_device", [False, True])
def test_a_loss_mask_that_is_not_0_1_is_rejected(bad_value, on_device):
  m, cfg, step_fn, logprobs = tl.fns("single")
  state = tl.init_state(m, cfg)
  batch = {k: np.array(v) for k, v in _good_batch(m, state, logprobs).items()}
  batch["loss_mask"][2, int(np.argmax(batch["loss_mask"][2]))] = bad_value
  if on_device:
    batch = train.shard_batch(batch, m)
  match = r"`batch\['loss_mask'\]` must be bool or 0/1, got 1 other value"
  with pytest.raises(ValueError, match=match):
    step_fn(state, batch)
  with pytest.raises(ValueError, match=match):
    logprobs(state, batch)


@pytest.mark.parametrize("shape", [(0, tl.SEQ), (tl.BATCH, 0)])
def test_zero_size_batches_name_the_argument(shape):
  m, cfg, step_fn, logprobs = tl.fns("single")
  state = tl.init_state(m, cfg)
  b, s = shape
  batch = {
    "tokens": np.zeros((b, s), np.int32),
    "loss_mask": np.zeros((b, s), np.float32),
    "advantages": np.zeros((b,), np.float32),
    "old_logp": np.zeros((b, s), np.float32),
  }
  with pytest.raises(ValueError, match=r"`batch\['tokens'\]` is empty \(shape \["):
    step_fn(state, batch)
  with pytest.raises(ValueError, match=r"`batch\['tokens'\]` is empty"):
    logprobs(state, batch)
  with pytest.raises(ValueError, match=r"`batch\['tokens'\]` is empty"):
    train.shard_batch(batch, m)


@pytest.mark.parametrize("layout", ["single", "data2", "data8"])
@pytest.mark.parametrize("kind", ["host", "device", "shard_params"])
def test_state_owns_its_buffers_so_the_reference_params_survive_donation(layout, kind):
  """The KL-reference workflow: log-probs from the original params after donating steps.

  On a mesh of several devices, placing one-device params replicated used to
  reuse their buffer for the first replica, so the donating step deleted them.
  """
  m, cfg, step_fn, logprobs = tl.fns(layout)
  mc = tl.model_config()
  params = policy.init_params(mc, jax.random.PRNGKey(0))  # on the default device
  if kind == "host":
    params = jax.tree.map(np.array, params)
  elif kind == "shard_params":
    params = train.shard_params(params, mc, m)  # already placed
  before = [np.array(x) for x in jax.tree.leaves(params)]
  state = train.create_train_state(params, mc, cfg, m, rng=jax.random.PRNGKey(1))
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(state.params), strict=True):
    assert not tl.shares_buffer(a, b)
  ref = train.shard_params(params, mc, m)
  for i in range(2):
    batch = tl.prepare(tl.make_batch(i), m, state, logprobs, ref_params=ref)
    state, _ = step_fn(state, batch)  # donates `state`
  leaves = jax.tree.leaves(params)
  assert not any(isinstance(x, jax.Array) and x.is_deleted() for x in leaves)
  for got, want in zip(leaves, before, strict=True):
    np.testing.assert_array_equal(np.asarray(got), want)
  want = np.asarray(logprobs(params, batch))
  np.testing.assert_array_equal(np.asarray(batch["ref_logp"]), want)


def test_params_or_state_of_another_model_config_are_rejected():
  m, cfg, step_fn, logprobs = tl.fns("single")
  mc = tl.model_config()
  other = policy.ModelConfig.small(
    vocab_size=tl.VOCAB,
    hidden_size=48,
    intermediate_size=64,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
  )
  wrong = policy.init_params(other, jax.random.PRNGKey(0))
  with pytest.raises(ValueError, match="`params` does not match the config: .*has shape"):
    train.create_train_state(wrong, mc, cfg, m, rng=jax.random.PRNGKey(1))
  state = tl.init_state(m, cfg)
  batch = _good_batch(m, state, logprobs)
  with pytest.raises(ValueError, match="`params` does not match the config"):
    logprobs(wrong, batch)
  # A state built for the other config reaches the step: named before dispatch.
  wrong_state = train.create_train_state(wrong, other, cfg, m, rng=jax.random.PRNGKey(1))
  with pytest.raises(ValueError, match=r"`state.params\['embed'\]\['embedding'\]` is float32"):
    step_fn(wrong_state, batch)
  # Params of the right shapes in another dtype: named at creation.
  half = jax.tree.map(
    lambda x: x.astype(jax.numpy.bfloat16), policy.init_params(mc, jax.random.PRNGKey(0))
  )
  with pytest.raises(ValueError, match=r"`params\['embed'\]\['embedding'\]` is bfloat16"):
    train.create_train_state(half, mc, cfg, m, rng=jax.random.PRNGKey(1))
  # An optimizer state of another optimizer, likewise.
  with pytest.raises(ValueError, match="`state` has tree structure"):
    step_fn(state.replace(opt_state=state.opt_state[1]), batch)


def test_a_donated_state_is_named_not_a_raw_deleted_buffer_error():
  m, cfg, step_fn, logprobs = tl.fns("single")
  state = tl.init_state(m, cfg)
  batch = _good_batch(m, state, logprobs)
  new_state, _ = step_fn(state, batch)
  with pytest.raises(ValueError, match=r"`state.step` was deleted: .*donated"):
    step_fn(state, batch)
  with pytest.raises(ValueError, match=r"`params\['embed'\]\['embedding'\]` was deleted"):
    logprobs(state, batch)
  step_fn(new_state, dict(batch, old_logp=logprobs(new_state, batch)))


@pytest.mark.parametrize(
  "key, value, what",
  [
    ("advantages", np.nan, "must be finite on loss tokens"),
    ("advantages", -np.inf, "must be finite on loss tokens"),
    ("old_logp", np.nan, "must be finite on loss tokens"),
    ("old_logp", 1e-3, "is a log-probability and must be <= 0"),
    ("rollout_logp", np.inf, "must be finite on loss tokens"),
    ("ref_logp", 0.5, "is a log-probability and must be <= 0"),
  ],
)
@pytest.mark.parametrize("on_device", [False, True])
def test_bad_float_values_on_loss_tokens_are_named_with_their_index(key, value, what, on_device):
  m, cfg, step_fn, logprobs = tl.fns("single")
  state = tl.init_state(m, cfg)
  batch = {k: np.array(v) for k, v in _good_batch(m, state, logprobs).items()}
  batch["rollout_logp"], batch["ref_logp"] = batch["old_logp"].copy(), batch["old_logp"].copy()
  row, col = 5, int(np.argmax(batch["loss_mask"][5])) + 1  # a loss token
  assert batch["loss_mask"][row, col] == 1
  if key == "advantages":
    batch[key][row] = value
    where = "row 5"
  else:
    batch[key][row, col] = value
    where = rf"\[5, {col}\]"
  if on_device:
    batch = train.shard_batch(batch, m)
  with pytest.raises(ValueError, match=rf"`batch\['{key}'\]` {what}.* 1 .*the first at {where}"):
    step_fn(state, batch)
  assert not jax.tree.leaves(state.params)[0].is_deleted()  # nothing ran


def test_nan_in_padding_is_allowed_and_gives_the_clean_result():
  m, cfg, step_fn, logprobs = tl.fns("single")
  clean = {k: np.array(v) for k, v in _good_batch(m, tl.init_state(m, cfg), logprobs).items()}
  padding = clean["loss_mask"] == 0
  dirty = {k: v.copy() for k, v in clean.items()}
  dirty["old_logp"][padding] = np.nan
  outputs = []
  for batch in (clean, dirty, train.shard_batch(dirty, m)):
    state, metrics = step_fn(tl.init_state(m, cfg), batch)
    outputs.append((tl.host_params(state), train.to_host(metrics)))
  for params, metrics in outputs[1:]:
    assert metrics["skipped"] == 0
    np.testing.assert_array_equal(metrics["loss"], outputs[0][1]["loss"])
    for got, want in zip(params, outputs[0][0], strict=True):
      np.testing.assert_array_equal(got, want)
  # Any value in padding passes the check, for every float key; so does a
  # log-probability a hair above 0 on a loss token (rounding slack).
  other = dict(dirty, advantages=np.where(padding, np.nan, clean["advantages"][:, None]))
  other["rollout_logp"] = np.where(padding, np.inf, clean["old_logp"])
  other["ref_logp"] = np.where(padding, 5.0, 1e-7)
  for batch in (other, train.shard_batch(other, m)):
    step_fn.check_and_place(tl.init_state(m, cfg), batch)  # the host checks of a call


@pytest.mark.parametrize(
  "key, value, match",
  [
    ("advantages", np.array(["a"] * tl.BATCH), r"`batch\['advantages'\]` must be a floating"),
    ("old_logp", np.zeros((tl.BATCH, tl.SEQ), np.int32), r"`batch\['old_logp'\]` must be a float"),
    ("ref_logp", np.zeros((tl.BATCH, tl.SEQ), bool), r"`batch\['ref_logp'\]` must be a floating"),
    ("positions", np.zeros((tl.BATCH, tl.SEQ), np.float32), r"`batch\['positions'\]` must be an"),
    ("segment_ids", np.ones((tl.BATCH, tl.SEQ)), r"`batch\['segment_ids'\]` must be an int"),
    ("loss_mask", np.full((tl.BATCH, tl.SEQ), "1"), r"`batch\['loss_mask'\]` must be a bool"),
  ],
)
def test_batch_dtypes_are_named(key, value, match):
  m, cfg, step_fn, logprobs = tl.fns("single")
  state = tl.init_state(m, cfg)
  batch = dict(_good_batch(m, state, logprobs), **{key: value})
  with pytest.raises(ValueError, match=match):
    step_fn(state, batch)
  if key in ("positions", "segment_ids", "loss_mask"):  # inputs of the forward too
    with pytest.raises(ValueError, match=match):
      logprobs(state, batch)
  if value.dtype.kind != "U":  # JAX traces no strings
    with pytest.raises(ValueError, match=match):  # at trace time too
      jax.eval_shape(step_fn.step_fn, state, batch)


def test_device_batches_are_reduced_once_per_new_array():
  """Device arrays found valid are not read again; a new one under a checked key is.

  Reads are observed with deleted arrays: reading one raises, so a check that
  passes over deleted arrays read none of them.
  """
  m, cfg, step_fn, logprobs = tl.fns("single")
  state = tl.init_state(m, cfg)
  batch = tl.make_batch(0)
  batch.pop("rollout_noise")
  batch = train.shard_batch(batch, m)
  host_mask = np.asarray(batch["loss_mask"])
  batch["old_logp"] = logprobs(state, batch)  # tokens + mask reduced
  # New arrays are read: a deleted new float array fails the check.
  gone = train.shard_batch({"old_logp": np.asarray(batch["old_logp"])}, m)["old_logp"]
  gone.delete()
  with pytest.raises(RuntimeError, match="deleted"):
    step_fn.check_and_place(state, dict(batch, old_logp=gone))
  step_fn.check_and_place(state, batch)  # the float keys are new: reduced with tokens + mask
  # A new array under a checked key is checked again (the cache is by identity).
  old = np.array(batch["old_logp"])
  old[0, int(np.argmax(host_mask[0]))] = np.nan
  bad = dict(batch, old_logp=train.shard_batch({"old_logp": old}, m)["old_logp"])
  with pytest.raises(ValueError, match=r"`batch\['old_logp'\]` must be finite"):
    step_fn.check_and_place(state, bad)
  # Nothing new: no array of the batch is read (deleted, they all pass), and they are
  # placed as they are.
  for x in batch.values():
    x.delete()
  placed = step_fn.check_and_place(state, batch)
  assert all(placed[k] is batch[k] for k in batch)
