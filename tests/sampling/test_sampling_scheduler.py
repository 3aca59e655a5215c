"""`rlx.sampling.scheduling.Scheduler` on host arrays, against a numpy model of the device side.

`_FakeEngine` does what the sampler's jitted engine does to the page and slot
state (a page popped per slot crossing a page boundary, blocked slots, the same
stack order; finished slots keep their pages for the host to release), keeps the
token written at every (page, offset) of a fake pool, and checks at every decode
step that each running slot's pages hold exactly its prompt + tokens so far. Token t of
(prompt i, sample j) is a fixed function of (i, j, t), as the per-sample keys
make it on device; so a request's tokens must not depend on the schedule.
"""

import dataclasses

import numpy as np
import pytest

from rlx.sampling import SamplerConfig
from rlx.sampling.scheduling import (
  LoopInfo,
  PageManager,
  PageState,
  PrefillRow,
  Request,
  Scheduler,
  SlotState,
  copy_plan,
  prefill_calls,
  prefill_compile_bound,
  prefill_rows,
  prefill_widths,
)

VOCAB = 64
CFG = SamplerConfig(
  max_slots=4,
  page_size=4,
  num_pages=16,
  max_prompt_len=12,
  max_new_tokens=8,
  steps_per_sync=4,
  prefill_chunk=8,
)
PAGE = CFG.page_size


def _token(prompt_index, sample_index, t):
  return (prompt_index * 7 + sample_index * 13 + t * 5 + 1) % VOCAB


def _expected(req, max_new_tokens, stops):
  out = []
  while len(out) < max_new_tokens:
    out.append(_token(req.prompt_index, req.sample_index, len(out)))
    if out[-1] in stops:
      break
  return out


class _FakeEngine:
  """Host model of the engine's prefill / copy_pages / decode on page and slot state."""

  def __init__(self, config: SamplerConfig):
    self.config = config
    self.page = config.page_size
    self.pool = np.full((config.num_pages, config.page_size), -1, np.int64)
    self.max_refcount = 0

  def prefill(self, tokens, start, num_new, table):
    for r in range(tokens.shape[0]):
      for c in range(num_new[r]):
        pos = start[r] + c
        self.pool[table[r, pos // self.page], pos % self.page] = tokens[r, c]

  def copy_pages(self, src, dst):
    for a, b in zip(src, dst, strict=True):
      if b < self.pool.shape[0]:
        self.pool[b] = self.pool[a]

  def decode(self, pages: PageState, slots: SlotState, *, max_steps, exit_after, prompts):
    cfg, page = self.config, self.page
    table, refcount, free_stack = (np.array(x) for x in pages[:3])
    num_free = int(pages.num_free)
    s = SlotState(*(np.array(x) for x in slots))
    num_pages, m = refcount.size, s.tokens.shape[1]
    steps = finished = 0
    blocked = np.zeros_like(s.active)
    peak = num_pages - num_free
    self.max_refcount = max(self.max_refcount, int(refcount.max()))
    while steps < max_steps and s.active.any() and not blocked.any() and finished < exit_after:
      need = s.active & (s.length % page == 0)
      rank = np.cumsum(need) - 1
      ok = need & (rank < num_free)
      for i in np.nonzero(ok)[0]:
        new = free_stack[num_free - 1 - rank[i]]
        table[i, s.length[i] // page] = new
        refcount[new] = 1
      num_free -= int(ok.sum())
      blocked = need & ~ok
      peak = max(peak, num_pages - num_free)
      run = s.active & ~blocked
      done = np.zeros_like(run)
      for i in np.nonzero(run)[0]:
        n, g = int(s.length[i]), int(s.num_generated[i])
        seq = [*prompts[s.prompt_index[i]], *s.tokens[i, :g]]
        cached = [self.pool[table[i, p // page], p % page] for p in range(n)]
        assert cached == seq[:n] and s.last_token[i] == seq[n], (i, cached, seq)
        self.pool[table[i, n // page], n % page] = s.last_token[i]
        tok = _token(s.prompt_index[i], s.sample_index[i], g)
        s.tokens[i, g], s.logprobs[i, g] = tok, -tok / VOCAB
        s.length[i], s.num_generated[i], s.last_token[i] = n + 1, g + 1, tok
        stop = tok in cfg.stop_token_ids
        s.stopped[i] |= stop
        done[i] = stop or g + 1 >= m
      s.active[done] = False  # its pages stay referenced: the host releases them
      finished += int(done.sum())
      steps += 1
    info = LoopInfo(np.int32(steps), blocked, np.int32(peak))
    return PageState(table, refcount, free_stack, np.int32(num_free)), s, info


def _requests(prompts, num_samples):
  return [
    Request(i * num_samples + j, i, j, np.asarray(p, np.int32))
    for i, p in enumerate(prompts)
    for j in range(num_samples)
  ]


def _run(config, requests, prompts, stop_when=None):
  """The host loop of `Sampler.generate` over `_FakeEngine`."""
  eng = _FakeEngine(config)
  pages = PageManager(config.max_slots, config.pages_per_sequence, config.num_pages, PAGE)
  sched = Scheduler(config, requests, pages)
  while True:
    if config.continuous_batching or not sched.running:
      rows, copies = sched.admit()
      calls = prefill_calls(
        rows,
        prefill_chunk=config.prefill_chunk,
        max_slots=config.max_slots,
        pages_per_sequence=config.pages_per_sequence,
      )
      for call in calls:
        assert call.tokens.shape[1] in prefill_widths(config.prefill_chunk)
        assert call.tokens.shape[0] in prefill_rows(config.max_slots)
        eng.prefill(call.tokens, call.start, call.num_new, call.page_table)
        sched.stats["prefill_tokens"] += int(call.num_new.sum())
      if copies:
        eng.copy_pages(*copy_plan(copies, config.max_slots, config.num_pages))
    sched.note_pages_in_use()
    if not sched.running:
      break
    exit_after = sched.exit_after(early_stop=stop_when is not None)
    result = eng.decode(
      pages.state(),
      sched.slots,
      max_steps=config.steps_per_sync,
      exit_after=exit_after,
      prompts=prompts,
    )
    sched.end_window(*result)
    if stop_when is not None and stop_when(sched.done()):
      sched.abort()
      break
  sched.finish()
  return sched, eng


def _random_prompts(rng, n):
  return [rng.integers(0, VOCAB, size=int(rng.integers(1, 13))).tolist() for _ in range(n)]


def _guard(max_windows=300):
  """A `stop_when` ending a call that runs more windows than any of these workloads needs."""
  windows = [0]

  def stop_when(done):
    windows[0] += 1
    return windows[0] > max_windows

  return stop_when


@pytest.mark.parametrize("seed", range(40))
def test_random_workloads_finish_with_schedule_independent_tokens(seed):
  rng = np.random.default_rng(seed)
  config = dataclasses.replace(
    CFG,
    max_slots=int(rng.choice([1, 2, 4, 8])),
    num_pages=int(rng.integers(CFG.pages_per_sequence, 16)),
    steps_per_sync=int(rng.integers(1, 6)),
    prefill_chunk=int(rng.choice([4, 8, 16])),
    continuous_batching=bool(rng.integers(2)),
    stop_token_ids=tuple(int(t) for t in rng.choice(VOCAB, size=int(rng.integers(0, 4)))),
  )
  prompts = _random_prompts(rng, int(rng.integers(1, 6)))
  g = int(rng.integers(1, 5))
  requests = _requests(prompts, g)
  sched, _ = _run(config, requests, prompts, stop_when=_guard())
  assert not sched.stats["stopped_early"]
  for r in requests:
    want = _expected(r, config.max_new_tokens, config.stop_token_ids)
    assert r.tokens == want, (r.row, r.tokens, want)
    np.testing.assert_allclose(r.logprobs, [-t / VOCAB for t in want], rtol=1e-6)
    assert r.finish_reason == ("stop" if want[-1] in config.stop_token_ids else "length")
  assert sched.peak_pages <= config.num_pages


def test_sequence_blocked_next_to_a_prompt_holder_advances():
  """5 pages; the holder of a 7-token prompt with 4 samples keeps 2 of them.

  A sample running alone then reaches a page boundary with its 3 pages and none
  free: preempting it would re-admit it into the same 3 pages, blocked again,
  forever; dropping the holder lets it finish.
  """
  prompts = [[9, 8, 7, 6, 5, 4, 3], [1, 2, 3]]
  config = dataclasses.replace(CFG, num_pages=5)
  requests = _requests(prompts, 4)
  sched, _ = _run(config, requests, prompts, stop_when=_guard())
  assert not sched.stats["stopped_early"]
  assert sched.stats["prefill_tokens"] > 6 + 2  # a prompt was prefilled again after the drop
  for r in requests:
    assert r.tokens == _expected(r, config.max_new_tokens, ())


def test_tight_pool_preempts_shared_samples_and_recomputes_their_kv():
  prompts = [[5, 1, 2, 3, 4, 5, 6, 7, 8, 9]]  # 9 prefilled: 2 full pages + 1 partial
  config = dataclasses.replace(CFG, num_pages=10)
  requests = _requests(prompts, 4)
  sched, eng = _run(config, requests, prompts)
  assert eng.max_refcount == 4  # four samples on the shared full pages
  assert sched.stats["preemptions"] > 0
  assert sched.stats["prefill_tokens"] > 9  # re-admissions prefill prompt + tokens
  for r in requests:
    assert r.tokens == _expected(r, config.max_new_tokens, ())


def test_prefix_sharing_prefills_each_prompt_once():
  prompts = [[3, 1, 4, 1], [9, 2, 6, 5, 3], [1], [2, 7, 1, 8, 2, 8, 1, 8, 2]]
  config = dataclasses.replace(CFG, max_slots=8, num_pages=64)
  requests = _requests(prompts, 3)
  sched, eng = _run(config, requests, prompts)
  assert sched.stats["preemptions"] == 0
  assert sched.stats["prefill_tokens"] == sum(len(p) - 1 for p in prompts)
  assert eng.max_refcount == 3


def test_admission_reserves_the_running_slots_growth():
  # A 12-token prompt runs first (3 pages for 11 cached tokens; its next 4 decode steps
  # need 1 more page); a second request needs 3 pages: 3 + 3 <= 8 - 1, but 3 + 3 > 6 - 1.
  prompts = [[1] * 12, [2] * 10]
  config = dataclasses.replace(CFG, num_pages=8)
  sched = Scheduler(config, _requests(prompts, 1), PageManager(4, 5, 8, PAGE))
  rows, copies = sched.admit()
  assert [len(r.tokens) for r in rows] == [11, 9] and not copies
  config = dataclasses.replace(CFG, num_pages=6)
  sched = Scheduler(config, _requests(prompts, 1), PageManager(4, 5, 6, PAGE))
  rows, _ = sched.admit()
  assert [len(r.tokens) for r in rows] == [11]  # the second waits
  assert sched.pages.in_use == 3 and len(sched.queue) == 1
  np.testing.assert_array_equal(sched.slots.length[:2], [11, 0])
  assert sched.slots.last_token[0] == 1 and sched.slots.active.tolist() == [1, 0, 0, 0]


def test_nothing_running_drops_prompt_holders_for_the_queue_head():
  # One slot: A0 (holder 3 pages + its copy + 1 decode page = the pool) leaves A's holder
  # behind; B0 needs 3 of the 2 free pages, so the holder is dropped and A1 prefills A again.
  a, b = [4] * 10, [6] * 10
  requests = [Request(0, 0, 0, np.asarray(a)), Request(1, 1, 0, np.asarray(b))]
  requests.append(Request(2, 0, 1, np.asarray(a)))
  config = dataclasses.replace(CFG, max_slots=1, num_pages=5, max_new_tokens=4)
  sched, _ = _run(config, requests, [a, b])
  assert sched.stats["prefill_tokens"] == 3 * 9 and sched.stats["preemptions"] == 0
  for r in requests:
    assert r.tokens == _expected(r, config.max_new_tokens, ())


def test_no_room_for_a_shared_copy_goes_private():
  # 3 pages hold one 12-token sequence; sharing would need a 4th for the partial page.
  prompt = [3] * 12
  config = dataclasses.replace(CFG, max_slots=1, num_pages=3, max_new_tokens=1)
  requests = _requests([prompt], 2)
  sched, _ = _run(config, requests, [prompt])
  assert requests[0].private and not requests[1].private  # the last sample shares nothing
  assert sched.stats["prefill_tokens"] == 2 * 11
  for r in requests:
    assert r.tokens == _expected(r, 1, ())


def test_preemption_takes_the_newest_and_requeues_it_first():
  prompts = [[1, 2, 3, 4, 5], [6, 7, 8, 9, 10], [11, 12]]
  config = dataclasses.replace(CFG, num_pages=6)
  sched = Scheduler(config, _requests(prompts, 1), PageManager(4, 5, 6, PAGE))
  sched.admit()
  assert [r is not None for r in sched.slot_req] == [True, True, True, False]
  # Window result: no page left, slots 0-2 blocked at a page boundary (slot 2 after 3
  # tokens; the pages popped here stand for other slots' allocations).
  pages, slots = sched.pages, sched.slots
  pages.pop(pages.num_free)
  slots.num_generated[2], slots.length[2] = 3, 4
  slots.tokens[2, :3], slots.logprobs[2, :3] = [40, 41, 42], [-0.5, -0.25, -1.0]
  blocked = np.asarray([True, True, True, False])
  sched.end_window(pages.state(), slots, LoopInfo(np.int32(3), blocked, np.int32(6)))
  # 3 blocked, 0 free: slot 2 (newest) goes (1 page back), then slot 1 (2 back >= 1 left).
  assert sched.stats["preemptions"] == 2
  assert [r.row for r in sched.queue] == [1, 2]
  assert sched.queue[1].tokens == [40, 41, 42] and sched.queue[1].logprobs[1] == -0.25
  assert [r is not None for r in sched.slot_req] == [True, False, False, False]
  rows, _ = sched.admit()  # 2 free, 1 reserved for slot 0: row 1 back, row 2 waits
  assert [r.tokens.tolist() for r in rows] == [[6, 7, 8, 9]] and sched.slot_req[1].row == 1
  # Re-admitted with tokens: prompt + all tokens but the last prefilled, the last fed next.
  resumed = Scheduler(config, [sched.queue[0]], PageManager(4, 5, 6, PAGE))
  rows, _ = resumed.admit()
  assert [r.tokens.tolist() for r in rows] == [[11, 12, 40, 41]]
  assert resumed.slots.last_token[0] == 42 and resumed.slots.num_generated[0] == 3
  np.testing.assert_array_equal(resumed.slots.tokens[0, :4], [40, 41, 42, 0])


def test_exit_after_and_abort_keep_unfinished_tokens():
  prompts = [[1, 2], [3, 4]]
  config = dataclasses.replace(CFG, max_slots=16)
  sched = Scheduler(config, _requests(prompts, 1), PageManager(16, 5, 16, PAGE))
  assert sched.exit_after(early_stop=False) == 2  # min(queue, max(1, 16 // 8))
  sched.admit()
  assert sched.exit_after(early_stop=False) == 17 and sched.exit_after(early_stop=True) == 2
  static_config = dataclasses.replace(config, continuous_batching=False)
  static = Scheduler(static_config, [], PageManager(16, 5, 16, PAGE))
  assert static.exit_after(early_stop=False) == 17
  sched.slots.num_generated[0] = 1
  sched.slots.tokens[0, 0] = 9
  sched.abort()
  assert sched.requests[0].tokens == [9] and sched.requests[0].finish_reason is None
  assert not sched.running and sched.stats["stopped_early"] == 1
  sched.finish()  # every page back


def test_early_stop_and_resume_equal_uninterrupted():
  prompts = _random_prompts(np.random.default_rng(3), 4)
  config = dataclasses.replace(CFG, num_pages=8, steps_per_sync=2)
  first = _requests(prompts, 2)
  _run(config, first, prompts, stop_when=lambda done: done.sum() >= 2)
  assert any(r.finish_reason is None for r in first)
  resumed = []
  for r in first:
    if r.finish_reason is None:
      resumed.append(dataclasses.replace(r, started=bool(r.tokens), private=False))
  _run(config, resumed, prompts)
  for r in first + resumed:
    if r.finish_reason is not None:
      assert r.tokens == _expected(r, config.max_new_tokens, ())


def test_finish_refuses_leaks():
  sched = Scheduler(CFG, [], PageManager(4, 5, 16, PAGE))
  sched.pages.pop(1)
  with pytest.raises(RuntimeError, match="leaked"):
    sched.finish()
  with pytest.raises(ValueError, match="every page free"):
    Scheduler(CFG, [], sched.pages)


def test_prefill_calls_bucket_rows_and_widths():
  rows = [PrefillRow(np.arange(n, dtype=np.int32), list(range(5))) for n in (3, 0, 11, 20)]
  calls = prefill_calls(rows, prefill_chunk=8, max_slots=16, pages_per_sequence=5)
  # Chunk 0: 3 rows (20, 11, 3 tokens) in 8 rows x 8; chunk 1: 20, 11 (8, 3); chunk 2: 20 (4).
  assert [c.tokens.shape for c in calls] == [(8, 8), (8, 8), (8, 8)]
  np.testing.assert_array_equal(calls[0].num_new[:4], [8, 8, 3, 0])
  np.testing.assert_array_equal(calls[1].num_new[:3], [8, 3, 0])
  np.testing.assert_array_equal(calls[2].num_new[:2], [4, 0])
  np.testing.assert_array_equal(calls[2].start, 16)
  np.testing.assert_array_equal(calls[1].tokens[1, :3], [8, 9, 10])
  wide = prefill_calls(rows[:1], prefill_chunk=32, max_slots=2, pages_per_sequence=5)
  assert [c.tokens.shape for c in wide] == [(2, 8)]  # rows: min(8, next_pow2(S))
  assert prefill_compile_bound(dataclasses.replace(CFG, max_slots=32, prefill_chunk=32)) == 9
  assert prefill_rows(2) == (2,) and prefill_rows(5) == (8,) and prefill_rows(32) == (8, 16, 32)
  assert prefill_rows(33) == (8, 16, 32, 64)  # the largest bucket: max_slots rounded up
