"""Partial pages with midpoint insertion: ``Cache(policy="midpoint")``.

A page stays the unit of I/O (new keys fill the open page in arrival order,
a page fault reads the whole stored page, a flush writes whole pages), but
residency is per *entry*: the memory tier holds at most ``max_pages *
page_size`` entries, and a page in memory may hold only some of its stored
entries. The entries in memory form one LRU list split into a *young* head
and an *old* tail (:data:`OLD_FRACTION` of the budget):

* a hit, a set or a new key puts the entry at the young MRU end; a hit in
  the old sublist moves the entry there;
* a page fault puts the requested entry at the young MRU end and the page's
  other entries that were not in memory (its neighbours, read with it) at
  the *midpoint*, the old sublist's MRU end;
* the young sublist's overflow moves to the old MRU end; the old LRU end
  (the young LRU end when the old sublist is empty) leaves memory.

This is InnoDB's buffer pool LRU, whose read-ahead pages enter at the
midpoint (MySQL reference manual, "Making the Buffer Pool Scan Resistant";
``innodb_old_blocks_pct`` = 37, hence 3/8), with entries in place of
InnoDB's pages and pages in place of its read-ahead extents. With
``page_size=1`` there are no neighbours and the two sublists are one LRU
list: an exact entry-level LRU. ``bench.sim.page_midpoint`` is the same
policy on a trace; single-threaded, this tier's memory hits equal it
exactly (tests/test_midpoint.py).

Per-slot state (``SlotPage.where``), changed only under the cache lock:

* ``YOUNG``: in the young sublist; ``stamps[slot]`` is its recency tick
  (stored without the lock by a memory hit, as a page's stamp is under
  ``lru``), and the young sublist is a min-heap of filed stamps re-filed
  lazily, as the page heap of :class:`~durablekv.tier.pages.MemoryTier`. A
  lock-free hit is taken only while ``stamps[slot] > 0``, i.e. young;
* ``OLD``: in the old sublist, a FIFO (entries enter it only at its MRU
  end). A hit there takes the lock, since it moves the entry;
* ``DOOMED``: chosen to leave memory while its page is dirty. Its data
  stays (the page's next flush must write it) but it no longer counts
  against the budget; it leaves when that flush commits. An access to it is
  a page fault, as for a pending page under ``lru``;
* ``OUT``: a free slot, or an *unloaded* one: its entry is in the store
  only (``keys[slot]`` is :data:`UNLOADED`, the page table has no entry for
  it). Only a clean page has unloaded slots; before a page with unloaded
  slots is changed, the cache reads them back in (as ``DOOMED``: the change
  makes the page dirty), so a flush always writes a complete page.

The order of the entries (the young and old sublists, the next victim) is
the policy object's, :class:`durablekv.policies.midpoint.Midpoint`; this
tier keeps residency: the slot states, the bytes in the budget, doomed and
unloaded entries, and the pages they sit in.

Pure data structures: no threads, no I/O, no locks.
"""

from __future__ import annotations

from typing import Any, Sequence

from ..policies.midpoint import OLD, OLD_FRACTION, YOUNG, Midpoint
from .pages import EMPTY, HAS_TTL, PENDING, MemoryTier, Page, SLOTTED, UNLOADED, _entries

__all__ = ["MidpointTier", "SlotPage", "OLD_FRACTION"]

#: Slot states of the tier beside the policy's ``YOUNG`` and ``OLD``: chosen
#: to leave memory while the page is dirty; out of memory (or a free slot).
DOOMED, OUT = 3, 0


class SlotPage(Page):
    """A page of a :class:`MidpointTier`: a :class:`~durablekv.tier.pages.Page`
    with per-slot residency.

    :ivar stamps: per slot, the recency tick while young (> 0), else 0.
    :ivar where: per slot, ``YOUNG``, ``OLD``, ``DOOMED`` or ``OUT``.
    :ivar filed: per slot, the stamp its young heap entry was filed under,
        or the token of its old sublist entry.
    :ivar live: slots young or old (counted against the budget).
    :ivar doomed: slots ``DOOMED``.
    :ivar sizes: per slot, the entry's bytes: encoded key + value at set
        time, the stored key + value after a page fault.
    """

    __slots__ = ("stamps", "where", "filed", "live", "doomed", "sizes")

    def __init__(self, page_id: int, page_size: int, full: tuple[list[Any], list[Any],
                 list[float | None]] | None = None) -> None:
        super().__init__(page_id, page_size, full)
        n = len(self.keys)
        self.state = SLOTTED
        self.stamps = [0] * n
        self.where = [OUT] * n
        self.filed = [0] * n
        self.live = 0
        self.doomed = 0
        self.sizes = [0] * n  # per slot: the entry's bytes (key + value), see MidpointTier

    def __repr__(self) -> str:
        return (f"<SlotPage {self.page_id} {self.used}/{len(self.keys)} live {self.live} "
                f"doomed {self.doomed} unloaded {self.unloaded} v{self.version}>")


class MidpointTier(MemoryTier):
    """The memory tier under ``policy="midpoint"`` (see the module docstring).

    :param page_size: slots per page (>= 1).
    :param max_pages: the budget is ``max_pages * page_size`` entries.
    :param max_bytes: also at most this many bytes of entries (``sizes``)
        young or old, the cache's ``max_memory_bytes``; None: no byte bound.
        After every call the live entries' bytes are at most ``max_bytes``,
        or exactly one entry is live (one entry bigger than the bound).

    Counters, as :class:`~durablekv.tier.pages.MemoryTier`'s, but per entry:
    ``evictions`` counts entries chosen to leave memory, ``resident`` the
    pages holding at least one entry in the budget, ``entries`` the entries
    in it (at most ``budget``), ``page_faults`` the accesses that read a
    page's missing entries in (or found the entry doomed), ``reloads`` the
    reads of a page's unloaded entries that a change of the page needed
    (a write-side read the simulator does not have). ``resident_bytes`` is
    the stored size of every page in memory, an upper bound for partial ones.
    """

    #: Install and fill take each entry's bytes (``sizes=``, from
    #: :func:`~durablekv.stores.pageformat.entry_sizes`).
    per_entry = True

    page_class = SlotPage

    def __init__(self, page_size: int, max_pages: int, max_bytes: int | None = None) -> None:
        #: the order of the entries in memory (young and old sublists), over a
        #: budget of ``max_pages * page_size`` entries
        self.policy: Midpoint
        super().__init__(page_size, max_pages,
                         policy=lambda tier: Midpoint(tier, max_pages * page_size))
        # (MemoryTier's byte bound is per page: its paths that evict pages
        # for bytes are not used here; _rebalance evicts entries for bytes)
        self.max_bytes = max_bytes
        if max_bytes is not None:
            self.page_bytes_limit = min(self.page_bytes_limit, max_bytes)
        self.live_bytes = 0  # bytes of the young and old entries
        self.reloads = 0
        #: ``fill_open(page)``: read the unloaded entries of the open page back
        #: in before an insert (the cache's ``_whole``: I/O, lock held).
        self.fill_open: Any = None

    @property
    def budget(self) -> int:
        """Most entries in memory (``max_pages * page_size``)."""
        return self.policy.budget

    @property
    def entries(self) -> int:
        """Entries counted against the budget (young + old)."""
        return self.policy.entries

    # -- residency of entries (lock held) --------------------------------------------

    def _young(self, page: SlotPage, slot: int, stamp: float | None = None) -> None:
        """``slot`` (out of memory's budget now) comes in at the young MRU end."""
        self.policy.add_young(page, slot, stamp)
        self.live_bytes += page.sizes[slot]
        self._gain(page)

    def _old(self, page: SlotPage, slot: int, lru_end: bool = False) -> None:
        """``slot`` comes in at the old MRU end (``lru_end``: its LRU end, for
        a warm preload)."""
        self.policy.add_old(page, slot, lru_end)
        self.live_bytes += page.sizes[slot]
        self._gain(page)

    def _gain(self, page: SlotPage) -> None:
        page.live += 1
        if page.live == 1:
            self.resident += 1

    def _lose(self, page: SlotPage, slot: int) -> None:
        """``slot`` leaves the budget (out of the policy's sublists)."""
        self.policy.remove(page, slot)
        self.live_bytes -= page.sizes[slot]
        page.live -= 1
        if page.live == 0:
            self.resident -= 1

    def _undoom(self, page: SlotPage, slot: int) -> None:
        page.where[slot] = OUT
        page.doomed -= 1
        if page.doomed == 0:
            self.pending -= 1

    def _rebalance(self) -> None:
        """Move the young overflow to the old sublist, then evict the policy's
        victims down to the budget (and ``max_bytes``); an entry chosen to
        leave goes at once when its page is clean (:meth:`_unload`), else when
        the page's flush commits (doomed)."""
        policy = self.policy
        policy.demote_overflow()
        excess = policy.young_n + policy.old_n - policy.budget
        max_bytes = self.max_bytes
        if excess > 0 or max_bytes is not None and self.live_bytes > max_bytes:
            dirty = self.dirty
            next_victim = policy.next_victim
            if max_bytes is None:
                max_bytes = 1 << 62
            while excess > 0 or self.live_bytes > max_bytes and \
                    policy.young_n + policy.old_n > 1:
                page, slot = next_victim()
                excess -= 1
                self.live_bytes -= page.sizes[slot]
                page.live -= 1
                if page.live == 0:
                    self.resident -= 1
                self.evictions += 1
                if page.page_id in dirty:
                    page.where[slot] = DOOMED
                    page.doomed += 1
                    if page.doomed == 1:
                        self.pending += 1
                else:  # clean: the store holds it
                    self._unload(page, slot)
                    if page.live == 0:
                        self._maybe_drop(page)
        policy.compact()

    def _unload(self, page: SlotPage, slot: int) -> None:
        """Drop a clean slot's entry from memory (the store holds it)."""
        del self.table[page.keys[slot]]
        page.keys[slot] = UNLOADED
        page.values[slot] = None
        page.expires[slot] = None
        page.where[slot] = OUT
        page.unloaded += 1

    def _maybe_drop(self, page: SlotPage) -> None:
        """Forget ``page`` once it holds no entry in memory and is clean."""
        if page.live == 0 and page.doomed == 0 and page.state != PENDING \
                and page.page_id not in self.dirty and page.used == page.unloaded \
                and page is not self.open_page:  # (see _take_page)
            if self.track_departures:
                self.departed.append(page.page_id)
            self.resident_bytes -= page.nbytes
            del self.pages[page.page_id]

    # -- MemoryTier's interface ------------------------------------------------------

    def touch(self, page: Page) -> None:
        """Page-level touch: not meaningful per entry; see :meth:`hit`."""
        raise TypeError("MidpointTier keeps recency per entry: use hit(page, slot)")

    def hit(self, page: Page, slot: int) -> bool:
        """An access to ``slot`` of ``page`` (in the page table) under the lock.

        :returns: True for a memory hit (young or old); False when the entry
            was doomed: a page fault, as the simulator counts it (the entry
            becomes young, the page's other doomed entries old).
        """
        where = page.where[slot]
        if where == YOUNG:
            page.stamps[slot] = next(self.ticks)
            self.locked_ticks += 1
            return True
        if where == OLD:
            self.policy.hit_old(page, slot)
            self._rebalance()
            return True
        # DOOMED: the simulator's page fault (its entry is out of memory there)
        self.page_faults += 1
        self._undoom(page, slot)
        self._young(page, slot)
        for s, w in enumerate(page.where):
            if w == DOOMED:
                self._undoom(page, s)
                self._old(page, s)
        self._rebalance()
        return False

    def fault_pending(self, page: Page) -> None:
        raise TypeError("MidpointTier has no pending pages with entries: use hit(page, slot)")

    def make_resident(self, page: Page, stamp: float | None = None) -> None:
        """A page taken for inserts (new, or empty from the free list)."""
        if page.state == PENDING:
            self.pending -= 1
            page.state = SLOTTED

    def over(self) -> bool:
        n = self.policy.young_n + self.policy.old_n
        return n > self.budget or (self.max_bytes is not None and self.live_bytes > self.max_bytes
                                   and n > 1)

    def shrink(self, keep: Page | None = None) -> None:
        """Evict entries down to both bounds (an entry's size does not change
        at a flush here: sizes are kept per entry, not read off the blob)."""
        if self.over():
            self._rebalance()

    def lru_order(self) -> list[Page]:
        """Pages holding entries in the budget, least recently used first by
        their most recent young entry (for tests and introspection)."""
        live = [p for p in self.pages.values() if getattr(p, "live", 0)]
        return sorted(live, key=lambda p: max(p.stamps))

    def install(self, page_id: int, slots: Sequence[int], keys: list[Any], values: list[Any],
                expires: list[float | None], nbytes: int = 0, *, resident: bool = True,
                warm_stamp: float | None = None, want: Any = UNLOADED,
                sizes: Sequence[int] | None = None) -> Page:
        """As :meth:`MemoryTier.install`, per entry: a page fault puts the
        entry of key ``want`` young and the others old (the midpoint); a
        warm preload (``warm_stamp``) puts every entry old, evicting nothing
        (the caller checks :meth:`warm_fits`); ``resident=False`` takes them in
        doomed (the caller dirties the page at once). ``sizes``: each entry's
        bytes, in ``slots`` order (:func:`~durablekv.stores.pageformat.entry_sizes`
        of the blob); required."""
        if sizes is None:
            raise TypeError("MidpointTier.install needs each entry's bytes (sizes=)")
        page = self._stored_page(page_id, slots, keys, values, expires, nbytes)
        ps = page.sizes
        for slot, size in zip(slots, sizes):
            ps[slot] = size
        self.resident_bytes += nbytes
        self._take_in(page, slots, keys, want, resident, warm_stamp is not None)
        return page

    def recency(self, pages: list[Page]) -> list[tuple[float, int]]:
        """``(recency, page id)`` of the pages holding entries in the budget:
        a page's most recent young entry's stamp; pages with old entries only
        after every page with a young one, in their old sublist order."""
        out = []
        for p in pages:
            if getattr(p, "live", 0):
                stamp = max(p.stamps)
                if not stamp:  # old entries only: below every young one, by FIFO token
                    stamp = max(t for t, w in zip(p.filed, p.where) if w == OLD) - (1 << 62)
                out.append((stamp, p.page_id))
        return out

    def warm_room(self) -> int:
        """Pages a warm preload may still bring in: while there is room for entries."""
        return -(-self.room() // self.page_size)

    @property
    def memory_bytes(self) -> int:
        """Bytes of the entries in the budget (young and old), bounded by
        ``max_bytes``; doomed entries wait for their page's flush, as pending
        pages do under ``lru``."""
        return self.live_bytes

    def warm_fits(self, n: int, nbytes: int) -> bool:
        """Whether a warm preload may bring in a stored page of ``n`` entries
        of ``nbytes`` bytes (their sizes) without evicting."""
        return n <= self.room() and (self.max_bytes is None
                                     or self.live_bytes + nbytes <= self.max_bytes)

    def room(self) -> int:
        """Entries that can come in without an eviction."""
        return self.budget - self.policy.young_n - self.policy.old_n

    def _take_in(self, page: SlotPage, slots: Sequence[int], keys: Sequence[Any], want: Any,
                 resident: bool, warm: bool) -> None:
        if not resident:
            for s in slots:
                page.where[s] = DOOMED
            if slots:
                if page.doomed == 0:
                    self.pending += 1
                page.doomed += len(slots)
            return
        if warm:
            for s in slots:
                self._old(page, s, lru_end=True)
            return
        self.page_faults += 1
        wanted = -1
        if want is not UNLOADED:
            ref = self.table.get(want)
            if ref is not None and ref[0] is page:
                wanted = ref[1]
                self._young(page, wanted)
        # the neighbours, at the old sublist's MRU end (the midpoint)
        sizes = page.sizes
        others = [s for s in slots if s != wanted]
        n = self.policy.add_old_many(page, others)
        self.live_bytes += sum([sizes[s] for s in others])
        if n:
            if page.live == 0:
                self.resident += 1
            page.live += n
        self._rebalance()

    def fill(self, page: SlotPage, slots: Sequence[int], keys: list[Any], values: list[Any],
             expires: list[float | None], *, want: Any = UNLOADED,
             for_write: bool = False, sizes: Sequence[int] = ()) -> None:
        """Read ``page``'s unloaded entries back in from its stored copy
        (``slots``... as :meth:`install`'s, the whole stored page, checked by
        the caller to agree with the loaded slots).

        :param want: the key whose access faulted (young; the rest old).
        :param for_write: the page is about to change: the entries come in
            doomed (outside the budget; they leave at the flush that follows).
        """
        pk, pv, pe, ps = page.keys, page.values, page.expires, page.sizes
        got_slots, got_keys, got_held, got_exp = [], [], [], []
        for slot, key, held, exp, size in zip(slots, keys, values, expires, sizes):
            if pk[slot] is UNLOADED:
                ps[slot] = size
                pk[slot] = key
                pv[slot] = held
                pe[slot] = exp
                got_slots.append(slot)
                got_keys.append(key)
                got_held.append(held)
                got_exp.append(exp)
        page.unloaded -= len(got_slots)
        self.table.update(zip(got_keys, _entries(page, got_slots, got_held, got_exp)))
        if for_write:
            self.reloads += 1
        self._take_in(page, got_slots, got_keys, want, not for_write, False)

    def settle(self, page: SlotPage) -> None:
        """After a change that might not have happened: doomed entries of a
        page that is still clean leave now (its store copy holds them)."""
        if page.doomed and page.page_id not in self.dirty and self.pages.get(page.page_id) is page:
            for s, w in enumerate(page.where):
                if w == DOOMED:
                    self._undoom(page, s)
                    self._unload(page, s)
            self._maybe_drop(page)

    def _take_page(self, nbytes: int) -> Page:
        """As :meth:`MemoryTier._take_page`. New keys keep filling the open
        page even when some of its entries have left memory (as the simulator
        does: a page holds keys set close together in time); its unloaded
        entries are read back first (:attr:`fill_open`, doomed: outside the
        budget, they leave at the flush that stores the insert), since a flush
        writes whole pages."""
        page = self.open_page
        if page is not None and page.used < self.page_size \
                and page.nbytes + nbytes <= self.page_bytes_limit:
            if page.unloaded:
                self.fill_open(page)
            return page
        taken = super()._take_page(nbytes)
        if page is not None and page is not taken and self.pages.get(page.page_id) is page:
            self._maybe_drop(page)  # kept while open, though nothing of it was in memory
        return taken

    def insert(self, key: Any, held: Any, expire_at: float | None, now: float, lsn: int,
               nbytes: int) -> Page:
        page = self._take_page(nbytes)
        page.nbytes += nbytes
        self.resident_bytes += nbytes
        slot = page.free_slots.pop()
        page.keys[slot] = key
        page.values[slot] = held
        page.expires[slot] = expire_at
        page.sizes[slot] = nbytes
        page.used += 1
        page.keys_version += 1
        self.table[key] = (page, slot, held if expire_at is None else HAS_TTL)
        self.mark_dirty(page, now, lsn)
        self._young(page, slot)
        self._rebalance()
        return page

    def insert_many(self, keys: Sequence[Any], held: Sequence[Any],
                    expires: Sequence[float | None], nbytes: Sequence[int], now: float,
                    lsn: int, start: int = 0, page_budget: int | None = None) -> int:
        """As :meth:`MemoryTier.insert_many`, one :meth:`insert` at a time
        (``page_budget`` counts the pages the inserts start)."""
        n = len(keys)
        i = start
        taken = 0
        limit = self.page_bytes_limit
        while i < n:
            page = self.open_page
            if page is None or page.used >= self.page_size or \
                    page.nbytes + nbytes[i] > limit:
                if page_budget is not None and taken >= page_budget:
                    break
                taken += 1
            self.insert(keys[i], held[i], expires[i], now, lsn, nbytes[i])
            i += 1
        return i

    def mark_dirty(self, page: Page, now: float, lsn: int) -> None:
        if page.unloaded:
            raise RuntimeError(f"page {page.page_id} changed with {page.unloaded} entries "
                               "not loaded: read them in first (Cache._whole)")
        super().mark_dirty(page, now, lsn)

    def update(self, page: Page, slot: int, held: Any, expire_at: float | None,
               now: float, lsn: int, nbytes: int) -> None:
        super().update(page, slot, held, expire_at, now, lsn, nbytes)
        self.resident_bytes += nbytes
        where = page.where[slot]
        if where == YOUNG or where == OLD:
            self.live_bytes += nbytes - page.sizes[slot]
        page.sizes[slot] = nbytes
        if self.max_bytes is not None and self.live_bytes > self.max_bytes:
            # the entry just written is the last to go: young MRU first
            # (the caller's hit() then finds it young)
            if where == YOUNG or where == OLD:
                self._lose(page, slot)
                self._young(page, slot)
            self._rebalance()

    def remove(self, key: Any, now: float, lsn: int) -> tuple[Page, int]:
        page, slot, _ = self.table[key]
        w = page.where[slot]
        if w == YOUNG or w == OLD:
            self._lose(page, slot)
        elif w == DOOMED:
            self._undoom(page, slot)
        self.mark_dirty(page, now, lsn)  # (raises first if the page is not whole)
        del self.table[key]
        page.keys[slot] = EMPTY
        page.values[slot] = None
        page.expires[slot] = None
        page.used -= 1
        page.keys_version += 1
        page.free_slots.append(slot)
        if page.used == 0 and page is not self.open_page:
            page.state = PENDING  # out of use until the free list gives it out
            self.pending += 1
            self.free.append(page.page_id)
        return page, slot

    def clear(self) -> None:
        super().clear()          # (clears the policy too)
        self.live_bytes = 0

    def flushed(self, page: Page, version: int, keys_version: int, n: int, ttl_n: int,
                nbytes: int) -> None:
        if not self._stored(page, keys_version, n, ttl_n):
            return  # forgotten meanwhile (clear())
        if page.version != version:
            self.dirty.pop(page.page_id, None)
            self.dirty[page.page_id] = page
            return
        self.resident_bytes += nbytes - page.nbytes
        page.nbytes = nbytes
        self.dirty.pop(page.page_id, None)
        page.dirty_since = None
        if page.state == PENDING:
            self.pending -= 1
            self.resident_bytes -= page.nbytes
            self._drop(page)
            return
        if page.doomed:
            for s, w in enumerate(page.where):
                if w == DOOMED:
                    self._undoom(page, s)
                    self._unload(page, s)
            self._maybe_drop(page)
