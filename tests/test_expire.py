"""Reclaiming expired entries: ``Cache.expire()`` and the write-behind's sweep.

An entry whose TTL passed is never served, but until something removes it,
it stays on its page in SQLite. These tests check that ``expire()`` removes
every one, in memory and on disk, without faulting pages in; that the
write-behind removes them on its own; and that a clean close stores the
pages the removals dirtied. TTL time moves only when a test moves it.
"""

from __future__ import annotations

import logging
import sqlite3

import pytest

from durablekv import Cache, CacheClosedError, CorruptStoreError

from .conftest import Clock, check_table, open_cache, opened, run_with_timeout


def stored_rows(directory) -> tuple[int, int]:
    """``(index rows, index rows with an expiry)`` committed in SQLite."""
    conn = sqlite3.connect(directory / "pages.sqlite3")
    try:
        return conn.execute("SELECT COUNT(*), COUNT(expire_at) FROM keys").fetchone()
    finally:
        conn.close()


def fill(c: Cache, n: int, ttl: float = 10) -> None:
    """Keys ``k0..k{n-1}``: the even ones expire after ``ttl`` seconds."""
    for i in range(n):
        c.set(f"k{i}", i, expire=ttl if i % 2 == 0 else None)


def test_expire_removes_every_expired_entry_in_memory_and_on_disk(tmp_path):
    clock = Clock(1000)
    d = tmp_path / "c"
    with opened(d, clock=clock, page_size=4, max_pages=3) as c:
        c._sweep_on = False                  # only the calls below remove entries
        fill(c, 400)
        c.flush()
        assert stored_rows(d) == (400, 200)
        resident = [p.page_id for p in c._tier.lru_order()]
        clock.now += 10                      # the deadline itself counts as expired
        before = c.stats()
        assert c.expire() == 200
        after = c.stats()
        # read from SQLite, not faulted in: the working set and LRU are as before
        assert after.page_faults == before.page_faults
        assert after.evictions == before.evictions
        assert [p.page_id for p in c._tier.lru_order()] == resident
        assert after.expirations - before.expirations == 200
        check_table(c._tier)
        assert len(c) == 200
        assert [c.get(f"k{i}") for i in range(6)] == [None, 1, None, 3, None, 5]
        assert c.expire() == 0               # nothing left to remove
    # the pages the removals dirtied were stored by close(): no expired row is left
    assert stored_rows(d) == (200, 0)
    with opened(d, clock=clock) as c:
        assert len(c) == 200
        assert sorted(c) == sorted(f"k{i}" for i in range(1, 400, 2))


def test_expire_leaves_entries_before_their_deadline(tmp_path):
    clock = Clock(1000)
    d = tmp_path / "c"
    with opened(d, clock=clock, page_size=2, max_pages=1) as c:
        c._sweep_on = False                  # only the calls below remove entries
        c.set("a", 1, expire=5)
        c.set("b", 2, expire=6)
        c.set("c", 3)
        c.set("d", 4, expire=5)
        c.flush()
        clock.now = 1004.999
        assert c.expire() == 0
        clock.now = 1005
        assert c.expire() == 2               # a and d, one resident and one stored
        assert dict(c.items()) == {"b": 2, "c": 3}
    assert stored_rows(d) == (2, 1)


def test_expire_without_ttls_does_nothing(tmp_path):
    with opened(tmp_path / "c", page_size=4, max_pages=2) as c:
        for i in range(100):
            c[i] = i
        c.flush()
        before = c.stats()
        assert c.expire() == 0
        assert c.stats() == before
        assert len(c) == 100


def test_expire_waits_for_back_pressure_and_finishes(tmp_path):
    """More stored pages to clean than may wait for the write-behind: expire()
    waits for flushes between them (the batcher runs on its own here)."""
    clock = Clock(1000)
    d = tmp_path / "c"
    c = Cache(d, clock=clock, page_size=2, max_pages=2, max_pending_pages=4,
              flush_interval=0.01, flush_batch_pages=2)
    try:
        fill(c, 200, ttl=1)                  # 100 pages, each with one expired entry
        c.flush()
        clock.now += 1
        removed = run_with_timeout(c.expire, 30.0)
        # the write-behind's own sweep may take some of them first
        assert 0 < removed <= 100 and c.stats().expirations == 100
        assert c.stats().pending_pages <= 4
        assert len(c) == 100
    finally:
        run_with_timeout(c.close, 30.0)
    assert stored_rows(d) == (100, 0)


def test_expire_after_a_clear_touches_no_stored_page(tmp_path):
    clock = Clock(1000)
    with opened(tmp_path / "c", clock=clock, page_size=2, max_pages=1) as c:
        c._sweep_on = False                  # only the calls below remove entries
        fill(c, 20)
        c.flush()
        c.clear()                            # the store is emptied by the next flush
        clock.now += 10
        assert c.expire() == 0
        assert len(c) == 0


def test_expire_on_a_closed_cache_raises(tmp_path):
    c = open_cache(tmp_path / "c")
    c.close()
    with pytest.raises(CacheClosedError):
        c.expire()


def test_a_page_left_holding_only_expired_entries_is_deleted(tmp_path):
    clock = Clock(1000)
    d = tmp_path / "c"
    with opened(d, clock=clock, page_size=4, max_pages=1) as c:
        c._sweep_on = False                  # only the calls below remove entries
        for i in range(40):
            c.set(i, i, expire=5)
        c.set("live", 1)
        c.flush()
        clock.now += 5
        assert c.expire() == 40
        assert list(c) == ["live"]
    conn = sqlite3.connect(d / "pages.sqlite3")
    try:
        assert conn.execute("SELECT COUNT(*) FROM pages").fetchone() == (1,)
    finally:
        conn.close()


# -- the write-behind's sweep ------------------------------------------------------------

def test_sweep_cleans_stored_pages_a_bounded_number_at_a_time(tmp_path):
    """Driven directly (it runs in the batcher thread before each cycle): at
    most flush_batch_pages stored pages per call, and never so many that
    writers would meet back-pressure."""
    clock = Clock(1000)
    d = tmp_path / "c"
    with opened(d, clock=clock, page_size=2, max_pages=1, flush_batch_pages=8,
                max_pending_pages=40) as c:
        c._sweep_on = False                  # only the calls below remove entries
        fill(c, 100)                         # 50 pages, one expired entry each
        c.flush()
        clock.now += 10
        faults = c.stats().page_faults
        assert c._sweep_expired() == 8       # flush_batch_pages pages
        assert c.stats().pending_pages == 8
        assert c._sweep_expired() == 8
        assert c._sweep_expired() == 4       # up to half of max_pending_pages
        assert c._sweep_expired() == 0
        assert c.stats().page_faults == faults
        check_table(c._tier)
        c.flush()                            # nothing logged since: no cycle needed
    assert stored_rows(d) == (80, 30)        # close stored the 20 swept pages


def test_the_write_behind_sweeps_on_its_own(tmp_path):
    """No call to expire(): the cycles the flushes wait for sweep first, and
    the pages they clean go in the same cycle."""
    clock = Clock(1000)
    d = tmp_path / "c"
    with opened(d, clock=clock, page_size=2, max_pages=1, flush_batch_pages=64) as c:
        fill(c, 40)
        c.flush()
        clock.now += 10
        # Two flushes: the cycle of the second began after the first returned,
        # so after the clock moved.
        c.set("x", 1)
        c.flush()
        c.set("y", 1)
        c.flush()
        assert c.stats().expirations == 20
        assert c.stats().page_faults == 0
        assert stored_rows(d) == (22, 0)     # the 20 live keys, x and y


def test_without_the_sweep_expired_entries_stay_on_disk(tmp_path):
    """The control for the test above: the same steps, sweep off."""
    clock = Clock(1000)
    d = tmp_path / "c"
    with opened(d, clock=clock, page_size=2, max_pages=1) as c:
        c._sweep_on = False                  # only the calls below remove entries
        fill(c, 40)
        c.flush()
        clock.now += 10
        for key in ("x", "y"):
            c.set(key, 1)
            c.flush()
        assert c.stats().expirations == 0
        assert stored_rows(d) == (42, 20)


def test_sweep_that_meets_a_damaged_page_stops_and_flushes_go_on(tmp_path, caplog):
    clock = Clock(1000)
    d = tmp_path / "c"
    with opened(d, clock=clock, page_size=2, max_pages=1) as c:
        fill(c, 4)                           # pages 1 and 2, each with one TTL entry
        c.set("other", 1)
        c.flush()
        conn = sqlite3.connect(d / "pages.sqlite3")
        (pid,), = conn.execute("SELECT page_id FROM keys WHERE orig IS NULL AND "
                               "key = ?", (b"s\x02\x00\x00\x00k0",)).fetchall()
        assert pid not in c._tier.pages
        conn.execute("UPDATE pages SET data = x'ffff0100' WHERE page_id = ?", (pid,))
        conn.commit()
        conn.close()
        clock.now += 10
        with caplog.at_level(logging.ERROR, logger="durablekv"):
            c.set("x", 1)
            c.flush()
            c.set("y", 2)
            c.flush()                        # writes still reach SQLite
        assert "expiry sweep" in caplog.text and "stopped" in caplog.text
        assert c._sweep_on is False
        with pytest.raises(CorruptStoreError):
            c.expire()
        assert c.get("y") == 2
