"""What a memory hit and an overwrite of a resident entry touch, in one object.

``Cache.get``'s lock-free memory hit and ``Cache.set``'s overwrite of a live,
resident entry are the two hot paths. Each exists twice: in Python
(durablekv/cache.py, and ``Cache._memory_hit``, which
:class:`~durablekv.aio.AsyncCache` calls) and in C
(``durablekv._native.hit_getter`` / ``hot_setter``). Both take their
collaborators from one :class:`FastPath` that the cache builds when it
opens: the Python code reads ``self._fast``, and the C twins read the same
fields by name once, when they are built (``hit_getter(cache, fast)``).
It holds no reference to the cache, so it makes no reference cycle. A field added here is added for
both; tests/test_native_bindings.py fails when a name the C code reads is
missing here.

The fields are fixed for the cache's open life (the page table and the tick
counter are never replaced, only emptied in place; the log is chosen at
open). What changes on every write (counts, the LSN, a page's state) stays
with its owner and is read there.
"""
from __future__ import annotations

from typing import Any, Callable

__all__ = ["FastPath"]


class FastPath:
    """The hot paths' collaborators, fixed at open.

    :ivar table: the tier's page table, ``dict`` of key -> entry
        ``(page, slot, value)`` (see :class:`~durablekv.tier.pages.MemoryTier`).
    :ivar ticks: the tier's recency clock, an iterator of ``int``; each
        draw stamps the page (or the entry, per-entry residency) and counts
        a hit.
    :ivar tier: the memory tier (byte counts, ``pending``, ``shrink``).
    :ivar dirty: the tier's dirty pages, ``dict`` of page id -> page.
    :ivar log: the replay log appended to, or ``None`` (durability "none",
        or before open).
    :ivar open: the state object of an open cache (a cache's ``_state`` is
        compared with it by identity).
    :ivar has_ttl: the marker an entry holds in place of its value when the
        entry has a TTL (its expiry must be checked under the lock).
    :ivar frozen: the type of a value kept encoded (decoded on each read).
    :ivar resident, slotted: the page states served without the lock
        (``slotted``: per-entry residency, young entries only).
    :ivar log_write: the log's write seam as the class defines it; the C
        overwrite steps aside when a test has replaced it.
    :ivar max_key_bytes: the largest encoded key, in bytes.
    :ivar monotonic: the clock a page's ``dirty_since`` is read from, in
        seconds.
    :ivar get, set: the Python ``Cache.get`` / ``Cache.set`` (unbound), to
        which the C twins hand every case they do not take.
    """

    __slots__ = ("table", "ticks", "tier", "dirty", "log", "open", "has_ttl",
                 "frozen", "resident", "slotted", "log_write", "max_key_bytes", "monotonic",
                 "get", "set")

    def __init__(self, tier: Any, *, open: object, has_ttl: object,
                 frozen: type, resident: int, slotted: int, log_write: Callable[..., Any],
                 max_key_bytes: int, monotonic: Callable[[], float],
                 get: Callable[..., Any], set: Callable[..., Any]) -> None:
        self.tier = tier
        self.table = tier.table
        self.ticks = tier.ticks
        self.dirty = tier.dirty
        self.log = None
        self.open = open
        self.has_ttl = has_ttl
        self.frozen = frozen
        self.resident = resident
        self.slotted = slotted
        self.log_write = log_write
        self.max_key_bytes = max_key_bytes
        self.monotonic = monotonic
        self.get = get
        self.set = set
