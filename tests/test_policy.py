"""Replacement policies: the frequency sketch, W-TinyLFU's admission, and
the memory tier's invariants under ``policy="tinylfu"``.

The sketch on its own (counts, saturation, aging), then the tier driven
directly (scan resistance, a frequent candidate winning over a victim, a
hypothesis run of gets/inserts/deletes/flushes checking that the resident
count holds, dirty victims go pending and the page table stays true), then
through a Cache (policy not stored: reopening with the other one works).
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from durablekv import Cache
from durablekv.errors import ConfigError
from durablekv.tier.pages import EMPTY, PENDING, RESIDENT, MemoryTier, Page
from durablekv.policies import LRU
from durablekv.policies.tinylfu import FrequencySketch, WindowClimber, window_split

from .conftest import check_table, opened


def flush_all(tier: MemoryTier) -> None:
    for p in list(tier.dirty.values()):
        n = sum(k is not EMPTY for k in p.keys)
        tier.flushed(p, p.version, p.keys_version, n, 0, 10)


# -- the sketch --------------------------------------------------------------------------


def test_sketch_counts_each_key_and_saturates_at_15():
    s = FrequencySketch(1000)
    for k in range(200):
        for _ in range(k % 20):
            s.increment(k)
    for k in range(200):
        # Count-Min never underestimates; 4-bit counters stop at 15
        assert min(k % 20, 15) <= s.frequency(k) <= 15
    exact = sum(s.frequency(k) == min(k % 20, 15) for k in range(200))
    assert exact >= 190          # 200 keys in 1024-wide rows: collisions are rare
    assert s.frequency("never seen") == 0 or s.frequency("never seen") <= 2


def test_sketch_halves_every_counter_after_its_sample():
    s = FrequencySketch(100)          # sample = 1000 increments
    assert s.sample == 1000
    for _ in range(12):
        s.increment("hot")
    for _ in range(987):
        s.increment("cold")
    assert s.resets == 0 and (s.frequency("hot"), s.frequency("cold")) == (12, 15)
    s.increment("x")                  # the 1000th increment ages the sketch
    assert s.resets == 1
    assert (s.frequency("hot"), s.frequency("cold"), s.frequency("x")) == (6, 7, 0)
    assert s.additions == 500


def test_sketch_rejects_a_capacity_below_one():
    with pytest.raises(ValueError, match="capacity"):
        FrequencySketch(0)


def test_window_split_is_one_percent_then_80_20():
    assert window_split(1000) == (10, 792)
    assert window_split(1) == (1, 0)
    assert window_split(5) == (1, 3)


# -- the tier under tinylfu ----------------------------------------------------------------


def resident(t: MemoryTier, k) -> bool:
    ref = t.table.get(k)
    return ref is not None and ref[0].state == RESIDENT


def access(t: MemoryTier, k) -> None:
    ref = t.table.get(k)
    if ref is not None and ref[0].state == RESIDENT:
        ref[0].stamp = next(t.ticks)          # what Cache.get's memory hit does
    elif ref is not None:
        t.fault_pending(ref[0])
    else:
        t.insert(k, k, None, 0.0, 1, 10)


def test_a_scan_does_not_flush_the_frequent_pages():
    """LRU loses every hot key to a one-pass scan; W-TinyLFU keeps them, the
    scan's pages losing admission against the hot pages' frequency."""
    hot = range(50)
    # (a 128-counter-wide sketch and 500 scanned page ids: a few collisions
    # can let a scanned page in, so tinylfu is asked for 90%, not all)
    for policy, kept in (("lru", range(0, 1)), ("tinylfu", range(45, 51))):
        t = MemoryTier(page_size=1, max_pages=100, policy=policy)
        for _ in range(5):
            for k in hot:
                access(t, k)
        flush_all(t)
        for k in range(1000, 1500):
            access(t, k)
            flush_all(t)
        assert sum(k in t.table for k in hot) in kept, policy
        assert t.resident <= 100
        check_table(t)
    assert t.policy.rejected > 400


def test_a_frequent_candidate_wins_against_the_probation_victim():
    t = MemoryTier(page_size=1, max_pages=10, policy="tinylfu")   # window 1
    for k in range(10):
        access(t, k)
    flush_all(t)
    # key 100 will live in the page with the next id; make that id frequent
    nxt = t.next_page_id
    for _ in range(5):
        t.policy.sketch.increment(nxt)
    access(t, 100)
    access(t, 101)          # pushes 100 out of the window: it must win
    # (9 lost its own admission when 100 came: a tie goes to the victim)
    assert resident(t, 100) and not resident(t, 9)
    assert t.policy.admitted == 1
    assert [k for k in range(10) if resident(t, k)] == list(range(1, 9))
    # and 101, seen as often as the victim, loses when 102 comes: it is
    # dirty, so it waits for the batcher as a pending page
    access(t, 102)
    assert not resident(t, 101)
    assert t.table[101][0].state == PENDING and t.table[101][0].page_id in t.dirty
    check_table(t)


def test_page_size_one_lru_is_unchanged_by_the_option():
    a = MemoryTier(page_size=1, max_pages=3)
    b = MemoryTier(page_size=1, max_pages=3, policy="lru")
    for k in [1, 2, 3, 1, 4, 2, 5, 1]:
        access(a, k)
        access(b, k)
    assert [k for k in a.table if resident(a, k)] == [k for k in b.table if resident(b, k)]
    assert sorted(k for k in a.table if resident(a, k)) == [1, 2, 5]
    # plain pages under LRU: a memory hit stays one attribute store
    assert isinstance(a.policy, LRU) and type(next(iter(a.pages.values()))) is Page


@given(st.lists(st.tuples(st.sampled_from(["get", "get", "get", "del", "flush"]),
                          st.integers(0, 30)), max_size=400),
       st.integers(1, 4), st.integers(1, 8))
@settings(max_examples=200, deadline=None)
def test_tinylfu_keeps_the_tier_invariants(ops, page_size, capacity):
    """Whatever W-TinyLFU chooses: at most ``max_pages`` resident, the count
    true, the segments adding up to it, a dirty victim pending (still in
    memory and dirty until the batcher writes it), a clean victim gone, the
    page just made resident still resident, the page table true."""
    t = MemoryTier(page_size=page_size, max_pages=capacity, policy="tinylfu")
    real_evict = t._evict

    def evict(page):
        dirty = page.page_id in t.dirty
        real_evict(page)
        if dirty:
            assert page.state == PENDING and t.pages[page.page_id] is page
        else:
            assert page.page_id not in t.pages

    t._evict = evict
    for op, k in ops:
        if op == "flush":
            flush_all(t)
            continue
        ref = t.table.get(k)
        if op == "del":
            if ref is not None:
                t.remove(k, 0.0, 1)
            continue
        access(t, k)
        page = t.table[k][0]
        assert page.state == RESIDENT
        resident = [p for p in t.pages.values() if p.state == RESIDENT]
        assert t.resident == len(resident) == sum(t.policy.sizes) <= capacity
        assert sorted(p.page_id for p in t.policy.order()) == sorted(p.page_id for p in resident)
        assert t.policy.heap_entries() <= 2 * t.resident + 65
        assert all(p.page_id in t.dirty for p in t.pages.values() if p.state == PENDING
                   and p.used)
    check_table(t)


def test_unknown_policy_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="policy='lfu'.*tinylfu"):
        Cache(tmp_path / "c", policy="lfu")
    with pytest.raises(ConfigError, match="policy"):
        MemoryTier(4, 4, policy="arc")


# -- through a Cache -------------------------------------------------------------------------


def test_policy_is_not_stored_reopen_with_the_other_one(tmp_path):
    d = tmp_path / "c"
    with opened(d, page_size=4, max_pages=2, policy="tinylfu") as c:
        for i in range(100):
            c[i] = i * 2
        for _ in range(3):
            for i in range(8):
                assert c[i] == i * 2
        assert c._tier.resident <= 2
    with opened(d, max_pages=2) as c:             # lru
        assert c.policy == "lru"
        assert [c[i] for i in range(100)] == [i * 2 for i in range(100)]
    with opened(d, max_pages=3, policy="tinylfu") as c:
        assert [c.get(i) for i in range(100)] == [i * 2 for i in range(100)]
        assert c._tier.resident <= 3
        check_table(c._tier)
        st_ = c.stats()
        assert st_.memory_hits + st_.store_hits == 100


def test_tinylfu_cache_counts_lock_free_hits_in_the_sketch(tmp_path):
    with opened(tmp_path / "c", page_size=1, max_pages=50, policy="tinylfu") as c:
        c["a"] = 1
        page = c._tier.table["a"][0]
        before = c._tier.policy.sketch.frequency(page.page_id)
        for _ in range(5):
            assert c["a"] == 1
        assert c._tier.policy.sketch.frequency(page.page_id) == min(before + 5, 15)
        assert c.stats().memory_hits == 5


def test_the_window_climbs_while_the_hit_ratio_improves_and_turns_when_it_falls():
    c = WindowClimber(100)                  # period 1000 accesses, step 6.25
    assert c.caps() == (1, 79)
    assert not c.observe(999, 500)          # not a whole period yet
    assert c.observe(1000, 500)             # 0.0 -> 0.5: up
    assert c.window == pytest.approx(7.25)
    assert c.observe(2000, 900)             # 0.5 -> 0.6: up again
    assert c.window == pytest.approx(13.5)
    assert c.observe(3000, 1500)            # 0.6 -> 0.4: turn round
    assert c.window == pytest.approx(7.25)
    assert c.observe(4000, 2099)            # 0.4 -> 0.401: same way, decayed step
    assert c.window == pytest.approx(7.25 - 6.25)
    assert c.step == pytest.approx(-6.25 * 0.98)
    assert c.caps() == (1, 79)              # never below one item


def test_a_recency_workload_grows_the_tiers_window():
    """Every key is used twice, ten new keys apart, then never again: only a
    window of 10 or more pages catches the second use (a candidate seen once
    loses against probation's victims). Each admission reports the tier's
    accesses and misses to the climber, which grows the window, and the
    segments take the sizes it sets."""
    t = MemoryTier(page_size=1, max_pages=100, policy="tinylfu")
    for j in range(40_000):
        access(t, j)
        access(t, j - 10)
        if j % 50 == 0:
            flush_all(t)
    assert t.policy.climber.adjustments > 20
    assert t.policy.window_cap >= 10
    assert (t.policy.window_cap, t.policy.protected_cap) == t.policy.climber.caps()
    assert t.policy.sizes[2] <= t.policy.protected_cap
    assert t.resident <= 100
    check_table(t)


# -- under a byte bound (max_memory_bytes) ---------------------------------------------------


def hot_and_scan(c: Cache, rounds: int = 30) -> float:
    """Read-through: a hot set of 20 keys read every round, then a burst of
    100 keys never seen before nor after; 1 KB values. Returns the memory
    hit ratio of the gets."""
    value = b"v" * 1000
    fresh = 0
    for _ in range(rounds):
        for k in range(20):
            if c.get(f"hot{k}") is None:
                c[f"hot{k}"] = value
        for _ in range(100):
            fresh += 1
            if c.get(f"scan{fresh}") is None:
                c[f"scan{fresh}"] = value
    s = c.stats()
    return s.memory_hits / (s.memory_hits + s.store_hits + s.misses)


def test_a_byte_bound_far_below_max_pages_keeps_the_hot_pages_under_tinylfu(tmp_path):
    """About 48 one-entry pages fit in the bytes and 10,000 in pages: sized
    in pages, the window (100 pages) would hold the whole cache and TinyLFU
    would be LRU, which loses the hot set to every burst. Weighed in bytes,
    the scan's pages lose admission to the hot ones."""
    ratio, kept = {}, {}
    for policy in ("lru", "tinylfu"):
        with opened(tmp_path / policy, page_size=1, max_pages=10_000, policy=policy,
                    max_memory_bytes=50_000) as c:
            ratio[policy] = hot_and_scan(c)
            assert c.stats().memory_bytes <= 50_000
            kept[policy] = sum(resident(c._tier, f"hot{k}") for k in range(20))
    # 600 hot gets of 3600: LRU hits none of them (every burst flushes the
    # hot set), TinyLFU nearly all after the first round
    assert ratio["lru"] < 0.02
    assert ratio["tinylfu"] > 0.14, ratio
    assert kept == {"lru": 0, "tinylfu": 20}


def test_under_a_byte_bound_the_climber_moves_a_byte_split():
    """The recency workload above, weighed: 100 pages of 10 bytes fit in the
    bytes, 10,000 in pages. The window must grow to 10 pages' bytes (10% of
    the bound) to catch the second uses, and the climber's caps are bytes,
    with the same share of max_pages."""
    t = MemoryTier(page_size=1, max_pages=10_000, policy="tinylfu", max_bytes=1000)
    p = t.policy
    assert (p.window_cap, p.window_pages) == (10, 100)      # 1% of each
    for j in range(40_000):
        access(t, j)
        access(t, j - 10)
        if j % 50 == 0:
            flush_all(t)
        assert t.resident_bytes <= 1000
    assert p.climber.adjustments > 20
    assert p.window_cap >= 100
    assert (p.window_cap, p.protected_cap) == p.climber.caps()
    assert p.window_pages == p.window_cap * 10_000 // 1000
    assert p.weights[2] <= p.protected_cap
    assert t.resident <= 100
    check_table(t)
