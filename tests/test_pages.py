"""The memory tier through a Cache: with ``page_size=1`` the tier is exactly
an LRU of ``max_pages`` entries whatever the flush timing (hypothesis against
an ``OrderedDict``), with bigger pages the resident page count never exceeds
``max_pages``, and pages spilled to the store read back. The tier on its own,
with no Cache, is tests/test_tier.py.
"""

from __future__ import annotations

import tempfile
from collections import OrderedDict

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from durablekv import Cache




def lru_model_hits(ops, capacity):
    model: OrderedDict = OrderedDict()
    hits = 0
    for k in ops:
        if k in model:
            hits += 1
            model.move_to_end(k)
        else:
            model[k] = None
            if len(model) > capacity:
                model.popitem(last=False)
    return hits


@given(ops=st.lists(st.one_of(st.integers(0, 15), st.just("flush")), min_size=1, max_size=120),
       capacity=st.integers(1, 5), interval=st.sampled_from([30.0, 0.001]))
@settings(max_examples=150, deadline=None)
def test_cache_with_page_size_1_memory_hits_equal_an_lru(ops, capacity, interval):
    """Look-aside get-then-set-on-miss: memory hits equal an OrderedDict LRU
    of ``max_pages`` entries, whether the batcher flushes all the time, only
    when asked, or anything in between (a page fault is never a memory hit)."""
    keys = [k for k in ops if k != "flush"]
    with tempfile.TemporaryDirectory() as d:
        with Cache(d, page_size=1, max_pages=capacity, flush_interval=interval,
                   flush_batch_pages=2) as c:
            gets = 0
            for k in ops:
                if k == "flush":
                    c.flush()
                    continue
                gets += 1
                if c.get(k) is None:
                    c.set(k, k)
                s = c.stats()
                assert s.resident_pages <= capacity
            s = c.stats()
            assert s.memory_hits == lru_model_hits(keys, capacity)
            assert s.memory_hits + s.store_hits + s.misses == gets
            assert s.misses == len(set(keys))
            assert s.page_faults == s.store_hits
            assert len(c) == len(set(keys))


OPS = st.lists(st.tuples(st.sampled_from(["set", "get", "delete", "flush", "pop"]),
                         st.integers(0, 40)), max_size=150)


@given(ops=OPS, page_size=st.integers(2, 5), max_pages=st.integers(1, 3))
@settings(max_examples=100, deadline=None)
def test_resident_pages_never_exceed_max_pages(ops, page_size, max_pages):
    with tempfile.TemporaryDirectory() as d:
        model = {}
        with Cache(d, page_size=page_size, max_pages=max_pages, flush_interval=30,
                   flush_batch_pages=2, max_pending_pages=4) as c:
            for op, k in ops:
                if op == "set":
                    c[k] = k
                    model[k] = k
                elif op == "get":
                    assert c.get(k) == model.get(k)
                elif op == "delete":
                    assert c.delete(k) == (k in model)
                    model.pop(k, None)
                elif op == "pop":
                    assert c.pop(k, None) == model.pop(k, None)
                else:
                    c.flush()
                s = c.stats()
                assert s.resident_pages <= max_pages
                assert s.pending_pages <= 4 + 2
            assert len(c) == len(model) and sorted(c) == sorted(model)
        with Cache(d) as c:
            assert dict(c.items()) == model


def test_page_recency_is_per_page(tmp_path):
    # touching any entry of a page keeps the whole page resident
    with Cache(tmp_path / "c", page_size=2, max_pages=2, flush_interval=30) as c:
        c["a"], c["b"] = 1, 2        # page 1
        c["c"], c["d"] = 3, 4        # page 2
        c.get("a")                   # page 1 is now MRU
        c["e"] = 5                   # page 3 evicts page 2
        before = c.stats()
        assert c["b"] == 2           # same page as a: a memory hit
        assert c.stats().memory_hits == before.memory_hits + 1
        assert c["c"] == 3           # page 2 was evicted: a store hit
        s = c.stats()
        assert s.store_hits == before.store_hits + 1 and s.evictions >= 1


def test_get_of_evicted_key_is_a_store_hit_and_a_page_fault(tmp_path):
    with Cache(tmp_path / "c", page_size=1, max_pages=1, flush_interval=30) as c:
        c["a"] = 1
        c["b"] = 2                   # a's page leaves memory (dirty: queued)
        before = c.stats()
        assert before.evictions == 1 and before.resident_pages == 1
        assert c["a"] == 1           # from the batcher's queue or from SQLite
        s = c.stats()
        assert (s.memory_hits, s.store_hits) == (before.memory_hits, before.store_hits + 1)
        assert s.page_faults == before.page_faults + 1
        c.flush()
        assert c["b"] == 2           # b was evicted by a's fault, then flushed
        s2 = c.stats()
        assert s2.store_hits == s.store_hits + 1 and s2.memory_hits == s.memory_hits
        assert c["b"] == 2
        assert c.stats().memory_hits == s.memory_hits + 1


@pytest.mark.parametrize("page_size,max_pages", [(1, 1), (4, 2), (16, 1)])
def test_spilled_pages_read_back_after_flush_and_restart(tmp_path, page_size, max_pages):
    n = 100
    with Cache(tmp_path / "c", page_size=page_size, max_pages=max_pages,
               flush_interval=30) as c:
        for i in range(n):
            c[i] = str(i)
        s = c.stats()
        assert s.resident_pages <= max_pages
        assert s.evictions >= n // page_size - max_pages
        assert all(c[i] == str(i) for i in range(n))
        assert c.stats().resident_pages <= max_pages
    # warm=False: the pages come back by page faults (test_warm.py has the preload)
    with Cache(tmp_path / "c", max_pages=max_pages, warm=False) as c:
        assert c.stats().resident_pages == 0         # nothing is read at open
        assert all(c[i] == str(i) for i in range(n))
        assert len(c) == n
