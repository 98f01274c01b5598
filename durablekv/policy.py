"""Replacement policies of the memory tier: ``"lru"`` and ``"tinylfu"``.

Pure data structures, no threads, no I/O (like pages.py, whose
:class:`~durablekv.pages.MemoryTier` delegates its victim choice to a
:class:`TinyLFU` when ``policy="tinylfu"``; under ``"lru"`` the tier keeps
its own page heap and no object of this module is on any path).

W-TinyLFU, as in Caffeine (Einziger, Friedman, Manes, "TinyLFU: A Highly
Efficient Cache Admission Policy", ACM TOS 2017):

* a *window* LRU of about 1% of the capacity takes every new item;
* the rest is a segmented LRU, *probation* (20%) and *protected* (80%): an
  item hit in probation moves to protected; protected's overflow goes back
  to probation's MRU end;
* when the window overflows, its LRU item (the *candidate*) and
  probation's LRU item (the *victim*) are compared by their estimated
  frequency in a :class:`FrequencySketch`; the more frequent one stays in
  main, the other leaves memory. Ties go to the victim (Caffeine's rule: an
  incumbent is kept unless the candidate is strictly more frequent).

At page granularity (the memory tier) the unit of residency is the page, so
the items are pages and the sketch counts *accesses per page* (keyed by page
id): every get, set or insert that touches a page counts once for it. A page
stays or goes as a whole, so the number to compare is how often the whole
page is used, which is the sum of its entries' accesses; counting entries
separately would need a per-page sum of 16 estimates at every admission and
would credit a page for entries that have moved out of it. Page ids come
back through the free list; a reused id inherits the old page's counts
until aging halves them away.
"""

from __future__ import annotations

from typing import Any, Hashable

__all__ = ["FrequencySketch", "POLICIES", "check_policy", "window_split"]

#: The policy names ``Cache(policy=...)`` takes.
POLICIES = ("lru", "tinylfu")

_M64 = (1 << 64) - 1
#: ``bytes.translate`` table halving every counter (the sketch's aging).
_HALVE = bytes(i >> 1 for i in range(256))


def check_policy(policy: Any) -> str:
    """Return ``policy`` if it names a replacement policy.

    :raises durablekv.errors.ConfigError: it does not.
    """
    if policy not in POLICIES:
        from .errors import ConfigError
        raise ConfigError(f"policy={policy!r}: expected one of {', '.join(map(repr, POLICIES))}; "
                          "use policy='lru' (the default) or policy='tinylfu'")
    return policy


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

    __slots__ = ("width", "mask", "counters", "sample", "additions", "resets")

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

    def _indexes(self, key: Hashable) -> tuple[int, int, int, int]:
        h = (hash(key) * 0x9E3779B97F4A7C15) & _M64
        h ^= h >> 29
        g = ((h ^ 0xBF58476D1CE4E5B9) * 0x94D049BB133111EB) & _M64
        g = (g ^ (g >> 31)) | 1
        m, w = self.mask, self.width
        return (h & m, w + ((h + g) & m), 2 * w + ((h + 2 * g) & m), 3 * w + ((h + 3 * g) & m))

    def increment(self, key: Hashable) -> None:
        """Count one access to ``key``; halve every counter every ``sample`` accesses."""
        c = self.counters
        a, b, d, e = self._indexes(key)
        if c[a] < 15:
            c[a] += 1
        if c[b] < 15:
            c[b] += 1
        if c[d] < 15:
            c[d] += 1
        if c[e] < 15:
            c[e] += 1
        self.additions += 1
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
