"""The Bloom filter in front of the key index: never a false negative."""

from __future__ import annotations

import itertools
import random
import sqlite3
import threading

import pytest

import durablekv.keyfilter as keyfilter
from durablekv import Cache
from durablekv import codec as kvcodec
from durablekv.errors import WriteBehindError
from durablekv.keyfilter import KeyFilter
from durablekv.tier.pages import EMPTY, PENDING

from .conftest import Clock


def count_lookups(cache: Cache) -> list:
    calls = []
    real = cache._store.find

    def lookup(ck):
        calls.append(ck)
        return real(ck)

    cache._store.find = lookup
    return calls


def test_filter_has_no_false_negatives_and_few_false_positives():
    f = KeyFilter(10_000)
    keys = [f"k{i}".encode() for i in range(10_000)]
    f.add_all(keys)
    assert all(k in f for k in keys)
    false_pos = sum(f"other{i}".encode() in f for i in range(10_000))
    assert false_pos < 300  # ~0.6 % expected at capacity (minimum capacity is larger)


def test_misses_and_new_keys_skip_sqlite_once_the_filter_is_ready(tmp_path):
    d = tmp_path / "c"
    with Cache(d, page_size=4, max_pages=2) as cache:
        for i in range(3000):
            cache[f"k{i}"] = i
    # (the write-behind stays idle until flush(): a timed cycle right after
    # open would build the filter before the first assert, as it once did)
    with Cache(d, page_size=4, max_pages=2, flush_interval=3600) as cache:
        assert not cache._store_keys.filter.ready  # a store with keys: built by a background scan
        cache["trigger"] = 1
        cache.flush()  # a batcher cycle: the scan runs before it
        assert cache._store_keys.filter.ready
        calls = count_lookups(cache)
        for i in range(1000):
            assert cache.get(f"absent{i}") is None
            cache[f"new{i}"] = i
        assert len(calls) < 50  # false positives only
        for i in range(0, 3000, 7):  # and every stored key is still found
            assert cache[f"k{i}"] == i
        assert len(cache) == 3000 + 1 + 1000


def test_filter_rebuilds_larger_when_overfull_without_losing_keys(tmp_path, monkeypatch):
    monkeypatch.setattr(keyfilter, "MIN_CAPACITY", 256)
    d = tmp_path / "c"
    with Cache(d, page_size=4, max_pages=2, flush_batch_pages=4) as cache:
        first = cache._store_keys.filter.capacity
        for i in range(5000):
            cache[f"k{i}"] = i
            if i % 500 == 0:
                cache.flush()
        cache.flush()
        assert cache._store_keys.filter.capacity > first  # rebuilt, larger
        # pages were evicted and dropped: the keys live only in SQLite now
        for i in range(5000):
            assert cache[f"k{i}"] == i


def test_clear_resets_the_filter(tmp_path):
    with Cache(tmp_path / "c", page_size=2, max_pages=2) as cache:
        for i in range(100):
            cache[i] = i
        cache.clear()
        cache.flush()
        calls = count_lookups(cache)
        assert cache.get(5) is None and len(calls) == 0
        cache[5] = "again"
        assert cache[5] == "again"


def test_add_many_sets_the_same_bits_as_add():
    keys = [f"k{i}".encode() for i in range(5000)] + [b"", b"s\x00\x00\x00\x00"]
    one, many = KeyFilter(3000), KeyFilter(3000)
    for k in keys:
        one.add(k)
    many.add_many(iter(keys))
    assert many.bits == one.bits and many.added == one.added == len(keys)


# -- keys enter the filter when a flush stores them ------------------------------------------
#
# The filter is consulted only for keys that are not in the page table, so it
# must hold every key the store holds on a page that is not in memory. Keys
# are added when a flush commits their index rows (Cache._flush_done), before
# their pages may leave memory. These tests push keys out of memory (their
# pages flushed and dropped) and look them up again, through each path that
# makes or replaces a filter.

#: the batcher never runs unless asked (flush()/close() or back-pressure)
NEVER = dict(flush_interval=3600, flush_batch_pages=1_000_000, max_pending_pages=1_000_000)
_fillers = itertools.count()


def ck(key) -> bytes:
    return kvcodec.canonical_key(key)


def push_out(cache: Cache, keys) -> None:
    """Set filler keys and flush until none of ``keys`` is in memory: their
    pages were stored and dropped, so only the key index can find them."""
    for _ in range(10_000):
        if not any(k in cache._tier.table for k in keys):
            return
        for _ in range(cache.page_size):
            cache[f"~filler{next(_fillers)}"] = 0
        cache.flush()
    raise AssertionError("the pages never left memory")


@pytest.fixture
def small_filters(monkeypatch):
    """Filters start at 256 keys, so a few hundred keys make one overfull."""
    monkeypatch.setattr(keyfilter, "MIN_CAPACITY", 256)


def test_a_new_key_enters_the_filter_when_a_flush_stores_it(tmp_path):
    with Cache(tmp_path / "c", page_size=1, max_pages=2, **NEVER) as cache:
        assert cache._store_keys.filter.ready  # a new store
        cache["k"] = 1
        # only in memory: the page table finds it, the set paid no filter add
        assert cache._store_keys.filter.added == 0 and ck("k") not in cache._store_keys.filter
        cache.flush()
        assert cache._store_keys.filter.added == 1 and ck("k") in cache._store_keys.filter
        push_out(cache, ["k"])
        calls = count_lookups(cache)
        assert cache["k"] == 1 and calls == [ck("k")]  # a page fault through the index
        assert cache.get("absent") is None and len(calls) == 1


def test_an_evicted_dirty_page_is_found_before_and_after_its_flush(tmp_path):
    with Cache(tmp_path / "c", page_size=1, max_pages=1, **NEVER) as cache:
        cache["k"] = 1
        cache["x"] = 2  # k's page is evicted while dirty: pending, still in the table
        page = cache._tier.table["k"][0]
        assert page.state == PENDING and ck("k") not in cache._store_keys.filter
        calls = count_lookups(cache)
        assert cache["k"] == 1 and calls == []  # taken back from the queue
        assert cache._tier.table["x"][0].state == PENDING
        cache.flush()  # x's pending page is stored, then dropped
        assert "x" not in cache._tier.table and ck("x") in cache._store_keys.filter
        assert cache["x"] == 2 and len(calls) == 1
        push_out(cache, ["k", "x"])
        assert cache["k"] == 1 and cache["x"] == 2


def _hold_first_flush(cache: Cache, monkeypatch):
    """Make the next write_batch wait (after the snapshot is taken) until
    released. Returns (started, release, flusher thread)."""
    started, release = threading.Event(), threading.Event()
    real = cache._store.write_batch
    held = []

    def write_batch(*args, **kwargs):
        if not held:
            held.append(1)
            started.set()
            assert release.wait(10)
        return real(*args, **kwargs)

    monkeypatch.setattr(cache._store, "write_batch", write_batch)
    flusher = threading.Thread(target=cache.flush, daemon=True)
    flusher.start()
    assert started.wait(10)
    return release, flusher


def test_keys_changed_while_their_flush_is_in_flight(tmp_path, monkeypatch):
    """A key deleted after the snapshot is committed anyway (the page stays
    dirty and in memory, so it is not found); a key set during the flush is
    added by the next one."""
    with Cache(tmp_path / "c", page_size=4, max_pages=1, **NEVER) as cache:
        cache["a"], cache["c"] = 1, 3
        release, flusher = _hold_first_flush(cache, monkeypatch)
        del cache["a"]
        cache["b"] = 2  # the same page: it stays dirty after this flush
        release.set()
        flusher.join(10)
        assert not flusher.is_alive()
        assert cache.get("a") is None and cache["b"] == 2 and cache["c"] == 3
        cache.flush()
        assert ck("b") in cache._store_keys.filter
        push_out(cache, ["a", "b", "c"])
        assert cache.get("a") is None and cache["b"] == 2 and cache["c"] == 3
        assert "a" not in cache and len(cache) == 2 + sum(
            1 for k in cache if str(k).startswith("~filler"))


def test_a_clear_during_a_flush_keeps_its_keys_out_of_the_new_filter(tmp_path, monkeypatch):
    with Cache(tmp_path / "c", page_size=2, max_pages=1, **NEVER) as cache:
        cache["old1"], cache["old2"] = 1, 2
        release, flusher = _hold_first_flush(cache, monkeypatch)
        cache.clear()
        cache["after"] = 3
        release.set()  # the pre-clear snapshot commits old1 and old2, which
        flusher.join(10)  # the next flush deletes (clear() kicked it already)
        assert not flusher.is_alive()
        assert cache.get("old1") is None
        cache.flush()  # the clear and "after"
        # only "after" went into the filter, not the keys committed before the clear
        assert cache._store_keys.filter.added == 1 and ck("after") in cache._store_keys.filter
        push_out(cache, ["after"])
        calls = count_lookups(cache)
        assert cache.get("old1") is None and cache.get("old2") is None and calls == []
        assert cache["after"] == 3


def test_filter_rebuild_in_progress_loses_no_key(tmp_path, small_filters):
    """An overfull filter starts a build (completed by the next cycle's scan);
    keys set, stored and dropped meanwhile are found before and after it."""
    with Cache(tmp_path / "c", page_size=4, max_pages=2, **NEVER) as cache:
        first = cache._store_keys.filter.capacity
        n = 0
        while cache._store_keys.building is None:
            for _ in range(40):
                cache[f"k{n}"] = n
                n += 1
            cache.flush()
            assert n < 5000
        old = cache._store_keys.filter
        assert old.ready and old.overfull  # still in use while the build waits
        for i in range(n, n + 100):  # memory only, then stored (and dropped)
            cache[f"k{i}"] = i
        assert all(cache[f"k{i}"] == i for i in range(n + 100))
        cache.flush()  # this cycle's scan completes the build first
        assert cache._store_keys.filter is not old and cache._store_keys.filter.ready
        assert cache._store_keys.filter.capacity > first and cache._store_keys.building is None
        push_out(cache, [f"k{i}" for i in range(n + 100)])
        calls = count_lookups(cache)
        assert all(cache[f"k{i}"] == i for i in range(n + 100))
        assert all(cache.get(f"absent{i}") is None for i in range(1000))
        assert len(calls) < n + 100 + 50  # one per stored key + false positives


def test_a_flush_that_outgrows_the_filter_adds_every_slice(tmp_path, small_filters,
                                                           monkeypatch):
    """One flush adds its keys in slices; the first makes the filter overfull
    and starts a build, which the next cycle's scan completes. The later
    slices still go into the filter in use: their pages are dropped at the
    end of this flush, before that scan."""
    import durablekv.writeback as cache_mod
    monkeypatch.setattr(cache_mod, "_FILTER_SLICE", 64)
    with Cache(tmp_path / "c", page_size=4, max_pages=2, **NEVER) as cache:
        old = cache._store_keys.filter
        for i in range(1000):
            cache[f"k{i}"] = i
        cache.flush()  # 1000 new keys: 16 slices; overfull after the 9th
        assert cache._store_keys.filter is old and old.added == 1000 and old.overfull
        assert cache._store_keys.building is not None  # the scan comes with the next cycle
        assert sum(f"k{i}" in cache._tier.table for i in range(1000)) <= 8
        assert all(ck(f"k{i}") in old for i in range(1000))
        assert all(cache[f"k{i}"] == i for i in range(1000))
        cache["trigger"] = 1
        cache.flush()
        assert cache._store_keys.filter is not old and cache._store_keys.filter.ready
        push_out(cache, [f"k{i}" for i in range(1000)])
        calls = count_lookups(cache)
        assert all(cache[f"k{i}"] == i for i in range(1000))
        assert all(cache.get(f"absent{i}") is None for i in range(1000))
        assert len(calls) < 1000 + 50


def test_keys_stored_while_the_open_time_scan_waits_are_found(tmp_path, monkeypatch):
    """A store with keys: the filter is built by a scan between flushes.
    Flushes that commit before the scan add nothing to it (the scan reads
    them); every key is found while it waits and after it is merged."""
    d = tmp_path / "c"
    with Cache(d, page_size=4) as cache:
        for i in range(300):
            cache[f"old{i}"] = i
    with Cache(d, page_size=4, max_pages=2, **NEVER) as cache:
        assert not cache._store_keys.filter.ready and cache._store_keys.building is not None
        monkeypatch.setattr(cache, "_background_work", lambda: None)  # the scan waits
        for i in range(200):
            cache[f"new{i}"] = i
        cache.flush()
        assert not cache._store_keys.filter.ready
        everything = [f"old{i}" for i in range(300)] + [f"new{i}" for i in range(200)]
        push_out(cache, everything)
        assert all(cache[k] == int(k[3:]) for k in everything)  # through SQLite
        monkeypatch.undo()
        cache["trigger"] = 1
        cache.flush()  # the scan runs before this cycle's commit
        assert cache._store_keys.filter.ready
        push_out(cache, everything)
        calls = count_lookups(cache)
        assert all(cache[k] == int(k[3:]) for k in everything)
        assert all(cache.get(f"absent{i}") is None for i in range(1000))
        assert len(calls) < len(everything) + 50


def test_recovery_adds_nothing_at_open_and_the_flush_adds_every_key(tmp_path):
    from .test_recovery import crash
    d = tmp_path / "c"
    cache = Cache(d, page_size=4, **NEVER)
    for i in range(1000):
        cache[f"k{i}"] = i
    crash(cache)
    with Cache(d, page_size=4, max_pages=1000, **NEVER) as cache:
        assert cache.stats().recovered_records == 1000
        assert cache._store_keys.filter.ready and cache._store_keys.filter.added == 0  # open paid no adds
        cache.flush()
        assert cache._store_keys.filter.added == 1000
        assert all(ck(f"k{i}") in cache._store_keys.filter for i in range(1000))
        push_out(cache, [f"k{i}" for i in range(1000)])
        assert all(cache[f"k{i}"] == i for i in range(1000))


@pytest.mark.parametrize("stored", [0, 500])
def test_recovery_through_back_pressure_loses_no_key(tmp_path, monkeypatch, stored):
    """Recovery bigger than memory flushes while it runs: into a ready filter
    (new store), or while the open-time scan still waits (store with keys:
    the scan is held back here until open returns)."""
    from .test_recovery import crash
    d = tmp_path / "c"
    cache = Cache(d, page_size=4, **NEVER)
    for i in range(stored):
        cache[f"s{i}"] = i
    cache.flush()
    for i in range(0, stored, 2):
        cache[f"s{i}"] = -i
    for i in range(800):
        cache[f"n{i}"] = i
    crash(cache)
    expected = {f"s{i}": (-i if i % 2 == 0 else i) for i in range(stored)}
    expected.update({f"n{i}": i for i in range(800)})
    real_scan = Cache._background_work
    gate = {"open": False}
    monkeypatch.setattr(Cache, "_background_work",
                        lambda self: real_scan(self) if gate["open"] else None)
    with Cache(d, max_pages=5, max_pending_pages=3, flush_interval=3600) as cache:
        assert cache.stats().flushes > 0  # back-pressure made the batcher write
        assert cache._store_keys.filter.ready == (stored == 0)
        assert all(cache[k] == v for k, v in expected.items())
        gate["open"] = True
        cache.flush()
        push_out(cache, list(expected))
        assert cache._store_keys.filter.ready
        calls = count_lookups(cache)
        assert all(cache[k] == v for k, v in expected.items())
        assert all(cache.get(f"absent{i}") is None for i in range(1000))
        assert len(calls) < len(expected) + 50


@pytest.mark.parametrize("how", ["none", "salvage"])
def test_recovery_that_flushes_at_open_fills_the_filter(tmp_path, how):
    """durability="none" (the log is dropped) and a salvaged log (the damaged
    segment is moved aside) wait for the flush at open: its keys are in the
    filter when open returns."""
    from pathlib import Path

    from durablekv.log.segments import HEADER, MAGIC, list_segments

    from .test_recovery import crash
    d = tmp_path / "c"
    cache = Cache(d, page_size=4, **NEVER)
    for i in range(300):
        cache[f"k{i}"] = i
    crash(cache)
    n = 300
    if how == "none":
        cache = Cache(d, durability="none", page_size=4, max_pages=2, **NEVER)
    else:
        (seg,) = list_segments(str(d))
        data = bytearray(Path(seg).read_bytes())
        at = len(MAGIC)
        for _ in range(150):  # damage record 151: records 1-150 are salvaged
            at += HEADER.size + HEADER.unpack_from(data, at)[0]
        data[at + HEADER.size + 3] ^= 0xFF
        Path(seg).write_bytes(bytes(data))
        n = 150
        cache = Cache(d, salvage_log=True, page_size=4, max_pages=2, **NEVER)
    with cache:
        assert cache.stats().recovered_records == n
        assert cache._store.checkpoint_lsn == n  # flushed before open returned
        assert all(ck(f"k{i}") in cache._store_keys.filter for i in range(n))
        push_out(cache, [f"k{i}" for i in range(n)])
        assert all(cache[f"k{i}"] == i for i in range(n))
        assert all(cache.get(f"k{i}") is None for i in range(n, 300))


def test_deletes_and_expiry_changes_add_no_keys(tmp_path):
    """Only index rows new to their page are added (a changed expire_at or a
    delete adds nothing); deleted and expired keys stay absent; a key set
    again after its delete is found."""
    clock = Clock()
    with Cache(tmp_path / "c", page_size=4, max_pages=1, clock=clock, **NEVER) as cache:
        cache["a"], cache["c"] = 1, 3
        cache.set("b", 2, expire=10)
        cache.flush()
        assert cache._store_keys.filter.added == 3
        del cache["a"]
        cache.set("c", 30, expire=100)  # expire_at changes: the index row is rewritten
        cache.flush()
        assert cache._store_keys.filter.added == 3
        push_out(cache, ["a", "b", "c"])
        assert cache.get("a") is None and cache["b"] == 2 and cache["c"] == 30
        clock.now += 50
        push_out(cache, ["a", "b", "c"])
        assert cache.get("b") is None and cache["c"] == 30
        clock.now += 100
        assert cache.get("c") is None
        cache["a"] = "again"
        cache.flush()
        push_out(cache, ["a", "b", "c"])
        assert cache["a"] == "again" and cache.get("b") is None and cache.get("c") is None


def test_a_failed_flush_adds_nothing_and_its_retry_does(tmp_path, monkeypatch):
    with Cache(tmp_path / "c", page_size=1, max_pages=2, **NEVER) as cache:
        real = cache._store.write_batch
        state = {"fail": "database is locked", "poison": False}

        def write_batch(images, *args, **kwargs):
            if state["fail"]:
                raise sqlite3.OperationalError(state["fail"])
            if state["poison"] and any(b"bad" in img.data for img in images):
                raise sqlite3.OperationalError("poison: cannot store this row")
            return real(images, *args, **kwargs)

        monkeypatch.setattr(cache._store, "write_batch", write_batch)
        cache["k"] = 1
        with pytest.raises(WriteBehindError):
            cache.flush()
        assert cache._store_keys.filter.added == 0 and cache["k"] == 1
        # one page that cannot be stored: the others are committed (and added)
        state["fail"], state["poison"] = None, True
        cache["bad"], cache["good"] = 2, 3
        with pytest.raises(WriteBehindError):
            cache.flush()
        assert ck("k") in cache._store_keys.filter and ck("good") in cache._store_keys.filter
        assert cache._store_keys.filter.added == 2 and cache["bad"] == 2
        state["poison"] = False
        cache.flush()
        assert cache._store_keys.filter.added == 3
        push_out(cache, ["k", "bad", "good"])
        assert cache["k"] == 1 and cache["bad"] == 2 and cache["good"] == 3


@pytest.mark.parametrize("seed", range(4))
def test_every_page_leaving_memory_has_its_keys_in_the_filter(tmp_path, small_filters, seed):
    """Random sets (with and without TTL), deletes, gets, flushes, clears and
    overfull rebuilds: whenever a page is dropped from memory, the filter in
    use holds each of its keys; and every key reads as a dict model says."""
    rng = random.Random(seed)
    clock = Clock()
    model: dict = {}
    deadline: dict = {}
    violations: list = []
    with Cache(tmp_path / "c", page_size=4, max_pages=3, max_pending_pages=6,
               flush_interval=3600, flush_batch_pages=4, clock=clock) as cache:
        tier = cache._tier
        real_drop = tier._drop

        def drop(page):
            f = cache._store_keys.filter
            if f.ready:
                violations.extend(k for k in page.keys if k is not EMPTY and ck(k) not in f)
            real_drop(page)

        tier._drop = drop

        def alive(k):
            return k in model and (deadline.get(k) is None or clock.now < deadline[k])

        keys = [f"k{i}" for i in range(700)] + list(range(300))
        for step in range(6000):
            k = rng.choice(keys)
            r = rng.random()
            if r < 0.55:
                expire = rng.choice([None, None, None, 5.0, 50.0])
                cache.set(k, step, expire=expire)
                model[k] = step
                deadline[k] = None if expire is None else clock.now + expire
            elif r < 0.7:
                assert cache.delete(k) == alive(k)
                model.pop(k, None)
            elif r < 0.9:
                assert cache.get(k) == (model[k] if alive(k) else None)
            elif r < 0.97:
                clock.now += rng.choice([0.5, 3.0])
            elif r < 0.9995:
                cache.flush()
            else:
                cache.clear()
                model.clear()
            assert not violations, violations[:5]
        cache.flush()
        push_out(cache, list(model))
        assert not violations, violations[:5]
        for k in keys:
            assert cache.get(k) == (model[k] if alive(k) else None)
