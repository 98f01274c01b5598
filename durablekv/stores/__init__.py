"""Page stores: the :class:`~durablekv.stores.base.PageStore` protocol and its implementations.

* :mod:`durablekv.stores.base`: the protocol and the contracts every store keeps.
* :mod:`durablekv.stores.pageformat`: the page blob format all stores share.
* :mod:`durablekv.stores.sqlite`: ``SQLitePageStore``, ``pages.sqlite3`` in the cache directory;
  :mod:`durablekv.stores.sqlitefile`: that file's name, damage marker, header check, migrations.
* :mod:`durablekv.stores.postgres`: ``PostgresPageStore``, one namespace of a PostgreSQL
  database (the ``postgres`` extra); :mod:`durablekv.stores.pglog`: the replay log in
  PostgreSQL for ``durability="sync"``.
* :mod:`durablekv.stores.factory`: :func:`open_store`, the one place a cache's store
  (and its replay log) is chosen from its location, with the checks of ``store=`` and
  ``namespace=``.
"""

from .factory import open_store

__all__ = ["open_store"]
