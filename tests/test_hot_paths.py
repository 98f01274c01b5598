"""Cache.get's memory hit and Cache.set's overwrite in C
(durablekv/_native.c ``hit_getter``, ``hot_setter``).

An open cache installs them as its ``get`` and ``set`` when the extension
runs. The getter takes the plain memory hit (no TTL, page resident, or a
young entry under ``policy="midpoint"``); the setter the overwrite of a
live entry in a resident, already dirty page with an ASCII str key and a
bytes value, appended into the mapped log. Every other case goes to the
Python ``Cache.get`` / ``Cache.set``. These tests check that a cache with
them and a cache without them answer every call the same, write the same
log bytes, count the same hits and keep the same LRU order and page
bookkeeping, and that neither outlives the cache's open state.
"""

from __future__ import annotations

import contextlib
import gc
import os
import pickle
import subprocess
import sys
import weakref
from pathlib import Path
from unittest import mock

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import durablekv
from durablekv import Cache, CacheClosedError, _accel

native_only = pytest.mark.skipif(not durablekv.accelerated,
                                 reason="needs the C kernels and the Python code in one process")


def _c_getter(cache: Cache) -> bool:
    return "get" in vars(cache)


def _c_setter(cache: Cache) -> bool:
    return "set" in vars(cache)


@native_only
def test_an_open_cache_gets_through_the_c_hit_and_drops_it_at_close(tmp_path):
    c = Cache(str(tmp_path / "c"))
    assert _c_getter(c) and type(c.get).__name__ == "builtin_function_or_method"
    assert _c_setter(c) and type(c.set).__name__ == "builtin_function_or_method"
    c["a"] = b"1"
    held, held_set = c.get, c.set
    c.close()
    assert not _c_getter(c) and not _c_setter(c)
    # taken while open, they keep working as Cache.get/set do: they raise
    with pytest.raises(CacheClosedError):
        held("a")
    with pytest.raises(CacheClosedError):
        held_set("a", b"2")
    with pytest.raises(CacheClosedError):
        c.get("a")


@native_only
def test_a_dropped_getter_and_cache_are_collected(tmp_path):
    """The getter's state is tracked by the cycle collector: a cache and a
    getter taken from it, both dropped, are freed."""
    c = Cache(str(tmp_path / "c"))
    c["a"] = b"1"
    held = c.get
    c.close()
    refs = weakref.ref(c)
    del c, held
    gc.collect()
    assert refs() is None


def test_the_pure_kernels_install_no_c_hit(tmp_path):
    with _accel.pure_kernels():
        c = Cache(str(tmp_path / "c"))
    try:
        assert not _c_getter(c)
        c["a"] = b"1"
        assert c.get("a") == b"1"
    finally:
        c.close()


def test_a_subclass_that_overrides_get_keeps_it(tmp_path):
    class Counting(Cache):
        calls = 0

        def get(self, key, default=None):
            Counting.calls += 1
            return super().get(key, default)

    c = Counting(str(tmp_path / "c"))
    try:
        c["a"] = b"1"
        assert c.get("a") == b"1" and c["a"] == b"1"
        assert Counting.calls == 2
    finally:
        c.close()


@native_only
def test_arguments_and_errors_are_cache_gets(tmp_path):
    c = Cache(str(tmp_path / "c"))
    try:
        c["a"] = b"1"
        assert c.get("a", 5) == b"1" and c.get("b", 5) == 5
        assert c.get(key="a") == b"1" and c.get("b", default=7) == 7
        with pytest.raises(TypeError, match="unsupported key type"):
            c.get(["unhashable"])
        with pytest.raises(TypeError):
            c.get()
        with pytest.raises(TypeError):
            c.get("a", 1, 2)
        with pytest.raises(KeyError):
            c["b"]
    finally:
        c.close()


_ops = st.lists(st.tuples(st.sampled_from(["get", "get", "get", "set", "set_ttl", "delete",
                                           "flush"]),
                          st.integers(0, 40), st.integers(0, 3)),
                min_size=1, max_size=120)


def _run(c: Cache, ops, values) -> list:
    out = []
    for op, k, v in ops:
        out.append(_step(c, op, f"k{k}", values[v]))
        if op == "get":
            out.append(_recency(c))  # the LRU order after each get
    return out


def _step(c: Cache, op: str, key: str, value) -> object:
    """One call of the agreement tests; its answer (None for a set or flush)."""
    if op == "get":
        return c.get(key, "missing")
    if op == "set":
        c.set(key, value)
    elif op == "set_ttl":
        c.set(key, value, expire=3600)
    elif op == "delete":
        return c.delete(key)
    else:
        c.flush()
    return None


def _recency(c: Cache) -> dict:
    """Each page's recency stamps in memory: the page's own, and its
    entries' under midpoint (the LRU order, tick for tick)."""
    pages = {ref[0].page_id: ref[0] for ref in c._tier.table.values()}
    return {pid: (p.stamp, tuple(getattr(p, "stamps", ()))) for pid, p in pages.items()}


@native_only
@pytest.mark.parametrize("policy", ["lru", "midpoint"])
@pytest.mark.parametrize("serializer", ["safe", "pickle"])
@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=_ops)
def test_the_c_hit_and_the_python_get_agree(tmp_path_factory, policy, serializer, ops):
    """Same answers, same hit and fault counts, same LRU order after every
    get; a tier of
    2 pages of 4 so that pages leave memory and come back."""
    values = [b"v0", b"v1" * 20, [1, {"a": 2}], 3.5]  # a list: kept frozen
    root = tmp_path_factory.mktemp("agree")
    kw = dict(page_size=4, max_pages=2, policy=policy, serializer=serializer)
    native = Cache(str(root / "n"), **kw)
    with _accel.pure_kernels():
        pure = Cache(str(root / "p"), **kw)
    try:
        assert _c_getter(native) and not _c_getter(pure)
        got_n = _run(native, ops, values)
        with _accel.pure_kernels():
            got_p = _run(pure, ops, values)
        assert got_n == got_p
        sn, sp = native.stats(), pure.stats()
        for field in ("memory_hits", "store_hits", "misses", "page_faults", "evictions"):
            assert getattr(sn, field) == getattr(sp, field), field
    finally:
        native.close()
        with _accel.pure_kernels():
            pure.close()


@native_only
@pytest.mark.parametrize("kw", [dict(), dict(serializer="pickle"), dict(durability="fsync")])
def test_the_c_overwrite_is_installed_only_where_its_steps_are_sets(tmp_path, kw):
    c = Cache(str(tmp_path / "c"), **kw)
    try:
        assert _c_setter(c) == (kw == {})
    finally:
        c.close()


@native_only
def test_set_arguments_and_errors_are_cache_sets(tmp_path):
    c = Cache(str(tmp_path / "c"), max_value_bytes=1000)
    try:
        c["a"] = b"1"
        c.flush()
        c.set("a", b"2")
        c.set("a", b"3")  # the page is dirty: the C overwrite
        assert c["a"] == b"3"
        with pytest.raises(ValueError, match="max_value_bytes"):
            c.set("a", b"x" * 1001)
        with pytest.raises(TypeError):
            c.set(["unhashable"], b"1")
        with pytest.raises(TypeError):
            c.set("a")
        c.set("a", b"4", expire=60)
        c.set(key="a", value=b"5")
        assert c["a"] == b"5"
        with pytest.raises(TypeError, match="tag"):
            c.set("a", b"6", tag="t")
        assert c["a"] == b"5"
    finally:
        c.close()


def _log_bytes(c: Cache) -> bytes:
    log = c._log
    if log._mm is not None:
        return bytes(log._mm[:log._size])
    with open(log._path, "rb") as f:
        return f.read()


def _pages(c: Cache) -> dict:
    pages = {ref[0].page_id: ref[0] for ref in c._tier.table.values()}
    return {pid: (p.nbytes, p.version, p.dirty_lsn, p.stamp, list(p.values))
            for pid, p in pages.items()}


_set_ops = st.lists(st.tuples(st.sampled_from(["set", "set", "set", "set", "get", "set_ttl",
                                               "delete", "flush", "big"]),
                              st.sampled_from(["k0", "k1", "k2", "k3", "k4", "k5", "k6",
                                               "ключ", "k" * 40]),
                              st.integers(0, 3)),
                    min_size=1, max_size=150)


@native_only
@settings(max_examples=30, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=_set_ops)
def test_the_c_overwrite_and_the_python_set_agree(tmp_path_factory, ops):
    """Same log bytes, LSNs, page bookkeeping (bytes, version, first dirty
    LSN, LRU stamp, slots), dirty pages in order, counts and answers, after
    every call."""
    values = [b"v0", b"v1" * 30, b"", b"v3" * 200]
    root = tmp_path_factory.mktemp("sets")
    kw = dict(page_size=4, max_pages=3, max_value_bytes=500, clock=lambda: 1.7e9)
    native = Cache(str(root / "n"), **kw)
    with _accel.pure_kernels():
        pure = Cache(str(root / "p"), **kw)
    caches = ((native, contextlib.nullcontext), (pure, _accel.pure_kernels))
    try:
        assert _c_setter(native) and not _c_setter(pure)
        for op, key, v in ops:
            seen = []
            for c, mode in caches:
                with mode():
                    if op == "big":
                        with pytest.raises(ValueError):
                            c.set(key, b"x" * 501)
                    else:
                        seen.append(_step(c, op, key, values[v]))
                    seen.append((c._last_lsn, _log_bytes(c), _pages(c), c.stats().sets,
                                 c._tier.resident_bytes, c._tier.locked_ticks,
                                 list(c._tier.dirty)))
            assert seen[:len(seen) // 2] == seen[len(seen) // 2:], op
    finally:
        native.close()
        with _accel.pure_kernels():
            pure.close()


def test_patching_cache_get_and_set_on_the_class_takes_effect(tmp_path):
    """A test double patched onto the class (unittest.mock) is what an open
    cache's get and set call, with the C paths as without them."""
    c = Cache(str(tmp_path / "c"))
    try:
        c.set("a", b"1")
        with mock.patch.object(Cache, "get", return_value="mocked") as get:
            assert c.get("a") == "mocked" and c.get("missing") == "mocked"
            assert c["a"] == "mocked"  # __getitem__ goes through get
        assert get.call_count == 3
        with mock.patch("durablekv.cache.Cache.set") as set_:
            c.set("a", b"not written")
            c["a"] = b"not written either"
        assert set_.call_count == 2
        assert c.get("a") == b"1"

        def recording_get(self, key, default=None):
            return ("patched", key, default)

        with mock.patch.object(Cache, "get", recording_get):
            assert c.get("a", 5) == ("patched", "a", 5)
        assert c.get("a") == b"1"  # unpatched again: the fast path is back
    finally:
        c.close()


def test_pickling_get_or_set_refuses_as_the_cache_does(tmp_path):
    c = Cache(str(tmp_path / "c"))
    try:
        for method in (c.get, c.set):
            with pytest.raises(TypeError, match="cannot be pickled.*Share the one Cache"):
                pickle.dumps(method)
    finally:
        c.close()


_HELD_AT_FORK = r"""
import os, signal, sys, threading
from durablekv import Cache, CacheClosedError

cache = Cache(sys.argv[1])
cache["a"] = b"1"
get, set_ = cache.get, cache.set  # taken while open, as a caller may keep them
held, release = threading.Event(), threading.Event()

def holder():  # the lock held by another thread at the fork (as the batcher's snapshot does)
    with cache._lock:
        held.set()
        release.wait()

t = threading.Thread(target=holder)
t.start()
held.wait()
pid = os.fork()
if pid == 0:
    signal.alarm(10)  # a hang shows as SIGALRM, not as a stuck test
    for call in (lambda: get("a"), lambda: set_("a", b"2"), lambda: cache.set("a", b"2")):
        try:
            call()
        except CacheClosedError as exc:
            assert "fork" in str(exc), exc
        else:
            os._exit(3)
    os._exit(0)
_, status = os.waitpid(pid, 0)
release.set()
t.join()
cache.close()
print(os.waitstatus_to_exitcode(status))
"""


def test_a_set_taken_before_a_fork_raises_in_the_child(tmp_path):
    """A forked child gets new locks (Lifecycle._retire_after_fork): a lock
    another parent thread held at the fork stays held in the child for good.
    A ``cache.set`` taken before the fork must raise CacheClosedError there,
    as the Python Cache.set does, not wait for the parent's old lock."""
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    proc = subprocess.run([sys.executable, "-c", _HELD_AT_FORK, str(tmp_path / "c")], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "0", f"the child's exit code: {proc.stdout!r} (-14: hung)"


def test_an_error_from_a_keys_eq_propagates_from_get(tmp_path):
    """Only a TypeError (an unhashable key) sends get on to the locked path,
    as Cache.get's lookup catches only that; any other error of the key's
    own __eq__ reaches the caller once, as from a dict."""

    class Boom(Exception):
        pass

    class Key(str):
        calls = 0

        def __hash__(self):
            return hash(str(self))

        def __eq__(self, other):
            Key.calls += 1
            raise Boom

    c = Cache(str(tmp_path / "c"))
    try:
        c["a"] = b"1"
        with pytest.raises(Boom):
            c.get(Key("a"))
        assert Key.calls == 1
    finally:
        c.close()


def test_close_keeps_a_get_or_set_the_user_put_on_the_instance(tmp_path):
    """Only the C functions open installed leave the instance at close; a
    function a test put there (monkeypatch) is restored by its owner."""
    c = Cache(str(tmp_path / "c"))

    def mine(*args, **kwargs):
        return "mine"

    c.get = mine
    c.close()
    assert vars(c)["get"] is mine and not _c_setter(c)


@native_only
def test_a_keyword_get_does_not_take_is_cache_gets_own_error(tmp_path):
    """diskcache's ``get(key, read=True)`` or ``expire_time=True``: the C
    getter takes no memory hit with keywords but hands the call to
    Cache.get, so a hit and a miss both raise Cache.get's TypeError."""
    c = Cache(str(tmp_path / "c"))
    try:
        c["a"] = b"1"
        assert _c_getter(c)
        for key in ("a", "missing"):
            for kw in ({"read": True}, {"expire_time": True}, {"tag": True}):
                with pytest.raises(TypeError) as from_c:
                    c.get(key, **kw)
                with pytest.raises(TypeError) as from_python:
                    Cache.get(c, key, **kw)
                assert str(from_c.value) == str(from_python.value)
                assert f"'{next(iter(kw))}'" in str(from_c.value)
                assert "Cache.get()" in str(from_c.value)
    finally:
        c.close()


def test_no_class_of_the_cache_defines_a_getattr_hook():
    """A ``__getattr__`` anywhere in Cache's classes makes CPython look up
    every attribute of every cache through a slower hook (and stops
    LOAD_ATTR specializing): it put about 20 ns on the C memory hit and
    50 % on the Python get. diskcache's names that durablekv refuses
    (``transact``, ``check``) are properties instead."""
    from durablekv.sharded import ShardedCache
    for cls in (Cache, ShardedCache):
        assert not hasattr(cls, "__getattr__"), cls
        assert cls.__getattribute__ is object.__getattribute__, cls
