"""A Bloom filter over the keys of the SQLite store, kept in memory.

A key that is not in the memory tier may still be in the store, so a get
miss or a set of a new key would cost a SQLite index lookup. The filter
answers "certainly not in the store" for almost every absent key, in about a
microsecond and without leaving Python (Bloom, "Space/time trade-offs in
hash coding with allowable errors", CACM 1970; used the same way in front of
LSM-tree runs by LevelDB and RocksDB).

The cache asks it only about keys that are not in the memory tier's page
table, so it must never give a false negative for a key the store holds on
a page that is not in memory. It holds:

* every key a flush adds to the store's key index: the write-behind thread
  adds them once the SQLite commit is done, under the cache lock, before
  any of their pages may leave memory (a flushed page is dropped only after
  that, and an unflushed page stays in the page table). A key that is only
  in memory is found through the page table, so a new key costs its
  setter, and recovery's open, no filter add;
* the keys already in the store when the cache opens: a scan that the
  write-behind thread runs in the background, between flushes. It starts
  after the build did, so it reads every commit made before it, and no
  commit lands between the scan and its merge (one thread does both);
  later commits add their keys to the filter it has become. Until that
  scan is merged in, the filter is not *ready* and lookups go to SQLite;
* deleting a key does not remove it (a plain Bloom filter cannot), which
  only raises the false-positive rate; when more keys were added than the
  filter was sized for, the cache builds a larger one the same way. A
  ``clear()`` starts an empty one: the store is emptied by the next flush,
  and until then the cache consults neither the filter nor the store.

Sizing: 12 bits and 4 probes per key give about 0.6 % false positives at
capacity. The probes come from Python's (SipHash) hash of the key's
canonical bytes by double hashing (Kirsch and Mitzenmacher, 2006).
"""

from __future__ import annotations

from typing import Iterable

__all__ = ["KeyFilter"]

#: Smallest capacity (keys) a filter is built for: 65,536 keys = 96 KiB.
MIN_CAPACITY = 1 << 16
_BITS_PER_KEY = 12
_PROBES = 4
_MASK64 = (1 << 64) - 1
assert _PROBES == 4  # add_many and __contains__ unroll the probe loop


class KeyFilter:
    """A fixed-size Bloom filter of canonical key bytes.

    :param capacity: keys it is sized for (more can be added; the
        false-positive rate then rises).
    Not thread-safe: the cache calls it under its lock.
    """

    __slots__ = ("capacity", "nbits", "bits", "added", "ready")

    def __init__(self, capacity: int) -> None:
        self.capacity = max(int(capacity), MIN_CAPACITY)
        self.nbits = self.capacity * _BITS_PER_KEY
        self.bits = bytearray((self.nbits + 7) // 8)
        self.added = 0
        self.ready = False

    def add(self, ckey: bytes) -> None:
        h = hash(ckey) & _MASK64
        h1, h2 = h & 0xFFFFFFFF, (h >> 32) | 1
        bits, nbits = self.bits, self.nbits
        for _ in range(_PROBES):
            i = h1 % nbits
            bits[i >> 3] |= 1 << (i & 7)
            h1 += h2
        self.added += 1

    def add_all(self, ckeys: Iterable[bytes]) -> None:
        for ck in ckeys:
            self.add(ck)

    def add_many(self, ckeys: Iterable[bytes]) -> None:
        """:meth:`add` for many keys (same bits), without a call per key: the
        probe loop is unrolled for the four probes (recovery adds millions)."""
        bits, nbits = self.bits, self.nbits
        count = 0
        for ck in ckeys:
            h = hash(ck) & _MASK64
            h1, h2 = h & 0xFFFFFFFF, (h >> 32) | 1
            i = h1 % nbits
            bits[i >> 3] |= 1 << (i & 7)
            h1 += h2
            i = h1 % nbits
            bits[i >> 3] |= 1 << (i & 7)
            h1 += h2
            i = h1 % nbits
            bits[i >> 3] |= 1 << (i & 7)
            h1 += h2
            i = h1 % nbits
            bits[i >> 3] |= 1 << (i & 7)
            count += 1
        self.added += count

    def __contains__(self, ckey: bytes) -> bool:
        # Every get miss and every set of a new key asks this: the four
        # probes are unrolled (a loop over range() cost about 0.1 us more).
        h = hash(ckey) & _MASK64
        h1, h2 = h & 0xFFFFFFFF, (h >> 32) | 1
        bits, nbits = self.bits, self.nbits
        i = h1 % nbits
        if not bits[i >> 3] & (1 << (i & 7)):
            return False
        h1 += h2
        i = h1 % nbits
        if not bits[i >> 3] & (1 << (i & 7)):
            return False
        h1 += h2
        i = h1 % nbits
        if not bits[i >> 3] & (1 << (i & 7)):
            return False
        i = (h1 + h2) % nbits
        return bool(bits[i >> 3] & (1 << (i & 7)))

    def merge(self, other: "KeyFilter") -> None:
        """OR ``other`` (same size) into this filter."""
        if other.nbits != self.nbits:
            raise ValueError("can only merge filters of the same size")
        n = len(self.bits)
        merged = int.from_bytes(self.bits, "little") | int.from_bytes(other.bits, "little")
        self.bits[:] = merged.to_bytes(n, "little")
        self.added += other.added

    @property
    def overfull(self) -> bool:
        """More keys were added than the filter was sized for (twice over)."""
        return self.added > 2 * self.capacity
