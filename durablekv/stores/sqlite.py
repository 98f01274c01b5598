"""The SQLite page store, the first :class:`~durablekv.stores.base.PageStore`: pages, the key index and the checkpoint LSN.

File: ``pages.sqlite3`` in the cache directory, plain SQLite in WAL mode
(``sqlite3 pages.sqlite3 .schema`` shows a readable schema). The schema comes
from the SQL files of the top-level ``migrations/`` folder, shipped inside the
package as ``durablekv.migrations``; ``PRAGMA user_version`` records how many
have been applied.

Tables:

* ``pages(page_id, n_entries, data, crc, last_use)``: one row per non-empty
  page; ``last_use`` (schema 4) orders pages for ``size_limit`` eviction.
* ``keys(key, page_id, expire_at, orig)``: the key index, canonical key bytes
  (see :func:`durablekv.codec.canonical_key`) to the page holding the entry.
* ``meta(name, value)``: ``page_size`` and ``serializer`` (fixed at creation),
  ``checkpoint_lsn``, ``key_count``, ``ttl_key_count`` and ``data_bytes``
  (the page blobs' total length) (set by every flush),
  and, once the TTL clock has had to step over a wall clock that went back,
  ``ttl_clock_offset`` (seconds added to the wall clock) and ``ttl_clock_now``
  (the latest TTL time then), so that TTL time stays monotonic across opens.

Page blobs: :mod:`durablekv.stores.pageformat` (format spec and codec);
the protocol this store implements: :class:`durablekv.stores.base.PageStore`.

Threads: the write connection is used only by the write-behind batcher's
thread (and by open/close, when that thread is not running); the read
connection only under the cache's lock. WAL lets the reader proceed while a
flush transaction is open (invariant 7: the hot path never waits for the
batcher). ``sqlite3.Error`` is translated to :mod:`durablekv.errors` in one
place, :func:`_translate`.
"""

from __future__ import annotations

import contextlib
import itertools
from itertools import repeat
import logging
import math
import operator
import os
import sqlite3
from typing import AbstractSet as Set
from typing import Any, Container, Iterator, Sequence

from .._perms import FILE_MODE
from ..errors import ConfigError, CorruptStoreError, HeldKeyError, SchemaVersionError, StoreError
from .base import MISSING_PAGE_SIZE, PageImage, meta_problems
from .pageformat import page_crc
from .sqlitefile import (STORE_FILE, _check_header, _fsync_parent, _nonempty,
                         _norm_codec, _remove_orphans, _statements, _translate, mark_damaged,
                         migration_files)

log = logging.getLogger("durablekv.store")

__all__ = ["SQLitePageStore"]

_FIND_SQL = ("SELECT k.page_id, p.n_entries, p.data, p.crc FROM keys AS k "
             "LEFT JOIN pages AS p ON p.page_id = k.page_id WHERE k.key = ?")


class SQLitePageStore:
    """Pages and the key index in one SQLite file.

    :param directory: the cache directory (must exist).
    :param durability: ``"fsync"``/``"log"`` commit with ``synchronous=FULL``
        (a committed flush survives power loss, so the log may be cut back
        behind it); ``"none"`` uses ``synchronous=NORMAL``.
    :param page_size: slots per page; None adopts the stored value (16 for a
        new store).
    :param serializer: name of the value codec; fixed at creation.
    :param busy_timeout: seconds SQLite waits on a lock held by another
        process before a statement fails (the batcher then retries).
    :param verify: check every page's checksum at open (a store about to
        be rebuilt if damaged).
    :param rebuilt_from: where the damaged store this one replaces was
        moved (:func:`~durablekv.stores.factory.open_store` sets it), kept
        as :attr:`rebuilt_from`.
    :raises CorruptStoreError: the file is not a readable durablekv store.
    :raises SchemaVersionError: the file comes from a newer durablekv.
    :raises ConfigError: ``page_size``/``serializer`` differ from the stored ones.
    """

    #: Bytes the ``-wal`` file is cut back to when it starts over after a
    #: checkpoint (SQLite's ``journal_size_limit``).
    wal_size_limit = 16 << 20

    def __init__(self, directory: str | os.PathLike, *, durability: str = "log",
                 page_size: int | None = None, serializer: str = "safe",
                 busy_timeout: float = 5.0, verify: bool = False,
                 rebuilt_from: str | None = None) -> None:
        self.path = os.path.join(os.fspath(directory), STORE_FILE)
        #: the damaged store this one replaced (moved aside), or None
        self.rebuilt_from = rebuilt_from
        self._w: sqlite3.Connection | None = None
        self._r: sqlite3.Connection | None = None
        # Reads may share one read transaction between commits (see
        # pause_snapshot); off until the cache's first flush protocol says so.
        self._snapshot_reads = False
        ready = self.path + ".ready"
        if os.path.exists(ready):
            if os.path.lexists(self.path):
                # a rebuild killed before it moved the damaged store aside:
                # the next rebuild prepares a new one
                os.unlink(ready)
            else:  # ... killed after: the prepared store is installed now
                # (anything the damaged store left behind is not the new one's)
                _remove_orphans(self.path)
                os.replace(ready, self.path)
                _fsync_parent(self.path)
        existed = os.path.exists(self.path)
        if existed and os.path.getsize(self.path) == 0 and not _nonempty(self.path + "-wal"):
            # A store is created whole, under another name, and renamed into
            # place (_create): an empty one was truncated or replaced since.
            raise CorruptStoreError(self.path, "the file is empty (0 bytes), which a durablekv "
                                    "store never is: it was truncated, and the cache's data "
                                    "with it, or an earlier durablekv release was killed while "
                                    "creating it (then the cache held nothing)")
        marker = self.path + ".damaged"
        if existed and os.path.exists(marker):
            with open(marker, encoding="utf-8", errors="replace") as f:
                first = f.readline().strip()
            raise CorruptStoreError(self.path, f"damage found while it was in use: {first}")
        if existed:
            _check_header(self.path)
        try:
            with _translate(self.path, "open"):
                if not existed and not os.path.islink(self.path):
                    # (a dangling symlink is left to SQLite, which follows it
                    # or says it cannot; a rename would replace the link)
                    _remove_orphans(self.path)
                    self._create(page_size, serializer)
                self._w = self._connect(durability, busy_timeout)
                getlimit = getattr(self._w, "getlimit", None)  # Python 3.11+
                # bound parameters a statement may have (999 in SQLite < 3.32)
                self._variable_limit = (getlimit(sqlite3.SQLITE_LIMIT_VARIABLE_NUMBER)
                                        if getlimit is not None else 999)
                self._migrate()
                self._settings(page_size, serializer)
                st = os.stat(self.path)
                self._identity = (st.st_dev, st.st_ino)
                self._r = self._connect(durability, busy_timeout)
                self._r.execute("PRAGMA query_only = ON")
                self._find_cursor = self._r.cursor()
                if verify and existed:
                    rows = [r[0] for r in self._w.execute("PRAGMA quick_check")]
                    if rows != ["ok"]:
                        raise CorruptStoreError(self.path, "quick_check: " + "; ".join(rows[:3]))
                meta = dict(self._w.execute("SELECT name, value FROM meta"))
                # (one min() or max() per statement: SQLite reads one B-tree path for
                # it; both in one statement scan the whole table)
                max_pid, min_pid = (self._w.execute("SELECT MAX(page_id) FROM pages").fetchone()[0],
                                    self._w.execute("SELECT MIN(page_id) FROM pages").fetchone()[0])
                problems = meta_problems(meta, max_pid, min_pid, self.size_bytes())
                if problems:
                    raise CorruptStoreError(self.path, "; ".join(problems))
        except BaseException:
            self.close()
            raise
        self.checkpoint_lsn: int = meta["checkpoint_lsn"]
        self.key_count: int = meta["key_count"]
        self.ttl_key_count: int = meta["ttl_key_count"]
        #: bytes of the page blobs as last committed (what size_limit bounds)
        self.data_bytes: int = int(meta.get("data_bytes", 0))
        self._evicted: list[tuple[int, int, int]] = []  # see take_evicted()
        self.max_page_id: int = max_pid or 0
        #: ``(offset, now)`` of the TTL clock as last committed (see
        #: ``Cache._now``); ``(0.0, -inf)`` when it never had to step over a
        #: clock that went back.
        self.ttl_clock: tuple[float, float] = (
            (0.0, -math.inf) if meta.get("ttl_clock_offset") is None else
            (float(meta["ttl_clock_offset"]), float(meta.get("ttl_clock_now", -math.inf))))

    # -- opening -----------------------------------------------------------------

    def _create(self, page_size: int | None, serializer: str, target: str | None = None,
                checkpoint_lsn: int = 0) -> None:
        """Make a new store whole under a temporary name, then rename it to
        ``target`` (``pages.sqlite3``), so that the store never exists half
        made: a process killed here leaves no store (the next open starts
        again), and an empty or headless file is damage, not a new store."""
        tmp = self.path + ".new"
        for stale in (tmp, tmp + "-journal"):
            if os.path.exists(stale):
                os.unlink(stale)
        # Created private (0600) before SQLite opens it: SQLite gives its
        # -journal, -wal and -shm files the mode of the database file.
        os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE))
        conn = sqlite3.connect(tmp, isolation_level=None)
        try:
            self._w = conn  # rollback journal here; _connect switches to WAL
            self._migrate()
            self._settings(page_size, serializer)
            if checkpoint_lsn:
                conn.execute("UPDATE meta SET value = ? WHERE name = 'checkpoint_lsn'",
                             (checkpoint_lsn,))
        finally:
            self._w = None
            conn.close()
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, target or self.path)
        _fsync_parent(self.path)

    @classmethod
    def prepare_rebuild(cls, directory: str | os.PathLike, *, page_size: int | None,
                        serializer: str, checkpoint_lsn: int) -> None:
        """Build the empty store that replaces a damaged one, whole, as
        ``pages.sqlite3.ready``, before the damaged one is moved aside. The
        next open installs it when ``pages.sqlite3`` is gone (see
        ``__init__``), so a process killed anywhere in a rebuild leaves
        either the damaged store (the rebuild runs again) or the new one.

        :param checkpoint_lsn: the new store's checkpoint: the LSN before the
            replay log's first record, so that the store continues the log.
        """
        self = cls.__new__(cls)
        self.path = os.path.join(os.fspath(directory), STORE_FILE)
        self._w = None
        self._create(page_size, serializer, self.path + ".ready", checkpoint_lsn)

    def _connect(self, durability: str, busy_timeout: float) -> sqlite3.Connection:
        conn = sqlite3.connect(self.path, timeout=busy_timeout, isolation_level=None,
                               check_same_thread=False)
        conn.execute(f"PRAGMA busy_timeout = {int(busy_timeout * 1000)}")
        mode = conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
        if str(mode).lower() != "wal":
            raise StoreError(f"could not put {self.path!r} in WAL mode (got {mode!r}); "
                             "the file system may not support shared memory", self.path)
        conn.execute("PRAGMA synchronous = " + ("NORMAL" if durability == "none" else "FULL"))
        # SQLite's automatic checkpoints (every 1000 WAL pages, after a
        # commit) copy the WAL into the file but leave the -wal file at its
        # largest size: under load it grew to 2.5x the store, shrinking only
        # at close. With a size limit, the WAL is cut back to it each time it
        # starts over after a checkpoint, while the cache runs.
        conn.execute(f"PRAGMA journal_size_limit = {int(self.wal_size_limit)}")
        return conn

    def _migrate(self) -> None:
        conn = self._w
        assert conn is not None
        migrations = migration_files()
        # used by 0003_page_checksums to give existing pages their checksum
        conn.create_function("durablekv_page_crc", 3, page_crc, deterministic=True)
        current = conn.execute("PRAGMA user_version").fetchone()[0]
        if current > len(migrations):
            raise SchemaVersionError(self.path, current, len(migrations))
        if current == 0:
            names = {r[0] for r in conn.execute("SELECT name FROM sqlite_master")}
            if names:
                raise CorruptStoreError(self.path, "a SQLite database that is not a durablekv store "
                                        f"(tables {sorted(names)!r})")
        for version, name, sql in migrations[current:]:
            conn.execute("BEGIN IMMEDIATE")
            try:
                for stmt in _statements(sql):
                    conn.execute(stmt)
                conn.execute(f"PRAGMA user_version = {version}")
                conn.execute("COMMIT")
            except BaseException:
                # An interrupt (Ctrl-C, SIGTERM in the CLI) may land just after
                # COMMIT; rolling back then would hide it behind "no transaction".
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                raise
        if 0 < current < len(migrations):
            # One way: there is no downgrade, and a durablekv that knows only
            # the old version refuses the store from now on (SchemaVersionError).
            log.warning("upgraded page store %s from schema version %d to %d (%s); a "
                        "durablekv that supports only schema version %d can no longer open "
                        "it", self.path, current, len(migrations),
                        ", ".join(name for _, name, _ in migrations[current:]), current)

    def _settings(self, page_size: int | None, serializer: str) -> None:
        conn = self._w
        assert conn is not None
        stored = dict(conn.execute(
            "SELECT name, value FROM meta WHERE name IN ('page_size', 'serializer')"))
        if "page_size" not in stored:
            if "serializer" in stored or \
                    conn.execute("SELECT 1 FROM pages LIMIT 1").fetchone() is not None:
                raise CorruptStoreError(self.path, MISSING_PAGE_SIZE)
            self.page_size = 16 if page_size is None else page_size
            conn.execute("INSERT INTO meta (name, value) VALUES ('page_size', ?), ('serializer', ?)",
                         (self.page_size, serializer))
            self.serializer = serializer
            return
        problems = meta_problems({k: stored[k] for k in ("page_size", "serializer") if k in stored}
                                 | {"checkpoint_lsn": 0, "key_count": 0, "ttl_key_count": 0},
                                 None, None, 0)
        if problems:
            raise CorruptStoreError(self.path, "; ".join(problems))
        self.page_size = stored["page_size"]
        self.serializer = str(stored.get("serializer", "safe"))
        if page_size is not None and page_size != self.page_size:
            raise ConfigError(
                f"{self.path!r} was created with page_size={self.page_size}, not {page_size}; "
                f"open it without page_size (or with page_size={self.page_size}), "
                "or use a new directory")
        if _norm_codec(serializer) != _norm_codec(self.serializer):
            raise ConfigError(
                f"{self.path!r} stores values with serializer={self.serializer!r}, not "
                f"{serializer!r}; open it with serializer={self.serializer!r}")

    # -- reads (cache lock held) -----------------------------------------------------

    def find(self, ckey: bytes) -> tuple[int, int | None, bytes | None] | None:
        """``(page_id, n_entries, blob)`` of the page holding canonical key
        ``ckey`` (one statement: index lookup and page read), ``(page_id, None,
        None)`` when the index points at a missing page, or None."""
        # try/except rather than _translate(): this runs on every page fault
        # and every miss the key filter lets through, and a generator-based
        # context manager costs about a microsecond.
        try:
            if self._snapshot_reads and not self._r.in_transaction:
                self._r.execute("BEGIN")  # the shared read transaction (pause_snapshot)
            row = self._find_cursor.execute(_FIND_SQL, (ckey,)).fetchone()
        except sqlite3.DatabaseError:
            with _translate(self.path, "key lookup"):
                raise
        if row is None or row[2] is None:
            return row if row is None else row[:3]
        pid, n, data, crc = row
        if page_crc(pid, n, data) != crc:
            self._bad_checksum(pid, n, data, crc)
        return pid, n, data

    def _bad_checksum(self, pid: Any, n: Any, data: Any, crc: Any) -> None:
        """Raise :class:`CorruptStoreError` for a page whose row fails its
        checksum (or has fields of impossible types); the store is marked
        damaged, so the next open refuses it (or rebuilds it)."""
        detail = (f"page {pid!r} fails its checksum (stored {crc!r}, computed "
                  f"{page_crc(pid, n, data)}): its blob or entry count was changed on disk "
                  "(a flipped bit, a torn write, a hand edit)")
        mark_damaged(self.path, detail)
        raise CorruptStoreError(self.path, detail)

    def _verify(self, pid: Any, n: Any, data: Any, crc: Any) -> tuple[int, bytes]:
        """``(n, data)`` of a page row once its checksum holds."""
        if page_crc(pid, n, data) != crc:
            self._bad_checksum(pid, n, data, crc)
        return n, data

    def read_page(self, page_id: int) -> tuple[int, bytes] | None:
        """``(n_entries, blob)`` of a committed page, or None."""
        with _translate(self.path, "page read"):
            row = self._find_cursor.execute(
                "SELECT n_entries, data, crc FROM pages WHERE page_id = ?", (page_id,)).fetchone()
        return None if row is None else self._verify(page_id, *row)

    def pause_snapshot(self) -> None:
        """Stop sharing a read transaction between reads: called (under the
        cache lock) before the write-behind takes the pages it will commit.

        In WAL mode every statement run outside a transaction starts and
        ends a read transaction of its own, which takes and drops a read-mark
        lock on the ``-wal-index`` with two ``fcntl`` calls: about 2.5 us of a
        10 us key lookup. Between commits the store does not change (only the
        write-behind writes, and it brackets every commit with
        :meth:`pause_snapshot` and :meth:`resume_snapshot`), so page faults
        and key lookups share one read transaction instead. It ends here,
        before the commit, so that the commit's checkpoint is never held back
        by a reader (WAL checkpoint starvation) and reads during the flush see
        the latest commit as before.
        """
        self._snapshot_reads = False
        r = self._r
        if r is not None and r.in_transaction:
            with _translate(self.path, "end of read transaction"):
                r.execute("COMMIT")

    def resume_snapshot(self) -> None:
        """Let reads share a read transaction again (after a commit, under the
        cache lock); the next read starts it."""
        self._snapshot_reads = True

    def locate_keys(self, ckeys: Sequence[bytes]) -> dict[bytes, int]:
        """``{canonical key: page_id}`` for those of ``ckeys`` in the key index
        (recovery: one ``IN (...)`` lookup per :data:`_IN_BATCH` keys)."""
        found: dict[bytes, int] = {}
        with _translate(self.path, "key lookup"):
            for part in _batches(ckeys):
                found.update(self._r.execute(
                    f"SELECT key, page_id FROM keys WHERE key IN ({_marks(len(part))})", part))
        return found

    def read_pages(self, page_ids: Sequence[int]) -> dict[int, tuple[int, bytes]]:
        """``{page_id: (n_entries, blob)}`` for those of ``page_ids`` that exist."""
        pages: dict[int, tuple[int, bytes]] = {}
        with _translate(self.path, "page read"):
            for part in _batches(page_ids):
                for pid, n, data, crc in self._r.execute(
                        "SELECT page_id, n_entries, data, crc FROM pages WHERE page_id IN "
                        f"({_marks(len(part))})", part):
                    pages[pid] = self._verify(pid, n, data, crc)
        return pages

    def scan_index(self) -> Iterator[tuple[bytes, bytes | None, int, float | None]]:
        """Every committed index row ``(key, orig, page_id, expire_at)``."""
        with _translate(self.path, "index scan"):
            rows = self._r.execute("SELECT key, orig, page_id, expire_at FROM keys").fetchall()
        return iter(rows)

    def iter_keys(self, batch: int = 10_000) -> Iterator[bytes]:
        """Every committed canonical key, read on the WRITE connection (the
        batcher thread: no commit can happen while it reads)."""
        with _translate(self.path, "key scan"):
            cur = self._w.execute("SELECT key FROM keys")
            while rows := cur.fetchmany(batch):
                for (key,) in rows:
                    yield key

    def expired_by_page(self, now: float) -> list[tuple[int, int]]:
        """``(page_id, entries)`` for each committed page holding entries with
        ``expire_at <= now`` (epoch seconds), through the expiry index."""
        with _translate(self.path, "expiry scan"):
            return self._r.execute(
                "SELECT page_id, COUNT(*) FROM keys WHERE expire_at IS NOT NULL "
                "AND expire_at <= ? GROUP BY page_id", (now,)).fetchall()

    def expired_pages(self, now: float, skip: Container[int], limit: int) -> list[int]:
        """Ids of up to ``limit`` committed pages, not in ``skip``, holding
        entries with ``expire_at <= now`` (epoch seconds), through the expiry
        index. The statement is finished before this returns, so later reads
        see later commits."""
        pids: list[int] = []
        with _translate(self.path, "expiry scan"):
            cur = self._r.execute(
                "SELECT DISTINCT page_id FROM keys WHERE expire_at IS NOT NULL "
                "AND expire_at <= ?", (now,))
            try:
                for (pid,) in cur:
                    if pid not in skip:
                        pids.append(pid)
                        if len(pids) >= limit:
                            break
            finally:
                cur.close()
        return pids

    def any_key(self, exclude_pages: set[int]) -> tuple[bytes, bytes | None] | None:
        """Some committed ``(key, orig)`` on a page not in ``exclude_pages``, or None."""
        with _translate(self.path, "index scan"):
            for key, orig, pid in self._r.execute("SELECT key, orig, page_id FROM keys"):
                if pid not in exclude_pages:
                    return key, orig
        return None

    # -- writes (batcher thread) -------------------------------------------------------

    def write_batch(self, images: Sequence[PageImage], checkpoint_lsn: int, key_count: int,
                    ttl_key_count: int, clear: bool = False, *,
                    held_pages: Set[int] = frozenset(),
                    ttl_clock: tuple[float, float] | None = None,
                    size_limit: int | None = None, keep_pages: Container[int] = frozenset(),
                    left_pages: Sequence[int] = ()) -> list[bytes]:
        """Write pages, index changes and the checkpoint LSN in ONE transaction.

        Index rows are written as changes only: a page never stored before
        (``PageImage.stored`` false) inserts its rows; a stored page whose
        key set changed reads its committed rows (``keys_by_page``) and
        deletes, inserts or updates only the ones that differ. Rows go in
        many per statement (see :meth:`_insert_many`).

        :param clear: delete every page and index row first (``Cache.clear()``).
        :param held_pages: ids of dirty pages left out of this commit (the
            write-behind is isolating a page that fails). A key that moved
            from one of them to a page written here would be held by both
            stored pages, the old one's image being stale, and after a crash
            that stale copy could be served. Such a commit is refused with
            :class:`HeldKeyError`: the page waits for the held one.
        :param ttl_clock: ``(offset, now)`` of the cache's TTL clock, stored
            when it differs from :attr:`ttl_clock` (see ``Cache._now``).
        :param size_limit, keep_pages, left_pages: see
            :meth:`durablekv.stores.base.PageStore.write_batch`.
        :returns: the canonical keys of the index rows this commit added (a
            key the page did not hold when last stored); the cache adds them
            to its key filter (see :mod:`durablekv.keyfilter`).
        :raises StoreError: the transaction failed and was rolled back.
        :raises HeldKeyError: see ``held_pages``.
        """
        conn = self._w
        with _translate(self.path, "flush"):
            conn.execute("BEGIN IMMEDIATE")
            try:
                if clear:
                    conn.execute("DELETE FROM pages")
                    conn.execute("DELETE FROM keys")
                upserts: list[tuple] = []   # (key, page_id, expire_at, orig) to write
                added: list[bytes] = []      # keys of rows new to the index
                gone: list[tuple[bytes, int]] = []   # (key, page_id) rows to delete
                emptied: list[tuple[int]] = []       # pages to delete with their rows
                page_rows: list[tuple] = []          # (page_id, n_entries, data, crc)
                for img in images:
                    pid = img.page_id
                    stored = img.stored and not clear
                    rows = img.index_rows
                    if not img.n:
                        if stored:
                            emptied.append((pid,))
                        continue
                    page_rows.append((pid, img.n, img.data, page_crc(pid, img.n, img.data),
                                      checkpoint_lsn))
                    if rows is None:
                        continue
                    if stored:
                        self._index_changes(conn, pid, rows, upserts, gone, added)
                    else:
                        upserts += [(k, pid, e, o) for k, e, o in rows]
                        added += map(_first, rows)
                if held_pages and added:
                    self._refuse_held_keys(conn, added, held_pages)
                data_bytes = 0 if clear else self.data_bytes - self._stored_bytes(
                    conn, [img.page_id for img in images if img.stored])
                data_bytes += sum(len(r[2]) for r in page_rows)
                evicted: list[tuple[int, int, int]] = []
                if size_limit is not None and data_bytes > size_limit and not clear:
                    # Other pages first, before the new images go in: the file
                    # pages they free are then reused by this very transaction
                    # (else the file would grow by a flush's worth each time).
                    written = {img.page_id for img in images}
                    data_bytes, evicted = self._evict(
                        conn, data_bytes, size_limit,
                        _Union(keep_pages, written), left_pages)
                if emptied:
                    conn.executemany("DELETE FROM keys WHERE page_id = ?", emptied)
                    conn.executemany("DELETE FROM pages WHERE page_id = ?", emptied)
                if gone:
                    conn.executemany("DELETE FROM keys WHERE key = ? AND page_id = ?", gone)
                # In key order, rows that share a B-tree leaf go in one after
                # another: with random keys and an index larger than SQLite's
                # cache, each leaf is then read and written once per flush,
                # not once per row (already sorted input costs one pass).
                upserts.sort(key=_first)
                page_rows.sort(key=_first)
                self._insert_many(conn, "INSERT OR REPLACE INTO keys "
                                  "(key, page_id, expire_at, orig) VALUES ", 4, upserts)
                self._insert_many(conn, "INSERT OR REPLACE INTO pages "
                                  "(page_id, n_entries, data, crc, last_use) VALUES ", 5,
                                  page_rows)
                if left_pages and not clear:
                    conn.executemany("UPDATE pages SET last_use = ? WHERE page_id = ?",
                                     zip(repeat(checkpoint_lsn), left_pages))
                if size_limit is not None and data_bytes > size_limit:
                    # still over: pending pages written just now may go too
                    data_bytes, more = self._evict(conn, data_bytes, size_limit, keep_pages)
                    evicted += more
                if evicted:
                    key_count -= sum(e[1] for e in evicted)
                    ttl_key_count -= sum(e[2] for e in evicted)
                conn.executemany("INSERT OR REPLACE INTO meta (name, value) VALUES (?, ?)",
                                 [("checkpoint_lsn", checkpoint_lsn), ("key_count", key_count),
                                  ("ttl_key_count", ttl_key_count), ("data_bytes", data_bytes)])
                if ttl_clock is not None and ttl_clock != self.ttl_clock:
                    conn.executemany("INSERT OR REPLACE INTO meta (name, value) VALUES (?, ?)",
                                     [("ttl_clock_offset", ttl_clock[0]),
                                      ("ttl_clock_now", ttl_clock[1])])
                self._commit(conn)
            except BaseException:
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                raise
        self._check_identity("flush")
        self._trim_wal()
        self.checkpoint_lsn = checkpoint_lsn
        self.key_count = key_count
        self.ttl_key_count = ttl_key_count
        self.data_bytes = data_bytes
        self._evicted += evicted
        if ttl_clock is not None:
            self.ttl_clock = ttl_clock
        return added

    def take_evicted(self) -> list[tuple[int, int, int]]:
        """``(page_id, entries, entries with an expiry)`` of every page that
        committed batches evicted for ``size_limit`` since the last call."""
        out, self._evicted = self._evicted, []
        return out

    def _stored_bytes(self, conn: sqlite3.Connection, page_ids: Sequence[int]) -> int:
        """Bytes of the committed blobs of ``page_ids`` (``length()`` of a blob
        reads its record header, not its data)."""
        total = 0
        for chunk in _batches(page_ids):
            total += conn.execute("SELECT coalesce(sum(length(data)), 0) FROM pages WHERE "
                                  f"page_id IN ({_marks(len(chunk))})", chunk).fetchone()[0]
        return total

    def _evict(self, conn: sqlite3.Connection, data_bytes: int, size_limit: int,
               keep: Container[int], left: Sequence[int] = ()
               ) -> tuple[int, list[tuple[int, int, int]]]:
        """Delete least recently used pages not in ``keep``, with their index
        rows, until ``data_bytes <= size_limit`` (or none is left to take).

        ``left``: pages whose last use this batch records but has not yet
        written (they are the most recently used: taken last).

        :returns: the new ``data_bytes`` and ``(page_id, entries, ttl entries)``
            of each page deleted."""
        if left:
            keep = _Union(keep, set(left))
        after = (-1, -1)
        victims: list[tuple[int, int]] = []
        while data_bytes > size_limit:
            rows = conn.execute(
                "SELECT page_id, n_entries, length(data), last_use FROM pages "
                "WHERE (last_use, page_id) > (?, ?) ORDER BY last_use, page_id LIMIT 256",
                after).fetchall()
            if not rows:
                break
            for pid, n, nb, used in rows:
                after = (used, pid)
                if pid in keep:
                    continue
                victims.append((pid, n))
                data_bytes -= nb
                if data_bytes <= size_limit:
                    break
        if not victims:
            return data_bytes, []
        ttl: dict[int, int] = {}
        pids = [v[0] for v in victims]
        for chunk in _batches(pids):
            ttl.update(conn.execute(
                "SELECT page_id, count(*) FROM keys WHERE expire_at IS NOT NULL AND "
                f"page_id IN ({_marks(len(chunk))}) GROUP BY page_id", chunk))
        gone = [(p,) for p in pids]
        conn.executemany("DELETE FROM keys WHERE page_id = ?", gone)
        conn.executemany("DELETE FROM pages WHERE page_id = ?", gone)
        return data_bytes, [(p, n, ttl.get(p, 0)) for p, n in victims]

    def _trim_wal(self) -> None:
        """After a commit: once the ``-wal`` file passes :attr:`wal_size_limit`,
        checkpoint it (PASSIVE: never waits for a reader), so that the next
        transaction starts the WAL over and ``journal_size_limit`` cuts the
        file back."""
        try:
            size = os.stat(self.path + "-wal").st_size
        except OSError:
            return
        if size > self.wal_size_limit:
            with _translate(self.path, "WAL checkpoint"):
                self._w.execute("PRAGMA wal_checkpoint(PASSIVE)")

    def _check_identity(self, when: str) -> None:
        """Raise :class:`StoreError` if ``pages.sqlite3`` is no longer the file
        this store opened (deleted or replaced while open: commits then go to
        a file no open will see, and the replay log must be kept)."""
        try:
            st = os.stat(self.path)
            how = None if (st.st_dev, st.st_ino) == self._identity else "was replaced"
        except FileNotFoundError:
            how = "was deleted"
        if how:
            raise StoreError(
                f"page store {self.path!r} {how} while the cache was open (found at {when}): "
                "what was stored since is in a file no open can see. The replay log is kept "
                "(it is cut back only behind a checkpoint in the live store), so the next "
                "open refuses the gap between a new store and the log (LogCorruptionError) "
                "instead of starting empty; restore pages.sqlite3 from a backup, or run "
                "`durablekv salvage` to keep what the log holds. Do not delete files in a "
                "cache directory while it is open", self.path)

    def _refuse_held_keys(self, conn: sqlite3.Connection, added: list[bytes],
                          held_pages: Set[int]) -> None:
        """Raise :class:`HeldKeyError` if a key new to a page written now has
        its committed index row on a held page (see :meth:`write_batch`)."""
        for part in _batches(added):
            for key, pid in conn.execute(
                    f"SELECT key, page_id FROM keys WHERE key IN ({_marks(len(part))})", part):
                if pid in held_pages:
                    raise HeldKeyError(
                        f"a page written with key {key!r} cannot be stored before page {pid}, "
                        "which still holds that key in the store and is not being stored "
                        "now; it is stored together with that page", self.path)

    @staticmethod
    def _index_changes(conn: sqlite3.Connection, pid: int,
                       rows: Sequence[tuple[bytes, float | None, bytes | None]],
                       upserts: list[tuple], gone: list[tuple[bytes, int]],
                       added: list[bytes]) -> None:
        """Add to ``upserts``/``gone`` what turns page ``pid``'s committed index
        rows into ``rows`` (a page that only grew inserts just its new keys),
        and to ``added`` the keys the page did not hold."""
        have = {k: (e, o) for k, e, o in conn.execute(
            "SELECT key, expire_at, orig FROM keys WHERE page_id = ?", (pid,))}
        for k, e, o in rows:
            old = have.pop(k, None)
            if old is None:
                upserts.append((k, pid, e, o))
                added.append(k)
            elif old[0] != e or old[1] != o:
                upserts.append((k, pid, e, o))
        for k in have:
            gone.append((k, pid))

    def _insert_many(self, conn: sqlite3.Connection, head: str, width: int,
                     rows: list[tuple]) -> None:
        """Run ``head`` + ``(?, ...)`` over ``rows`` (``width`` values each),
        many rows per statement.

        ``executemany`` steps once per row, and Python's sqlite3 releases and
        takes back the GIL around every step: with writers running, each row
        then costs two thread hand-offs. A multi-row VALUES statement does
        hundreds of rows in one step. Statements hold a power of two of rows
        (the largest within SQLite's bound-parameter limit, at most
        ``_ROWS_PER_STATEMENT``), so a batch uses a few cached statements."""
        if not rows:
            return
        flat = list(_chain(rows))
        n = len(rows)
        i = 0
        per = self._max_rows(width)
        while n:
            while per > n:
                per >>= 1
            end = i + per * width
            conn.execute(_values_sql(head, width, per), flat[i:end])
            i = end
            n -= per

    def _max_rows(self, width: int) -> int:
        limit = self._variable_limit
        rows = _ROWS_PER_STATEMENT
        while rows > 1 and rows * width > limit:
            rows >>= 1
        return rows

    def _commit(self, conn: sqlite3.Connection) -> None:
        """Commit the flush transaction (a seam: crash tests stop the process here)."""
        conn.execute("COMMIT")

    # -- misc ------------------------------------------------------------------------

    def size_bytes(self) -> int:
        """Bytes of the store file and its WAL (0 for files that are missing)."""
        total = 0
        for suffix in ("", "-wal"):
            with contextlib.suppress(OSError):
                total += os.stat(self.path + suffix).st_size
        return total

    def integrity_check(self) -> list[str]:
        """Run SQLite's ``integrity_check`` (O(store size)); [] when healthy."""
        with _translate(self.path, "integrity check"):
            rows = [r[0] for r in self._w.execute("PRAGMA integrity_check")]
        return [] if rows == ["ok"] else rows

    def close(self, checkpoint_wal: bool = False) -> None:
        """Close both connections; ``checkpoint_wal`` folds the WAL into the file first."""
        for attr in ("_r", "_w"):
            conn = getattr(self, attr)
            if conn is None:
                continue
            setattr(self, attr, None)
            with contextlib.suppress(sqlite3.Error):
                if checkpoint_wal and attr == "_w":
                    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            conn.close()


class _Union:
    """``x in _Union(a, b)``: in either container (no copy of a large set)."""

    __slots__ = ("a", "b")

    def __init__(self, a: Container[Any], b: Container[Any]) -> None:
        self.a, self.b = a, b

    def __contains__(self, x: object) -> bool:
        return x in self.a or x in self.b


#: Parameters per ``IN (...)`` statement: far below SQLite's limit on
#: variables (999 before 3.32), large enough that a statement costs little.
_IN_BATCH = 500


def _batches(items: Sequence[Any]) -> Iterator[Sequence[Any]]:
    for i in range(0, len(items), _IN_BATCH):
        yield items[i:i + _IN_BATCH]


def _marks(n: int) -> str:
    return ",".join("?" * n)


#: Most rows in one multi-row INSERT (see SQLitePageStore._insert_many).
_ROWS_PER_STATEMENT = 256
_first = operator.itemgetter(0)
_chain = itertools.chain.from_iterable
_SQL_CACHE: dict[tuple[str, int, int], str] = {}


def _values_sql(head: str, width: int, rows: int) -> str:
    key = (head, width, rows)
    sql = _SQL_CACHE.get(key)
    if sql is None:
        row = "(" + ", ".join("?" * width) + ")"
        sql = _SQL_CACHE[key] = head + ", ".join([row] * rows)
    return sql


