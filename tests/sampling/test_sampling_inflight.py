"""In-flight weight updates: `Sampler.generate_requests(params_update=...)` and
`RolloutEngine.collect(params_update=...)` switch params between decode windows
and record each token's policy version."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlx import policy, sampling

MODEL = policy.ModelConfig.small(
  "qwen2", vocab_size=64, hidden_size=32, intermediate_size=64, head_dim=8
)
M = 10
WINDOW = 3


def _config(num_pages=32, stops=()):
  return sampling.SamplerConfig(
    max_slots=2,
    page_size=4,
    num_pages=num_pages,
    max_prompt_len=6,
    max_new_tokens=M,
    steps_per_sync=WINDOW,
    prefill_chunk=8,
    temperature=1.0,
    stop_token_ids=stops,
  )


def _params(seed):
  p = policy.init_params(MODEL, jax.random.key(0))
  noise = np.random.default_rng(seed)
  return jax.tree.map(lambda x: x + jnp.asarray(0.3 * noise.normal(size=x.shape), x.dtype), p)


PROMPTS = [[11, 12, 13, 14, 15], [21, 22, 23], [31, 32, 33, 34], [41, 42]]


def _generate(sampler, params, update=None, version=0):
  n = len(PROMPTS)
  return sampler.generate_requests(
    params,
    PROMPTS,
    prompt_index=list(range(n)),
    sample_index=[0] * n,
    rng=jax.random.key(3),
    policy_version=version,
    params_update=update,
  )


def _once(params, version):
  """A `params_update` that hands over (params, version) at its first call only."""
  calls = []

  def update():
    calls.append(1)
    return (params, version) if len(calls) == 1 else None

  return update, calls


@pytest.mark.parametrize("num_pages", [32, 6], ids=["roomy", "preempting"])
def test_same_values_under_a_new_version_change_nothing_but_the_versions(num_pages):
  """The update lands between windows: rows running then switch after their first window's
  tokens, rows admitted later are all the new version, and the samples are unchanged."""
  sampler = sampling.Sampler(MODEL, _config(num_pages))
  params = _params(0)
  plain = _generate(sampler, params, version=5)
  copy = jax.tree.map(jnp.array, params)  # new buffers, same values
  update, calls = _once(copy, 7)
  out = _generate(sampler, params, update, version=5)
  np.testing.assert_array_equal(out.tokens, plain.tokens)
  np.testing.assert_array_equal(out.logprobs, plain.logprobs)
  # Asked after every window but the last (which leaves nothing to run).
  assert out.stats["params_updates"] == 1 and len(calls) == out.stats["syncs"] - 1
  assert (plain.versions[:, :M] == 5).all()  # no update: every token is the call's version
  for r in range(len(PROMPTS)):
    v = out.versions[r, : out.lengths[r]]
    assert set(v.tolist()) <= {5, 7} and (np.diff(v) >= 0).all()
  # Rows 0 and 1 held the two slots during the first window: its WINDOW tokens are version 5.
  for r in (0, 1):
    np.testing.assert_array_equal(out.versions[r], [5] * WINDOW + [7] * (M - WINDOW))
  # Rows 2 and 3 waited in the queue: every token of theirs is the new version's.
  assert (out.versions[2:] == 7).all()
  if num_pages == 6:
    assert out.stats["preemptions"] > 0


def test_new_params_take_over_in_flight_and_rows_admitted_later_are_theirs_alone():
  sampler = sampling.Sampler(MODEL, _config())
  old, new = _params(0), _params(1)
  only_old = _generate(sampler, old)
  only_new = _generate(sampler, new, version=1)
  update, _ = _once(new, 1)
  out = _generate(sampler, old, update)
  # The first window is the old policy's, token for token.
  np.testing.assert_array_equal(out.tokens[:2, :WINDOW], only_old.tokens[:2, :WINDOW])
  np.testing.assert_allclose(out.logprobs[:2, :WINDOW], only_old.logprobs[:2, :WINDOW], atol=1e-6)
  # After it the running rows sample from the new params (over K/V the old ones cached).
  assert not np.allclose(out.logprobs[:2, WINDOW:], only_old.logprobs[:2, WINDOW:], atol=1e-3)
  # Rows admitted after the update (their prompts prefilled by the new params) equal a run
  # with the new params from the start: the same per-(prompt, sample, position) randomness.
  np.testing.assert_array_equal(out.tokens[2:], only_new.tokens[2:])
  np.testing.assert_allclose(out.logprobs[2:], only_new.logprobs[2:], atol=1e-5)
  np.testing.assert_array_equal(out.versions[2:], only_new.versions[2:])


def test_a_sample_admitted_after_an_update_does_not_share_the_older_prompt_pages():
  """Three samples of one prompt, two slots: the third is admitted after the update. Its
  prompt K/V is the new params' (the older prompt pages are not shared), so it equals a run
  with the new params from the start."""
  sampler = sampling.Sampler(MODEL, _config())

  def generate(params, update=None, version=0):
    return sampler.generate_requests(
      params, [PROMPTS[0]] * 3, prompt_index=[0, 0, 0], sample_index=[0, 1, 2],
      rng=jax.random.key(3), policy_version=version, params_update=update,
    )  # fmt: skip

  old, new = _params(0), _params(1)
  only_new = generate(new, version=1)
  update, _ = _once(new, 1)
  out = generate(old, update)
  assert (out.versions[2] == 1).all()
  np.testing.assert_array_equal(out.tokens[2], only_new.tokens[2])
  np.testing.assert_allclose(out.logprobs[2], only_new.logprobs[2], atol=1e-5)
  # The two samples admitted first shared the old prompt pages and switched in flight.
  np.testing.assert_array_equal(out.versions[:2, :WINDOW], 0)


def test_a_resumed_prefix_keeps_version_minus_one_and_new_tokens_are_versioned():
  sampler = sampling.Sampler(MODEL, _config())
  params = _params(0)
  update, _ = _once(params, 4)
  out = sampler.generate_requests(
    params,
    PROMPTS[:1],
    prompt_index=[0],
    sample_index=[0],
    rng=jax.random.key(3),
    prefix_tokens=[[20, 21]],
    prefix_logprobs=[[-1.0, -2.0]],
    policy_version=3,
    params_update=update,
  )
  np.testing.assert_array_equal(out.versions[0], [-1, -1] + [3] * WINDOW + [4] * (M - 2 - WINDOW))


@pytest.mark.parametrize(
  ("kwargs", "match"),
  [
    ({"params_update": 3}, "`params_update` must be callable"),
    ({"policy_version": -1}, "`policy_version` must be an int >= 0"),
    ({"policy_version": 1.0}, "`policy_version` must be an int >= 0"),
    ({"params_update": lambda: "params"}, r"None or a \(params, version\) pair"),
    ({"policy_version": 2, "params_update": lambda: (_params(0), 1)}, "older than the current 2"),
    ({"params_update": lambda: (_params(0), -3)}, "version` must be an int >= 0"),
  ],
)
def test_bad_updates_are_named(kwargs, match):
  sampler = sampling.Sampler(MODEL, _config())
  with pytest.raises(ValueError, match=match):
    sampler.generate_requests(
      _params(0), PROMPTS, prompt_index=[0, 1, 2, 3], sample_index=[0] * 4,
      rng=jax.random.key(0), **kwargs,
    )  # fmt: skip


def test_rollout_engine_records_the_in_flight_versions_and_measures_staleness_from_the_newest():
  sampler = sampling.Sampler(MODEL, _config(stops=(1, 2, 3, 4, 5, 6, 7, 8)))
  engine = sampling.RolloutEngine(sampler, num_samples=2, target_groups=2, over_provision=2.0)
  keys = iter(range(100))

  def source(n):
    return [(k, [9 + k % 50, 10 + k % 40, 11]) for k in (next(keys) for _ in range(n))]

  params = _params(0)
  update, _ = _once(params, 1)
  out = engine.collect(params, source, jax.random.key(0), policy_version=0, params_update=update)
  assert out.stats["params_updates"] == 1 and out.stats["policy_version"] == 1
  on = np.arange(M)[None, :] < out.lengths[:, None]
  assert set(np.unique(out.versions[on]).tolist()) <= {0, 1}
  assert (out.versions[~on] == -1).all()
  np.testing.assert_array_equal(out.staleness[on], 1 - out.versions[on])
  # The buffer keeps the versions it recorded; the next collection starts at the newest.
  out2 = engine.collect(params, source, jax.random.key(1), policy_version=1)
  on2 = np.arange(M)[None, :] < out2.lengths[:, None]
  assert set(np.unique(out2.versions[on2]).tolist()) <= {0, 1}
  with pytest.raises(ValueError, match="older than a buffered token's version"):
    engine.collect(params, source, jax.random.key(2), policy_version=0)
