"""The interface between the memory tier and a replacement policy.

The tier (:mod:`durablekv.tier`) owns pages, the page table, the free list
and residency counts; a policy owns the order in which resident pages leave
memory and nothing else. The tier calls the policy at the few points where
residency changes; the policy answers by naming victims, which it hands back
to the tier's ``_evict``. A memory hit never calls the policy: it stores the
next tick of the tier's recency clock in ``page.stamp`` (one attribute store,
also from C), and a policy reads those stamps when it next chooses a victim
(lazy promotion).

A policy is built once, from its name, by :func:`durablekv.policies.make_policy`;
nothing else looks at which policy a tier has.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol, Sequence

__all__ = ["EvictionPolicy"]


class EvictionPolicy(Protocol):
    """What a page-granular memory tier calls on its policy.

    ``tier`` below is the :class:`~durablekv.tier.pages.MemoryTier` the policy
    was built for: the policy reads its bounds (``max_pages``, ``max_bytes``,
    ``over()``), its recency clock (``ticks``, ``locked_ticks``) and calls
    ``tier._evict(page)`` for each page it chooses to leave memory.
    """

    #: Whether :meth:`admit_fresh` may file a run of new pages in one step
    #: (the tier's bulk insert uses it when nothing would be evicted).
    bulk_admit: bool

    def page_factory(self, page_cls: type) -> Callable[..., Any]:
        """The callable that builds the tier's pages, ``(page_id, page_size,
        full=None)`` -> page (a policy that counts accesses returns a
        subclass whose ``stamp`` store counts them)."""

    def admit(self, page: Any, stamp: float) -> None:
        """``page`` just became resident (the tier counted it) under recency
        ``stamp``: set its stamps, file it, and evict until the tier is
        within its bounds. ``page`` itself never leaves here."""

    def admit_fresh(self, stamps: Sequence[int], pages: Sequence[Any]) -> None:
        """File new pages whose stamps are already set and above every page
        filed so far; evicts nothing (only when :attr:`bulk_admit`)."""

    def count_fault(self, page_id: int) -> None:
        """An access that brought page ``page_id`` back into memory."""

    def shrink(self, keep: Any = None) -> None:
        """Evict while the tier is over a bound (never ``keep``, when the
        policy can avoid it: the page the caller is using)."""

    def left(self, page: Any) -> None:
        """``page`` left residency without being a victim (it became empty)."""

    def order(self) -> list[Any]:
        """Resident pages, the next victim first: for tests and introspection."""

    def clear(self) -> None:
        """Forget every page (the tier is being cleared)."""
