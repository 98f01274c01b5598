"""``policy="lru"``: least recently used pages leave first.

Every access stamps its page with the next tick of the tier's recency clock
(an integer store instead of moving a list node). Resident pages sit in a
min-heap by the stamp they had when they were filed there; to evict, the
top page is taken if its stamp is still the filed one, else re-filed under
its current stamp (lazy promotion, as in a timestamp-ordered LRU heap). The
victim is always the page with the smallest stamp: an exact LRU, so
``page_size=1`` behaves exactly like an entry-level LRU. (Exact in the order
the touches are stored: a get touches without the lock, and a thread
switched out between drawing its tick and storing it can store an older tick
over a newer one, so that page looks older than it is.) Each resident page
has one live heap entry (``page.heap_stamp`` is its filed stamp, -1 for
none); entries of pages that left residency are dropped when they surface,
or when the heap is rebuilt.

Pure data structure: no threads, no I/O, no locks (the cache serialises
every call; only ``page.stamp`` moves without the lock).
"""

from __future__ import annotations

from heapq import heapify, heappop, heappush, heapreplace
from typing import Any, Callable, Sequence

__all__ = ["LRU"]


class LRU:
    """Exact LRU over a tier's resident pages (see the module docstring).

    :param tier: the :class:`~durablekv.tier.pages.MemoryTier` it orders
        (reads ``resident``, ``max_pages``, ``resident_bytes``, ``max_bytes``;
        calls ``_evict``).
    """

    bulk_admit = True

    def __init__(self, tier: Any) -> None:
        self.tier = tier
        self.heap: list[tuple[float, Any]] = []  # (filed stamp, page)

    def page_factory(self, page_cls: type) -> Callable[..., Any]:
        return page_cls

    def admit(self, page: Any, stamp: float) -> None:
        page.stamp = page.heap_stamp = stamp
        heappush(self.heap, (stamp, page))
        tier = self.tier
        while tier.resident > tier.max_pages:
            tier._evict(self.pop())
        if tier.max_bytes is not None and tier.resident_bytes > tier.max_bytes:
            self.shrink(page)
        if len(self.heap) > 2 * tier.resident + 64:
            self.rebuild()

    def admit_fresh(self, stamps: Sequence[int], pages: Sequence[Any]) -> None:
        # every filed stamp is above those in the heap: appending keeps it a heap
        self.heap.extend(zip(stamps, pages))

    def count_fault(self, page_id: int) -> None:
        pass

    def shrink(self, keep: Any = None) -> None:
        """Evict least recently used pages until the tier's resident bytes
        fit ``max_bytes`` or one page is left (``keep``, the caller's page,
        was just touched: it is the most recently used)."""
        tier = self.tier
        while tier.resident_bytes > tier.max_bytes and tier.resident > 1:
            tier._evict(self.pop())

    def pop(self) -> Any:
        """Take the least recently used resident page out of the heap."""
        heap = self.heap
        while True:
            filed, page = heap[0]
            if page.heap_stamp != filed:
                heappop(heap)  # the page left residency after this entry was filed
            elif (stamp := page.stamp) != filed:
                # used since it was filed: re-file it under its current stamp
                # (read once: a get touches pages without the lock, and the
                # heap entry must match heap_stamp)
                page.heap_stamp = stamp
                heapreplace(heap, (stamp, page))
            else:
                heappop(heap)
                page.heap_stamp = -1
                return page

    def rebuild(self) -> None:
        """Drop the entries of pages no longer resident and re-file the rest
        under their current stamps (O(resident pages))."""
        live = [(p.stamp, p) for filed, p in self.heap if p.heap_stamp == filed]
        for stamp, p in live:
            p.heap_stamp = stamp
        heapify(live)
        self.heap = live

    def left(self, page: Any) -> None:
        pass

    def order(self) -> list[Any]:
        live = [p for filed, p in self.heap if p.heap_stamp == filed]
        return sorted(live, key=lambda p: p.stamp)

    def clear(self) -> None:
        self.heap.clear()
