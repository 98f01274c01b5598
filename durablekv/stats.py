"""Counters and histograms kept on the hot path as plain Python numbers.

The cache never pays for a prometheus_client metric object on a get or set:
it bumps integers in :class:`Counters` under its own lock, and the exporter
(:mod:`durablekv.metrics`) reads a :class:`CacheStats` snapshot at scrape time.
"""

from __future__ import annotations

import bisect
from typing import Iterator
from dataclasses import dataclass

__all__ = ["CacheStats", "Histogram", "HistogramSnapshot",
           "FLUSH_SECONDS_BUCKETS", "FLUSH_PAGES_BUCKETS"]

#: Upper bounds (seconds) of the flush-duration histogram: 10 µs .. 10 s.
FLUSH_SECONDS_BUCKETS: tuple[float, ...] = (
    1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3,
    1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)
#: Upper bounds (pages) of the pages-per-flush histogram.
FLUSH_PAGES_BUCKETS: tuple[float, ...] = (
    1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192,
)


@dataclass(frozen=True)
class HistogramSnapshot:
    """A point-in-time copy of a :class:`Histogram`.

    :ivar bounds: finite upper bounds, ascending (the ``+Inf`` bucket is implied).
    :ivar cumulative: ``len(bounds) + 1`` cumulative counts; the last is ``count``.
    :ivar sum: sum of all observed values (same unit as the bounds).
    :ivar count: number of observations.
    """

    bounds: tuple[float, ...]
    cumulative: tuple[int, ...]
    sum: float
    count: int


class Histogram:
    """A fixed-bucket histogram of plain numbers (no locking of its own).

    The owner serialises :meth:`observe` (the batcher thread is the only
    writer of the flush histograms); :meth:`snapshot` may run concurrently and
    sees a slightly stale but well-formed copy.
    """

    __slots__ = ("bounds", "_counts", "_sum", "_count")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        if list(bounds) != sorted(bounds) or len(set(bounds)) != len(bounds):
            raise ValueError(f"histogram bounds must be strictly ascending, got {bounds!r}")
        self.bounds = tuple(float(b) for b in bounds)
        self._counts = [0] * (len(self.bounds) + 1)
        self._sum = 0.0
        self._count = 0

    def observe(self, value: float) -> None:
        """Record one observation; a value equal to a bound falls in that bucket (``le``)."""
        self._counts[bisect.bisect_left(self.bounds, value)] += 1
        self._sum += value
        self._count += 1

    def snapshot(self) -> HistogramSnapshot:
        counts = list(self._counts)
        cumulative, running = [], 0
        for c in counts:
            running += c
            cumulative.append(running)
        return HistogramSnapshot(self.bounds, tuple(cumulative), self._sum, running)


@dataclass(frozen=True)
class CacheStats:
    """What a cache has done since it was opened, and its state now.

    Counters count since open; fields marked *now* are gauges.

    :ivar hits: gets that found a live entry (``memory_hits + store_hits``).
    :ivar memory_hits: hits served from a resident page.
    :ivar store_hits: hits that needed a page fault (SQLite, or a page still
        queued for write-behind).
    :ivar misses: gets that found nothing (or only an expired entry).
    :ivar sets: writes of a value acknowledged: ``set`` (with ``expire=0``
        too, although it stores nothing), ``add`` when it stored, ``incr``,
        ``decr``, and ``touch`` when it gave an entry a new TTL (logged as a
        set of the same value).
    :ivar deletes: entries removed by ``delete``, ``pop``, ``popitem`` and
        ``touch(key, 0)``.
    :ivar evictions: pages evicted from the memory tier (entries under
        ``policy="midpoint"``, whose residency is per entry).
    :ivar store_evictions: pages evicted from the store by ``size_limit``.
    :ivar page_faults: pages made resident again (from SQLite or the queue).
    :ivar expirations: entries dropped because their TTL had passed.
    :ivar flushes: write-behind transactions committed.
    :ivar flushed_pages: pages written by those transactions.
    :ivar flush_errors: flush attempts that failed (and were retried).
    :ivar pending_pages: *now*: evicted dirty pages waiting for the batcher.
    :ivar dirty_pages: *now*: pages (resident or pending) not yet in SQLite.
    :ivar resident_pages: *now*: pages in the memory tier (under
        ``policy="midpoint"``: pages holding at least one entry in its budget
        of ``max_pages * page_size`` entries).
    :ivar max_pages: the memory tier's bound in pages.
    :ivar memory_bytes: *now*: bytes of the resident pages' entries (see
        ``Cache(max_memory_bytes=)`` for how they are counted).
    :ivar max_memory_bytes: the memory tier's bound in bytes; None: no bound.
    :ivar store_data_bytes: *now*: bytes of the page blobs in the store, as of
        its last commit (what ``size_limit`` bounds; ``store_bytes`` is the
        file size, which also counts the key index and free file pages).
    :ivar size_limit: the store's bound in bytes; None: no bound.
    :ivar policy: the memory tier's replacement policy (``"lru"``, ``"tinylfu"``,
        ``"midpoint"``).
    :ivar page_size: slots per page.
    :ivar log_bytes: *now*: bytes in the replay log's segments.
    :ivar store_bytes: *now*: bytes of ``pages.sqlite3`` and its WAL.
    :ivar oldest_unflushed_seconds: *now*: age in seconds of the oldest write
        not yet in SQLite (0.0 when everything is flushed).
    :ivar checkpoint_lsn: *now*: every change with an LSN up to this is in SQLite.
    :ivar last_lsn: *now*: LSN of the latest acknowledged change.
    :ivar recovered_records: log records applied again at open.
    :ivar recovery_seconds: time spent on that recovery at open.
    :ivar torn_records: damaged records cut from the log's tail at open.
    :ivar salvaged_bytes: bytes of the replay log that ``salvage_log=True``
        gave up on at open (from the damage to the end of the log, moved aside
        as ``*.damaged``); the writes they held are lost. 0 when nothing was
        salvaged. Bytes, not records: what lies behind damage cannot be
        counted.
    :ivar warmed_pages: pages the warm restart's preload read back into the
        memory tier since open (not counted in ``page_faults``; see
        :mod:`durablekv.warm`).
    :ivar residency_errors: residency lists ignored at open (damaged,
        truncated, foreign) and saves of the list that failed; each is also a
        logged warning. The list is a hint: none of these loses data.
    """

    hits: int = 0
    memory_hits: int = 0
    store_hits: int = 0
    misses: int = 0
    sets: int = 0
    deletes: int = 0
    evictions: int = 0
    store_evictions: int = 0
    page_faults: int = 0
    expirations: int = 0
    flushes: int = 0
    flushed_pages: int = 0
    flush_errors: int = 0
    pending_pages: int = 0
    dirty_pages: int = 0
    resident_pages: int = 0
    max_pages: int = 0
    memory_bytes: int = 0
    max_memory_bytes: int | None = None
    store_data_bytes: int = 0
    size_limit: int | None = None
    policy: str = "lru"
    page_size: int = 0
    log_bytes: int = 0
    store_bytes: int = 0
    oldest_unflushed_seconds: float = 0.0
    checkpoint_lsn: int = 0
    last_lsn: int = 0
    recovered_records: int = 0
    recovery_seconds: float = 0.0
    torn_records: int = 0
    salvaged_bytes: int = 0
    warmed_pages: int = 0
    residency_errors: int = 0

    def __iter__(self) -> Iterator[int]:
        """``hits, misses = cache.stats()``, as diskcache's ``stats()`` returns
        that pair; every other field by name (``stats().page_faults``)."""
        return iter((self.hits, self.misses))

    @property
    def hit_ratio(self) -> float:
        """``hits / (hits + misses)``, or 0.0 before the first get."""
        total = self.hits + self.misses
        return self.hits / total if total else 0.0
