"""`PageManager`: the sampler's host-side page bookkeeping (free stack, reference counts, sharing).

The block-manager half of a vLLM-style scheduler (Kwon et al. 2023,
https://arxiv.org/abs/2309.06180; vLLM's `BlockSpaceManager` under its
`Scheduler`): it owns the host copy of `PageState` between decode windows and
every page edit made at a scheduling point. The decode loop edits the same
state on device (`rlx.sampling._engine`: a page popped per slot crossing a page
boundary; finished slots keep their pages until the host releases them after
the window), and `load` takes its result back.

- Pages: P pages of `page_size` tokens; free pages are `free_stack[:num_free]`,
  popped from the top (LIFO) and pushed back when their reference count drops
  to 0.
- Page table: row s lists slot s's pages in position order; a slot holding
  `length` cached tokens uses its first `ceil(length / page_size)` entries.
- Prefix sharing: the first admitted sample of a prompt (m = prompt length - 1
  prefilled tokens) gets a `PromptHolder` of `ceil(m / page_size)` pages that
  the prompt is prefilled into once. Every sample references the holder's
  `m // page_size` full pages; the partly filled last page (if any) is copied
  into a page of its own, except for the last sample admitted, which takes the
  holder's page itself (so G = 1 copies nothing). The holder drops its
  references once all G samples are admitted (or when `drop_holders` is
  called to free the pool).

Reference count of a page = slots whose used table entries name it + 1 while a
prompt holder holds it.
"""

import dataclasses

import numpy as np

from rlx.sampling._engine import PageState


@dataclasses.dataclass
class PromptHolder:
  """The prompt pages of one prompt while some of its samples are not admitted yet."""

  pages: list[int]  # full pages first, then the partial one (if any)
  num_full: int
  remaining: int  # samples of the prompt not admitted yet


class PageManager:
  """Host page state between decode windows: free stack, reference counts, prompt holders.

  Args:
    num_slots: S, rows of the page table.
    pages_per_sequence: page-table width.
    num_pages: P, pages in the pool.
    page_size: tokens per page.
  """

  def __init__(self, num_slots: int, pages_per_sequence: int, num_pages: int, page_size: int):
    for name, value in (
      ("num_slots", num_slots),
      ("pages_per_sequence", pages_per_sequence),
      ("num_pages", num_pages),
      ("page_size", page_size),
    ):
      if not isinstance(value, int | np.integer) or value < 1:
        raise ValueError(f"`{name}` must be a positive int, got {value!r}.")
    self.num_pages = int(num_pages)
    self.page_size = int(page_size)
    self.table = np.zeros((num_slots, pages_per_sequence), np.int32)  # i32[S, pps]
    self.refcount = np.zeros((num_pages,), np.int32)  # i32[P]
    self.free_stack = np.arange(num_pages, dtype=np.int32)  # i32[P]
    self.num_free = self.num_pages
    self.holders: dict[int, PromptHolder] = {}

  # --------------------------------------------------------------------------------------
  # Device state.

  def load(self, state: PageState):
    """Takes the page state a decode window returned (prompt holders are kept)."""
    table, refcount, free_stack = (np.array(x) for x in state[:3])
    pool = (self.num_pages,)
    if table.shape != self.table.shape or refcount.shape != pool or free_stack.shape != pool:
      raise ValueError(
        f"`state` shapes {table.shape}, {refcount.shape}, {free_stack.shape} do not match "
        f"this manager's {self.table.shape}, ({self.num_pages},)."
      )
    self.table, self.refcount, self.free_stack = table, refcount, free_stack
    self.num_free = int(state.num_free)

  def state(self) -> PageState:
    """The current state as a `PageState` of host arrays (the decode window's input)."""
    return PageState(self.table, self.refcount, self.free_stack, np.int32(self.num_free))

  # --------------------------------------------------------------------------------------
  # Pages.

  @property
  def in_use(self) -> int:
    """Pages not on the free stack."""
    return self.num_pages - self.num_free

  def pages_for(self, num_tokens: int) -> int:
    """Pages holding `num_tokens` cached tokens: ceil(num_tokens / page_size)."""
    return -(-int(num_tokens) // self.page_size)

  def growth(self, length: int, steps: int) -> int:
    """New pages a slot caching `length` tokens needs for `steps` more decode steps."""
    return self.pages_for(length + steps) - self.pages_for(length)

  def pop(self, n: int) -> list[int]:
    """Takes `n` pages off the free stack (top first), each with reference count 1."""
    if n > self.num_free:
      raise RuntimeError(f"internal: popping {n} pages with {self.num_free} free")
    pages = [int(p) for p in self.free_stack[self.num_free - n : self.num_free][::-1]]
    self.num_free -= n
    self.refcount[pages] = 1
    return pages

  def incref(self, pages):
    for p in pages:
      self.refcount[p] += 1

  def decref(self, pages):
    """Drops one reference of each page; a page reaching 0 goes back on the free stack."""
    for p in pages:
      if self.refcount[p] <= 0:
        raise RuntimeError(f"internal: page {p} released with reference count {self.refcount[p]}")
      self.refcount[p] -= 1
      if self.refcount[p] == 0:
        self.free_stack[self.num_free] = p
        self.num_free += 1

  # --------------------------------------------------------------------------------------
  # Slots.

  def assign(self, slot: int, pages: list[int]):
    """Page-table row `slot` := `pages` (the caller holds their references)."""
    self.table[slot] = 0
    self.table[slot, : len(pages)] = pages

  def release(self, slot: int, length: int):
    """Drops slot `slot`'s references to the pages of its `length` cached tokens."""
    self.decref([int(p) for p in self.table[slot, : self.pages_for(length)]])
    self.table[slot] = 0

  # --------------------------------------------------------------------------------------
  # Prefix sharing.

  def shared_need(self, prompt_index: int, num_prefilled: int, siblings: int) -> int:
    """Free pages `share` takes for a sample of prompt `prompt_index`.

    Args:
      prompt_index: the prompt.
      num_prefilled: m, the prompt's tokens that are prefilled (length - 1).
      siblings: samples of the prompt not admitted yet, this one included (used
        when no holder exists yet: it becomes the holder's `remaining`).
    """
    partial = num_prefilled % self.page_size != 0
    holder = self.holders.get(prompt_index)
    if holder is not None:
      return 1 if (partial and holder.remaining > 1) else 0
    return self.pages_for(num_prefilled) + (1 if (partial and siblings > 1) else 0)

  def share(self, prompt_index: int, num_prefilled: int, siblings: int):
    """Pages of one sample of a shared prompt (`shared_need(...)` of them are popped).

    Returns:
      (own, prefill, copy): `own` the sample's page list for its table row;
      `prefill` the new holder's pages when this call created it (the prompt is
      to be prefilled into them), else None; `copy` a (source, destination)
      page pair when the partial page must be copied for this sample, else None.
    """
    m = num_prefilled
    holder = self.holders.get(prompt_index)
    prefill = None
    if holder is None:
      holder = PromptHolder(self.pop(self.pages_for(m)), m // self.page_size, siblings)
      self.holders[prompt_index] = holder
      prefill = holder.pages
    holder.remaining -= 1
    full = holder.pages[: holder.num_full]
    self.incref(full)
    own = list(full)
    copy = None
    if m % self.page_size:
      partial = holder.pages[holder.num_full]
      if holder.remaining == 0:
        self.incref([partial])  # the holder's reference is dropped below
        own.append(partial)
      else:
        dst = self.pop(1)[0]
        copy = (partial, dst)
        own.append(dst)
    if holder.remaining == 0:
      self.decref(holder.pages)
      del self.holders[prompt_index]
    return own, prefill, copy

  def drop_holders(self):
    """Drops every prompt holder's references (samples not admitted yet prefill anew)."""
    for h in self.holders.values():
      self.decref(h.pages)
    self.holders.clear()

  def check_all_free(self):
    """Raises RuntimeError unless every page is free exactly once with reference count 0."""
    whole = np.array_equal(np.sort(self.free_stack), np.arange(self.num_pages))
    if self.num_free != self.num_pages or self.refcount.any() or self.holders or not whole:
      raise RuntimeError(
        f"internal: pages leaked or freed twice: {self.num_free} of {self.num_pages} free, "
        f"{np.count_nonzero(self.refcount)} referenced, {len(self.holders)} prompt holders"
      )


def copy_plan(copies: list[tuple[int, int]], num_slots: int, num_pages: int):
  """(src, dst) i32[num_slots] arguments of the engine's `copy_pages` (dst = P: no copy)."""
  if len(copies) > num_slots:
    raise ValueError(f"`copies` has {len(copies)} pairs > num_slots={num_slots}.")
  src = np.full((num_slots,), 0, np.int32)
  dst = np.full((num_slots,), num_pages, np.int32)
  for i, (a, b) in enumerate(copies):
    src[i], dst[i] = a, b
  return src, dst
