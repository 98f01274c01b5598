"""A requests-cache backend on durablekv: HTTP responses that survive a
restart and a kill -9, in a bounded memory tier.

::

    import requests_cache
    from durablekv.contrib.requests_cache import DurableKVBackend

    session = requests_cache.CachedSession("http", backend=DurableKVBackend("var/http"),
                                           expire_after=300)
    requests_cache.install_cache("http", backend=DurableKVBackend("var/http"))

requests-cache decides what to cache, for how long and when to revalidate
(``expire_after``, ``Cache-Control``, ``ETag``/``Last-Modified``,
``stale_if_error``, ``filter_fn``); this module stores what it decides, as
its Redis backend does:

- ``responses`` and ``redirects`` are two :class:`DurableKVDict` storages,
  each a durablekv Cache in a directory of its own under ``cache_name``
  (``<cache_name>/responses``, ``<cache_name>/redirects``).
- Responses are serialized by requests-cache's serializer (``"pickle"`` by
  default, as for its SQLite backend; ``"json"``, ``"yaml"``, ``"bson"`` or a
  ``SerializerPipeline`` work the same), redirects are stored as plain str.
- A response that expires gets a durablekv TTL of its remaining life plus
  ``ttl_offset`` (3600 s, Redis's default), so an expired response stays
  available for revalidation and ``stale_if_error`` for an hour, then leaves
  by itself (one saved already past that is kept with no TTL, as the Redis
  backend does); ``ttl=False`` keeps every response until it is deleted.
- Options of :class:`~durablekv.Cache` (``page_size``, ``max_pages``,
  ``durability``, ``size_limit``, ...) pass through the keyword arguments;
  every instance on one directory in this process shares one open Cache.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any, Iterable, Iterator

from requests_cache.backends.base import BaseCache, BaseStorage
from requests_cache.backends.sqlite import get_cache_path
from requests_cache.serializers import pickle_serializer

from ..cache import Cache
from ..errors import ConfigError
from ._shared import Location, close_all, open_shared

__all__ = ["DurableKVBackend", "DurableKVDict", "close_caches"]

#: flush and close every directory's Cache in this process (also run at exit)
close_caches = close_all

#: seconds an expired response is kept for revalidation (Redis backend's default)
DEFAULT_TTL_OFFSET = 3600

_CACHE_PARAMS = frozenset(p for p in inspect.signature(Cache.__init__).parameters
                          if p not in ("self", "directory"))
_MISSING = object()


def _mismatch(path: str, have: dict, want: dict) -> Exception:
    return ConfigError(f"cache directory {path!r} is open in this process with durablekv "
                       f"options {have}, and another requests-cache backend asks for {want}; "
                       "one Cache serves a directory, so pass the same options, or use "
                       "another cache_name")


class DurableKVDict(BaseStorage):
    """One requests-cache table (``responses``, ``redirects``) as a durablekv
    Cache in ``<cache_name>/<table_name>``.

    :param cache_name: the base directory (relative to the working directory,
        or to the user cache dir / temp dir with ``use_cache_dir`` / ``use_temp``).
    :param table_name: the table, a subdirectory.
    :param serializer: requests-cache's serializer (default ``pickle``); None
        stores values as they are (str, bytes, numbers).
    :param ttl: give expiring responses a durablekv TTL (default True).
    :param ttl_offset: seconds past a response's expiry it is kept (default 3600).
    :param kwargs: :class:`~durablekv.Cache` arguments, and requests-cache's
        own settings, which this storage ignores (as its other backends do).
    :raises ConfigError: a directory open in this process with other options.
    """

    def __init__(self, cache_name: Any = "http_cache", table_name: str = "http_cache",
                 serializer: Any = pickle_serializer, use_cache_dir: bool = False,
                 use_temp: bool = False, ttl: bool = True,
                 ttl_offset: int = DEFAULT_TTL_OFFSET, **kwargs: Any) -> None:
        super().__init__(serializer=serializer, **kwargs)
        self.cache_dir: Path = get_cache_path(cache_name, use_cache_dir=use_cache_dir,
                                              use_temp=use_temp)
        self.table_name = table_name
        self.directory = self.cache_dir / table_name
        self.ttl = ttl
        self.ttl_offset = ttl_offset
        options = {k: v for k, v in kwargs.items() if k in _CACHE_PARAMS}
        options.setdefault("warm", False)
        self._options = options
        self._loc: Location = self._open()

    def _open(self) -> Location:
        return open_shared(self.directory, self._options, mismatch=_mismatch,
                           locked_hint="a durablekv directory belongs to one process at a "
                           "time: give each process its own cache_name")

    @property
    def cache(self) -> Cache:
        """The durablekv Cache of this table (reopened if its directory was deleted)."""
        if not self._loc.alive():
            self._loc = self._open()
        return self._loc.cache

    def __getitem__(self, key: str) -> Any:
        stored = self.cache.get(key, _MISSING)
        if stored is _MISSING:
            raise KeyError(key)
        return self.deserialize(key, stored)

    def __setitem__(self, key: str, value: Any) -> None:
        expire = None
        delta = getattr(value, "expires_delta", None)
        if self.ttl and delta is not None and delta + self.ttl_offset > 0:
            expire = delta + self.ttl_offset
        # (a response saved already past its offset is kept with no TTL, as the
        # Redis backend does: requests-cache may still revalidate it)
        self.cache.set(key, self.serialize(value), expire)

    def __delitem__(self, key: str) -> None:
        if not self.cache.delete(key):
            raise KeyError(key)

    def __contains__(self, key: object) -> bool:
        try:
            return key in self.cache
        except TypeError:
            return False

    def __iter__(self) -> Iterator[str]:
        yield from self.keys()

    def __len__(self) -> int:
        return len(self.cache)

    def keys(self) -> list[str]:  # type: ignore[override]
        return list(self.cache)

    def bulk_delete(self, keys: Iterable[str]) -> None:
        """Delete ``keys``, ignoring the missing ones."""
        cache = self.cache
        for k in keys:
            cache.delete(k)

    def clear(self) -> None:
        """Remove every entry of the table, and wait until the store has it too."""
        cache = self.cache
        cache.clear()
        cache.flush()

    def close(self) -> None:
        """Nothing to release: the shared Cache stays open for the process's
        other users and is flushed and closed at exit (or by :func:`close_caches`)."""


class DurableKVBackend(BaseCache):
    """requests-cache's backend on durablekv.

    :param cache_name: the base directory (default ``"http_cache"``).
    :param use_cache_dir, use_temp: as for requests-cache's file backends.
    :param serializer: for responses (default ``"pickle"``).
    :param kwargs: :class:`~durablekv.Cache` arguments, ``ttl``/``ttl_offset``
        (see :class:`DurableKVDict`), and requests-cache's session settings.
    """

    def __init__(self, cache_name: Any = "http_cache", use_cache_dir: bool = False,
                 use_temp: bool = False, serializer: Any = None, **kwargs: Any) -> None:
        super().__init__(cache_name=str(cache_name), **kwargs)
        where = dict(use_cache_dir=use_cache_dir, use_temp=use_temp)
        skwargs = {"serializer": serializer, **kwargs} if serializer else kwargs
        self.responses: DurableKVDict = DurableKVDict(cache_name, "responses", **where,
                                                      **skwargs)
        self.redirects: DurableKVDict = DurableKVDict(cache_name, "redirects", **where,
                                                      **{**kwargs, "serializer": None})

    @property
    def cache_dir(self) -> Path:
        """The base directory (``responses`` and ``redirects`` are in it)."""
        return self.responses.cache_dir
