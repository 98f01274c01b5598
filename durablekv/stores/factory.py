"""Which page store a cache opens, and its replay log: the one place a
store is chosen, and the checks of ``store=`` and ``namespace=``.

:func:`open_store` opens SQLite (``pages.sqlite3`` in the cache directory,
:mod:`durablekv.stores.sqlite`) or, for ``store="postgresql://..."``, one
namespace of a PostgreSQL database (:mod:`durablekv.stores.postgres`), and
the replay log beside it (except with ``durability="sync"``, whose log is
in PostgreSQL: :mod:`durablekv.stores.pglog`). A PostgreSQL cache's
directory keeps the ``LOCK`` file and the replay log, bound to its
namespace by the ``STORE`` file (:func:`bind_directory`).
"""

from __future__ import annotations

import logging
import os
from typing import Any

from .._perms import FILE_MODE
from ..errors import ConfigError, CorruptStoreError
from ..log.replaylog import ReplayLog, _fsync_dir
from ..log.segments import _first_lsn_of, list_segments
from .base import PageStore
from .sqlite import SQLitePageStore
from .sqlitefile import STORE_FILE, check_store_files, move_aside

log = logging.getLogger("durablekv")

__all__ = ["open_store", "check_store_args", "refuse_other_kinds", "bind_directory",
           "is_postgres_url", "BINDING_FILE"]


def is_postgres_url(store: Any) -> bool:
    return isinstance(store, str) and store.startswith(("postgresql://", "postgres://"))


def check_store_args(store: Any, namespace: Any, durability: str) -> None:
    """Validate ``Cache(store=..., namespace=...)``.

    :raises ConfigError: ``store`` is neither None nor a ``postgresql://``
        URL, a PostgreSQL store has no ``namespace`` (or a namespace without
        a store), or ``durability="sync"`` without a PostgreSQL store.
    """
    if store is None:
        if namespace is not None:
            raise ConfigError(f"namespace={namespace!r} names a cache in a PostgreSQL store, "
                              "but no store= was given; pass store='postgresql://...' too, "
                              "or drop namespace")
        if durability == "sync":
            raise ConfigError("durability='sync' commits every write to PostgreSQL and needs "
                              "a PostgreSQL store; pass store='postgresql://...' and "
                              "namespace=..., or use durability='fsync' for a local cache")
        return
    if not is_postgres_url(store):
        shown = _redacted(store) if isinstance(store, str) else store
        raise ConfigError(f"store must be None (SQLite in the cache directory) or a "
                          f"'postgresql://' URL, got {shown!r}; e.g. "
                          "store='postgresql://user@db.example:5432/cache'")
    if not isinstance(namespace, str) or not namespace:
        raise ConfigError(f"a PostgreSQL store needs namespace= (a non-empty str naming this "
                          f"cache in the database), got {namespace!r}")


def _redacted(url: str) -> str:
    """``url`` as it may be shown in a message: whole, but for a password
    (``user:secret@host`` becomes ``user:***@host``)."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    netloc, slash, path = rest.partition("/")
    userinfo, at, host = netloc.rpartition("@")
    if at and ":" in userinfo:
        userinfo = userinfo.split(":", 1)[0] + ":***"
    return f"{scheme}{sep}{userinfo}{at}{host}{slash}{path}"


def _open_postgres(url: str, namespace: str, directory: str, *, durability: str,
                   page_size: int | None, serializer: str, connect_timeout: float) -> Any:
    """The :class:`~durablekv.stores.postgres.PostgresPageStore` of the cache
    in ``directory``, which is bound to it (see :func:`bind_directory`)."""
    from .postgres import PostgresPageStore
    opened = PostgresPageStore(url, namespace, durability=durability, page_size=page_size,
                               serializer=serializer, connect_timeout=connect_timeout)
    try:
        bind_directory(directory, opened)
    except BaseException:
        opened.close()
        raise
    return opened


#: In a cache directory: which PostgreSQL namespace its replay log belongs to.
BINDING_FILE = "STORE"


def bind_directory(directory: str, store: Any) -> None:
    """Make sure the replay log in ``directory`` belongs to ``store``'s namespace.

    The log's records after the store's checkpoint are replayed into the
    store at open; a log written for another namespace, or for the SQLite
    store in the directory, would mix another cache's writes in. The
    directory's ``STORE`` file names the namespace (``namespace_uuid``,
    fixed when the namespace was created) it was last opened with.

    :raises ConfigError: the directory holds log segments of another
        namespace or of its SQLite store.
    """
    path = os.path.join(directory, BINDING_FILE)
    line = f"postgresql {store.namespace_uuid} {store.namespace}\n"
    try:
        with open(path, encoding="utf-8") as f:
            bound: str | None = f.read()
    except FileNotFoundError:
        bound = None
    if bound == line:
        return
    if list_segments(directory):
        other = (bound or "").split()
        if len(other) >= 3 and other[2] == store.namespace:
            raise ConfigError(
                f"namespace {store.namespace!r} on {store.where} was created anew (uuid "
                f"{store.namespace_uuid}, the replay log in {directory!r} was written for "
                f"uuid {other[1]}): the database lost the store this log continues (a new "
                "or restored server?). Replaying it would leave a cache with a hole; restore "
                "the database, or move the replay-*.log files away to start from it as it is")
        if bound is not None:
            what = (f"namespace {other[2]!r} (uuid {other[1]})" if len(other) >= 3
                    else f"something else ({bound.strip()!r})")
        elif os.path.exists(os.path.join(directory, STORE_FILE)):
            what = f"the SQLite store {STORE_FILE} beside it"
        else:
            what = "no PostgreSQL namespace (the directory has no STORE file)"
        raise ConfigError(
            f"the replay log in {directory!r} belongs to {what}, not to namespace "
            f"{store.namespace!r} on {store.where}; replaying it there would mix another "
            "cache's writes in. Open the directory with the store its log belongs to (a "
            "clean close() empties the log), or use a new directory")
    tmp = path + ".new"
    with open(tmp, "w", encoding="utf-8",
              opener=lambda p, flags: os.open(p, flags, FILE_MODE)) as f:
        f.write(line)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(directory)


def refuse_other_kinds(directory: str) -> None:
    """Refuse to open ``directory`` with the SQLite store when it belongs to
    another kind of cache: a PostgreSQL namespace (its ``STORE`` file) or a
    ShardedCache (its ``SHARDS`` file). Either would open empty beside the
    real data, and a PostgreSQL cache's replay log would be replayed into a
    new SQLite store.

    :raises ConfigError: naming what the directory is and how to open it.
    """
    path = os.path.join(directory, BINDING_FILE)
    try:
        with open(path, encoding="utf-8") as f:
            bound = f.read().split()
    except FileNotFoundError:
        bound = None
    if bound is not None:
        name = bound[2] if len(bound) >= 3 else "?"
        raise ConfigError(
            f"{directory!r} belongs to PostgreSQL namespace {name!r} (its {BINDING_FILE} file "
            f"says so): open it with Cache({directory!r}, store='postgresql://...', "
            f"namespace={name!r}); to use the directory with the SQLite store instead, close "
            f"that cache cleanly and remove {path!r}")
    if os.path.exists(os.path.join(directory, "SHARDS")):
        raise ConfigError(f"{directory!r} is a ShardedCache directory (it has a SHARDS file and "
                          "shard-NN directories): open it with durablekv.ShardedCache"
                          f"({directory!r})")


def open_store(directory: str, url: str | None = None, *, namespace: str | None = None,
               durability: str = "log", page_size: int | None = None,
               serializer: str = "safe", busy_timeout: float = 5.0,
               on_corruption: str = "raise",
               segment_bytes: int = 64 << 20) -> tuple[PageStore, Any]:
    """Open the page store of the cache in ``directory`` and its replay log:
    the one place a store is chosen.

    :param directory: the cache directory (its ``LOCK`` is held by the caller).
    :param url: None for SQLite (``pages.sqlite3`` in ``directory``), or a
        ``postgresql://`` URL (checked by :func:`check_store_args` first).
    :param namespace: the PostgreSQL namespace (with ``url``).
    :param durability: ``"none"``, ``"log"``, ``"fsync"``, or ``"sync"``
        (PostgreSQL only: the log is the database's, :class:`PgReplayLog`).
    :param page_size: entries per page for a new store; None: the stored one.
    :param serializer: the value codec's name, checked against the store's.
    :param busy_timeout: seconds to wait for a lock (SQLite) or to connect
        (PostgreSQL).
    :param on_corruption: ``"raise"``, or ``"rebuild"``: a damaged SQLite
        store is moved aside (``pages.sqlite3.corrupt-<time>``) and a new,
        empty one continues the replay log; the new store's ``rebuilt_from``
        names the old one.
    :param segment_bytes: the replay log's segment size.
    :returns: ``(store, log)``; the log is not recovered yet (the caller
        runs ``log.recover(store.checkpoint_lsn)``). On an error nothing is
        left open.
    :raises ConfigError: bad ``url``/``namespace``, or a log that belongs to
        another store.
    :raises CorruptStoreError: a damaged store (``on_corruption="raise"``).
    :raises StoreError: the store cannot be opened.
    """
    check_store_args(url, namespace, durability)
    if url is None:
        check_store_files(directory)
        try:
            store: Any = SQLitePageStore(directory, durability=durability, page_size=page_size,
                                         serializer=serializer, busy_timeout=busy_timeout,
                                         verify=on_corruption == "rebuild")
        except CorruptStoreError as exc:
            if on_corruption != "rebuild":
                raise
            store = _rebuild(directory, exc, durability=durability, page_size=page_size,
                             serializer=serializer, busy_timeout=busy_timeout)
    else:
        store = _open_postgres(url, namespace, directory, durability=durability,
                               page_size=page_size, serializer=serializer,
                               connect_timeout=busy_timeout)
    try:
        # The log exists in every mode at recovery time: a directory last used
        # with durability="log" may hold records that must be replayed.
        if durability == "sync":
            from .pglog import PgReplayLog
            log: Any = PgReplayLog(store, directory)
        else:
            log = ReplayLog(directory, durability=durability, segment_bytes=segment_bytes)
    except BaseException:
        store.close()
        raise
    return store, log


def _rebuild(directory: str, exc: CorruptStoreError, **options: Any) -> SQLitePageStore:
    """A new, empty SQLite store in place of the damaged one, which moves
    aside: the new one is built whole first, and starts where the replay log
    does, which it continues."""
    segments = list_segments(directory)
    SQLitePageStore.prepare_rebuild(
        directory, page_size=options["page_size"], serializer=options["serializer"],
        checkpoint_lsn=_first_lsn_of(segments[0]) - 1 if segments else 0)
    aside = move_aside(os.path.join(directory, STORE_FILE))
    log.warning("page store %s is damaged (%s); moved it to %s and started empty",
                exc.path, exc.detail, aside)
    return SQLitePageStore(directory, rebuilt_from=aside, **options)
