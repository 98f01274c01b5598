"""Cache simulators over a request list: LRU, durablekv's page-LRU, Belady's OPT.

All count the same thing: a request whose op is ``get`` and whose key is
resident is a hit; every request (get or set) is an access, and an access
to a key that is not resident brings it in (demand paging: the missed key is
always inserted). The hit ratio is hits / gets; for the read-only traces that
is hits / requests, the definition of ../shared/traces/README.md, whose
reference numbers :data:`REFERENCE` repeats for the self-check in ``--full``
mode. Deletes remove the key.

``page_lru`` follows durablekv's memory tier exactly (DESIGN.md, pages.py):
new keys fill the *open page* in arrival order; recency is per page; a page
coming in (new or faulted back) evicts the least recently used one; when
the open page is evicted the next new key starts a new page. With
``page_size=1`` it is exactly ``lru``. The macro case checks that durablekv's
measured memory hits equal this simulation's hits.
"""

from __future__ import annotations

import heapq
import itertools
import os
from collections import OrderedDict
from typing import Any, NamedTuple, Sequence

GET, SET, DELETE = 0, 1, 2
_OPS = {"get": GET, "set": SET, "delete": DELETE}

#: Reference (whole trace, slots) -> (LRU hits, OPT hits), from ../shared/traces/README.md.
REFERENCE = {
    ("arc_OLTP.lis", 1869): (380_653, 546_324),
    ("arc_OLTP.lis", 18688): (608_101, 696_639),
    ("cache2k_orm-busy.i32be", 763): (3_851_698, 4_141_226),
    ("cache2k_orm-busy.i32be", 7635): (4_400_401, 4_665_403),
    ("scarab_recs.i64be", 2584): (432_205, 664_311),
    ("scarab_recs.i64be", 25837): (754_547, 934_319),
}


class Requests(NamedTuple):
    """A trace (or its prefix) held in memory as parallel lists."""

    name: str
    ops: list[int]          # GET / SET / DELETE
    keys: list[Any]
    sizes: list[int]        # value bytes (0: the trace has none)
    unique: int
    gets: int
    whole: bool             # the whole trace, not a prefix


def load(path: str | os.PathLike, limit: int | None) -> Requests:
    """Read ``limit`` requests (None: all) of a trace through durablekv's readers."""
    from durablekv.traces import open_trace
    trace = open_trace(path)
    ops: list[int] = []
    keys: list[Any] = []
    sizes: list[int] = []
    it = iter(trace)
    src = it if limit is None else itertools.islice(it, limit)
    for op, key, size, _ttl, _t in src:
        ops.append(_OPS[op])
        keys.append(key)
        sizes.append(size)
    whole = limit is None or len(keys) < limit or next(it, None) is None
    return Requests(os.path.basename(os.fspath(path)), ops, keys, sizes, len(set(keys)),
                    ops.count(GET), whole)


def slots_for(req: Requests, fraction: float) -> int:
    """Memory size in entries: ``fraction`` of the unique keys, rounded (at least 1)."""
    return max(1, round(req.unique * fraction))


def lru(req: Requests, slots: int) -> int:
    """Get hits of an entry-level LRU of ``slots`` entries (an OrderedDict)."""
    od: OrderedDict[Any, None] = OrderedDict()
    move, pop = od.move_to_end, od.popitem
    hits = 0
    for op, k in zip(req.ops, req.keys):
        if op == DELETE:
            od.pop(k, None)
        elif k in od:
            move(k)
            if op == GET:
                hits += 1
        else:
            od[k] = None
            if len(od) > slots:
                pop(False)
    return hits


def page_lru(req: Requests, page_size: int, max_pages: int) -> dict[str, int]:
    """durablekv's memory tier on a look-aside replay (no deletes, no TTLs).

    Returns ``memory_hits``, ``store_hits``, ``misses`` (gets) and ``page_faults``.
    """
    return _pages(req, page_size, _PageLRU(max_pages), "page_lru")


class _PageLRU:
    """LRU of page ids (an OrderedDict), with :class:`_WTinyLFU`'s interface."""

    def __init__(self, max_pages: int) -> None:
        self.max_pages = max_pages
        self.od: OrderedDict[int, None] = OrderedDict()

    def access(self, p: int) -> bool:
        if p in self.od:
            self.od.move_to_end(p)
            return True
        return False

    def admit(self, p: int) -> list[int]:
        od = self.od
        od[p] = None
        out = []
        while len(od) > self.max_pages:
            out.append(od.popitem(False)[0])
        return out

    def born(self, p: int) -> None:
        """A new page is made for the open page's successor."""


def _pages(req: Requests, page_size: int, pol: Any, name: str) -> dict[str, int]:
    """The memory tier's page loop under the policy ``pol`` (access / admit / born)."""
    if DELETE in req.ops:
        raise ValueError(f"{name} does not model deletes (the free list)")
    access, admit = pol.access, pol.admit
    page_of: dict[Any, int] = {}
    open_page, open_used, next_id = -1, page_size, 0
    mem = store = miss = faults = 0
    for op, k in zip(req.ops, req.keys):
        p = page_of.get(k)
        if p is not None:
            if access(p):
                if op == GET:
                    mem += 1
                continue
            faults += 1
            if op == GET:
                store += 1
            if open_page in admit(p):   # fault the page back in, at the MRU end
                open_page, open_used = -1, page_size
            continue
        if op == GET:
            miss += 1                   # look-aside: a miss is followed by a set
        if open_used >= page_size:      # the open page is full (or was evicted)
            open_page, open_used = next_id, 0
            next_id += 1
            pol.born(open_page)
            admit(open_page)   # the new page is the MRU (window's MRU): never the one out
        else:
            access(open_page)
        page_of[k] = open_page
        open_used += 1
    return {"memory_hits": mem, "store_hits": store, "misses": miss, "page_faults": faults}


def opt(req: Requests, slots: int) -> int:
    """Get hits of Belady's OPT with demand paging (evict the resident key whose
    next access is farthest away; the missed key is always inserted)."""
    ids: dict[Any, int] = {}
    seq = [ids.setdefault(k, len(ids)) for k in req.keys]
    n = len(seq)
    nxt = [0] * n
    last: dict[int, int] = {}
    for i in range(n - 1, -1, -1):
        k = seq[i]
        # never used again: n + i keeps every "never" distinct (no ties)
        nxt[i] = last.get(k, n + i)
        last[k] = i
    resident: dict[int, int] = {}       # key id -> its next access
    heap: list[tuple[int, int]] = []    # (-next access, key id), lazily invalidated
    push, pop = heapq.heappush, heapq.heappop
    hits = 0
    ops = req.ops
    for i in range(n):
        k = seq[i]
        if ops[i] == DELETE:
            resident.pop(k, None)
            continue
        if k in resident:
            if ops[i] == GET:
                hits += 1
        elif len(resident) >= slots:
            while True:
                neg, victim = pop(heap)
                if resident.get(victim) == -neg:
                    del resident[victim]
                    break
        resident[k] = nxt[i]
        push(heap, (-nxt[i], k))
        if len(heap) > 4 * slots + 1024:   # drop stale entries now and then
            heap = [(-v, key) for key, v in resident.items()]
            heapq.heapify(heap)
    return hits


def curves(req: Requests, fractions: Sequence[float], page_sizes: Sequence[int],
           rehome: Sequence[int] = (), midpoint: Sequence[int] = ()) -> dict[str, Any]:
    """Hit ratios for the plots and docs/policy.md: entry-level LRU, W-TinyLFU
    and OPT, and durablekv's memory tier per page size under ``policy="lru"``
    (``page_lru``) and ``policy="tinylfu"`` (``page_tinylfu``); for the page
    sizes in ``rehome`` also page-LRU with re-homing (``page_rehome``), and for
    those in ``midpoint`` partial pages with midpoint insertion
    (``page_midpoint``, with its ``page_faults`` beside page-LRU's in
    ``faults_midpoint`` / ``faults_page_lru``)."""
    out: dict[str, Any] = {"fractions": list(fractions), "slots": [], "lru": [], "opt": [],
                           "tinylfu": [],
                           "page_lru": {str(ps): [] for ps in page_sizes},
                           "page_tinylfu": {str(ps): [] for ps in page_sizes},
                           "page_rehome": {str(ps): [] for ps in rehome},
                           "page_midpoint": {str(ps): [] for ps in midpoint},
                           "faults_page_lru": {str(ps): [] for ps in midpoint},
                           "faults_midpoint": {str(ps): [] for ps in midpoint}}
    gets = max(req.gets, 1)
    for f in fractions:
        slots = slots_for(req, f)
        out["slots"].append(slots)
        out["lru"].append(lru(req, slots) / gets)
        out["opt"].append(opt(req, slots) / gets)
        out["tinylfu"].append(tinylfu(req, slots) / gets)
        for ps in page_sizes:
            pages = -(-slots // ps)
            out["page_lru"][str(ps)].append(page_lru(req, ps, pages)["memory_hits"] / gets)
            out["page_tinylfu"][str(ps)].append(
                page_tinylfu(req, ps, pages)["memory_hits"] / gets)
        for ps in rehome:
            out["page_rehome"][str(ps)].append(
                page_rehome(req, ps, -(-slots // ps))["memory_hits"] / gets)
        for ps in midpoint:
            pages = -(-slots // ps)
            m = page_midpoint(req, ps, pages)
            out["page_midpoint"][str(ps)].append(m["memory_hits"] / gets)
            out["faults_midpoint"][str(ps)].append(m["page_faults"])
            out["faults_page_lru"][str(ps)].append(page_lru(req, ps, pages)["page_faults"])
    return out

class _WTinyLFU:
    """W-TinyLFU over hashable items (keys or page ids), OrderedDict segments,
    the same policy as :class:`durablekv.policy` describes and the memory
    tier's ``policy="tinylfu"`` runs."""

    def __init__(self, capacity: int) -> None:
        from durablekv.policies.tinylfu import FrequencySketch, WindowClimber
        self.cap = capacity
        self.climber = WindowClimber(capacity)
        self.wcap, self.pcap = self.climber.caps()
        self.misses = 0
        self.window: OrderedDict[Any, None] = OrderedDict()
        self.probation: OrderedDict[Any, None] = OrderedDict()
        self.protected: OrderedDict[Any, None] = OrderedDict()
        self.sketch = FrequencySketch(capacity)

    def access(self, x: Any) -> bool:
        """Count an access to ``x``; True (and recency updated) if resident."""
        self.sketch.increment(x)
        if x in self.window:
            self.window.move_to_end(x)
        elif x in self.protected:
            self.protected.move_to_end(x)
        elif x in self.probation:
            del self.probation[x]
            self.protected[x] = None
            if len(self.protected) > self.pcap:
                self.probation[self.protected.popitem(False)[0]] = None
        else:
            return False
        return True

    def born(self, p: Any) -> None:
        """A new page: its first insert counts as an access."""
        self.sketch.increment(p)

    def remove(self, x: Any) -> None:
        for seg in (self.window, self.probation, self.protected):
            seg.pop(x, None)

    def admit(self, x: Any) -> list[Any]:
        """Bring ``x`` in (at the window's MRU end); return the items that left."""
        self.misses += 1
        if self.climber.observe(self.sketch.total, self.misses):
            self.wcap, self.pcap = self.climber.caps()
            while len(self.protected) > self.pcap:
                self.probation[self.protected.popitem(False)[0]] = None
        self.window[x] = None
        out: list[Any] = []
        if len(self.window) <= self.wcap:
            return out
        cand = self.window.popitem(False)[0]
        if len(self.window) + len(self.probation) + len(self.protected) < self.cap:
            self.probation[cand] = None
            return out
        seg = self.probation or self.protected
        if not seg:                      # capacity 1: all window
            out.append(cand)
            return out
        victim = next(iter(seg))
        if self.sketch.frequency(cand) > self.sketch.frequency(victim):
            del seg[victim]
            self.probation[cand] = None
            out.append(victim)
        else:
            out.append(cand)
        return out


def tinylfu(req: Requests, slots: int) -> int:
    """Get hits of an entry-level W-TinyLFU of ``slots`` entries."""
    pol = _WTinyLFU(slots)
    access, admit = pol.access, pol.admit
    hits = 0
    for op, k in zip(req.ops, req.keys):
        if op == DELETE:
            pol.remove(k)
        elif access(k):
            if op == GET:
                hits += 1
        else:
            admit(k)
    return hits


def page_tinylfu(req: Requests, page_size: int, max_pages: int) -> dict[str, int]:
    """:func:`page_lru` with the memory tier's ``policy="tinylfu"``: W-TinyLFU over
    pages, the sketch counting accesses per page. Same counts returned."""
    return _pages(req, page_size, _WTinyLFU(max_pages), "page_tinylfu")


def page_rehome(req: Requests, page_size: int, max_pages: int) -> dict[str, int]:
    """:func:`page_lru` plus re-homing: when a page is evicted, its entries hit
    since they were last placed (faulted in, inserted or re-homed) move into
    the open page and stay in memory; the others leave with the page. Pages
    stay the unit of I/O (a fault reads the whole page). Same counts returned,
    plus ``rehomed`` (entries moved)."""
    if DELETE in req.ops:
        raise ValueError("page_rehome does not model deletes (the free list)")
    page_of: dict[Any, int] = {}
    members: dict[int, set[Any]] = {}
    hot: set[Any] = set()                # entries hit since placed
    resident: OrderedDict[int, None] = OrderedDict()
    move, popfirst = resident.move_to_end, resident.popitem
    state = {"open": -1, "used": page_size, "next": 0}
    mem = store = miss = faults = rehomed = 0

    def new_page() -> None:
        state["open"], state["used"] = state["next"], 0
        state["next"] += 1
        members[state["open"]] = set()
        resident[state["open"]] = None

    def place(k: Any) -> None:
        if state["used"] >= page_size:
            new_page()
        p = state["open"]
        page_of[k] = p
        members[p].add(k)
        state["used"] += 1
        move(p)

    def shrink() -> None:
        nonlocal rehomed
        while len(resident) > max_pages:
            victim = popfirst(False)[0]
            if victim == state["open"]:
                state["open"], state["used"] = -1, page_size
            keep = [k for k in members[victim] if k in hot]
            for k in keep:
                hot.discard(k)
                members[victim].discard(k)
                place(k)
            rehomed += len(keep)

    for op, k in zip(req.ops, req.keys):
        p = page_of.get(k)
        if p is not None:
            if p in resident:
                move(p)
                hot.add(k)
                if op == GET:
                    mem += 1
                continue
            faults += 1
            if op == GET:
                store += 1
            for m in members[p]:
                hot.discard(m)
            hot.add(k)
            resident[p] = None
            shrink()
            continue
        if op == GET:
            miss += 1
        place(k)
        shrink()
    return {"memory_hits": mem, "store_hits": store, "misses": miss, "page_faults": faults,
            "rehomed": rehomed}


#: Share of the entry budget :func:`page_midpoint` keeps as its *old* sublist,
#: InnoDB's default (``innodb_old_blocks_pct=37``, i.e. 3/8 of the LRU list).
OLD_FRACTION = 3 / 8


def page_midpoint(req: Requests, page_size: int, max_pages: int,
                  old_fraction: float = OLD_FRACTION) -> dict[str, int]:
    """Partial pages with midpoint insertion: memory is budgeted in entries
    (``max_pages * page_size`` of them), not in whole pages, and pages stay the
    unit of I/O.

    New keys fill the open page in arrival order, as in :func:`page_lru`, and a
    page is still read whole from the store; but residency is per entry, in one
    LRU list of entries split into a *young* head and an *old* tail
    (``old_fraction`` of the budget). A page fault puts the requested entry at
    the young MRU end and the page's other entries that are not in memory
    (its neighbours, read with it) at the *midpoint*, the MRU end of the old
    sublist; an entry hit in the old sublist moves to the young MRU end; the
    young sublist's overflow moves to the old MRU end; the old LRU end leaves
    memory. A neighbour read in with a page and never used therefore leaves
    after it has passed through the old sublist, while the hot entries of a
    page stay without its cold ones. This is InnoDB's buffer pool LRU with
    its midpoint insertion of read-ahead pages (MySQL reference manual,
    "Making the Buffer Pool Scan Resistant"), with entries for InnoDB's pages
    and pages for its read-ahead extents; 2Q's A1in (Johnson and Shasha,
    VLDB 1994) is the same idea of a probation area for entries not yet
    re-referenced. With ``page_size=1`` (no neighbours) the two sublists are
    one LRU list: exactly :func:`lru`.

    Returns :func:`page_lru`'s counts plus ``prefetched`` (neighbours placed
    at the midpoint) and ``prefetch_hits`` (of those, entries hit before they
    left the old sublist).
    """
    if DELETE in req.ops:
        raise ValueError("page_midpoint does not model deletes (the free list)")
    budget = max_pages * page_size
    young_cap = max(1, budget - int(old_fraction * budget))
    young: OrderedDict[Any, None] = OrderedDict()
    old: OrderedDict[Any, bool] = OrderedDict()   # key -> placed as a neighbour
    ymove, ypop, opop = young.move_to_end, young.popitem, old.popitem
    page_of: dict[Any, int] = {}
    members: dict[int, list[Any]] = {}
    open_page, open_used, next_id = -1, page_size, 0
    mem = store = miss = faults = prefetched = prefetch_hits = 0
    for op, k in zip(req.ops, req.keys):
        if k in young:
            ymove(k)
            if op == GET:
                mem += 1
            continue
        if k in old:
            if old.pop(k):
                prefetch_hits += 1
            young[k] = None
            if op == GET:
                mem += 1
        else:
            p = page_of.get(k)
            if p is None:
                if op == GET:
                    miss += 1           # look-aside: a miss is followed by a set
                if open_used >= page_size:
                    open_page, open_used = next_id, 0
                    next_id += 1
                    members[open_page] = []
                page_of[k] = open_page
                members[open_page].append(k)
                open_used += 1
                young[k] = None
            else:
                faults += 1             # the whole page is read from the store
                if op == GET:
                    store += 1
                young[k] = None
                for m in members[p]:
                    if m not in young and m not in old:
                        old[m] = True
                        prefetched += 1
        while len(young) > young_cap:
            old[ypop(False)[0]] = False
        while len(young) + len(old) > budget:
            if old:
                opop(False)
            else:
                ypop(False)
    return {"memory_hits": mem, "store_hits": store, "misses": miss, "page_faults": faults,
            "prefetched": prefetched, "prefetch_hits": prefetch_hits}
