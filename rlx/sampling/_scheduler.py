"""`Scheduler`: the sampler's host scheduling between decode windows.

The scheduler half of a vLLM-style scheduler (Kwon et al. 2023,
https://arxiv.org/abs/2309.06180; vLLM's `Scheduler` over its
`BlockSpaceManager`), over a `rlx.sampling._pages.PageManager` that owns every
page. The device runs windows of up to `steps_per_sync` decode steps
(`rlx.sampling._engine`); between two windows the scheduler:

- Queue: requests (prompt i, sample j) in prompt-major order, FIFO; a
  preempted request goes back to the FRONT with its tokens kept.
- Admission (every scheduling point with continuous batching; only when all
  slots are idle with static batching): the queue head gets a free slot if
  its pages fit next to a reserve of the pages the running slots will need in
  the next window (no reserve when nothing runs), so admission rarely causes
  a preemption. Prefix sharing (`PageManager.share`): the first admitted
  sample of a prompt prefills the prompt once into pages its siblings
  reference. When nothing runs and the head still does not fit, the prompt
  holders are dropped first, then the head is made private (it prefills its
  own pages, no sharing).
- Preemption: when a slot finds no free page the window ends early; the
  scheduler first drops the prompt holders (held prompt pages of samples not
  admitted yet, as vLLM evicts cached prefix blocks before preempting; without
  this a sequence blocked next to a holder is re-admitted into the same pages
  forever), then preempts the NEWEST running sequence (the one admitted last)
  until the blocked slots fit, and re-queues it with its prompt, tokens and
  log-probs; on re-admission its KV is recomputed by prefill (no sharing). The
  oldest running sequence always advances, so every call ends. A
  sequence never changes a token because of this (same per-sample keys, same
  positions; only float rounding of recomputed K/V differs).
- Resume and early stop: a request may start with a response prefix, admitted
  like a preempted one (prompt + prefix KV recomputed by prefill); `abort`
  ends the call, handing back each unfinished request's tokens so far.
- Prefill (`prefill_calls`): chunked, at most `prefill_chunk` tokens per row
  per call (a chunk attends to the row's earlier pages and causally to
  itself). A call's width is the smallest bucket that holds the longest
  remaining piece of its rows, the buckets being the powers of two in
  [min(8, prefill_chunk), prefill_chunk) plus prefill_chunk itself (so 8-32-token
  prompts are not padded to a 64-wide chunk); rows are padded to a power of
  two in [min(8, S), next_pow2(S)]. So prefill compiles at most
  `prefill_compile_bound(config)` times per sampler whatever the prompt lengths.
"""

import collections
import dataclasses
import math
from typing import NamedTuple

import numpy as np

from rlx.sampling._config import SamplerConfig
from rlx.sampling._engine import LoopInfo, PageState, SlotState, empty_slots
from rlx.sampling._pages import PageManager

# Prefill row buckets: powers of two from min(8, S) up to S (few compiles, little padding).
_MIN_PREFILL_ROWS = 8
# Narrowest prefill call (tokens per row): the width buckets are the powers of two from
# min(8, prefill_chunk) below prefill_chunk, and prefill_chunk itself.
_MIN_PREFILL_WIDTH = 8


def _next_pow2(n: int) -> int:
  return 1 << max(0, (n - 1).bit_length())


def prefill_widths(prefill_chunk: int) -> tuple[int, ...]:
  """The prefill call widths (tokens per row) a sampler uses, ascending."""
  widths, w = [], min(_MIN_PREFILL_WIDTH, prefill_chunk)
  while w < prefill_chunk:
    widths.append(w)
    w *= 2
  return (*widths, prefill_chunk)


def prefill_width(piece: int, prefill_chunk: int) -> int:
  """The narrowest prefill width bucket holding `piece` (<= prefill_chunk) tokens per row."""
  return next(w for w in prefill_widths(prefill_chunk) if w >= min(piece, prefill_chunk))


def prefill_rows(max_slots: int) -> tuple[int, ...]:
  """The prefill call row counts (row buckets) of a sampler with `max_slots` slots, ascending."""
  top = _next_pow2(max_slots)
  rows, b = [], min(_MIN_PREFILL_ROWS, top)
  while b < top:
    rows.append(b)
    b *= 2
  return (*rows, top)


def prefill_compile_bound(config: SamplerConfig) -> int:
  """Most prefill compiles of one sampler: width buckets x row buckets."""
  rows = 1 + max(0, math.ceil(math.log2(config.max_slots / _MIN_PREFILL_ROWS)))
  return len(prefill_widths(config.prefill_chunk)) * rows


@dataclasses.dataclass
class Request:
  """One sample to generate (or resume): row `row` of the result."""

  row: int
  prompt_index: int
  sample_index: int
  prompt: np.ndarray  # i32[n]
  tokens: list = dataclasses.field(default_factory=list)
  logprobs: list = dataclasses.field(default_factory=list)
  started: bool = False  # admitted at least once (a re-admission recomputes all its KV)
  private: bool = False  # prefill its own prompt pages (no sharing)
  finish_reason: str | None = None
  # (first token index, policy version) of each segment this call generates; the
  # tokens before the first mark are the caller's prefix.
  version_marks: list = dataclasses.field(default_factory=list)

  def token_versions(self, width: int) -> np.ndarray:
    """i32[width]: the version of each token generated by this call, -1 elsewhere."""
    out = np.full((width,), -1, np.int32)
    ends = [start for start, _ in self.version_marks[1:]] + [len(self.tokens)]
    for (start, version), end in zip(self.version_marks, ends, strict=True):
      out[start:end] = version
    return out


class PrefillRow(NamedTuple):
  """Tokens to prefill from position 0 into a row's pages."""

  tokens: np.ndarray  # i32[n]
  pages: list[int]  # the row's pages (ceil(n / page_size) of them at least)


class PrefillCall(NamedTuple):
  """Arguments of one engine prefill call (`Engine.prefill`)."""

  tokens: np.ndarray  # i32[B, W]: row b holds positions start[b] + [0, num_new[b])
  start: np.ndarray  # i32[B]
  num_new: np.ndarray  # i32[B] (0: padding row)
  page_table: np.ndarray  # i32[B, pages_per_sequence]


def prefill_calls(
  rows: list[PrefillRow], *, prefill_chunk: int, max_slots: int, pages_per_sequence: int
) -> list[PrefillCall]:
  """Chunked prefill calls for `rows` (module docstring): chunk c of every row long enough.

  Rows are sorted longest first (stable); call c holds the rows with more than
  `c * prefill_chunk` tokens, `B` = their count padded to a row bucket and `W`
  the width bucket of the longest piece.
  """
  chunk = prefill_chunk
  rows = sorted((r for r in rows if len(r.tokens)), key=lambda r: -len(r.tokens))
  calls = []
  c = 0
  while rows and len(rows[0].tokens) > c * chunk:
    live = [r for r in rows if len(r.tokens) > c * chunk]
    b = min(max(_next_pow2(len(live)), _MIN_PREFILL_ROWS), _next_pow2(max_slots))
    width = prefill_width(len(live[0].tokens) - c * chunk, chunk)  # longest piece first
    tokens = np.zeros((b, width), np.int32)
    start = np.full((b,), c * chunk, np.int32)
    num_new = np.zeros((b,), np.int32)
    table = np.zeros((b, pages_per_sequence), np.int32)
    for r, (seq, own) in enumerate(live):
      piece = seq[c * chunk : c * chunk + width]
      tokens[r, : piece.size] = piece
      num_new[r] = piece.size
      table[r, : len(own)] = own
    calls.append(PrefillCall(tokens, start, num_new, table))
    c += 1
  return calls


class Scheduler:
  """Host state of one generate call: queue, slots, page manager, counters (module docstring).

  A call alternates `admit` (then the prefill calls and page copies it asks
  for), `exit_after` + a decode window on device, and `end_window` with the
  window's result; `abort` stops early, `finish` checks the pool is whole.

  Args:
    config: the sampler's `SamplerConfig`.
    requests: the requests, queued in this order.
    pages: a `PageManager` of the pool with every page free.
    version: the policy version of the params the call starts with (recorded
      per generated token; `switch_version` changes it between windows).

  Attributes:
    config: the `SamplerConfig` it was built with.
    pages: the `PageManager`; `pages.state()` is the page state of the next window.
    slots: host `SlotState` (numpy) of the next window.
    stats: counters: decode_steps, syncs, preemptions, stopped_early (and the
      caller's prefill_calls, prefill_tokens).
    peak_pages: most pages in use at once so far.
  """

  def __init__(
    self, config: SamplerConfig, requests: list[Request], pages: PageManager, version: int = 0
  ):
    if not isinstance(pages, PageManager) or pages.in_use:
      raise ValueError("`pages` must be a PageManager with every page free.")
    if pages.table.shape[0] != config.max_slots:
      raise ValueError(
        f"`pages` has {pages.table.shape[0]} page-table rows for max_slots={config.max_slots}."
      )
    self.config = config
    self.requests = list(requests)
    self.pages = pages
    self.queue = collections.deque(self.requests)
    self.slot_req: list[Request | None] = [None] * config.max_slots
    self.admitted_at = np.zeros(config.max_slots, np.int64)
    self.clock = 0
    self.slots = empty_slots(config.max_slots, config.max_new_tokens)
    self.stats = collections.Counter()
    self.peak_pages = 0
    self.version = int(version)
    for req in self.requests:
      req.version_marks = [(len(req.tokens), self.version)]

  @property
  def running(self) -> bool:
    """Whether some slot holds a request."""
    return any(r is not None for r in self.slot_req)

  def done(self) -> np.ndarray:
    """bool[N]: the requests finished so far (in request order)."""
    return np.asarray([r.finish_reason is not None for r in self.requests], bool)

  def growth(self, slot: int) -> int:
    """Pages slot `slot` may need in the next window (its admission reserve)."""
    cfg = self.config
    w = min(cfg.steps_per_sync, cfg.max_new_tokens - int(self.slots.num_generated[slot]))
    return self.pages.growth(int(self.slots.length[slot]), w)

  def note_pages_in_use(self):
    self.peak_pages = max(self.peak_pages, self.pages.in_use)

  # --------------------------------------------------------------------------------------
  # Admission.

  def _need(self, req: Request, siblings: int) -> int:
    """Free pages admitting `req` takes."""
    if req.started or req.private:
      return self.pages.pages_for(req.prompt.size + len(req.tokens) - 1)
    return self.pages.shared_need(req.prompt_index, req.prompt.size - 1, siblings)

  def admit(self) -> tuple[list[PrefillRow], list[tuple[int, int]]]:
    """Admits queue heads into free slots while their pages fit (module docstring).

    Returns:
      (rows to prefill, (source, destination) page copies), both to run before
      the next window.
    """
    pages = self.pages
    free_slots = [s for s in range(self.config.max_slots) if self.slot_req[s] is None]
    rows, copies = [], []
    if not free_slots or not self.queue:
      return rows, copies
    # Kept up to date below instead of rescanning slots / queue per request.
    running = self.running
    reserve = sum(self.growth(s) for s, r in enumerate(self.slot_req) if r is not None)
    unstarted = collections.Counter(r.prompt_index for r in self.queue if not r.started)
    while free_slots and self.queue:
      req = self.queue[0]
      siblings = unstarted[req.prompt_index]
      need = self._need(req, siblings)
      if need > pages.num_free - (reserve if running else 0):
        if not running and pages.holders:
          pages.drop_holders()  # held prompt pages must not starve the queue head
          continue
        if not running and not req.started and not req.private:
          req.private = True  # too tight to keep a shared copy: prefill its own pages
          continue
        break
      self.queue.popleft()
      if not req.started:
        unstarted[req.prompt_index] -= 1
      s = free_slots.pop(0)
      if req.started or req.private:
        seq = np.concatenate([req.prompt, np.asarray(req.tokens, np.int32)])
        m = seq.size - 1
        own = pages.pop(need)
        rows.append(PrefillRow(seq[:m], own))
        last = int(seq[-1])
      else:
        m = req.prompt.size - 1
        own, prefill, copy = pages.share(req.prompt_index, m, siblings)
        if prefill is not None:
          rows.append(PrefillRow(req.prompt[:m], prefill))
        if copy is not None:
          copies.append(copy)
        last = int(req.prompt[-1])
      self._place(s, req, own, m, last)
      running = True
      reserve += self.growth(s)
    return rows, copies

  def _place(self, slot: int, req: Request, own: list[int], length: int, last: int):
    """Puts `req` in slot `slot`: `own` pages caching `length` tokens, `last` fed next."""
    req.started = True
    g = len(req.tokens)
    self.slot_req[slot] = req
    self.clock += 1
    self.admitted_at[slot] = self.clock
    self.pages.assign(slot, own)
    slots = self.slots
    slots.active[slot] = True
    slots.length[slot] = length
    slots.last_token[slot] = last
    slots.num_generated[slot] = g
    slots.prompt_index[slot] = req.prompt_index
    slots.sample_index[slot] = req.sample_index
    slots.stopped[slot] = False
    slots.tokens[slot] = 0
    slots.tokens[slot, :g] = req.tokens
    slots.logprobs[slot] = 0
    slots.logprobs[slot, :g] = req.logprobs

  # --------------------------------------------------------------------------------------
  # Decode windows.

  def exit_after(self, *, early_stop: bool) -> int:
    """Finished slots after which the next window ends (max_slots + 1: never early).

    With continuous batching and a queue, soon enough to refill the freed
    slots; with an early-stop condition, soon enough to check it.
    """
    s = self.config.max_slots
    if self.config.continuous_batching and self.queue:
      return min(len(self.queue), max(1, s // 8))
    if early_stop:
      return max(1, s // 8)
    return s + 1

  def end_window(self, pages: PageState, slots: SlotState, info: LoopInfo):
    """Takes a window's result (host arrays) and makes room for its blocked slots.

    Finished requests leave their slots and their pages are released; if the
    blocked slots need more pages than are free, the prompt holders are
    dropped, then the newest running sequences preempted until they fit.
    """
    self.pages.load(pages)
    self.slots = SlotState(*(np.array(x) for x in slots))
    self.stats["decode_steps"] += int(info.steps)
    self.stats["syncs"] += 1
    self.peak_pages = max(self.peak_pages, int(info.peak_pages))
    for s, req in enumerate(self.slot_req):
      if req is not None and not self.slots.active[s]:
        self._take_back(s, req)
        req.finish_reason = "stop" if self.slots.stopped[s] else "length"
        self.slot_req[s] = None
        self.pages.release(s, int(self.slots.length[s]))  # the device keeps them to the end
    blocked = [s for s, r in enumerate(self.slot_req) if info.blocked[s] and r is not None]
    if len(blocked) > self.pages.num_free and self.pages.holders:
      self.pages.drop_holders()  # held prompt pages go before running sequences
    while blocked and len(blocked) > self.pages.num_free:
      running = [s for s, r in enumerate(self.slot_req) if r is not None]
      s = max(running, key=lambda s: self.admitted_at[s])
      self.preempt(s)
      blocked = [b for b in blocked if b != s]

  def switch_version(self, version: int):
    """The params change to policy version `version` before the next window (in-flight update).

    Every unfinished request's next tokens record `version`; what it generated
    so far keeps its versions (and a running one its cached K/V). The held
    prompt pages (prefilled by the older params for samples not admitted yet)
    are dropped, so a sample admitted from now on prefills its prompt with the
    new params: every one of its tokens is the new version's.
    """
    if version < self.version:
      raise ValueError(f"policy versions must not decrease: {version} after {self.version}.")
    self.pages.drop_holders()
    self.version = int(version)
    slot_of = {id(r): s for s, r in enumerate(self.slot_req) if r is not None}
    for req in self.requests:
      if req.finish_reason is not None:
        continue
      s = slot_of.get(id(req))
      count = len(req.tokens) if s is None else int(self.slots.num_generated[s])
      if req.version_marks[-1][0] == count:
        req.version_marks[-1] = (count, self.version)
      else:
        req.version_marks.append((count, self.version))
    self.stats["params_updates"] += 1

  def _take_back(self, slot: int, req: Request):
    g = int(self.slots.num_generated[slot])
    req.tokens = self.slots.tokens[slot, :g].tolist()
    req.logprobs = self.slots.logprobs[slot, :g].tolist()

  def _release(self, slot: int):
    self.pages.release(slot, int(self.slots.length[slot]))
    self.slots.active[slot] = False
    self.slot_req[slot] = None

  def preempt(self, slot: int):
    """Frees slot `slot`'s pages and re-queues its request at the front (tokens kept)."""
    req = self.slot_req[slot]
    self._take_back(slot, req)
    self._release(slot)
    self.queue.appendleft(req)
    self.stats["preemptions"] += 1

  def abort(self):
    """Ends the call now: every running request keeps what it generated, unfinished."""
    for s, req in enumerate(self.slot_req):
      if req is not None:
        self._take_back(s, req)
        self._release(s)
    self.stats["stopped_early"] = 1

  def finish(self):
    """Drops the prompt holders; raises RuntimeError if a page leaked or was freed twice."""
    if not self.stats["stopped_early"] and (self.running or self.queue):
      raise RuntimeError("internal: nothing runs and the queue head does not fit")
    self.pages.drop_holders()
    self.pages.check_all_free()
