"""rlx.sampling.scheduling: the sampler's host-side scheduling, independent of the device.

`Sampler` runs these pieces between its device windows; they are public so that
another engine can drive them (a different device loop, or a host model of one,
as in tests/sampling/test_sampling_scheduler.py) and so that their invariants can
be tested on host arrays:

  pages = PageManager(max_slots, pages_per_sequence, num_pages, page_size)
  sched = Scheduler(config, [Request(row, i, j, prompt) ...], pages)
  rows, copies = sched.admit()                         # admission, prefix sharing
  for call in prefill_calls(rows, prefill_chunk=..., max_slots=...,
                            pages_per_sequence=...):   # PrefillCall per device call
    ...                                                # write the rows' K/V
  src, dst = copy_plan(copies, max_slots, num_pages)   # partial prompt pages to copy
  # device window: decode on (pages.state(), sched.slots) -> (PageState, SlotState, LoopInfo)
  sched.end_window(page_state, slot_state, loop_info)  # preemption, releases
  sched.finish()

The device state is three NamedTuples (static shapes; S slots, P pages):
`PageState` (page_table i32[S, pages_per_sequence], refcount i32[P], free_stack
i32[P], num_free i32[]), `SlotState` (per-slot decode state, `empty_slots`) and
`LoopInfo` (what one decode window did). Prefill compiles at most
`prefill_compile_bound(config)` times per sampler: its call widths are
`prefill_widths(prefill_chunk)` (`prefill_width` picks one), its row counts
`prefill_rows(max_slots)`.
"""

from rlx.sampling._engine import (
  LoopInfo,
  PageState,
  SlotState,
  empty_slots,
)
from rlx.sampling._pages import (
  PageManager,
  copy_plan,
)
from rlx.sampling._scheduler import (
  PrefillCall,
  PrefillRow,
  Request,
  Scheduler,
  prefill_calls,
  prefill_compile_bound,
  prefill_rows,
  prefill_width,
  prefill_widths,
)

__all__ = (
  "LoopInfo",
  "PageManager",
  "PageState",
  "PrefillCall",
  "PrefillRow",
  "Request",
  "Scheduler",
  "SlotState",
  "copy_plan",
  "empty_slots",
  "prefill_calls",
  "prefill_compile_bound",
  "prefill_rows",
  "prefill_width",
  "prefill_widths",
)
