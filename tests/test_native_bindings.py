"""The C fast path (``durablekv/_native.c``) reads and writes Python
attributes by name: every name it interns must exist on the object it is
used on, or the C path fails only at run time, on the first get or set that
reaches the line. This test reads the names out of the C source and checks
each on a real cache's objects, so renaming an attribute in Python without
the C code (or the other way round) fails here, with or without the
extension built."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from durablekv import Cache
from durablekv.fastpath import FastPath

SOURCE = Path(__file__).resolve().parents[1] / "durablekv" / "_native.c"

#: Every attribute name the C code interns, by the object it is used on.
BOUND = {
    "cache": {"_state", "_batcher", "_lock", "flush_batch_pages", "max_value_bytes",
              "max_pending_pages", "_last_lsn", "_sets", "_failed_after_log", "get", "set"},
    "tier": {"max_bytes", "page_bytes_limit", "pending", "resident_bytes", "locked_ticks"},
    "log": {"_mm", "_size", "segment_bytes", "_last_start", "_last_lsn"},
    "log type": {"_write"},
    "page": {"values", "nbytes", "version", "dirty_lsn", "page_id", "dirty_since", "state",
             "stamp"},
    "slot page": {"stamps"},           # policy="midpoint": per-slot recency
    "batcher": {"kick"},
    "lock": {"acquire", "release"},
    "object": {"__reduce_ex__"},
}


def interned_names() -> set[str]:
    text = SOURCE.read_text()
    names = set(re.findall(r'INTERN\(\w+, "(\w+)"\)', text))
    names |= set(re.findall(r'PyUnicode_InternFromString\("(\w+)"\)', text))
    return names


def fast_path_fields() -> set[str]:
    """The FastPath fields the C getter and setter read at construction."""
    text = SOURCE.read_text()
    names = set(re.findall(r'fast_long\(args\[1\], "(\w+)"', text))
    for body in re.findall(r'static const char \*const names\[\] = \{([^}]*)\}', text):
        names |= set(re.findall(r'"(\w+)"', body))
    return names


def test_the_c_code_reads_every_fast_path_field_and_no_other():
    """The fast path object is the one list of what the two hot paths take:
    a field the C code does not read is dead, one it reads that the object
    lacks fails at open."""
    assert fast_path_fields() == set(FastPath.__slots__)


def test_a_fast_path_object_without_a_field_is_refused_by_name(tmp_path):
    native = pytest.importorskip("durablekv._native")

    class Partial:
        resident = slotted = 1
        max_key_bytes = 100

    with Cache(tmp_path / "c") as cache:
        for build in (native.hit_getter, native.hot_setter):
            with pytest.raises(TypeError, match="lacks the field"):
                build(cache, Partial())
            with pytest.raises(TypeError, match="2 arguments"):
                build(cache)


def test_the_list_above_is_every_name_the_c_code_binds():
    listed = set().union(*BOUND.values())
    assert interned_names() == listed, "update BOUND with the names _native.c binds"


@pytest.mark.parametrize("policy", ["lru", "midpoint"])
def test_every_bound_name_exists_on_its_object(tmp_path, policy):
    with Cache(tmp_path / "c", policy=policy, page_size=4) as cache:
        cache.set("k", b"v")
        page = cache._tier.table["k"][0]
        objects = {"cache": [cache], "tier": [cache._tier], "log": [cache._log],
                   "log type": [type(cache._log)], "batcher": [cache._batcher],
                   "lock": [cache._lock], "object": [object()],
                   "page": [page], "slot page": [page] if policy == "midpoint" else []}
        for kind, names in BOUND.items():
            for obj in objects[kind]:
                missing = sorted(n for n in names if not hasattr(obj, n))
                assert not missing, f"{kind} {obj!r} lacks {missing}, which _native.c binds"


@pytest.mark.parametrize("policy", ["lru", "midpoint"])
def test_the_fast_path_holds_the_tiers_own_fields_through_a_clear(tmp_path, policy):
    """FastPath keeps the tier's table, clock and dirty map, fixed for the
    cache's open life: a clear empties them in place, never replaces them
    (the C twins read them once, at open)."""
    with Cache(tmp_path / "c", policy=policy, page_size=4) as cache:
        for i in range(10):
            cache.set(f"k{i}", b"v")
        cache.clear()
        cache.set("after", b"w")
        fast, tier = cache._fast, cache._tier
        assert fast.tier is tier and fast.table is tier.table
        assert fast.ticks is tier.ticks and fast.dirty is tier.dirty and fast.log is cache._log
        assert cache.get("after") == b"w" and cache.get("k1") is None
