"""The Bloom filter in front of the key index: never a false negative."""

from __future__ import annotations

import durablekv.keyfilter as keyfilter
from durablekv import Cache
from durablekv.keyfilter import KeyFilter


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
    with Cache(d, page_size=4, max_pages=2) as cache:
        assert not cache._filter.ready  # a store with keys: built by a background scan
        cache["trigger"] = 1
        cache.flush()  # a batcher cycle: the scan runs before it
        assert cache._filter.ready
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
        first = cache._filter.capacity
        for i in range(5000):
            cache[f"k{i}"] = i
            if i % 500 == 0:
                cache.flush()
        cache.flush()
        assert cache._filter.capacity > first  # rebuilt, larger
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
