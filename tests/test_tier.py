"""The memory tier on its own: :class:`durablekv.tier.pages.MemoryTier`, a
pure data structure driven with key sequences and no Cache (pages, the page
table, page-level LRU, pending pages, the free list, bulk inserts against
inserting one key at a time, and an exact LRU at ``page_size=1`` against an
``OrderedDict``). tests/test_pages.py drives the same tier through a Cache.
"""

from __future__ import annotations

from collections import OrderedDict

from hypothesis import given, settings
from hypothesis import strategies as st

from durablekv.tier.pages import EMPTY, PENDING, RESIDENT, MemoryTier

from .conftest import check_table, tier_layout



def resident_ids(tier: MemoryTier) -> list[int]:
    return [p.page_id for p in tier.lru_order()]


def flush_all(tier: MemoryTier) -> None:
    """What a successful write-behind cycle does to the tier."""
    for p in list(tier.dirty.values()):
        n = sum(k is not EMPTY for k in p.keys)
        tier.flushed(p, p.version, p.keys_version, n, 0, 10)




@settings(max_examples=300, deadline=None)
@given(page_size=st.sampled_from([1, 2, 3, 4, 16]), max_pages=st.integers(1, 60),
       max_bytes=st.one_of(st.none(), st.integers(20, 400)),
       before=st.integers(0, 30), removed=st.lists(st.integers(0, 29), max_size=8),
       n=st.integers(0, 200), ttl_every=st.sampled_from([0, 1, 3]),
       big_at=st.lists(st.integers(0, 199), max_size=3), budget=st.one_of(
           st.none(), st.integers(1, 8)), start=st.integers(0, 5))
def test_insert_many_fills_whole_pages_exactly_as_the_page_loop(
        page_size, max_pages, max_bytes, before, removed, n, ttl_every, big_at, budget, start):
    """insert_many's bulk step (whole fresh pages at once) leaves the very
    state the page-at-a-time loop leaves: same pages, slots, table order,
    LRU ticks and heap, dirty order, byte counts; from any starting state
    (an open page with room, a free list, pages evicted or pending) and with
    TTLs, entries too big for a page's byte limit, and a page budget."""
    def build(bulk: bool) -> tuple[MemoryTier, int]:
        t = MemoryTier(page_size, max_pages, max_bytes=max_bytes)
        if not bulk:
            t._fill_fresh_pages = lambda *args: args[6]  # the position: nothing placed
        for i in range(before):
            t.insert(("old", i), i, None, 1.0, i + 1, 10)
        for i in set(removed):
            if ("old", i) in t.table:
                t.remove(("old", i), 2.0, 100 + i)
        keys = [f"k{i}" for i in range(n)]
        held = [b"v%d" % i for i in range(n)]
        expires = [50.0 + i if ttl_every and i % ttl_every == 0 else None for i in range(n)]
        nbytes = [5000 if i in big_at else 7 for i in range(n)]
        end = t.insert_many(keys, held, expires, nbytes, 3.0, 200, min(start, n), budget)
        return t, end

    loop, loop_end = build(False)
    bulk, bulk_end = build(True)
    assert bulk_end == loop_end
    assert tier_layout(bulk) == tier_layout(loop)
    check_table(bulk)


def test_new_keys_fill_the_open_page_then_take_a_new_id():
    t = MemoryTier(page_size=2, max_pages=8)
    for k in "abcde":
        t.insert(k, k.upper(), None, 0.0, 1, 10)
    pages = {k: t.table[k][0].page_id for k in "abcde"}
    assert pages == {"a": 1, "b": 1, "c": 2, "d": 2, "e": 3}
    assert t.table["d"][1] in (0, 1) and t.table["c"][1] != t.table["d"][1]
    assert resident_ids(t) == [1, 2, 3]
    assert set(t.dirty) == {1, 2, 3}
    p = t.table["a"][0]
    assert p.used == 2 and p.values[t.table["a"][1]] == "A"


def test_lru_evicts_least_recently_used_page_dirty_ones_go_pending():
    t = MemoryTier(page_size=1, max_pages=2)
    t.insert("a", 1, None, 0.0, 1, 10)
    t.insert("b", 2, None, 0.0, 1, 10)
    t.touch(t.table["a"][0])
    t.insert("c", 3, None, 0.0, 1, 10)            # evicts b (LRU), which is dirty
    assert t.evictions == 1
    pb = t.table["b"][0]
    assert pb.state == PENDING and t.pending == 1
    assert resident_ids(t) == [1, 3]
    assert "b" in t.table                  # still readable while queued
    # the batcher writes it: a pending page then leaves memory
    flush_all(t)
    assert "b" not in t.table and t.pending == 0 and pb.page_id not in t.pages
    assert t.dirty == {}


def test_clean_page_is_dropped_on_eviction_and_faults_back():
    t = MemoryTier(page_size=2, max_pages=1)
    t.next_page_id = 10
    t.install(4, [0, 1], ["x", "y"], [1, 2], [None, 50.0])
    assert t.page_faults == 1 and resident_ids(t) == [4]
    p = t.pages[4]
    assert p.free_slots == [] and p.used == 2 and p.stored_n == 2
    t.insert("z", 3, None, 0.0, 1, 10)           # new page 10 evicts clean page 4: dropped
    assert t.evictions == 1 and t.pending == 0
    assert "x" not in t.table and 4 not in t.pages
    assert resident_ids(t) == [10]


def test_pending_page_taken_back_is_a_page_fault():
    t = MemoryTier(page_size=1, max_pages=1)
    t.insert("a", 1, None, 0.0, 1, 10)
    t.insert("b", 2, None, 0.0, 1, 10)
    pa = t.table["a"][0]
    assert pa.state == PENDING
    t.fault_pending(pa)
    assert pa.state == RESIDENT and t.page_faults == 1
    assert t.table["b"][0].state == PENDING and t.pending == 1
    assert t.resident == len(t.lru_order()) == 1


def test_dirty_tracking_is_by_version():
    t = MemoryTier(page_size=4, max_pages=4)
    t.insert("a", 1, None, 0.0, 1, 10)
    p = t.table["a"][0]
    v, kv = p.version, p.keys_version
    t.update(p, t.table["a"][1], 2, None, 0.0, 1, 10)     # changed while "in flight"
    t.flushed(p, v, kv, 1, 0, 10)
    assert p.page_id in t.dirty                    # still dirty: written again later
    assert p.stored_keys_version == kv
    t.flushed(p, p.version, p.keys_version, 1, 0, 10)
    assert p.page_id not in t.dirty and p.dirty_since is None


def test_value_only_update_keeps_keys_version_expire_change_bumps_it():
    t = MemoryTier(page_size=4, max_pages=4)
    t.insert("a", 1, None, 0.0, 1, 10)
    p, slot, _ = t.table["a"]
    kv = p.keys_version
    t.update(p, slot, 2, None, 0.0, 1, 10)
    assert p.keys_version == kv
    t.update(p, slot, 3, 99.0, 0.0, 1, 10)
    assert p.keys_version == kv + 1 and p.expires[slot] == 99.0


def test_emptied_page_leaves_lru_without_eviction_and_its_id_is_reused():
    t = MemoryTier(page_size=2, max_pages=4)
    for k in "abcde":
        t.insert(k, 0, None, 0.0, 1, 10)          # pages 1: a b, 2: c d, 3: e (open)
    t.remove("c", 0.0, 1)
    t.remove("d", 0.0, 1)
    assert 2 not in resident_ids(t) and t.evictions == 0
    assert t.free == [2] and t.pending == 1
    t.insert("f", 0, None, 0.0, 1, 10)            # fills the open page 3
    t.insert("g", 0, None, 0.0, 1, 10)            # takes id 2 from the free list
    assert t.table["g"][0].page_id == 2 and t.pending == 0
    assert t.table["g"][0].state == RESIDENT


def test_emptied_page_flushed_then_id_reused_as_a_fresh_page():
    t = MemoryTier(page_size=1, max_pages=4)
    t.insert("a", 0, None, 0.0, 1, 10)
    t.insert("b", 0, None, 0.0, 1, 10)
    t.remove("a", 0.0, 1)
    flush_all(t)
    assert 1 not in t.pages and t.free == [1]
    t.insert("c", 0, None, 0.0, 1, 10)
    p = t.table["c"][0]
    assert p.page_id == 1 and p.stored_n == 0 and p.used == 1


def test_clear_forgets_everything_but_page_ids_keep_growing():
    t = MemoryTier(page_size=2, max_pages=2)
    for k in range(7):
        t.insert(k, k, None, 0.0, 1, 10)
    t.clear()
    assert (t.table, t.pages, t.dirty, t.free, t.resident, len(t.policy.heap), t.pending) == ({}, {}, {}, [], 0, 0, 0)
    t.insert("x", 1, None, 0.0, 1, 10)
    assert t.table["x"][0].page_id == 5


def test_key_equality_in_the_page_table_is_dicts():
    t = MemoryTier(page_size=4, max_pages=4)
    t.insert(1.0, "a", None, 0.0, 1, 10)
    assert t.table[1][0] is t.table[True][0]
    p, slot, _ = t.table[1]
    assert type(p.keys[slot]) is float


@given(st.lists(st.integers(0, 12), max_size=200), st.integers(1, 6))
@settings(max_examples=300, deadline=None)
def test_tier_with_page_size_1_is_an_exact_lru(keys, capacity):
    t = MemoryTier(page_size=1, max_pages=capacity)
    model: OrderedDict = OrderedDict()
    hits = model_hits = 0
    for i, k in enumerate(keys):
        ref = t.table.get(k)
        if ref is not None and ref[0].state == RESIDENT:
            hits += 1
            t.touch(ref[0])
        elif ref is not None:
            t.fault_pending(ref[0])
        else:
            t.insert(k, k, None, 0.0, 1, 10)
        if k in model:
            model_hits += 1
            model.move_to_end(k)
        else:
            model[k] = None
            if len(model) > capacity:
                model.popitem(last=False)
        if i % 7 == 0:
            flush_all(t)
        assert [p.keys[0] for p in t.lru_order()] == list(model)
        assert t.resident == len(model)
    assert hits == model_hits


@given(st.lists(st.tuples(st.sampled_from(["get", "get", "del"]), st.integers(0, 12)),
                max_size=300), st.integers(1, 4), st.integers(1, 6))
@settings(max_examples=300, deadline=None)
def test_tier_evicts_the_least_recently_used_page_with_deletes(ops, page_size, capacity):
    """Deleted keys can empty a page, which leaves residency without an
    eviction; every eviction still takes the resident page used least
    recently, the resident count stays true and the heap stays bounded."""
    t = MemoryTier(page_size=page_size, max_pages=capacity)
    last_use: dict[int, int] = {}   # page id -> step of its last access
    victims: list[tuple[int, int]] = []
    real_evict = t._evict

    def evict(page):
        resident = [p for p in t.pages.values() if p.state == RESIDENT]
        oldest = min(last_use[p.page_id] for p in resident)
        victims.append((last_use[page.page_id], oldest))
        real_evict(page)

    real_make_resident = t.make_resident
    step = [0]

    def make_resident(page):
        last_use[page.page_id] = step[0]   # coming in for the access being made
        real_make_resident(page)

    t._evict = evict
    t.make_resident = make_resident
    for i, (op, k) in enumerate(ops):
        step[0] = i
        ref = t.table.get(k)
        if op == "del":
            if ref is not None:
                t.remove(k, 0.0, 1)   # (a delete does not count as a use)
            continue
        if ref is not None and ref[0].state == RESIDENT:
            t.touch(ref[0])
            page = ref[0]
        elif ref is not None:
            page = ref[0]
            t.fault_pending(page)
        else:
            page = t.insert(k, k, None, 0.0, 1, 10)
        last_use[page.page_id] = i
        if i % 5 == 0:
            flush_all(t)
        resident = [p for p in t.pages.values() if p.state == RESIDENT]
        assert t.resident == len(resident) == len(t.lru_order()) <= capacity
        assert len(t.policy.heap) <= 2 * t.resident + 65
    assert all(used == oldest for used, oldest in victims)
    assert t.evictions == len(victims)
    check_table(t)


# -- MemoryTier.insert_many (recovery) against insert one key at a time ------------------


def tier_state(tier: MemoryTier) -> dict:
    """Everything observable about a tier but the version counters (insert
    bumps them per key, insert_many per page)."""
    return dict(
        table={k: (p.page_id, s, v) for k, (p, s, v) in tier.table.items()},
        pages={pid: (list(p.keys), list(p.values), list(p.expires), p.used, p.nbytes,
                     list(p.free_slots), p.state, p.dirty_lsn)
               for pid, p in tier.pages.items()},
        lru=resident_ids(tier), dirty=list(tier.dirty), pending=tier.pending,
        evictions=tier.evictions, free=list(tier.free), next_page_id=tier.next_page_id,
        open_page=None if tier.open_page is None else tier.open_page.page_id)


@settings(max_examples=300, deadline=None)
@given(page_size=st.integers(1, 5), max_pages=st.integers(1, 4),
       setup=st.lists(st.tuples(st.sampled_from(["ins", "rm", "flush"]), st.integers(0, 20),
                                st.integers(1, 60)), max_size=40),
       sizes=st.lists(st.integers(1, 60), max_size=40),
       budgets=st.lists(st.integers(1, 3), min_size=1, max_size=6))
def test_insert_many_matches_insert_one_at_a_time(page_size, max_pages, setup, sizes, budgets):
    """Same pages, slots, byte counts, LRU order, evictions, pending pages,
    free list and dirty LSNs, from any tier history (free slots in any order,
    emptied pages on the free list, stale byte counts), with a byte limit
    that splits pages, in several calls bounded by a page budget."""
    from unittest import mock

    import durablekv.tier.pages as pages

    def build() -> MemoryTier:
        t = MemoryTier(page_size=page_size, max_pages=max_pages)
        for op, n, nbytes in setup:
            key = f"s{n}"
            if op == "ins" and key not in t.table:
                t.insert(key, n, None, 0.0, 1, nbytes)
            elif op == "rm" and key in t.table:
                t.remove(key, 0.0, 2)
            elif op == "flush":
                flush_all(t)
        return t

    keys = [f"new{i}" for i in range(len(sizes))]
    held = [i * 10 for i in range(len(sizes))]
    expires = [None if i % 3 else 50.0 + i for i in range(len(sizes))]
    with mock.patch.object(pages, "PAGE_BYTES_LIMIT", 100):
        one, many = build(), build()
        for k, h, e, nb in zip(keys, held, expires, sizes):
            one.insert(k, h, e, 0.0, 7, nb)
        pos, calls = 0, 0
        while pos < len(keys):
            end = many.insert_many(keys, held, expires, sizes, 0.0, 7, pos,
                                   budgets[calls % len(budgets)])
            assert end > pos
            pos, calls = end, calls + 1
    assert tier_state(many) == tier_state(one)
    check_table(one)
    check_table(many)


def test_insert_many_without_a_budget_takes_everything():
    t = MemoryTier(page_size=4, max_pages=100)
    keys = [f"k{i}" for i in range(37)]
    assert t.insert_many(keys, keys, [None] * 37, [10] * 37, 0.0, 5) == 37
    assert len(t.table) == 37 and len(t.pages) == 10 and len(t.dirty) == 10
    assert all(p.dirty_lsn == 5 for p in t.pages.values())


def test_each_tier_builds_only_its_own_policy(monkeypatch):
    """The tier factory builds one policy object per tier: the entry tier
    (policy="midpoint") does not also build, and then drop, a page LRU."""
    from durablekv.policies import lru, midpoint, tinylfu
    from durablekv.tier import make_tier
    from durablekv.tier.midpoint import SlotPage

    built = []
    for cls in (lru.LRU, midpoint.Midpoint, tinylfu.TinyLFU):
        init = cls.__init__
        monkeypatch.setattr(cls, "__init__",
                            lambda self, *a, _init=init, _cls=cls, **k:
                            (built.append(_cls.__name__), _init(self, *a, **k))[1])
    for name, want in (("lru", "LRU"), ("midpoint", "Midpoint"), ("tinylfu", "TinyLFU")):
        built.clear()
        tier = make_tier(4, 8, name)
        assert built == [want] and type(tier.policy).__name__ == want
        tier.insert("k", b"v", None, 0.0, 1, 6)
        page = tier.table["k"][0]
        assert (type(page) is SlotPage) == (name == "midpoint")
