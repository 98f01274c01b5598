"""The public Cache API behaves as a dict (DESIGN "Public API"), in every tier.

Each mapping test runs against three shapes of memory tier:

* ``roomy``: the default page size and plenty of pages (everything resident);
* ``tiny``: ``page_size=4, max_pages=2`` so pages are evicted, written behind
  and faulted back while the test runs;
* ``lru1``: ``page_size=1, max_pages=3`` (an exact entry LRU of 3 entries);

and most of them also across ``close()`` + reopen. A hypothesis state machine
checks the whole mapping API against a plain dict across flush/close/reopen.

Time is never slept on: the flush interval is long and ``flush()`` drives the
write-behind batcher.
"""

from __future__ import annotations

import dataclasses
import errno
import gc
import os
import subprocess
import sys
import tempfile
import textwrap
import threading

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

import durablekv
from durablekv import Cache, CacheStats
from durablekv.errors import (CacheClosedError, CacheLockedError, ConfigError, DurableKVError)
from durablekv.tier.pages import EMPTY
from durablekv.sharded import ShardedCache
from .conftest import Clock, open_cache, opened, reseal_pages, run_threads

SHAPES = {
    "roomy": dict(),
    "tiny": dict(page_size=4, max_pages=2),
    "lru1": dict(page_size=1, max_pages=3),
    # W-TinyLFU instead of LRU: the API holds whatever the victim choice
    "tinylfu": dict(page_size=4, max_pages=3, policy="tinylfu"),
}


@pytest.fixture(params=sorted(SHAPES))
def shape(request):
    return SHAPES[request.param]


@pytest.fixture
def cache(tmp_path, shape):
    c = open_cache(tmp_path / "c", **shape)
    yield c
    c.close()


def reopen(c: Cache, **kw) -> Cache:
    """Close ``c`` and open its directory again with the same shape (and kind:
    ``test_sharded`` runs these tests on a ShardedCache)."""
    c.close()
    # warm=False: what was resident comes back through the store's paths
    # (key index, page faults), which these tests exercise; test_warm.py
    # tests the warm restart
    shape = dict(page_size=c.page_size, max_pages=c.max_pages, warm=False)
    shape.update(kw)
    if isinstance(c, ShardedCache):
        return ShardedCache(c.path, shards=c.shard_count, flush_interval=30.0, **shape)
    return open_cache(c.path, **shape)


# -- single operations ---------------------------------------------------------------


def test_getitem_missing_raises_keyerror_with_the_key(cache):
    with pytest.raises(KeyError) as info:
        cache["nope"]
    assert info.value.args == ("nope",)
    cache["k"] = "v"
    assert cache["k"] == "v"


def test_get_returns_default_only_when_missing(cache):
    assert cache.get("x") is None
    assert cache.get("x", 42) == 42
    cache.set("x", 0)
    assert cache.get("x", 42) == 0
    cache.set("f", False)
    assert cache.get("f", "D") is False


def test_set_and_setitem_overwrite_without_growing(cache):
    cache.set("a", 1)
    cache["a"] = 2
    cache.set("a", 3)
    assert cache["a"] == 3
    assert len(cache) == 1
    assert list(cache) == ["a"]


def test_delete_returns_bool_and_del_raises_when_missing(cache):
    cache["a"] = 1
    assert cache.delete("a") is True
    assert cache.delete("a") is False
    assert "a" not in cache
    cache["b"] = 2
    del cache["b"]
    with pytest.raises(KeyError):
        del cache["b"]
    assert len(cache) == 0


def test_pop_with_and_without_default(cache):
    cache["a"] = [1, 2]
    assert cache.pop("a") == [1, 2]
    assert "a" not in cache
    with pytest.raises(KeyError):
        cache.pop("a")
    assert cache.pop("a", "D") == "D"
    assert cache.pop("a", None) is None
    assert len(cache) == 0


def test_popitem_until_empty_then_keyerror(cache):
    model = {f"k{i}": i for i in range(13)}
    cache.update(model)
    popped = {}
    for _ in range(len(model)):
        k, v = cache.popitem()
        assert k not in popped
        popped[k] = v
    assert popped == model
    assert len(cache) == 0
    with pytest.raises(KeyError):
        cache.popitem()


def test_popitem_after_reopen_finds_keys_only_in_the_store(cache):
    model = {i: str(i) for i in range(10)}
    cache.update(model)
    c2 = reopen(cache)
    try:
        popped = dict(c2.popitem() for _ in range(10))
        assert popped == model
        with pytest.raises(KeyError):
            c2.popitem()
        c3 = reopen(c2)
        assert len(c3) == 0 and list(c3) == []
        c3.close()
    finally:
        c2.close()


def test_setdefault(cache):
    assert cache.setdefault("a", 1) == 1
    assert cache.setdefault("a", 2) == 1
    assert cache["a"] == 1
    assert cache.setdefault("n") is None
    assert "n" in cache and cache["n"] is None


def test_update_from_mapping_pairs_and_kwargs(cache):
    cache.update({"a": 1, "b": 2})
    cache.update([("c", 3), ("a", 10)])
    cache.update(d=4)
    assert dict(cache.items()) == {"a": 10, "b": 2, "c": 3, "d": 4}


def test_clear_then_restart_is_empty(cache):
    cache.update({i: i for i in range(20)})
    cache.flush()
    cache.clear()
    assert len(cache) == 0 and list(cache) == [] and cache.get(3) is None
    c2 = reopen(cache)
    try:
        assert len(c2) == 0
        assert list(c2) == []
        assert all(c2.get(i) is None for i in range(20))
    finally:
        c2.close()


def test_clear_then_new_sets_survive_restart(cache):
    cache.update({i: i for i in range(20)})
    cache.flush()
    cache.clear()
    cache.update({i: -i for i in range(5, 9)})
    c2 = reopen(cache)
    try:
        assert dict(c2.items()) == {i: -i for i in range(5, 9)}
        assert len(c2) == 4
    finally:
        c2.close()


def test_clear_without_flush_then_restart(cache):
    cache.update({i: i for i in range(20)})
    cache.flush()
    cache.clear()
    cache["after"] = 1
    # the clear and the set only reached the replay log before close flushes
    c2 = reopen(cache)
    try:
        assert dict(c2.items()) == {"after": 1}
    finally:
        c2.close()


def test_views_len_in_and_equality(cache):
    model = {"a": 1, 2: "two", (3, "x"): [3], b"b": None}
    cache.update(model)
    assert len(cache) == 4
    assert set(cache.keys()) == set(model)
    assert sorted(map(repr, cache.values())) == sorted(map(repr, model.values()))
    assert dict(cache.items()) == model
    assert cache == model
    assert cache != {**model, "a": 2}
    assert cache != {"a": 1}
    assert "a" in cache and "zz" not in cache
    assert ("a", 1) in cache.items() and ("a", 2) not in cache.items()
    assert 2 in cache.keys() and [3] in cache.values()
    assert len(cache.keys()) == len(cache.items()) == len(cache.values()) == 4


@pytest.mark.parametrize("restart", [False, True], ids=["live", "restart"])
def test_iteration_is_a_snapshot_under_writes(cache, restart):
    keys = [f"k{i}" for i in range(25)]
    for k in keys:
        cache[k] = 0
    if restart:
        cache = reopen(cache)
    seen = []
    deleted: set = set()
    for i, k in enumerate(cache):
        seen.append(k)
        # delete a key not yet yielded, add new keys, overwrite one
        if i < 10:
            cache.delete(keys[-1 - i])
            deleted.add(keys[-1 - i])
        cache[f"new{i}"] = i
        cache[keys[0]] = i
        # a key deleted during the loop is never yielded after its deletion
        assert k not in deleted or k == keys[-1 - i]
    assert set(seen) == set(keys) - deleted | (set(seen) & deleted)
    assert not set(seen) & {f"new{i}" for i in range(25)}
    assert len(seen) == len(set(seen))
    if restart:
        cache.close()


def test_mapping_ops_on_keys_only_in_the_store(tmp_path, shape):
    c = open_cache(tmp_path / "c", **shape)
    c.update({i: str(i) for i in range(30)})
    c = reopen(c)
    try:
        assert c.stats().resident_pages == 0
        assert c[0] == "0" and c.get(1) == "1" and c.get(99, "D") == "D"
        with pytest.raises(KeyError):
            c[99]
        assert 2 in c and 99 not in c
        assert c.delete(3) is True and c.delete(3) is False
        del c[4]
        with pytest.raises(KeyError):
            del c[4]
        assert c.pop(5) == "5" and c.pop(5, "D") == "D"
        assert c.setdefault(6, "x") == "6" and c.setdefault(60, "x") == "x"
        c.update({7: "seven", 70: "seventy"})
        model = {i: str(i) for i in range(30) if i not in (3, 4, 5)}
        model.update({60: "x", 7: "seven", 70: "seventy"})
        assert c == model and len(c) == len(model)
        assert set(c.keys()) == set(model) and sorted(c.values()) == sorted(model.values())
        c = reopen(c)
        assert dict(c.items()) == model
        assert c.stats().resident_pages <= c.max_pages
    finally:
        c.close()


def test_items_and_values_skip_keys_deleted_meanwhile(cache):
    cache.update({i: i * 10 for i in range(12)})
    out = []
    for k, v in cache.items():
        out.append((k, v))
        cache.delete((k + 1) % 12)
    assert len(out) == len({k for k, _ in out})
    assert all(v == k * 10 for k, v in out)
    assert len(out) < 12


@pytest.mark.parametrize("restart", [False, True], ids=["live", "restart"])
def test_many_keys_match_a_dict(tmp_path, shape, restart):
    c = open_cache(tmp_path / "c", **shape)
    model = {}
    for i in range(60):
        c[i] = {"n": i}
        model[i] = {"n": i}
    for i in range(0, 60, 3):
        assert c.delete(i)
        del model[i]
    for i in range(0, 60, 7):
        c[i] = (i, "again")
        model[i] = (i, "again")
    if restart:
        c = reopen(c)
    try:
        assert len(c) == len(model)
        assert c == model
        assert sorted(c) == sorted(model)
        for k, v in model.items():
            assert c[k] == v
        for k in range(60):
            assert (k in c) == (k in model)
        st_ = c.stats()
        assert st_.resident_pages <= c.max_pages
    finally:
        c.close()


# -- keys: equality exactly as a dict -----------------------------------------------

EQUAL_KEY_GROUPS = [
    (1, 1.0, True),
    (0, 0.0, -0.0, False),
    ((1, "a"), (1.0, "a"), (True, "a")),
    ((0, (2, b"z")), (-0.0, (2.0, b"z"))),
    (2**70, float(2**70)),
]


def spill(c: Cache) -> None:
    """Push every page of a ``page_size=1, max_pages=1`` cache out to SQLite."""
    assert c.page_size == 1 and c.max_pages == 1
    c.set("__spill__", 0)
    c.delete("__spill__")
    c.flush()
    assert c.stats().pending_pages == 0


@pytest.mark.parametrize("where", ["memory", "spill", "restart"])
def test_equal_keys_are_one_key_and_the_first_stored_key_is_kept(tmp_path, where):
    kw = dict(page_size=1, max_pages=1) if where == "spill" else {}
    c = open_cache(tmp_path / "c", **kw)
    try:
        for group in EQUAL_KEY_GROUPS:
            c.set(group[0], repr(group[0]))
        if where == "spill":
            spill(c)
        elif where == "restart":
            c = reopen(c)
        before = c.stats()
        for group in EQUAL_KEY_GROUPS:
            for k in group:
                assert c.get(k) == repr(group[0]), (k, where)
                assert k in c
        if where == "spill":
            assert c.stats().store_hits > before.store_hits
        assert len(c) == len(EQUAL_KEY_GROUPS)
        # dict semantics: an overwrite through an equal key keeps the first key
        for group in EQUAL_KEY_GROUPS:
            c.set(group[-1], "over")
        if where == "spill":
            spill(c)
        elif where == "restart":
            c = reopen(c)
        keys = list(c)
        expect = [g[0] for g in EQUAL_KEY_GROUPS]
        assert sorted(map(repr, keys)) == sorted(map(repr, expect))
        for got in keys:
            want = next(g[0] for g in EQUAL_KEY_GROUPS if g[0] == got)
            assert repr(got) == repr(want)
            assert type(got) is type(want)
        assert all(c[g[1]] == "over" for g in EQUAL_KEY_GROUPS)
        # and a delete through an equal key removes it
        for group in EQUAL_KEY_GROUPS:
            assert c.delete(group[-1]) is True
        assert len(c) == 0
    finally:
        c.close()


@pytest.mark.parametrize("where", ["memory", "spill", "restart"])
def test_unequal_keys_stay_apart(tmp_path, where):
    kw = dict(page_size=1, max_pages=1) if where == "spill" else {}
    c = open_cache(tmp_path / "c", **kw)
    nfc, nfd = "\u00e9", "e\u0301"
    keys = ["1", 1, b"x", "x", "\U0001F439", nfc, nfd, (1,), ((1,),), "", b"", None, 0.5,
            "\ud800", (None, None), -1, 2**64 + 1, float(2**64)]
    try:
        for i, k in enumerate(keys):
            c[k] = i
        if where == "spill":
            spill(c)
        elif where == "restart":
            c = reopen(c)
        assert len(c) == len(keys)
        for i, k in enumerate(keys):
            assert c[k] == i, k
        got = list(c.keys())
        assert sorted(map(repr, got)) == sorted(map(repr, keys))
        by_repr = {repr(k): k for k in got}
        for k in keys:
            assert type(by_repr[repr(k)]) is type(k)
    finally:
        c.close()


def test_nan_key_is_a_valueerror(cache):
    nan = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        cache.set(nan, 1)
    with pytest.raises(ValueError):
        cache.set((1, nan), 1)
    with pytest.raises(ValueError):
        cache.get(nan)
    with pytest.raises(ValueError):
        cache.delete(nan)
    assert len(cache) == 0 and cache.stats().sets == 0


@pytest.mark.parametrize("bad", [[1], {"a": 1}, {1}, object(), frozenset(), (1, [2])],
                         ids=["list", "dict", "set", "object", "frozenset", "tuple-with-list"])
def test_unsupported_key_type_is_a_typeerror_naming_the_type(cache, bad):
    inner = bad[1] if isinstance(bad, tuple) else bad
    name = type(inner).__name__
    with pytest.raises(TypeError, match=name):
        cache.set(bad, 1)
    with pytest.raises(TypeError, match=name):
        cache[bad] = 1
    with pytest.raises(TypeError):
        cache.get(bad)
    with pytest.raises(TypeError):
        cache.delete(bad)
    with pytest.raises(TypeError):
        bad in cache  # noqa: B015
    assert len(cache) == 0 and cache.stats().sets == 0


def test_key_subclasses_are_refused(cache):
    import enum

    class Color(enum.IntEnum):
        RED = 1

    class S(str):
        pass

    with pytest.raises(TypeError, match="Color"):
        cache.set(Color.RED, 1)
    with pytest.raises(TypeError, match=r"<locals>\.S\b"):
        cache.set(S("a"), 1)


# -- errors and lifecycle ------------------------------------------------------------


def test_use_after_close_raises_cacheclosederror(tmp_path):
    c = open_cache(tmp_path / "c")
    c["a"] = 1
    c.close()
    c.close()  # idempotent
    assert c.closed
    ops = [lambda: c.get("a"), lambda: c["a"], lambda: c.set("a", 2), lambda: c.delete("a"),
           lambda: len(c), lambda: iter(c), lambda: list(c.keys()), lambda: c.flush(),
           lambda: "a" in c, lambda: c.pop("a"), lambda: c.clear(), lambda: c.popitem()]
    for op in ops:
        with pytest.raises(CacheClosedError) as info:
            op()
        assert isinstance(info.value, ValueError)
        assert isinstance(info.value, DurableKVError)
        assert str(tmp_path / "c") in str(info.value)
    with open_cache(tmp_path / "c") as c2:
        assert c2["a"] == 1


def test_with_block_closes(tmp_path):
    with open_cache(tmp_path / "c") as c:
        c["a"] = 1
    assert c.closed
    with pytest.raises(CacheClosedError):
        c.get("a")


def test_second_open_in_same_process_is_locked_with_pid(tmp_path):
    c = open_cache(tmp_path / "c")
    try:
        with pytest.raises(CacheLockedError) as info:
            open_cache(tmp_path / "c")
        assert info.value.pid == os.getpid()
        assert str(os.getpid()) in str(info.value)
        assert "this process" in str(info.value) and "close()" in str(info.value)
        c["still"] = "works"
        assert c["still"] == "works"
    finally:
        c.close()
    with open_cache(tmp_path / "c") as c2:  # released by close()
        assert c2["still"] == "works"


def test_a_dropped_cache_keeps_the_directory_and_the_error_says_why(tmp_path):
    c = open_cache(tmp_path / "c")
    c["a"] = 1
    batcher = c._batcher  # (only to close it at the end: it keeps the cache)
    del c
    gc.collect()
    with pytest.raises(CacheLockedError, match="was not closed"):
        open_cache(tmp_path / "c")
    batcher._source._cache.close()
    with opened(tmp_path / "c") as c:
        assert c["a"] == 1


def test_second_open_from_another_process_is_locked_with_pid(tmp_path):
    d = tmp_path / "c"
    with open_cache(d) as c:
        c["a"] = 1
        code = textwrap.dedent(f"""
            import sys
            from durablekv import Cache, CacheLockedError
            try:
                Cache({str(d)!r})
            except CacheLockedError as exc:
                print("LOCKED", exc.pid)
                print(exc)
                sys.exit(0)
            sys.exit(3)
        """)
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             timeout=30)
        assert out.returncode == 0, out.stderr
        first, msg = out.stdout.split("\n", 1)
        assert first == f"LOCKED {os.getpid()}"
        assert str(os.getpid()) in msg and str(d) in msg


@pytest.mark.parametrize("kw", [dict(page_size=0), dict(max_pages=-1), dict(max_pages=0),
                                dict(durability="sometimes"), dict(flush_interval=0),
                                dict(flush_interval=float("nan")), dict(on_corruption="x"),
                                dict(page_size=1.5), dict(max_value_bytes=0),
                                dict(serializer="yaml"), dict(segment_bytes="abc"),
                                dict(segment_bytes=None), dict(segment_bytes=0),
                                dict(segment_bytes=100),
                                # a truthy 'no' must not give up log records
                                dict(salvage_log="yes"), dict(salvage_log="no"),
                                dict(salvage_log=1), dict(salvage_log=None)],
                         ids=lambda kw: ",".join(f"{k}={v!r}" for k, v in kw.items()))
def test_bad_config_is_a_configerror(tmp_path, kw):
    with pytest.raises(ConfigError) as info:
        Cache(tmp_path / "c", **kw)
    assert isinstance(info.value, ValueError)
    (value,) = kw.values()
    assert repr(value) in str(info.value)
    # nothing left locked
    with open_cache(tmp_path / "c") as c:
        c["ok"] = 1


def test_the_smallest_segment_bytes_is_accepted_and_rolls_segments(tmp_path):
    """README: ``segment_bytes`` is at least 1024 (below, ConfigError above)."""
    from durablekv.config import MIN_SEGMENT_BYTES
    from durablekv.log.segments import list_segments
    assert MIN_SEGMENT_BYTES == 1024
    with open_cache(tmp_path / "c", segment_bytes=1024) as c:
        for i in range(100):
            c[f"k{i}"] = b"v" * 100
        assert len(list_segments(str(tmp_path / "c"))) > 5
    with pytest.raises(ConfigError, match="segment_bytes must be an integer >= 1024, got 1023"):
        Cache(tmp_path / "d", segment_bytes=1023)


def test_page_size_is_fixed_at_creation(tmp_path):
    with open_cache(tmp_path / "c", page_size=4) as c:
        c.update({i: i for i in range(10)})
    with pytest.raises(ConfigError, match="page_size=4"):
        open_cache(tmp_path / "c", page_size=8)
    with open_cache(tmp_path / "c") as c:
        assert c.page_size == 4
        assert c.stats().page_size == 4
        assert dict(c.items()) == {i: i for i in range(10)}
    with open_cache(tmp_path / "c", page_size=4) as c:
        assert len(c) == 10


def test_serializer_is_fixed_at_creation_and_never_adopted(tmp_path):
    """Unlike page_size, a reopen does not adopt the stored serializer: a
    pickle store opened without serializer="pickle" (or a safe store opened
    with it) is a ConfigError, so a store never silently starts unpickling."""
    with open_cache(tmp_path / "p", serializer="pickle") as c:
        c["k"] = {1, 2}
    with pytest.raises(ConfigError, match="pickle"):
        open_cache(tmp_path / "p")
    with open_cache(tmp_path / "p", serializer="pickle") as c:
        assert c["k"] == {1, 2}
    with open_cache(tmp_path / "s") as c:
        c["k"] = 1
    with pytest.raises(ConfigError):
        open_cache(tmp_path / "s", serializer="pickle")


@pytest.mark.parametrize("flush_batch_pages, pending", [(64, 256), (8, 64), (100, 400)])
def test_max_pending_pages_defaults_to_four_batches_and_at_least_64(tmp_path, flush_batch_pages,
                                                                    pending):
    with open_cache(tmp_path / "c", flush_batch_pages=flush_batch_pages) as c:
        assert c.max_pending_pages == pending


def test_memoize_names_by_qualname_so_two_lambdas_need_their_own_name(tmp_path):
    """As the README warns: without name=, two lambdas share one name and
    so one set of results; name= keeps them apart."""
    with open_cache(tmp_path / "c") as c:
        plus1 = c.memoize()(lambda x: x + 1)
        plus100 = c.memoize()(lambda x: x + 100)
        assert plus1(1) == 2 and plus100(1) == 2   # the shared, wrong, result
        c.clear()
        plus1 = c.memoize(name="plus1")(lambda x: x + 1)
        plus100 = c.memoize(name="plus100")(lambda x: x + 100)
        assert plus1(1) == 2 and plus100(1) == 101


# -- stats ---------------------------------------------------------------------------


def test_stats_has_every_documented_field(tmp_path):
    with open_cache(tmp_path / "c") as c:
        s = c.stats()
    assert isinstance(s, CacheStats)
    names = {f.name for f in dataclasses.fields(s)}
    documented = {"hits", "memory_hits", "store_hits", "misses", "sets", "deletes", "evictions",
                  "page_faults", "expirations", "flushes", "flushed_pages", "pending_pages",
                  "resident_pages", "log_bytes", "recovered_records", "recovery_seconds"}
    assert documented <= names


def test_stats_move_as_expected(tmp_path):
    c = open_cache(tmp_path / "c", page_size=1, max_pages=2, flush_batch_pages=1000)
    try:
        s0 = c.stats()
        assert (s0.hits, s0.misses, s0.sets, s0.deletes, s0.evictions) == (0, 0, 0, 0, 0)
        c["a"] = 1
        c["b"] = 2
        assert c.get("a") == 1                      # memory hit
        assert c.get("zz") is None                  # miss
        s = c.stats()
        assert (s.memory_hits, s.store_hits, s.misses, s.sets) == (1, 0, 1, 2)
        assert s.resident_pages == 2 and s.evictions == 0
        assert s.log_bytes > 0
        c["c"] = 3                                   # evicts b's page (LRU)
        s = c.stats()
        assert s.evictions == 1 and s.resident_pages == 2
        assert s.pending_pages + s.flushed_pages >= 1  # b was dirty: queued or written
        c.flush()
        s = c.stats()
        assert s.pending_pages == 0 and s.flushes >= 1 and s.flushed_pages >= 1
        assert s.checkpoint_lsn == s.last_lsn == 3
        faults = s.page_faults
        assert c.get("b") == 2                       # page evicted: a store hit
        s = c.stats()
        assert (s.memory_hits, s.store_hits) == (1, 1)
        assert s.page_faults == faults + 1
        assert s.hits == s.memory_hits + s.store_hits == 2
        assert c.delete("a") and not c.delete("a")
        assert c.stats().deletes == 1
        c.flush()
        flushes = c.stats().flushes
        c.flush()  # nothing new: no transaction
        assert c.stats().flushes == flushes
        c["d"] = 4
        c.flush()
        assert c.stats().flushes == flushes + 1
        assert c.stats().resident_pages <= 2
    finally:
        c.close()
    with open_cache(tmp_path / "c") as c2:
        s = c2.stats()
        assert s.recovered_records == 0 and s.recovery_seconds >= 0
        assert (s.hits, s.misses, s.sets) == (0, 0, 0)


def test_recovered_records_counted_when_log_is_replayed(tmp_path):
    d = tmp_path / "c"
    code = textwrap.dedent(f"""
        import os
        from durablekv import Cache
        c = Cache({str(d)!r}, flush_interval=30)
        for i in range(5):
            c[i] = i
        os._exit(0)   # no close(): the log holds the writes
    """)
    subprocess.run([sys.executable, "-c", code], check=True, timeout=30)
    with open_cache(d) as c:
        assert c.stats().recovered_records == 5
        assert dict(c.items()) == {i: i for i in range(5)}


def test_store_hit_never_counts_as_memory_hit(tmp_path):
    with open_cache(tmp_path / "c", page_size=2, max_pages=2) as c:
        for i in range(20):
            c[i] = i
        c.flush()
        for i in range(20):
            before = c.stats()
            resident = c.stats().resident_pages
            assert c[i] == i
            after = c.stats()
            assert after.hits == before.hits + 1
            assert after.memory_hits + after.store_hits == after.hits
            if after.store_hits == before.store_hits + 1:
                assert after.page_faults == before.page_faults + 1
            assert after.resident_pages <= 2 and resident <= 2


def test_coalescing_many_sets_few_page_writes(tmp_path):
    with open_cache(tmp_path / "c", flush_interval=0.05) as c:
        for i in range(10_000):
            c[f"hot{i % 10}"] = i
        c.flush()
        s = c.stats()
        assert s.sets == 10_000
        assert s.flushed_pages <= 50, s
        assert s.pending_pages == 0
    with open_cache(tmp_path / "c") as c:
        assert dict(c.items()) == {f"hot{j}": 9990 + j for j in range(10)}


def test_public_surface_is_pinned():
    assert durablekv.__all__ == [
        "Cache", "ShardedCache", "CacheStats", "Acceleration", "accelerated",
        "DurableKVError", "CacheLockedError",
        "NamespaceLockedError", "CacheClosedError", "CacheNotOpenError",
        "CacheFailedError", "ConfigError", "StoreError", "CorruptStoreError",
        "SchemaVersionError", "HeldKeyError", "LogError", "LogCorruptionError", "LogFileGoneError",
        "LogWriteError", "WriteBehindError", "FlushTimeoutError", "TraceFormatError",
        "MetricsServeError", "RemoteError", "RemoteAuthError", "RemoteValueError",
        "RemoteTypeError", "ServerUnavailableError", "__version__"]


def test_every_error_class_a_docstring_names_is_importable_from_durablekv():
    """Docstrings say ``:raises LogError:``; ``from durablekv import LogError``
    failed. Every class of the exception tree, and every durablekv error a
    public docstring names, comes from the package itself."""
    import pkgutil
    import re
    from pathlib import Path

    import durablekv.errors as errors

    assert set(errors.__all__) <= set(durablekv.__all__)
    named = set()
    root = Path(durablekv.__file__).parent
    for info in pkgutil.iter_modules(durablekv.__path__):
        files = sorted((root / info.name).glob("*.py")) if info.ispkg \
            else [root / f"{info.name}.py"]
        files = [f for f in files if f.exists()]  # (the C extension has no source here)
        for path in files:
            text = path.read_text(encoding="utf-8")
            named.update(n for n in re.findall(r"\b([A-Z][A-Za-z]*Error)\b", text)
                         if hasattr(errors, n))
    assert "LogError" in named
    for name in sorted(named):
        assert getattr(durablekv, name) is getattr(errors, name), name
        assert name in durablekv.__all__, name


def test_threads_share_one_cache(tmp_path):
    with open_cache(tmp_path / "c", page_size=2, max_pages=3) as c:
        errors = []

        def work(t):
            try:
                for i in range(300):
                    c[(t, i % 17)] = i
                    c.get((t, (i * 7) % 17))
                    if i % 5 == 0:
                        c.delete((t, (i * 3) % 17))
            except BaseException as exc:  # noqa: BLE001
                errors.append(exc)

        run_threads(work, 6)
        assert errors == []
        assert len(c) == len(list(c))
        assert c.stats().resident_pages <= 3


def test_concurrent_popitem_pops_each_key_once_and_empties_the_cache(tmp_path):
    with open_cache(tmp_path / "c", page_size=2, max_pages=2) as c:
        model = {i: -i for i in range(400)}
        c.update(model)
        popped = [[] for _ in range(8)]
        errors = []

        def work(t):
            try:
                while True:
                    try:
                        popped[t].append(c.popitem())
                    except KeyError:
                        return
            except BaseException as exc:  # noqa: BLE001
                errors.append(exc)

        threads = [threading.Thread(target=work, args=(t,)) for t in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert errors == []
        pairs = [p for ps in popped for p in ps]
        # a KeyError means "empty", never "another thread took my key"
        assert len(c) == 0
        assert len(pairs) == len(model) and dict(pairs) == model


# -- the whole mapping API against a dict (hypothesis state machine) -------------------

KEYS = st.sampled_from([0, 1, 1.0, True, 2, "a", "b", b"a", (1, "a"), (1.0, "a"), -0.0, "é",
                        None, 3, 4, 5, 6])
VALUES = st.one_of(st.none(), st.integers(), st.floats(allow_nan=False), st.text(max_size=5),
                   st.binary(max_size=5), st.lists(st.integers(), max_size=3),
                   st.tuples(st.integers(), st.text(max_size=2)))


class CacheVsDict(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.tmp = tempfile.TemporaryDirectory()
        self.path = os.path.join(self.tmp.name, "c")
        self.cache = self.open(page_size=2, max_pages=2, flush_batch_pages=3)
        self.model: dict = {}

    def open(self, **kw):
        return open_cache(self.path, **kw)

    @rule(k=KEYS, v=VALUES)
    def set(self, k, v):
        self.cache[k] = v
        self.model[k] = v

    @rule(k=KEYS)
    def get(self, k):
        assert self.cache.get(k, "MISSING") == self.model.get(k, "MISSING")

    @rule(k=KEYS)
    def delete(self, k):
        assert self.cache.delete(k) == (k in self.model)
        self.model.pop(k, None)

    @rule(k=KEYS)
    def pop(self, k):
        assert self.cache.pop(k, "MISSING") == self.model.pop(k, "MISSING")

    @rule()
    def popitem(self):
        if not self.model:
            with pytest.raises(KeyError):
                self.cache.popitem()
            return
        k, v = self.cache.popitem()
        assert self.model.pop(k) == v

    @rule(k=KEYS, v=VALUES)
    def setdefault(self, k, v):
        assert self.cache.setdefault(k, v) == self.model.setdefault(k, v)

    @rule()
    def clear(self):
        self.cache.clear()
        self.model.clear()

    @rule()
    def flush(self):
        self.cache.flush()

    @rule()
    def reopen(self):
        self.cache.close()
        self.cache = self.open(max_pages=2, flush_batch_pages=3)

    @invariant()
    def agrees(self):
        assert len(self.cache) == len(self.model)
        keys = list(self.cache)
        assert len(keys) == len(self.model)
        for k in keys:
            assert k in self.model
        # the first-stored key object is the one listed
        assert sorted(map(repr, keys)) == sorted(map(repr, self.model))
        assert self.cache.stats().resident_pages <= 2 * getattr(self.cache, "shard_count", 1)

    def teardown(self):
        try:
            self.cache.close()
        finally:
            self.tmp.cleanup()


CacheVsDict.TestCase.settings = settings(max_examples=40, stateful_step_count=30, deadline=None,
                                         suppress_health_check=[HealthCheck.too_slow])
TestCacheVsDict = CacheVsDict.TestCase


@pytest.mark.parametrize("directory", [5, b"var/cache", ["var", "cache"]])  # None: a temporary one
def test_a_directory_that_is_not_a_path_is_a_type_error_naming_it(directory):
    with pytest.raises(TypeError, match=r"must be a path \(str or os.PathLike\), not "
                                        + type(directory).__name__ + r" .*Cache\('var/cache'\)"):
        Cache(directory)


def test_paths_that_cannot_be_a_cache_directory_are_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="empty path"):
        Cache("")
    (tmp_path / "afile").write_text("x")
    with pytest.raises(ConfigError, match="is a file, not a directory"):
        Cache(tmp_path / "afile")


@pytest.mark.parametrize("below", ["sub", "sub/deeper"])
def test_a_file_among_the_parents_is_named_as_a_file(tmp_path, below):
    """``Cache("afile/sub")`` said "Not a directory; create it yourself":
    the fix is to move the file, and the message names it."""
    (tmp_path / "afile").write_text("x")
    with pytest.raises(ConfigError) as info:
        Cache(tmp_path / "afile" / below)
    msg = str(info.value)
    assert f"{str(tmp_path / 'afile')!r} is a file, not a directory" in msg, msg
    assert "create it yourself" not in msg
    assert (tmp_path / "afile").read_text() == "x"


@pytest.mark.parametrize("as_path", [False, True], ids=["str", "Path"])
def test_a_leading_tilde_is_the_home_directory(home, as_path):
    """As diskcache (and every shell) takes it: ``Cache("~/x")`` made a
    directory named ``~`` in the working directory."""
    from pathlib import Path
    directory = Path("~/c") if as_path else "~/c"
    with Cache(directory) as cache:
        cache["k"] = 1
        assert cache.path == str(home / "c")
        assert cache.name == "c"
    assert os.listdir(".") == []
    with Cache("~/c") as cache:
        assert cache["k"] == 1 and cache.path == str(home / "c")


def test_a_directory_where_the_store_file_goes_is_a_config_error(tmp_path):
    d = tmp_path / "c"
    (d / "pages.sqlite3").mkdir(parents=True)
    with pytest.raises(ConfigError) as info:
        Cache(d)
    msg = str(info.value)
    assert f"{str(d / 'pages.sqlite3')!r} is a directory" in msg, msg
    assert "move it away" in msg
    assert os.listdir(d / "pages.sqlite3") == []
    os.rmdir(d / "pages.sqlite3")
    with Cache(d) as cache:  # the lock was released: the directory opens once it is fixed
        cache["k"] = 1


@pytest.mark.parametrize("err,words", [
    (PermissionError(errno.EACCES, "Permission denied"), "needs a directory this user may read and write"),
    (OSError(errno.EROFS, "Read-only file system"), "read-only file system"),
])
def test_an_unwritable_directory_is_a_config_error(tmp_path, monkeypatch, err, words):
    """Creating the LOCK file fails as it does in a directory without write
    permission or on a read-only mount (injected: root could write anyway)."""
    def refuse(path, *args, **kwargs):
        if str(path).endswith("LOCK"):
            raise err
        return real_open(path, *args, **kwargs)
    real_open = os.open
    monkeypatch.setattr(os, "open", refuse)
    with pytest.raises(ConfigError, match=words):
        Cache(tmp_path / "c")


def test_a_value_that_contains_itself_is_a_type_error(tmp_path):
    loop: list = []
    loop.append(loop)
    with Cache(tmp_path / "c") as cache:
        with pytest.raises(TypeError, match="contains itself"):
            cache["k"] = loop
        assert "k" not in cache and len(cache) == 0


def test_memoize_works_bare_like_lru_cache(tmp_path):
    calls = []
    with Cache(tmp_path / "c") as cache:
        @cache.memoize
        def square(x):
            calls.append(x)
            return x * x
        assert square(3) == 9 and square(3) == 9 and calls == [3]
        assert square.__name__ == "square"
        # memoized results are ordinary entries, keyed as the README says
        name = f"{square.__module__}.{square.__qualname__}"
        assert list(cache.keys()) == [("durablekv.memoize", name, (3,), ())]
        assert len(cache) == 1


def test_memoize_names_the_function_and_the_argument_that_cannot_be_a_key(tmp_path):
    calls = []
    with Cache(tmp_path / "c") as cache:
        @cache.memoize
        def lookup(x, flags=None):
            calls.append(x)
            return object() if x == "bad result" else x
        name = f"{lookup.__module__}.{lookup.__qualname__}"
        with pytest.raises(TypeError) as info:
            lookup([1, 2])
        assert str(info.value).startswith(
            f"memoized {name}(): its 1st positional argument ([1, 2]) cannot be part of a "
            "cache key: unsupported key type builtins.list"), info.value
        assert str(info.value).endswith("; pass a tuple instead of the list")
        with pytest.raises(TypeError, match=r"its argument flags= \(\{'a': 1\}\)"):
            lookup(1, flags={"a": 1})
        assert calls == []  # the function never ran
        with pytest.raises(TypeError, match=rf"memoized {name}\(\) returned a result that "
                           "cannot be cached: cannot store value of type builtins.object"):
            lookup("bad result")
        assert len(cache) == 0
        assert lookup((1, 2), flags=("a",)) == (1, 2)
        # a miss answered without looking at the key (just found absent, or a
        # pending clear) still blames the argument, and the function never runs
        import enum

        class Color(enum.IntEnum):
            RED = 1
        calls.clear()
        for setup in (lambda: cache.get(lookup.cache_key(1)), cache.clear):
            setup()
            with pytest.raises(TypeError, match="its 1st positional argument .* its .value$"):
                lookup(Color.RED)
        assert calls == []


def test_an_unhashable_key_gets_the_same_type_error_from_every_method(tmp_path):
    with Cache(tmp_path / "c") as cache:
        calls = [lambda: cache.get([1]), lambda: [1] in cache, lambda: cache[[1]],
                 lambda: cache.set([1], 1), lambda: cache.delete([1]),
                 lambda: cache.pop([1], None), lambda: cache.get((1, {2: 3}))]
        for call in calls:
            with pytest.raises(TypeError, match="unsupported key type builtins"):
                call()


@pytest.mark.parametrize("bad", [-1, -0.001, float("nan"), float("inf"), -float("inf")])
def test_flush_refuses_a_negative_nan_or_infinite_timeout(tmp_path, bad):
    """flush(timeout=-1) was accepted (a FlushTimeoutError or nothing, by
    luck); inf failed with OverflowError deep in threading. Each is a
    ValueError naming the value, before anything waits."""
    with opened(tmp_path / "c") as c:
        for _round in range(2):
            with pytest.raises(ValueError) as info:
                c.flush(timeout=bad)
            assert "timeout" in str(info.value) and repr(float(bad)) in str(info.value)
            c["k"] = 1  # the second round: with a write pending
        with pytest.raises(TypeError, match="timeout"):
            c.flush(timeout="1")
        c.flush(timeout=5)
        c.flush(timeout=0)  # nothing pending: returns at once
        assert c.stats().pending_pages == 0 and c.stats().checkpoint_lsn == c.stats().last_lsn


def test_with_on_a_closed_cache_raises_at_once(tmp_path):
    """``with cache:`` after close() entered the block and failed only at the
    first call inside it (or never, for a block that only reads stats)."""
    c = open_cache(tmp_path / "c")
    c["k"] = 1
    c.close()
    entered = False
    with pytest.raises(CacheClosedError, match="is closed"):
        with c:
            entered = True
    assert not entered
    assert c.closed
    with open_cache(tmp_path / "c") as again:  # closing it left nothing held
        assert again["k"] == 1


@pytest.mark.parametrize("where", ["resident", "store only"])
def test_an_intenum_or_strenum_key_reads_like_a_dict_and_writes_refuse_it(tmp_path, where):
    """README's rule, the same whether the entry's page is in memory or only
    in SQLite. A lookup with an enum key (get, [], in) is a dict lookup: it
    finds the entry stored under the equal int or str (and misses, without
    an error, when there is none). Every write with one (set, add, delete,
    pop, touch, incr, decr) raises TypeError and changes nothing. Before,
    get(I.ONE) found the int's entry while its page was resident and raised
    TypeError once the page was evicted."""
    import enum

    from durablekv.tier.pages import RESIDENT

    class I(enum.IntEnum):
        ONE = 1
        TWO = 2

    class S(str, enum.Enum):  # StrEnum is new in 3.11; the same type shape
        A = "a"
        B = "b"

    with opened(tmp_path / "c", page_size=1, max_pages=2) as c:
        stored = {1: "one", "a": "A", (1, "a"): "tuple"}
        c.update(stored)

        def place(plain):
            """Put ``plain``'s page in memory, or only in SQLite."""
            if where == "store only":
                for i in range(4):  # evicts every other page (max_pages=2)
                    c[f"filler{i}"] = i
                c.flush()
                assert all(c._tier.table.get(k) is None for k in stored)
            elif plain in stored:
                c.get(plain)
                assert c._tier.table[plain][0].state == RESIDENT

        cases = ((I.ONE, 1), (S.A, "a"), ((I.ONE, S.A), (1, "a")))
        for key, plain in cases:
            place(plain)
            assert c.get(key) == stored[plain] and c[key] == stored[plain] and key in c
        for missing in (I.TWO, S.B, (I.TWO,)):
            place(None)
            assert c.get(missing, "dflt") == "dflt" and missing not in c
            with pytest.raises(KeyError):
                c[missing]
        writes = [lambda k: c.set(k, 0), lambda k: c.add(k, 0), lambda k: c.delete(k),
                  lambda k: c.pop(k), lambda k: c.pop(k, None), lambda k: c.touch(k, 60),
                  lambda k: c.incr(k), lambda k: c.decr(k)]
        for key, plain in cases + ((I.TWO, None),):
            for write in writes:
                place(plain)
                lsn = c.stats().last_lsn
                with pytest.raises(TypeError, match="unsupported key type") as info:
                    write(key)
                if not isinstance(key, tuple):
                    assert "pass the plain value, its .value" in str(info.value)
                assert c.stats().last_lsn == lsn  # nothing logged
        assert {k: c[k] for k in stored} == stored


def test_a_scan_of_items_and_values_leaves_the_memory_tier_and_the_counters_alone(tmp_path):
    """One pass over a cache ten times its memory tier neither evicts the
    working set nor counts as hits, page faults or misses."""
    with Cache(tmp_path / "c", page_size=1, max_pages=10) as c:
        for i in range(100):
            c[i] = i * 10
        c.flush()
        hot = list(range(90, 100))
        for k in hot:
            assert c[k] == k * 10
        before = c.stats()
        lru = [p.keys[0] for p in c._tier.lru_order()]
        assert sorted(lru) == hot
        assert dict(c.items()) == {i: i * 10 for i in range(100)}
        assert sorted(c.values()) == [i * 10 for i in range(100)]
        assert 990 in c.values() and 991 not in c.values()
        after = c.stats()
        assert [p.keys[0] for p in c._tier.lru_order()] == lru
        for field in ("hits", "memory_hits", "store_hits", "misses", "page_faults",
                      "evictions"):
            assert getattr(after, field) == getattr(before, field), field


@pytest.mark.parametrize("where", ["memory", "store"])
def test_a_scan_sees_writes_made_after_its_batch_was_read(tmp_path, monkeypatch, where):
    """Entries are read a batch at a time; a write after the batch makes each
    later entry of it be read again, so a deleted key is not yielded and a
    changed one is yielded with its new value."""
    import durablekv.scan as cache_mod
    monkeypatch.setattr(cache_mod, "_SCAN_BATCH", 100)
    monkeypatch.setattr(cache_mod, "_SCAN_BATCH_PAGES", 100)
    with Cache(tmp_path / "c", page_size=2, max_pages=2 if where == "store" else 64) as c:
        for i in range(20):
            c[i] = i
        c.flush()
        in_memory = {k for p in c._tier.pages.values() for k in p.keys if k is not EMPTY}
        later = sorted(set(range(20)) - in_memory) if where == "store" else sorted(in_memory)
        it = iter(c.items())
        first = next(it)
        victims = [k for k in later if k != first[0]][:2]
        del c[victims[0]]
        c[victims[1]] = "changed"
        rest = dict(it)
        rest[first[0]] = first[1]
        assert victims[0] not in rest and rest[victims[1]] == "changed"
        assert len(rest) == 19


def test_a_scan_skips_entries_that_expire_during_it(tmp_path):
    clock = Clock(100)
    with Cache(tmp_path / "c", page_size=2, max_pages=2, clock=clock) as c:
        for i in range(10):
            c.set(i, i, expire=5 if i % 2 else None)
        c.flush()
        it = iter(c.items())
        got = [next(it)]
        clock.now = 106
        got += list(it)
        assert {k for k, _ in got[1:]} <= {0, 2, 4, 6, 8}
        assert {k for k, _ in got} >= {0, 2, 4, 6, 8}


def test_a_clear_during_a_scan_ends_it_with_what_memory_holds(tmp_path):
    """After clear() the store's pages are stale until a flush wipes them:
    the rest of the scan must not yield their entries."""
    with Cache(tmp_path / "c", page_size=2, max_pages=2, flush_interval=3600) as c:
        for i in range(20):
            c[i] = i
        c.flush()
        it = iter(c.items())
        next(it)
        c.clear()
        c[19] = "after the clear"
        assert dict(it) in ({}, {19: "after the clear"})
        assert dict(c.items()) == {19: "after the clear"}


def test_an_index_row_that_disagrees_with_its_page_is_a_missing_entry_check_reports(
        tmp_path, capsys):
    """README: a scan raises for the damage a get would meet; an index row
    naming a page that does not hold its key shows as a missing entry (as
    it does to get), and durablekv check reports it."""
    import sqlite3
    from durablekv.cli import main
    d = tmp_path / "c"
    with Cache(d, page_size=4, max_pages=1) as c:
        for i in range(16):
            c[f"k{i}"] = i
    con = sqlite3.connect(d / "pages.sqlite3")
    pids = sorted(r[0] for r in con.execute("SELECT page_id FROM pages"))
    con.execute("UPDATE keys SET page_id=? WHERE page_id=? AND key=?",
                (pids[1], pids[0], b"s\x02\x00\x00\x00k0"))
    con.commit()
    con.close()
    with Cache(d, max_pages=1) as c:
        assert dict(c.items()) == {f"k{i}": i for i in range(1, 16)}
        assert c.get("k0") is None
    assert main(["check", str(d)]) == 1
    assert "DAMAGE" in capsys.readouterr().out


def test_a_scan_reports_a_stored_page_holding_a_key_memory_holds(tmp_path):
    import sqlite3
    from durablekv import CorruptStoreError
    d = tmp_path / "c"
    with Cache(d, page_size=4, max_pages=1) as c:
        for i in range(16):
            c[f"k{i}"] = b"x" * 30
    con = sqlite3.connect(d / "pages.sqlite3")
    rows = dict(con.execute("SELECT page_id, data FROM pages").fetchall())
    p1, p2 = sorted(rows)[:2]
    con.execute("UPDATE pages SET data=? WHERE page_id=?", (rows[p1], p2))  # p2: p1's keys
    reseal_pages(con)  # past the checksum, to the check that keys live in one page
    con.commit()
    con.close()
    with Cache(d, max_pages=1) as c:
        assert c._tier.table.get("k0") is None and c.get("k0") == b"x" * 30  # p1 resident
        with pytest.raises(CorruptStoreError, match="holds key 'k0', which lives in another"):
            list(c.items())


# -- iteration and deletes (issue: keys() yielded deleted keys) ---------------------


@pytest.mark.parametrize("restart", [False, True], ids=["live", "restart"])
def test_for_k_in_cache_reading_each_key_survives_deletes_in_the_loop(cache, restart):
    keys = [f"k{i:02}" for i in range(40)]
    for k in keys:
        cache[k] = k.upper()
    if restart:
        cache = reopen(cache)
    try:
        order = list(cache)
        assert sorted(order) == keys
        seen = []
        for k in cache:
            # the common loop: read each key, and delete keys still to come
            assert cache[k] == k.upper()
            seen.append(k)
            later = order[len(seen):]
            if later:
                del cache[later[-1]]  # the last one still to come
                order.remove(later[-1])
        assert seen == order and len(seen) == 20
        # keys() is the same walk
        for k in cache.keys():
            cache.delete(k)
            assert k not in cache
        assert len(cache) == 0 and list(cache) == []
    finally:
        if restart:
            cache.close()


def test_iteration_skips_a_key_that_expired_meanwhile(tmp_path, shape):
    clock = Clock()
    with opened(tmp_path / "c", clock=clock, **shape) as c:
        for i in range(10):
            c.set(i, i, expire=10 if i % 2 else None)
        seen = []
        for k in c:
            if not seen:
                clock.now += 20
            seen.append(k)
            assert c[k] == k
        assert sorted(seen[1:]) == [i for i in range(10) if i % 2 == 0 and i != seen[0]]


def test_iter_of_a_closed_cache_raises_at_once(tmp_path):
    c = open_cache(tmp_path / "c")
    c["a"] = 1
    it = iter(c)
    c.close()
    with pytest.raises(CacheClosedError):
        iter(c)
    with pytest.raises(CacheClosedError):
        next(it)


# -- setdefault is one step (issue: it was the inherited lookup-then-store) ---------


def test_setdefault_racing_callers_all_get_the_one_stored_value(tmp_path, monkeypatch):
    """Every thread misses before any stores: the inherited setdefault (get,
    then set) then tells each its own default was stored."""
    n = 6
    with opened(tmp_path / "c") as c:
        gate = threading.Barrier(n, timeout=5)
        real_get = c.get

        def get_then_wait(key, default=None):
            value = real_get(key, default)
            try:
                gate.wait()  # only the inherited lookup-then-store gets here
            except threading.BrokenBarrierError:
                pass
            return value

        monkeypatch.setattr(c, "get", get_then_wait)
        got = [None] * n
        run_threads(lambda i: got.__setitem__(i, c.setdefault("k", f"default-{i}")), n)
        assert len(set(got)) == 1, got
        assert c["k"] == got[0]


def test_setdefault_under_threads_on_many_keys(tmp_path, shape):
    n, keys = 4, 300
    with opened(tmp_path / "c", **shape) as c:
        got = [[None] * keys for _ in range(n)]
        start = threading.Barrier(n)

        def work(i):
            start.wait()
            for k in range(keys):
                got[i][k] = c.setdefault(k, (i, k))
        run_threads(work, n)
        for k in range(keys):
            assert len({got[i][k] for i in range(n)}) == 1
            assert c[k] == got[0][k]
        assert len(c) == keys


def test_setdefault_checks_and_keeps_ttl_semantics(tmp_path):
    clock = Clock()
    with opened(tmp_path / "c", clock=clock) as c:
        c.set("t", "old", expire=5)
        assert c.setdefault("t", "new") == "old"
        clock.now += 10
        assert c.setdefault("t", "new") == "new"  # the expired entry does not count
        assert c["t"] == "new"
        with pytest.raises(TypeError):
            c.setdefault("x", object())
        with pytest.raises(TypeError):
            c.setdefault(["list"], 1)
        assert "x" not in c


def test_the_key_limit_the_readme_states(tmp_path):
    """README: an encoded key is at most 1 MiB; a str key takes its UTF-8
    bytes plus 5."""
    from durablekv.config import MAX_KEY_BYTES
    assert MAX_KEY_BYTES == 1 << 20
    with opened(tmp_path / "c") as c:
        longest = "k" * (MAX_KEY_BYTES - 5)
        c[longest] = 1
        assert c[longest] == 1
        with pytest.raises(ValueError, match="limit on keys; use a shorter key"):
            c[longest + "k"] = 2
        with pytest.raises(ValueError, match="limit on keys"):
            c.setdefault(longest + "k", 2)
        assert len(c) == 1


def test_pop_and_popitem_under_threads_hand_each_entry_to_one_caller(tmp_path, shape):
    """The other read-modify-writes a dict offers are one step too: of racing
    pops of one key exactly one gets the value; racing popitems hand out
    every entry exactly once."""
    n = 4
    with opened(tmp_path / "c", **shape) as c:
        c.update({k: k * 10 for k in range(200)})
        start = threading.Barrier(n)
        popped: list = [[] for _ in range(n)]

        def pop_all(i):
            start.wait()
            for k in range(100):
                got = c.pop(k, None)
                if got is not None:
                    popped[i].append((k, got))
            while True:
                try:
                    popped[i].append(c.popitem())
                except KeyError:
                    return
        run_threads(pop_all, n)
        every = sorted(p for ps in popped for p in ps)
        assert every == [(k, k * 10) for k in range(200)]
        assert len(c) == 0


def test_readme_error_kinds_bad_settings_are_config_errors_and_value_errors(tmp_path):
    """README: bad keys and values raise TypeError/ValueError as dicts do; bad
    constructor settings raise ConfigError, which is a ValueError."""
    from durablekv import Cache
    from durablekv.errors import ConfigError, DurableKVError
    for bad in ({"page_size": "16"}, {"max_pages": -1}, {"max_memory_bytes": "256MiB"}):
        with pytest.raises(ConfigError) as info:
            Cache(str(tmp_path / "c"), **bad)
        assert isinstance(info.value, ValueError) and isinstance(info.value, DurableKVError)
    with Cache(str(tmp_path / "ok")) as c:
        with pytest.raises(TypeError):
            c.set([1, 2], b"x")     # an unhashable key, as a dict refuses it
        with pytest.raises(ValueError):
            c.set("k", b"x", expire=-1)


def test_every_durablekv_error_pickles_as_itself():
    """An error raised in a multiprocessing or concurrent.futures worker must
    reach the parent as what it is, message and attributes included."""
    import inspect
    import pickle

    import durablekv.errors as errors

    made = [errors.CacheLockedError("/var/c", 42), errors.CacheClosedError("/var/c", True),
            errors.LogCorruptionError("/var/c/replay.log", 7, "bad CRC"),
            errors.WriteBehindError("/var/c", OSError(28, "No space left on device")),
            errors.RemoteTypeError(409, "not an int", "detail", "http://h/k"),
            errors.ConfigError("page_size must be >= 1")]
    classes = {c for c in vars(errors).values() if inspect.isclass(c)
               and issubclass(c, errors.DurableKVError)}
    assert {type(e) for e in made} <= classes
    for exc in made:
        back = pickle.loads(pickle.dumps(exc))
        assert type(back) is type(exc) and str(back) == str(exc) and back.args == exc.args
        assert {k: repr(v) for k, v in vars(back).items()} == \
            {k: repr(v) for k, v in vars(exc).items()}
    locked = pickle.loads(pickle.dumps(made[0]))
    assert (locked.path, locked.pid) == ("/var/c", 42)
