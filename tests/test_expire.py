"""Reclaiming expired entries: ``Cache.expire()`` and the write-behind's sweep.

An entry whose TTL passed is never served, but until something removes it,
it stays on its page in SQLite. These tests check that ``expire()`` removes
every one, in memory and on disk, without faulting pages in; that the
write-behind removes them on its own; and that a clean close stores the
pages the removals dirtied. TTL time moves only when a test moves it.
"""

from __future__ import annotations

import contextlib
import logging
import sqlite3
import threading
import time
from unittest import mock

import pytest

from durablekv import Cache, CacheClosedError, CorruptStoreError, StoreError
from durablekv.check import check_directory
from durablekv.tier.pages import RESIDENT

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


@contextlib.contextmanager
def filled(directory, n: int, *, sweep: bool = False, **opts):
    """``with filled(d, n, ...) as (c, clock)``: a cache on a ``Clock(1000)``
    holding :func:`fill`'s ``n`` keys, flushed to SQLite. The write-behind's
    own sweep is off unless ``sweep``, so that only the calls a test makes
    remove entries. TTL time has not moved yet."""
    clock = Clock(1000)
    with opened(directory, clock=clock, **opts) as c:
        c._sweep_on = sweep
        fill(c, n)
        c.flush()
        yield c, clock


def test_expire_removes_every_expired_entry_in_memory_and_on_disk(tmp_path):
    d = tmp_path / "c"
    with filled(d, 400, page_size=4, max_pages=3) as (c, clock):
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
        assert after.last_lsn == before.last_lsn  # no log record for a removal
        check_table(c._tier)
        assert len(c) == 200
        assert [c.get(f"k{i}") for i in range(6)] == [None, 1, None, 3, None, 5]
        assert c.expire() == 0               # nothing left to remove
    # the pages the removals dirtied were stored by close(): no expired row is left
    assert stored_rows(d) == (200, 0)
    with opened(d, clock=clock) as c:
        assert len(c) == 200
        assert sorted(c) == sorted(f"k{i}" for i in range(1, 400, 2))


@pytest.mark.parametrize("meet", ["get", "len", "in", "keys", "items", "values"])
def test_a_read_that_meets_an_expired_entry_in_memory_removes_it(tmp_path, meet):
    clock = Clock(1000)
    with opened(tmp_path / "c", clock=clock) as c:
        c._sweep_on = False
        c.set("a", 1, expire=5)
        c.set("b", 2)
        clock.now = 1005
        if meet in ("keys", "items", "values"):
            list(getattr(c, meet)())
        else:
            {"get": lambda: c.get("a"), "len": lambda: len(c), "in": lambda: "a" in c}[meet]()
        assert "a" not in c._tier.table
        assert c.stats().expirations == 1


def test_stats_after_close_give_the_final_numbers(tmp_path):
    c = open_cache(tmp_path / "c")
    c.set("a", 1)
    c.get("a")
    c.close()
    st = c.stats()
    assert (st.sets, st.hits, st.memory_hits) == (1, 1, 1)
    with pytest.raises(CacheClosedError):
        c.get("a")


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
    with filled(tmp_path / "c", 20, page_size=2, max_pages=1) as (c, clock):
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
    most flush_batch_pages pages per call, and never so many that writers
    would meet back-pressure; the cycle after it stores what it changed."""
    d = tmp_path / "c"
    with filled(d, 100, page_size=2, max_pages=1, flush_batch_pages=8,
                max_pending_pages=12) as (c, clock):
        clock.now += 10                      # 50 pages, one expired entry each
        faults = c.stats().page_faults

        def cycle():                         # a write, so flush() runs a cycle
            c.set("tick", b"")
            c.flush()

        assert c._sweep_expired() == 6       # half of max_pending_pages
        assert c.stats().pending_pages == 6
        assert c._sweep_expired() == 0       # writers keep the other half
        cycle()
        assert c.stats().pending_pages == 0
        assert stored_rows(d) == (95, 44)    # 94 keys + tick; 6 expired rows gone
        c.max_pending_pages = 100
        assert c._sweep_expired() == 8       # flush_batch_pages
        cycle()
        while c._sweep_expired():
            cycle()
        assert c.stats().page_faults == faults
        assert c.stats().expirations == 50
        check_table(c._tier)
        assert stored_rows(d) == (51, 0)


def test_the_sweep_takes_the_lock_once_per_16_pages(tmp_path):
    d = tmp_path / "c"
    with filled(d, 80, page_size=2, max_pages=1, flush_batch_pages=40) as (c, clock):
        clock.now += 10                      # 40 stored pages, one expired entry each
        real_lock, takes = c._lock, []

        class CountingLock:
            def __enter__(self):
                takes.append(1)
                return real_lock.__enter__()

            def __exit__(self, *exc):
                return real_lock.__exit__(*exc)

        c._lock = CountingLock()
        try:
            assert c._sweep_expired() == 40
        finally:
            c._lock = real_lock
        assert len(takes) == 3               # 16 + 16 + 8 pages


def test_the_write_behind_sweeps_on_its_own(tmp_path):
    """No call to expire(): the cycles the flushes wait for sweep first, and
    the pages they clean go in the same cycle."""
    d = tmp_path / "c"
    with filled(d, 40, sweep=True, page_size=2, max_pages=1, flush_batch_pages=64) as (c, clock):
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


def test_the_sweep_also_cleans_resident_pages_and_does_not_come_back_to_them(tmp_path):
    """Entries that expire on pages in memory go too (their pages are dirtied
    and stored), and a later sweep has nothing left to walk there."""
    d = tmp_path / "c"
    with filled(d, 400, sweep=True, page_size=4, max_pages=1000,
                flush_batch_pages=128) as (c, clock):
        assert c.stats().resident_pages == 100
        clock.now += 10
        for key in ("x", "y"):               # the second cycle began after the move
            c.set(key, 1)
            c.flush()
        assert c.stats().expirations == 200  # one sweep: 100 pages < flush_batch_pages
        assert c.stats().page_faults == 0 and c.stats().evictions == 0
        assert stored_rows(d) == (202, 0)
        assert c._store.expired_pages(clock.now, (), 1) == []
        assert c._sweep_expired() == 0


def test_the_sweep_is_off_while_recovery_waits_for_back_pressure(tmp_path):
    """Recovery reads stored pages in batches and may wait for back-pressure
    (lock released) before it installs them: a page the sweep rewrote and
    dropped meanwhile would come back stale, or be missing. Each wait is
    stretched here over many write-behind cycles, a schedule the OS may
    choose; the sweep must stay out until the open is done."""
    clock = Clock(1000)
    d = tmp_path / "c"
    opts = dict(clock=clock, page_size=4, max_pages=4, segment_bytes=4096)
    c = Cache(d, flush_interval=3600, flush_batch_pages=1_000_000,
              max_pending_pages=1_000_000, **opts)
    c.set("keep", "me")
    for i in range(2000):
        c.set(f"k{i}", i, expire=10)
    c.flush()
    for i in range(2000):                   # logged again, never flushed
        c.set(f"k{i}", -i, expire=10)
    c._teardown(clean=False)                # a crash
    clock.now += 20                         # all but "keep" expired while down
    sweeps_during_open = []
    real_bp, real_sweep = Cache._backpressure, Cache._sweep_expired

    def slow_backpressure(self):
        waited = self._tier.pending >= self.max_pending_pages
        real_bp(self)
        if waited:                          # descheduled for 5 more cycles
            b, start = self._batcher, self._batcher._cycles
            self._lock.release()
            try:
                deadline = time.monotonic() + 2
                while b._cycles < start + 5 and time.monotonic() < deadline:
                    time.sleep(0.0005)
            finally:
                self._lock.acquire()

    def watched_sweep(self):
        if self._sweep_on:
            sweeps_during_open.append(self._state)
        return real_sweep(self)

    with mock.patch.object(Cache, "_backpressure", slow_backpressure), \
            mock.patch.object(Cache, "_sweep_expired", watched_sweep):
        c = Cache(d, flush_interval=0.001, flush_batch_pages=4, max_pending_pages=8, **opts)
    try:
        assert c.stats().recovered_records > 0
        assert c.get("keep") == "me"
        assert len(c) == 1
    finally:
        run_with_timeout(c.close, 30.0)
    assert check_directory(str(d)).ok
    with opened(d, **opts) as c:
        assert dict(c.items()) == {"keep": "me"}


def test_expire_waiting_for_back_pressure_when_close_comes_raises_closed(tmp_path):
    """expire() waits with the lock released; close() may take the cache
    meanwhile. It must wake to CacheClosedError, never read a store being
    closed (which crashed the interpreter)."""
    clock = Clock(1000)
    d = tmp_path / "c"
    c = Cache(d, clock=clock, page_size=2, max_pages=1, max_pending_pages=2,
              flush_interval=3600)
    c._sweep_on = False
    fill(c, 300)
    c.flush()
    clock.now += 10
    entered, go = threading.Event(), threading.Event()
    real_write = c._store.write_batch

    def blocked_write(*a, **kw):
        entered.set()
        assert go.wait(30)
        return real_write(*a, **kw)

    c._store.write_batch = blocked_write
    got = {}

    def run(name, fn):
        try:
            got[name] = fn()
        except Exception as exc:             # noqa: BLE001 - the outcome is checked
            got[name] = exc

    a = threading.Thread(target=run, args=("expire", c.expire))
    a.start()
    assert entered.wait(30)                  # expire() waits; the flush is held
    b = threading.Thread(target=run, args=("close", c.close))
    b.start()
    deadline = time.monotonic() + 30
    while c._state == "open" and time.monotonic() < deadline:
        time.sleep(0.001)
    go.set()
    a.join(30)
    b.join(30)
    assert not a.is_alive() and not b.is_alive()
    assert isinstance(got["expire"], CacheClosedError)
    assert got["close"] is None
    assert check_directory(str(d)).ok
    with opened(d, clock=clock) as c:
        assert sorted(c) == sorted(f"k{i}" for i in range(1, 300, 2))


def test_back_pressure_that_ends_after_a_close_raises_closed(tmp_path):
    """The schedule of the test above, made certain: the wait for
    back-pressure ends with the cache closing (and room made). expire() must
    raise CacheClosedError and read nothing more from the store."""
    with filled(tmp_path / "c", 40, page_size=2, max_pages=1,
                max_pending_pages=2) as (c, clock):
        clock.now += 10
        real_pending, reads = [], []
        real_scan = c._store.expired_pages

        def wait_through_a_close(timeout=None):
            real_pending.append(c._tier.pending)
            c._state = "closing"             # close() took the cache meanwhile...
            c._tier.pending = 0              # ...and the flush made room
            return True

        def scan(*args):
            reads.append(c._state)
            return real_scan(*args)

        with mock.patch.object(c._cond, "wait", wait_through_a_close), \
                mock.patch.object(c._store, "expired_pages", scan):
            with pytest.raises(CacheClosedError):
                c.expire()
        assert reads and set(reads) == {"open"}
        c._state = "open"                    # back as it was, for the real close
        c._tier.pending = real_pending[0]


def test_expire_also_cleans_a_page_faulted_in_while_it_waited(tmp_path):
    """Another thread faults in a stored page while expire() waits for
    back-pressure: that page's expired entries are then in memory, and
    expire() must still remove them."""
    # page p holds k{2p-2} (expiring) and k{2p-1}
    with filled(tmp_path / "c", 100, page_size=2, max_pages=4,
                max_pending_pages=2) as (c, clock):
        clock.now += 10
        # The last page only in SQLite: its keys come late in the expiry
        # index's order, so expire() has not reached it at its first wait.
        pid = max(p for p in range(1, 51) if p not in c._tier.pages)
        doomed, live = f"k{2 * pid - 2}", f"k{2 * pid - 1}"
        real_wait = c._cond.wait
        faulted = []

        def wait_while_a_reader_faults(timeout=None):
            if not faulted:                  # a get(live) from another thread
                faulted.append(c._ref(live))
                assert c._tier.table[doomed][0].state == RESIDENT
            return real_wait(timeout)

        with mock.patch.object(c._cond, "wait", wait_while_a_reader_faults):
            c.expire()
        assert faulted
        now = clock.now
        assert not [k for k, (p, s, _) in c._tier.table.items()
                    if p.expires[s] is not None and now >= p.expires[s]]
        assert c.stats().expirations == 50


def test_the_sweep_works_with_max_pending_pages_1(tmp_path):
    with filled(tmp_path / "c", 20, page_size=2, max_pages=1,
                max_pending_pages=1) as (c, clock):
        clock.now += 10
        assert c._sweep_expired() == 1       # one page: writers then meet back-pressure
        assert c.stats().pending_pages == 1


def test_a_read_error_in_the_sweep_pauses_it_and_flushes_go_on(tmp_path, caplog):
    d = tmp_path / "c"
    with filled(d, 20, sweep=True, page_size=2, max_pages=1) as (c, clock):
        clock.now += 10

        def failing_read(pid):
            raise StoreError(f"SQLite page store {d}: page read failed: disk I/O error", str(d))

        c._store.read_page = failing_read
        with caplog.at_level(logging.WARNING, logger="durablekv"):
            for key in ("x", "y"):
                c.set(key, 1)
                c.flush()                    # the cycle's sweep fails; its flush does not
        assert "expiry sweep" in caplog.text and "paused" in caplog.text
        assert c._sweep_on and c._sweep_paused_until > time.monotonic() + 30
        assert c.stats().flush_errors == 0
        assert c.get("y") == 1
        del c._store.read_page
        assert c.expire() == 10              # the call itself still works


def test_without_the_sweep_expired_entries_stay_on_disk(tmp_path):
    """The control for test_the_write_behind_sweeps_on_its_own: the same
    steps with the sweep off leave every expired row on disk."""
    d = tmp_path / "c"
    with filled(d, 40, page_size=2, max_pages=1) as (c, clock):
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
