"""The PostgreSQL page store: pages, the key index and the checkpoint in PostgreSQL.

``Cache(directory, store="postgresql://...", namespace="name")`` keeps its
pages here instead of in ``pages.sqlite3``; the replay log stays in the
directory (see docs/postgres.md for what each durability mode can lose).
Needs psycopg 3 (``pip install 'durablekv[postgres]'``).

Tables (created by the SQL files of ``migrations/postgres/``, shipped as
``durablekv.migrations.postgres``; ``dkv_schema.version`` records how many
have been applied; every table is keyed by ``ns_id``, so that many caches
share one database):

* ``dkv_namespaces(ns_id, name)``: one row per namespace;
* ``dkv_pages(ns_id, page_id, n_entries, data, crc)``: one row per
  non-empty page; ``data`` is the page blob, the same bytes as in the SQLite
  store (format: :mod:`durablekv.stores.pageformat`), opaque to PostgreSQL (bytea), and
  ``crc`` its :func:`~durablekv.stores.pageformat.page_crc`, checked on every read;
* ``dkv_keys(ns_id, key, page_id, expire_at, orig)``: the key index;
* ``dkv_meta(ns_id, name, value)``: as the SQLite store's ``meta``, plus
  ``flush_seq``, the number of flush transactions committed, ``owner``, a
  token the current owner wrote when it took the namespace, and
  ``namespace_uuid``, fixed at creation (a cache directory records it in
  its ``STORE`` file, see :mod:`durablekv.stores.factory`);
* ``dkv_log(ns_id, lsn, record)``: the replay log of ``durability="sync"``
  (see :mod:`durablekv.stores.pglog`).

One owner per namespace: the store holds a session advisory lock on
``(LOCK_CLASS, ns_id)`` on its write connection. A second opener gets
:class:`~durablekv.errors.NamespaceLockedError`; when the owner's session
ends (close, or its process killed: PostgreSQL ends the session), the lock
goes with it and the next opener recovers.

Fencing: every flush commits ``flush_seq + 1``. When the write connection
is lost, the store reconnects at the next flush, takes the lock again and
checks that ``flush_seq`` is still its own: if another owner flushed in
between, it refuses to write (:class:`~durablekv.errors.StoreError`,
"taken over") instead of overwriting the newer state. A COMMIT whose
connection is lost before the answer arrives has an unknown outcome; the
store reconnects and reads ``flush_seq`` to learn whether it landed, so a
flush is never applied twice and never reported failed when it landed.

Threads: as the SQLite store. The write connection is used only by the
write-behind batcher's thread (and by open/close); the read connection only
under the cache's lock. Both are in autocommit mode; a flush is one explicit
transaction. ``psycopg.Error`` is translated to :mod:`durablekv.errors` in
one place, :func:`_translate`, and no message carries the password.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
from pathlib import Path
import time
import uuid
from typing import AbstractSet as Set
from typing import Any, Container, Iterator, Sequence

from ..errors import (ConfigError, CorruptStoreError, HeldKeyError, NamespaceLockedError,
                      SchemaVersionError, StoreError)
from .base import PageImage, meta_problems, ordered_migrations
from .pageformat import page_crc

try:
    import psycopg
    from psycopg import conninfo as _conninfo
except ImportError:  # pragma: no cover - checked in connect()
    psycopg = None  # type: ignore[assignment]

log = logging.getLogger("durablekv.stores.postgres")

__all__ = ["PostgresPageStore", "describe_conninfo", "migration_files", "LOCK_CLASS",
           "URL_SCHEMES"]

#: The first key of every durablekv advisory lock (``pg_try_advisory_lock(int, int)``):
#: the second is the namespace's ``ns_id``.
LOCK_CLASS = 0x646B76  # "dkv"
#: The migrations' own lock (a transaction lock, while a schema is created or upgraded).
_MIGRATE_LOCK = (LOCK_CLASS, 0)
URL_SCHEMES = ("postgresql://", "postgres://")
#: After a lost connection, how long a reconnect tries to take the lock again.
_RELOCK_SECONDS = 5.0

_FIND_SQL = ("SELECT k.page_id, p.n_entries, p.data, p.crc FROM dkv_keys AS k "
             "LEFT JOIN dkv_pages AS p ON p.ns_id = k.ns_id AND p.page_id = k.page_id "
             "WHERE k.ns_id = %s AND k.key = %s")


def migration_files() -> list[tuple[int, str, str]]:
    """The packaged PostgreSQL migrations as ``(version, name, sql)``, in order."""
    from importlib.resources import files
    try:
        root: Any = files("durablekv.migrations.postgres")
        items = list(root.iterdir())
    except ModuleNotFoundError:  # running from a source tree, as the SQLite store does
        root = Path(__file__).resolve().parents[2] / "migrations" / "postgres"
        items = list(root.glob("*.sql"))
    return ordered_migrations(items)


def describe_conninfo(conninfo: str) -> str:
    """``conninfo`` for messages: hosts, ports, database and user, never the password.

    :raises ConfigError: ``conninfo`` cannot be parsed.
    """
    _need_psycopg()
    try:
        parts = _conninfo.conninfo_to_dict(conninfo)
    except psycopg.ProgrammingError as exc:
        raise ConfigError(f"the PostgreSQL connection string {_scrub(conninfo, conninfo)!r} "
                          f"cannot be parsed ({_scrub(str(exc).strip(), conninfo)}); give a URL "
                          "such as 'postgresql://user@host:5432/dbname'") from None
    hosts = str(parts.get("host") or parts.get("hostaddr") or "localhost")
    ports = str(parts.get("port") or "5432")
    where = ",".join(f"{h}:{p}" for h, p in zip(hosts.split(","), _repeat(ports, hosts)))
    user = parts.get("user")
    return (f"postgresql://{user + '@' if user else ''}{where}/{parts.get('dbname') or ''}"
            + (f"?target_session_attrs={parts['target_session_attrs']}"
               if parts.get("target_session_attrs") else ""))


def _repeat(ports: str, hosts: str) -> list[str]:
    p = ports.split(",")
    return p if len(p) > 1 else p * len(hosts.split(","))


def _scrub(text: str, conninfo: str) -> str:
    """``text`` with the password of ``conninfo`` (if any) blanked out."""
    pw = None
    with contextlib.suppress(Exception):
        pw = _conninfo.conninfo_to_dict(conninfo).get("password")
    if not pw:
        # an unparsable URL: blank what sits between "user:" and "@"
        if "://" in conninfo and "@" in conninfo:
            cred = conninfo.split("://", 1)[1].rsplit("@", 1)[0]
            pw = cred.split(":", 1)[1] if ":" in cred else None
    return text.replace(pw, "***") if pw else text


def _need_psycopg() -> None:
    if psycopg is None:
        raise ConfigError("a PostgreSQL store needs psycopg 3, which is not installed; "
                          "install it with: pip install 'durablekv[postgres]'")


def _typed_meta(meta: dict[str, str]) -> dict[str, Any]:
    """``dkv_meta`` (text values) as the SQLite store's meta types, for
    :func:`~durablekv.stores.base.meta_problems`: a value that does not parse
    stays text, which that check reports."""
    out: dict[str, Any] = dict(meta)
    for name, kind in (("page_size", int), ("checkpoint_lsn", int), ("key_count", int),
                       ("data_bytes", int),
                       ("ttl_key_count", int), ("ttl_clock_offset", float),
                       ("ttl_clock_now", float)):
        if name in meta:
            try:
                out[name] = kind(meta[name])
            except ValueError:
                pass
    return out


class _Either:
    """``x in _Either(a, b)``: in either container (no copy of a large set)."""

    __slots__ = ("a", "b")

    def __init__(self, a: Container[Any], b: Container[Any]) -> None:
        self.a, self.b = a, b

    def __contains__(self, x: object) -> bool:
        return x in self.a or x in self.b


class PostgresPageStore:
    """Pages and the key index of one namespace in a PostgreSQL database.

    The :class:`~durablekv.stores.base.PageStore` protocol, with the same
    semantics as :class:`durablekv.stores.sqlite.SQLitePageStore`.

    :param conninfo: a libpq connection string or ``postgresql://`` URL; may
        list several hosts (``host1:5432,host2:5432``) with
        ``target_session_attrs=read-write`` to follow a failover.
    :param namespace: the cache's name in the database (a non-empty str).
    :param durability: ``"none"`` commits with ``synchronous_commit=off``
        (a crash of PostgreSQL may lose the last flushes, which the replay
        log does not hold then either); every other mode waits for the commit
        to be durable (and replicated, if the server says so).
    :param page_size: slots per page; None adopts the stored value (16 new).
    :param serializer: name of the value codec; fixed at creation.
    :param connect_timeout: seconds to wait for each host when connecting.
    :raises ConfigError: ``conninfo`` cannot be parsed, psycopg is missing,
        or ``page_size``/``serializer`` differ from the stored ones.
    :raises StoreError: the server cannot be reached, refuses the login, or
        is a standby that refuses writes (the message names the host).
    :raises NamespaceLockedError: another session owns the namespace.
    :raises SchemaVersionError: the database has a newer durablekv schema.
    """

    #: never rebuilt in place (see SQLitePageStore.rebuilt_from)
    rebuilt_from: str | None = None

    def __init__(self, conninfo: str, namespace: str, *, durability: str = "log",
                 page_size: int | None = None, serializer: str = "safe",
                 connect_timeout: float = 10.0, verify: bool = False) -> None:
        _need_psycopg()
        if not isinstance(namespace, str) or not namespace:
            raise ConfigError(f"namespace must be a non-empty str, got {namespace!r}; name "
                              "the cache in the database, e.g. namespace='sessions'")
        self.conninfo = conninfo
        self.namespace = namespace
        self.where = describe_conninfo(conninfo)
        self._user = _conninfo.conninfo_to_dict(conninfo).get("user")  # (for messages)
        #: what messages name the store by (no password)
        self.path = f"{self.where} namespace {namespace!r}"
        self._durability = durability
        self._connect_timeout = connect_timeout
        self._w: Any = None
        self._r: Any = None
        self.ns_id = 0
        # a flush whose COMMIT lost its connection: (flush_seq, added keys,
        # checkpoint_lsn, key_count, ttl_key_count, ttl_clock, data_bytes,
        # evicted pages), until resolved
        self._unknown: tuple | None = None
        self._evicted: list[tuple[int, int, int]] = []  # see take_evicted()
        self._carry: list[bytes] = []  # added keys of such a flush that had landed
        try:
            self._w = self._connect()
            self._migrate()
            self.ns_id = self._namespace_id()
            self._lock()
            self._settings(page_size, serializer)
            self._claim()
            self._r = self._connect()
            meta = self._meta(self._w)
            with self._translate("open"):
                max_pid, min_pid, keys_bytes = self._w.execute(
                    "SELECT MAX(page_id), MIN(page_id), pg_total_relation_size('dkv_keys') "
                    "FROM dkv_pages WHERE ns_id = %s", (self.ns_id,)).fetchone()
            # (the keys table's size bounds key_count: every key takes a byte of it)
            problems = meta_problems(_typed_meta(meta), max_pid, min_pid, int(keys_bytes))
            if problems:
                raise CorruptStoreError(self.path, "; ".join(problems))
            self.max_page_id = int(max_pid or 0)
        except BaseException:
            self.close()
            raise
        self.checkpoint_lsn: int = int(meta["checkpoint_lsn"])
        self.key_count: int = int(meta["key_count"])
        self.ttl_key_count: int = int(meta["ttl_key_count"])
        self._flush_seq = int(meta.get("flush_seq", 0))
        #: bytes of the page blobs as last committed (what size_limit bounds)
        self.data_bytes: int = int(meta.get("data_bytes", 0))
        self.ttl_clock: tuple[float, float] = (
            (0.0, -math.inf) if "ttl_clock_offset" not in meta else
            (float(meta["ttl_clock_offset"]), float(meta["ttl_clock_now"])))

    # -- connections ---------------------------------------------------------------

    @contextlib.contextmanager
    def _translate(self, what: str) -> Iterator[None]:
        try:
            yield
        except psycopg.Error as exc:
            raise self._error(what, exc) from exc

    def _error(self, what: str, exc: BaseException) -> StoreError:
        msg = _scrub(str(exc).strip(), self.conninfo)
        hint = ""
        if isinstance(exc, psycopg.errors.InsufficientPrivilege):
            user = self._user or "the role"
            hint = (f"; {user} may not create or use durablekv's tables: as a superuser, "
                    f"connected to the database, run GRANT USAGE, CREATE ON SCHEMA public TO "
                    f"{user}; (PostgreSQL 15 and later grant CREATE on public only to the "
                    "database's owner: CREATE DATABASE ... OWNER "
                    f"{user} avoids it), or GRANT SELECT, INSERT, UPDATE, DELETE on tables "
                    "another role created; see docs/postgres.md, \"Setting up the database\"")
        elif isinstance(exc, psycopg.errors.ReadOnlySqlTransaction):
            hint = ("; the server is a read-only standby: list the primary in the "
                    "connection string, or several hosts with target_session_attrs=read-write")
        elif isinstance(exc, psycopg.OperationalError):
            hint = ("; PostgreSQL is unreachable or read-only: check that the server runs "
                    "and the host, port, user, password and database are right")
        return StoreError(f"{what} on page store {self.path} failed: {msg}{hint}", self.path)

    def _connect(self) -> Any:
        """A new autocommit connection (the write one also takes the lock)."""
        try:
            conn = psycopg.connect(self.conninfo, autocommit=True,
                                   connect_timeout=max(1, int(math.ceil(self._connect_timeout))),
                                   application_name=f"durablekv pid {os.getpid()}")
        except psycopg.ProgrammingError as exc:
            raise ConfigError(f"the PostgreSQL connection string for {self.path} is not "
                              f"valid ({_scrub(str(exc), self.conninfo)})") from None
        except psycopg.Error as exc:
            text = _scrub(str(exc).strip(), self.conninfo)
            fix = ("check that the server runs and that the host, port, user, password and "
                   "database are right")
            if "does not exist" in text:
                fix = ("durablekv creates its tables but not the role or the database: as a "
                       "superuser, CREATE ROLE name LOGIN PASSWORD '...'; CREATE DATABASE name "
                       "OWNER role; (see docs/postgres.md, \"Setting up the database\")")
            raise StoreError(f"cannot connect to PostgreSQL at {self.where} (namespace "
                             f"{self.namespace!r}): {text}; unable to open a connection: {fix}",
                             self.path) from None
        try:
            if self._durability == "none":
                conn.execute("SET synchronous_commit = off")
            if conn.execute("SELECT pg_is_in_recovery()").fetchone()[0]:
                raise StoreError(
                    f"PostgreSQL at {conn.info.host}:{conn.info.port} ({self.where}) is a "
                    "read-only standby and refuses writes; connect to the primary, or list "
                    "several hosts with target_session_attrs=read-write so that the "
                    "primary is found", self.path)
        except BaseException:
            conn.close()
            raise
        return conn

    def _migrate(self) -> None:
        conn = self._w
        migrations = migration_files()
        with self._translate("schema check"), conn.transaction():
            conn.execute("SELECT pg_advisory_xact_lock(%s, %s)", _MIGRATE_LOCK)
            conn.execute("CREATE TABLE IF NOT EXISTS dkv_schema (version integer NOT NULL)")
            row = conn.execute("SELECT version FROM dkv_schema").fetchone()
            current = 0 if row is None else row[0]
            if current > len(migrations):
                raise SchemaVersionError(f"{self.where} (table dkv_schema)", current,
                                         len(migrations))
            for version, name, sql in migrations[current:]:
                conn.execute(sql)
                if row is None:
                    conn.execute("INSERT INTO dkv_schema (version) VALUES (%s)", (version,))
                    row = (version,)
                else:
                    conn.execute("UPDATE dkv_schema SET version = %s", (version,))
                log.info("applied %s to %s", name, self.where)

    def _namespace_id(self) -> int:
        conn = self._w
        with self._translate("namespace lookup"):
            conn.execute("INSERT INTO dkv_namespaces (name) VALUES (%s) ON CONFLICT DO NOTHING",
                         (self.namespace,))
            return int(conn.execute("SELECT ns_id FROM dkv_namespaces WHERE name = %s",
                                    (self.namespace,)).fetchone()[0])

    def _lock(self, wait: float = 0.0) -> None:
        """Take the namespace's advisory lock on the write connection, trying
        for up to ``wait`` seconds (a reconnect: this owner's old session may
        still be ending on the server)."""
        conn = self._w
        deadline = time.monotonic() + wait
        with self._translate("namespace lock"):
            while True:
                if conn.execute("SELECT pg_try_advisory_lock(%s, %s)",
                                (LOCK_CLASS, self.ns_id)).fetchone()[0]:
                    return
                if time.monotonic() >= deadline:
                    break
                time.sleep(0.05)  # the server ends a dead session on its own schedule
            row = conn.execute(
                "SELECT a.application_name, a.client_addr, a.pid FROM pg_locks AS l "
                "JOIN pg_stat_activity AS a ON a.pid = l.pid WHERE l.locktype = 'advisory' "
                "AND l.classid = %s AND l.objid = %s AND l.granted",
                (LOCK_CLASS, self.ns_id)).fetchone()
        owner = None if row is None else (f"{row[0] or 'a session'} (client {row[1] or 'local'}, "
                                          f"server pid {row[2]})")
        raise NamespaceLockedError(self.where, self.namespace, owner)

    def _claim(self) -> None:
        """Record this owner's token in ``meta.owner`` (with the lock held):
        the sync-mode log checks it before each commit (see pglog.py)."""
        self.owner_token = f"{os.getpid()}-{uuid.uuid4().hex}"
        with self._translate("namespace claim"):
            self._w.execute("INSERT INTO dkv_meta (ns_id, name, value) VALUES (%s, 'owner', %s) "
                            "ON CONFLICT (ns_id, name) DO UPDATE SET value = EXCLUDED.value",
                            (self.ns_id, self.owner_token))

    def _meta(self, conn: Any) -> dict[str, str]:
        with self._translate("meta read"):
            return dict(conn.execute("SELECT name, value FROM dkv_meta WHERE ns_id = %s",
                                     (self.ns_id,)).fetchall())

    def _settings(self, page_size: int | None, serializer: str) -> None:
        conn = self._w
        stored = self._meta(conn)
        if "page_size" not in stored:
            self.page_size = 16 if page_size is None else page_size
            self.serializer = serializer
            with self._translate("namespace setup"), conn.transaction():
                conn.cursor().executemany(
                    "INSERT INTO dkv_meta (ns_id, name, value) VALUES (%s, %s, %s) "
                    "ON CONFLICT DO NOTHING",
                    [(self.ns_id, n, str(v)) for n, v in
                     (("page_size", self.page_size), ("serializer", serializer),
                      ("namespace_uuid", uuid.uuid4().hex),
                      ("checkpoint_lsn", 0), ("key_count", 0), ("ttl_key_count", 0),
                      ("flush_seq", 0))])
            self.namespace_uuid = self._meta(conn)["namespace_uuid"]
            return
        self.namespace_uuid = stored.get("namespace_uuid", "")
        self.page_size = int(stored["page_size"])
        self.serializer = stored.get("serializer", "safe")
        if page_size is not None and page_size != self.page_size:
            raise ConfigError(
                f"{self.path} was created with page_size={self.page_size}, not {page_size}; "
                f"open it without page_size (or with page_size={self.page_size}), "
                "or use a new namespace")
        norm = {"json": "safe"}
        if norm.get(serializer, serializer) != norm.get(self.serializer, self.serializer):
            raise ConfigError(
                f"{self.path} stores values with serializer={self.serializer!r}, not "
                f"{serializer!r}; open it with serializer={self.serializer!r}")

    def _reader(self) -> Any:
        """The read connection, opened again if it was lost."""
        r = self._r
        if r is None or r.closed or r.broken:
            if r is not None:
                r.close()
            self._r = r = self._connect()
        return r

    def _read(self, what: str, fn: Any) -> Any:
        """``fn(read_connection)``; once more on a new connection when the
        old one turns out to be lost (the server restarted, or failed over)."""
        conn = self._reader()
        try:
            return fn(conn)
        except psycopg.OperationalError as exc:
            if not conn.broken:
                raise self._error(what, exc) from exc
        except psycopg.Error as exc:
            raise self._error(what, exc) from exc
        with self._translate(what):
            return fn(self._reader())

    def _fetch(self, what: str, sql: str, params: tuple, one: bool = False) -> Any:
        """Rows of one read statement (see :meth:`_read`): all, or the first."""
        def run(conn: Any) -> Any:
            cur = conn.execute(sql, params)
            return cur.fetchone() if one else cur.fetchall()
        return self._read(what, run)

    def _writer(self) -> Any:
        """The write connection; if it was lost, a new one that holds the lock
        again and has checked that no other owner flushed meanwhile."""
        w = self._w
        if w is not None and not w.closed and not w.broken:
            return w
        if w is not None:
            w.close()
        self._w = None
        conn = self._connect()
        self._w = conn
        try:
            self._lock(wait=_RELOCK_SECONDS)
            seq = int(self._meta(conn).get("flush_seq", 0))
        except BaseException:
            self._w = None
            conn.close()
            raise
        pending, self._unknown = self._unknown, None
        if pending is not None and seq == pending[0]:
            # the COMMIT whose answer was lost had landed: adopt it
            self._committed(*pending)
            self._carry += pending[1]
            log.warning("flush %d to %s had landed although its COMMIT lost the "
                        "connection", seq, self.path)
        elif seq != self._flush_seq:
            self._w = None
            conn.close()
            raise StoreError(
                f"page store {self.path} was taken over: another owner committed flush "
                f"{seq} after this one's {self._flush_seq} while its connection was lost; "
                "this cache stops writing (close it; reopen to continue from the store)",
                self.path)
        log.warning("reconnected to page store %s", self.path)
        return conn

    # -- reads (cache lock held) ---------------------------------------------------

    def find(self, ckey: bytes) -> tuple[int, int | None, bytes | None] | None:
        """``(page_id, n_entries, blob)`` of the page holding canonical key
        ``ckey``, ``(page_id, None, None)`` when the index points at a missing
        page, or None."""
        row = self._fetch("key lookup", _FIND_SQL, (self.ns_id, ckey), one=True)
        if row is None:
            return None
        pid, n, data, crc = row
        if data is not None:
            self._verify(pid, n, data, crc)
        return pid, n, data

    def read_page(self, page_id: int) -> tuple[int, bytes] | None:
        """``(n_entries, blob)`` of a committed page, or None."""
        row = self._fetch("page read", "SELECT n_entries, data, crc FROM dkv_pages WHERE "
                          "ns_id = %s AND page_id = %s", (self.ns_id, page_id), one=True)
        return None if row is None else self._verify(page_id, *row)

    def _verify(self, pid: Any, n: Any, data: Any, crc: Any) -> tuple[int, bytes]:
        """``(n, data)`` of a page row once its checksum holds.

        :raises CorruptStoreError: it does not (the row was changed outside
            durablekv, or damaged).
        """
        if page_crc(pid, n, data) != crc:
            raise CorruptStoreError(self.path, (
                f"page {pid!r} fails its checksum (stored {crc!r}, computed "
                f"{page_crc(pid, n, data)}): its blob or entry count was changed in the "
                "database (a hand edit, a restore that mixed rows)"))
        return n, data

    def pause_snapshot(self) -> None:
        """Nothing to do: every read is its own statement (autocommit)."""

    def resume_snapshot(self) -> None:
        """Nothing to do (see :meth:`pause_snapshot`)."""

    def locate_keys(self, ckeys: Sequence[bytes]) -> dict[bytes, int]:
        """``{canonical key: page_id}`` for those of ``ckeys`` in the key index."""
        if not ckeys:
            return {}
        return dict(self._fetch("key lookup", "SELECT key, page_id FROM dkv_keys WHERE "
                                "ns_id = %s AND key = ANY(%s)", (self.ns_id, list(ckeys))))

    def read_pages(self, page_ids: Sequence[int]) -> dict[int, tuple[int, bytes]]:
        """``{page_id: (n_entries, blob)}`` for those of ``page_ids`` that exist."""
        if not page_ids:
            return {}
        rows = self._fetch("page read", "SELECT page_id, n_entries, data, crc FROM dkv_pages "
                           "WHERE ns_id = %s AND page_id = ANY(%s)",
                           (self.ns_id, list(page_ids)))
        return {pid: self._verify(pid, n, data, crc) for pid, n, data, crc in rows}

    def scan_index(self) -> Iterator[tuple[bytes, bytes | None, int, float | None]]:
        """Every committed index row ``(key, orig, page_id, expire_at)``."""
        return iter(self._fetch("index scan", "SELECT key, orig, page_id, expire_at FROM "
                                "dkv_keys WHERE ns_id = %s", (self.ns_id,)))

    def iter_keys(self, batch: int = 10_000) -> Iterator[bytes]:
        """Every committed canonical key, read on the WRITE connection (the
        batcher thread), through a server-side cursor ``batch`` rows at a time."""
        with self._translate("key scan"):
            conn = self._writer()
            with conn.transaction(), conn.cursor(name="dkv_iter_keys") as cur:
                cur.itersize = batch
                cur.execute("SELECT key FROM dkv_keys WHERE ns_id = %s", (self.ns_id,))
                for (key,) in cur:
                    yield key

    def expired_by_page(self, now: float) -> list[tuple[int, int]]:
        """``(page_id, entries)`` for each committed page holding entries with
        ``expire_at <= now`` (epoch seconds)."""
        return self._fetch("expiry scan", "SELECT page_id, COUNT(*) FROM dkv_keys WHERE "
                           "ns_id = %s AND expire_at IS NOT NULL AND expire_at <= %s "
                           "GROUP BY page_id", (self.ns_id, now))

    def expired_pages(self, now: float, skip: Container[int], limit: int) -> list[int]:
        """Ids of up to ``limit`` committed pages, not in ``skip``, holding
        entries with ``expire_at <= now`` (epoch seconds)."""
        pids: list[int] = []
        for (pid,) in self._fetch("expiry scan", "SELECT DISTINCT page_id FROM dkv_keys WHERE "
                                  "ns_id = %s AND expire_at IS NOT NULL AND expire_at <= %s",
                                  (self.ns_id, now)):
            if pid not in skip:
                pids.append(pid)
                if len(pids) >= limit:
                    break
        return pids

    def any_key(self, exclude_pages: set[int]) -> tuple[bytes, bytes | None] | None:
        """Some committed ``(key, orig)`` on a page not in ``exclude_pages``, or None."""
        row = self._fetch("index scan", "SELECT key, orig FROM dkv_keys WHERE ns_id = %s AND "
                          "NOT (page_id = ANY(%s)) LIMIT 1", (self.ns_id, list(exclude_pages)),
                          one=True)
        return None if row is None else (row[0], row[1])

    # -- writes (batcher thread) ---------------------------------------------------

    def write_batch(self, images: Sequence[PageImage], checkpoint_lsn: int, key_count: int,
                    ttl_key_count: int, clear: bool = False, *,
                    held_pages: Set[int] = frozenset(),
                    ttl_clock: tuple[float, float] | None = None,
                    size_limit: int | None = None, keep_pages: Container[int] = frozenset(),
                    left_pages: Sequence[int] = ()) -> list[bytes]:
        """Write pages, index changes, the checkpoint LSN and the counts in ONE
        transaction; parameters, result and errors as
        :meth:`durablekv.stores.base.PageStore.write_batch` (eviction for
        ``size_limit`` included).

        :raises StoreError: the transaction failed and was rolled back, or
            the connection was lost and the namespace taken over meanwhile.
        :raises NamespaceLockedError: the connection was lost and another
            session now owns the namespace.
        """
        ns = self.ns_id
        seq = self._flush_seq + 1
        with self._translate("flush"):
            conn = self._writer()
            committing = False
            try:
                with conn.transaction():
                    cur = conn.cursor()
                    if clear:
                        cur.execute("DELETE FROM dkv_keys WHERE ns_id = %s", (ns,))
                        cur.execute("DELETE FROM dkv_pages WHERE ns_id = %s", (ns,))
                    data_bytes = 0 if clear else self.data_bytes - self._stored_bytes(
                        cur, [img.page_id for img in images if img.stored])
                    data_bytes += sum(len(img.data) for img in images if img.n)
                    evicted: list[tuple[int, int, int]] = []
                    if size_limit is not None and data_bytes > size_limit and not clear:
                        # other pages first (see the SQLite store): never the
                        # pages written here, nor those this batch marks as used
                        skip = {img.page_id for img in images} | set(left_pages)
                        data_bytes, evicted = self._evict(
                            cur, data_bytes, size_limit,
                            skip if not keep_pages else _Either(keep_pages, skip))
                    added = self._write_pages(cur, images, clear, held_pages, checkpoint_lsn)
                    if left_pages and not clear:
                        cur.execute("UPDATE dkv_pages SET last_use = %s WHERE ns_id = %s AND "
                                    "page_id = ANY(%s)", (checkpoint_lsn, ns, list(left_pages)))
                    if size_limit is not None and data_bytes > size_limit:
                        data_bytes, more = self._evict(cur, data_bytes, size_limit, keep_pages)
                        evicted += more
                    if evicted:
                        key_count -= sum(e[1] for e in evicted)
                        ttl_key_count -= sum(e[2] for e in evicted)
                    meta = [("checkpoint_lsn", checkpoint_lsn), ("key_count", key_count),
                            ("ttl_key_count", ttl_key_count), ("flush_seq", seq),
                            ("data_bytes", data_bytes)]
                    if ttl_clock is not None and ttl_clock != self.ttl_clock:
                        meta += [("ttl_clock_offset", repr(ttl_clock[0])),
                                 ("ttl_clock_now", repr(ttl_clock[1]))]
                    cur.execute(
                        "INSERT INTO dkv_meta (ns_id, name, value) SELECT %s, n, v FROM "
                        "unnest(%s::text[], %s::text[]) AS m(n, v) ON CONFLICT (ns_id, name) "
                        "DO UPDATE SET value = EXCLUDED.value",
                        (ns, [m[0] for m in meta], [str(m[1]) for m in meta]))
                    committing = True
                    self._before_commit()
                self._after_commit()
            except psycopg.OperationalError:
                if not committing:
                    raise
                # The COMMIT's outcome is unknown: the next connection reads
                # flush_seq to learn it (now if the server is back, else at the
                # next flush), so that the flush is neither applied twice nor,
                # when it landed, reported failed.
                self._unknown = (seq, added, checkpoint_lsn, key_count, ttl_key_count, ttl_clock,
                                 data_bytes, evicted)
                with contextlib.suppress(StoreError, psycopg.Error):
                    self._w.close()
                    self._writer()
                if self._flush_seq != seq:
                    raise
                return self._take_carry()
        self._committed(seq, [], checkpoint_lsn, key_count, ttl_key_count, ttl_clock,
                        data_bytes, evicted)
        return self._take_carry() + added

    def _committed(self, seq: int, added: list[bytes], checkpoint_lsn: int, key_count: int,
                   ttl_key_count: int, ttl_clock: tuple[float, float] | None,
                   data_bytes: int, evicted: list[tuple[int, int, int]]) -> None:
        """Record that flush ``seq`` committed with these values."""
        self._flush_seq = seq
        self.data_bytes = data_bytes
        self._evicted += evicted
        self.checkpoint_lsn = checkpoint_lsn
        self.key_count = key_count
        self.ttl_key_count = ttl_key_count
        if ttl_clock is not None:
            self.ttl_clock = ttl_clock

    def take_evicted(self) -> list[tuple[int, int, int]]:
        """As :meth:`durablekv.stores.base.PageStore.take_evicted`."""
        out, self._evicted = self._evicted, []
        return out

    def _stored_bytes(self, cur: Any, page_ids: list[int]) -> int:
        """Bytes of the committed blobs of ``page_ids``."""
        if not page_ids:
            return 0
        cur.execute("SELECT COALESCE(SUM(octet_length(data)), 0) FROM dkv_pages "
                    "WHERE ns_id = %s AND page_id = ANY(%s)", (self.ns_id, page_ids))
        return int(cur.fetchone()[0])

    def _evict(self, cur: Any, data_bytes: int, size_limit: int,
               keep: Container[int]) -> tuple[int, list[tuple[int, int, int]]]:
        """As the SQLite store's ``_evict``: least recently used pages not in
        ``keep`` go, with their index rows, until ``data_bytes <= size_limit``."""
        ns = self.ns_id
        after = (-1, -1)
        victims: list[tuple[int, int]] = []
        while data_bytes > size_limit:
            cur.execute("SELECT page_id, n_entries, octet_length(data), last_use FROM dkv_pages "
                        "WHERE ns_id = %s AND (last_use, page_id) > (%s, %s) "
                        "ORDER BY last_use, page_id LIMIT 256", (ns, *after))
            rows = cur.fetchall()
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
        pids = [v[0] for v in victims]
        cur.execute("SELECT page_id, count(*) FROM dkv_keys WHERE ns_id = %s AND "
                    "expire_at IS NOT NULL AND page_id = ANY(%s) GROUP BY page_id", (ns, pids))
        ttl = {int(p): int(c) for p, c in cur.fetchall()}
        cur.execute("DELETE FROM dkv_keys WHERE ns_id = %s AND page_id = ANY(%s)", (ns, pids))
        cur.execute("DELETE FROM dkv_pages WHERE ns_id = %s AND page_id = ANY(%s)", (ns, pids))
        return data_bytes, [(p, n, ttl.get(p, 0)) for p, n in victims]

    def _take_carry(self) -> list[bytes]:
        """Keys added by an earlier flush found landed after its COMMIT lost
        the connection: the caller's key filter must still learn them."""
        carry, self._carry = self._carry, []
        return carry

    def _before_commit(self) -> None:
        """Runs inside the flush transaction just before COMMIT (a seam:
        crash tests stop the process here)."""

    def _after_commit(self) -> None:
        """Runs just after COMMIT returned (a seam: tests lose the connection
        here, which is what a COMMIT whose answer never arrives looks like)."""

    def _write_pages(self, cur: Any, images: Sequence[PageImage], clear: bool,
                     held_pages: Set[int], last_use: int = 0) -> list[bytes]:
        """The page and index statements of one flush (see :meth:`write_batch`)."""
        ns = self.ns_id
        added: list[bytes] = []
        upserts: dict[bytes, tuple] = {}          # key -> (page_id, expire_at, orig)
        gone: list[tuple[bytes, int]] = []        # (key, page_id) rows to delete
        emptied: list[int] = []
        page_rows: dict[int, tuple[int, bytes]] = {}
        changed: list[PageImage] = []             # stored pages whose key set changed
        for img in images:
            stored = img.stored and not clear
            if not img.n:
                if stored:
                    emptied.append(img.page_id)
                continue
            page_rows[img.page_id] = (img.n, img.data)
            if img.index_rows is None:
                continue
            if stored:
                changed.append(img)
            else:
                for k, e, o in img.index_rows:
                    upserts[k] = (img.page_id, e, o)
                    added.append(k)
        if changed:
            have: dict[int, dict[bytes, tuple]] = {img.page_id: {} for img in changed}
            cur.execute("SELECT page_id, key, expire_at, orig FROM dkv_keys WHERE ns_id = %s "
                        "AND page_id = ANY(%s)", (ns, list(have)))
            for pid, k, e, o in cur.fetchall():
                have[pid][k] = (e, o)
            for img in changed:
                old_rows = have[img.page_id]
                for k, e, o in img.index_rows:
                    old = old_rows.pop(k, None)
                    if old is None:
                        upserts[k] = (img.page_id, e, o)
                        added.append(k)
                    elif old[0] != e or old[1] != o:
                        upserts[k] = (img.page_id, e, o)
                gone += [(k, img.page_id) for k in old_rows]
        if held_pages and added:
            cur.execute("SELECT key, page_id FROM dkv_keys WHERE ns_id = %s AND key = ANY(%s) "
                        "AND page_id = ANY(%s)", (ns, added, list(held_pages)))
            row = cur.fetchone()
            if row is not None:
                raise HeldKeyError(
                    f"a page written with key {row[0]!r} cannot be stored before page "
                    f"{row[1]}, which still holds that key in the store and is not being "
                    "stored now; it is stored together with that page", self.path)
        if emptied:
            cur.execute("DELETE FROM dkv_keys WHERE ns_id = %s AND page_id = ANY(%s)",
                        (ns, emptied))
            cur.execute("DELETE FROM dkv_pages WHERE ns_id = %s AND page_id = ANY(%s)",
                        (ns, emptied))
        if gone:
            cur.execute("DELETE FROM dkv_keys AS k USING unnest(%s::bytea[], %s::bigint[]) "
                        "AS g(key, page_id) WHERE k.ns_id = %s AND k.key = g.key "
                        "AND k.page_id = g.page_id",
                        ([g[0] for g in gone], [g[1] for g in gone], ns))
        if upserts:
            keys = sorted(upserts)
            rows = [upserts[k] for k in keys]
            cur.execute(
                "INSERT INTO dkv_keys (ns_id, key, page_id, expire_at, orig) SELECT %s, * FROM "
                "unnest(%s::bytea[], %s::bigint[], %s::float8[], %s::bytea[]) "
                "ON CONFLICT (ns_id, key) DO UPDATE SET page_id = EXCLUDED.page_id, "
                "expire_at = EXCLUDED.expire_at, orig = EXCLUDED.orig",
                (ns, keys, [r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows]))
        if page_rows:
            pids = sorted(page_rows)
            cur.execute(
                "INSERT INTO dkv_pages (ns_id, page_id, n_entries, data, crc, last_use) "
                "SELECT %s, *, %s FROM "
                "unnest(%s::bigint[], %s::int[], %s::bytea[], %s::bigint[]) "
                "ON CONFLICT (ns_id, page_id) DO UPDATE SET n_entries = EXCLUDED.n_entries, "
                "data = EXCLUDED.data, crc = EXCLUDED.crc, last_use = EXCLUDED.last_use",
                (ns, last_use, pids, [page_rows[p][0] for p in pids], [page_rows[p][1] for p in pids],
                 [page_crc(p, *page_rows[p]) for p in pids]))
        return added

    # -- misc ----------------------------------------------------------------------

    def size_bytes(self) -> int:
        """Bytes of this namespace's page blobs (one aggregate query, O(pages))."""
        return int(self._fetch("size query", "SELECT COALESCE(SUM(octet_length(data)), 0) "
                               "FROM dkv_pages WHERE ns_id = %s", (self.ns_id,), one=True)[0])

    def integrity_check(self) -> list[str]:
        """Check that the key index and the pages agree both ways and that the
        stored key count matches (O(store size)); [] when healthy."""
        from ..check import index_agreement
        conn = self._reader()
        with self._translate("integrity check"), conn.transaction():
            conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
            index = {k: (pid, exp) for k, pid, exp in conn.execute(
                "SELECT key, page_id, expire_at FROM dkv_keys WHERE ns_id = %s",
                (self.ns_id,)).fetchall()}
            pages = conn.execute("SELECT page_id, n_entries, data, crc FROM dkv_pages "
                                 "WHERE ns_id = %s", (self.ns_id,)).fetchall()
            meta = self._meta(conn)
        problems, _, _ = index_agreement(index, pages, int(meta.get("key_count", -1)),
                                         self.page_size, checksums=True)
        return problems

    def close(self, checkpoint_wal: bool = False) -> None:
        """Close both connections; the namespace's lock ends with the write one's session."""
        for attr in ("_r", "_w"):
            conn = getattr(self, attr)
            if conn is None:
                continue
            setattr(self, attr, None)
            with contextlib.suppress(Exception):
                conn.close()

