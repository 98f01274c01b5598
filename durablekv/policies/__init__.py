"""Replacement policies of the memory tier, chosen once by name.

* ``"lru"`` (:mod:`.lru`): least recently used pages leave first;
* ``"tinylfu"`` (:mod:`.tinylfu`): W-TinyLFU over pages, as in Caffeine;
* ``"midpoint"`` (:mod:`.midpoint`): young and old sublists of entries with
  midpoint insertion, as InnoDB's buffer pool; it orders the entries of the
  tier whose residency is per entry (:mod:`durablekv.tier.midpoint`).

Each is an object that owns its state behind the small interface of
:class:`~durablekv.policies.base.EvictionPolicy`. :func:`make_policy` (and
the tier factory, :func:`durablekv.tier.make_tier`) are the only places
that look at a policy's name.
"""

from __future__ import annotations

from typing import Any

from .base import EvictionPolicy
from .lru import LRU
from .tinylfu import TinyLFU

__all__ = ["POLICIES", "EvictionPolicy", "LRU", "TinyLFU", "check_policy", "is_exact_lru",
           "make_policy", "residency"]

#: The policy names ``Cache(policy=...)`` takes.
POLICIES = ("lru", "tinylfu", "midpoint")

#: The policies of a page-granular tier, by name.
_PAGE_POLICIES = {"lru": LRU, "tinylfu": TinyLFU}

#: The unit each policy keeps in memory or lets go.
_RESIDENCY = {"lru": "page", "tinylfu": "page", "midpoint": "entry"}


def residency(policy: str) -> str:
    """``"page"`` or ``"entry"``: what ``policy`` keeps in memory or lets go
    (a page is the unit of I/O either way).

    :raises durablekv.errors.ConfigError: an unknown policy.
    """
    return _RESIDENCY[check_policy(policy)]


def is_exact_lru(policy: str, page_size: int) -> bool:
    """Whether a memory tier of ``page_size`` under ``policy`` is exactly an
    entry-level LRU of its slots (its hit ratio is an LRU cache's)."""
    return page_size == 1 and check_policy(policy) == "lru"


def check_policy(policy: Any) -> str:
    """Return ``policy`` if it names a replacement policy.

    :raises durablekv.errors.ConfigError: it does not.
    """
    if policy not in POLICIES:
        from ..errors import ConfigError
        raise ConfigError(f"policy={policy!r}: expected one of {', '.join(map(repr, POLICIES))}; "
                          "use policy='lru' (the default), 'tinylfu' or 'midpoint'")
    return policy


def make_policy(policy: str, tier: Any) -> EvictionPolicy:
    """The policy object named ``policy`` for a page-granular ``tier``.

    :raises durablekv.errors.ConfigError: an unknown name, or ``"midpoint"``
        (residency per entry is a tier of its own: use the tier factory).
    """
    cls = _PAGE_POLICIES.get(check_policy(policy))
    if cls is None:
        from ..errors import ConfigError
        raise ConfigError(f"policy={policy!r} keeps residency per entry: build its tier with "
                          "durablekv.tier.make_tier, not a page tier")
    return cls(tier)
