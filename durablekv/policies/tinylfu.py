"""``policy="tinylfu"``: W-TinyLFU over the memory tier's pages.

Pure data structures, no threads, no I/O. :class:`TinyLFU` is the policy
object (:class:`~durablekv.policies.base.EvictionPolicy`); the tier builds
its pages with :meth:`TinyLFU.page_factory`, so that every touch of a page
is counted in the frequency sketch.

W-TinyLFU, as in Caffeine (Einziger, Friedman, Manes, "TinyLFU: A Highly
Efficient Cache Admission Policy", ACM TOS 2017):

* a *window* LRU of about 1% of the capacity takes every new item;
* the rest is a segmented LRU, *probation* (20%) and *protected* (80%): an
  item hit in probation moves to protected; protected's overflow goes back
  to probation's MRU end;
* the window's share adapts (Caffeine's hill climber, :class:`WindowClimber`):
  every ``10 * capacity`` accesses the hit ratio of the last period is
  compared with the one before; the window keeps growing (or shrinking) by
  6.25% of the capacity while the hit ratio improves, turns round when it
  falls, and the step decays by 2% a period (back to 6.25% when the hit
  ratio moves by 5 points or more: the workload changed). A recency-heavy
  trace so gets a big window (LRU-like), a frequency-heavy one a small one;
* when the window overflows, its LRU item (the *candidate*) and
  probation's LRU item (the *victim*) are compared by their estimated
  frequency in a :class:`FrequencySketch`; the more frequent one stays in
  main, the other leaves memory. Ties go to the victim (Caffeine's rule: an
  incumbent is kept unless the candidate is strictly more frequent).

With a byte bound (the tier's ``max_bytes``, ``Cache(max_memory_bytes=)``)
the segments are weighed in bytes, as Caffeine weighs entries with a
weigher: the window and protected caps are bytes of ``max_bytes`` (the
climber steps by 6.25% of it, every 10 accesses per page of the most pages
resident so far, which also sets the sketch's aging sample), each segment
keeps its pages' byte total exact (a page's ``nbytes`` store updates it:
sets grow a resident page, a flush or a fault sets its exact size), and
when the tier is over a bound the window's overflow duels probation's LRU
pages until it fits. The same proportions of ``max_pages`` also cap the
segments, so a byte bound looser than the page bound leaves the page
split in charge. Without a byte bound everything is counted in pages.

At page granularity (the memory tier) the unit of residency is the page, so
the items are pages and the sketch counts *accesses per page* (keyed by page
id): every get, set or insert that touches a page counts once for it. A page
stays or goes as a whole, so the number to compare is how often the whole
page is used, which is the sum of its entries' accesses; counting entries
separately would need a per-page sum of 16 estimates at every admission and
would credit a page for entries that have moved out of it. Page ids come
back through the free list; a reused id inherits the old page's counts
until aging halves them away.

Threads: the cache's lock-free memory hit increments the sketch without the
lock. Two increments at once can lose one count, and an increment during a
halving can land in the old counters; both only make an estimate a little
low, which admission tolerates. Everything else here runs under the cache
lock.
"""

from __future__ import annotations

from functools import partial
from heapq import heapify, heappop, heappush, heapreplace
from typing import Any, Callable, Hashable

__all__ = ["FrequencySketch", "TinyLFU", "WindowClimber", "counted_page_class",
           "window_split"]

#: ``bytes.translate`` table halving every counter (the sketch's aging).
_HALVE = bytes(i >> 1 for i in range(256))


def window_split(capacity: int) -> tuple[int, int]:
    """``(window, protected)`` sizes for ``capacity`` items: the window about
    1% (at least 1), protected 80% of the rest (probation takes the remainder)."""
    window = max(1, capacity // 100)
    main = max(0, capacity - window)
    return window, (main * 4) // 5


class FrequencySketch:
    """Count-Min sketch of 4-bit counters with periodic halving (TinyLFU).

    Four rows of ``width`` counters (``width`` the power of two at or above
    ``capacity``, at least 16), one byte each but saturating at 15 (4 bits'
    worth: a frequency above 15 does not change an admission). After
    ``sample = 10 * capacity`` increments every counter is halved (aging), so
    the estimate follows a changing popularity.

    :param capacity: items the cache holds (>= 1): sizes the sketch.
    :raises ValueError: ``capacity < 1``.
    """

    __slots__ = ("width", "mask", "counters", "sample", "additions", "resets", "total")

    MAX = 15

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity={capacity!r}: a frequency sketch needs capacity >= 1")
        width = 16
        while width < capacity:
            width <<= 1
        self.width = width
        self.mask = width - 1
        self.counters = bytearray(4 * width)
        self.sample = 10 * capacity
        self.additions = 0
        self.resets = 0
        self.total = 0      # increments ever (not aged): the accesses seen

    def _indexes(self, key: Hashable) -> tuple[int, int, int, int]:
        # One C call mixes the key: a tuple's hash runs xxHash rounds over its
        # items' hashes (an int hashes to itself, so structured int keys need
        # it); then double hashing h + i*g, one index per row.
        h = hash((key, 0x9E3779B9))
        g = (h >> 32) | 1
        m, w = self.mask, self.width
        return (h & m, w + ((h + g) & m), 2 * w + ((h + 2 * g) & m), 3 * w + ((h + 3 * g) & m))

    def increment(self, key: Hashable) -> None:
        """Count one access to ``key``; halve every counter every ``sample`` accesses."""
        c = self.counters
        h = hash((key, 0x9E3779B9))     # _indexes, inlined: this is a memory hit's cost
        g = (h >> 32) | 1
        m, w = self.mask, self.width
        for i in (h & m, w + ((h + g) & m), 2 * w + ((h + 2 * g) & m),
                  3 * w + ((h + 3 * g) & m)):
            if c[i] < 15:
                c[i] += 1
        self.additions += 1
        self.total += 1
        if self.additions >= self.sample:
            self.reset()

    def frequency(self, key: Hashable) -> int:
        """Estimated accesses to ``key`` (0..15), never below the true count since
        the last halving (Count-Min: the minimum over the four rows)."""
        c = self.counters
        a, b, d, e = self._indexes(key)
        return min(c[a], c[b], c[d], c[e])

    def reset(self) -> None:
        """Age the sketch: halve every counter (and the addition count)."""
        self.counters = bytearray(self.counters.translate(_HALVE))
        self.additions //= 2
        self.resets += 1


class WindowClimber:
    """The window's size, tuned by hill climbing on the hit ratio (Caffeine's
    simple climber): see the module docstring.

    :param capacity: items the cache holds (>= 1), or bytes for a weighted
        cache (the window and its steps are then bytes).
    :param period: accesses per sample (default ``10 * capacity``; a weighted
        cache passes its own and moves it as the pages it holds grow).
    """

    STEP = 0.0625        # of the capacity
    DECAY = 0.98
    RESTART = 0.05       # a hit-ratio change this big restarts the step

    def __init__(self, capacity: int, period: int | None = None) -> None:
        self.capacity = capacity
        self.window = float(window_split(capacity)[0])
        self.initial_step = self.STEP * capacity
        self.step = self.initial_step
        self.period = 10 * capacity if period is None else period
        self.previous = 0.0
        self.base_accesses = self.base_misses = 0
        self.adjustments = 0

    def caps(self) -> tuple[int, int]:
        """``(window, protected)`` sizes now."""
        window = int(self.window)
        return window, ((self.capacity - window) * 4) // 5

    def observe(self, accesses: int, misses: int) -> bool:
        """Running totals of accesses and misses; True if the window changed."""
        n = accesses - self.base_accesses
        if n < self.period:
            return False
        rate = max(0.0, 1.0 - (misses - self.base_misses) / n)
        change = rate - self.previous
        if change < 0:
            self.step = -self.step
        top = max(1.0, self.capacity - 1.0)
        self.window = min(max(1.0, self.window + self.step), top)
        if abs(change) >= self.RESTART:
            self.step = self.initial_step if self.step > 0 else -self.initial_step
        else:
            self.step *= self.DECAY
        self.previous = rate
        self.base_accesses, self.base_misses = accesses, misses
        self.adjustments += 1
        return True


WINDOW, PROBATION, PROTECTED = 0, 1, 2
#: ``page.seg`` of a page in no segment (not resident, or a candidate being
#: weighed in :meth:`TinyLFU._evict_weighted`); its byte changes land in the
#: fourth item of :attr:`TinyLFU.weights`, which nothing reads.
NONE = 3


class _NoCount:
    __slots__ = ()

    def increment(self, key: Hashable) -> None:
        pass


_NO_COUNT = _NoCount()


def counted_page_class(page_cls: type, weighted: bool = False) -> type:
    """A subclass of the memory tier's page class whose ``stamp`` store also
    counts the access in the page's frequency sketch.

    The cache's hot path touches a page with ``page.stamp = tick``; under
    ``"tinylfu"`` that store becomes this property, so every get, set and
    insert is counted without a line of the cache changing, and under
    ``"lru"`` (plain pages) a memory hit stays one attribute store.

    :param weighted: also make ``nbytes`` a property whose store adds the
        change to the byte total of the page's segment (``weights[page.seg]``,
        the :attr:`TinyLFU.weights` list the page is built with), so that
        every writer of ``nbytes`` (insert, overwrite, the cache's inlined
        overwrite, a flush's exact size) keeps the segments' byte totals
        exact without knowing about them. Only with a byte bound: a memory
        hit does not store ``nbytes``, and without one sets stay a plain
        store.
    """
    slot = page_cls.__dict__["stamp"]
    get, put = slot.__get__, slot.__set__

    class CountedPage(page_cls):  # type: ignore[misc, valid-type]
        __slots__ = ("sketch", "seg")

        def __init__(self, page_id: int, page_size: int, full: Any = None, *,
                     sketch: FrequencySketch) -> None:
            self.sketch = _NO_COUNT   # building a page is not an access
            self.seg = NONE
            super().__init__(page_id, page_size, full)
            self.sketch = sketch

        @property
        def stamp(self) -> int:
            return get(self)

        @stamp.setter
        def stamp(self, tick: int) -> None:
            self.sketch.increment(self.page_id)
            put(self, tick)

        def set_stamp_uncounted(self, tick: int) -> None:
            put(self, tick)

    cls: type = CountedPage
    if weighted:
        nb = page_cls.__dict__["nbytes"]
        get_nb, put_nb = nb.__get__, nb.__set__

        class WeightedPage(CountedPage):
            __slots__ = ("weights",)

            def __init__(self, page_id: int, page_size: int, full: Any = None, *,
                         sketch: FrequencySketch, weights: list[int]) -> None:
                self.weights = weights
                put_nb(self, 0)
                super().__init__(page_id, page_size, full, sketch=sketch)

            def _set_nbytes(self, n: int) -> None:
                self.weights[self.seg] += n - get_nb(self)
                put_nb(self, n)

            # the slot's own getter, no Python frame: a read costs about what it did
            nbytes = property(get_nb, _set_nbytes)

        cls = WeightedPage
    cls.__qualname__ = cls.__name__ = f"{'Weighted' if weighted else 'Counted'}{page_cls.__name__}"
    return cls


class TinyLFU:
    """W-TinyLFU victim choice for a memory tier's resident pages.

    Segments are min-heaps of ``(filed stamp, page)`` with the tier's lazy
    promotion: a page touched since it was filed has a newer ``stamp``, seen
    when it surfaces at its heap's top. A page that surfaces in probation
    with a newer stamp was hit there: it moves to protected (Caffeine moves
    it at the hit; here the move waits until it would otherwise be the
    victim, so a lock-free hit stays a store). Protected's overflow goes to
    probation's MRU end under a fresh tick.

    With a byte bound (``tier.max_bytes`` set) the segments are *weighted*,
    as Caffeine's are with a weigher: ``weights`` holds each segment's bytes
    (``page.nbytes`` summed, kept exact by the pages themselves, see
    :func:`counted_page_class`), the window and protected caps are bytes of
    ``max_bytes`` (the climber moves a byte split) and, in the same
    proportions, pages of ``max_pages`` (a segment is over when it passes
    either, so a loose byte bound leaves the page split in charge), and
    eviction is :meth:`_evict_weighted`: the window's overflow becomes
    candidates that duel probation's LRU pages for as long as the tier is
    over a bound. Without one, everything is counted in pages as before.

    The tier keeps counting ``resident``; this object keeps the segments and
    calls ``tier._evict(page)`` for every page it chooses to leave. The page
    being admitted is never the one that leaves, so a caller can use a page
    right after ``make_resident``.

    :param tier: the :class:`~durablekv.tier.pages.MemoryTier` (reads ``max_pages``,
        ``max_bytes``, ``ticks``, ``resident``; calls ``_evict``).
    """

    bulk_admit = False

    def __init__(self, tier: Any) -> None:
        self.tier = tier
        self.weighted = tier.max_bytes is not None
        self.heaps: tuple[list, list, list] = ([], [], [])
        self.sizes = [0, 0, 0]
        #: bytes per segment (window, probation, protected; the fourth item
        #: takes the changes of pages in no segment): exact when weighted
        self.weights = [0, 0, 0, 0]
        self.sketch = FrequencySketch(tier.max_pages)
        self.misses = 0     # admissions (new or faulted pages)
        self.admitted = 0   # duels a candidate won (its victim left memory)
        self.rejected = 0   # candidates that lost (left memory from the window)
        if self.weighted:
            # Caffeine sizes a weighted cache's sketch, and so its aging
            # sample and the climber's period, by the entries it holds: here
            # 10 accesses per page of the most pages resident so far (the
            # sketch's width stays sized for max_pages).
            self.most_resident = 1
            self.sketch.sample = 10
            self.climber = WindowClimber(tier.max_bytes, period=10)
            self._set_caps()
        else:
            self.climber = WindowClimber(tier.max_pages)
            self.window_cap, self.protected_cap = self.climber.caps()

    def _set_caps(self) -> None:
        """Caps from the climber: bytes, and pages in the same proportion."""
        self.window_cap, self.protected_cap = self.climber.caps()
        max_pages, max_bytes = self.tier.max_pages, self.tier.max_bytes
        self.window_pages = max(1, self.window_cap * max_pages // max_bytes)
        self.protected_pages = ((max_pages - self.window_pages) * 4) // 5

    def _file(self, page: Any, seg: int, stamp: int) -> None:
        page.seg = seg
        page.heap_stamp = stamp
        heappush(self.heaps[seg], (stamp, page))
        self.sizes[seg] += 1
        self.weights[seg] += page.nbytes

    def _unfile(self, page: Any) -> None:
        """Count ``page`` out of its segment (its heap entry goes stale)."""
        seg = page.seg
        self.sizes[seg] -= 1
        self.weights[seg] -= page.nbytes
        page.seg = NONE

    def _peek(self, seg: int) -> Any:
        """The LRU page of segment ``seg`` (left in place), or None if it is empty."""
        heap = self.heaps[seg]
        while heap:
            filed, page = heap[0]
            if page.heap_stamp != filed or page.seg != seg:
                heappop(heap)   # left residency (or the segment) after it was filed
                continue
            stamp = page.stamp
            if stamp == filed:
                return page
            if seg == PROBATION:
                heappop(heap)   # hit while in probation: promote
                self._unfile(page)
                self._file(page, PROTECTED, stamp)
                self._demote()
            else:
                page.heap_stamp = stamp
                heapreplace(heap, (stamp, page))
        return None

    def _take(self, seg: int) -> Any:
        page = self._peek(seg)
        if page is not None:
            heappop(self.heaps[seg])
            self._unfile(page)
            page.heap_stamp = -1
        return page

    def _protected_over(self) -> bool:
        if self.weighted:
            return (self.weights[PROTECTED] > self.protected_cap
                    or self.sizes[PROTECTED] > self.protected_pages)
        return self.sizes[PROTECTED] > self.protected_cap

    def _demote(self) -> None:
        while self._protected_over():
            page = self._take(PROTECTED)
            if page is None:
                break
            tick = next(self.tier.ticks)
            self.tier.locked_ticks += 1
            page.set_stamp_uncounted(tick)
            self._file(page, PROBATION, tick)

    def _leave(self, page: Any) -> None:
        """Evict ``page`` (already out of its heap) through the tier."""
        self.tier._evict(page)

    def page_factory(self, page_cls: type) -> Callable[..., Any]:
        """Pages whose ``stamp`` store counts the access in :attr:`sketch`
        (and, with a byte bound, whose ``nbytes`` store keeps :attr:`weights`)."""
        if self.weighted:
            return partial(counted_page_class(page_cls, weighted=True),
                           sketch=self.sketch, weights=self.weights)
        return partial(counted_page_class(page_cls), sketch=self.sketch)

    def count_fault(self, page_id: int) -> None:
        self.sketch.increment(page_id)

    def admit_fresh(self, stamps: Any, pages: Any) -> None:
        raise TypeError("TinyLFU admits one page at a time (bulk_admit is False)")

    def admit(self, page: Any, stamp: float) -> None:
        """``page`` just became resident (the tier counted it in ``resident``):
        file it in the window under ``stamp`` and evict until the tier fits.
        Becoming resident is not an access: a fault counts its access
        (:meth:`count_fault`), a new page the insert that follows."""
        page.set_stamp_uncounted(stamp)
        page.heap_stamp = stamp
        self._admit(page)
        if self.heap_entries() > 2 * self.tier.resident + 64:
            self.rebuild()

    def _admit(self, page: Any) -> None:
        self._file(page, WINDOW, page.heap_stamp)
        tier = self.tier
        sketch = self.sketch
        self.misses += 1
        if self.weighted:
            if tier.resident > self.most_resident:
                self.most_resident = tier.resident
                sketch.sample = self.climber.period = 10 * tier.resident
            if self.climber.observe(sketch.total, self.misses):
                self._set_caps()
            self._evict_weighted(page)
            return
        if self.climber.observe(sketch.total, self.misses):
            self.window_cap, self.protected_cap = self.climber.caps()
            self._demote()
        while self.sizes[WINDOW] > self.window_cap:
            cand = self._take(WINDOW)
            if not tier.over():
                self._file(cand, PROBATION, cand.stamp)
                continue
            victim = self._peek(PROBATION)
            seg = PROBATION
            if victim is None:
                victim, seg = self._peek(PROTECTED), PROTECTED
            if victim is None:
                self._leave(cand)
                self.rejected += 1
            elif sketch.frequency(cand.page_id) > sketch.frequency(victim.page_id):
                self._take(seg)
                self._leave(victim)
                self._file(cand, PROBATION, cand.stamp)
                self.admitted += 1
            else:
                self._leave(cand)
                self.rejected += 1
        # only the window can overfill the page bound; the byte bound
        # (tier.max_bytes) can be passed by a big page coming in
        self._shrink_lru(page)

    def _evict_weighted(self, keep: Any) -> None:
        """Caffeine's ``evictEntries`` for weighted segments: demote
        protected's overflow; if the tier is over a bound, take the window's
        LRU pages (never ``keep``) as candidates while the window is over
        its caps; then, while the tier is still over, the oldest candidate
        duels probation's LRU page (protected's when probation is empty; never
        ``keep``) by sketch frequency and the loser leaves memory (on a tie,
        with no victim, or when the candidate alone passes ``max_bytes``,
        the candidate leaves; a winner duels the next victim). Candidates
        left go to probation; if the tier is still over, pages leave by
        :meth:`_shrink_lru`."""
        tier = self.tier
        sketch = self.sketch
        weights, sizes = self.weights, self.sizes
        self._demote()
        if not tier.over():
            # A page comes in empty and fills with the inserts that follow,
            # so the window's overflow waits there until the bytes are over;
            # moving it to probation now would skip its duel.
            return
        cands = []
        while weights[WINDOW] > self.window_cap or sizes[WINDOW] > self.window_pages:
            cand = self._take(WINDOW)
            if cand is None:
                break
            if cand is keep:
                self._file(keep, WINDOW, keep.stamp)   # nothing older left in the window
                break
            cands.append(cand)
        i = 0
        held = None     # the segment keep was taken out of, while it was a victim
        while i < len(cands) and tier.over():
            cand = cands[i]
            for seg in (PROBATION, PROTECTED):
                victim = self._peek(seg)
                if victim is not None and victim is keep:
                    self._take(seg)
                    held = seg
                    victim = self._peek(seg)
                if victim is not None:
                    break
            if (victim is None or cand.nbytes > tier.max_bytes
                    or sketch.frequency(cand.page_id) <= sketch.frequency(victim.page_id)):
                self._leave(cand)
                self.rejected += 1
                i += 1
            else:
                self._take(seg)
                self._leave(victim)
                self.admitted += 1
        for cand in cands[i:]:
            self._file(cand, PROBATION, cand.stamp)
        if held is not None:
            self._file(keep, held, keep.stamp)
        self._shrink_lru(keep)

    def shrink(self, keep: Any = None) -> None:
        """Evict while the tier is over a bound (``keep`` never: the page a
        caller uses). Weighted: :meth:`_evict_weighted` (a set that grows a
        page can take the window past its cap); else :meth:`_shrink_lru`."""
        if self.weighted:
            self._evict_weighted(keep)
        else:
            self._shrink_lru(keep)

    def _shrink_lru(self, keep: Any = None) -> None:
        """Evict while the tier is over a bound: probation's LRU page first,
        then protected's, then the window's (``keep`` never; the page a
        caller uses, and the one being admitted)."""
        tier = self.tier
        while tier.over():
            for seg in (PROBATION, PROTECTED, WINDOW):
                victim = self._take(seg)
                if victim is not None and victim is not keep:
                    self._leave(victim)
                    break
                if victim is keep and victim is not None:
                    self._file(keep, seg, keep.stamp)
                    # keep is the only page left in seg: try the next segment
            else:
                break

    def left(self, page: Any) -> None:
        """``page`` left residency outside the heaps (it became empty)."""
        self._unfile(page)

    def order(self) -> list[Any]:
        """Resident pages, next victim-side first within each segment (window,
        probation, protected): for tests and introspection."""
        out = []
        for seg in (WINDOW, PROBATION, PROTECTED):
            live = [(p.stamp, p.page_id, p) for s, p in self.heaps[seg]
                    if p.heap_stamp == s and p.seg == seg]
            out.extend(p for _, _, p in sorted(live, key=lambda t: t[:2]))
        return out

    def rebuild(self) -> None:
        """Drop stale heap entries (O(resident pages))."""
        for seg, heap in enumerate(self.heaps):
            live = [(s, p) for s, p in heap if p.heap_stamp == s and p.seg == seg]
            heapify(live)
            heap[:] = live

    def heap_entries(self) -> int:
        return sum(map(len, self.heaps))

    def clear(self) -> None:
        for heap in self.heaps:
            for _, page in heap:
                page.seg = NONE     # a forgotten page's later nbytes stores count nowhere
            heap.clear()
        self.sizes = [0, 0, 0]
        self.weights[:] = [0, 0, 0, 0]   # in place: the pages hold this list
