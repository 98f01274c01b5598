"""Regression tests for the public bug reports in ../shared/cases/BUG-CASES.md.

One test per case (``test_brNNN_...``), each following the case's scenario
step by step. Cases that need crash kills, corruption or a full disk
(BR-016, 017, 018, 019, 021, 022) and the exporter cases (BR-027, 028) live
in other modules.
"""

from __future__ import annotations

import os
import pickle
import random
import sqlite3
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from durablekv import Cache
from durablekv import codec
from durablekv.stores.pageformat import decode_page
from .conftest import Clock, open_cache, opened, run_with_timeout

MiB = 1 << 20


class RealClockUntilFrozen:
    """``time.time()`` until ``frozen`` is set, then that value."""

    def __init__(self) -> None:
        self.frozen: float | None = None

    def __call__(self) -> float:
        return time.time() if self.frozen is None else self.frozen


def spill(c: Cache) -> None:
    """Push every page of a ``page_size=1, max_pages=1`` cache out to SQLite."""
    assert (c.page_size, c.max_pages) == (1, 1)
    c.set("__spill__", 0)
    c.delete("__spill__")
    c.flush()
    assert c.stats().pending_pages == 0


def store_contents(path) -> dict:
    """``{key: value}`` as committed in ``pages.sqlite3`` (read-only), after
    checking that the key index and the pages agree both ways."""
    con = sqlite3.connect(f"file:{os.path.join(path, 'pages.sqlite3')}?mode=ro", uri=True)
    try:
        pages = con.execute("SELECT page_id, data FROM pages").fetchall()
        index = {bytes(k): pid for k, pid in con.execute("SELECT key, page_id FROM keys")}
    finally:
        con.close()
    safe = codec.SafeCodec()
    out = {}
    seen = set()
    for pid, data in pages:
        for _slot, kb, vb, _exp in decode_page(data):
            key = codec.decode_key(kb)
            ck = codec.canonical_key(key)
            assert index.get(ck) == pid, f"index has {key!r} on {index.get(ck)}, page {pid} holds it"
            assert ck not in seen, f"{key!r} is stored twice"
            seen.add(ck)
            out[key] = safe.decode(vb)
    assert seen == set(index), "index rows without an entry in their page"
    return out


# -- BR-001 ------------------------------------------------------------------------


def test_br001_ttl_boundary_and_zero_ttl(tmp_path):
    clock = Clock(100)
    d = tmp_path / "c"
    with opened(d, clock=clock) as c:
        c.set("a", 1, expire=1)                                   # 1
        clock.now = 100.5
        assert c.get("a") == 1                                    # 2
        clock.now = 101.0                                         # 3: the deadline
        assert c.get("a", default="D") == "D"
        assert "a" not in c and len(c) == 0 and list(c) == []
        c.set("b", 2, expire=0)                                   # 4
        assert c.get("b", "D") == "D" and len(c) == 0 and list(c) == []
        c.set("c", 3, expire=None)                                # 5
        clock.now = 10**9
        assert c.get("c") == 3
        with pytest.raises(ValueError):                           # 6: the spec picks ValueError
            c.set("d", 4, expire=-1)
        assert "d" not in c and len(c) == 1
    # 7: steps 1-3 with a restart between step 1 and step 3
    clock.now = 100
    d2 = tmp_path / "c2"
    with opened(d2, clock=clock) as c:
        c.set("a", 1, expire=1)
    clock.now = 100.5
    with opened(d2, clock=clock) as c:
        assert c.get("a") == 1
    clock.now = 101.0
    with opened(d2, clock=clock) as c:
        assert c.get("a", default="D") == "D"
        assert "a" not in c and len(c) == 0 and list(c) == []


# -- BR-004 ------------------------------------------------------------------------


def test_br004_cached_none_is_a_hit_not_a_miss(tmp_path):
    d = tmp_path / "c"
    with opened(d) as c:
        calls = []

        @c.memoize()
        def f(x):
            calls.append(x)
            return None

        assert f(1) is None
        hits = c.stats().hits
        assert f(1) is None
        assert calls == [1]                                       # ran once
        assert c.stats().hits == hits + 1

        c.set("k", None)                                          # 2
        assert "k" in c and c.get("k", default="D") is None and c["k"] is None
        assert len(c) == 2                                        # k and f(1)'s entry

        failures = []

        @c.memoize()
        def boom(x):                                              # 4
            failures.append(x)
            raise RuntimeError("nope")

        for _ in range(2):
            with pytest.raises(RuntimeError):
                boom(1)
        assert failures == [1, 1]                                 # not cached
        assert len(c) == 2
    with opened(d) as c:                                      # 3: restart
        assert "k" in c and c.get("k", default="D") is None
        assert c.pop("k", "D") is None
        assert len(c) == 1

        calls2 = []

        @c.memoize(name=f.__module__ + "." + f.__qualname__)
        def f2(x):
            calls2.append(x)
            return "recomputed"

        assert f2(1) is None and calls2 == []                     # the stored None is a hit
    with opened(d, page_size=None, max_pages=1) as c:         # and from a faulted page
        c.set("n", None)
        spill_keys = [("x", i) for i in range(20)]
        for k in spill_keys:
            c[k] = 0
        c.flush()
        s = c.stats()
        assert c.get("n", "D") is None and "n" in c
        assert c.stats().store_hits == s.store_hits + 1


# -- BR-005 ------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["memory", "spill", "restart"])
def test_br005_string_one_and_int_one_are_different_keys(tmp_path, where):
    kw = dict(page_size=1, max_pages=1) if where == "spill" else {}
    c = open_cache(tmp_path / "c", **kw)
    try:
        c.set("1", "ONE")
        c.set(1, 1)
        if where == "spill":
            spill(c)
        elif where == "restart":
            c.close()
            c = open_cache(tmp_path / "c")
        assert len(c) == 2
        assert c.get("1") == "ONE" and c.get(1) == 1
        keys = set(c.keys())
        assert keys == {"1", 1}
        assert {type(k) for k in keys} == {str, int}
        assert c.get(1.0) == 1 and c.get(True) == 1 and c.get(b"1") is None
    finally:
        c.close()
    with opened(tmp_path / "c") as c:
        assert store_contents(c.path) == {"1": "ONE", 1: 1}


# -- BR-007 ------------------------------------------------------------------------


def test_br007_equal_keys_encode_to_the_same_stored_key(tmp_path):
    d = tmp_path / "c"
    c = open_cache(d, page_size=1, max_pages=1)
    try:
        c.set(("part0", "part1"), 1)                              # 1
        assert [c[k] for k in c] == [1]
        s = "".join(["x"] * 100)                                  # 2
        t1 = (s, s)
        t2 = ("".join(["x"] * 100), "".join(["x"] * 100))
        assert t1 == t2 and t1[0] is t1[1] and t2[0] is not t2[1]
        assert pickle.dumps(t1) != pickle.dumps(t2)
        c.set(t1, "v")
        assert c.get(t2) == "v"                                   # memory
        spill(c)
        before = c.stats().store_hits
        assert c.get(t2) == "v"                                   # after a spill
        assert c.stats().store_hits == before + 1
        calls = []

        @c.memoize()
        def g(x):                                                 # 3
            calls.append(x)
            return len(x)

        assert g(t1) == 2 and g(t2) == 2 and calls == [t1]
        spill(c)
        assert g(t2) == 2 and calls == [t1]
    finally:
        c.close()
    with opened(d) as c:                                      # restart
        assert c.get(t2) == "v"
        for k in c:
            assert k in c and c[k] is not None
        assert c[("part0", "part1")] == 1
        assert len(c) == 3
        assert len([k for k in c if k == t1]) == 1


# -- BR-008 ------------------------------------------------------------------------


def test_br008_unicode_keys_come_back_as_str_and_str_never_equals_bytes(tmp_path):
    d = tmp_path / "c"
    emoji, nfc, nfd = "\U0001F439", "\u00e9", "e\u0301"

    def check(c):
        ks = list(c.keys())
        assert emoji in ks and type(ks[ks.index(emoji)]) is str
        assert len(c) == 5
        assert c[emoji] == 1 and c[b"x"] == "bytes" and c["x"] == "str"
        assert c[nfc] == "nfc" and c[nfd] == "nfd"
        assert sorted(map(repr, ks)) == sorted(map(repr, [emoji, b"x", "x", nfc, nfd]))

    with opened(d, page_size=1, max_pages=1) as c:
        c.set(emoji, 1)                                           # 1
        assert list(c.keys()) == [emoji] and type(list(c.keys())[0]) is str
        c.set(b"x", "bytes")                                      # 2
        c.set("x", "str")
        assert len(c) == 3
        c.set(nfc, "nfc")                                         # 3
        c.set(nfd, "nfd")
        check(c)
        spill(c)
        check(c)
    with opened(d) as c:                                      # 4
        check(c)
        assert store_contents(d) == {emoji: 1, b"x": "bytes", "x": "str", nfc: "nfc",
                                     nfd: "nfd"}


# -- BR-009 ------------------------------------------------------------------------


def test_br009_many_threads_with_expiring_entries(tmp_path):
    """16 threads x 5,000 random ops over 200 keys, each set with a random TTL of
    1-50 ms (real clock). durablekv bounds *resident pages*, not entries: with
    ``page_size=1, max_pages=50`` at most 50 entries are in memory, the rest
    wait in SQLite, so ``len`` counts every live entry."""
    n_threads, n_ops = 16, 5000
    clock = RealClockUntilFrozen()
    c = open_cache(tmp_path / "c", page_size=1, max_pages=50, flush_interval=0.01, clock=clock)
    errors: list[BaseException] = []
    gets = [0] * n_threads
    barrier = threading.Barrier(n_threads)

    def work(tid: int) -> None:
        rnd = random.Random(tid)
        try:
            barrier.wait()
            for _ in range(n_ops):
                k = rnd.randrange(200)
                r = rnd.random()
                if r < 0.35:
                    c.set(k, (tid, k), expire=rnd.uniform(0.001, 0.05))
                elif r < 0.7:
                    gets[tid] += 1
                    v = c.get(k)
                    assert v is None or v[1] == k
                elif r < 0.8:
                    c.delete(k)
                elif r < 0.9:
                    k in c  # noqa: B015
                else:
                    assert len(c) >= 0
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    try:
        assert not any(t.is_alive() for t in threads)
        assert errors == []
        s = c.stats()
        assert s.resident_pages <= 50
        assert s.hits + s.misses == sum(gets)
        assert s.hits == s.memory_hits + s.store_hits
        # no writer meanwhile: len and iteration agree (entries may still expire
        # between two reads of the real clock, so compare against a frozen one)
        clock.frozen = time.time() + 3600  # every entry is now past its TTL
        assert len(c) == len(list(c)) == 0
        c.set("after", 1)                  # 4: still usable
        assert c.get("after") == 1 and len(c) == 1 and list(c) == ["after"]
        c.flush(timeout=10)
    finally:
        run_with_timeout(c.close)


def test_br009_len_matches_iteration_with_live_entries(tmp_path):
    clock = Clock(0)
    c = open_cache(tmp_path / "c", page_size=1, max_pages=50, clock=clock, flush_interval=0.01)
    errors = []

    def work(tid: int) -> None:
        rnd = random.Random(100 + tid)
        try:
            for _ in range(800):
                k = rnd.randrange(200)
                r = rnd.random()
                if r < 0.5:
                    c.set(k, k, expire=rnd.choice([None, 5.0, 10.0]))
                elif r < 0.8:
                    c.get(k)
                else:
                    c.delete(k)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    try:
        assert errors == []
        clock.now = 7.0          # the 5 s entries are gone, the others are not
        n = len(c)
        keys = list(c)
        assert n == len(keys) == len(set(keys))
        assert all(c.get(k) == k for k in keys)
        assert c.stats().resident_pages <= 50
    finally:
        run_with_timeout(c.close)
    with opened(tmp_path / "c", clock=clock) as c2:
        assert sorted(c2) == sorted(keys)


# -- BR-010 ------------------------------------------------------------------------


def _wait_until(condition, timeout: float = 10.0) -> None:
    """Return once ``condition()`` holds; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    tick = threading.Event()
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting"
        tick.wait(0.001)


def test_br010_memoize_single_flight(tmp_path):
    with opened(tmp_path / "c") as c:
        calls = []
        everyone = threading.Event()
        n = 8
        count = [0]
        lock = threading.Lock()

        @c.memoize()
        def slow(x):
            calls.append(x)
            # hold the flight open until every other caller waits for it
            everyone.wait(10)
            _wait_until(lambda: slow.waiting(x) == n - 1)
            return {"x": x}

        barrier = threading.Barrier(n)
        results: list = [None] * n

        def call(i):
            barrier.wait()
            with lock:
                count[0] += 1
                if count[0] == n:
                    everyone.set()
            results[i] = slow(1)

        threads = [threading.Thread(target=call, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert calls == [1]
        assert results == [{"x": 1}] * n
        assert slow(1) == {"x": 1} and calls == [1]
        assert slow.waiting(1) == 0  # nothing in flight now

        # 3: the first call raises: every waiter gets that error, nothing cached
        attempts = []
        release = threading.Event()
        count[0] = 0

        @c.memoize()
        def flaky(x):
            attempts.append(x)
            if len(attempts) == 1:
                release.wait(10)
                _wait_until(lambda: flaky.waiting(x) == n - 1)
                raise ValueError("first call fails")
            return "second"

        barrier2 = threading.Barrier(n)
        outcomes: list = [None] * n

        def call2(i):
            barrier2.wait()
            with lock:
                count[0] += 1
                if count[0] == n:
                    release.set()
            try:
                outcomes[i] = flaky(1)
            except ValueError as exc:
                outcomes[i] = exc

        threads = [threading.Thread(target=call2, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert attempts == [1]
        assert all(isinstance(o, ValueError) and str(o) == "first call fails" for o in outcomes)
        assert flaky.cache_key(1) not in c
        assert flaky(1) == "second" and attempts == [1, 1]
        assert flaky(1) == "second" and attempts == [1, 1]


# -- BR-013 ------------------------------------------------------------------------


def test_br013_overwrites_do_not_inflate_size_and_eviction_takes_only_the_lru(tmp_path):
    """maxsize=3 is read as ``page_size=1, max_pages=3``: an exact LRU of 3
    entries. durablekv's bound is on the memory tier, not on the cache: "b" is
    the page that leaves memory (one eviction), but it is still in the SQLite
    store, so it remains a key of the cache (a later get is a store hit), and
    after a restart all four keys are present."""
    d = tmp_path / "c"
    with opened(d, page_size=1, max_pages=3) as c:
        for _ in range(3):                                        # 1
            c.set("a", 1)
        s = c.stats()
        assert len(c) == 1 and s.evictions == 0 and s.resident_pages == 1
        c.set("b", 2)                                             # 2
        c.set("c", 3)
        assert c.get("a") == 1
        c.set("d", 4)
        s = c.stats()
        assert s.evictions == 1 and s.resident_pages == 3
        for k, v in (("a", 1), ("c", 3), ("d", 4)):               # the three residents
            before = c.stats()
            assert c.get(k) == v
            after = c.stats()
            assert after.memory_hits == before.memory_hits + 1, k
            assert after.store_hits == before.store_hits, k
        before = c.stats()
        assert c.get("b") == 2                                    # b left memory
        after = c.stats()
        assert after.store_hits == before.store_hits + 1
        assert after.memory_hits == before.memory_hits
        assert after.page_faults == before.page_faults + 1
        assert len(c) == 4
    with opened(d) as c:                                      # 3
        assert len(c) == 4
        assert dict(c.items()) == {"a": 1, "b": 2, "c": 3, "d": 4}


# -- BR-014 ------------------------------------------------------------------------


def test_br014_write_behind_keeps_per_key_order(tmp_path):
    d = tmp_path / "c"
    code = textwrap.dedent(f"""
        import os
        from durablekv import Cache
        c = Cache({str(d)!r}, flush_batch_pages=10, flush_interval=60)
        c.delete("k")
        for v in "ABCD":
            c.set("k", v)
            c.delete("k")
        c.set("k", "D")
        c.set("j", "A")
        c.set("j", "B")
        c.delete("j")
        c.flush()
        os._exit(0)      # no close()
    """)
    subprocess.run([sys.executable, "-c", code], check=True, timeout=30)
    with opened(d) as c:                                      # 1 and 2
        assert c.get("k") == "D"
        assert "j" not in c and c.get("j") is None
        assert store_contents(d) == {"k": "D"}


@pytest.mark.parametrize("page_size,max_pages", [(2, 1), (1, 2), (3, 2)])
def test_br014_store_matches_memory_after_every_flush(tmp_path, page_size, max_pages):
    """Keys move between pages (delete from one page, set into the open page)
    while pages are evicted and written in different batches; after each
    flush SQLite holds exactly the cache's state (3), and so does a restart."""
    d = tmp_path / "c"
    rnd = random.Random(page_size * 10 + max_pages)
    model: dict = {}
    with opened(d, page_size=page_size, max_pages=max_pages, flush_batch_pages=10) as c:
        for round_ in range(25):
            for _ in range(12):
                k = rnd.choice("kjmnpqrs")
                if rnd.random() < 0.4:
                    c.delete(k)
                    model.pop(k, None)
                else:
                    v = f"{k}{round_}{rnd.randrange(100)}"
                    c.set(k, v)
                    model[k] = v
            c.flush()
            assert store_contents(d) == model
            assert {k: c.get(k) for k in model} == model
    with opened(d) as c:
        assert dict(c.items()) == model


# -- BR-024 ------------------------------------------------------------------------


def test_br024_huge_values(tmp_path):
    d = tmp_path / "c"
    c = open_cache(d, page_size=1, max_pages=1, max_value_bytes=MiB)   # 1
    try:
        c.set("small", b"s")
        before = c.stats()
        with pytest.raises(ValueError, match="max_value_bytes"):       # 2
            c.set("big", b"\0" * (MiB + 1))
        with pytest.raises(ValueError):
            c.set("small", b"\0" * (MiB + 1))
        after = c.stats()
        assert len(c) == 1 and "big" not in c and c["small"] == b"s"
        assert after.sets == before.sets and after.last_lsn == before.last_lsn
        assert after.log_bytes == before.log_bytes                   # nothing logged
        assert after.dirty_pages == before.dirty_pages               # nothing queued
        assert after.pending_pages == before.pending_pages
        assert after.resident_pages == before.resident_pages
        exact = b"\1" * MiB                                          # 3
        c.set("exact", exact)
        spill(c)
        assert c.get("exact") == exact
        assert c.stats().store_hits == after.store_hits + 1
    finally:
        c.close()
    with opened(d, max_value_bytes=MiB) as c:
        assert c.get("exact") == exact and c["small"] == b"s" and len(c) == 2
    # 4: the default limit is below SQLite's limit on one blob
    with opened(tmp_path / "dflt") as c:
        limit = sqlite3.connect(":memory:").getlimit(sqlite3.SQLITE_LIMIT_LENGTH)
        assert c.max_value_bytes < limit
