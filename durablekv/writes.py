"""The write path behind ``set``/``delete``/``clear``: encode, log, apply, back-pressure.

:class:`WritePath` (mixed into :class:`~durablekv.cache.Cache`). ``set`` itself
stays in ``cache.py`` with its inline fast path; it calls these helpers
exactly as before. Order for every write: assign the LSN and append to the
replay log (``_append``), then apply to the memory tier (``_apply_*``), all
under the cache lock; ``durability="fsync"`` then waits for ``_sync``
outside it.
"""

from __future__ import annotations

from typing import Any

from . import codec as _codec
from .config import (MAX_KEY_BYTES, MAX_VALUE_BYTES_LIMIT, _FAILED, _OPEN,
                     _REAL_MONOTONIC, _U32_PACK, _key_too_long)
from .errors import LogWriteError, WriteBehindError
from .log.segments import OP_DELETE, OP_SET


class WritePath:
    """Encode, log and apply writes (lock held unless said otherwise)."""

    def _backpressure(self) -> None:
        """Block (lock released) while too many evicted dirty pages wait."""
        tier = self._tier
        if tier.pending < self.max_pending_pages:
            return
        batcher = self._batcher
        errors = batcher.errors
        batcher.kick(retry=True)  # one attempt at once, even during a back-off
        while tier.pending >= self.max_pending_pages:
            if batcher.errors > errors and batcher.failing:
                raise WriteBehindError(self.path, batcher.last_error,
                                       f"{tier.pending} dirty pages are waiting and the "
                                       f"write-behind flush to {self.path!r} is failing "
                                       f"({batcher.last_error!r}); the write was NOT stored. "
                                       "Fix the store (disk space, locks) and retry")
            if self._state is not _OPEN:
                self._check_open()
            batcher.kick(urgent=True)
            self._cond.wait(0.5)
        if self._state is not _OPEN:
            # closed (or failed) while this waited with the lock released
            self._check_open()

    def _apply_set(self, key: Any, held: Any, expire_at: float | None,
                   ref: tuple | list | None, lsn: int, nbytes: int) -> None:
        """Apply a logged set (lock held). ``nbytes``: encoded key + value size."""
        tier = self._tier
        now = _REAL_MONOTONIC[0]()
        if ref is not None:
            page, slot, _ = ref
            if page.unloaded:
                self._whole(page)
            old = page.expires[slot]
            if tier.fits(page, nbytes):
                tier.update(page, slot, held, expire_at, now, lsn, nbytes)
                self._counts.expiry_changed(old is not None, expire_at is not None)
                tier.hit(page, slot)
            else:
                # The page would outgrow PAGE_BYTES_LIMIT: move the entry to
                # another page, keeping the key object first stored.
                key = page.keys[slot]
                tier.remove(key, now, lsn)
                tier.insert(key, held, expire_at, now, lsn, nbytes)
                self._counts.expiry_changed(old is not None, expire_at is not None)
        else:
            tier.insert(key, held, expire_at, now, lsn, nbytes)
            self._store_keys.key_added()  # (the filter gets it when a flush stores it)
            self._counts.added(1, expire_at is not None)
        if tier.pending * 2 >= self.max_pending_pages:
            self._batcher.kick(urgent=True)
        elif len(tier.dirty) == self.flush_batch_pages:
            self._batcher.kick()

    def _apply_delete(self, key: Any, lsn: int) -> None:
        page, slot, _ = self._tier.table[key]
        if page.unloaded:
            self._whole(page)
        had_ttl = page.expires[slot] is not None
        self._tier.remove(key, _REAL_MONOTONIC[0](), lsn)
        self._counts.removed(1, had_ttl)
        if self._tier.pending * 2 >= self.max_pending_pages:
            self._batcher.kick(urgent=True)

    def _apply_clear(self, lsn: int) -> None:
        self._tier.clear()
        self._store_keys.cleared(lsn)  # the store is about to be emptied
        self._counts.cleared()

    def _append(self, op: int, kb: bytes, vb: bytes, expire_at: float | None) -> int:
        """Assign the next LSN and log the record (lock held); return the LSN."""
        lsn = self._last_lsn + 1
        if self._log is not None:
            self._log.append(lsn, op, kb, vb, expire_at)
        self._last_lsn = lsn
        return lsn

    def _sync(self, lsn: int) -> None:
        """fsync mode: return once the record is on disk (no lock held)."""
        try:
            self._log.sync_to(lsn)
        except LogWriteError as exc:
            # After a failed fsync the kernel may have dropped the dirty pages:
            # what is on disk is unknown, so stop accepting writes (fail-stop).
            with self._lock:
                self._failure = exc
                self._state = _FAILED
            raise

    def _logged_set(self, key: Any, kb: bytes, vb: bytes, held: Any, expire_at: float | None,
                    ref: tuple | list | None, nbytes: int) -> int:
        """Log a set and apply it (lock held); return its LSN. ``ref``: the
        key's live page-table entry or None (see :meth:`_apply_set`)."""
        lsn = self._append(OP_SET, kb, vb, expire_at)
        try:
            self._apply_set(key, held, expire_at, ref, lsn, nbytes)
        except BaseException as exc:
            self._failed_after_log(lsn, exc)
            raise
        self._sets += 1
        return lsn

    def _logged_delete(self, key: Any, kb: bytes, count: bool = True) -> int:
        """Log a delete of the live ``key`` and apply it (lock held); return
        its LSN. ``count``: a delete in stats (not a set with ``expire=0``)."""
        lsn = self._append(OP_DELETE, kb, b"", None)
        try:
            self._apply_delete(key, lsn)
        except BaseException as exc:
            self._failed_after_log(lsn, exc)
            raise
        self._deletes += count
        return lsn

    def _failed_after_log(self, lsn: int, exc: BaseException) -> None:
        """A write whose record ``lsn`` is in the log failed before memory took
        it all (lock held): a MemoryError, or an exception from a signal
        handler. Memory and the log now disagree about that key, and a
        reopen applies the record: fail-stop (every later call raises
        CacheFailedError, close() keeps the log), as PostgreSQL PANICs on an
        error inside a WAL critical section. The LSN is never logged again."""
        self._last_lsn = max(self._last_lsn, lsn)
        if self._state is _OPEN:
            self._failure = exc
            self._state = _FAILED

    def _value_too_big(self, key: Any, size: int) -> ValueError:
        fix = ("store it elsewhere (max_value_bytes is at its largest, "
               f"MAX_VALUE_BYTES_LIMIT={MAX_VALUE_BYTES_LIMIT}: one entry must fit in a page)"
               if self.max_value_bytes >= MAX_VALUE_BYTES_LIMIT else
               f"store it elsewhere or raise max_value_bytes (up to {MAX_VALUE_BYTES_LIMIT})")
        return ValueError(f"value for key {key!r} is {size} bytes, over max_value_bytes="
                          f"{self.max_value_bytes}; {fix}")

    def _encode_entry(self, key: Any, value: Any) -> tuple[bytes, bytes, Any, int]:
        """``(key bytes, value bytes, memory form, encoded size)`` of an entry,
        with the key and value checks every write makes (set inlines these
        steps for a str key and a bytes value).

        :raises TypeError: unsupported key or value type.
        :raises ValueError: key or value over its size limit.
        """
        if type(key) is str:
            kb = key.encode("utf-8", "surrogatepass")
            kb = b"s" + _U32_PACK(len(kb)) + kb
        else:
            kb = _codec.encode_key(key)
        if len(kb) > MAX_KEY_BYTES:
            raise _key_too_long(kb)
        codec = self._codec
        vb = codec.encode(value)
        size = codec.value_bytes(value, vb)
        if size > self.max_value_bytes:
            raise self._value_too_big(key, size)
        return kb, vb, codec.memory_form(value, vb), len(kb) + len(vb)

    def _open_for_writes(self) -> None:
        """The checks every write makes first (lock held): open, and room
        for one more dirty page (back-pressure)."""
        if self._state is not _OPEN:
            self._check_open()
        if self._tier.pending >= self.max_pending_pages:
            self._backpressure()
