"""How a :class:`~durablekv.Cache` opens a PostgreSQL page store.

``Cache(directory, store="postgresql://...", namespace="name")``: the pages,
key index and checkpoint go to PostgreSQL (:mod:`durablekv.stores.postgres`);
the directory keeps the ``LOCK`` file and (except with ``durability="sync"``,
whose log is in PostgreSQL: :mod:`durablekv.stores.pglog`) the replay log.
The cache's own code only calls :func:`check_store_args`, :func:`open_store`
and :func:`open_log`.
"""

from __future__ import annotations

from typing import Any

from .errors import ConfigError

__all__ = ["check_store_args", "open_store", "open_log", "is_postgres_url"]


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
        shown = store.split("@", 1)[-1] if isinstance(store, str) else store
        raise ConfigError(f"store must be None (SQLite in the cache directory) or a "
                          f"'postgresql://' URL, got {shown!r}; e.g. "
                          "store='postgresql://user@db.example:5432/cache'")
    if not isinstance(namespace, str) or not namespace:
        raise ConfigError(f"a PostgreSQL store needs namespace= (a non-empty str naming this "
                          f"cache in the database), got {namespace!r}")


def open_store(store: str, namespace: str, *, durability: str, page_size: int | None,
               serializer: str, connect_timeout: float) -> Any:
    """The :class:`~durablekv.stores.postgres.PostgresPageStore` of a cache."""
    from .stores.postgres import PostgresPageStore
    return PostgresPageStore(store, namespace, durability=durability, page_size=page_size,
                             serializer=serializer, connect_timeout=connect_timeout)


def open_log(store: Any, directory: str) -> Any:
    """The ``durability="sync"`` log of a PostgreSQL store's cache
    (:class:`~durablekv.stores.pglog.PgReplayLog`)."""
    from .stores.pglog import PgReplayLog
    return PgReplayLog(store, directory)
