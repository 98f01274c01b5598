"""The memory tier: fixed-size pages, a page table, a free list, page-level LRU.

Pure data structures: no threads, no I/O, no locks (the cache serialises
access). The design is a database buffer pool shrunk to key/value entries
(PostgreSQL shared buffers, InnoDB's buffer pool):

* A :class:`Page` has ``page_size`` slots; a slot holds one entry
  (key, value, expire_at). New keys fill the *open page*; a full page takes
  the next page id from the *free list* (ids of pages that became empty) or
  a fresh id.
* The *page table* maps a key to its page-table entry ``(page, slot,
  value)`` for every page held in memory. Python's dict gives it exactly
  dict key equality (``1 == 1.0``). The entry repeats the slot's value, or
  holds :data:`HAS_TTL` when the slot has an expiry, so that a memory hit
  reads the value from the entry alone (see :class:`MemoryTier`).
* A page is *resident* (in the LRU order, at most ``max_pages`` of them) or
  *pending* (evicted while dirty: out of the LRU, still in the page table,
  waiting for the write-behind batcher). A clean page that is evicted leaves
  memory altogether.
* The tier is bounded in pages (``max_pages``) and, optionally, in bytes
  (``max_bytes``, the cache's ``max_memory_bytes``): ``resident_bytes`` is
  the sum of ``page.nbytes`` over resident pages, kept in step by every
  change of residency or of a resident page's ``nbytes``. When either bound
  is passed, the policy's victims leave exactly as for ``max_pages``. The
  byte bound is exact to a page: after any method returns,
  ``resident_bytes <= max_bytes``, or exactly one page is resident (a page
  holding an entry bigger than the bound on its own, see
  :attr:`MemoryTier.page_bytes_limit`), which the next page to become
  resident evicts.
* Recency is per page: touching any entry touches its page. With
  ``page_size=1`` this is exactly an entry-level LRU of ``max_pages`` entries.
* Dirty tracking is by version (invariant 4 of the design): every change
  bumps ``page.version``; a flush remembers the version it wrote, and a page
  changed while its flush was in flight stays dirty. ``page.dirty_lsn`` is
  the LSN of the first change not yet in the store, so a flush that could
  write only some pages knows how far its checkpoint may go.
"""

from __future__ import annotations

from itertools import accumulate, chain, count, islice, repeat
from typing import Any, Callable, Iterator, Sequence

from ..policies import make_policy
from ..policies.base import EvictionPolicy

__all__ = ["Page", "MemoryTier", "EMPTY", "HAS_TTL", "PAGE_BYTES_LIMIT", "UNLOADED"]

#: Most encoded bytes (keys + values) a page holds, well under SQLite's
#: default 1,000,000,000-byte limit on a blob: an insert that would pass it
#: starts a new page, an overwrite that would pass it moves the entry to one.
PAGE_BYTES_LIMIT = 256 << 20


class _Empty:
    __slots__ = ()

    def __repr__(self) -> str:
        return "EMPTY"


#: Marker for an unused slot.
EMPTY: Any = _Empty()


class _HasTTL:
    __slots__ = ()

    def __repr__(self) -> str:
        return "HAS_TTL"


#: The value in the page-table entry of a slot with an expiry (whose value
#: must be read with the expiry, under the lock).
HAS_TTL: Any = _HasTTL()

class _Unloaded:
    __slots__ = ()

    def __repr__(self) -> str:
        return "UNLOADED"


#: Marker for a used slot whose entry is in the store only (``policy=
#: "midpoint"``, :mod:`durablekv.tier.midpoint`): the page is in memory in part.
UNLOADED: Any = _Unloaded()

#: Page states: in the LRU order; evicted while dirty (waiting for the
#: write-behind); a page of the midpoint tier, whose residency is per slot.
RESIDENT, PENDING, SLOTTED = 1, 2, 3


class Page:
    """One page: ``page_size`` slots of (key, value, expire_at).

    :ivar page_id: int id, also its row id in the SQLite store.
    :ivar keys/values/expires: parallel lists, one item per slot; ``keys[i]``
        is :data:`EMPTY` for a free slot; ``expires[i]`` is absolute epoch
        seconds or None.
    :ivar used: slots in use.
    :ivar version: bumped by every change (dirty tracking by version).
    :ivar keys_version: bumped when the set of keys or an expire_at changes,
        so a flush can skip rewriting the key index for value-only changes.
    :ivar dirty_since: ``time.monotonic()`` when the page became dirty, or None.
    :ivar dirty_lsn: LSN of the first change not yet handed to a flush, or None.
    :ivar flight_lsn: the ``dirty_lsn`` handed to the flush now in flight, or None.
    :ivar nbytes: encoded bytes of the page's entries; exact after a flush or
        a page fault, an upper bound in between (overwrites only add).
    :ivar stored_n / stored_ttl_n: entries (with an expire_at) as last
        committed to the store; used to keep the store's counts exact.
    """

    __slots__ = ("page_id", "keys", "values", "expires", "used", "version",
                 "keys_version", "state", "dirty_since", "stored_n",
                 "stored_ttl_n", "stored_keys_version", "free_slots", "dirty_lsn",
                 "flight_lsn", "nbytes", "stamp", "heap_stamp", "unloaded")

    def __init__(self, page_id: int, page_size: int, full: tuple[list[Any], list[Any],
                 list[float | None]] | None = None) -> None:
        """An empty page, or with ``full`` = ``(keys, values, expires)``
        (each ``page_size`` long) a page whose every slot is taken."""
        self.page_id = page_id
        if full is None:
            self.keys: list[Any] = [EMPTY] * page_size
            self.values: list[Any] = [None] * page_size
            self.expires: list[float | None] = [None] * page_size
            self.free_slots: list[int] = list(range(page_size - 1, -1, -1))
        else:
            self.keys, self.values, self.expires = full
            self.free_slots = []
        self.used = 0
        self.version = 0
        self.keys_version = 0
        self.stored_keys_version = 0
        self.state = RESIDENT
        self.dirty_since: float | None = None
        self.stored_n = 0
        self.stored_ttl_n = 0
        self.dirty_lsn: int | None = None
        self.flight_lsn: int | None = None
        self.nbytes = 0
        self.stamp = 0        # recency: the tier's tick at the last access
        self.heap_stamp = -1  # stamp of this page's entry in the LRU heap; -1: none
        self.unloaded = 0     # used slots whose entry is in the store only (midpoint)

    def __repr__(self) -> str:
        st = "resident" if self.state == RESIDENT else "pending"
        return f"<Page {self.page_id} {self.used}/{len(self.keys)} {st} v{self.version}>"


def _entries(page: "Page", slots: Sequence[int], held: Sequence[Any],
             expires: Sequence[float | None]) -> Iterator[tuple[Page, int, Any]]:
    """Page-table entries for ``held`` values with ``expires`` in ``slots`` of ``page``."""
    if expires.count(None) == len(expires):
        return zip(repeat(page), slots, held)
    return zip(repeat(page), slots, [h if e is None else HAS_TTL for h, e in zip(held, expires)])


class MemoryTier:
    """Page table, resident pages in LRU order, pending pages, free list.

    :param page_size: slots per page (>= 1).
    :param max_pages: most pages resident at once (>= 1).
    :param max_bytes: most bytes resident at once (``page.nbytes`` summed over
        resident pages: the entries' encoded keys and values as accounted at
        set time, and a page's stored blob size after a flush or a page
        fault), or None for no byte bound. With a bound, a new entry starts
        a new page rather than take the open page past ``max_bytes``, so only
        a page holding one entry bigger than the bound can pass it alone.
    :param policy: the replacement policy's name, ``"lru"`` or ``"tinylfu"``
        (:func:`durablekv.policies.make_policy` builds it; it chooses the
        pages that leave), or a callable that builds the policy object from
        the tier (a tier subclass's own policy). Dirty victims go pending
        either way.

    Public attributes are read directly by the cache's hot path:
    ``table`` (key -> page-table entry, see below), ``ticks`` (the recency clock: an access
    sets ``page.stamp = next(ticks)``), ``pages`` (page_id -> Page for every
    page in memory), ``dirty`` (page_id -> Page, in the order they became
    dirty). ``page.heap_stamp`` is the stamp a resident page is filed under
    in its policy's order (-1: none); a policy re-files a page touched since
    lazily, when it surfaces as a victim (:mod:`durablekv.policies.lru`).

    Page-table entries: ``(page, slot, value)``, where ``value`` is
    ``page.values[slot]`` while the slot has no expiry, else
    :data:`HAS_TTL`. The cache reads them without its lock (``Cache.get``),
    so an entry changes only in ways a reader can take whole:

    * page and slot are fixed: a key that moves to another page gets a new
      entry;
    * a key gets a tuple when it is placed (built in C, no Python call per
      key, so page faults and recovery stay cheap). Its first change of
      value or expiry replaces the tuple with a list, and later changes
      store into the list's third item: one store, no allocation on the
      overwrite path. A reader's one load of item 2 sees the value before
      a write or after it;
    * an entry that leaves the table keeps the value it had then, which
      was live until that moment.
    """

    #: The page class of this residency granularity (a policy may wrap it:
    #: see :meth:`~durablekv.policies.base.EvictionPolicy.page_factory`).
    page_class: type = Page

    def __init__(self, page_size: int, max_pages: int,
                 policy: str | Callable[[MemoryTier], EvictionPolicy] = "lru",
                 max_bytes: int | None = None) -> None:
        self.page_size = page_size
        self.max_pages = max_pages
        self.max_bytes = max_bytes
        #: most bytes a page takes new entries up to (see fits())
        self.page_bytes_limit = (PAGE_BYTES_LIMIT if max_bytes is None
                                 else min(PAGE_BYTES_LIMIT, max_bytes))
        self.resident_bytes = 0  # sum of page.nbytes over resident pages
        # ids of clean pages that left memory, for the store's LRU order
        # (Cache(size_limit=) sets track_departures; the write-behind takes them)
        self.track_departures = False
        self.departed: list[int] = []
        self.table: dict[Any, tuple | list] = {}
        self.pages: dict[int, Page] = {}
        # The LRU clock. Cache.get's lock-free memory hit draws one tick
        # and nothing else, so its hits are the ticks drawn minus those
        # drawn under the cache lock (counted here): one C call per hit.
        self.ticks = count(1)
        self.locked_ticks = 0
        self.resident = 0
        self.dirty: dict[int, Page] = {}
        self.free: list[int] = []
        self.open_page: Page | None = None
        self.next_page_id = 1
        self.pending = 0
        self.evictions = 0
        self.page_faults = 0
        self.evicted: list[Page] = []  # scratch: pages evicted by the last call
        self._all_slots = list(range(page_size))
        #: the replacement policy (:mod:`durablekv.policies`): the order in
        #: which resident pages leave
        self.policy = make_policy(policy, self) if isinstance(policy, str) else policy(self)
        self._new_page: Any = self.policy.page_factory(self.page_class)

    # -- residency -------------------------------------------------------------

    def draw_tick(self) -> int:
        """Draw a tick of the recency clock under the cache lock (counted in
        ``locked_ticks``, so that it is not taken for a lock-free hit)."""
        self.locked_ticks += 1
        return next(self.ticks)

    def take_departed(self) -> list[int]:
        """The ids of clean pages that left memory since the last call (with
        ``track_departures``), for the store's LRU order; the list starts over."""
        left, self.departed = self.departed, []
        return left

    def give_back_departed(self, left: list[int]) -> None:
        """``left`` (from :meth:`take_departed`) was not recorded (a failed
        flush): a later one records it, before those that left since."""
        self.departed[:0] = left

    def store_lost(self, page: Page, now: float, lsn: int) -> None:
        """The store evicted ``page`` (``size_limit``) while it is in memory:
        it is written again, as a page never stored, by the next flush.

        :param now: monotonic seconds (its ``dirty_since`` if it was clean).
        :param lsn: the LSN its change counts from (the next one).
        """
        page.stored_n = page.stored_ttl_n = 0
        page.stored_keys_version = page.keys_version - 1
        self.mark_dirty(page, now, lsn)

    def next_tick(self) -> int:
        """The tick the recency clock gives next, without drawing it (the
        clock is an ``itertools.count``, whose repr is ``count(N)``)."""
        return int(repr(self.ticks)[6:-1])

    def touch(self, page: Page) -> None:
        """Mark ``page`` most recently used (it must be resident)."""
        page.stamp = next(self.ticks)
        self.locked_ticks += 1

    #: ``fill_open(page)``: read the unloaded entries of the open page back
    #: in before an insert; set by the cache, called only by a tier with
    #: residency per entry (:class:`durablekv.tier.midpoint.MidpointTier`).
    fill_open: Any = None

    #: Whether install() takes per-entry sizes (``sizes=``); see
    #: :class:`durablekv.tier.midpoint.MidpointTier`.
    per_entry = False

    @property
    def memory_bytes(self) -> int:
        """Bytes the tier counts against ``max_bytes`` now (``stats().memory_bytes``)."""
        return self.resident_bytes

    def recency(self, pages: list[Page]) -> list[tuple[float, int]]:
        """``(recency stamp, page id)`` of the resident pages among ``pages``
        (for ``resident.list``; stamps move lock-free, so the caller sorts)."""
        return [(p.stamp, p.page_id) for p in pages if p.state == RESIDENT and p.heap_stamp >= 0]

    def warm_room(self) -> int:
        """Pages a warm preload may still bring in without evicting."""
        return self.max_pages - self.resident

    def warm_fits(self, n: int, nbytes: int) -> bool:
        """Whether a warm preload may bring in a stored page of ``n`` entries
        and ``nbytes`` bytes without evicting (``max_bytes``)."""
        return self.max_bytes is None or self.resident_bytes + nbytes <= self.max_bytes

    def hit(self, page: Page, slot: int) -> bool:
        """An access to ``slot`` of ``page`` (in the page table), lock held.

        :returns: True for a memory hit (the page is resident: touched),
            False for a page fault (a pending page taken back).
        """
        if page.state == RESIDENT:
            page.stamp = next(self.ticks)
            self.locked_ticks += 1
            return True
        self.fault_pending(page)
        return False

    def make_resident(self, page: Page, stamp: float | None = None) -> None:
        """Put a pending or newly built page at the MRU end, evicting if full
        (``stamp``: file it under this recency stamp instead; see :meth:`install`)."""
        if page.state == RESIDENT and page.heap_stamp >= 0:
            self.touch(page)
            return
        if page.state == PENDING:
            self.pending -= 1
        page.state = RESIDENT
        if stamp is None:
            stamp = next(self.ticks)
            self.locked_ticks += 1
        self.resident += 1
        self.resident_bytes += page.nbytes
        self.policy.admit(page, stamp)

    def over(self) -> bool:
        """Whether the resident pages pass either bound (pages or bytes)."""
        return self.resident > self.max_pages or (
            self.max_bytes is not None and self.resident_bytes > self.max_bytes
            and self.resident > 1)

    def shrink(self, keep: Page | None = None) -> None:
        """Evict by the policy until ``resident_bytes <= max_bytes`` or one
        page is left; ``keep`` (the page the caller is using, just touched) is
        the last to go, so it stays."""
        if self.max_bytes is not None:
            self.policy.shrink(keep)

    def lru_order(self) -> list[Page]:
        """Resident pages, least recently used first (O(n log n); for tests
        and introspection, not the hot path)."""
        return sorted((p for p in self.pages.values()
                       if p.state == RESIDENT and p.heap_stamp >= 0),
                      key=lambda p: p.stamp)

    def _leave_residency(self, page: Page) -> None:
        """``page`` stops being resident without going through the heap top."""
        page.heap_stamp = -1
        self.resident -= 1
        self.resident_bytes -= page.nbytes
        self.policy.left(page)

    def _evict(self, page: Page) -> None:
        self.resident -= 1
        self.resident_bytes -= page.nbytes
        self.evictions += 1
        if page is self.open_page:
            self.open_page = None
        if page.page_id in self.dirty:
            page.state = PENDING
            self.pending += 1
        else:
            if self.track_departures:
                self.departed.append(page.page_id)
            self._drop(page)

    def _drop(self, page: Page) -> None:
        """Forget a clean page that is not resident."""
        table = self.table
        for k in page.keys:
            if k is not EMPTY:
                del table[k]
        del self.pages[page.page_id]

    def install(self, page_id: int, slots: Sequence[int], keys: list[Any], values: list[Any],
                expires: list[float | None], nbytes: int = 0, *, resident: bool = True,
                warm_stamp: float | None = None) -> Page:
        """Take a page read from the store into memory: resident (a page
        fault), or pending (``resident=False``).

        :param slots, keys, values, expires: parallel sequences, one item per
            stored entry (``values`` in their memory form).
        :param nbytes: size of the stored page blob.
        :param resident: False: take the page in as pending instead, outside
            the LRU order (no eviction, no page fault counted). The caller
            must dirty it at once (the expiry sweep removes entries from it):
            only the write-behind takes a pending page out of memory again.
        :param warm_stamp: a warm restart's preload (:mod:`durablekv.warm`): no
            page fault is counted and the page is filed under this recency
            stamp (a float between two ticks, drawn by the caller), so
            preloaded pages keep their saved order and leave before any page
            used since. The caller makes room first: this install must evict
            nothing.
        """
        page = self._stored_page(page_id, slots, keys, values, expires, nbytes)
        if not resident:
            page.state = PENDING
            self.pending += 1
            return page
        if warm_stamp is not None:
            self.make_resident(page, warm_stamp)
            return page
        self.page_faults += 1
        self.policy.count_fault(page_id)
        self.make_resident(page)
        return page

    def _stored_page(self, page_id: int, slots: Sequence[int], keys: list[Any],
                     values: list[Any], expires: list[float | None], nbytes: int) -> Page:
        """Build the page object of a stored page (``install``'s arguments)
        and enter it and its keys in the page table; it is in no LRU order yet."""
        n = len(keys)
        if n == self.page_size and list(slots) == self._all_slots:
            page = self._new_page(page_id, n, (keys, values, expires))
        else:
            page = self._new_page(page_id, self.page_size)
            pk, pv, pe = page.keys, page.values, page.expires
            for slot, key, held, exp in zip(slots, keys, values, expires):
                pk[slot] = key
                pv[slot] = held
                pe[slot] = exp
            taken = set(slots)
            page.free_slots = [s for s in range(self.page_size - 1, -1, -1) if s not in taken]
        self.table.update(zip(keys, _entries(page, slots, values, expires)))
        page.used = n
        page.stored_n = n
        page.stored_ttl_n = n - expires.count(None)
        page.nbytes = nbytes
        self.pages[page_id] = page
        return page

    def fault_pending(self, page: Page) -> None:
        """Take a pending page back from the write-behind queue (a page fault)."""
        self.page_faults += 1
        self.policy.count_fault(page.page_id)
        self.make_resident(page)

    # -- changes ---------------------------------------------------------------

    def mark_dirty(self, page: Page, now: float, lsn: int) -> None:
        """Record a change to ``page`` made by the change with LSN ``lsn``."""
        page.version += 1
        if page.dirty_lsn is None:
            page.dirty_lsn = lsn
        if page.page_id not in self.dirty:
            self.dirty[page.page_id] = page
            page.dirty_since = now

    def _take_page(self, nbytes: int) -> Page:
        page = self.open_page
        if page is not None and page.used < self.page_size \
                and page.nbytes + nbytes <= self.page_bytes_limit:
            return page
        if self.free:
            pid = self.free.pop()
            page = self.pages.get(pid)
            if page is None:
                page = self._new_page(pid, self.page_size)
                self.pages[pid] = page
                self.make_resident(page)
            elif page.state == PENDING:
                self.make_resident(page)
        else:
            pid = self.next_page_id
            self.next_page_id += 1
            page = self._new_page(pid, self.page_size)
            self.pages[pid] = page
            self.make_resident(page)
        self.open_page = page
        return page

    def insert(self, key: Any, held: Any, expire_at: float | None, now: float, lsn: int,
               nbytes: int) -> Page:
        """Add a new key (not in the table) to the open page; return its page.

        :param nbytes: the entry's encoded size (key + value).
        """
        page = self._take_page(nbytes)
        page.nbytes += nbytes
        if page.state == RESIDENT:
            self.resident_bytes += nbytes
        slot = page.free_slots.pop()
        page.keys[slot] = key
        page.values[slot] = held
        page.expires[slot] = expire_at
        page.used += 1
        page.keys_version += 1
        self.table[key] = (page, slot, held if expire_at is None else HAS_TTL)
        self.mark_dirty(page, now, lsn)
        if page.state == RESIDENT:
            self.touch(page)
            if self.max_bytes is not None and self.resident_bytes > self.max_bytes:
                self.shrink(page)
        return page

    def insert_many(self, keys: Sequence[Any], held: Sequence[Any],
                    expires: Sequence[float | None], nbytes: Sequence[int], now: float,
                    lsn: int, start: int = 0, page_budget: int | None = None) -> int:
        """Add new keys (none of them in the table), as :meth:`insert` would one
        at a time from ``start`` on, but filling each page in one step.

        :param keys, held, expires, nbytes: parallel sequences, one item per
            key (``nbytes``: the entry's encoded size).
        :param lsn: the change's LSN (the pages' ``dirty_lsn`` if not dirty yet).
        :param page_budget: take at most this many pages (each one taken may
            evict one page, so this bounds the growth of the pending queue);
            None: no bound.
        :returns: the position after the last key inserted.
        """
        n = len(keys)
        i = start
        taken = 0
        table = self.table
        while i < n and (page_budget is None or taken < page_budget):
            if n - i >= 2 * self.page_size:
                end = self._fill_fresh_pages(keys, held, expires, nbytes, now, lsn, i,
                                             None if page_budget is None
                                             else page_budget - taken)
                if end > i:
                    taken += (end - i) // self.page_size
                    i = end
                    continue
            page = self._take_page(nbytes[i])
            taken += 1
            free = page.free_slots
            k = min(len(free), n - i)
            size = sum(nbytes[i:i + k])
            limit = self.page_bytes_limit
            if page.nbytes + size > limit:
                # Huge entries: fill the page one entry at a time, as insert() would
                # (the first entry always goes in: _take_page chose the page for it).
                k, size = 1, nbytes[i]
                while k < len(free) and i + k < n and \
                        page.nbytes + size + nbytes[i + k] <= limit:
                    size += nbytes[i + k]
                    k += 1
            cut = len(free) - k
            slots = free[cut:]
            del free[cut:]
            slots.reverse()  # the order insert()'s free_slots.pop() takes them in
            s0 = slots[0]
            end = i + k
            ks, vs, es = keys[i:end], held[i:end], expires[i:end]
            if slots == list(range(s0, s0 + k)):
                page.keys[s0:s0 + k] = ks
                page.values[s0:s0 + k] = vs
                page.expires[s0:s0 + k] = es
            else:
                pk, pv, pe = page.keys, page.values, page.expires
                for j, slot in enumerate(slots):
                    pk[slot] = ks[j]
                    pv[slot] = vs[j]
                    pe[slot] = es[j]
            table.update(zip(ks, _entries(page, slots, vs, es)))
            page.used += k
            page.nbytes += size
            page.keys_version += 1
            self.mark_dirty(page, now, lsn)
            if page.state == RESIDENT:
                self.resident_bytes += size
                self.touch(page)
                if self.max_bytes is not None and self.resident_bytes > self.max_bytes:
                    self.shrink(page)
            i = end
        return i

    def _fill_fresh_pages(self, keys: Sequence[Any], held: Sequence[Any],
                          expires: Sequence[float | None], nbytes: Sequence[int],
                          now: float, lsn: int, i: int, page_budget: int | None) -> int:
        """:meth:`insert_many`'s step for a run of whole pages that take fresh
        ids and evict nothing: build each page full (no per-slot stores) and
        the page-table entries of the whole run in one ``dict.update``.

        The state left is exactly the one the page-at-a-time loop leaves:
        the same page ids, slots, entries in the same table order, the same
        two LRU ticks per page (one when it becomes resident, under which its
        heap entry is filed, one for the touch after the fill), the same
        dirty order, byte counts and versions. It runs only where that loop
        would take a fresh id for every page and evict nothing: the LRU
        policy, an empty free list, no open page with room, the pages stay
        within ``max_pages`` (and ``max_bytes``) and each page's entries fit
        its byte limit, and ``keys``, ``held`` and ``expires`` are lists (a page
        keeps slices of them). Returns the position after the last key placed (``i``
        when it places none; the loop then goes on as before).
        """
        ps = self.page_size
        open_page = self.open_page
        if (not self.policy.bulk_admit or self.free or type(keys) is not list
                or type(held) is not list or type(expires) is not list
                or (open_page is not None and open_page.used < ps)):
            return i
        m = min((len(keys) - i) // ps, self.max_pages - self.resident)
        if page_budget is not None:
            m = min(m, page_budget)
        if m < 2:
            return i
        end = i + m * ps
        # each page's bytes (prefix sums); a page past the limit ends the run
        sums = list(accumulate(islice(nbytes, i, end), initial=0))
        sizes = [sums[j + ps] - sums[j] for j in range(0, m * ps, ps)]
        limit = self.page_bytes_limit
        if max(sizes) > limit:
            m = next(j for j, size in enumerate(sizes) if size > limit)
            if m < 2:
                return i
            del sizes[m:]
            end = i + m * ps
        if self.max_bytes is not None and \
                self.resident_bytes + sums[m * ps] > self.max_bytes:
            return i
        ks, vs, es = keys[i:end], held[i:end], expires[i:end]
        pid0 = self.next_page_id
        self.next_page_id = pid0 + m
        new_page = self._new_page
        pages: list[Page] = []
        stamps = list(islice(self.ticks, 2 * m))  # per page: resident, then the touch
        self.locked_ticks += 2 * m
        for j in range(m):
            a = j * ps
            page = new_page(pid0 + j, ps, (ks[a:a + ps], vs[a:a + ps], es[a:a + ps]))
            page.used = ps
            page.version = page.keys_version = 1
            page.dirty_lsn = lsn
            page.dirty_since = now
            page.nbytes = sizes[j]
            page.heap_stamp = stamps[2 * j]
            page.stamp = stamps[2 * j + 1]
            pages.append(page)
        pids = range(pid0, pid0 + m)
        self.pages.update(zip(pids, pages))
        self.dirty.update(zip(pids, pages))
        self.policy.admit_fresh(stamps[::2], pages)
        self.resident += m
        self.resident_bytes += sums[m * ps]
        if es.count(None) != len(es):
            vs = [h if e is None else HAS_TTL for h, e in zip(vs, es)]
        self.table.update(zip(ks, zip(chain.from_iterable(map(repeat, pages, repeat(ps, m))),
                                      chain.from_iterable(repeat(self._all_slots, m)), vs)))
        self.open_page = pages[-1]
        return end

    def fits(self, page: Page, nbytes: int) -> bool:
        """Whether an overwrite of ``nbytes`` keeps ``page`` within the byte
        limit of a page (:data:`PAGE_BYTES_LIMIT`, or ``max_bytes`` if lower)."""
        return page.nbytes + nbytes <= self.page_bytes_limit

    def update(self, page: Page, slot: int, held: Any, expire_at: float | None,
               now: float, lsn: int, nbytes: int) -> None:
        """Overwrite the entry in ``slot`` (the key stays as first stored)."""
        page.values[slot] = held
        if page.expires[slot] != expire_at:
            page.expires[slot] = expire_at
            page.keys_version += 1
        key = page.keys[slot]
        entry = self.table[key]
        if type(entry) is list:
            entry[2] = held if expire_at is None else HAS_TTL
        else:
            self.table[key] = [page, slot, held if expire_at is None else HAS_TTL]
        page.nbytes += nbytes
        self.mark_dirty(page, now, lsn)
        if page.state == RESIDENT:
            self.resident_bytes += nbytes
            if self.max_bytes is not None and self.resident_bytes > self.max_bytes:
                self.touch(page)  # the caller's page is the last to go
                self.shrink(page)

    def remove(self, key: Any, now: float, lsn: int) -> tuple[Page, int]:
        """Remove ``key`` (which must be in the table); return its old place."""
        page, slot, _ = self.table.pop(key)
        page.keys[slot] = EMPTY
        page.values[slot] = None
        page.expires[slot] = None
        page.used -= 1
        page.keys_version += 1
        page.free_slots.append(slot)
        self.mark_dirty(page, now, lsn)
        if page.used == 0 and page is not self.open_page:
            # An empty page needs no residency: it leaves the LRU (without
            # counting as an eviction) and its id goes to the free list. It is
            # still dirty: the batcher deletes its row.
            if page.state == RESIDENT:
                self._leave_residency(page)
                page.state = PENDING
                self.pending += 1
            self.free.append(page.page_id)
        return page, slot

    def clear(self) -> None:
        """Forget every page (the store is wiped separately)."""
        self.table.clear()
        self.pages.clear()
        self.policy.clear()
        self.resident = 0
        self.resident_bytes = 0
        self.departed.clear()
        self.dirty.clear()
        self.free.clear()
        self.open_page = None
        self.pending = 0

    # -- write-behind bookkeeping ----------------------------------------------

    def start_flush(self, page: Page) -> int | None:
        """Hand ``page``'s dirty LSN to a flush; return it."""
        page.flight_lsn = page.dirty_lsn
        page.dirty_lsn = None
        return page.flight_lsn

    def _stored(self, page: Page, keys_version: int, n: int, ttl_n: int) -> bool:
        """:meth:`flushed`'s first step, the store's view of ``page``; False
        when the page was forgotten meanwhile (``clear()``)."""
        page.stored_n = n
        page.stored_ttl_n = ttl_n
        page.stored_keys_version = keys_version
        page.flight_lsn = None
        return self.pages.get(page.page_id) is page

    def flush_failed(self, page: Page) -> None:
        """The flush of ``page`` did not commit: it is dirty since its old LSN."""
        if page.flight_lsn is not None:
            page.dirty_lsn = page.flight_lsn
        page.flight_lsn = None

    def flushed(self, page: Page, version: int, keys_version: int, n: int, ttl_n: int,
                nbytes: int) -> None:
        """Record that ``page`` at ``version`` is committed to the store."""
        if not self._stored(page, keys_version, n, ttl_n):
            return
        if page.version == version:
            if page.state == RESIDENT:
                self.resident_bytes += nbytes - page.nbytes
            page.nbytes = nbytes
            self.dirty.pop(page.page_id, None)
            page.dirty_since = None
            if page.state == PENDING:
                self.pending -= 1
                self._drop(page)
        else:
            # Changed while the flush was in flight: still dirty, and now the
            # most recently dirtied.
            self.dirty.pop(page.page_id, None)
            self.dirty[page.page_id] = page

