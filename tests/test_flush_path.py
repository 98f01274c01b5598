"""The write-behind flush path: index changes written as changes, many rows
per statement, and the store staying consistent with the pages throughout."""

from __future__ import annotations

import os
import shutil
import sqlite3
import tempfile
import threading

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, rule

from durablekv import Cache
from durablekv import codec as kvcodec
from durablekv.check import CheckResult, _check_store
from durablekv.tier.pages import EMPTY
from durablekv.stores.base import PageImage
from durablekv.stores.pageformat import encode_page
from durablekv.stores.sqlite import SQLitePageStore
from durablekv.stores.sqlitefile import read_only_uri

from .conftest import Clock, opened


# -- the store on its own ------------------------------------------------------------------


def _store(path, variable_limit: int | None = None) -> SQLitePageStore:
    store = SQLitePageStore(path)
    if variable_limit is not None:
        store._variable_limit = variable_limit
    return store


def _count_index_writes(store: SQLitePageStore) -> dict:
    """Count rows inserted into and deleted from the key index from now on."""
    conn = store._w
    conn.execute("CREATE TEMP TABLE IF NOT EXISTS index_writes (op TEXT)")
    conn.execute("CREATE TEMP TRIGGER IF NOT EXISTS count_ins AFTER INSERT ON main.keys "
                 "BEGIN INSERT INTO index_writes VALUES ('insert'); END")
    conn.execute("CREATE TEMP TRIGGER IF NOT EXISTS count_del AFTER DELETE ON main.keys "
                 "BEGIN INSERT INTO index_writes VALUES ('delete'); END")
    conn.execute("DELETE FROM index_writes")

    def counts() -> dict:
        got = dict(conn.execute("SELECT op, COUNT(*) FROM index_writes GROUP BY op"))
        conn.execute("DELETE FROM index_writes")
        return {"insert": got.get("insert", 0), "delete": got.get("delete", 0)}
    return counts


def _index(store: SQLitePageStore) -> dict:
    return {k: (pid, e, o) for k, pid, e, o in
            store._w.execute("SELECT key, page_id, expire_at, orig FROM keys")}


def _pages(store: SQLitePageStore) -> dict:
    return dict(store._w.execute("SELECT page_id, n_entries FROM pages"))


def _img(pid: int, rows, stored: bool = True, index: bool = True) -> PageImage:
    rows = list(rows)
    return PageImage(pid, len(rows), sum(e is not None for _, e, _ in rows),
                     b"page %d" % pid, rows if index else None, stored)


def _rows(*keys: str, expire: float | None = None):
    return [(k.encode(), expire, None) for k in keys]


def _write(store: SQLitePageStore, *images: PageImage, clear: bool = False) -> None:
    store.write_batch(list(images), store.checkpoint_lsn + 1, 0, 0, clear)


def test_new_page_inserts_its_rows_and_deletes_nothing(tmp_path):
    store = _store(tmp_path)
    counts = _count_index_writes(store)
    _write(store, _img(1, _rows("a", "b", "c"), stored=False))
    assert counts() == {"insert": 3, "delete": 0}
    assert _index(store) == {b"a": (1, None, None), b"b": (1, None, None),
                             b"c": (1, None, None)}
    store.close()


def test_page_that_only_grew_inserts_only_its_new_keys(tmp_path):
    store = _store(tmp_path)
    keys = [f"k{i}" for i in range(10)]
    _write(store, _img(1, _rows(*keys), stored=False))
    counts = _count_index_writes(store)
    _write(store, _img(1, _rows(*keys, "k10", "k11")))
    assert counts() == {"insert": 2, "delete": 0}
    assert len(_index(store)) == 12 and _pages(store) == {1: 12}
    store.close()


def test_stored_page_writes_only_the_rows_that_differ(tmp_path):
    store = _store(tmp_path)
    _write(store, _img(1, _rows("a", "b", "c", "d"), stored=False))
    counts = _count_index_writes(store)
    # "a" kept, "b" gone, "c" gets an expire_at, "d" gets an orig, "e" is new
    rows = [(b"a", None, None), (b"c", 5.0, None), (b"d", None, b"D"), (b"e", None, None)]
    _write(store, _img(1, rows))
    assert counts() == {"insert": 3, "delete": 1}
    assert _index(store) == {b"a": (1, None, None), b"c": (1, 5.0, None),
                             b"d": (1, None, b"D"), b"e": (1, None, None)}
    store.close()


def test_value_only_change_leaves_the_index_alone(tmp_path):
    store = _store(tmp_path)
    _write(store, _img(1, _rows("a", "b"), stored=False))
    counts = _count_index_writes(store)
    _write(store, _img(1, _rows("a", "b"), index=False))
    assert counts() == {"insert": 0, "delete": 0}
    assert _pages(store) == {1: 2}
    store.close()


def test_emptied_page_loses_its_row_and_index_rows(tmp_path):
    store = _store(tmp_path)
    _write(store, _img(1, _rows("a", "b"), stored=False), _img(2, _rows("c"), stored=False))
    _write(store, _img(1, []))
    assert _pages(store) == {2: 1} and _index(store) == {b"c": (2, None, None)}
    store.close()


@pytest.mark.parametrize("order", ["from_first", "to_first"])
def test_key_moving_between_pages_in_one_batch(tmp_path, order):
    store = _store(tmp_path)
    _write(store, _img(1, _rows("a", "b"), stored=False), _img(2, _rows("c"), stored=False))
    src, dst = _img(1, _rows("a")), _img(2, _rows("c", "b"))
    _write(store, *([src, dst] if order == "from_first" else [dst, src]))
    assert _index(store) == {b"a": (1, None, None), b"b": (2, None, None),
                             b"c": (2, None, None)}
    # ... and into a page never stored before
    _write(store, _img(1, []), _img(3, _rows("a"), stored=False))
    assert _index(store) == {b"a": (3, None, None), b"b": (2, None, None),
                             b"c": (2, None, None)}
    store.close()


def test_index_rows_go_in_in_key_order(tmp_path):
    """Random keys spread over pages are inserted sorted, so rows that share
    a B-tree leaf are written one after another."""
    import random
    store = _store(tmp_path, variable_limit=40)
    keys = [b"%016x" % random.Random(3).getrandbits(64) for _ in range(100)]
    keys = list(dict.fromkeys(keys))
    conn = store._w
    conn.execute("CREATE TEMP TABLE inserted (key BLOB)")
    conn.execute("CREATE TEMP TRIGGER log_ins AFTER INSERT ON main.keys "
                 "BEGIN INSERT INTO inserted VALUES (new.key); END")
    pages = [_img(1 + i // 8, [(k, None, None) for k in keys[i:i + 8]], stored=False)
             for i in range(0, len(keys), 8)]
    _write(store, *pages)
    got = [r[0] for r in conn.execute("SELECT key FROM inserted ORDER BY rowid")]
    assert got == sorted(keys)
    store.close()


@pytest.mark.parametrize("limit", [7, 999, 32766])
@pytest.mark.parametrize("n", [0, 1, 2, 3, 63, 64, 65, 255, 256, 257, 1000])
def test_rows_in_any_number_are_all_written(tmp_path, limit, n):
    store = _store(tmp_path, variable_limit=limit)
    keys = [f"k{i:05d}" for i in range(n)]
    pages = [_img(1 + i // 16, _rows(*keys[i:i + 16]), stored=False) for i in range(0, n, 16)]
    _write(store, *pages)
    assert len(_index(store)) == n
    assert sum(_pages(store).values()) == n
    store.close()


_PAGE_IDS = st.integers(1, 6)
_KEYS = st.sampled_from([b"k%d" % i for i in range(12)])
_ROW = st.tuples(_KEYS, st.sampled_from([None, 1.0, 2.0]), st.sampled_from([None, b"o"]))


@settings(max_examples=80, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(batches=st.lists(st.tuples(st.booleans(),
                                  st.dictionaries(_PAGE_IDS, st.lists(_ROW, max_size=5),
                                                  max_size=4)),
                        min_size=1, max_size=8),
       limit=st.sampled_from([5, 999]))
def test_index_matches_a_model_after_any_batches(tmp_path_factory, batches, limit):
    """Random batches of page images (keys moving between pages, pages
    growing, shrinking and emptying, clears) leave exactly the model's rows
    behind, with ``stored`` set as the cache sets it: for pages whose row
    is committed."""
    store = _store(tmp_path_factory.mktemp("s"), variable_limit=limit)
    index: dict[bytes, tuple] = {}   # key -> (page_id, expire_at, orig)
    pages: dict[int, int] = {}       # page_id -> n_entries
    try:
        for clear, chosen in batches:
            if clear:
                index, pages = {}, {}
            seen: set[bytes] = set()
            images = []
            for pid, rows in chosen.items():
                # a key is on one page of a batch (as in one snapshot of the cache)
                rows = [(k, e, o) for k, e, o in rows if not (k in seen or seen.add(k))]
                images.append(_img(pid, rows, stored=pid in pages))
            store.write_batch(images, store.checkpoint_lsn + 1, 0, 0, clear)
            index = {k: v for k, v in index.items() if v[0] not in chosen}
            for img in images:
                for k, e, o in img.index_rows:
                    index[k] = (img.page_id, e, o)
                if img.n:
                    pages[img.page_id] = img.n
                else:
                    pages.pop(img.page_id, None)
            assert _index(store) == index
            assert _pages(store) == pages
    finally:
        store.close()


# -- the cache: what a flush builds ----------------------------------------------------

_ODD_KEYS = ["plain", "", "ünïcödé", "\ud800 lone surrogate", b"bytes", b"", 7, -1, 2 ** 70,
             1.5, 2.0, True, None, (1, "x", (2.0, b"y")), ()]
_ODD_VALUES = [b"raw", b"", "text", 1, 2.5, None, True, [1, 2], {"a": (1, b"b")}, (1,), 2 ** 80]


@pytest.mark.parametrize("serializer", ["safe", "pickle"])
def test_built_pages_and_index_rows_match_the_codec(tmp_path, serializer):
    """The flush's inlined encodings (str keys, bytes values) give exactly
    the bytes of ``encode_key``/``to_blob``/``canonical_key``."""
    with opened(tmp_path / "c", page_size=4, flush_batch_pages=10_000,
                serializer=serializer) as cache:
        for i, k in enumerate(_ODD_KEYS):
            cache[k] = _ODD_VALUES[i % len(_ODD_VALUES)]
        snap = cache._take_snapshot()
        try:
            batch = snap.build()
        finally:
            cache._flush_failed(snap)
        codec = cache._codec
        for item, img in zip(snap.items, batch.images):
            keys, values, expires = item[4], item[5], item[6]
            entries, rows = [], []
            for slot, k in enumerate(keys):
                if k is EMPTY:
                    continue
                kb, ck = kvcodec.encode_key(k), kvcodec.canonical_key(k)
                entries.append((slot, kb, codec.to_blob(values[slot]), expires[slot]))
                rows.append((ck, expires[slot], None if ck == kb else kb))
            assert img.data == encode_page(entries)
            assert list(img.index_rows) == rows
            assert img.stored is False


@pytest.mark.parametrize("keys", [
    [f"k{i}" for i in range(11)],                   # str keys: the column fast path
    [f"k{i}" for i in range(10)] + ["clé"],         # one non-ASCII key: the general path
    [f"k{i}" for i in range(10)] + [10],            # one int key among str keys
])
def test_column_fast_path_builds_what_encode_page_builds(tmp_path, keys):
    """Pages of str keys and bytes values (full, partly empty, with TTLs)
    take build()'s column path; the blob and index rows must be exactly
    those of the general path."""
    with opened(tmp_path / "c", page_size=4, flush_batch_pages=10_000) as cache:
        for i, k in enumerate(keys):
            cache.set(k, b"v" * i, expire=None if i % 3 else 60.0 + i)
        cache.flush()
        cache.delete(keys[1])            # leaves an empty slot in the first page
        cache[keys[2]] = b"changed"      # a value-only change
        cache.set(keys[-1], b"new", expire=5.0)
        snap = cache._take_snapshot()
        try:
            batch = snap.build()
        finally:
            cache._flush_failed(snap)
        assert batch.images
        for item, img in zip(snap.items, batch.images):
            page_keys, values, expires = item[4], item[5], item[6]
            entries = [(s, kvcodec.encode_key(k), cache._codec.to_blob(values[s]), expires[s])
                       for s, k in enumerate(page_keys) if k is not EMPTY]
            assert img.data == encode_page(entries)
            if img.index_rows is not None:
                rows = []
                for s, kb, _vb, e in entries:
                    ck = kvcodec.canonical_key(page_keys[s])
                    rows.append((ck, e, None if ck == kb else kb))
                assert list(img.index_rows) == rows
            assert img.n == len(entries)


# -- the cache: index and pages agree after every flush ---------------------------------

_CACHE_KEYS = st.one_of(st.integers(0, 9), st.sampled_from(["a", "b", 1.0, True, (1, "x"),
                                                             b"a", 2.5]))


def check_committed(directory: str) -> CheckResult:
    """``durablekv check``'s store checks on what is committed now, while the
    cache stays open. The write-behind may commit at any time, even after
    flush() returns (its expiry sweep rewrites pages on its own), and the
    checker reads with many statements, so it checks a copy taken in one
    read transaction (SQLite's backup API)."""
    copy = tempfile.mkdtemp(prefix="durablekv-flush-copy-")
    try:
        src = sqlite3.connect(read_only_uri(os.path.join(directory, "pages.sqlite3")), uri=True)
        dst = sqlite3.connect(os.path.join(copy, "pages.sqlite3"))
        try:
            src.backup(dst)
        finally:
            dst.close()
            src.close()
        r = CheckResult()
        _check_store(copy, r)
        return r
    finally:
        shutil.rmtree(copy, ignore_errors=True)


class FlushesKeepTheStoreConsistent(RuleBasedStateMachine):
    """Sets, deletes, expiries and reopenings on a tiny memory tier; after each
    flush the committed store passes ``durablekv check``'s agreement checks
    and holds what the cache holds."""

    @initialize(page_size=st.sampled_from([1, 2, 4]), max_pages=st.integers(1, 3))
    def open_cache(self, page_size, max_pages):
        self.dir = tempfile.mkdtemp(prefix="durablekv-flush-")
        self.clock = Clock()
        self.opts = dict(page_size=page_size, max_pages=max_pages, clock=self.clock,
                         flush_interval=3600, flush_batch_pages=2)
        self.cache = Cache(self.dir, **self.opts)
        self.model: dict = {}

    def teardown(self):
        if hasattr(self, "cache"):
            self.cache.close()
            shutil.rmtree(self.dir, ignore_errors=True)

    @rule(key=_CACHE_KEYS, value=st.integers(), ttl=st.sampled_from([None, None, 1.0, 5.0]))
    def set(self, key, value, ttl):
        self.cache.set(key, value, expire=ttl)
        self.model[key] = (value, None if ttl is None else self.clock.now + ttl)

    @rule(key=_CACHE_KEYS)
    def delete(self, key):
        self.cache.delete(key)
        self.model.pop(key, None)

    @rule()
    def time_passes(self):
        self.clock.now += 2.0

    @rule()
    def flush_and_check(self):
        self.cache.flush()
        r = check_committed(self.dir)
        assert r.ok, r.lines
        live = {k: v for k, (v, t) in self.model.items() if t is None or self.clock.now < t}
        assert dict(self.cache.items()) == live

    @rule()
    def reopen(self):
        self.cache.close()
        self.cache = Cache(self.dir, **self.opts)


TestFlushesKeepTheStoreConsistent = FlushesKeepTheStoreConsistent.TestCase
TestFlushesKeepTheStoreConsistent.settings = settings(
    max_examples=80, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])


# -- pacing -------------------------------------------------------------------------------


def test_duty_cycle_pause_is_in_proportion_to_rewritten_pages(tmp_path):
    with opened(tmp_path / "c") as cache:
        b = cache._batcher
        b._cycle_pages, b._cycle_rewritten = 0, 0
        assert b.pause_after(0.1) == pytest.approx(0.3)  # nothing written: as before
        b._cycle_pages, b._cycle_rewritten = 100, 100
        assert b.pause_after(0.1) == pytest.approx(0.3)  # only hot pages: full pause
        b._cycle_pages, b._cycle_rewritten = 100, 25
        assert b.pause_after(0.1) == pytest.approx(0.075)
        b._cycle_pages, b._cycle_rewritten = 100, 0
        assert b.pause_after(0.1) == 0.0                 # only new pages: no pause


def test_batch_counts_the_pages_stored_before(tmp_path):
    with opened(tmp_path / "c", page_size=2, flush_batch_pages=10_000) as cache:
        for i in range(6):
            cache[i] = i  # three new pages
        snap = cache._take_snapshot()
        batch = snap.build()
        cache._flush_failed(snap)
        assert len(batch.images) == 3 and batch.rewritten == 0
        cache.flush()
        cache[0] = "again"  # one stored page rewritten ...
        cache[6] = 6        # ... and one new one
        snap = cache._take_snapshot()
        batch = snap.build()
        cache._flush_failed(snap)
        assert len(batch.images) == 2 and batch.rewritten == 1


def test_pages_dirtied_during_a_flush_are_flushed_right_after_it(tmp_path, monkeypatch):
    """The writers' kick comes when exactly flush_batch_pages pages are dirty;
    pages dirtied while a flush runs (the flushed ones still counted) pass
    that mark unseen, so the end of the flush kicks again instead of leaving
    them for flush_interval (here 30 s)."""
    with opened(tmp_path / "c", page_size=1, flush_batch_pages=2) as cache:
        first_started, release = threading.Event(), threading.Event()
        calls = []
        done = threading.Condition()
        real = cache._store.write_batch

        def write_batch(images, *args, **kwargs):
            if not calls:
                first_started.set()
                assert release.wait(10)
            added = real(images, *args, **kwargs)
            with done:
                calls.append(len(images))
                done.notify_all()
            return added

        monkeypatch.setattr(cache._store, "write_batch", write_batch)
        cache["a"], cache["b"] = 1, 2           # 2 dirty pages: the writers' kick
        assert first_started.wait(10)
        for k in "cdef":                        # 6, then 4 dirty: no exact 2 seen
            cache[k] = 0
        release.set()
        with done:
            assert done.wait_for(lambda: len(calls) >= 2, 10), calls
        assert calls[:2] == [2, 4]


def test_consecutive_flushes_follow_key_changes(tmp_path):
    """Flush after flush of one page, the column path and the general path
    build the same blob through inserts, deletes, TTL and value-type changes."""
    def built_matches(cache):
        snap = cache._take_snapshot()
        try:
            batch = snap.build()
        finally:
            cache._flush_failed(snap)
        for item, img in zip(snap.items, batch.images):
            page_keys, values, expires = item[4], item[5], item[6]
            entries = [(s, kvcodec.encode_key(k), cache._codec.to_blob(values[s]), expires[s])
                       for s, k in enumerate(page_keys) if k is not EMPTY]
            assert img.data == encode_page(entries)
        cache.flush()

    with opened(tmp_path / "c", page_size=4, flush_batch_pages=10_000) as cache:
        for k in "abcd":
            cache[k] = b"1"
        built_matches(cache)
        cache["a"] = b"2"                 # value only
        built_matches(cache)
        del cache["b"]                    # key set shrinks
        built_matches(cache)
        cache["e"] = b"3"                 # the free slot is taken by a new key
        built_matches(cache)
        cache.set("c", b"4", expire=100)  # an expire_at changes
        built_matches(cache)
        cache["d"] = "not bytes"          # a value the column path does not take
        built_matches(cache)
        cache["d"] = b"bytes again"
        built_matches(cache)
    with opened(tmp_path / "c") as cache:
        assert dict(cache.items()) == {"a": b"2", "c": b"4", "d": b"bytes again", "e": b"3"}
