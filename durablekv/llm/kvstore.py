"""KVBlockStore: KV blocks in a durablekv Cache, the tier below the block pool's memory.

A block is stored under its chained hash (:mod:`durablekv.llm.hashing`, 32
bytes) as the key, and a self-describing, checksummed byte string as the
value. The value layout (little-endian)::

    offset  size  field
    0       4     magic  b"DKVB"
    4       1     format version (1)
    5       1     n = length of the dtype string
    6       n     numpy dtype string, ASCII (e.g. "<f4"; byte order explicit)
    6+n     1     ndim
    7+n     4*nd  shape, u32 each
    ...     8     payload length in bytes, u64
    ...     4     CRC-32 of (block hash || every byte above || payload)
    ...     len   payload: the array's bytes in C order

The CRC covers the key as well, so a value stored under the wrong hash is
caught like a flipped bit. Arrays come back bit-exact, with their dtype and
shape.

A damaged block is never served as KV data. What "damaged" means: the value
is not bytes, is truncated or too long, has a bad magic, version, dtype or
shape, or its CRC does not match. With ``on_corrupt="miss"`` (the default)
:meth:`KVBlockStore.get` then warns (:class:`KVBlockCorruptWarning`), deletes
the entry and returns None, so the block is recomputed, exactly as on a miss;
with ``on_corrupt="raise"`` it raises :class:`KVBlockCorruptError`. A miss is
the default because the tier is a cache: recomputing a block is always
correct, and one bad block should not stop serving.
"""

from __future__ import annotations

import os
import struct
import warnings
import zlib
from typing import Any, Iterable

import numpy as np

from ..errors import ConfigError, DurableKVError
from .hashing import HASH_BYTES

__all__ = ["KVBlockStore", "KVBlockCorruptError", "KVBlockCorruptWarning", "encode_block",
           "decode_block"]

_MAGIC = b"DKVB"
_VERSION = 1
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_MAX_NDIM = 8


class KVBlockCorruptError(DurableKVError, ValueError):
    """A stored KV block's bytes do not decode (or do not fit the pool).

    :ivar block_hash: the block's hash (bytes).
    :ivar detail: what was wrong.
    """

    def __init__(self, block_hash: bytes, detail: str) -> None:
        self.block_hash = block_hash
        self.detail = detail
        super().__init__(f"stored KV block {block_hash.hex()[:16]}... is damaged: {detail}; "
                         "it is not used as KV data (delete it, or open the KVBlockStore "
                         "with on_corrupt='miss' to recompute such blocks)")


class KVBlockCorruptWarning(UserWarning):
    """A damaged stored KV block was dropped and will be recomputed."""


def _check_hash(block_hash: Any) -> bytes:
    if not isinstance(block_hash, bytes) or len(block_hash) != HASH_BYTES:
        raise TypeError(f"a block hash is {HASH_BYTES} bytes from block_hashes(), not "
                        f"{type(block_hash).__name__} {block_hash!r:.60}")
    return block_hash


#: What KVBlockStore calls on its cache (besides ``in``).
_CACHE_METHODS = ("get", "set", "delete")


def _check_cache(cache: Any) -> None:
    """Refuse, at construction, what the first ``put`` or spill would fail on
    with an AttributeError far from the mistake (a path given for a Cache)."""
    missing = [m for m in _CACHE_METHODS if not callable(getattr(cache, m, None))]
    if not missing and hasattr(type(cache), "__contains__"):
        return
    what = f"{type(cache).__name__} {cache!r:.60}"
    if isinstance(cache, (str, bytes, os.PathLike)):
        path = os.fsdecode(cache)
        raise TypeError(f"KVBlockStore needs an open durablekv Cache, not the path {what}; "
                        f"open the cache and pass it: KVBlockStore(Cache({path!r})) "
                        "(from durablekv import Cache; the KVBlockStore does not close it)")
    raise TypeError(f"KVBlockStore needs an open durablekv Cache (or an object with its "
                    f"get, set, delete and `in`), not {what}"
                    + (f", which has no {' or '.join(m + '()' for m in missing)}"
                       if missing else "")
                    + "; pass KVBlockStore(Cache(directory))")


def encode_block(block_hash: bytes, kv: np.ndarray) -> bytes:
    """The stored bytes of ``kv`` under ``block_hash`` (layout in the module docstring).

    :raises TypeError: ``kv`` is not a numpy array of a plain numeric dtype,
        or the hash is not 32 bytes.
    :raises ValueError: more than 8 dimensions.
    """
    _check_hash(block_hash)
    if not isinstance(kv, np.ndarray):
        raise TypeError(f"a KV block must be a numpy array, not {type(kv).__name__}")
    if kv.dtype.kind not in "fiub" or kv.dtype.hasobject:
        raise TypeError(f"a KV block must hold numbers, not dtype {kv.dtype}")
    if kv.ndim > _MAX_NDIM:
        raise ValueError(f"a KV block has at most {_MAX_NDIM} dimensions, got {kv.ndim}")
    dtype = kv.dtype.newbyteorder("<") if kv.dtype.byteorder == ">" else kv.dtype
    payload = np.ascontiguousarray(kv, dtype=dtype).tobytes()
    dstr = dtype.str.encode("ascii")
    head = (_MAGIC + bytes([_VERSION, len(dstr)]) + dstr + bytes([kv.ndim])
            + b"".join(_U32.pack(n) for n in kv.shape) + _U64.pack(len(payload)))
    crc = zlib.crc32(payload, zlib.crc32(head, zlib.crc32(block_hash)))
    return head + _U32.pack(crc) + payload


def decode_block(block_hash: bytes, data: Any) -> np.ndarray:
    """The array stored as ``data`` under ``block_hash``, bit-exact.

    :raises KVBlockCorruptError: the bytes do not decode (see module docstring).
    """
    def bad(detail: str) -> KVBlockCorruptError:
        return KVBlockCorruptError(block_hash, detail)

    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise bad(f"the stored value is a {type(data).__name__}, not bytes")
    data = bytes(data)
    if len(data) < 7 or data[:4] != _MAGIC:
        raise bad("no DKVB header (not a KV block)")
    if data[4] != _VERSION:
        raise bad(f"format version {data[4]}, this durablekv reads {_VERSION}")
    n = data[5]
    pos = 6 + n
    try:
        dtype = np.dtype(data[6:pos].decode("ascii"))
    except (UnicodeDecodeError, TypeError, ValueError):
        raise bad(f"unknown dtype string {data[6:pos]!r}") from None
    if dtype.kind not in "fiub" or dtype.hasobject:
        raise bad(f"dtype {dtype} is not numeric")
    if len(data) < pos + 1:
        raise bad("truncated header")
    ndim = data[pos]
    pos += 1
    if ndim > _MAX_NDIM or len(data) < pos + 4 * ndim + 12:
        raise bad("truncated header")
    shape = tuple(_U32.unpack_from(data, pos + 4 * i)[0] for i in range(ndim))
    pos += 4 * ndim
    (length,) = _U64.unpack_from(data, pos)
    pos += 8
    (crc,) = _U32.unpack_from(data, pos)
    head = data[:pos]
    pos += 4
    payload = data[pos:]
    if len(payload) != length:
        raise bad(f"payload is {len(payload)} bytes, the header says {length}")
    if length != int(np.prod(shape, dtype=np.int64)) * dtype.itemsize:
        raise bad(f"payload of {length} bytes does not hold shape {shape} of {dtype}")
    if zlib.crc32(payload, zlib.crc32(head, zlib.crc32(block_hash))) != crc:
        raise bad("checksum mismatch (bit flip, torn write, or stored under another hash)")
    return np.frombuffer(payload, dtype=dtype).reshape(shape).copy()


class KVBlockStore:
    """KV blocks by hash in a durablekv :class:`~durablekv.Cache` (keys and values bytes).

    Uses only the Cache's public API (``set``, ``get``, ``in``, ``delete``), so
    the blocks get the Cache's replay log and write-behind page store: a
    block whose ``put`` returned survives a killed process under the Cache's
    ``durability="log"`` and a power loss under ``"fsync"``.

    :param cache: an open :class:`~durablekv.Cache` (or anything with that
        mapping API). The KVBlockStore does not close it.
    :param on_corrupt: ``"miss"`` (default: warn, delete, return None) or
        ``"raise"`` (:class:`KVBlockCorruptError`), for a damaged block.
    :raises TypeError: ``cache`` lacks that API (a path, say: open the Cache
        first, ``KVBlockStore(Cache("var/kv"))``).
    :raises ConfigError: a bad ``on_corrupt``.

    Counters (ints since construction): ``puts``, ``hits``, ``misses``,
    ``corrupt``. Thread-safety: the Cache is thread-safe; the counters are
    for the one engine thread that uses the store.
    """

    def __init__(self, cache: Any, *, on_corrupt: str = "miss") -> None:
        if on_corrupt not in ("miss", "raise"):
            raise ConfigError(f"on_corrupt must be 'miss' or 'raise', not {on_corrupt!r}")
        _check_cache(cache)
        self.cache = cache
        self.on_corrupt = on_corrupt
        self.puts = self.hits = self.misses = self.corrupt = 0

    @property
    def name(self) -> str:
        """The Cache's name (the metrics ``cache`` label)."""
        return str(getattr(self.cache, "name", "kv"))

    def put(self, block_hash: bytes, kv_array: np.ndarray) -> None:
        """Store ``kv_array`` under ``block_hash`` (replacing what was there).

        Returns once the Cache's ``set`` returned (its durability applies).

        :raises TypeError: a bad hash or array (see :func:`encode_block`).
        """
        self.cache.set(_check_hash(block_hash), encode_block(block_hash, kv_array))
        self.puts += 1

    def get(self, block_hash: bytes) -> np.ndarray | None:
        """The block stored under ``block_hash``, bit-exact (dtype and shape as
        stored), or None when it is not stored, or is damaged and
        ``on_corrupt="miss"``.

        :raises KVBlockCorruptError: a damaged block with ``on_corrupt="raise"``.
        """
        data = self.cache.get(_check_hash(block_hash))
        if data is None:
            self.misses += 1
            return None
        try:
            kv = decode_block(block_hash, data)
        except KVBlockCorruptError as exc:
            self.drop_corrupt(exc)
            return None
        self.hits += 1
        return kv

    def drop_corrupt(self, exc: KVBlockCorruptError) -> None:
        """Handle a damaged block per ``on_corrupt`` (the pool calls this too
        when a block decodes but does not fit it): raise, or warn, delete it
        and count it."""
        self.corrupt += 1
        if self.on_corrupt == "raise":
            raise exc
        warnings.warn(f"{exc}; treated as a miss", KVBlockCorruptWarning, stacklevel=3)
        self.cache.delete(exc.block_hash)
        self.misses += 1

    def __contains__(self, block_hash: object) -> bool:
        return isinstance(block_hash, bytes) and block_hash in self.cache

    def match_prefix(self, hashes: Iterable[bytes]) -> int:
        """How many leading ``hashes`` are stored, stopping at the first missing one.

        A presence check only (no decode): a damaged block is found out by
        :meth:`get`, and the pool stops its prefix there.
        """
        n = 0
        for h in hashes:
            if _check_hash(h) not in self.cache:
                break
            n += 1
        return n

    def delete(self, block_hash: bytes) -> bool:
        """Remove a block; True when it was stored."""
        return bool(self.cache.delete(_check_hash(block_hash)))
