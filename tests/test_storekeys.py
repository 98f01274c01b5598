"""StoreKeys (durablekv/storekeys.py) and KeyCounts (durablekv/counts.py) on
their own, with no Cache: which keys the store may hold, through a scan, a
clear, commits and a look-aside miss; and the key counts' arithmetic."""

from __future__ import annotations

from durablekv.codec import canonical_key as ck
from durablekv.counts import KeyCounts
from durablekv.keyfilter import MIN_CAPACITY, KeyFilter
from durablekv.storekeys import StoreKeys


def _absent(keys: StoreKeys, key, ckey: bytes) -> bool:
    """The question Cache.set asks of StoreKeys for a new key (inline there):
    can the store hold ``key``?"""
    return keys.absent is key or keys.clear_pending or keys.excluded(ckey)


def test_a_new_store_holds_nothing_and_says_so_at_once():
    keys = StoreKeys(0, empty=True)
    assert keys.filter.ready and keys.building is None and keys.nothing_stored()
    assert _absent(keys, "a", ck("a"))


def test_a_store_with_keys_answers_only_once_its_scan_is_merged():
    keys = StoreKeys(3, empty=False)
    assert not keys.filter.ready and keys.building is keys.filter
    assert not _absent(keys, "a", ck("a")) and not keys.nothing_stored()
    target = keys.building
    scanned = KeyFilter(target.capacity)
    scanned.add_all([ck("a"), ck("b")])
    keys.finish_build(target, scanned)
    assert keys.filter is target and target.ready and keys.building is None
    assert not _absent(keys, "a", ck("a"))
    assert _absent(keys, "zzz", ck("zzz"))  # (no Bloom false positive for this key)


def test_a_scan_overtaken_by_a_clear_is_dropped():
    keys = StoreKeys(3, empty=False)
    target = keys.building
    keys.cleared(7)
    scanned = KeyFilter(target.capacity)
    scanned.add(ck("old"))
    keys.finish_build(target, scanned)
    assert keys.filter is not target and _absent(keys, "old", ck("old"))


def test_the_look_aside_miss_is_by_identity_and_ends_with_an_insert():
    keys = StoreKeys(3, empty=False)  # the filter is not ready: only the miss answers
    k = ("tuple", 1)
    assert not _absent(keys, k, ck(k))
    keys.found_absent(k)
    assert _absent(keys, k, ck(k))
    assert not _absent(keys, ("tuple", int("1")), ck(k))  # an equal key is asked again
    keys.key_added()
    assert not _absent(keys, k, ck(k))


def test_a_clear_is_pending_until_its_own_flush_commits():
    keys = StoreKeys(0, empty=True)
    keys.committed([ck("a")], clear_lsn=0, live_keys=1)
    assert ck("a") in keys.filter and not keys.nothing_stored()
    keys.cleared(5)
    assert keys.clear_pending and _absent(keys, "a", ck("a")) and keys.nothing_stored()
    keys.committed([ck("b")], clear_lsn=0, live_keys=1)  # snapshotted before the clear
    assert keys.filter.added == 0
    keys.cleared(9)
    keys.clear_committed(5)  # an older clear's flush: a newer one is pending
    assert keys.clear_pending
    keys.clear_committed(9)
    assert not keys.clear_pending and keys.nothing_stored()  # empty, ready filter
    keys.committed([ck("c")], clear_lsn=9, live_keys=1)
    assert ck("c") in keys.filter and not keys.nothing_stored()


def test_an_overfull_filter_gets_a_larger_one_built():
    keys = StoreKeys(0, empty=True)
    first = keys.filter
    keys.committed([ck(f"k{i}") for i in range(2 * MIN_CAPACITY + 1)], 0,
                   live_keys=2 * MIN_CAPACITY + 1)
    assert first.overfull and keys.building is not None
    assert keys.building.capacity > first.capacity and keys.filter is first


def test_reserve_grows_an_empty_complete_filter_at_once_and_others_by_a_build():
    keys = StoreKeys(0, empty=True)
    keys.reserve(10 * MIN_CAPACITY, live_keys=0)
    assert keys.filter.ready and keys.filter.capacity >= 10 * MIN_CAPACITY
    assert keys.building is None
    keys.committed([ck("x")], 0, live_keys=1)
    keys.reserve(100 * MIN_CAPACITY, live_keys=1)
    assert keys.building is not None and keys.building.capacity >= 100 * MIN_CAPACITY
    assert ck("x") in keys.filter  # the current filter stays until the scan is merged


def test_key_counts_follow_adds_removals_expiry_changes_and_a_clear():
    counts = KeyCounts(10, 3)
    counts.added(5, 2)
    counts.removed(1, 1)
    counts.expiry_changed(had=False, has=True)
    counts.expiry_changed(had=True, has=True)
    assert (counts.keys, counts.ttl_keys) == (14, 5)
    counts.cleared()
    assert (counts.keys, counts.ttl_keys) == (0, 0)
