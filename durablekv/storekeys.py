"""Which keys the page store may hold: asked before a key index lookup.

A key not in the memory tier's page table may still be in the store, and
finding out costs a SQLite (or PostgreSQL) index lookup. :class:`StoreKeys`
answers "certainly not there" without one, from three things it owns:

* a pending clear (``clear_pending``, ``clear_lsn``): ``clear()`` emptied
  memory at once, and the next flush empties the store; until that commits
  the store holds no live key;
* the key filter (:class:`~durablekv.keyfilter.KeyFilter`, a Bloom filter
  of the store's keys; its module docstring has the rules) and the one
  being built to replace it (``building``), which the write-behind thread
  fills from a scan of the store;
* the look-aside miss (``absent``): the key object a lookup just found
  absent, so that a miss and the set that fills it cost one lookup.

Everything here runs under the cache's lock; the cache's parts change this
state only through the methods below (reads go to the attributes).
"""

from __future__ import annotations

from typing import Any

from .config import _MISSING
from .keyfilter import KeyFilter

__all__ = ["StoreKeys"]

class StoreKeys:
    """What the store may hold (see the module docstring).

    :param key_count: keys in the store at open.
    :param empty: the store has never held a page (a new store): the
        filter is complete at once; otherwise it is built by a scan
        into ``building`` (:meth:`finish_build`) and not ``ready`` until
        then.

    :ivar filter: the current :class:`KeyFilter`; when ``filter.ready``, a
        canonical key not in it is not in the store.
    :ivar building: the filter a scan is filling, or None.
    :ivar absent: the key object last found absent from the store.
    :ivar clear_pending: a clear not committed yet: the store holds nothing live.
    :ivar clear_lsn: the LSN of the last clear.
    """

    __slots__ = ("filter", "building", "absent", "clear_pending", "clear_lsn")

    def __init__(self, key_count: int, empty: bool) -> None:
        self.filter = KeyFilter(2 * key_count)
        self.building: KeyFilter | None = None
        self.absent: Any = _MISSING  # (no key object is _MISSING)
        self.clear_pending = False
        self.clear_lsn = 0
        if empty:
            self.filter.ready = True
        else:
            self.building = self.filter

    # -- questions -------------------------------------------------------------

    def excluded(self, ck: bytes) -> bool:
        """The filter alone says ``ck`` is not in the store."""
        f = self.filter
        return f.ready and ck not in f

    def nothing_stored(self) -> bool:
        """No key the store holds is live: a clear is pending, or the filter
        is complete and no flush has added a key to it (a new or cleared
        store, memory holding every key)."""
        f = self.filter
        return self.clear_pending or (f.ready and f.added == 0)

    # -- changes ---------------------------------------------------------------

    def found_absent(self, key: Any) -> None:
        """A lookup of ``key`` found it in neither memory nor the store."""
        self.absent = key

    def key_added(self) -> None:
        """A new key entered memory: no key is known absent any more (it
        enters the filter once a flush stores it: :meth:`committed`)."""
        self.absent = _MISSING

    def cleared(self, lsn: int) -> None:
        """``clear()`` at ``lsn``: the store is about to be emptied, so an
        empty filter is complete, and no build goes on."""
        self.filter = KeyFilter(self.filter.capacity)
        self.filter.ready = True
        self.building = None
        self.clear_pending = True
        self.clear_lsn = lsn

    def clear_committed(self, lsn: int) -> None:
        """A flush committed the clear made at ``lsn`` (a later clear stays
        pending)."""
        if self.clear_lsn == lsn:
            self.clear_pending = False

    def committed(self, cks: list[bytes], clear_lsn: int, live_keys: int) -> None:
        """A flush, snapshotted after the clear at ``clear_lsn``, added the
        canonical keys ``cks`` to the key index. They go into the filter
        unless the cache was cleared since (the next flush deletes them). A
        filter that is overfull gets a larger one built (``live_keys``: keys
        the cache holds). A filter being built, or not ready, gets nothing:
        the scan that completes it starts after the build did and reads
        every commit made before it, and no commit lands between that scan
        and its merge (one thread does both)."""
        if self.clear_lsn != clear_lsn:
            return
        f = self.filter
        if f.ready:
            f.add_many(cks)
            if f.overfull and self.building is None:
                self.building = KeyFilter(4 * max(f.added, live_keys))

    def reserve(self, n: int, live_keys: int) -> None:
        """Make room for ``n`` new keys entering memory at once (recovery):
        the flushes that store them add them to the filter, so size it for
        them now instead of rebuilding it each time it fills up."""
        f, building = self.filter, self.building
        target = f if building is None else building
        if target.added + n <= 2 * target.capacity:  # not overfull afterwards
            return
        if building is None and f.ready and f.added == 0:
            # No flush has added a key since this filter was complete, so the
            # store holds none outside the pages in memory (a new or a cleared
            # store; a commit whose flush is still to report adds its keys to
            # whichever filter is current then): an empty bigger filter is
            # as complete.
            self.filter = KeyFilter(2 * n)
            self.filter.ready = True
            return
        self.building = KeyFilter(2 * (max(target.added, live_keys) + n))

    def finish_build(self, target: KeyFilter, scanned: KeyFilter) -> None:
        """The scan for ``target`` read the store's keys into ``scanned`` (a
        filter of ``target``'s capacity): merged, it becomes the filter,
        unless a clear or a newer build replaced it meanwhile."""
        if self.building is target:
            target.merge(scanned)
            target.ready = True
            self.filter = target
            self.building = None

    def __repr__(self) -> str:
        return (f"<StoreKeys ready={self.filter.ready} building={self.building is not None} "
                f"clear_pending={self.clear_pending}>")
