"""An aiocache backend on a durablekv :class:`~durablekv.Cache`: the persistent,
embedded cache aiocache lacks (its backends are memory, Redis and Memcached).

::

    from aiocache import Cache, cached
    from durablekv.contrib.aiocache import DurableKVCache

    cache = Cache(DurableKVCache, directory="var/cache", namespace="api")
    await cache.set("user:1", {"name": "Ada"}, ttl=60)

    @cached(cache=DurableKVCache, directory="var/cache", ttl=60)
    async def fetch(user_id): ...

Semantics are aiocache's ``BaseCache`` (and its Redis backend's where the
memory backend has none, as for ``increment`` on a serialized value):

- The default serializer is aiocache's ``JsonSerializer`` (as for Redis and
  Memcached); pass ``serializer=PickleSerializer()`` for arbitrary objects.
  A serialized value that is an integer's decimal text (what ``JsonSerializer``
  and ``StringSerializer`` make of an int) is stored as the int, and handed
  back re-serialized, so ``increment`` is one atomic, logged read-modify-write
  that keeps the entry's TTL (Redis's ``INCRBY``); ``increment`` of anything
  else raises ``TypeError``.
- ``ttl``: None (the instance's ``ttl``) or 0 never expires; floats are fine;
  a negative one stores nothing. ``expire(key, 0)`` removes the TTL.
- ``add`` of a live key raises ``ValueError``; ``delete`` returns 1 or 0;
  ``clear(namespace)`` deletes the keys that start with it, ``clear()`` all.
- Threads: a memory hit, and a get or set that cannot wait, returns on the
  event loop's thread; anything that may wait on disk (a page fault, an
  fsync, a busy lock) runs on worker threads
  (:class:`durablekv.aio.AsyncCache`), never on the loop's.
- Every instance on one directory in this process shares one open Cache
  (:mod:`durablekv.contrib._shared`), opened at the first operation, not when
  a decorator is applied; another process gets
  :class:`~durablekv.errors.CacheLockedError`.
"""

from __future__ import annotations

import asyncio
import re
from typing import Any

from aiocache.base import BaseCache
from aiocache.serializers import JsonSerializer

from ..errors import ConfigError
from ._shared import Location, check_options, close_all, open_shared

__all__ = ["DurableKVCache", "close_caches"]

_MISSING = object()
#: an int's canonical decimal text (what json.dumps and str make of one),
#: short enough for int() (Python limits int/str conversion to 4300 digits)
_INT_TEXT = re.compile(r"-?(?:0|[1-9][0-9]{0,4000})")

#: flush and close every directory's Cache in this process (also run at exit)
close_caches = close_all

_BASE_ARGS = ("plugins", "key_builder", "timeout", "ttl")


def _mismatch(path: str, have: dict, want: dict) -> Exception:
    return ConfigError(f"cache directory {path!r} is open in this process with durablekv "
                       f"options {have}, and another aiocache cache asks for {want}; one Cache "
                       "serves a directory, so pass the same options, or use another directory")


class DurableKVCache(BaseCache):
    """aiocache's cache API on a durablekv Cache in ``directory``.

    :param directory: the cache directory (created 0700 with its parents).
    :param serializer: an aiocache serializer (default ``JsonSerializer``).
    :param namespace, plugins, key_builder, timeout, ttl: as for aiocache's caches.
    :param options: :class:`~durablekv.Cache` arguments (``page_size``,
        ``max_pages``, ``durability``, ``size_limit``, ...); ``warm``
        defaults to False here (the residency list is the one file an idle
        cache writes).
    :raises TypeError: an argument neither aiocache nor the Cache takes.
    :raises ConfigError: no ``directory``.
    """

    NAME = "durablekv"

    def __init__(self, directory: Any = None, serializer: Any = None,
                 namespace: str | None = None, **kwargs: Any) -> None:
        base = {k: kwargs.pop(k) for k in _BASE_ARGS if k in kwargs}
        super().__init__(serializer=serializer or JsonSerializer(), namespace=namespace, **base)
        if directory is None:
            raise ConfigError("DurableKVCache needs directory=, the cache directory: "
                              "Cache(DurableKVCache, directory='var/cache')")
        check_options("DurableKVCache", kwargs, ("directory", "serializer", "namespace")
                      + _BASE_ARGS)
        kwargs.setdefault("warm", False)
        self.directory = directory
        self._options = kwargs
        self._loc: Location | None = None
        self._opening: Any = None      # the open in flight (a future), if any

    @classmethod
    def parse_uri_path(cls, path: str) -> dict[str, Any]:
        """``durablekv:///var/cache`` names the directory (aiocache's ``from_url``)."""
        return {"directory": path} if path else {}

    async def _location(self) -> Location:
        """The shared Location, opened on a worker thread at the first use.
        Calls that arrive while it opens wait for that one open (single
        flight), so concurrent first calls all proceed together when it is
        ready, as they would on a backend that was open already."""
        loc = self._loc
        if loc is not None and loc.alive():
            return loc
        loop = asyncio.get_running_loop()
        opening = self._opening
        if opening is None or opening.done() or opening.get_loop() is not loop:
            opening = self._opening = loop.run_in_executor(
                None, lambda: open_shared(self.directory, self._options, mismatch=_mismatch,
                                          locked_hint="a durablekv directory belongs to one "
                                          "process at a time: give each process its own "
                                          "directory"))
        loc = self._loc = await asyncio.shield(opening)
        return loc

    # -- stored form ----------------------------------------------------------------

    @staticmethod
    def _in(data: Any) -> Any:
        """What is stored for serialized ``data``: an int for an int's text."""
        if type(data) is str and _INT_TEXT.fullmatch(data):
            return int(data)
        return data

    def _out(self, stored: Any) -> Any:
        """The serialized form of a stored value (an int re-serialized)."""
        if type(stored) is int:
            return self.serializer.dumps(stored)
        return stored

    @staticmethod
    def _expire_for(ttl: Any) -> float | None:
        """durablekv's ``expire`` for an aiocache ttl: None (or 0) never; negative: -1."""
        if not ttl:
            return None
        ttl = float(ttl)
        return ttl if ttl > 0 else -1.0

    # -- aiocache's backend methods ---------------------------------------------

    async def _get(self, key: Any, encoding: str | None = "utf-8", _conn: Any = None) -> Any:
        loc = await self._location()
        stored = await loc.aio().get(key, _MISSING)
        return None if stored is _MISSING else self._out(stored)

    async def _gets(self, key: Any, encoding: str | None = "utf-8", _conn: Any = None) -> Any:
        return await self._get(key, encoding=encoding, _conn=_conn)

    async def _multi_get(self, keys: list, encoding: str | None = "utf-8",
                         _conn: Any = None) -> list:
        return [await self._get(k, encoding=encoding) for k in keys]

    async def _set(self, key: Any, value: Any, ttl: Any = None, _cas_token: Any = None,
                   _conn: Any = None) -> Any:
        loc = await self._location()
        expire, data = self._expire_for(ttl), self._in(value)
        if _cas_token is not None:
            def cas() -> int:
                with loc.lock:
                    if self._out(loc.cache.get(key, None)) != _cas_token:
                        return 0
                    self._store(loc, key, data, expire)
                    return 1
            return await loc.aio()._run(cas) == 1
        if expire is not None and expire < 0:
            await loc.aio().delete(key)         # stored already expired
            return True
        await loc.aio().set(key, data, expire)
        return True

    @staticmethod
    def _store(loc: Location, key: Any, data: Any, expire: float | None) -> None:
        if expire is not None and expire < 0:
            loc.cache.delete(key)
        else:
            loc.cache.set(key, data, expire)

    async def _multi_set(self, pairs: Any, ttl: Any = None, _conn: Any = None) -> bool:
        for key, value in pairs:
            await self._set(key, value, ttl=ttl)
        return True

    async def _add(self, key: Any, value: Any, ttl: Any = None, _conn: Any = None) -> bool:
        loc = await self._location()
        expire, data = self._expire_for(ttl), self._in(value)
        if expire is not None and expire < 0:
            stored = not await loc.aio().contains(key)
        else:
            stored = await loc.aio().add(key, data, expire)
        if not stored:
            raise ValueError(f"Key {key} already exists, use .set to update the value")
        return True

    async def _exists(self, key: Any, _conn: Any = None) -> bool:
        loc = await self._location()
        return await loc.aio().contains(key)

    async def _increment(self, key: Any, delta: int, _conn: Any = None) -> int:
        """Atomic add to a stored int (a missing key starts at 0); its TTL stays.

        :raises TypeError: the stored value is not an int (nor an int's text).
        """
        loc = await self._location()
        try:
            return await loc.aio().incr(key, delta)
        except TypeError:
            raise TypeError("Value is not an integer") from None

    async def _expire(self, key: Any, ttl: Any, _conn: Any = None) -> bool:
        loc = await self._location()
        expire = self._expire_arg(ttl)
        return await loc.aio().touch(key, expire)

    @staticmethod
    def _expire_arg(ttl: Any) -> float | None:
        if not ttl:
            return None                 # 0: no expiry (aiocache's rule)
        ttl = float(ttl)
        return ttl if ttl > 0 else 0.0  # negative: gone now (touch with 0 removes)

    async def _delete(self, key: Any, _conn: Any = None) -> int:
        loc = await self._location()
        return 1 if await loc.aio().delete(key) else 0

    async def _clear(self, namespace: str | None = None, _conn: Any = None) -> bool:
        loc = await self._location()

        def clear() -> None:
            cache = loc.cache
            if namespace:
                for k in [k for k in cache if isinstance(k, str) and k.startswith(namespace)]:
                    cache.delete(k)
            else:
                cache.clear()
            cache.flush()
        await loc.aio()._run(clear)
        return True

    async def _raw(self, command: str, *args: Any, encoding: str | None = "utf-8",
                   _conn: Any = None, **kwargs: Any) -> Any:
        """``getattr(cache, command)(*args, **kwargs)`` on the durablekv Cache,
        on a worker thread."""
        loc = await self._location()
        return await loc.aio()._run(lambda: getattr(loc.cache, command)(*args, **kwargs))

    async def _redlock_release(self, key: Any, value: Any) -> int:
        loc = await self._location()

        def release() -> int:
            with loc.lock:
                if self._out(loc.cache.get(key, None)) == value:
                    return 1 if loc.cache.delete(key) else 0
                return 0
        return await loc.aio()._run(release)

    async def _close(self, *args: Any, _conn: Any = None, **kwargs: Any) -> None:
        """Nothing to release: the shared Cache stays open for the process's
        other users and is flushed and closed at exit (or by :func:`close_caches`)."""
