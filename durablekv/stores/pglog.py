"""The replay log of ``durability="sync"``: log records committed in PostgreSQL.

With ``Cache(directory, store="postgresql://...", namespace=..., durability="sync")``
a write returns only once its log record is committed in PostgreSQL (table
``dkv_log``), so that losing the machine, directory and all, loses no
acknowledged write: any machine that opens the namespace next replays the
records after the store's checkpoint. The directory keeps only ``LOCK``.

Records are the local log's bytes (:func:`durablekv.log.segments.encode_record`:
length, CRC, LSN, payload), one row per record, keyed ``(ns_id, lsn)``.

Group commit: :meth:`PgReplayLog.append` (under the cache's lock) only
queues the record; :meth:`PgReplayLog.sync_to` makes one writer the leader,
which inserts every queued record in one transaction while the others wait
for it, as :meth:`durablekv.log.replaylog.ReplayLog.sync_to` shares one fsync.

Unknown outcomes: when the connection is lost during the insert (or its
COMMIT), the leader reconnects (following ``target_session_attrs`` to a new
primary) and inserts the same rows again with ``ON CONFLICT DO NOTHING``: by
LSN, a record is never applied twice and a commit that landed is never
reported failed. It keeps trying for ``reconnect_timeout`` seconds, then
raises :class:`~durablekv.errors.LogWriteError` (the cache fails stop).

Fencing: each insert first reads the namespace's ``owner`` token ``FOR
SHARE`` (written by the store when it takes the namespace's lock): if another
owner has taken the namespace over meanwhile, nothing is inserted and the
cache fails stop; an owner taking over waits for an insert in flight to end.

Opening a directory whose local replay log still holds records after the
checkpoint (it was last used with ``durability="log"`` or ``"fsync"``):
those records are copied into ``dkv_log`` (committed) and the local
segments removed, then recovery goes on from PostgreSQL alone.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Any

from ..errors import LogCorruptionError, LogWriteError, StoreError
from ..log.segments import _parse_segment, encode_record
from ..log.replaylog import RecoveryResult, ReplayLog

log = logging.getLogger("durablekv.stores.pglog")

__all__ = ["PgReplayLog"]

_INSERT = ("INSERT INTO dkv_log (ns_id, lsn, record) SELECT %s, * FROM "
           "unnest(%s::bigint[], %s::bytea[]) ON CONFLICT (ns_id, lsn) DO NOTHING")


class _TakenOver(Exception):
    pass


class PgReplayLog:
    """The log of one namespace in PostgreSQL, with :class:`ReplayLog`'s interface.

    :param store: the cache's :class:`~durablekv.stores.postgres.PostgresPageStore`
        (its connection string, namespace id and owner token).
    :param directory: the cache directory (a local log left there is moved in).
    :param reconnect_timeout: seconds a commit keeps retrying a lost
        connection before it fails (covers a failover to a standby).

    Thread-safety: :meth:`append` runs under the cache's lock; :meth:`sync_to`
    from any writer; :meth:`truncate_through` from the batcher. Each uses the
    log's own connection (psycopg serializes its use).
    """

    durability = "sync"

    def __init__(self, store: Any, directory: str, *, reconnect_timeout: float = 30.0) -> None:
        self.store = store
        self.directory = directory
        self.reconnect_timeout = reconnect_timeout
        self._conn: Any = None
        self._queue: list[tuple[int, bytes]] = []   # appended, not yet committed
        self._lock = threading.Lock()       # guards _queue, _last_lsn, _bytes
        self._sync_lock = threading.Lock()  # one leader at a time (group commit)
        self._last_lsn = 0
        self._synced_lsn = 0
        self._truncated = 0
        # (last LSN, bytes) of each commit's records not yet deleted, oldest first
        self._committed: collections.deque[tuple[int, int]] = collections.deque()
        #: transactions that committed log records, and records they held
        self.commits = self.committed_records = 0

    # -- connection --------------------------------------------------------------

    def _connection(self) -> Any:
        conn = self._conn
        if conn is None or conn.closed or conn.broken:
            if conn is not None:
                conn.close()
            self._conn = conn = self.store._connect()
        return conn

    def _run(self, what: str, fn) -> Any:
        """``fn(conn)`` in a transaction; on a lost connection, reconnect and
        run it again until ``reconnect_timeout`` (``fn`` must be idempotent)."""
        import psycopg
        deadline = time.monotonic() + self.reconnect_timeout
        delay = 0.05
        while True:
            try:
                conn = self._connection()
                with conn.transaction():
                    result = fn(conn)
                self._after_commit(conn)
                return result
            except _TakenOver as exc:
                raise LogWriteError(self.store.path, OSError(
                    0, f"{what}: namespace taken over by another owner ({exc}); this "
                    "cache stops writing")) from None
            except (psycopg.OperationalError, StoreError) as exc:
                # (StoreError: a reconnect that failed; during a failover the
                # standby is not yet promoted, or no host is up)
                if time.monotonic() + delay > deadline:
                    raise LogWriteError(self.store.path, OSError(
                        0, f"{what} failed for {self.reconnect_timeout:g} s: "
                        f"{exc if isinstance(exc, StoreError) else self.store._error(what, exc)}"
                    )) from None
                log.warning("%s on %s: %s; reconnecting", what, self.store.path,
                            str(exc).strip().splitlines()[0] if str(exc).strip() else exc)
                time.sleep(delay)  # a lost server: back off before the next try
                delay = min(delay * 2, 1.0)
            except psycopg.Error as exc:
                raise LogWriteError(self.store.path, OSError(
                    0, str(self.store._error(what, exc)))) from None

    def _after_commit(self, conn: Any) -> None:
        """Runs after each commit (a seam: tests lose the connection here, so
        that the commit's outcome is unknown to the caller)."""

    def _fenced_insert(self, rows: list[tuple[int, bytes]]) -> None:
        store = self.store

        def insert(conn: Any) -> None:
            row = conn.execute("SELECT value FROM dkv_meta WHERE ns_id = %s AND name = 'owner' "
                               "FOR SHARE", (store.ns_id,)).fetchone()
            if row is None or row[0] != store.owner_token:
                raise _TakenOver(f"owner token {row and row[0]!r}")
            conn.execute(_INSERT, (store.ns_id, [r[0] for r in rows], [r[1] for r in rows]))
        self._run("log commit", insert)

    # -- recovery ------------------------------------------------------------------

    def recover(self, after_lsn: int, *, salvage: bool = False) -> RecoveryResult:
        """Records with LSN > ``after_lsn``: a local log's first (moved into
        PostgreSQL), then ``dkv_log``'s, in LSN order.

        :raises LogCorruptionError: a stored record fails its CRC, or the
            records after the checkpoint have an LSN gap.
        """
        local = ReplayLog(self.directory, durability="fsync")
        moved = local.recover(after_lsn, salvage=salvage)
        if moved.records:
            rows = [(r[0], encode_record(*r)) for r in moved.records]
            self._fenced_insert(rows)
            log.warning("moved %d records of the local replay log of %s into %s",
                        len(rows), self.directory, self.store.path)
        if moved.salvaged:
            local.set_aside(moved)
        local.close(remove=True)

        def read(conn: Any) -> list[tuple[int, bytes]]:
            return conn.execute("SELECT lsn, record FROM dkv_log WHERE ns_id = %s AND lsn > %s "
                                "ORDER BY lsn", (self.store.ns_id, after_lsn)).fetchall()
        rows = self._run("log recovery", read)
        data = b"".join(r[1] for r in rows)
        records, good_end, damage = _parse_segment(data, 0)
        where = f"{self.store.path} table dkv_log"
        if damage is not None:
            raise LogCorruptionError(where, damage.offset, damage.detail)
        expect = after_lsn + 1
        for rec in records:
            if rec[0] != expect:
                raise LogCorruptionError(where, 0, f"LSN {expect} is missing (next: {rec[0]}), "
                                         f"after checkpoint {after_lsn}")
            expect += 1
        if rows:
            self._committed.append((rows[-1][0], len(data)))
        self._last_lsn = self._synced_lsn = expect - 1
        return RecoveryResult(records, 0, 0, [], moved.salvaged_bytes)

    def set_aside(self, result: RecoveryResult) -> list[str]:
        return []

    # -- writing -------------------------------------------------------------------

    @property
    def last_lsn(self) -> int:
        return self._last_lsn

    def start(self, next_lsn: int) -> None:
        """Records from ``next_lsn`` on may be appended."""
        self._last_lsn = self._synced_lsn = next_lsn - 1

    def append(self, lsn: int, op: int, key: bytes, value: bytes, expire_at: float | None) -> int:
        """Queue one record (LSN ``last_lsn + 1``) for the next commit; its size in bytes."""
        record = encode_record(lsn, op, key, value, expire_at)
        with self._lock:
            self._queue.append((lsn, record))
            self._last_lsn = lsn
        return len(record)

    def append_bytes(self, lsn: int, op: int, key: bytes, raw: bytes,
                     expire_at: float | None) -> int:
        """:meth:`ReplayLog.append_bytes`: the value ``raw`` logged as the
        safe codec's encoding of a bytes value."""
        return self.append(lsn, op, key, b"b" + len(raw).to_bytes(4, "little") + raw, expire_at)

    def sync(self) -> None:
        """Commit everything appended so far."""
        self.sync_to(self._last_lsn)

    def sync_to(self, lsn: int) -> None:
        """Return once every record up to ``lsn`` is committed in PostgreSQL; one
        transaction serves every writer waiting meanwhile (group commit).

        :raises LogWriteError: the commit failed for ``reconnect_timeout``
            seconds, or the namespace was taken over (the cache fails stop).
        """
        if self._synced_lsn >= lsn:
            return
        with self._sync_lock:
            if self._synced_lsn >= lsn:
                return
            with self._lock:
                rows, self._queue = self._queue, []
            if not rows:
                return
            try:
                self._fenced_insert(rows)
            except BaseException:
                with self._lock:  # not committed: a later sync tries them again
                    self._queue[:0] = rows
                raise
            self.commits += 1
            self.committed_records += len(rows)
            self._committed.append((rows[-1][0], sum(len(r[1]) for r in rows)))
            self._synced_lsn = max(self._synced_lsn, rows[-1][0])

    def mark(self) -> None:
        """:meth:`ReplayLog.mark`: nothing to do here, a recovery reads only
        the rows after the checkpoint (an index range)."""

    def truncate_through(self, lsn: int) -> int:
        """Delete committed records with LSN <= ``lsn`` (a committed checkpoint);
        the number deleted. Errors are logged, not raised (see ReplayLog)."""
        if lsn <= self._truncated:
            return 0
        import psycopg
        try:
            conn = self._connection()
            n = conn.execute("DELETE FROM dkv_log WHERE ns_id = %s AND lsn <= %s",
                             (self.store.ns_id, lsn)).rowcount
        except psycopg.Error as exc:
            log.error("log rows of %s through checkpoint %d not deleted (%s); tried again at "
                      "the next checkpoint", self.store.path, lsn, str(exc).strip())
            return 0
        self._truncated = lsn
        with self._lock:
            while self._committed and self._committed[0][0] <= lsn:
                self._committed.popleft()
        return n

    def size_bytes(self) -> int:
        """Bytes of the committed records not yet deleted (whole commits)."""
        with self._lock:
            return sum(b for _, b in self._committed)

    def close(self, *, remove: bool = False) -> None:
        """Close the connection; ``remove`` deletes every record (after a final
        checkpoint that covers the whole log)."""
        conn, self._conn = self._conn, None
        if conn is None:
            return
        try:
            if remove and not conn.closed and not conn.broken:
                conn.execute("DELETE FROM dkv_log WHERE ns_id = %s", (self.store.ns_id,))
        except Exception as exc:  # noqa: BLE001 - the records are covered by the checkpoint
            log.warning("closing the log of %s: rows not deleted (%s)", self.store.path, exc)
        finally:
            conn.close()
