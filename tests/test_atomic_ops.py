"""add, incr/decr and touch: the atomic read-modify-writes a diskcache or
Redis user reaches for (``Cache.add``/``SET NX``, ``Cache.incr``/``INCRBY``,
``Cache.touch``/``EXPIRE``). Each is one step under the cache lock, logged like
a set, so it is atomic between threads and survives a crash."""

from __future__ import annotations

import threading
import time

import pytest

from durablekv import Cache

from .conftest import Clock, opened, run_threads


def crash(cache: Cache) -> None:
    """Stop ``cache`` as a killed process would leave it (no flush, log kept)."""
    cache._teardown(clean=False)


# -- add ----------------------------------------------------------------------------------

def test_add_stores_only_when_no_live_entry_is_there(tmp_path):
    clock = Clock(100)
    with opened(tmp_path / "c", clock=clock) as c:
        assert c.add("a", 1) is True
        assert c.add("a", 2) is False
        assert c["a"] == 1
        c.set("t", "old", expire=5)
        assert c.add("t", "new") is False
        clock.now = 105           # the deadline: the entry is gone, so add stores
        assert c.add("t", "new", expire=10) is True
        assert c["t"] == "new"
        clock.now = 114.9
        assert c["t"] == "new"
        clock.now = 115
        assert "t" not in c
        # expire=0 would be expired as stored: True would claim a key not there
        with pytest.raises(ValueError, match="add\\(\\) with expire=0"):
            c.add("z", 1, expire=0)
        assert "z" not in c and len(c) == 1
        with pytest.raises(TypeError, match="cannot store value of type builtins.object"):
            c.add("x", object())
        with pytest.raises(ValueError, match="expire"):
            c.add("x", 1, expire=-1)
        assert "x" not in c


def test_add_from_many_threads_has_exactly_one_winner(tmp_path, monkeypatch):
    # The lookup that decides "absent" sleeps a moment: an add whose check
    # and store were two steps would let every other thread in between.
    real_ref = Cache._ref

    def slow_ref(self, *args, **kwargs):
        found = real_ref(self, *args, **kwargs)
        time.sleep(0.001)
        return found
    monkeypatch.setattr(Cache, "_ref", slow_ref)
    with opened(tmp_path / "c") as c:
        for round_ in range(10):
            key = f"k{round_}"
            barrier = threading.Barrier(8)
            won: list[int] = []

            def contender(i: int) -> None:
                barrier.wait()
                if c.add(key, i):
                    won.append(i)
            run_threads(contender, 8)
            assert len(won) == 1 and c[key] == won[0], (key, won)


def test_add_on_a_key_whose_page_is_only_in_the_store(tmp_path):
    with opened(tmp_path / "c", page_size=2, max_pages=2) as c:
        for i in range(40):
            c[i] = i
        c.flush()
        assert c.stats().resident_pages == 2
        assert c.add(0, "again") is False   # found by a page fault, not in memory
        assert c[0] == 0
        assert c.add(1000, "new") is True


# -- incr / decr ----------------------------------------------------------------------------

def test_incr_counts_from_default_and_keeps_the_ttl(tmp_path):
    clock = Clock(100)
    with opened(tmp_path / "c", clock=clock) as c:
        assert c.incr("n") == 1
        assert c.incr("n", 41) == 42
        assert c.decr("n", 2) == 40
        assert c.incr("m", 5, default=10) == 15
        assert c.decr("d") == -1
        c.set("t", 7, expire=10)
        clock.now = 105
        assert c.incr("t") == 8
        clock.now = 109.9
        assert c["t"] == 8
        clock.now = 110              # the TTL set before the incr still holds
        assert "t" not in c
        assert c.incr("t") == 1      # expired: counts from default again, with no TTL
        clock.now = 10_000
        assert c["t"] == 1
        big = 1 << 100
        assert c.incr("big", big) == big   # any int, not just 64 bits
        assert c.incr("big") == big + 1


def test_incr_refuses_what_is_not_an_int_and_changes_nothing(tmp_path):
    with opened(tmp_path / "c") as c:
        c["s"] = "text"
        c["f"] = 1.5
        c["b"] = True
        for key, kind in (("s", "str"), ("f", "float"), ("b", "bool")):
            with pytest.raises(TypeError, match=f"its value is a {kind}, not an int"):
                c.incr(key)
        assert (c["s"], c["f"], c["b"]) == ("text", 1.5, True)
        with pytest.raises(KeyError):
            c.incr("missing", default=None)
        assert "missing" not in c
        for bad in (1.0, True, "1", None):
            with pytest.raises(TypeError, match="delta must be an int"):
                c.incr("n", bad)
        with pytest.raises(TypeError, match="default must be an int or None"):
            c.incr("n", 1, default=0.0)
        with pytest.raises(TypeError, match="decr\\(\\) delta must be an int"):
            c.decr("n", 0.5)
        assert "n" not in c and c.stats().sets == 3


def test_concurrent_increments_are_never_lost(tmp_path):
    with opened(tmp_path / "c", page_size=2, max_pages=2) as c:
        for i in range(20):          # evictions and page faults meanwhile
            c[f"x{i}"] = i
        barrier = threading.Barrier(4)

        def worker() -> None:
            barrier.wait()
            for _ in range(500):
                c.incr("hits")
                c.decr("left", default=2000)
        threads = [threading.Thread(target=worker) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert c["hits"] == 2000 and c["left"] == 0


# -- touch ----------------------------------------------------------------------------------

def test_touch_sets_replaces_and_removes_a_ttl(tmp_path):
    clock = Clock(100)
    with opened(tmp_path / "c", clock=clock) as c:
        assert c.touch("missing", 5) is False
        assert "missing" not in c
        c["a"] = [1, 2]
        assert c.touch("a", 10) is True
        clock.now = 109.9
        assert c["a"] == [1, 2]
        assert c.touch("a", 10) is True          # from now again
        clock.now = 119.5
        assert c["a"] == [1, 2]
        assert c.touch("a") is True              # None: no TTL any more
        clock.now = 1e6
        assert c["a"] == [1, 2]
        assert c.touch("a", 0) is True           # 0: gone, as set(expire=0)
        assert "a" not in c and len(c) == 0
        c.set("e", 1, expire=1)
        clock.now += 1
        assert c.touch("e", 100) is False        # expired entries are not revived
        with pytest.raises(ValueError, match="expire"):
            c.touch("e", float("nan"))


def test_touch_keeps_the_entrys_own_key_object(tmp_path):
    with opened(tmp_path / "c") as c:
        c[1] = "one"
        assert c.touch(1.0, 30) is True
        (key,) = list(c)
        assert type(key) is int and c[1] == "one"
    with opened(tmp_path / "c") as c:
        (key,) = list(c)
        assert type(key) is int


# -- durability ------------------------------------------------------------------------------

@pytest.mark.parametrize("durability", ["log", "fsync"])
def test_every_atomic_op_is_recovered_after_a_crash(tmp_path, durability):
    clock = Clock(100)
    c = Cache(tmp_path / "c", clock=clock, durability=durability, flush_interval=3600,
              flush_batch_pages=1_000_000)
    c["counter"] = 10
    c.incr("counter", 5)
    c.decr("gone", default=3)
    c.add("added", {"x": 1})
    c.add("added", "loses")
    c["ttl"] = b"v"
    c.touch("ttl", 50)
    c["persist"] = "p"
    c.touch("persist", 50)
    c.touch("persist", None)
    c["dropped"] = 1
    c.touch("dropped", 0)
    crash(c)
    with opened(tmp_path / "c", clock=clock) as c:
        assert c.stats().recovered_records > 0
        assert dict(c.items()) == {"counter": 15, "gone": 2, "added": {"x": 1}, "ttl": b"v",
                                   "persist": "p"}
        clock.now = 150
        assert dict(c.items()) == {"counter": 15, "gone": 2, "added": {"x": 1}, "persist": "p"}


def test_atomic_ops_on_a_closed_cache_raise(tmp_path):
    from durablekv import CacheClosedError
    c = Cache(tmp_path / "c")
    c.close()
    for call in (lambda: c.add("a", 1), lambda: c.incr("a"), lambda: c.decr("a"),
                 lambda: c.touch("a", 1)):
        with pytest.raises(CacheClosedError):
            call()


def test_atomic_ops_on_a_failed_cache_raise(tmp_path, monkeypatch):
    import errno

    from durablekv import CacheFailedError, LogWriteError
    from durablekv.log.replaylog import ReplayLog
    c = Cache(tmp_path / "c", durability="fsync", flush_interval=3600)
    c["a"] = 1

    def bad_fsync(self, fd):
        raise OSError(errno.EIO, "Input/output error")
    monkeypatch.setattr(ReplayLog, "_fsync", bad_fsync)
    with pytest.raises(LogWriteError):
        c.incr("n")
    for call in (lambda: c.add("b", 1), lambda: c.incr("a"), lambda: c.decr("a"),
                 lambda: c.touch("a", 1)):
        with pytest.raises(CacheFailedError):
            call()
    monkeypatch.undo()
    c.close()


def test_in_fsync_mode_each_op_returns_only_once_its_record_is_fsynced(tmp_path):
    c = Cache(tmp_path / "c", durability="fsync", flush_interval=3600)
    synced: list[int] = []
    real = c._log.sync_to

    def spy(lsn: int) -> None:
        real(lsn)
        synced.append(lsn)
    c._log.sync_to = spy
    try:
        c["t"] = 1
        for op in (lambda: c.add("a", 1), lambda: c.incr("n"), lambda: c.decr("n"),
                   lambda: c.touch("t", 5), lambda: c.touch("t", 0)):
            before = c._last_lsn
            op()
            assert c._last_lsn == before + 1           # one record each ...
            assert synced and synced[-1] == c._last_lsn  # ... fsynced before it returned
        n = len(synced)
        assert c.add("a", 2) is False and c.touch("nope", 1) is False
        assert len(synced) == n                        # nothing written, nothing to wait for
    finally:
        c.close()


def test_a_bad_key_is_a_type_error_even_when_a_lookup_would_not_tell(tmp_path):
    """After a miss on an equal key, or while a clear is pending, a lookup
    answers without looking at the key; writes still check it. A lookup with
    an IntEnum key is a dict lookup: it misses here, as for 1 and (1,)
    (tests/test_cache_api.py::test_an_intenum_key_...)."""
    import enum

    class Color(enum.IntEnum):
        RED = 1

    with opened(tmp_path / "c") as c:
        for setup in (lambda: c.get(1), lambda: c.get((1,)), c.clear):
            setup()
            for call in (lambda: c.touch(Color.RED, 5), lambda: c.incr(Color.RED),
                         lambda: c.decr(Color.RED), lambda: c.add(Color.RED, 1)):
                with pytest.raises(TypeError, match="unsupported key type"):
                    call()
            assert c.get((Color.RED,)) is None and Color.RED not in c
        assert len(c) == 0


def test_stats_count_each_write_as_documented(tmp_path):
    """stats().sets counts every acknowledged write of a value (set, add that
    stored, incr, decr, touch); deletes counts entries removed, touch(key, 0)
    included. An add that stored nothing and a touch of a missing key count
    nowhere."""
    with opened(tmp_path / "c") as c:
        c["a"] = 1
        assert c.add("b", 2) and not c.add("b", 3)
        c.incr("n")
        c.decr("n")
        assert c.touch("a", 60) and not c.touch("missing", 60)
        st = c.stats()
        assert (st.sets, st.deletes) == (5, 0)
        assert c.touch("a", 0)
        assert c.pop("b") == 2
        assert c.delete("n") and not c.delete("n")
        st = c.stats()
        assert (st.sets, st.deletes) == (5, 3)
