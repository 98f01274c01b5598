"""A cachelib backend on a durablekv :class:`~durablekv.Cache`: cachelib's
``FileSystemCache`` API, crash-safe and without its O(n) culling.

::

    from durablekv.contrib.cachelib import DurableKVCache

    cache = DurableKVCache("var/cache", threshold=10_000, default_timeout=300)
    cache.set("user:1", {"name": "Ada"}, timeout=60)
    cache.get("user:1")

For Flask, use :mod:`durablekv.contrib.flask_caching` (Flask-Caching's
``CACHE_TYPE``). Semantics are cachelib's (``cachelib.BaseCache``, and its
``FileSystemCache`` where cachelib leaves a choice); docs/flask.md lists the
few differences.

- Timeouts: None means ``default_timeout`` (300 s); ``0`` never expires; a
  negative timeout stores an entry that is already expired (so nothing);
  a :class:`datetime.timedelta` is whole seconds, rounded up, as cachelib does.
- Values go through ``serializer`` (cachelib's pickle serializer unless set,
  per instance or per class, as in cachelib), except a plain ``int``, kept
  as an int so that ``inc``/``dec`` are one atomic, logged read-modify-write.
- ``threshold`` (default 500; 0: none): when the cache holds more entries
  than that, a ``set`` or ``add`` first drops expired entries, then enough
  others to come back to it (``FileSystemCache``'s rule); durablekv's own
  bounds (``max_pages``, ``size_limit``) apply too.
- Every instance on one directory in this process shares one open Cache
  (:mod:`durablekv.contrib._shared`); another process gets
  :class:`~durablekv.errors.CacheLockedError`.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from cachelib import BaseCache
from cachelib.serializers import SimpleSerializer

from ..cache import Cache
from ..errors import ConfigError
from ._shared import Location, close_all, delete_some, open_shared

__all__ = ["DurableKVCache", "close_caches"]

_MISSING = object()

#: flush and close every directory's Cache in this process (also run at exit)
close_caches = close_all


def _mismatch(path: str, have: dict, want: dict) -> Exception:
    return ConfigError(f"cache directory {path!r} is open in this process with durablekv "
                       f"options {have}, and another cache asks for {want}; one Cache serves "
                       "a directory, so pass the same options, or use another directory")


LOCKED_HINT = ("a durablekv directory belongs to one process at a time: give each process "
               "its own cache directory")


class DurableKVCache(BaseCache):
    """cachelib's cache API on a durablekv Cache in ``cache_dir``.

    :param cache_dir: the cache directory (created 0700 with its parents).
    :param threshold: entries kept before a store culls (int >= 0; 0: no bound).
    :param default_timeout: seconds (or a timedelta) for ``timeout=None``; 0: never expires.
    :param ignore_delete_many_errors: as in cachelib.
    :param options: :class:`~durablekv.Cache` arguments (``page_size``,
        ``max_pages``, ``durability``, ``size_limit``, ...); ``warm`` defaults
        to False here (the residency list is the one file an idle cache writes).
    :raises ConfigError: a bad option, or a directory this process has open
        with other options.
    :raises CacheLockedError: another process owns the directory.
    """

    serializer: Any = SimpleSerializer()

    def __init__(self, cache_dir: Any, threshold: int = 500,
                 default_timeout: int | dt.timedelta = 300,
                 ignore_delete_many_errors: bool = True, **options: Any) -> None:
        super().__init__(default_timeout, ignore_delete_many_errors=ignore_delete_many_errors)
        if isinstance(threshold, bool) or not isinstance(threshold, int) or threshold < 0:
            raise ConfigError(f"threshold must be an int >= 0 (0: no bound), not {threshold!r}")
        self._threshold = threshold
        self._dir = cache_dir
        options.setdefault("warm", False)
        self._options = options
        self._loc: Location | None = self._open()

    def _open(self) -> Location:
        return open_shared(self._dir, self._options, mismatch=_mismatch,
                           locked_hint=LOCKED_HINT)

    @property
    def _cache(self) -> Cache:
        loc = self._loc
        if loc is None or not loc.alive():
            loc = self._loc = self._open()
        return loc.cache

    # -- values and timeouts ----------------------------------------------------

    def _dump(self, value: Any) -> Any:
        if type(value) is int:
            return value
        return self.serializer.dumps(value)

    def _load(self, stored: Any) -> Any:
        if type(stored) is int:
            return stored
        return self.serializer.loads(stored)

    def _ttl(self, timeout: Any) -> float | None:
        """Seconds to live from a cachelib timeout: None for cachelib's 0
        (never expires), -1.0 for a negative one (already expired)."""
        seconds = self._normalize_timeout(timeout)
        if seconds == 0:
            return None
        return float(seconds) if seconds > 0 else -1.0

    def _prune(self, cache: Cache) -> None:
        if not self._threshold or cache._counts.keys <= self._threshold:
            return
        delete_some(cache, len(cache) - self._threshold)   # len() drops expired ones first

    # -- cachelib's BaseCache -----------------------------------------------------

    def get(self, key: str) -> Any:
        stored = self._cache.get(key, _MISSING)
        return None if stored is _MISSING else self._load(stored)

    def set(self, key: str, value: Any, timeout: Any = None) -> bool:
        data = self._dump(value)
        ttl = self._ttl(timeout)
        cache = self._cache
        if ttl is not None and ttl < 0:
            cache.delete(key)       # stored already expired
            return True
        self._prune(cache)
        cache.set(key, data, ttl)
        return True

    def add(self, key: str, value: Any, timeout: Any = None) -> bool:
        data = self._dump(value)
        ttl = self._ttl(timeout)
        cache = self._cache
        if key in cache:
            return False
        if ttl is not None and ttl < 0:
            return True
        self._prune(cache)
        return cache.add(key, data, ttl)

    def delete(self, key: str) -> bool:
        return self._cache.delete(key)

    def has(self, key: str) -> bool:
        return key in self._cache

    def clear(self) -> bool:
        """Remove every entry of the directory (every instance on it), and
        wait until the store has it too."""
        cache = self._cache
        cache.clear()
        cache.flush()
        return True

    def inc(self, key: str, delta: int = 1) -> int:
        """Add ``delta`` to the stored int, atomically (a missing key starts at 0,
        with no timeout; a stored one keeps its timeout).

        :raises TypeError: the stored value is not an int.
        """
        return self._cache.incr(key, delta, default=0)

    def dec(self, key: str, delta: int = 1) -> int:
        return self.inc(key, -delta)
