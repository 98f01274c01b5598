"""How many live keys a cache holds, in memory and in its store together.

One :class:`KeyCounts` per cache owns the two numbers; the write path,
expiry, recovery and the write-behind (which learns of keys the store
evicted for ``size_limit``) change them only through its methods, under the
cache's lock. ``len(cache)`` starts from :attr:`KeyCounts.keys`, and the
expiry sweep stops when :attr:`KeyCounts.ttl_keys` is zero.
"""

from __future__ import annotations

__all__ = ["KeyCounts"]


class KeyCounts:
    """The live keys of one cache and, of those, the keys with a TTL.

    :param keys: keys at open (the store's ``key_count``).
    :param ttl_keys: of those, keys with an expiry (``ttl_key_count``).

    An expired key that nothing has removed yet still counts: ``len`` and
    the sweep take it out when they meet it.
    """

    __slots__ = ("keys", "ttl_keys")

    def __init__(self, keys: int = 0, ttl_keys: int = 0) -> None:
        self.keys = keys
        self.ttl_keys = ttl_keys

    def added(self, n: int = 1, ttl: int = 0) -> None:
        """``n`` new keys, ``ttl`` of them with an expiry."""
        self.keys += n
        self.ttl_keys += ttl

    def removed(self, n: int = 1, ttl: int = 0) -> None:
        """``n`` keys gone, ``ttl`` of them with an expiry."""
        self.keys -= n
        self.ttl_keys -= ttl

    def expiry_changed(self, had: bool, has: bool) -> None:
        """A key kept, whose expiry went from ``had`` (one or none) to ``has``."""
        self.ttl_keys += has - had

    def cleared(self) -> None:
        """Every key is gone (``clear()``)."""
        self.keys = self.ttl_keys = 0

    def __repr__(self) -> str:
        return f"KeyCounts(keys={self.keys}, ttl_keys={self.ttl_keys})"
