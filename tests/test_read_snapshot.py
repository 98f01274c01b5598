"""Page faults and key lookups share one SQLite read transaction between
write-behind commits (Store.pause_snapshot / resume_snapshot): the reads see
exactly what per-statement reads would, and no read transaction is held
across a commit, so the WAL is still checkpointed and reset."""

from __future__ import annotations

import os
import random
import sqlite3
import threading

import pytest

from durablekv import Cache, WriteBehindError

from .conftest import opened


def _fill(c: Cache, n: int, tag: str = "v") -> None:
    for i in range(n):
        c.set(f"key{i:06d}", f"{tag}{i}".encode())


def test_faults_between_commits_share_one_read_transaction(tmp_path):
    with opened(tmp_path, page_size=4, max_pages=4, flush_interval=3600) as c:
        _fill(c, 400)
        c.flush()
        reader = c._store._r
        assert c.get("key000001") == b"v1"          # a page fault
        assert reader.in_transaction                # ... left its read transaction open
        assert c.get("key000201") == b"v201"        # the next one uses it
        assert c.stats().page_faults >= 2
        c.flush()   # nothing dirty, no commit: the transaction may stay
        c.set("key000002", b"new")
        c.flush()   # a commit: the read transaction ended before it
        assert not reader.in_transaction


def test_no_read_transaction_is_open_while_a_flush_commits(tmp_path, monkeypatch):
    with opened(tmp_path, page_size=4, max_pages=4, flush_interval=3600) as c:
        _fill(c, 400)
        c.flush()
        store = c._store
        seen = []
        real_commit = store._commit

        def commit(conn):
            seen.append(store._r.in_transaction)
            real_commit(conn)

        monkeypatch.setattr(store, "_commit", commit)
        for round_ in range(5):
            assert c.get(f"key{round_ * 50:06d}") == f"v{round_ * 50}".encode()  # fault: txn open
            c.set(f"key{round_ * 50 + 1:06d}", b"changed")
            c.flush()
        assert seen == [False] * 5


def test_reads_after_a_commit_see_it(tmp_path):
    """A key moved, changed or deleted by a flush and then evicted is read
    from the new commit, not from a snapshot taken before it."""
    with opened(tmp_path, page_size=4, max_pages=4, flush_interval=3600) as c:
        _fill(c, 400)
        c.flush()
        for i in range(0, 400, 37):
            assert c.get(f"key{i:06d}") == f"v{i}".encode()   # snapshot open now
            c.set(f"key{i:06d}", f"w{i}".encode())
            c.delete(f"key{i + 1:06d}")
            c.flush()
            _touch_others(c, i)                                # evict the changed pages
            assert c.get(f"key{i:06d}") == f"w{i}".encode()
            assert c.get(f"key{i + 1:06d}") is None
            assert f"key{i + 1:06d}" not in c


def _touch_others(c: Cache, i: int) -> None:
    for j in range(8):
        c.get(f"key{(i + 100 + 4 * j) % 400:06d}")


def test_wal_is_reset_while_reads_continue(tmp_path):
    """Reads between every commit must not starve the WAL checkpoint: the WAL
    file stays near SQLite's auto-checkpoint size (1000 pages of 4 KiB)
    instead of growing with every flush."""
    with opened(tmp_path, page_size=16, max_pages=8, flush_interval=3600) as c:
        _fill(c, 2000, tag="x" * 200)
        c.flush()
        for round_ in range(1000):
            for j in range(40):
                c.set(f"key{(round_ * 40 + j) % 2000:06d}", b"y" * 600)
            for j in range(10):
                c.get(f"key{(round_ * 97 + j * 131) % 2000:06d}")
            c.flush()
        wal = os.path.getsize(os.path.join(str(tmp_path), "pages.sqlite3-wal"))
        assert wal < 8 << 20, f"the WAL grew to {wal} bytes"


def test_concurrent_faults_flushes_and_writes_return_only_the_keys_own_values(tmp_path):
    """Two reader threads fault pages in while a writer overwrites, deletes
    and re-inserts keys and the batcher flushes every few milliseconds (a
    tiny memory tier, so almost every read is a page fault). A read must
    return a value written for that key, and a key that is never deleted
    must never read as missing."""
    stable = [f"s{i:05d}" for i in range(1500)]
    churn = [f"c{i:05d}" for i in range(500)]
    errors: list[str] = []
    done = threading.Event()
    with opened(tmp_path, page_size=4, max_pages=6, flush_interval=0.002,
                flush_batch_pages=8) as c:
        for k in stable + churn:
            c[k] = f"{k}:0"
        c.flush()

        def writer():
            rng = random.Random(1)
            try:
                for i in range(1, 12001):
                    k = rng.choice(stable if i % 3 else churn)
                    if k[0] == "c" and i % 2:
                        c.delete(k)
                    else:
                        c[k] = f"{k}:{i}"
            except Exception as exc:  # noqa: BLE001 - reported below
                errors.append(f"writer: {exc!r}")
            finally:
                done.set()

        def reader(seed):
            rng = random.Random(seed)
            try:
                while not done.is_set():
                    k = rng.choice(stable)
                    v = c.get(k)
                    if v is None or not v.startswith(k + ":"):
                        errors.append(f"{k} read {v!r}")
                    k = rng.choice(churn)
                    v = c.get(k)
                    if v is not None and not v.startswith(k + ":"):
                        errors.append(f"{k} read {v!r}")
            except Exception as exc:  # noqa: BLE001 - reported below
                errors.append(f"reader: {exc!r}")

        threads = [threading.Thread(target=writer)] + \
                  [threading.Thread(target=reader, args=(s,)) for s in (2, 3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert not any(t.is_alive() for t in threads)
        assert errors == [], errors[:5]
        st = c.stats()
        assert st.page_faults > 1000 and st.flushes > 10, st


def test_a_read_transaction_that_cannot_end_fails_the_flush_with_no_page_in_flight(
        tmp_path, monkeypatch):
    """Ending the read transaction is the first thing a snapshot does: if it
    fails, the flush fails before any page is handed to it, and the retry
    stores everything."""
    with opened(tmp_path, page_size=4, flush_interval=30.0) as c:
        for i in range(40):
            c[f"k{i}"] = i
        real_pause = c._store.pause_snapshot
        calls = []

        def pause():
            calls.append(1)
            if len(calls) == 1:
                raise sqlite3.OperationalError("disk I/O error")
            real_pause()

        monkeypatch.setattr(c._store, "pause_snapshot", pause)
        with pytest.raises(WriteBehindError):
            c.flush()
        dirty = list(c._tier.dirty.values())
        assert dirty and all(p.flight_lsn is None and p.dirty_lsn for p in dirty)
        c.flush()
        assert c.stats().checkpoint_lsn == c.stats().last_lsn
    with opened(tmp_path) as c:
        assert {k: c[k] for k in c} == {f"k{i}": i for i in range(40)}
