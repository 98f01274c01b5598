"""Cache.get's memory hit in C (durablekv/_native.c ``hit_getter``).

An open cache installs the C getter as its ``get`` when the extension runs:
it takes the plain memory hit (no TTL, page resident, or a young entry
under ``policy="midpoint"``) and hands every other case to the Python
``Cache.get``. These tests check that a cache with it and a cache without it
answer every call the same, count the same hits and keep the same LRU
order, and that the getter does not outlive the cache's open state.
"""

from __future__ import annotations

import gc
import weakref

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import durablekv
from durablekv import Cache, CacheClosedError, _accel

native_only = pytest.mark.skipif(not durablekv.accelerated,
                                 reason="needs the C kernels and the Python code in one process")


def _c_getter(cache: Cache) -> bool:
    return "get" in vars(cache)


@native_only
def test_an_open_cache_gets_through_the_c_hit_and_drops_it_at_close(tmp_path):
    c = Cache(str(tmp_path / "c"))
    assert _c_getter(c) and type(c.get).__name__ == "builtin_function_or_method"
    c["a"] = b"1"
    held = c.get
    c.close()
    assert not _c_getter(c)
    # a getter taken while open keeps working as Cache.get does: it raises
    with pytest.raises(CacheClosedError):
        held("a")
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
        key = f"k{k}"
        if op == "get":
            out.append(c.get(key, "missing"))
            out.append(_recency(c))  # the LRU order after each get
        elif op == "set":
            c[key] = values[v]
        elif op == "set_ttl":
            c.set(key, values[v], expire=3600)
        elif op == "delete":
            out.append(c.delete(key))
        else:
            c.flush()
    return out


def _recency(c: Cache) -> dict:
    """Each page's recency stamps in memory: the page's own, and its
    entries' under midpoint (the LRU order, tick for tick)."""
    pages = {ref[0].page_id: ref[0] for ref in c._table.values()}
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
