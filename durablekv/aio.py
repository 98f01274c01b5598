"""AsyncCache: the :class:`~durablekv.Cache` API for asyncio code.

::

    async with AsyncCache("var/cache", durability="fsync") as cache:
        await cache.set("user:1", {"name": "Ada"}, expire=30)
        await cache.get("user:1")
        async for key in cache: ...

Which thread runs what:

- A memory hit (the key's page is resident and the entry has no TTL)
  returns on the event loop's thread, with no thread hand-off: the same
  lock-free page-table lookup that :meth:`Cache.get` does first.
- A ``get`` or ``set`` that cannot wait also runs on the loop's thread:
  the cache lock is free (tried without blocking), the answer needs no
  SQLite read (the key's page is in memory, or the key filter says the
  store does not hold it), and for ``set`` the durability is ``log`` or
  ``none`` (the record goes to the OS, no fsync), there is no back-pressure
  and no log segment to roll.
- Everything else, all that may wait on disk or on the lock (page faults,
  fsync mode, back-pressure, ``flush``, ``stats``, open and close, iteration), runs on
  the AsyncCache's worker threads (a
  :class:`concurrent.futures.ThreadPoolExecutor`), never on the loop's thread.

Cancellation: a call handed to a worker thread cannot be stopped half-way,
so a cancelled ``await`` lets it run (even one still queued for a worker)
and waits for it to finish before ``CancelledError`` propagates. When the
cancellation reaches the caller the write has been applied in full, with the
durability of the cache's mode; never half, never lost.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import os
import sysconfig
from typing import Any, AsyncIterator, Callable

from .cache import Cache
from .config import NOWAIT_UNSURE, _MISSING, _OPEN
from .errors import CacheNotOpenError
from .tier import HAS_TTL
from .stats import CacheStats

__all__ = ["AsyncCache"]

#: The lock-free memory hit relies on the GIL (as Cache.get's does).
_LOCK_FREE_HITS = not sysconfig.get_config_var("Py_GIL_DISABLED")


def memory_hit(cache: Cache, key: Any) -> Any:
    """The value of ``key`` if it is a memory hit that needs no lock, else
    :data:`MISS_IN_MEMORY`: the first step of :meth:`Cache.get`, which never
    waits (``Cache._memory_hit``, counted as a hit exactly as ``get`` counts
    it). Not on a free-threaded build, where a hit takes the lock."""
    if _LOCK_FREE_HITS:
        return cache._memory_hit(key)
    return _MISSING


MISS_IN_MEMORY = _MISSING


class AsyncCache:
    """An asyncio front to a :class:`~durablekv.Cache`.

    :param directory: the cache directory, as for :class:`Cache` (a leading
        ``~`` is the user's home directory).
    :param options: keyword arguments of :class:`Cache` (``page_size``,
        ``max_pages``, ``durability``, ``flush_interval``, ...).
    :param max_workers: worker threads for calls that may wait on disk
        (default 4).

    Open it with ``async with AsyncCache(...) as cache`` or ``await
    cache.open()``; close with ``await cache.close()``. To drive a Cache you
    opened yourself, use :meth:`wrap` (the Cache then stays yours to close).

    Errors are those of the :class:`Cache` method of the same name; a call
    before the cache is open raises :class:`~durablekv.errors.CacheNotOpenError`.
    """

    def __init__(self, directory: Any = None, *, max_workers: int = 4, **options: Any) -> None:
        # expanded here, not only by Cache at open, so that repr() and the
        # not-open error name the directory that will be opened
        self._directory = (os.path.expanduser(os.fspath(directory))
                           if isinstance(directory, (str, os.PathLike)) else directory)
        self._options = options
        self._cache: Cache | None = None
        self._owned = True
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=max_workers, thread_name_prefix="durablekv-aio")

    @classmethod
    def wrap(cls, cache: Cache, *, max_workers: int = 4) -> "AsyncCache":
        """An AsyncCache over an open ``cache``; :meth:`close` leaves the
        cache open (its owner closes it) and stops the worker threads."""
        self = cls(None, max_workers=max_workers)
        self._cache = cache
        self._owned = False
        return self

    @property
    def cache(self) -> Cache:
        """The underlying :class:`Cache`.

        :raises CacheNotOpenError: not opened yet (a ``RuntimeError``)."""
        if self._cache is None:
            raise CacheNotOpenError(self._directory if isinstance(self._directory, str)
                                    else None)
        return self._cache

    async def _run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn(*args)`` on a worker thread; on cancellation, wait until
        it has finished (it cannot be stopped half-way), then re-raise."""
        fut = asyncio.get_running_loop().run_in_executor(
            self._executor, functools.partial(fn, *args))
        cancelled: asyncio.CancelledError | None = None
        while True:
            try:
                result = await asyncio.shield(fut)
                break
            except asyncio.CancelledError as exc:
                cancelled = exc
                if fut.done():
                    break
        if cancelled is not None:
            if not fut.cancelled():
                fut.exception()  # retrieved: the caller sees the cancellation instead
            raise cancelled
        return result

    # -- lifecycle -----------------------------------------------------------

    async def open(self) -> "AsyncCache":
        """Open the cache (recovery runs on a worker thread).

        :raises: as :class:`Cache` does."""
        if self._cache is None:
            self._cache = await self._run(
                functools.partial(Cache, self._directory, **self._options))
        return self

    async def close(self) -> None:
        """Flush and close the cache (if this AsyncCache opened it), then stop
        the worker threads. Idempotent."""
        try:
            if self._cache is not None and self._owned:
                await self._run(self._cache.close)
        finally:
            self._executor.shutdown(wait=False)

    async def __aenter__(self) -> "AsyncCache":
        return await self.open()

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    # -- reads -----------------------------------------------------------------

    async def get(self, key: Any, default: Any = None) -> Any:
        """:meth:`Cache.get`: the value, or ``default`` when missing or expired.
        A memory hit returns without leaving the loop's thread."""
        cache = self.cache
        v = memory_hit(cache, key)
        if v is not _MISSING:
            return v
        v = cache._get_nowait(key, default)
        if v is not NOWAIT_UNSURE:
            return v
        return await self._run(cache.get, key, default)

    async def contains(self, key: Any) -> bool:
        """``key in cache`` (no hit or miss counted)."""
        cache = self.cache
        if _LOCK_FREE_HITS and cache._state is _OPEN:
            try:
                ref = cache._fast.table.get(key)
            except TypeError:
                ref = None
            if ref is not None and ref[2] is not HAS_TTL:
                return True
        return await self._run(cache.__contains__, key)

    async def length(self) -> int:
        """``len(cache)``."""
        return await self._run(len, self.cache)

    async def keys(self) -> list[Any]:
        """A snapshot of the keys (as ``list(cache)``), taken on a worker thread."""
        return await self._run(list, self.cache)

    def __aiter__(self) -> AsyncIterator[Any]:
        return self._iter_keys()

    async def _iter_keys(self) -> AsyncIterator[Any]:
        for key in await self.keys():
            yield key

    async def stats(self) -> CacheStats:
        """:meth:`Cache.stats`: a :class:`~durablekv.stats.CacheStats` snapshot,
        taken on a worker thread (it takes the cache lock and reads the log's
        and the store's file sizes). Works after the cache closed (the final
        numbers)."""
        return await self._run(self.cache.stats)

    # -- writes ----------------------------------------------------------------

    async def set(self, key: Any, value: Any, expire: float | None = None) -> None:
        """:meth:`Cache.set`; returns with its durability (on the loop's
        thread when it cannot wait, see the module docstring)."""
        cache = self.cache
        if not cache._set_nowait(key, value, expire):
            await self._run(cache.set, key, value, expire)

    async def add(self, key: Any, value: Any, expire: float | None = None) -> bool:
        """:meth:`Cache.add`: store only if absent; True if stored."""
        return await self._run(self.cache.add, key, value, expire)

    async def delete(self, key: Any) -> bool:
        """:meth:`Cache.delete`: True if a live entry was there."""
        return await self._run(self.cache.delete, key)

    async def incr(self, key: Any, delta: int = 1, default: int | None = 0) -> int:
        """:meth:`Cache.incr`: the new value."""
        return await self._run(self.cache.incr, key, delta, default)

    async def touch(self, key: Any, expire: float | None = None) -> bool:
        """:meth:`Cache.touch`: a new TTL for a live entry; True if it was there."""
        return await self._run(self.cache.touch, key, expire)

    async def flush(self, timeout: float | None = None) -> None:
        """:meth:`Cache.flush`: every write acknowledged before it is in SQLite."""
        await self._run(self.cache.flush, timeout)

    async def wait_warm(self, timeout: float | None = None) -> bool:
        """:meth:`Cache.wait_warm`: True once the warm restart's preload has
        ended, False when ``timeout`` seconds passed first."""
        return await self._run(self.cache.wait_warm, timeout)

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn(*args)`` on a worker thread with the cancellation rule above
        (for several cache calls that belong together)."""
        return await self._run(fn, *args)

    def __repr__(self) -> str:
        inner = repr(self._cache) if self._cache is not None else f"{self._directory!r}, unopened"
        return f"<AsyncCache {inner}>"
