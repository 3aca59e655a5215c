"""`rlx.sampling.scheduling.PageManager` on host arrays: free stack, reference counts, sharing."""

import numpy as np
import pytest

from rlx.sampling.scheduling import PageManager, PageState, copy_plan

PAGE = 4


def _manager(num_pages=12, num_slots=4, pages_per_sequence=5):
  return PageManager(num_slots, pages_per_sequence, num_pages, PAGE)


def test_fresh_pool_pops_lifo_and_frees_on_last_reference():
  pm = _manager()
  assert pm.num_free == 12 and pm.in_use == 0 and not pm.refcount.any()
  a = pm.pop(2)
  assert a == [11, 10]  # top of the stack first
  np.testing.assert_array_equal(pm.refcount[a], [1, 1])
  pm.incref([11])
  pm.decref([11, 10])
  assert pm.num_free == 11 and pm.refcount[11] == 1  # 11 still referenced
  assert pm.pop(1) == [10]  # the page just freed is on top
  pm.decref([10, 11])
  pm.check_all_free()


def test_over_pop_and_double_free_raise():
  pm = _manager(num_pages=6)
  with pytest.raises(RuntimeError, match="popping 7"):
    pm.pop(7)
  p = pm.pop(1)
  pm.decref(p)
  with pytest.raises(RuntimeError, match="reference count 0"):
    pm.decref(p)


def test_slot_release_drops_only_the_used_pages():
  pm = _manager()
  own = pm.pop(3)
  pm.assign(1, own)
  np.testing.assert_array_equal(pm.table[1, :3], own)
  pm.release(1, 5)  # 5 cached tokens: 2 pages; the third page stays referenced
  assert not pm.table[1].any() and pm.refcount[own[2]] == 1 and pm.num_free == 11
  pm.decref([own[2]])
  pm.check_all_free()


def test_growth_counts_page_boundaries():
  pm = _manager()
  assert pm.pages_for(0) == 0 and pm.pages_for(4) == 1 and pm.pages_for(5) == 2
  assert pm.growth(3, 1) == 0  # position 3 is in page 0
  assert pm.growth(4, 1) == 1  # position 4 starts page 1
  assert pm.growth(0, 8) == 2 and pm.growth(5, 4) == 1


def test_three_samples_share_full_pages_and_copy_the_partial_one():
  pm = _manager()
  m = 9  # 2 full pages + 1 partial
  assert pm.shared_need(0, m, siblings=3) == 4  # 3 holder pages + 1 copy
  own0, prefill, copy0 = pm.share(0, m, siblings=3)
  assert prefill == [11, 10, 9] and copy0 == (9, 8) and own0 == [11, 10, 8]
  assert pm.shared_need(0, m, siblings=2) == 1
  own1, prefill1, copy1 = pm.share(0, m, siblings=2)
  assert prefill1 is None and copy1 == (9, 7) and own1 == [11, 10, 7]
  assert pm.shared_need(0, m, siblings=1) == 0  # the last one takes the holder's page
  own2, _, copy2 = pm.share(0, m, siblings=1)
  assert copy2 is None and own2 == [11, 10, 9] and not pm.holders
  np.testing.assert_array_equal(pm.refcount[[11, 10, 9, 8, 7]], [3, 3, 1, 1, 1])
  assert pm.in_use == 5
  for s, own in enumerate((own0, own1, own2)):
    pm.assign(s, own)
    pm.release(s, m + 3)  # 12 tokens: still 3 pages
  pm.check_all_free()


@pytest.mark.parametrize("m, holder_pages", [(8, 2), (0, 0)])
def test_prefill_on_a_page_boundary_copies_nothing(m, holder_pages):
  pm = _manager()
  needs, owns = [], []
  for siblings in (3, 2, 1):
    needs.append(pm.shared_need(5, m, siblings))
    own, _, copy = pm.share(5, m, siblings)
    assert copy is None
    owns.append(own)
  assert needs == [holder_pages, 0, 0] and owns[0] == owns[1] == owns[2]
  assert len(owns[0]) == holder_pages and not pm.holders
  for own in owns:
    pm.decref(own)
  pm.check_all_free()


def test_single_sample_takes_the_holder_pages():
  pm = _manager()
  own, prefill, copy = pm.share(2, 6, siblings=1)
  assert own == prefill == [11, 10] and copy is None and not pm.holders
  np.testing.assert_array_equal(pm.refcount[own], [1, 1])


def test_drop_holders_returns_the_unadmitted_share():
  pm = _manager()
  own, _, _ = pm.share(0, 9, siblings=3)  # holder keeps 3 pages, the sample 3 (1 copied)
  pm.share(1, 5, siblings=2)
  assert set(pm.holders) == {0, 1}
  pm.drop_holders()
  assert not pm.holders
  np.testing.assert_array_equal(pm.refcount[own], [1, 1, 1])
  with pytest.raises(RuntimeError, match="leaked"):
    pm.check_all_free()


def test_state_round_trip_and_bad_state():
  pm = _manager()
  pm.assign(0, pm.pop(2))
  other = _manager()
  other.load(pm.state())
  for a, b in zip(other.state(), pm.state(), strict=True):
    np.testing.assert_array_equal(a, b)
  assert other.num_free == 10
  bad = PageState(np.zeros((3, 5), np.int32), pm.refcount, pm.free_stack, np.int32(10))
  with pytest.raises(ValueError, match="state"):
    other.load(bad)


def test_copy_plan_and_bad_arguments():
  src, dst = copy_plan([(3, 7), (3, 8)], num_slots=4, num_pages=12)
  np.testing.assert_array_equal(src, [3, 3, 0, 0])
  np.testing.assert_array_equal(dst, [7, 8, 12, 12])  # 12 = num_pages: no copy
  with pytest.raises(ValueError, match="copies"):
    copy_plan([(0, 1)] * 3, num_slots=2, num_pages=12)
  with pytest.raises(ValueError, match="num_pages"):
    PageManager(4, 5, 0, PAGE)
  with pytest.raises(ValueError, match="page_size"):
    PageManager(4, 5, 8, 0)
