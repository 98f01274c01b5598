"""A Django cache backend on a durablekv :class:`~durablekv.Cache`: Django's
cache that survives a restart and a kill -9.

::

    CACHES = {
        "default": {
            "BACKEND": "durablekv.contrib.django.DurableKVCache",
            "LOCATION": "/var/cache/site",       # a directory, created 0700
            "TIMEOUT": 300,
            "OPTIONS": {"MAX_ENTRIES": 10_000, "CULL_FREQUENCY": 3,
                        "durability": "log", "size_limit": 1 << 30},
        },
    }

Semantics are Django's own (``BaseCache``, and the file-based backend where
Django leaves a choice), so code written against any built-in backend runs
unchanged; docs/django.md lists the few deliberate differences.

- Values are pickled (``pickle.HIGHEST_PROTOCOL``) as Django's backends do,
  except a plain ``int``, kept as an int so that ``incr``/``decr`` are one
  atomic, logged read-modify-write (arbitrary size: Python ints).
- ``OPTIONS``: ``MAX_ENTRIES`` (default 300) and ``CULL_FREQUENCY`` (default 3;
  0 clears all) are Django's: when the location holds ``MAX_ENTRIES`` entries
  or more, a ``set`` or ``add`` first removes one in ``CULL_FREQUENCY`` of
  them. Every other option goes to :class:`~durablekv.Cache` (``page_size``,
  ``max_pages``, ``durability``, ``size_limit``, ``policy``, ...), whose own
  bounds apply too.
- One :class:`~durablekv.Cache` per location per process is shared by every
  alias and every thread's backend instance on it (Django makes one backend
  per alias per thread), so they see each other's writes. ``close()``, which
  Django calls after every request, keeps it open; it is closed, flushed, at
  the process's exit (or by :func:`close_caches`).
- A durablekv directory belongs to one process at a time: a second process
  opening the same LOCATION gets :class:`~durablekv.errors.CacheLockedError`.
  Several worker processes (gunicorn, uWSGI) sharing one cache are not
  supported yet (docs/django.md).
- A location deleted under a live backend (tests do this) is noticed at the
  next operation: the old Cache is dropped quietly and a new, empty one opens.
"""

from __future__ import annotations

import os
import pickle
from typing import Any, Iterable

from django.core.cache.backends.base import DEFAULT_TIMEOUT, BaseCache
from django.core.exceptions import ImproperlyConfigured

from ..cache import Cache
from ..errors import ConfigError
from ._shared import Location, close_all, delete_some, open_shared

__all__ = ["DurableKVCache", "close_caches"]

#: Django's options, read by BaseCache; never passed to the Cache
_DJANGO_OPTIONS = ("MAX_ENTRIES", "CULL_FREQUENCY")
_MISSING = object()


def _mismatch(path: str, have: dict, want: dict) -> Exception:
    return ImproperlyConfigured(
        f"two CACHES entries open {path!r} with different durablekv OPTIONS ({have} and "
        f"{want}); one Cache serves a location, so give them the same OPTIONS "
        "(MAX_ENTRIES and CULL_FREQUENCY may differ) or different LOCATIONs")


_LOCKED_HINT = ("for Django: a durablekv directory belongs to one process at a time, so run "
                "one worker process per LOCATION (a LOCATION shared by several worker "
                "processes is not supported yet; docs/django.md)")


def _location(path: str, options: dict[str, Any]) -> Location:
    try:
        return open_shared(path, options, mismatch=_mismatch, locked_hint=_LOCKED_HINT)
    except (ConfigError, TypeError) as exc:
        raise ImproperlyConfigured(
            f"CACHES OPTIONS for {path!r}: {exc} (OPTIONS other than MAX_ENTRIES and "
            "CULL_FREQUENCY are durablekv Cache arguments, see docs/api.md)") from exc


#: flush and close every location's Cache in this process (also run at exit)
close_caches = close_all


class DurableKVCache(BaseCache):
    """Django's cache API on a durablekv Cache in directory ``LOCATION``.

    :param location: the ``LOCATION`` setting: a directory (str or path).
    :param params: the rest of the ``CACHES`` entry (``TIMEOUT``,
        ``KEY_PREFIX``, ``VERSION``, ``KEY_FUNCTION``, ``OPTIONS``).
    :raises ImproperlyConfigured: no LOCATION, an OPTIONS entry the Cache does
        not take, or a location another alias opened with other OPTIONS.
    :raises CacheLockedError: another process owns the directory.
    """

    #: Django's error for incr/decr of a non-integer value
    incr_decr_type_error = TypeError

    def __init__(self, location: Any, params: dict[str, Any]) -> None:
        super().__init__(params)
        if not location:
            raise ImproperlyConfigured(
                "DurableKVCache needs a LOCATION: the cache directory, e.g. "
                "'LOCATION': '/var/cache/site'")
        self._dir = os.path.abspath(os.fspath(location))
        options = dict(params.get("OPTIONS") or {})
        for name in _DJANGO_OPTIONS:
            options.pop(name, None)
        # No residency list by default: its periodic save is the one file a
        # quiet cache writes on its own, and Django deployments and tests
        # delete cache directories (OPTIONS {"warm": True} turns it on).
        options.setdefault("warm", False)
        self._options = options
        self._loc: Location | None = None

    # -- the shared Cache -------------------------------------------------------

    @property
    def _cache(self) -> Cache:
        loc = self._loc
        if loc is None or not loc.alive():
            loc = self._loc = _location(self._dir, self._options)
        return loc.cache

    def _ttl(self, timeout: Any) -> float | None:
        """Seconds to live, from a Django timeout: None forever, <= 0 expired."""
        if timeout is DEFAULT_TIMEOUT:
            timeout = self.default_timeout
        return None if timeout is None else float(timeout)

    @staticmethod
    def _dump(value: Any) -> Any:
        if type(value) is int:
            return value
        return pickle.dumps(value, pickle.HIGHEST_PROTOCOL)

    @staticmethod
    def _load(stored: Any) -> Any:
        if type(stored) is int:
            return stored
        return pickle.loads(stored)

    def _full(self, cache: Cache) -> bool:
        """Whether the location holds ``MAX_ENTRIES`` live entries or more.

        The Cache's entry count (expired entries not yet removed included)
        answers at no cost while it is below the bound, the usual case; only
        at the bound does ``len()`` count live entries exactly."""
        return cache._counts.keys >= self._max_entries and len(cache) >= self._max_entries

    def _cull(self, cache: Cache) -> None:
        """Django's rule: at ``MAX_ENTRIES`` entries or more, remove one in
        ``CULL_FREQUENCY`` (all of them when it is 0) before a store."""
        if not self._full(cache):
            return
        if self._cull_frequency == 0:
            cache.clear()
            return
        delete_some(cache, len(cache) // self._cull_frequency)

    def _store(self, key: str, value: Any, timeout: Any) -> None:
        data = self._dump(value)
        ttl = self._ttl(timeout)
        cache = self._cache
        if ttl is not None and ttl <= 0:
            cache.delete(key)           # Django: not cached at all
            return
        self._cull(cache)
        cache.set(key, data, ttl)

    # -- BaseCache ------------------------------------------------------------------

    def add(self, key: Any, value: Any, timeout: Any = DEFAULT_TIMEOUT,
            version: int | None = None) -> bool:
        """Store only if ``key`` holds no live value; True if stored."""
        key = self.make_and_validate_key(key, version=version)
        data = self._dump(value)
        ttl = self._ttl(timeout)
        cache = self._cache
        if ttl is not None and ttl <= 0:
            return key not in cache     # "stored" already expired, as Django's backends do
        if key in cache:
            return False
        self._cull(cache)
        return cache.add(key, data, ttl)

    def get(self, key: Any, default: Any = None, version: int | None = None) -> Any:
        key = self.make_and_validate_key(key, version=version)
        stored = self._cache.get(key, _MISSING)
        return default if stored is _MISSING else self._load(stored)

    def set(self, key: Any, value: Any, timeout: Any = DEFAULT_TIMEOUT,
            version: int | None = None) -> None:
        self._store(self.make_and_validate_key(key, version=version), value, timeout)

    def touch(self, key: Any, timeout: Any = DEFAULT_TIMEOUT,
              version: int | None = None) -> bool:
        key = self.make_and_validate_key(key, version=version)
        ttl = self._ttl(timeout)
        return self._cache.touch(key, 0 if ttl is not None and ttl <= 0 else ttl)

    def delete(self, key: Any, version: int | None = None) -> bool:
        return self._cache.delete(self.make_and_validate_key(key, version=version))

    def has_key(self, key: Any, version: int | None = None) -> bool:
        return self.make_and_validate_key(key, version=version) in self._cache

    def get_many(self, keys: Iterable[Any], version: int | None = None) -> dict[Any, Any]:
        cache = self._cache
        found = {}
        for k in keys:
            stored = cache.get(self.make_and_validate_key(k, version=version), _MISSING)
            if stored is not _MISSING:
                found[k] = self._load(stored)
        return found

    def set_many(self, data: dict[Any, Any], timeout: Any = DEFAULT_TIMEOUT,
                 version: int | None = None) -> list[Any]:
        for k, v in data.items():
            self._store(self.make_and_validate_key(k, version=version), v, timeout)
        return []

    def delete_many(self, keys: Iterable[Any], version: int | None = None) -> None:
        cache = self._cache
        for k in keys:
            cache.delete(self.make_and_validate_key(k, version=version))

    def incr(self, key: Any, delta: int = 1, version: int | None = None) -> int:
        """Add ``delta`` to the stored int, atomically; its TTL stays.

        :raises ValueError: ``key`` is missing or expired (Django's rule).
        :raises TypeError: the stored value is not an int.
        """
        key = self.make_and_validate_key(key, version=version)
        try:
            return self._cache.incr(key, delta, default=None)
        except KeyError:
            raise ValueError(f"Key '{key}' not found") from None

    def decr(self, key: Any, delta: int = 1, version: int | None = None) -> int:
        return self.incr(key, -delta, version=version)

    def clear(self) -> None:
        """Remove every entry of the location (every alias on it, as Django's
        file-based backend does)."""
        cache = self._cache
        cache.clear()
        # and stored: the write-behind is idle when this returns, so the
        # directory can be deleted next (Django's tests do) without a flush
        # racing the deletion
        cache.flush()

    def close(self, **kwargs: Any) -> None:
        """Django calls this after each request: nothing to do, the shared
        Cache stays open (it is flushed and closed at exit)."""

    # -- async: a memory hit, or a write that cannot wait, stays on the loop's thread

    async def aget(self, key: Any, default: Any = None, version: int | None = None) -> Any:
        key = self.make_and_validate_key(key, version=version)
        self._cache  # noqa: B018  (opens or reopens the location)
        stored = await self._loc.aio().get(key, _MISSING)
        return default if stored is _MISSING else self._load(stored)

    async def aset(self, key: Any, value: Any, timeout: Any = DEFAULT_TIMEOUT,
                   version: int | None = None) -> None:
        key = self.make_and_validate_key(key, version=version)
        ttl = self._ttl(timeout)
        cache = self._cache
        if (ttl is not None and ttl <= 0) or cache._counts.keys >= self._max_entries:
            from asgiref.sync import sync_to_async
            await sync_to_async(self._store, thread_sensitive=False)(key, value, timeout)
            return
        await self._loc.aio().set(key, self._dump(value), ttl)
