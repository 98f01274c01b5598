"""The replacement policies as objects of their own (``durablekv.policies``),
driven without a Cache or a memory tier.

Each policy object is handed a small tier that keeps only what the policy
reads and calls (:class:`~durablekv.policies.base.EvictionPolicy`): the
bounds, the resident count and the recency clock, and an ``_evict`` that
records the victims. Key sequences then check each policy's documented
behaviour: LRU evicts the page with the oldest stamp, exactly, against a
reference; W-TinyLFU keeps a frequently used page through a scan that an
LRU would let push it out; the midpoint policy, alone, is an exact LRU when
no neighbours come in, and lets a page fault's neighbours go before the young
entries. The factory checks names in one place.
"""

from __future__ import annotations

from collections import OrderedDict
from itertools import count

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from durablekv.errors import ConfigError
from durablekv.tier.pages import Page
from durablekv.policies import LRU, POLICIES, TinyLFU, check_policy, make_policy
from durablekv.policies.midpoint import YOUNG, Midpoint


class SmallTier:
    """What a policy sees of a page-granular tier, and nothing else."""

    def __init__(self, max_pages: int, max_bytes: int | None = None) -> None:
        self.max_pages = max_pages
        self.max_bytes = max_bytes
        self.resident = 0
        self.resident_bytes = 0
        self.ticks = count(1)
        self.locked_ticks = 0
        self.evicted: list[int] = []
        self.policy = None
        self.pages: dict[int, Page] = {}

    def over(self) -> bool:
        return self.resident > self.max_pages or (
            self.max_bytes is not None and self.resident_bytes > self.max_bytes
            and self.resident > 1)

    def _evict(self, page: Page) -> None:
        self.resident -= 1
        self.resident_bytes -= page.nbytes
        self.evicted.append(page.page_id)
        del self.pages[page.page_id]

    # the two things a tier does around its policy
    def bring_in(self, page_id: int, nbytes: int = 0) -> Page:
        page = self.policy.page_factory(Page)(page_id, 1)
        page.nbytes = nbytes
        self.pages[page_id] = page
        self.resident += 1
        self.resident_bytes += nbytes
        self.policy.admit(page, next(self.ticks))
        return page

    def access(self, page_id: int) -> bool:
        """A get of page ``page_id``: True for a hit, False for a fault."""
        page = self.pages.get(page_id)
        if page is not None:
            page.stamp = next(self.ticks)      # the lock-free memory hit
            return True
        self.policy.count_fault(page_id)
        self.bring_in(page_id)
        return False


def with_policy(name: str, max_pages: int, max_bytes: int | None = None) -> SmallTier:
    tier = SmallTier(max_pages, max_bytes)
    tier.policy = make_policy(name, tier)
    return tier


class ReferenceLRU:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.items: OrderedDict[int, None] = OrderedDict()
        self.evicted: list[int] = []

    def access(self, key: int) -> bool:
        if key in self.items:
            self.items.move_to_end(key)
            return True
        self.items[key] = None
        if len(self.items) > self.capacity:
            self.evicted.append(self.items.popitem(last=False)[0])
        return False


# -- LRU ---------------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 8), st.lists(st.integers(0, 20), max_size=300))
def test_lru_is_an_exact_lru(capacity, keys):
    tier, ref = with_policy("lru", capacity), ReferenceLRU(capacity)
    for k in keys:
        assert tier.access(k) == ref.access(k)
        assert tier.evicted == ref.evicted
        assert sorted(tier.pages) == sorted(ref.items)
    assert [p.page_id for p in tier.policy.order()] == list(ref.items)


def test_lru_rebuilds_its_heap_and_keeps_the_order():
    tier = with_policy("lru", 4)
    for k in range(4):
        tier.bring_in(k)
    for _ in range(200):                   # hits only: no entry goes stale ...
        tier.access(0)
    for k in range(100, 400):              # ... misses leave stale entries behind
        tier.access(k)
    assert len(tier.policy.heap) <= 2 * tier.resident + 65
    assert [p.page_id for p in tier.policy.order()] == [396, 397, 398, 399]


def test_lru_byte_bound_evicts_the_oldest_until_it_fits():
    tier = with_policy("lru", 10, max_bytes=100)
    for k in range(4):
        tier.bring_in(k, nbytes=30)       # the fourth passes 100 bytes
    assert tier.evicted == [0] and tier.resident_bytes == 90
    tier.access(1)
    tier.bring_in(9, nbytes=60)
    assert tier.evicted == [0, 2, 3] and sorted(tier.pages) == [1, 9]


def test_lru_files_a_run_of_fresh_pages_in_one_step():
    tier = with_policy("lru", 8)
    assert tier.policy.bulk_admit
    pages = [Page(i, 1) for i in range(3)]
    stamps = [next(tier.ticks) for _ in pages]
    for p, s in zip(pages, stamps):
        p.stamp = p.heap_stamp = s
        tier.pages[p.page_id] = p
    tier.resident = 3
    tier.policy.admit_fresh(stamps, pages)
    assert tier.policy.order() == pages


# -- W-TinyLFU ---------------------------------------------------------------------------


def test_tinylfu_keeps_a_frequent_page_through_a_scan_lru_does_not():
    results = {}
    for name in ("lru", "tinylfu"):
        tier = with_policy(name, 100)
        for _ in range(20):                # a hot set, used over and over
            for k in range(50):
                tier.access(k)
        for k in range(1000, 3000):        # one pass over keys never used again
            tier.access(k)
        results[name] = sum(tier.access(k) for k in range(50))
    assert results["lru"] == 0
    assert results["tinylfu"] >= 45


def test_tinylfu_counts_every_touch_and_fault_in_its_sketch():
    tier = with_policy("tinylfu", 16)
    page = tier.bring_in(7)
    assert tier.policy.sketch.frequency(7) == 0    # coming in is not an access
    for _ in range(3):
        tier.access(7)                             # a hit: the stamp store counts
    tier.policy.count_fault(7)
    assert tier.policy.sketch.frequency(7) == 4
    assert not tier.policy.bulk_admit
    assert type(page).__name__ == "CountedPage"


def test_tinylfu_never_evicts_the_page_it_admits():
    tier = with_policy("tinylfu", 3)
    for k in range(50):
        page = tier.bring_in(k)
        assert page.page_id in tier.pages and tier.resident <= 3


# -- the factory -------------------------------------------------------------------------


def test_policies_are_built_from_their_name_in_one_place():
    tier = SmallTier(4)
    assert isinstance(make_policy("lru", tier), LRU)
    assert isinstance(make_policy("tinylfu", tier), TinyLFU)
    assert POLICIES == ("lru", "tinylfu", "midpoint")
    assert check_policy("midpoint") == "midpoint"
    with pytest.raises(ConfigError, match="per entry"):
        make_policy("midpoint", tier)
    with pytest.raises(ConfigError, match="expected one of 'lru', 'tinylfu', 'midpoint'"):
        make_policy("arc", tier)


# -- midpoint (entries: young and old sublists) ------------------------------------------


class Slots:
    """A page's per-slot fields the midpoint policy keeps (where, stamps, filed)."""

    def __init__(self, page_id: int, n: int = 1) -> None:
        self.page_id = page_id
        self.where, self.stamps, self.filed = [0] * n, [0] * n, [0] * n


class EntryTier:
    """What the midpoint policy sees of an entry-granular tier: a clock and
    a budget; entries come in young (a miss) or old (a fault's neighbours)."""

    def __init__(self, budget: int) -> None:
        self.ticks = count(1)
        self.locked_ticks = 0
        self.policy = Midpoint(self, budget)
        self.pages: dict[int, Slots] = {}
        self.evicted: list[int] = []

    def _fit(self) -> None:
        self.policy.demote_overflow()
        while self.policy.entries > self.policy.budget:
            page, slot = self.policy.next_victim()
            page.where[slot] = 0
            self.evicted.append(page.page_id)
            del self.pages[page.page_id]
        self.policy.compact()

    def access(self, key: int, neighbours: tuple[int, ...] = ()) -> bool:
        page = self.pages.get(key)
        if page is not None:
            if page.where[0] == YOUNG:
                page.stamps[0] = next(self.ticks)          # the lock-free memory hit
            else:
                self.policy.hit_old(page, 0)
            self._fit()
            return True
        self.pages[key] = page = Slots(key)
        self.policy.add_young(page, 0)
        for n in neighbours:
            if n not in self.pages:
                self.pages[n] = Slots(n)
                self.policy.add_old(self.pages[n], 0)
        self._fit()
        return False


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 8), st.lists(st.integers(0, 20), max_size=300))
def test_midpoint_without_neighbours_is_an_exact_lru(budget, keys):
    tier, ref = EntryTier(budget), ReferenceLRU(budget)
    for k in keys:
        assert tier.access(k) == ref.access(k)
        assert sorted(tier.pages) == sorted(ref.items)
    assert tier.evicted == ref.evicted


def test_midpoint_neighbours_enter_old_and_leave_before_young_entries():
    tier = EntryTier(16)                     # young 10, old 6
    for k in range(10):
        tier.access(k)                       # a young working set
    tier.access(100, neighbours=tuple(range(101, 116)))   # a fault reads 15 neighbours
    assert all(k in tier.pages for k in range(10))
    assert tier.policy.young_n <= tier.policy.young_cap
    # the young overflow (key 0) went to the old end behind the neighbours, and
    # the ten entries over the budget were the oldest neighbours
    assert tier.evicted == list(range(101, 111))
    assert tier.access(115) and tier.pages[115].where[0] == YOUNG   # a hit moves it young


def test_midpoint_counts_its_locked_ticks_on_the_tier():
    tier = EntryTier(4)
    tier.access(1)
    tier.access(2, neighbours=(3,))
    tier.policy.hit_old(tier.pages[3], 0)
    assert tier.locked_ticks == 3            # two young entries and one move: ticks drawn here
