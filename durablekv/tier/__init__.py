"""The memory tier: pages, the page table, the free list and residency.

Two implementations, chosen once by :func:`make_tier`:

* :class:`~.pages.MemoryTier`: residency per page; a replacement policy
  object (:mod:`durablekv.policies`: ``"lru"``, ``"tinylfu"``) chooses the
  pages that leave;
* :class:`~.midpoint.MidpointTier` (``"midpoint"``): residency per entry
  inside pages, with InnoDB's midpoint insertion.

Pages stay the unit of I/O in both. The rest of the package reads what a
tier is through its attributes (``per_entry``), never through
the policy's name.
"""

from __future__ import annotations

from typing import Any

from ..policies import check_policy
from .pages import (EMPTY, HAS_TTL, PAGE_BYTES_LIMIT, PENDING, RESIDENT, SLOTTED, UNLOADED,
                    MemoryTier, Page)

__all__ = ["EMPTY", "HAS_TTL", "PAGE_BYTES_LIMIT", "PENDING", "RESIDENT", "SLOTTED",
           "UNLOADED", "MemoryTier", "Page", "make_tier"]


def make_tier(page_size: int, max_pages: int, policy: str = "lru",
              max_bytes: int | None = None, *, next_page_id: int = 1,
              track_departures: bool = False, fill_open: Any = None) -> MemoryTier:
    """The memory tier for ``policy``: a :class:`MemoryTier` with that policy
    (``"lru"``, ``"tinylfu"``), or a :class:`~.midpoint.MidpointTier`
    (``"midpoint"``, residency per entry).

    :param page_size: slots per page (>= 1).
    :param max_pages: most pages resident (``"midpoint"``: ``max_pages *
        page_size`` entries).
    :param max_bytes: most bytes resident, or None.
    :param next_page_id: the id the first new page takes (one past the
        store's highest).
    :param track_departures: keep the ids of clean pages that leave memory
        (``departed``, :meth:`~MemoryTier.take_departed`), for a store with a
        size limit that evicts least recently used pages.
    :param fill_open: ``fill_open(page)``: read the unloaded entries of the
        open page back in before an insert (entry residency only).
    :raises durablekv.errors.ConfigError: an unknown policy.
    """
    if check_policy(policy) == "midpoint":
        from .midpoint import MidpointTier
        tier: MemoryTier = MidpointTier(page_size, max_pages, max_bytes)
    else:
        tier = MemoryTier(page_size, max_pages, policy, max_bytes)
    tier.fill_open = fill_open
    tier.next_page_id = next_page_id
    tier.track_departures = track_departures
    return tier
