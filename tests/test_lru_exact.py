"""With page_size=1 the memory tier is an exact LRU of max_pages entries.

The reference value (380,653 memory hits of 914,145 requests on arc_OLTP.lis
with 1,869 slots) was computed independently (see ../shared/traces/README.md)
and matches the LRU column of the ARC paper.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict

import pytest

from durablekv import Cache
from durablekv.traces import open_trace

from .conftest import trace_path


def lru_hits(keys, capacity: int) -> int:
    od: OrderedDict = OrderedDict()
    hits = 0
    for k in keys:
        if k in od:
            od.move_to_end(k)
            hits += 1
        else:
            od[k] = None
            if len(od) > capacity:
                od.popitem(last=False)
    return hits


def replay_memory_hits(cache: Cache, keys) -> int:
    for k in keys:
        if cache.get(k) is None:
            cache.set(k, b"v")
    return cache.stats().memory_hits


def test_slice_of_oltp_matches_ordereddict_model(tmp_path):
    keys = [r.key for r in itertools.islice(open_trace(trace_path("arc_OLTP.lis")), 60_000)]
    with Cache(tmp_path / "c", page_size=1, max_pages=1869, durability="none") as cache:
        got = replay_memory_hits(cache, keys)
        st = cache.stats()
    assert got == lru_hits(keys, 1869)
    # every get is a memory hit, a store hit (page fault) or a miss
    assert st.memory_hits + st.store_hits + st.misses == len(keys)
    assert st.store_hits == st.page_faults


def test_lru_model_agrees_with_flush_timing(tmp_path):
    """Page faults from the write-behind queue never count as memory hits:
    the result is the same whether or not flushes happened in between."""
    keys = [r.key for r in itertools.islice(open_trace(trace_path("arc_OLTP.lis")), 20_000)]
    expected = lru_hits(keys, 300)
    with Cache(tmp_path / "a", page_size=1, max_pages=300, flush_interval=1000,
               flush_batch_pages=1_000_000, max_pending_pages=1_000_000) as cache:
        assert replay_memory_hits(cache, keys) == expected
    with Cache(tmp_path / "b", page_size=1, max_pages=300, flush_batch_pages=1) as cache:
        for i, k in enumerate(keys):
            if cache.get(k) is None:
                cache.set(k, b"v")
            if i % 997 == 0:
                cache.flush()
        assert cache.stats().memory_hits == expected


@pytest.mark.stress
def test_whole_oltp_trace_exact_lru(tmp_path):
    keys = [r.key for r in open_trace(trace_path("arc_OLTP.lis"))]
    assert len(keys) == 914_145
    with Cache(tmp_path / "c", page_size=1, max_pages=1869, durability="none") as cache:
        got = replay_memory_hits(cache, keys)
    assert got == 380_653
