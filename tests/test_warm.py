"""Warm restart (durablekv/warm.py): the residency list and the preload after open.

The preload thread is stepped through :meth:`Cache._warm_gate` where a test
needs to act before it runs; everything else waits with ``wait_warm()``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

import durablekv.warm as warm
from durablekv import Cache, ConfigError, ShardedCache
from durablekv.stores.sqlite import SQLitePageStore
from durablekv.warm import RESIDENCY_FILE, decode_residency

from .pg import DEADLINE

WRITER = Path(__file__).with_name("warm_writer.py")
REPO = Path(__file__).resolve().parents[1]
QUIET = dict(flush_interval=30.0)  # the batcher flushes (and saves the list) when asked


def _order(cache) -> list[int]:
    """Resident page ids, most recently used first."""
    return [p.page_id for p in reversed(cache._tier.lru_order())]


def _fill(d, n=200, reads=(), **kw) -> list[int]:
    """Set k0..k{n-1} (page_size 4, max_pages 8), get ``reads``, close; the
    resident order at close."""
    with Cache(d, page_size=4, max_pages=8, **QUIET, **kw) as c:
        for i in range(n):
            c[f"k{i}"] = b"v%d" % i
        for i in reads:
            assert c[f"k{i}"] == b"v%d" % i
        return _order(c)


READS = (3, 17, 40, 41, 99, 150, 151, 188, 3)


class Gate:
    """Holds the preload before its first batch until :meth:`open` (a step hook)."""

    def __init__(self, monkeypatch):
        self.event = threading.Event()
        self.reached = threading.Event()
        gate = self

        def wait(cache):
            gate.reached.set()
            assert gate.event.wait(DEADLINE), "the test never opened the gate"

        monkeypatch.setattr(Cache, "_warm_gate", wait)

    def open(self):
        self.event.set()


def test_a_clean_close_comes_back_warm_in_the_same_order(tmp_path):
    d = tmp_path / "c"
    before = _fill(d, reads=READS)
    assert len(before) == 8
    assert decode_residency((d / RESIDENCY_FILE).read_bytes(), 4) == before
    assert (d / RESIDENCY_FILE).stat().st_mode & 0o777 == 0o600
    with Cache(d, max_pages=8, **QUIET) as c:
        assert c.wait_warm(DEADLINE)
        assert _order(c) == before
        s = c.stats()
        assert (s.warmed_pages, s.page_faults, s.resident_pages, s.residency_errors) == (8, 0, 8, 0)
        for i in READS:
            assert c[f"k{i}"] == b"v%d" % i
        s = c.stats()
        assert (s.memory_hits, s.store_hits, s.page_faults) == (len(READS), 0, 0)
        assert all(c[f"k{i}"] == b"v%d" % i for i in range(200))  # the rest faults in


def test_preloaded_pages_leave_before_pages_used_since_open(tmp_path):
    """Their order is the list's, and below every page touched after open."""
    d = tmp_path / "c"
    before = _fill(d, reads=READS)
    with Cache(d, max_pages=8, **QUIET) as c:
        c.wait_warm(DEADLINE)
        assert 16 not in before
        c.get("k60")  # page 16, not in the list: evicts the list's LRU page
        assert _order(c) == [16] + before[:7]
        c.get("k99")  # page 25, preloaded: touched, now the MRU
        assert _order(c) == [25, 16] + [p for p in before[:7] if p != 25]
        assert c.stats().evictions == 1


def test_open_reads_no_page_and_returns_before_the_preload(tmp_path, monkeypatch):
    """Invariant 6: open does O(log suffix) work. The preload is held at its
    first batch: open has returned having read no page."""
    d = tmp_path / "c"
    before = _fill(d, reads=READS)
    reads = []
    for name in ("read_page", "read_pages", "find", "locate_keys"):
        real = getattr(SQLitePageStore, name)

        def spy(self, *a, _real=real, _name=name, **kw):
            reads.append((_name, threading.current_thread().name))
            return _real(self, *a, **kw)
        monkeypatch.setattr(SQLitePageStore, name, spy)
    gate = Gate(monkeypatch)
    with Cache(d, max_pages=8, **QUIET) as c:
        assert gate.reached.wait(DEADLINE)
        assert reads == [] and c.stats().resident_pages == 0
        assert not c.wait_warm(0)
        gate.open()
        assert c.wait_warm(DEADLINE)
        assert _order(c) == before
        assert reads and {t for _, t in reads} == {"durablekv-warm[c]"}


def test_the_preload_never_evicts_what_a_user_faulted_or_wrote(tmp_path, monkeypatch):
    d = tmp_path / "c"
    before = _fill(d, reads=READS)
    gate = Gate(monkeypatch)
    with Cache(d, max_pages=8, **QUIET) as c:
        gate.reached.wait(DEADLINE)
        c.get("k0")                                   # faults page 1 (not listed)
        c.get("k17")                                  # faults a listed page (5)
        c["new"] = b"n"                               # a new page, written
        mine = set(_order(c))
        assert len(mine) == 3
        gate.open()
        c.wait_warm(DEADLINE)
        s = c.stats()
        assert mine <= set(_order(c)) and s.resident_pages == 8 and s.evictions == 0
        # room for 5 of the list's pages; the faulted listed page was skipped
        assert s.warmed_pages == 5
        assert _order(c)[3:] == [p for p in before if p not in mine][:5]
        assert c["new"] == b"n" and c["k17"] == b"v17"


def test_stale_list_entries_load_what_the_store_holds_or_are_skipped(tmp_path):
    """The list names pages deleted and rewritten since it was saved: the
    rewritten ones come back as stored now, the deleted ones are skipped."""
    d = tmp_path / "c"
    before = _fill(d, reads=READS)
    saved = (d / RESIDENCY_FILE).read_bytes()
    with Cache(d, warm=False, **QUIET) as c:        # neither reads nor writes the list
        for i in (40, 41, 42, 43):                   # page 11: every key deleted
            del c[f"k{i}"]
        for i in (3, 0, 1, 2, 17):                   # pages 1 and 5: rewritten
            c[f"k{i}"] = b"new%d" % i
        c[f"k{150}"] = b"x" * 1000
    assert (d / RESIDENCY_FILE).read_bytes() == saved
    with Cache(d, max_pages=8, **QUIET) as c:
        c.wait_warm(DEADLINE)
        assert 11 in before and 11 not in _order(c)
        assert c.stats().warmed_pages == 7
        expected = {f"k{i}": b"v%d" % i for i in range(200) if i not in (40, 41, 42, 43)}
        expected.update({f"k{i}": b"new%d" % i for i in (3, 0, 1, 2, 17)}, k150=b"x" * 1000)
        assert dict(c.items()) == expected
        assert c.stats().residency_errors == 0


def test_reopen_with_fewer_pages_takes_the_most_recent_ones(tmp_path):
    d = tmp_path / "c"
    before = _fill(d, reads=READS)
    with Cache(d, max_pages=3, **QUIET) as c:
        c.wait_warm(DEADLINE)
        assert _order(c) == before[:3] and c.stats().warmed_pages == 3
    # the list saved at that close holds those 3; a bigger tier gets just them
    with Cache(d, max_pages=8, **QUIET) as c:
        c.wait_warm(DEADLINE)
        assert _order(c) == before[:3]


def test_reopen_with_a_byte_bound_preloads_only_what_fits(tmp_path):
    d = tmp_path / "c"
    before = _fill(d, reads=READS)
    with Cache(d, max_pages=8, warm=False, **QUIET) as c:   # the stored blobs' sizes
        sizes = {pid: len(row[1]) for pid, row in c._store.read_pages(before).items()}
    bound = sizes[before[0]] + sizes[before[1]] + sizes[before[2]]
    with Cache(d, max_pages=8, max_memory_bytes=bound, **QUIET) as c:
        c.wait_warm(DEADLINE)
        assert _order(c) == before[:3] and c.stats().warmed_pages == 3
        assert c._tier.resident_bytes <= bound and c.stats().evictions == 0


def test_warm_off_reads_and_writes_no_list(tmp_path):
    d = tmp_path / "c"
    _fill(d, reads=READS, warm=False)
    assert not (d / RESIDENCY_FILE).exists()
    _fill(tmp_path / "w", reads=READS)
    with Cache(tmp_path / "w", warm=False, **QUIET) as c:
        assert c.wait_warm(0)
        assert c.stats().resident_pages == 0 and c.stats().warmed_pages == 0


@pytest.mark.parametrize("bad", [None, 0, 1, "yes"])
def test_warm_must_be_a_bool(tmp_path, bad):
    with pytest.raises(ConfigError, match="warm="):
        Cache(tmp_path / "c", warm=bad)


@pytest.mark.parametrize("bad, error", [(-1, ValueError), (float("nan"), ValueError),
                                        ("1", TypeError), (True, TypeError)])
def test_wait_warm_checks_its_timeout(tmp_path, bad, error):
    with Cache(tmp_path / "c", **QUIET) as c:
        with pytest.raises(error, match="wait_warm"):
            c.wait_warm(bad)


def test_clear_during_the_preload_stops_it(tmp_path, monkeypatch):
    d = tmp_path / "c"
    _fill(d, reads=READS)
    gate = Gate(monkeypatch)
    with Cache(d, max_pages=8, **QUIET) as c:
        gate.reached.wait(DEADLINE)
        c.clear()
        gate.open()
        c.wait_warm(DEADLINE)
        assert c.stats().warmed_pages == 0 and len(c) == 0 and c.get("k3") is None


def test_close_during_the_preload_stops_it(tmp_path, monkeypatch):
    d = tmp_path / "c"
    before = _fill(d, reads=READS)
    gate = Gate(monkeypatch)
    c = Cache(d, max_pages=8, **QUIET)
    gate.reached.wait(DEADLINE)
    closer = threading.Thread(target=c.close)
    closer.start()
    while c._state == "open":  # close() has begun once the state moves
        threading.Event().wait(0.001)
    gate.open()
    closer.join(DEADLINE)
    assert not closer.is_alive() and c.stats().warmed_pages == 0
    # the pages the preload did not get to stay listed for the next open
    assert decode_residency((d / RESIDENCY_FILE).read_bytes(), 4) == before


def test_the_write_behind_saves_the_list_periodically(tmp_path, monkeypatch):
    """Every write-behind cycle calls _residency_tick, which saves the list
    once RESIDENCY_INTERVAL has passed, if the tier was used since."""
    monkeypatch.setattr(warm, "RESIDENCY_INTERVAL", 0.0)
    ticks = []
    real = Cache._residency_tick

    def spy(self):
        ticks.append(threading.current_thread().name)
        real(self)
    monkeypatch.setattr(Cache, "_residency_tick", spy)
    d = tmp_path / "c"
    with Cache(d, page_size=4, max_pages=8, **QUIET) as c:
        assert c.wait_warm(DEADLINE)  # (no list yet: nothing to preload)
        for i in range(100):
            c[f"k{i}"] = b"v"
        c.flush()  # the cycle that stored them called the tick first
        assert ticks and set(ticks) == {"durablekv-batcher[c]"}
        saves = c._residency_saves
        c.get("k50")          # page 13, used after any save so far
        c._residency_tick()   # used since the last save: saved now
        assert c._residency_saves == saves + 1
        assert decode_residency((d / RESIDENCY_FILE).read_bytes(), 4) == _order(c)
        assert _order(c)[0] == 13
        c._residency_tick()   # not used since: nothing to save
        assert c._residency_saves == saves + 1
        c.get("k0")
        c._residency_tick()
        assert c._residency_saves == saves + 2
        assert decode_residency((d / RESIDENCY_FILE).read_bytes(), 4)[0] == 1


def test_a_killed_process_comes_back_warm(tmp_path):
    """kill -9 after the write-behind saved the list: the resident pages and
    their order come back (the child waits for a save made after its reads)."""
    d = tmp_path / "c"
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.Popen([sys.executable, str(WRITER), str(d)], stdout=subprocess.PIPE,
                            text=True, env=env)
    try:
        line = proc.stdout.readline()
        assert line, "the writer died before it was ready"
        order = json.loads(line)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(DEADLINE)
    assert proc.returncode == -signal.SIGKILL
    assert len(order) == 8
    with Cache(d, max_pages=8, **QUIET) as c:
        assert c.wait_warm(DEADLINE)
        assert c.stats().recovered_records > 0 or c.stats().checkpoint_lsn == 200
        assert _order(c) == order
        assert all(c[f"k{i}"] == b"v%d" % i for i in range(200))


def test_each_shard_comes_back_warm(tmp_path):
    d = tmp_path / "s"
    with ShardedCache(d, shards=3, page_size=4, max_pages=4, **QUIET) as c:
        for i in range(300):
            c[f"k{i}"] = b"v%d" % i
        for i in range(0, 300, 7):
            c.get(f"k{i}")
        orders = [_order(s) for s in c.shards]
    assert all(len(o) == 4 for o in orders)
    with ShardedCache(d, max_pages=4, **QUIET) as c:
        assert c.wait_warm(DEADLINE)
        assert [_order(s) for s in c.shards] == orders
        assert c.stats().warmed_pages == 12
        with pytest.raises(ValueError, match="wait_warm"):
            c.wait_warm(-1)


def test_the_postgresql_store_comes_back_warm(pg, pg_ns, tmp_path):
    d = tmp_path / "c"
    kw = dict(store=pg.url(), namespace=pg_ns, max_pages=8, **QUIET)
    with Cache(d, page_size=4, **kw) as c:
        for i in range(200):
            c[f"k{i}"] = b"v%d" % i
        for i in READS:
            c.get(f"k{i}")
        before = _order(c)
    with Cache(d, **kw) as c:
        assert c.wait_warm(DEADLINE)
        assert _order(c) == before and c.stats().warmed_pages == 8
        assert c.stats().page_faults == 0
        assert all(c[f"k{i}"] == b"v%d" % i for i in range(200))


def test_async_cache_waits_for_the_preload(tmp_path):
    import asyncio
    from durablekv.aio import AsyncCache
    d = tmp_path / "c"
    before = _fill(d, reads=READS)

    async def main():
        async with AsyncCache(d, max_pages=8, flush_interval=30.0) as c:
            assert await c.wait_warm(DEADLINE)
            return _order(c.cache), c.cache.stats().warmed_pages
    assert asyncio.run(main()) == (before, 8)
