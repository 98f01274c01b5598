"""``policy="midpoint"``: entries in one LRU list split into a young head and
an old tail, a page fault's neighbours entering at the midpoint.

The order of the entries in memory, for a tier whose residency is per entry
(:class:`durablekv.tier.midpoint.MidpointTier`, which keeps the entries'
residency, bytes and the pages they sit in):

* a hit, a set or a new key puts the entry at the young MRU end
  (:meth:`Midpoint.add_young`); a hit in the old sublist moves it there
  (:meth:`Midpoint.hit_old`);
* a page fault's other entries (the neighbours read with it) go to the old
  sublist's MRU end, the *midpoint* (:meth:`Midpoint.add_old`);
* the young sublist's overflow moves to the old MRU end
  (:meth:`Midpoint.demote_overflow`); the next victim is the old LRU end,
  the young LRU end when the old sublist is empty (:meth:`Midpoint.next_victim`).

This is InnoDB's buffer pool LRU, whose read-ahead pages enter at the
midpoint (MySQL reference manual, "Making the Buffer Pool Scan Resistant";
``innodb_old_blocks_pct`` = 37, hence :data:`OLD_FRACTION` = 3/8), with
entries in place of InnoDB's pages and pages in place of its read-ahead
extents. With ``page_size=1`` there are no neighbours and the two sublists
are one LRU list: an exact entry-level LRU.

Per-slot fields of a :class:`~durablekv.tier.midpoint.SlotPage` this policy
keeps: ``where[slot]`` (:data:`YOUNG` or :data:`OLD` while the entry is in a
sublist), ``stamps[slot]`` (the recency tick while young, stored without the
lock by a memory hit, as a page's stamp is under ``lru``; 0 otherwise) and
``filed[slot]`` (the stamp its young heap entry was filed under, or the token
of its old FIFO entry). The young sublist is a min-heap of filed stamps
re-filed lazily, as :class:`~durablekv.policies.lru.LRU`'s page heap; the old
sublist is a FIFO (entries enter it only at its MRU end, or at its LRU end
for a warm preload). Moving an entry between the sublists changes no
residency count; entering or leaving them does, and the tier counts it.

Pure data structure: no threads, no I/O, no locks.
"""

from __future__ import annotations

from collections import deque
from heapq import heappop, heappush, heapreplace
from itertools import count
from typing import Any, Iterable

__all__ = ["Midpoint", "OLD_FRACTION", "YOUNG", "OLD"]

#: The old sublist's share of the entry budget (InnoDB's
#: ``innodb_old_blocks_pct`` default of 37%).
OLD_FRACTION = 0.375

#: ``where[slot]`` of an entry in the young or the old sublist (the tier's
#: other slot states are 0, out of memory, and 3, doomed).
YOUNG, OLD = 1, 2

_OUT = 0


class Midpoint:
    """The young and old sublists of an entry budget (see the module docstring).

    :param tier: the tier whose entries it orders: its recency clock
        (``ticks``; a tick drawn here, under the cache lock, is counted in
        its ``locked_ticks``, as the tier's own are).
    :param budget: entries the tier holds (>= 1); the young sublist takes
        ``budget - int(OLD_FRACTION * budget)`` of them (at least 1).
    :ivar young_n, old_n: entries in each sublist.
    """

    def __init__(self, tier: Any, budget: int) -> None:
        self.tier = tier
        self.budget = budget
        self.young_cap = max(1, budget - int(OLD_FRACTION * budget))
        self.young: list[tuple[float, Any, int]] = []   # (filed stamp, page, slot)
        self.old: deque[tuple[int, Any, int]] = deque()  # (token, page, slot)
        self.young_n = 0
        self.old_n = 0
        self._tokens = count(1)
        self._warm_tokens = count(-1, -1)  # FIFO tokens of the LRU end (unique, ordered)

    def page_factory(self, page_cls: type) -> Any:
        """``page_cls`` itself: the tier's pages (with per-slot recency)."""
        return page_cls

    @property
    def entries(self) -> int:
        """Entries in the two sublists."""
        return self.young_n + self.old_n

    def add_young(self, page: Any, slot: int, stamp: float | None = None) -> None:
        """Put ``slot`` (in no sublist now) at the young MRU end."""
        if stamp is None:
            tier = self.tier
            stamp = next(tier.ticks)
            tier.locked_ticks += 1
        page.where[slot] = YOUNG
        page.stamps[slot] = page.filed[slot] = stamp
        heappush(self.young, (stamp, page, slot))
        self.young_n += 1

    def add_old(self, page: Any, slot: int, lru_end: bool = False) -> None:
        """Put ``slot`` (in no sublist now) at the old MRU end (``lru_end``: at
        the LRU end, for a warm preload, which brings pages in most recent first)."""
        page.where[slot] = OLD
        page.stamps[slot] = 0
        if lru_end:
            page.filed[slot] = tok = next(self._warm_tokens)
            self.old.appendleft((tok, page, slot))
        else:
            page.filed[slot] = tok = next(self._tokens)
            self.old.append((tok, page, slot))
        self.old_n += 1

    def add_old_many(self, page: Any, slots: Iterable[int]) -> int:
        """:meth:`add_old` of each of ``slots`` (a page fault's neighbours), in
        order; returns how many."""
        where, stamps, filed = page.where, page.stamps, page.filed
        old, tokens = self.old, self._tokens
        n = 0
        for s in slots:
            where[s] = OLD
            stamps[s] = 0
            filed[s] = tok = next(tokens)
            old.append((tok, page, s))
            n += 1
        self.old_n += n
        return n

    def remove(self, page: Any, slot: int) -> None:
        """Take ``slot`` out of its sublist (its heap or FIFO entry goes stale)."""
        if page.where[slot] == YOUNG:
            self.young_n -= 1
        else:
            self.old_n -= 1
        page.where[slot] = _OUT
        page.stamps[slot] = 0

    def hit_old(self, page: Any, slot: int) -> None:
        """A hit on an old entry: it moves to the young MRU end."""
        self.old_n -= 1
        page.where[slot] = _OUT
        self.add_young(page, slot)

    def _pop_young(self) -> tuple[Any, int]:
        """The young LRU entry (the sublist must not be empty), still young."""
        heap = self.young
        while True:
            filed, page, slot = heap[0]
            if page.where[slot] != YOUNG or page.filed[slot] != filed:
                heappop(heap)  # stale: it left the young sublist after this was filed
            elif (stamp := page.stamps[slot]) != filed:
                page.filed[slot] = stamp  # hit since it was filed (read once, see lru.py)
                heapreplace(heap, (stamp, page, slot))
            else:
                return page, slot

    def demote_overflow(self) -> None:
        """Move the young sublist's overflow to the old MRU end."""
        if self.young_n > self.young_cap:
            old, tokens = self.old, self._tokens
            n = self.young_n - self.young_cap
            for _ in range(n):
                page, slot = self._pop_young()
                page.where[slot] = OLD
                page.stamps[slot] = 0
                page.filed[slot] = tok = next(tokens)
                old.append((tok, page, slot))
            self.young_n -= n
            self.old_n += n

    def next_victim(self) -> tuple[Any, int]:
        """Take the next entry to leave memory out of its sublist (there must
        be one): the old LRU end, or the young LRU end when the old sublist is
        empty. Its ``where`` is left for the tier to set."""
        old = self.old
        while self.old_n:
            tok, page, slot = old.popleft()
            if page.where[slot] != OLD or page.filed[slot] != tok:
                continue  # stale: it left the old sublist after this was filed
            stamp = page.stamps[slot]
            if stamp > 0:
                # a lock-free hit raced its move to the old sublist: that
                # hit counts, so the entry is young again
                self.old_n -= 1
                page.where[slot] = _OUT
                self.add_young(page, slot, stamp)
                self.demote_overflow()
                continue
            self.old_n -= 1
            return page, slot
        page, slot = self._pop_young()
        page.stamps[slot] = 0
        self.young_n -= 1
        return page, slot

    def compact(self) -> None:
        """Drop stale heap and FIFO entries once they are more than half."""
        if len(self.young) > 2 * self.young_n + 64:
            self.young = [(p.filed[s], p, s) for f, p, s in self.young
                          if p.where[s] == YOUNG and p.filed[s] == f]
            self.young.sort()
        if len(self.old) > 2 * self.old_n + 64:
            self.old = deque(e for e in self.old
                             if e[1].where[e[2]] == OLD and e[1].filed[e[2]] == e[0])

    def clear(self) -> None:
        self.young.clear()
        self.old.clear()
        self.young_n = self.old_n = 0
