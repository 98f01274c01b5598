"""The write-behind batcher on its own, with no Cache: an in-memory source
of dirty pages and an in-memory page store that commits a batch whole or
not at all. Cycles run in the test's thread (``run_cycle``) where the order
matters, and through the real thread (``flush_until``) where waiting is the
point; nothing sleeps.

Checked: coalescing (a page written many times between flushes is written
once, at its latest version); the checkpoint LSN; a failing store (counted,
reported to the waiter, the pages kept dirty, success once it recovers); a
page that fails alone (the rest committed, the checkpoint kept below its
first change).
"""

from __future__ import annotations

import sqlite3
import threading

import pytest

from durablekv.batcher import Batch, WriteBehindBatcher
from durablekv.errors import WriteBehindError
from durablekv.stores.base import PageImage


class MemoryStore:
    """The part of the PageStore protocol the batcher calls, in memory: a
    batch is applied whole or not at all."""

    def __init__(self) -> None:
        self.pages: dict[int, bytes] = {}
        self.writes: dict[int, int] = {}  # page id -> times written
        self.checkpoint_lsn = 0
        self.ttl_clock = None
        self.data_bytes = 0
        self.fail_all: Exception | None = None  # every commit fails with it
        self.fail_pages: set[int] = set()       # a commit holding one of them fails
        self.commits = 0

    def write_batch(self, images, checkpoint_lsn, key_count, ttl_key_count, clear=False, *,
                    held_pages=frozenset(), ttl_clock=None):
        if self.fail_all is not None:
            raise self.fail_all
        bad = sorted(im.page_id for im in images if im.page_id in self.fail_pages)
        if bad:
            raise ValueError(f"page {bad[0]} cannot be encoded")
        for im in images:
            self.pages[im.page_id] = im.data
            self.writes[im.page_id] = self.writes.get(im.page_id, 0) + 1
        self.checkpoint_lsn = checkpoint_lsn
        self.commits += 1
        return []


class _Snap:
    """Dirty pages copied at take_snapshot: (page id, version, first LSN, data)."""

    def __init__(self, items: list, checkpoint_lsn: int) -> None:
        self.items = items
        self.checkpoint_lsn = checkpoint_lsn

    @property
    def size(self) -> int:
        return len(self.items)

    def page_id(self, index: int) -> int:
        return self.items[index][0]

    def build(self, indices=None, uncommitted=frozenset()) -> Batch:
        chosen = range(len(self.items)) if indices is None else indices
        images = [PageImage(self.items[i][0], 1, 0, self.items[i][3], None)
                  for i in chosen]
        checkpoint = self.checkpoint_lsn
        for j in uncommitted:  # stop below the first change not yet committed
            checkpoint = min(checkpoint, self.items[j][2] - 1)
        return Batch(images, checkpoint, 0, 0,
                     held_pages=frozenset(self.items[j][0] for j in uncommitted))


class MemorySource:
    """Pages written with LSNs; dirty until a flush of their version commits."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.pages: dict[int, tuple[int, int, bytes]] = {}  # id -> (version, first LSN, data)
        self.dirty: set[int] = set()
        self.last_lsn = 0
        self.failed: list[list[int]] = []   # the page ids of each flush_failed
        self.background = 0

    def write(self, page_id: int, data: bytes) -> int:
        with self.lock:
            self.last_lsn += 1
            version, first, _ = self.pages.get(page_id, (0, 0, b""))
            if page_id not in self.dirty:
                first = self.last_lsn
                self.dirty.add(page_id)
            self.pages[page_id] = (version + 1, first, data)
            return self.last_lsn

    def take_snapshot(self):
        with self.lock:
            if not self.dirty:
                return None
            items = [(pid, *self.pages[pid]) for pid in sorted(self.dirty)]
            return _Snap([(pid, v, first, data) for pid, v, first, data in items],
                         self.last_lsn)

    def flush_done(self, snap, indices, added) -> None:
        with self.lock:
            for i in (range(snap.size) if indices is None else indices):
                pid, version = snap.items[i][0], snap.items[i][1]
                if self.pages[pid][0] == version:  # not written since the snapshot
                    self.dirty.discard(pid)

    def flush_failed(self, snap, indices=None) -> None:
        self.failed.append([snap.items[i][0]
                            for i in (range(snap.size) if indices is None else indices)])

    def background_work(self) -> None:
        self.background += 1


def _batcher(source, store, **kw) -> WriteBehindBatcher:
    kw.setdefault("interval", 3600.0)  # cycles only when asked
    return WriteBehindBatcher(source, store, None, sync_log=False, name="t", path="mem", **kw)


def test_a_page_written_many_times_is_stored_once_at_its_latest_version():
    source, store = MemorySource(), MemoryStore()
    batcher = _batcher(source, store)
    for i in range(10):
        source.write(1, b"v%d" % i)
    last = source.write(2, b"other")
    batcher.run_cycle()
    assert store.pages == {1: b"v9", 2: b"other"}
    assert store.writes == {1: 1, 2: 1} and store.commits == 1
    assert store.checkpoint_lsn == last == 11
    assert source.dirty == set()
    batcher.run_cycle()  # nothing dirty: no commit
    assert store.commits == 1


def test_flush_until_waits_for_the_thread_to_commit_that_lsn():
    source, store = MemorySource(), MemoryStore()
    batcher = _batcher(source, store)
    batcher.start()
    try:
        lsn = source.write(7, b"x")
        batcher.flush_until(lsn, timeout=30)
        assert store.pages == {7: b"x"} and store.checkpoint_lsn >= lsn
        assert source.background >= 1  # background_work ran before the cycle
    finally:
        batcher.stop()
    assert not batcher.alive


def test_a_failing_store_is_reported_and_the_pages_wait_for_it_to_recover():
    source, store = MemorySource(), MemoryStore()
    store.fail_all = sqlite3.OperationalError("database is locked")
    batcher = _batcher(source, store, max_backoff=0.05)
    batcher.start()
    try:
        lsn = source.write(3, b"kept")
        with pytest.raises(WriteBehindError) as err:
            batcher.flush_until(lsn)
        assert err.value.__cause__ is store.fail_all
        assert batcher.failing and batcher.errors >= 1
        assert source.dirty == {3} and store.pages == {}
        # a whole-store error is retried, not split page by page
        assert all(f == [3] for f in source.failed)
        store.fail_all = None
        batcher.flush_until(lsn, timeout=30)
        assert store.pages == {3: b"kept"} and not batcher.failing
        assert source.dirty == set()
    finally:
        batcher.stop()


def test_a_page_that_fails_alone_is_isolated_and_the_checkpoint_stays_below_it():
    source, store = MemorySource(), MemoryStore()
    for pid in (1, 2, 3, 4):
        source.write(pid, b"page %d" % pid)  # LSNs 1-4
    store.fail_pages = {3}
    batcher = _batcher(source, store)
    with pytest.raises(WriteBehindError, match=r"page\(s\) \[3\]"):
        batcher.run_cycle()
    assert store.pages == {1: b"page 1", 2: b"page 2", 4: b"page 4"}
    assert source.dirty == {3} and source.failed[-1] == [3]
    # page 3's change (LSN 3) is not stored: a crash must replay it
    assert store.checkpoint_lsn == 2
    store.fail_pages = set()
    batcher.run_cycle()
    assert store.pages[3] == b"page 3" and store.checkpoint_lsn == 4
    assert source.dirty == set()
