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

from ..policies import check_policy
from .pages import (EMPTY, HAS_TTL, PAGE_BYTES_LIMIT, PENDING, RESIDENT, SLOTTED, UNLOADED,
                    MemoryTier, Page)

__all__ = ["EMPTY", "HAS_TTL", "PAGE_BYTES_LIMIT", "PENDING", "RESIDENT", "SLOTTED",
           "UNLOADED", "MemoryTier", "Page", "make_tier"]


def make_tier(page_size: int, max_pages: int, policy: str = "lru",
              max_bytes: int | None = None) -> MemoryTier:
    """The memory tier for ``policy``: a :class:`MemoryTier` with that policy
    (``"lru"``, ``"tinylfu"``), or a :class:`~.midpoint.MidpointTier`
    (``"midpoint"``, residency per entry).

    :param page_size: slots per page (>= 1).
    :param max_pages: most pages resident (``"midpoint"``: ``max_pages *
        page_size`` entries).
    :param max_bytes: most bytes resident, or None.
    :raises durablekv.errors.ConfigError: an unknown policy.
    """
    if check_policy(policy) == "midpoint":
        from .midpoint import MidpointTier
        return MidpointTier(page_size, max_pages, max_bytes)
    return MemoryTier(page_size, max_pages, policy, max_bytes)
