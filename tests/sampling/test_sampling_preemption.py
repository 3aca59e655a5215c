"""Scheduling end to end: preemption, prefix sharing and their page accounting, FP8 KV.

Every case compares against a reference the scheduling must not change: the
same sampler config with a pool big enough that nothing is preempted (same
rng, so the same tokens: a sample's keys depend only on (prompt, sample,
position)), a row generated alone, or the trainer's teacher-forced log-probs.
A wrapper around `rlx.sampling.scheduling.Scheduler.end_window` (which the sampler
calls with each decode window's result) checks the page state going into and
coming out of every decode window (no page free twice, none leaked, reference
counts = slot references (running slots, and slots finished in the window,
whose pages the host releases after it) + at most one prompt holder's) and
that the pool is whole again once the last window's finished slots are released.

Same tiny model as tests/sampling/test_sampling_sampler.py (so the engines of
matching configs are shared in one session).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlx import policy, sampling
from rlx.sampling import scheduling

MODEL = policy.ModelConfig.small(
  "qwen2", vocab_size=64, hidden_size=32, intermediate_size=64, head_dim=8
)
SAMPLED = sampling.SamplerConfig(
  max_slots=4,
  page_size=4,
  num_pages=48,
  max_prompt_len=12,
  max_new_tokens=8,
  steps_per_sync=4,
  prefill_chunk=8,
  temperature=1.0,
)
PROMPTS = [[1, 2, 3, 4, 5], [7], [3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14], [5, 6], [9, 8, 7, 6]]
# m = 9 prefilled tokens: 2 full pages shared by every sample, a partial one copied per sample.
SHARED_PROMPT = [5, 1, 2, 3, 4, 5, 6, 7, 8, 9]

_token_logprobs = jax.jit(policy.token_logprobs, static_argnums=1)


@pytest.fixture(scope="module")
def params():
  p = policy.init_params(MODEL, jax.random.key(0))
  noise = np.random.default_rng(0)
  return jax.tree.map(lambda x: x + jnp.asarray(0.3 * noise.normal(size=x.shape), x.dtype), p)


@pytest.fixture(scope="module")
def samplers():
  """Samplers by pool size (48: never preempts on these requests; 10 and 5: preempt)."""
  return {
    p: sampling.Sampler(MODEL, dataclasses.replace(SAMPLED, num_pages=p)) for p in (48, 10, 5)
  }


def _slot_refs(table, slots, mask, page_size: int, num_pages: int) -> np.ndarray:
  """References of the slots in `mask`: their first ceil(length / page_size) table entries."""
  refs = np.zeros(num_pages, np.int64)
  length = np.asarray(slots.length)
  for s in np.nonzero(mask)[0]:
    np.add.at(refs, table[s, : -(-int(length[s]) // page_size)], 1)
  return refs


def _check_pages(pages, slots, page_size: int, finished=None) -> int:
  """Asserts a consistent page state; returns the largest reference count.

  Every page is either on the free stack (once, reference count 0) or referenced;
  a page's count is the active slots whose first ceil(length / page_size) table
  entries name it, plus the slots that finished in the window just run (`finished`:
  the host releases their pages after it), plus at most one prompt holder.
  """
  table, refcount, free_stack, num_free = (np.asarray(x) for x in pages)
  num_pages = refcount.size
  free = free_stack[:num_free]
  assert 0 <= num_free <= num_pages
  assert np.unique(free).size == num_free, "a page is on the free stack twice"
  assert (refcount >= 0).all() and (refcount[free] == 0).all()
  assert num_free + np.count_nonzero(refcount) == num_pages, "an unreferenced page is not free"
  holding = np.asarray(slots.active) if finished is None else np.asarray(slots.active) | finished
  extra = refcount - _slot_refs(table, slots, holding, page_size, num_pages)
  assert ((extra == 0) | (extra == 1)).all(), (refcount, extra)
  return int(refcount.max())


class _PageAudit:
  """Checks every decode window of `sampler`: the page state going in and coming out.

  Wraps `Scheduler.end_window`, which the sampler calls with the window's result
  (host arrays) while its scheduler still holds the window's input
  (`Scheduler.pages.state()`, `Scheduler.slots`).
  """

  def __init__(self, sampler, monkeypatch):
    self.page_size = sampler.config.page_size
    self.max_refcount = 0
    self.last = None
    end_window = scheduling.Scheduler.end_window

    def audited(sched, pages, slots, info):
      if sched.config is sampler.config:  # a window of this sampler
        state = sched.pages.state()
        self.max_refcount = max(self.max_refcount, _check_pages(state, sched.slots, self.page_size))
        finished = np.asarray(sched.slots.active) & ~np.asarray(slots.active)
        _check_pages(pages, slots, self.page_size, finished)
        self.last = pages, slots, finished
      return end_window(sched, pages, slots, info)

    monkeypatch.setattr(scheduling.Scheduler, "end_window", audited)

  def assert_pool_whole(self):
    """After generate: the last window's pages are free but those of its finished slots."""
    pages, slots, finished = self.last
    table, refcount, free_stack, num_free = (np.asarray(x) for x in pages)
    held = _slot_refs(table, slots, finished, self.page_size, refcount.size)
    np.testing.assert_array_equal(refcount, held)  # released by the host: then all free
    free = free_stack[: int(num_free)]
    np.testing.assert_array_equal(np.sort(np.r_[free, np.nonzero(held)[0]]), np.arange(held.size))


def _assert_same_rows(out, ref):
  np.testing.assert_array_equal(out.tokens, ref.tokens)
  np.testing.assert_allclose(out.logprobs, ref.logprobs, atol=1e-5)
  np.testing.assert_array_equal(out.lengths, ref.lengths)
  assert out.finish_reason == ref.finish_reason


def _teacher_forced(params, prompts, out, temperature):
  """The trainer's log-probs of `out`'s tokens, [N, max_new_tokens] (0 on padding)."""
  n, m = out.tokens.shape
  seqs = np.zeros((n, SAMPLED.max_prompt_len + m), np.int32)
  mask = np.zeros_like(seqs)
  for r in range(n):
    p, g = prompts[out.prompt_index[r]], out.lengths[r]
    seqs[r, : len(p)] = p
    seqs[r, len(p) : len(p) + g] = out.tokens[r, :g]
    mask[r, len(p) : len(p) + g] = 1
  logp, _ = _token_logprobs(
    params, MODEL, jnp.asarray(seqs), jnp.asarray(mask), temperature=jnp.float32(temperature)
  )
  expected = np.zeros((n, m), np.float32)
  for r in range(n):
    expected[r, : out.lengths[r]] = np.asarray(logp[r])[mask[r].astype(bool)]
  return expected


@pytest.mark.parametrize("num_pages", [10, 5])
def test_sampled_preemption_equals_no_preemption(params, samplers, num_pages, monkeypatch):
  key = jax.random.key(1)
  ref = samplers[48].generate(params, PROMPTS, num_samples=3, rng=key)
  assert ref.stats["preemptions"] == 0
  audit = _PageAudit(samplers[num_pages], monkeypatch)
  out = samplers[num_pages].generate(params, PROMPTS, num_samples=3, rng=key)
  assert out.stats["preemptions"] > 0 and out.stats["peak_pages_used"] <= num_pages
  _assert_same_rows(out, ref)
  assert len({tuple(t) for t in out.tokens}) > len(PROMPTS)  # really sampled
  audit.assert_pool_whole()
  assert out.stats["pages_in_use_at_end"] == 0


def test_preempted_sample_sharing_prompt_pages(params, samplers, monkeypatch):
  """G = 4 samples share 2 prompt pages; growing, they exhaust the 10-page pool.

  All four are admitted together (2 shared + 4 partial-page copies = 6 pages; one
  page each at position 12 fills the pool), so the sample preempted at position 16
  holds shared pages; on re-admission it recomputes its KV privately.
  """
  key = jax.random.key(2)
  ref = samplers[48].generate(params, [SHARED_PROMPT], num_samples=4, rng=key)
  audit = _PageAudit(samplers[10], monkeypatch)
  out = samplers[10].generate(params, [SHARED_PROMPT], num_samples=4, rng=key)
  assert audit.max_refcount == 4  # the full prompt pages were shared by all four
  assert out.stats["preemptions"] > 0
  # The prompt was prefilled once for the four; a preempted sample re-prefills its own.
  assert out.stats["prefill_tokens"] > len(SHARED_PROMPT) - 1 == ref.stats["prefill_tokens"]
  _assert_same_rows(out, ref)
  audit.assert_pool_whole()
  # The same sampler serves the next call from the whole pool.
  again = samplers[10].generate(params, [SHARED_PROMPT], num_samples=4, rng=key)
  _assert_same_rows(again, ref)
  audit.assert_pool_whole()


def test_sample_blocked_next_to_held_prompt_pages_finishes(params, samplers):
  """5 pages; the prompt holder of a 7-token prompt with 4 samples keeps 2 of them.

  A sample running alone reaches a page boundary with none free; preempting it
  would re-admit it into the same pages, blocked again, forever: the held prompt
  pages must go first. `stop_when` bounds the call (it ends after a few windows).
  """
  prompts, g, key = [[9, 8, 7, 6, 5, 4, 3], [1, 2, 3]], 4, jax.random.key(5)
  ref = samplers[48].generate(params, prompts, num_samples=g, rng=key)
  windows = []
  out = samplers[5].generate_requests(
    params,
    [p for p in prompts for _ in range(g)],
    prompt_index=[i for i in range(len(prompts)) for _ in range(g)],
    sample_index=[j for _ in prompts for j in range(g)],
    rng=key,
    stop_when=lambda done: windows.append(1) or len(windows) > 100,
  )
  assert not out.stats["stopped_early"] and len(windows) < 100
  _assert_same_rows(out, ref)


def test_prefix_sharing_several_prompts_and_page_multiples(params, samplers, monkeypatch):
  """Prompts of 4 and 8 tokens (multiples of the page size), 5 and 9 (prefilled part a
  multiple: no partial page to copy), 1 (nothing prefilled) and 12, 3 samples each.

  Each prompt is prefilled once; every row equals the same row generated alone
  (no sibling to share with) and its log-probs equal the trainer's.
  """
  prompts = [[3, 1, 4, 1], [9, 2, 6, 5, 3, 5, 8, 9], [7, 9, 3, 2, 3], [8, 4, 6, 2, 6, 4, 3, 3, 8]]
  prompts += [[11], [2, 7, 1, 8, 2, 8, 1, 8, 2, 8, 4, 5]]
  sampler, key, g = samplers[48], jax.random.key(3), 3
  audit = _PageAudit(sampler, monkeypatch)
  out = sampler.generate(params, prompts, num_samples=g, rng=key)
  assert out.stats["preemptions"] == 0
  assert out.stats["prefill_tokens"] == sum(len(p) - 1 for p in prompts)
  assert audit.max_refcount == g
  audit.assert_pool_whole()
  np.testing.assert_allclose(
    out.logprobs, _teacher_forced(params, prompts, out, SAMPLED.temperature), atol=1e-4
  )
  for r in range(len(prompts) * g):
    i, j = divmod(r, g)
    alone = sampler.generate_requests(
      params, [prompts[i]], prompt_index=[i], sample_index=[j], rng=key
    )
    np.testing.assert_array_equal(alone.tokens[0], out.tokens[r])
    np.testing.assert_allclose(alone.logprobs[0], out.logprobs[r], atol=1e-5)


@pytest.mark.parametrize("kv_scale_mode", ["static", "per_token"])
def test_fp8_kv_with_preemption_and_stop_tokens(params, monkeypatch, kv_scale_mode):
  """FP8 pages, a 5-page pool (preempts) and stop tokens vs the same with 48 pages.

  Rows must equal the big pool's, and each row must be the stop-free row cut after
  its first stop token (same per-position keys). With per-token scales the
  preempted rows' recomputed K/V get their scales written again, and shared
  prompt pages are copied with theirs.
  """
  fp8 = dataclasses.replace(SAMPLED, kv_dtype="fp8_e4m3", kv_scale_mode=kv_scale_mode)
  padded = jnp.asarray([p + [0] * (SAMPLED.max_prompt_len - len(p)) for p in PROMPTS], jnp.int32)
  scales = None
  if kv_scale_mode == "static":
    scales = sampling.calibrate_kv_scales(params, MODEL, padded, padded > 0)
  key = jax.random.key(4)
  free = sampling.Sampler(MODEL, fp8).generate(
    params, PROMPTS, num_samples=2, rng=key, kv_scales=scales
  )
  stops = (int(free.tokens[0, 2]), int(free.tokens[4, 4]))
  big = sampling.Sampler(MODEL, dataclasses.replace(fp8, stop_token_ids=stops))
  small = sampling.Sampler(MODEL, dataclasses.replace(fp8, stop_token_ids=stops, num_pages=5))
  ref = big.generate(params, PROMPTS, num_samples=2, rng=key, kv_scales=scales)
  audit = _PageAudit(small, monkeypatch)
  out = small.generate(params, PROMPTS, num_samples=2, rng=key, kv_scales=scales)
  pool = small.kv_pool()
  assert pool.k.dtype == jnp.float8_e4m3fn
  per_token = kv_scale_mode == "per_token"
  assert (pool.k_scale is not None) == per_token
  if per_token:  # written scales differ from the initial ones
    assert pool.k_scale.shape == pool.k.shape[:-1]
    assert float(jnp.mean(pool.k_scale != 1.0)) > 0.5
  assert out.stats["preemptions"] > 0 and ref.stats["preemptions"] == 0
  assert {"stop", "length"} <= set(out.finish_reason)
  _assert_same_rows(out, ref)
  audit.assert_pool_whole()
  for r in range(len(out.lengths)):
    row = free.tokens[r].tolist()
    g = next((t + 1 for t, tok in enumerate(row) if tok in stops), len(row))
    assert out.lengths[r] == g
    assert out.finish_reason[r] == ("stop" if row[g - 1] in stops else "length")
    np.testing.assert_array_equal(out.tokens[r, :g], row[:g])
    np.testing.assert_allclose(out.logprobs[r, :g], free.logprobs[r, :g], atol=1e-5)
    assert not out.tokens[r, g:].any() and not out.logprobs[r, g:].any()


def test_per_token_fp8_prefix_copies_carry_their_scales(params):
  """Per-token FP8 scales: G = 4 samples of a prompt whose partial last page is copied per
  sample (and 2 full pages shared) equal each sample generated alone (no copy, no share).
  A copy that left the scales behind would read the copied rows with stale scales."""
  cfg = dataclasses.replace(SAMPLED, kv_dtype="fp8_e4m3", kv_scale_mode="per_token")
  sampler, key, g = sampling.Sampler(MODEL, cfg), jax.random.key(5), 4
  out = sampler.generate(params, [SHARED_PROMPT], num_samples=g, rng=key)
  assert out.stats["prefill_tokens"] == len(SHARED_PROMPT) - 1  # prefilled once
  for j in range(g):
    alone = sampler.generate_requests(
      params, [SHARED_PROMPT], prompt_index=[0], sample_index=[j], rng=key
    )
    np.testing.assert_array_equal(alone.tokens[0], out.tokens[j])
    np.testing.assert_allclose(alone.logprobs[0], out.logprobs[j], atol=1e-5)
  with pytest.raises(ValueError, match="`kv_scales` must be None with kv_scale_mode='per_token'"):
    sampler.generate(params, [SHARED_PROMPT], rng=key, kv_scales=(1.0, 1.0))
  with pytest.raises(ValueError, match="needs an FP8 `kv_dtype`"):
    dataclasses.replace(SAMPLED, kv_scale_mode="per_token")
