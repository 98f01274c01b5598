"""Calls that never wait: what :class:`~durablekv.aio.AsyncCache` and the server run on the event loop's thread.

:class:`NoWait` (mixed into :class:`~durablekv.cache.Cache`): each answers
only when it can do so without blocking (the cache lock free, nothing that
needs SQLite, no fsync, no back-pressure) and otherwise says so
(:data:`~durablekv.config.NOWAIT_UNSURE`, False) having done nothing; the
caller then runs the ordinary call in a worker thread.
"""

from __future__ import annotations

from typing import Any

from . import codec as _codec
from .config import NOWAIT_UNSURE, _OPEN, _check_expire


class NoWait:
    """Non-blocking get and set for an event loop (see the module docstring)."""

    def _in_memory(self, key: Any) -> bool:
        """Whether ``key``'s entry, or its absence, is known without reading
        SQLite (lock held): its page is in memory, or the store cannot hold
        it (the look-aside miss, a pending clear, the key filter)."""
        try:
            if self._tier.table.get(key) is not None:
                return True
            keys = self._store_keys
            if keys.absent is key or keys.clear_pending:
                return True
            return keys.excluded(_codec.canonical_key(key))
        except TypeError:
            return False  # the waiting path raises the TypeError set() gives

    def _get_nowait(self, key: Any, default: Any) -> Any:
        """:meth:`get` if it can answer without waiting (the lock is free and
        nothing needs SQLite); :data:`NOWAIT_UNSURE` (nothing done) otherwise."""
        if not self._lock.acquire(blocking=False):
            return NOWAIT_UNSURE
        try:
            if self._state is not _OPEN or not self._in_memory(key):
                return NOWAIT_UNSURE
            return self._get_held(key, default)
        finally:
            self._lock.release()

    def _set_nowait(self, key: Any, value: Any, expire: float | None = None) -> bool:
        """:meth:`set` if it can be done without waiting; False (nothing done)
        when it could wait: fsync or sync durability, the lock taken, back-pressure,
        a log segment to roll (an fsync), an entry that needs SQLite.

        :raises TypeError, ValueError: as :meth:`set` (nothing done).
        """
        if self._sync_writes:  # "fsync", or "sync": the record must be committed first
            return False
        if expire is not None:
            expire = _check_expire(expire)
            if expire == 0:
                return False
        kb, vb, held, nbytes = self._encode_entry(key, value)
        if not self._lock.acquire(blocking=False):
            return False
        try:
            log = self._log
            if self._state is not _OPEN or self._tier.pending >= self.max_pending_pages or \
                    (log is not None and log._size >= log.segment_bytes) or \
                    not self._in_memory(key):
                return False
            expire_at = None if expire is None else self._now() + expire
            self._logged_set(key, kb, vb, held, expire_at, self._ref(key), nbytes)
            return True
        finally:
            self._lock.release()
