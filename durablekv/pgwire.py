"""How a :class:`~durablekv.Cache` opens a PostgreSQL page store.

``Cache(directory, store="postgresql://...", namespace="name")``: the pages,
key index and checkpoint go to PostgreSQL (:mod:`durablekv.stores.postgres`);
the directory keeps the ``LOCK`` file and (except with ``durability="sync"``,
whose log is in PostgreSQL: :mod:`durablekv.stores.pglog`) the replay log.
The cache's own code only calls :func:`check_store_args`, :func:`open_store`
and :func:`open_log`.
"""

from __future__ import annotations

import os
from typing import Any

from ._perms import FILE_MODE
from .errors import ConfigError
from .log.segments import list_segments
from .log.replaylog import _fsync_dir
from .stores.sqlitefile import STORE_FILE

__all__ = ["check_store_args", "open_store", "open_log", "bind_directory", "is_postgres_url",
           "BINDING_FILE"]


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


def open_store(store: str, namespace: str, directory: str, *, durability: str,
               page_size: int | None, serializer: str, connect_timeout: float) -> Any:
    """The :class:`~durablekv.stores.postgres.PostgresPageStore` of the cache
    in ``directory``, which is bound to it (see :func:`bind_directory`)."""
    from .stores.postgres import PostgresPageStore
    opened = PostgresPageStore(store, namespace, durability=durability, page_size=page_size,
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


def open_log(store: Any, directory: str) -> Any:
    """The ``durability="sync"`` log of a PostgreSQL store's cache
    (:class:`~durablekv.stores.pglog.PgReplayLog`)."""
    from .stores.pglog import PgReplayLog
    return PgReplayLog(store, directory)
