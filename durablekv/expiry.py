"""TTL expiry: the TTL clock, lazy expiry, ``expire()`` and the write-behind's sweep.

:class:`Expiry` (mixed into :class:`~durablekv.cache.Cache`). The TTL clock
(``_now``) is the injected ``clock`` (default ``time.time``) plus an offset
that keeps TTL time from going backwards; the offset is persisted with each
flush. The sweep runs on the batcher thread (``background_work``, :class:`~durablekv.writeback.CacheFlushSource`) in slices
of ``_SWEEP_SLICE`` stored pages, each under the cache lock.
"""

from __future__ import annotations

import time
from typing import Any, Sequence

from .config import _OPEN, _REAL_MONOTONIC, _expire_args_refused
from .tier.pages import HAS_TTL


#: The expiry sweep takes the cache lock once per this many stored pages
#: (about 30 us each: read, decode, remove the expired entries).
_SWEEP_SLICE = 16


#: Seconds the expiry sweep waits after a store read error.
_SWEEP_RETRY = 60.0


def _expired_keys(keys: Sequence[Any], expires: Sequence[float | None], now: float) -> list:
    """The keys whose expiry (parallel to ``keys``) is at or before ``now``;
    a free slot has none."""
    return [k for k, e in zip(keys, expires) if e is not None and now >= e]


class Expiry:
    """TTL clock and expiry (see the module docstring)."""

    def _now(self) -> float:
        """TTL clock, epoch seconds, never going backwards (lock held).

        When the wall clock steps back, TTL time does not: an offset is added
        to the wall clock from then on, so that no entry outlives its TTL (it
        only ever expires early, never late). The offset and the TTL time
        reached go to the store with the next flush (which a step back asks
        for at once), and an open starts from them (a wall clock still or
        again behind is stepped over the same way)."""
        raw = self._clock() if self._clock is not None else time.time()
        now = raw + self._clock_offset
        if now < self._last_now:
            self._clock_offset += self._last_now - now
            now = self._last_now
            self._ttl_clock = (self._clock_offset, now)
            if self._batcher is not None:
                self._batcher.kick(urgent=True)
        self._last_now = now
        return now

    def _expire(self, key: Any) -> None:
        """Drop an expired entry (no log record: replaying its set re-creates an
        entry that is just as expired)."""
        page = self._tier.table[key][0]
        if page.unloaded:
            self._whole(page)
        self._tier.remove(key, _REAL_MONOTONIC[0](), self._last_lsn + 1)
        self._counts.removed(1, 1)
        self._expirations += 1

    def expire(self, *args: Any, **kwargs: Any) -> int:
        """Remove every entry whose TTL has passed, in memory and in SQLite;
        return how many were removed (int).

        As diskcache's ``Cache.expire()``. It takes no arguments: Redis's
        ``EXPIRE key seconds`` is :meth:`touch`, and ``expire("a", 5)`` is
        a ``TypeError`` that says so. Entries in memory go at once.
        Pages only in SQLite that hold expired entries are found through the
        expiry index and read; their expired entries are removed and the
        write-behind rewrites them. Those pages wait for it outside the LRU
        order (as evicted dirty pages do), so the working set stays resident
        and no page fault is counted. Removing an expired entry writes no
        log record: replaying its set re-creates an entry that is just as
        expired.

        The write-behind does the same on its own, for up to
        ``flush_batch_pages`` pages before each flush it runs, so entries
        that expire unread do not stay on disk. Call this to reclaim them at
        once, or to bound the work to one place (after a bulk expiry).

        Back-pressure applies as for a write: while ``max_pending_pages``
        pages wait for the write-behind, this waits with the lock released.

        :raises CacheClosedError, CacheFailedError: closed or failed cache.
        :raises WriteBehindError: pages are waiting and the write-behind is
            failing.
        :raises CorruptStoreError: a stored page cannot be decoded (the store
            is marked damaged, as a get of one of its keys would).
        :raises TypeError: an argument given (see above).
        """
        if args or kwargs:
            raise _expire_args_refused(args, kwargs)
        with self._lock:
            self._check_open()
            if not self._counts.ttl_keys:
                return 0
            now = self._now()
            tier = self._tier
            removed = self._expire_in_memory(now)
            seen: set[int] = set()  # each page is done at most once
            while self._counts.ttl_keys and not self._store_keys.clear_pending:
                room = self.max_pending_pages - tier.pending
                if room <= 0:
                    self._backpressure()  # the lock is released meanwhile
                    continue
                # Pages in memory are named too: one faulted in during a
                # back-pressure wait still holds its expired entries.
                pids = self._store.expired_pages(now, seen, room)
                if not pids:
                    break
                seen.update(pids)
                for pid in pids:
                    removed += self._expire_page(pid, now)
            return removed

    def _expire_in_memory(self, now: float) -> int:
        """Remove the entries in memory expired at ``now`` (lock held); return
        how many. Only page-table entries marked ``HAS_TTL`` are looked at."""
        removed = 0
        while True:
            doomed = [k for k, (p, s, v) in self._tier.table.items()
                      if v is HAS_TTL and now >= p.expires[s]]
            for k in doomed:
                self._expire(k)
            removed += len(doomed)
            # policy="midpoint": expiring an entry of a page in memory in part
            # reads the rest of the page in, and with it maybe more expired
            # entries (each page is read in once, so this ends)
            if not doomed or not self._tier.per_entry:
                return removed

    def _sweep_expired(self) -> int:
        """Batcher thread, before each cycle: remove the expired entries of
        up to ``flush_batch_pages`` pages named by the expiry index, as
        :meth:`expire` does: a page in memory loses them there; a page only
        in SQLite is read and taken in as pending. Only while fewer than
        half of ``max_pending_pages`` pages wait (it never waits for
        back-pressure: this thread is the one that relieves it). The lock is
        taken once per ``_SWEEP_SLICE`` pages. The cycle that follows stores
        the pages it changed, and with them their index rows go. Returns the
        entries removed.

        :raises StoreError: the expiry scan or a page read failed.
        :raises CorruptStoreError: a stored page cannot be decoded.
        """
        removed = 0
        budget = self.flush_batch_pages
        seen: set[int] = set()  # pages done in this call: their rows go at the flush
        while budget > 0:
            with self._lock:
                tier = self._tier
                if self._state is not _OPEN or not self._counts.ttl_keys or self._store_keys.clear_pending:
                    break
                # (at least one page: max_pending_pages may be 1)
                room = min(budget, _SWEEP_SLICE,
                           max(1, self.max_pending_pages // 2) - tier.pending)
                if room <= 0:
                    break
                now = self._now()
                pids = self._store.expired_pages(now, seen, room)
                seen.update(pids)
                for pid in pids:
                    removed += self._expire_page(pid, now)
            if len(pids) < room:
                break
            budget -= len(pids)
        return removed

    def _expire_page(self, pid: int, now: float) -> int:
        """Remove the entries of page ``pid`` expired at ``now`` (lock held);
        return how many. A page in memory loses them there (its index rows
        go when a flush stores it; until then the expiry index names it
        again, with nothing left to remove). A page only in SQLite is read
        and taken in as pending, not resident, and dirtied: the write-behind
        rewrites it.

        :raises CorruptStoreError: the stored page is missing or damaged.
        """
        page = self._tier.pages.get(pid)
        if page is not None:
            if page.unloaded:  # policy="midpoint": expired entries may be unloaded
                self._whole(page)
            doomed = _expired_keys(page.keys, page.expires, now)
            if not doomed and self._tier.per_entry:
                self._tier.settle(page)
        else:
            row = self._store.read_page(pid)
            slots, keys, values, expires = self._decode_page(pid, row)
            doomed = _expired_keys(keys, expires, now)
            if not doomed:
                # Its index rows say otherwise: a disagreement that `durablekv
                # check` reports; the page stays as it is.
                return 0
            self._tier.install(pid, slots, keys, values, expires, len(row[1]), resident=False,
                               **self._sizes(row))
        for k in doomed:
            self._expire(k)
        return len(doomed)
