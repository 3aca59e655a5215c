"""Partial rollouts: `Sampler.generate_requests` (resume + early stop) and `RolloutEngine`.

A tiny random model with several stop tokens gives a geometric (long-tail)
length distribution: most samples stop after a few tokens, some run to
max_new_tokens, so over-provisioned collections stop early and recycle groups.
"""

import dataclasses
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlx import policy, sampling, train

MODEL = policy.ModelConfig.small(
  "qwen2", vocab_size=64, hidden_size=32, intermediate_size=64, head_dim=8
)
STOPS = (1, 2, 3, 4, 5, 6, 7, 8)
CFG = sampling.SamplerConfig(
  max_slots=4,
  page_size=4,
  num_pages=48,
  max_prompt_len=8,
  max_new_tokens=12,
  steps_per_sync=2,
  prefill_chunk=8,
  temperature=1.0,
  stop_token_ids=STOPS,
)
G = 2
_token_logprobs = jax.jit(policy.token_logprobs, static_argnums=1)


def _params(seed):
  p = policy.init_params(MODEL, jax.random.key(0))
  noise = np.random.default_rng(seed)
  return jax.tree.map(lambda x: x + jnp.asarray(0.3 * noise.normal(size=x.shape), x.dtype), p)


@pytest.fixture(scope="module")
def params():
  return _params(0)


def _prompt(key):
  rng = np.random.default_rng(1000 + key)
  return rng.integers(9, MODEL.vocab_size, size=int(rng.integers(2, CFG.max_prompt_len + 1)))


class _Source:
  """Prompts keyed 0, 1, 2, ...; records every key handed out."""

  def __init__(self):
    self.next = 0
    self.pulled = []

  def __call__(self, n):
    keys = list(range(self.next, self.next + n))
    self.next += n
    self.pulled += keys
    return [(k, _prompt(k).tolist()) for k in keys]


def _teacher_forced_logp(params, out, r, lo, hi):
  """log p of row r's response tokens [lo, hi) under `params` (full-vocab softmax, T = 1)."""
  p = int(out.prompt_lengths[r])
  seq = np.zeros((1, CFG.max_prompt_len + CFG.max_new_tokens), np.int32)
  seq[0, :p] = out.prompt_tokens[r, :p]
  seq[0, p : p + out.lengths[r]] = out.tokens[r, : out.lengths[r]]
  mask = np.zeros_like(seq)
  mask[0, p + lo : p + hi] = 1
  logp, _ = _token_logprobs(params, MODEL, jnp.asarray(seq), jnp.asarray(mask))
  return np.asarray(logp)[0, p + lo : p + hi]


def test_generate_requests_stop_and_resume_equals_uninterrupted(params):
  sampler = sampling.Sampler(MODEL, CFG)
  prompts = [_prompt(k).tolist() for k in range(3)]
  key = jax.random.key(5)
  full = sampler.generate(params, prompts, num_samples=G, rng=key)
  pi = np.repeat(np.arange(3), G)
  si = np.tile(np.arange(G), 3)
  rows = [prompts[i] for i in pi]
  part = sampler.generate_requests(
    params, rows, prompt_index=pi, sample_index=si, rng=key, stop_when=lambda done: True
  )
  assert part.stats["stopped_early"] and "unfinished" in part.finish_reason
  assert (part.lengths <= CFG.steps_per_sync).all() and part.lengths.max() > 0
  for r in range(len(rows)):  # each prefix is a prefix of the uninterrupted sample
    n = part.lengths[r]
    np.testing.assert_array_equal(part.tokens[r, :n], full.tokens[r, :n])
  todo = [r for r in range(len(rows)) if part.finish_reason[r] == "unfinished"]
  rest = sampler.generate_requests(
    params,
    [rows[r] for r in todo],
    prompt_index=pi[todo],
    sample_index=si[todo],
    prefix_tokens=[part.tokens[r, : part.lengths[r]] for r in todo],
    prefix_logprobs=[part.logprobs[r, : part.lengths[r]] for r in todo],
    rng=key,
  )
  assert rest.stats["generated_tokens"] == int(rest.lengths.sum() - part.lengths[todo].sum())
  for k, r in enumerate(todo):
    np.testing.assert_array_equal(rest.tokens[k], full.tokens[r])
    np.testing.assert_allclose(rest.logprobs[k], full.logprobs[r], atol=1e-5)
    assert rest.finish_reason[k] == full.finish_reason[r]


def test_generate_requests_rejects_bad_rows(params):
  sampler = sampling.Sampler(MODEL, CFG)
  key = jax.random.key(0)
  ok = dict(prompt_index=[0, 1], sample_index=[0, 0], rng=key)
  with pytest.raises(ValueError, match="prompt_index"):
    sampler.generate_requests(params, [[9], [10]], **{**ok, "prompt_index": [0]})
  with pytest.raises(ValueError, match="unique"):
    sampler.generate_requests(params, [[9], [9]], **{**ok, "prompt_index": [0, 0]})
  with pytest.raises(ValueError, match="different prompts"):
    sampler.generate_requests(
      params, [[9], [10]], **{**ok, "prompt_index": [0, 0], "sample_index": [0, 1]}
    )
  with pytest.raises(ValueError, match="together"):
    sampler.generate_requests(params, [[9], [10]], prefix_tokens=[[], []], **ok)
  with pytest.raises(ValueError, match="max_new_tokens"):
    sampler.generate_requests(
      params, [[9], [10]], prefix_tokens=[[9] * 12, []], prefix_logprobs=[[-1.0] * 12, []], **ok
    )
  with pytest.raises(ValueError, match=r"prefix_logprobs\[0\]"):
    sampler.generate_requests(
      params, [[9], [10]], prefix_tokens=[[9], []], prefix_logprobs=[[], []], **ok
    )
  with pytest.raises(ValueError, match="vocab"):
    sampler.generate_requests(
      params, [[9], [10]], prefix_tokens=[[64], []], prefix_logprobs=[[-1.0], []], **ok
    )


def test_engine_rejects_bad_arguments(params):
  sampler = sampling.Sampler(MODEL, CFG)
  with pytest.raises(ValueError, match="over_provision"):
    sampling.RolloutEngine(sampler, num_samples=G, target_groups=2, over_provision=0.5)
  with pytest.raises(ValueError, match="target_groups"):
    sampling.RolloutEngine(sampler, num_samples=G, target_groups=0)
  engine = sampling.RolloutEngine(sampler, num_samples=G, target_groups=2, over_provision=2.0)
  with pytest.raises(ValueError, match="returned 1 prompts"):
    engine.collect(params, lambda n: [(0, [9])], jax.random.key(0), policy_version=0)
  with pytest.raises(ValueError, match="key"):
    engine.collect(params, lambda n: [("a", [9])] * n, jax.random.key(0), policy_version=0)
  with pytest.raises(ValueError, match="shape"):
    engine.load_state_dict({**engine.state_dict(), "tokens": np.zeros((1, 2, 3), np.int32)})


def test_partial_rollouts_lose_nothing_and_keep_versions(params, tmp_path):
  """Several collects, a new policy each time: exactly-once, per-token versions and log-probs."""
  sampler = sampling.Sampler(MODEL, CFG)
  target = 3
  engine = sampling.RolloutEngine(sampler, num_samples=G, target_groups=target, over_provision=2.0)
  source = _Source()
  versions = [_params(v) for v in range(4)]
  returned, mixed, resumed = [], 0, 0
  for v, p in enumerate(versions):
    out = engine.collect(p, source, jax.random.key(10 + v), policy_version=v)
    st = out.stats
    assert out.tokens.shape == (target * G, CFG.max_new_tokens)
    assert st["groups_returned"] == target
    assert st["groups_fresh"] + st["groups_resumed"] == engine.launch_groups
    assert len(source.pulled) == len(set(returned)) + target + engine.buffered_groups
    assert 0 < st["slot_utilisation"] <= 1
    resumed += st["groups_resumed"]
    returned += out.keys.tolist()
    for r in range(target * G):
      n = out.lengths[r]
      ver = out.versions[r, :n]
      assert (ver >= 0).all() and (out.versions[r, n:] == -1).all()
      assert (np.diff(ver) >= 0).all() and ver.max() <= v
      np.testing.assert_array_equal(out.staleness[r, :n], v - ver)
      # A row ends exactly once: a stop token last, or max_new_tokens.
      if out.stopped[r]:
        assert out.tokens[r, n - 1] in STOPS and not np.isin(out.tokens[r, : n - 1], STOPS).any()
      else:
        assert n == CFG.max_new_tokens and not np.isin(out.tokens[r, :n], STOPS).any()
      mixed += len(set(ver.tolist())) > 1
      for u in set(ver.tolist()):  # each segment's log-probs are its own policy's
        lo, hi = np.flatnonzero(ver == u)[[0, -1]]
        np.testing.assert_allclose(
          out.logprobs[r, lo : hi + 1],
          _teacher_forced_logp(versions[u], out, r, lo, hi + 1),
          atol=2e-4,
        )
    # Rows of one group share its prompt; groups are the keys' prompts.
    for gi, k in enumerate(out.keys):
      for j in range(G):
        r = gi * G + j
        np.testing.assert_array_equal(out.prompt_tokens[r, : out.prompt_lengths[r]], _prompt(k))
    hist = st["staleness_histogram"]
    assert sum(hist.values()) == st["response_tokens"] == int(out.lengths.sum())
    assert st["off_policy_token_fraction"] == pytest.approx(
      1 - hist.get(0, 0) / st["response_tokens"]
    )
  assert resumed > 0 and mixed > 0, (resumed, mixed)  # the long tail was recycled and resumed
  # Every pulled prompt is returned exactly once or still buffered: nothing dropped or repeated.
  assert len(returned) == len(set(returned))
  assert sorted(returned + engine.buffer_keys()) == source.pulled
  assert engine.buffered_groups > 0
  # Resumed prefixes, early stops and new params never recompile the decode loop.
  assert sampler.compile_counts()["decode"] == 1
  assert sampler.compile_counts()["prefill"] == 1  # max_slots <= 8: one row bucket

  # The buffer round-trips through an orbax checkpoint bit-exactly, and both copies continue alike.
  mesh = train.make_mesh(1, 1, 1, devices=jax.devices()[:1])
  tcfg = train.get_config()
  state = train.create_train_state(params, MODEL, tcfg, mesh, rng=jax.random.PRNGKey(0))
  saved = engine.state_dict()
  with train.Checkpointer(str(tmp_path / "ckpt")) as ckpt:
    ckpt.save(1, state, data_cursor={"next": source.next}, extra=saved, force=True)
  with train.Checkpointer(str(tmp_path / "ckpt")) as ckpt:
    restored = ckpt.restore(state, extra_target=engine.state_dict())
  other = sampling.RolloutEngine(sampler, num_samples=G, target_groups=target, over_provision=2.0)
  other.load_state_dict(restored.extra)
  again = other.state_dict()
  assert set(again) == set(saved)
  for k in saved:
    assert again[k].dtype == saved[k].dtype
    np.testing.assert_array_equal(again[k], saved[k], err_msg=k)
  src_a, src_b = _Source(), _Source()
  src_a.next = src_b.next = restored.data_cursor["next"]
  a = engine.collect(versions[-1], src_a, jax.random.key(99), policy_version=4)
  b = other.collect(versions[-1], src_b, jax.random.key(99), policy_version=4)
  for name in ("keys", "tokens", "logprobs", "versions", "lengths", "stopped"):
    np.testing.assert_array_equal(getattr(a, name), getattr(b, name), err_msg=name)
  with pytest.raises(ValueError, match="must not decrease"):
    engine.collect(versions[0], _Source(), jax.random.key(0), policy_version=0)


def test_greedy_resumed_samples_equal_uninterrupted_ones(params):
  # A tight pool (8 pages for 4 slots): resumed rows are also preempted and re-prefilled.
  cfg = dataclasses.replace(CFG, temperature=0.0, stop_token_ids=tuple(range(1, 17)), num_pages=8)
  sampler = sampling.Sampler(MODEL, cfg)
  engine = sampling.RolloutEngine(sampler, num_samples=G, target_groups=2, over_provision=2.0)
  source = _Source()
  got, resumed, preempted = {}, 0, 0
  for v in range(3):
    out = engine.collect(params, source, jax.random.key(v), policy_version=v)
    resumed += int((out.versions[out.versions >= 0] < v).sum())
    preempted += out.stats["preemptions"]
    for gi, k in enumerate(out.keys):
      got[int(k)] = (out.tokens[gi * G : gi * G + G], out.logprobs[gi * G : gi * G + G])
  assert resumed > 0 and preempted > 0
  keys = sorted(got)
  ref = sampler.generate(
    params, [_prompt(k).tolist() for k in keys], num_samples=G, rng=jax.random.key(0)
  )
  for i, k in enumerate(keys):
    np.testing.assert_array_equal(got[k][0], ref.tokens[i * G : i * G + G], err_msg=str(k))
    np.testing.assert_allclose(got[k][1], ref.logprobs[i * G : i * G + G], atol=1e-5)


def test_over_provision_one_is_synchronous(params):
  sampler = sampling.Sampler(MODEL, CFG)
  engine = sampling.RolloutEngine(sampler, num_samples=G, target_groups=3, over_provision=1.0)
  source = _Source()
  for v in range(2):
    out = engine.collect(params, source, jax.random.key(v), policy_version=v)
    assert engine.buffered_groups == 0 and out.stats["off_policy_token_fraction"] == 0
    assert out.keys.tolist() == list(range(3 * v, 3 * v + 3))
    assert (out.versions[out.versions >= 0] == v).all()


def test_interrupted_collect_keeps_the_pulled_prompts(params, monkeypatch):
  sampler = sampling.Sampler(MODEL, CFG)
  engine = sampling.RolloutEngine(sampler, num_samples=G, target_groups=2, over_provision=1.5)
  source = _Source()

  def interrupted(*args, **kwargs):
    raise KeyboardInterrupt

  monkeypatch.setattr(sampler, "generate_requests", interrupted)
  with pytest.raises(KeyboardInterrupt):
    engine.collect(params, source, jax.random.key(0), policy_version=0)
  assert engine.buffer_keys() == source.pulled == [0, 1, 2]
  assert int(engine.state_dict()["count"]) == 3


def test_bench_partial_rollout_runs(tmp_path):
  """experiments/bench_partial_rollout.py end to end on a shrunken setting."""
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  out = tmp_path / "table.md"
  proc = subprocess.run(
    [
      sys.executable,
      os.path.join(root, "experiments", "bench_partial_rollout.py"),
      "--target_groups=2",
      "--group=2",
      "--slots=4",
      "--max_new_tokens=8",
      "--vocab=64",
      "--stop_ids=8",
      "--rounds=1",
      "--warmup=1",
      "--prefill_chunk=16",
      f"--out={out}",
    ],
    env=dict(os.environ, JAX_PLATFORMS="cpu"),
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  rows = [line for line in out.read_text().splitlines() if line.startswith("| 16 |")]
  names = [r.split("|")[2].strip() for r in rows]
  assert names == [
    "synchronous (static batching)",
    "continuous batching",
    "partial rollout 1.5x",
    "partial rollout 2x",
  ]
