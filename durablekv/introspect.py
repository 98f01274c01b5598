"""Introspection: ``stats()``, ``histograms()``, ``volume()``, ``evict()``.

:class:`Introspection` (mixed into :class:`~durablekv.cache.Cache`): read-only
views of the counters and sizes, taken under the cache lock.
"""

from __future__ import annotations

from typing import Any

from .config import _FORKED, _MISSING, _REAL_MONOTONIC, _stats_args_refused, _tags_refused
from .stats import CacheStats, HistogramSnapshot


class Introspection:
    """Counters, sizes and histograms."""

    def stats(self, *args: Any, **kwargs: Any) -> CacheStats:
        """A :class:`~durablekv.stats.CacheStats` snapshot (cheap; thread-safe).

        Counters run from when the cache was opened, and are always kept.
        Takes no arguments: diskcache's ``stats(enable=..., reset=...)`` is
        a ``TypeError`` that says so (to count from a point on, subtract
        that point's snapshot). Works after :meth:`close` too (the final
        numbers)."""
        if args or kwargs:
            raise _stats_args_refused(args, kwargs)
        if self._state is _FORKED:
            self._check_open()
        b = self._batcher
        with self._lock:
            tier = self._tier
            dirty = tier.dirty
            oldest = 0.0
            if dirty:
                first = next(iter(dirty.values()))
                if first.dirty_since is not None:
                    oldest = max(0.0, _REAL_MONOTONIC[0]() - first.dirty_since)
            # lock-free hits: the LRU ticks not drawn under the lock
            unlocked = tier.next_tick() - 1 - tier.locked_ticks
            memory_hits = self._memory_hits + unlocked
            s = dict(
                hits=memory_hits + self._store_hits, memory_hits=memory_hits,
                store_hits=self._store_hits, misses=self._misses, sets=self._sets,
                deletes=self._deletes, evictions=tier.evictions, page_faults=tier.page_faults,
                expirations=self._expirations, pending_pages=tier.pending,
                dirty_pages=len(dirty), resident_pages=tier.resident, max_pages=tier.max_pages,
                page_size=tier.page_size, oldest_unflushed_seconds=oldest,
                memory_bytes=tier.memory_bytes, max_memory_bytes=tier.max_bytes,
                size_limit=self.size_limit, policy=self.policy,
                store_evictions=self._store_evictions,
                store_data_bytes=self._store.data_bytes if self._store is not None else 0,
                last_lsn=self._last_lsn)
        return CacheStats(
            flushes=b.flushes, flushed_pages=b.flushed_pages, flush_errors=b.errors,
            log_bytes=self._log.size_bytes() if self._log is not None else 0,
            store_bytes=self._store.size_bytes() if self._store is not None else 0,
            checkpoint_lsn=self._store.checkpoint_lsn if self._store is not None else 0,
            recovered_records=self.recovered_records, recovery_seconds=self.recovery_seconds,
            torn_records=self.torn_records, salvaged_bytes=self.salvaged_bytes,
            warmed_pages=self._warmed_pages, residency_errors=self._residency_errors, **s)

    def histograms(self) -> dict[str, HistogramSnapshot]:
        """``{"flush_seconds": ..., "flush_pages": ...}`` histogram snapshots."""
        if self._state is _FORKED:
            self._check_open()
        return {"flush_seconds": self._batcher.flush_seconds.snapshot(),
                "flush_pages": self._batcher.flush_pages.snapshot()}

    def evict(self, tag: Any) -> int:
        """Not supported: durablekv entries carry no tag (diskcache's
        ``evict(tag)``). Always raises.

        :raises TypeError: always, saying what to do instead.
        """
        raise _tags_refused(f"evict({tag!r:.40})")

    def volume(self) -> int:
        """Bytes the cache takes on disk now: ``pages.sqlite3``, its WAL, and
        the replay log's segments (diskcache's ``volume()``). Thread-safe.

        :raises CacheClosedError: the cache is closed.
        """
        with self._lock:
            self._check_open()
            store, log_ = self._store, self._log
        return store.size_bytes() + (log_.size_bytes() if log_ is not None else 0)

    def _peek(self, key: Any) -> Any:
        with self._lock:
            self._check_open()
            ref = self._ref(key)
            if ref is None:
                return _MISSING
            page, slot, _ = ref
            return self._codec.from_memory(page.values[slot])
