"""Replacement policies of the memory tier, chosen once by name.

* ``"lru"`` (:mod:`.lru`): least recently used pages leave first;
* ``"tinylfu"`` (:mod:`.tinylfu`): W-TinyLFU over pages, as in Caffeine;
* ``"midpoint"``: residency per entry with midpoint insertion, as InnoDB's
  buffer pool (an entry-granular tier, :mod:`durablekv.midpoint`).

Each is an object that owns its state behind the small interface of
:class:`~durablekv.policies.base.EvictionPolicy`. :func:`make_policy` (and
the tier factory, :func:`durablekv.pages.make_tier`) are the only places
that look at a policy's name.
"""

from __future__ import annotations

from typing import Any

from .base import EvictionPolicy
from .lru import LRU
from .tinylfu import TinyLFU

__all__ = ["POLICIES", "EvictionPolicy", "LRU", "TinyLFU", "check_policy", "make_policy"]

#: The policy names ``Cache(policy=...)`` takes.
POLICIES = ("lru", "tinylfu", "midpoint")

#: The policies of a page-granular tier, by name.
_PAGE_POLICIES = {"lru": LRU, "tinylfu": TinyLFU}


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
                          "durablekv.pages.make_tier, not a page tier")
    return cls(tier)
