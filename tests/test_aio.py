"""AsyncCache: the awaitable API, which thread runs what, cancellation."""

from __future__ import annotations

import asyncio
import os
import threading
import time

import pytest

from durablekv import Cache
from durablekv.aio import AsyncCache
from durablekv.log.replaylog import ReplayLog
from durablekv.stats import CacheStats
from durablekv.stores.sqlite import SQLitePageStore


def run(coro):
    return asyncio.run(coro)


class CountingExecutor:
    """Counts the calls AsyncCache hands to its worker threads."""

    def __init__(self, acache: AsyncCache) -> None:
        self.calls = 0
        inner = acache._executor
        real = inner.submit

        def submit(fn, *a, **kw):
            self.calls += 1
            return real(fn, *a, **kw)
        inner.submit = submit  # type: ignore[method-assign]


def test_api(tmp_path):
    async def main():
        async with AsyncCache(tmp_path / "c", page_size=4) as c:
            await c.set("a", {"x": 1})
            assert await c.get("a") == {"x": 1}
            assert await c.get("nope", "dflt") == "dflt"
            assert await c.add("a", 2) is False and await c.add("b", 2) is True
            assert await c.incr("n", 5) == 5 and await c.incr("n") == 6
            assert await c.touch("a", 100) is True and await c.touch("zz") is False
            assert await c.contains("a") and not await c.contains("zz")
            assert await c.delete("b") and not await c.delete("b")
            await c.flush()
            assert sorted([k async for k in c]) == ["a", "n"]
            assert await c.length() == 2
            with pytest.raises(TypeError):
                await c.incr("a")
        assert c.cache.closed
        with Cache(tmp_path / "c") as again:
            assert dict(again.items()) == {"a": {"x": 1}, "n": 6}
    run(main())


def test_memory_hit_stays_on_the_loop_thread_and_the_rest_does_not(tmp_path):
    async def main():
        async with AsyncCache(tmp_path / "c", page_size=2, max_pages=2) as c:
            counting = CountingExecutor(c)
            await c.set("hot", b"v")   # log mode, lock free, a new key: no hand-off
            for _ in range(100):
                assert await c.get("hot") == b"v"
                assert await c.contains("hot")
            assert counting.calls == 0, "a memory hit left the loop's thread"
            assert c.cache.stats().memory_hits >= 100
            for i in range(40):               # evict "hot"'s page: reading it is a page fault
                await c.set(f"k{i}", i)
            await c.flush()
            before = counting.calls
            assert await c.get("hot") == b"v"
            assert counting.calls == before + 1
            assert c.cache.stats().page_faults >= 1
            c.cache._lock.acquire()           # the lock taken: a worker waits for it, not the loop
            try:
                task = asyncio.ensure_future(c.set("k0", "new"))
                for _ in range(5):
                    await asyncio.sleep(0)
                assert not task.done() and counting.calls == before + 2
            finally:
                c.cache._lock.release()
            await task
            assert await c.get("k0") == "new"
        async with AsyncCache(tmp_path / "f", durability="fsync") as c:
            counting = CountingExecutor(c)
            await c.set("k", 1)               # an fsync: always a worker
            assert counting.calls == 1
    run(main())


def test_disk_work_never_runs_on_the_loop_thread(tmp_path, monkeypatch):
    """fsync mode, a write-heavy load beside a ticking task: every fsync
    and every SQLite read (page faults) runs on a worker thread, and the loop keeps
    ticking (its longest gap stays far below the time the fsyncs took)."""
    threads: set[int] = set()
    fsync_seconds = [0.0]
    real_fsync = ReplayLog._fsync

    def fsync(self, fd):
        threads.add(threading.get_ident())
        t0 = time.perf_counter()
        real_fsync(self, fd)
        fsync_seconds[0] += time.perf_counter() - t0
    monkeypatch.setattr(ReplayLog, "_fsync", fsync)
    for name in ("find", "read_page"):   # every SQLite read of a page or the key index
        real = getattr(SQLitePageStore, name)

        def reader(self, *a, _real=real, **kw):
            threads.add(threading.get_ident())
            return _real(self, *a, **kw)
        monkeypatch.setattr(SQLitePageStore, name, reader)

    async def main():
        loop_thread = threading.get_ident()
        gaps = []
        stop = asyncio.Event()

        async def ticker():
            last = time.perf_counter()
            while not stop.is_set():
                await asyncio.sleep(0.001)
                now = time.perf_counter()
                gaps.append(now - last)
                last = now

        async with AsyncCache(tmp_path / "c", durability="fsync", page_size=4,
                              max_pages=8) as c:
            tick = asyncio.create_task(ticker())

            async def writer(w):
                for i in range(60):
                    await c.set(f"w{w}-{i}", b"x" * 100)
                    await c.get(f"w{w}-{i // 2}")
            t0 = time.perf_counter()
            await asyncio.gather(*(writer(w) for w in range(4)))
            elapsed = time.perf_counter() - t0
            stop.set()
            await tick
        assert loop_thread not in threads, "disk work ran on the loop's thread"
        assert threads, "the instrumentation saw no disk work"
        assert gaps
        # generous: the loop never stalls for a large share of the run
        assert max(gaps) < max(0.25, elapsed / 4), (max(gaps), elapsed, fsync_seconds[0])
    run(main())


def test_cancelled_set_is_applied_in_full_never_half(tmp_path, monkeypatch):
    """A set cancelled while its fsync is in progress: the cancellation
    reaches the caller only once the write is done, and it is all there,
    in memory and after a reopen."""
    entered, release = threading.Event(), threading.Event()
    real_fsync = ReplayLog._fsync

    def slow_fsync(self, fd):
        entered.set()
        assert release.wait(30)
        real_fsync(self, fd)

    async def main():
        async with AsyncCache(tmp_path / "c", durability="fsync", max_workers=1) as c:
            await c.set("k", {"v": "old"})
            monkeypatch.setattr(ReplayLog, "_fsync", slow_fsync)
            first = asyncio.create_task(c.set("k", {"v": "new", "big": "x" * 5000}))
            queued = asyncio.create_task(c.set("q", 1))  # waits for the only worker
            await asyncio.to_thread(entered.wait, 30)
            first.cancel()
            queued.cancel()
            for _ in range(5):
                await asyncio.sleep(0)
            assert not first.done(), "cancellation returned while the write was under way"
            release.set()
            for t in (first, queued):
                with pytest.raises(asyncio.CancelledError):
                    await t
            monkeypatch.setattr(ReplayLog, "_fsync", real_fsync)
            assert await c.get("k") == {"v": "new", "big": "x" * 5000}
            assert await c.get("q") == 1
    run(main())
    with Cache(tmp_path / "c") as again:
        assert again["k"] == {"v": "new", "big": "x" * 5000}


def test_stats_is_the_caches_and_runs_on_a_worker_thread(tmp_path, monkeypatch):
    """``await stats()`` is Cache.stats() (it takes the lock and stats the
    files), taken on a worker thread, never on the loop's thread."""
    threads: set[int] = set()
    real = Cache.stats

    def stats(self):
        threads.add(threading.get_ident())
        return real(self)
    monkeypatch.setattr(Cache, "stats", stats)

    async def main():
        async with AsyncCache(tmp_path / "c") as c:
            await c.set("a", 1)
            assert await c.get("a") == 1 and await c.get("b") is None
            s = await c.stats()
            assert type(s) is CacheStats
            assert (s.sets, s.hits, s.misses, s.last_lsn) == (1, 1, 1, 1)
            return threading.get_ident()
    loop_thread = run(main())
    assert threads and loop_thread not in threads


def test_wrap_leaves_the_cache_open(tmp_path):
    with Cache(tmp_path / "c") as cache:
        async def main():
            ac = AsyncCache.wrap(cache)
            await ac.set("a", 1)
            await ac.close()
        run(main())
        assert not cache.closed and cache["a"] == 1


def test_a_leading_tilde_is_the_home_directory_as_for_cache(home):
    async def main():
        ac = AsyncCache("~/c")
        assert repr(ac) == f"<AsyncCache {str(home / 'c')!r}, unopened>"
        async with ac as c:
            await c.set("k", 1)
            assert c.cache.path == str(home / "c")
    run(main())
    assert os.listdir(".") == []
    with Cache("~/c") as cache:
        assert cache["k"] == 1


def test_a_call_before_open_is_an_error_that_says_to_open_it(tmp_path):
    """Every call of an AsyncCache not opened yet (or whose open failed)
    raised a bare RuntimeError."""
    from durablekv.errors import CacheNotOpenError, DurableKVError

    async def main():
        ac = AsyncCache(tmp_path / "c")
        for call in (lambda: ac.get("k"), lambda: ac.set("k", 1), lambda: ac.stats()):
            with pytest.raises(CacheNotOpenError) as info:
                await call()
            assert isinstance(info.value, (DurableKVError, RuntimeError))
            msg = str(info.value)
            assert str(tmp_path / "c") in msg and "is not open" in msg
            assert "async with AsyncCache(" in msg and "await cache.open()" in msg
        with pytest.raises(CacheNotOpenError):
            ac.cache
        await ac.open()
        await ac.set("k", 1)
        await ac.close()
    run(main())


def test_nowait_calls_refuse_whatever_could_wait(tmp_path):
    """Cache._set_nowait / _get_nowait (what AsyncCache runs on the loop)
    do nothing, and say so, whenever the call could wait."""
    from durablekv.config import NOWAIT_UNSURE
    with Cache(tmp_path / "f", durability="fsync") as c:
        assert c._set_nowait("k", 1) is False and "k" not in c       # an fsync
    with Cache(tmp_path / "c", page_size=2, max_pages=2, segment_bytes=1024) as c:
        assert c._set_nowait("a", 1) is True and c["a"] == 1
        c._lock.acquire()
        try:                                                          # the lock taken
            assert c._set_nowait("a", 2) is False
            assert c._get_nowait("a", None) is NOWAIT_UNSURE
        finally:
            c._lock.release()
        for i in range(20):
            c[f"k{i}"] = "x" * 100
        c.flush()
        assert "a" not in c._tier.table                               # evicted: needs SQLite
        assert c._get_nowait("a", None) is NOWAIT_UNSURE
        assert c._set_nowait("a", 3) is False
        assert c["a"] == 1
        while c._log._size < c._log.segment_bytes:                    # a roll fsyncs
            c["k19"] = "y" * 100
        assert c._set_nowait("k19", "z") is False and c["k19"] == "y" * 100
        assert c._set_nowait("k19", 0, expire=0) is False             # expire=0 deletes
        with pytest.raises(ValueError):
            c._set_nowait("k19", 1, expire=-1)
