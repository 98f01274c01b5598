"""The PageStore contracts (see :mod:`durablekv.stores.base`), run against every store.

Each test takes ``store_factory`` (``tests/stores/conftest.py``), so a store
that passes here keeps every contract the cache, the batcher, recovery and
``check`` rely on: batch atomicity, checkpoint ordering, a key index that
agrees with the pages, reopen, damage detection, meta validation and
eviction down to a size limit.
"""

from __future__ import annotations

import math
import os
import select
import signal
import subprocess
import sys
import time

import pytest

from durablekv.codec import SafeCodec, canonical_key, decode_key, encode_key
from durablekv.errors import ConfigError, CorruptStoreError, HeldKeyError, StoreError
from durablekv.stores.base import PageImage, PageStore
from durablekv.stores.pageformat import decode_page, encode_page

_CODEC = SafeCodec()


def image(page_id: int, entries: dict, *, stored: bool = True, index: bool = True) -> PageImage:
    """A page image of ``{key: (value, expire_at)}`` (slots in order), with
    its index rows when ``index``; an empty dict deletes the page."""
    rows, packed, ttl_n = [], [], 0
    for slot, (key, (value, exp)) in enumerate(entries.items()):
        kb = encode_key(key)
        ck = canonical_key(key)
        packed.append((slot, kb, _CODEC.encode(value), exp))
        rows.append((ck, exp, None if ck == kb else kb))
        ttl_n += exp is not None
    data = encode_page(packed) if packed else b""
    return PageImage(page_id, len(packed), ttl_n, data, rows if index else None, stored)


def page_keys(store: PageStore, page_id: int) -> dict:
    """``{key: (value, expire_at)}`` of a committed page (empty when absent)."""
    row = store.read_page(page_id)
    if row is None:
        return {}
    n, data = row
    got = {decode_key(kb): (_CODEC.decode(vb), exp) for _s, kb, vb, exp in decode_page(data)}
    assert len(got) == n
    return got


def assert_index_agrees(store: PageStore, pages: dict[int, dict]) -> None:
    """The index, the pages and the counts agree with ``pages`` (what the test committed)."""
    expect = {canonical_key(k): (pid, e) for pid, ents in pages.items() for k, (_v, e) in ents.items()}
    index = {key: (pid, exp) for key, _orig, pid, exp in store.scan_index()}
    assert index == expect
    assert sorted(store.iter_keys()) == sorted(expect)
    assert store.locate_keys(list(expect) + [canonical_key("absent")]) == \
        {ck: pid for ck, (pid, _e) in expect.items()}
    for pid, ents in pages.items():
        assert page_keys(store, pid) == ents
        for key in ents:
            found = store.find(canonical_key(key))
            assert found is not None and found[0] == pid
    assert store.find(canonical_key("absent")) is None
    assert store.key_count == len(expect)
    assert store.ttl_key_count == sum(e is not None for _p, e in expect.values())
    assert store.read_pages(sorted(pages) + [999_999]).keys() == set(pages)


def assert_reopened(store_factory, pages: dict[int, dict], checkpoint_lsn: int) -> None:
    """Opened again, the store holds ``pages`` under ``checkpoint_lsn``."""
    store = store_factory.open()
    try:
        assert store.checkpoint_lsn == checkpoint_lsn
        assert_index_agrees(store, pages)
    finally:
        store.close()


def commit(store: PageStore, images: list[PageImage], lsn: int, pages: dict[int, dict],
           **kw) -> list[bytes]:
    """Write a batch and apply it to the model ``pages``."""
    for img, ents in zip(images, kw.pop("model")):
        if ents:
            pages[img.page_id] = ents
        else:
            pages.pop(img.page_id, None)
    count = sum(len(e) for e in pages.values())
    ttl = sum(x is not None for e in pages.values() for _v, x in e.values())
    return store.write_batch(images, lsn, count, ttl, **kw)


def batch(store, pages, lsn, changes: dict[int, dict], **kw):
    imgs = [image(pid, ents, stored=pid in pages) for pid, ents in changes.items()]
    return commit(store, imgs, lsn, pages, model=list(changes.values()), **kw)


def test_a_new_store_is_empty(store_factory):
    store = store_factory.open(page_size=8)
    try:
        assert (store.page_size, store.checkpoint_lsn, store.key_count, store.ttl_key_count,
                store.max_page_id) == (8, 0, 0, 0, 0)
        assert store.ttl_clock == (0.0, -math.inf)
        assert list(store.scan_index()) == [] and list(store.iter_keys()) == []
        assert store.read_page(1) is None and store.any_key(set()) is None
        assert store.size_bytes() >= 0 and store.integrity_check() == []
    finally:
        store.close()


def test_the_index_agrees_with_the_pages_through_inserts_moves_deletes_and_clear(store_factory):
    store = store_factory.open(page_size=4)
    pages: dict[int, dict] = {}
    try:
        added = batch(store, pages, 3, {1: {"a": (b"1", None), "b": (b"2", 50.0)},
                                       2: {7: (b"x", None), (1, "t"): ([1, 2], None)}})
        assert sorted(added) == sorted(canonical_key(k) for k in ("a", "b", 7, (1, "t")))
        assert_index_agrees(store, pages)
        # "b" moves to page 2, page 1 changes value only for "a"; a new key on 2
        added = batch(store, pages, 5, {1: {"a": (b"1bis", None)},
                                       2: {7: (b"x", None), (1, "t"): ([1, 2], None),
                                           "b": (b"2", 60.0), "c": (b"3", None)}})
        assert sorted(added) == sorted(canonical_key(k) for k in ("b", "c"))  # new to page 2
        assert_index_agrees(store, pages)
        # a value-only change leaves the index alone (index_rows None)
        img = image(1, {"a": (b"1ter", None)}, index=False)
        commit(store, [img], 6, pages, model=[{"a": (b"1ter", None)}])
        assert_index_agrees(store, pages)
        batch(store, pages, 8, {1: {}})  # page 1 emptied: its row and index rows go
        assert_index_agrees(store, pages)
        assert store.any_key({2}) is None
        assert store.any_key(set()) in {(canonical_key(k), None) for k in pages[2]} | \
            {(canonical_key(k), encode_key(k)) for k in pages[2]}
        batch(store, pages.clear() or pages, 9, {3: {"z": (b"z", None)}}, clear=True)
        assert_index_agrees(store, pages)
        assert store.checkpoint_lsn == 9
    finally:
        store.close()


def test_expiry_queries_name_the_pages_with_expired_entries(store_factory):
    store = store_factory.open(page_size=4)
    pages: dict[int, dict] = {}
    try:
        batch(store, pages, 1, {1: {"a": (b"", 10.0), "b": (b"", 30.0)},
                               2: {"c": (b"", 20.0)}, 3: {"d": (b"", None)}})
        assert sorted(store.expired_by_page(25.0)) == [(1, 1), (2, 1)]
        assert sorted(store.expired_pages(25.0, set(), 10)) == [1, 2]
        assert store.expired_pages(25.0, {1}, 10) == [2]
        assert len(store.expired_pages(100.0, set(), 1)) == 1
        assert store.expired_by_page(5.0) == []
    finally:
        store.close()


def test_reopen_reads_what_was_committed(store_factory):
    store = store_factory.open(page_size=4)
    pages: dict[int, dict] = {}
    batch(store, pages, 4, {1: {"a": (b"1", 5.0)}, 5: {"b": (b"2", None)}},
          ttl_clock=(2.5, 1000.0))
    store.close()
    store = store_factory.open()
    try:
        assert store.page_size == 4 and store.checkpoint_lsn == 4 and store.max_page_id == 5
        assert store.ttl_clock == (2.5, 1000.0)
        assert_index_agrees(store, pages)
        batch(store, pages, 7, {5: {"b": (b"3", None), "c": (b"4", None)}})
    finally:
        store.close()
    assert_reopened(store_factory, pages, 7)


def test_checkpoints_follow_commits_in_order(store_factory):
    """Each committed batch's checkpoint is the store's, in memory and after
    reopen; a batch that fails leaves the previous one's."""
    store = store_factory.open(page_size=4)
    pages: dict[int, dict] = {}
    try:
        for lsn in (1, 2, 10, 11):
            batch(store, pages, lsn, {lsn: {f"k{lsn}": (b"v", None)}})
            assert store.checkpoint_lsn == lsn
        with pytest.raises(HeldKeyError):
            batch(store, dict(pages), 12, {20: {"k10": (b"moved", None)}}, held_pages={10})
        assert store.checkpoint_lsn == 11
    finally:
        store.close()
    assert_reopened(store_factory, pages, 11)


def test_a_refused_batch_writes_nothing(store_factory):
    """A key moving out of a held page is refused (HeldKeyError), and none of
    the batch's other pages, index rows or counts are written."""
    store = store_factory.open(page_size=4)
    pages: dict[int, dict] = {}
    try:
        batch(store, pages, 1, {1: {"a": (b"1", None)}, 2: {"b": (b"2", None)}})
        with pytest.raises(HeldKeyError):
            batch(store, dict(pages), 2, {2: {"b": (b"new", None), "x": (b"", 9.0)},
                                          3: {"a": (b"moved", None)}}, held_pages={1})
        assert (store.checkpoint_lsn, store.key_count, store.ttl_key_count) == (1, 2, 0)
        assert_index_agrees(store, pages)
    finally:
        store.close()


class _Boom(Exception):
    pass


def test_a_batch_failing_before_its_commit_writes_nothing(store_factory):
    store = store_factory.open(page_size=4)
    pages: dict[int, dict] = {}
    try:
        batch(store, pages, 1, {1: {"a": (b"1", None)}})

        def fail(*_a, **_kw):
            raise _Boom("injected: the commit did not happen")

        setattr(store, store_factory.commit_hook, fail)
        with pytest.raises((_Boom, StoreError)):
            batch(store, dict(pages), 2, {1: {}, 2: {"b": (b"2", 1.0)}}, clear=False,
                  ttl_clock=(1.0, 5.0))
        assert store.checkpoint_lsn == 1 and store.ttl_clock == (0.0, -math.inf)
        assert_index_agrees(store, pages)
    finally:
        store.__dict__.pop(store_factory.commit_hook, None)
        store.close()
    assert_reopened(store_factory, pages, 1)


_KILLED_WRITER = """
import sys
{open_store}
from tests.stores.test_conformance import batch
pages = {{}}
batch(store, pages, 1, {{1: {{"a": (b"1", None)}}, 2: {{"b": (b"2", None)}}}})
def stop(*a, **kw):
    print("in-commit", flush=True)
    sys.stdin.read()  # blocks until killed
setattr(store, {hook!r}, stop)
batch(store, pages, 2, {{1: {{}}, 2: {{"b": (b"3", None), "c": (b"4", 7.0)}}, 3: {{"d": (b"5", None)}}}},
      clear={clear})
"""


@pytest.mark.parametrize("clear", [False, True])
def test_a_batch_killed_inside_its_transaction_leaves_the_previous_state(store_factory, clear):
    """SIGKILL of a real process while its batch's transaction is open (all
    statements run, the commit not yet): the reopened store holds exactly the
    batch before."""
    store_factory.open(page_size=4).close()
    code = _KILLED_WRITER.format(open_store=store_factory.child_source(),
                                 hook=store_factory.commit_hook, clear=clear)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=root, text=True)
    try:
        deadline = time.monotonic() + 60
        line = ""
        while not line and time.monotonic() < deadline:
            ready, _, _ = select.select([proc.stdout], [], [], 1.0)
            if ready:
                line = proc.stdout.readline()
                if not line:
                    break
        assert line.strip() == "in-commit", proc.stderr.read() if proc.poll() is not None else line
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert_reopened(store_factory, {1: {"a": (b"1", None)}, 2: {"b": (b"2", None)}}, 1)


def test_a_damaged_page_is_never_served(store_factory):
    store = store_factory.open(page_size=4)
    pages: dict[int, dict] = {}
    batch(store, pages, 1, {1: {"a": (b"value-a", None)}, 2: {"b": (b"value-b", None)}})
    store.close()
    store_factory.corrupt_page(1)
    store = store_factory.open()
    try:
        with pytest.raises(CorruptStoreError):
            store.read_page(1)
        with pytest.raises(CorruptStoreError):
            store.find(canonical_key("a"))
        with pytest.raises(CorruptStoreError):
            store.read_pages([1, 2])
        assert page_keys(store, 2) == pages[2]  # the good page still reads
    finally:
        store.close()


@pytest.mark.parametrize("name, value", [("checkpoint_lsn", -1), ("key_count", -5),
                                         ("page_size", 0), ("ttl_key_count", 10**9)])
def test_meta_out_of_bounds_is_refused_at_open(store_factory, name, value):
    store = store_factory.open(page_size=4)
    batch(store, {}, 1, {1: {"a": (b"1", None)}})
    store.close()
    store_factory.set_meta(name, value)
    with pytest.raises(CorruptStoreError, match=name):
        store_factory.open().close()


def test_fixed_settings_conflict_is_a_config_error(store_factory):
    store_factory.open(page_size=4, serializer="safe").close()
    with pytest.raises(ConfigError):
        store_factory.open(page_size=8).close()
    with pytest.raises(ConfigError):
        store_factory.open(serializer="pickle").close()
    store = store_factory.open()
    try:
        assert store.page_size == 4
    finally:
        store.close()


def test_the_store_has_every_protocol_member(store_factory):
    """Every protocol member exists on the implementation (a typo'd or missing
    method fails here, not at a cache's first flush)."""
    store = store_factory.open()
    try:
        for name in ("find", "read_page", "read_pages", "locate_keys", "scan_index", "iter_keys",
                     "expired_by_page", "expired_pages", "any_key", "write_batch",
                     "pause_snapshot", "resume_snapshot", "size_bytes", "integrity_check",
                     "close", "path", "page_size", "checkpoint_lsn", "key_count",
                     "ttl_key_count", "max_page_id", "ttl_clock", "data_bytes",
                     "take_evicted"):
            assert hasattr(store, name), name
        assert isinstance(store, PageStore)
        store.pause_snapshot()
        store.resume_snapshot()
    finally:
        store.close()
    store.close()  # idempotent


# -- contract 7: size limit ------------------------------------------------------


def _blob_bytes(pages: dict[int, dict]) -> int:
    return sum(len(image(pid, ents).data) for pid, ents in pages.items())


def test_data_bytes_follow_every_write_rewrite_delete_and_clear(store_factory):
    store = store_factory.open()
    pages: dict[int, dict] = {}
    try:
        assert store.data_bytes == 0
        batch(store, pages, 1, {1: {"a": (b"x" * 100, None)}, 2: {"b": (b"y" * 10, 5.0)}})
        assert store.data_bytes == _blob_bytes(pages)
        batch(store, pages, 2, {1: {"a": (b"x" * 5000, None), "c": (1, None)}, 2: {}})
        assert store.data_bytes == _blob_bytes(pages)
        store.close()
        store = store_factory.open()
        assert store.data_bytes == _blob_bytes(pages)
        commit(store, [], 3, pages, model=[], clear=True)
        pages.clear()
        assert store.data_bytes == 0
    finally:
        store.close()


def _fill(store, pages, n_pages: int, value_bytes: int) -> int:
    """Pages 1..n_pages, one per batch (so page i was last used at LSN i)."""
    for pid in range(1, n_pages + 1):
        batch(store, pages, pid, {pid: {f"k{pid:03}-{j}": (bytes([pid]) * value_bytes, None)
                                        for j in range(2)}})
    return n_pages


def test_a_size_limit_evicts_least_recently_used_pages_not_kept(store_factory):
    store = store_factory.open()
    pages: dict[int, dict] = {}
    try:
        lsn = _fill(store, pages, 10, 1000)
        one = len(image(1, pages[1]).data)
        assert store.data_bytes == 10 * one
        # pages 3 and 5 were used again (they left memory at LSN 11); page 1 is kept
        limit = 6 * one
        added = batch(store, pages, lsn + 1, {}, size_limit=limit, keep_pages={1},
                      left_pages=[3, 5])
        assert added == []
        evicted = store.take_evicted()
        # least recently used first, skipping the kept page 1: 2, 4, 6, 7
        assert [e[0] for e in evicted] == [2, 4, 6, 7]
        assert all(e[1:] == (2, 0) for e in evicted)
        assert store.take_evicted() == []          # each reported once
        for pid, *_ in evicted:
            del pages[pid]
        assert store.data_bytes == 6 * one <= limit
        assert_index_agrees(store, pages)           # counts exclude the evicted entries
        for pid in pages:                           # every other key keeps its value
            assert page_keys(store, pid) == pages[pid]
        store.close()
        assert_reopened(store_factory, pages, lsn + 1)
        store = store_factory.open()
        assert store.data_bytes == 6 * one
    finally:
        store.close()


def test_eviction_goes_with_the_batch_that_passes_the_limit(store_factory):
    """Pages written in the batch are the most recently used: older ones go
    first, and TTL entries leave ttl_key_count."""
    store = store_factory.open()
    pages: dict[int, dict] = {}
    try:
        batch(store, pages, 1, {1: {"old": (b"o" * 3000, 99.0), "o2": (b"p", None)}})
        batch(store, pages, 2, {2: {"mid": (b"m" * 3000, None)}})
        limit = _blob_bytes({2: pages[2]}) + 4000
        batch(store, pages, 3, {3: {"new": (b"n" * 3000, None)}}, size_limit=limit,
              keep_pages=frozenset())
        assert [e for e in store.take_evicted()] == [(1, 2, 1)]
        del pages[1]
        assert store.ttl_key_count == 0 and store.key_count == 2
        assert_index_agrees(store, pages)
        assert store.data_bytes <= limit
    finally:
        store.close()


def test_only_kept_pages_left_stays_over_the_limit(store_factory):
    store = store_factory.open()
    pages: dict[int, dict] = {}
    try:
        lsn = _fill(store, pages, 3, 500)
        batch(store, pages, lsn + 1, {}, size_limit=1, keep_pages={1, 2, 3})
        assert store.take_evicted() == [] and store.data_bytes == _blob_bytes(pages)
        assert_index_agrees(store, pages)
    finally:
        store.close()


def test_an_evicting_batch_killed_before_its_commit_leaves_every_page(store_factory):
    store = store_factory.open()
    pages: dict[int, dict] = {}
    try:
        lsn = _fill(store, pages, 4, 800)
        before = store.data_bytes

        def boom(*a, **kw):
            raise _Boom("stop")

        setattr(store, store_factory.commit_hook, boom)
        with pytest.raises((_Boom, StoreError)):
            store.write_batch([], lsn + 1, 8, 0, size_limit=1, keep_pages=frozenset())
    finally:
        store.close()
    store = store_factory.open()
    try:
        assert store.data_bytes == before and store.take_evicted() == []
        assert_index_agrees(store, pages)
    finally:
        store.close()
