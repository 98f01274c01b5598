"""Read-modify-write operations: add, incr/decr, touch, pop, setdefault, update, popitem.

:class:`AtomicOps` (mixed into :class:`~durablekv.cache.Cache`): each is one
hold of the cache lock around the core's ``_ref`` (find a live entry,
faulting its page in), ``_logged_set``/``_append`` (log then apply), so no
other writer interleaves between the read and the write.
"""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Any

from . import codec as _codec
from .config import _MISSING, _check_counter_args, _check_expire, _tags_refused


class AtomicOps:
    """Read-modify-write operations, each under one hold of the cache lock."""

    def add(self, key: Any, value: Any, expire: float | None = None, *,
            tag: Any = None) -> bool:
        """Store ``value`` under ``key`` only if no live entry is there (an
        expired one does not count); return True if it was stored.

        Atomic: of many threads adding the same key, one wins (Redis's
        ``SET ... NX``, diskcache's ``Cache.add``). ``expire`` is as for
        :meth:`set`, except that it cannot be 0: the entry would be expired
        as it is stored, and True would claim a key that is not there.

        :raises TypeError, ValueError: as for :meth:`set`; ValueError for
            ``expire=0``.
        :raises LogWriteError, CacheClosedError, CacheFailedError: as for :meth:`set`.
        :raises TypeError: ``tag`` given (see :meth:`evict`).
        """
        if tag is not None:
            raise _tags_refused("add(..., tag=...)")
        if expire is not None:
            expire = _check_expire(expire)
            if expire == 0:
                raise ValueError("add() with expire=0 would store an entry that is already "
                                 "expired; pass a positive expire, or None for no expiry")
        kb, vb, held, nbytes = self._encode_entry(key, value)
        with self._lock:
            self._open_for_writes()
            if self._ref(key) is not None:
                return False
            expire_at = None if expire is None else self._now() + expire
            lsn = self._logged_set(key, kb, vb, held, expire_at, None, nbytes)
        if self._sync_writes:
            self._sync(lsn)
        return True

    def incr(self, key: Any, delta: int = 1, default: int | None = 0) -> int:
        """Add ``delta`` to the int stored under ``key``; return the new value.

        Atomic: concurrent increments are never lost (Redis's ``INCRBY``,
        diskcache's ``Cache.incr``). A missing or expired key counts from
        ``default`` and is stored with no TTL; a live entry keeps its TTL.
        The new value is logged like any set, so it survives a crash under
        the cache's durability.

        :param delta: int to add (negative to subtract; see :meth:`decr`).
        :param default: int a missing key starts from; None makes a missing
            key a KeyError.
        :raises KeyError: ``key`` is missing and ``default`` is None.
        :raises TypeError: the stored value, ``delta`` or ``default`` is not
            an int (a bool does not count as one).
        :raises LogWriteError, CacheClosedError, CacheFailedError: as for :meth:`set`.
        """
        _check_counter_args("incr", delta, default)
        # refused before the lookup, as every write does (a lookup would
        # find an entry through an equal key of an unsupported type)
        _codec.check_key(key)
        with self._lock:
            self._open_for_writes()
            ref = self._ref(key)
            if ref is None:
                if default is None:
                    raise KeyError(key)
                value, expire_at = default + delta, None
            else:
                page, slot, _ = ref
                old = self._codec.from_memory(page.values[slot])
                if type(old) is not int:
                    raise TypeError(f"cannot incr() key {key!r}: its value is a "
                                    f"{type(old).__qualname__}, not an int; set() it to an "
                                    "int first, or count under another key")
                value, expire_at = old + delta, page.expires[slot]
            # encoded under the lock: the new value depends on the old one
            kb, vb, held, nbytes = self._encode_entry(key, value)
            lsn = self._logged_set(key, kb, vb, held, expire_at, ref, nbytes)
        if self._sync_writes:
            self._sync(lsn)
        return value

    def decr(self, key: Any, delta: int = 1, default: int | None = 0) -> int:
        """``incr(key, -delta, default)``: subtract ``delta``; return the new value.

        :raises KeyError, TypeError: as for :meth:`incr`.
        """
        _check_counter_args("decr", delta, default)
        return self.incr(key, -delta, default)

    def touch(self, key: Any, expire: float | None = None) -> bool:
        """Give a live entry a new TTL: ``expire`` seconds from now, or None
        for none; return True if ``key`` was there (Redis's ``EXPIRE`` and
        ``PERSIST``, diskcache's ``Cache.touch``). The value is unchanged;
        ``expire=0`` removes the entry (as :meth:`set` with ``expire=0`` does).

        :raises TypeError: unsupported key type.
        :raises ValueError: ``expire`` negative, NaN or infinite.
        :raises LogWriteError, CacheClosedError, CacheFailedError: as for :meth:`set`.
        """
        if expire is not None:
            expire = _check_expire(expire)
        # A write checks its key as set and delete do (a lookup would find an
        # entry through an equal key of an unsupported type, e.g. an IntEnum).
        _codec.encode_key(key)
        with self._lock:
            self._open_for_writes()
            ref = self._ref(key)
            if ref is None:
                return False
            page, slot, _ = ref
            # logged as a set of the same value, under the key object the
            # entry keeps (a set of an equal key keeps it too)
            kb = _codec.encode_key(page.keys[slot])
            if expire == 0:
                lsn = self._logged_delete(key, kb)
            else:
                held = page.values[slot]
                vb = self._codec.to_blob(held)
                expire_at = None if expire is None else self._now() + expire
                lsn = self._logged_set(key, kb, vb, held, expire_at, ref, len(kb) + len(vb))
        if self._sync_writes:
            self._sync(lsn)
        return True

    def pop(self, key: Any, default: Any = _MISSING) -> Any:
        """Remove ``key`` and return its value; ``default`` (or KeyError) when missing."""
        kb = _codec.encode_key(key)
        with self._lock:
            self._open_for_writes()
            if self._tier.pending >= self.max_pending_pages:
                self._backpressure()  # (a page only in the store comes in pending)
            ref = self._ref(key, for_delete=True)
            if ref is None:
                if default is _MISSING:
                    raise KeyError(key)
                return default
            page, slot, _ = ref
            value = self._codec.from_memory(page.values[slot])
            lsn = self._logged_delete(key, kb)
        if self._sync_writes:
            self._sync(lsn)
        return value

    def setdefault(self, key: Any, default: Any = None) -> Any:
        """Return the value of a live ``key``; if there is none, store
        ``default`` under it (no TTL) and return ``default``.

        Atomic, one step under the cache lock as :meth:`add` is: of many
        threads calling ``setdefault`` on the same missing key, exactly one
        stores its default and every caller gets that one stored value (the
        inherited ``MutableMapping.setdefault`` looked up, then stored, and
        two callers could each be told their default was stored).

        :raises TypeError, ValueError: as for :meth:`set` (``default`` is
            checked even when the key is present).
        :raises LogWriteError, CacheClosedError, CacheFailedError: as for :meth:`set`.
        """
        kb, vb, held, nbytes = self._encode_entry(key, default)
        with self._lock:
            self._open_for_writes()
            ref = self._ref(key)
            if ref is not None:
                page, slot, _ = ref
                return self._codec.from_memory(page.values[slot])
            lsn = self._logged_set(key, kb, vb, held, None, None, nbytes)
        if self._sync_writes:
            self._sync(lsn)
        return default

    def update(self, other: Any = (), /, **kwargs: Any) -> None:
        """``dict.update``: store each pair of ``other`` (a mapping, or an
        iterable of ``(key, value)`` pairs) and of ``kwargs``, in order.

        Each pair is one :meth:`set` (logged and applied atomically); the
        update as a whole is not one step, so a reader may see some of the
        pairs before the rest. Nothing is read and then written back, so no
        concurrent write is lost.

        :raises TypeError, ValueError, LogWriteError, CacheClosedError,
            CacheFailedError: as for :meth:`set`; pairs before the failing
            one stay stored.
        """
        MutableMapping.update(self, other, **kwargs)

    def popitem(self) -> tuple[Any, Any]:
        """Remove and return some ``(key, value)``; KeyError when empty."""
        while True:
            with self._lock:
                self._check_open()
                key = next(iter(self._tier.table), _MISSING)
                if key is _MISSING and not self._store_keys.clear_pending:
                    row = self._store.any_key(set(self._tier.pages))
                    if row is not None:
                        key = _codec.decode_key(row[1] or row[0])
            if key is _MISSING:
                raise KeyError("popitem(): cache is empty")
            # pop() takes _MISSING as "no default": a key that expired or was
            # removed meanwhile raises KeyError, and another key is tried.
            try:
                return key, self.pop(key)
            except KeyError:
                continue
