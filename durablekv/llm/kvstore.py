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
                  (8 in version 2: XXH3-64 of the same bytes)
    ...     len   payload: the array's bytes in C order

The CRC covers the key as well, so a value stored under the wrong hash is
caught like a flipped bit. Arrays come back bit-exact, with their dtype and
shape.

Large blocks (``file_block_bytes``, 1 MiB by default: a real model's block
is MiBs) are written once, to a file of their own beside the Cache
(``<cache dir>/kvblocks/<hash hex>.kvb``, the same bytes as above), and the
Cache holds a 25-byte reference under the hash::

    0  4  magic b"DKVF" | 4  1  version (1) | 5  8  file length, u64
    13 8  the file block's checksum (the field above) | 21 4  CRC-32 of bytes 0..20

A file block is format version 2: its checksum is XXH3-64 (the ``xxhash``
package, in the ``llm`` extra), which runs at about memory speed where
zlib's CRC-32 took most of a large put's time (measured: 2.2 GB/s against
10 GB/s on 2 MiB blocks here).

so each byte of the block goes to disk once (through the page cache), not
to the replay log and then twice to SQLite (WAL and main file) as a value
does. The order makes it crash-safe: the file is written to a temporary
name and renamed (with the Cache's ``durability="fsync"`` or ``"sync"``,
after an fsync of the file, then of the directory) before its reference is
set, so a reference always names a whole file; a crash between the two
leaves a file with no reference, which the next KVBlockStore deletes when
it opens. The files' bytes are bounded by ``max_file_bytes`` (least
recently used files go first, with their reference); the Cache's own
``size_limit`` counts only the references.

A damaged block is never served as KV data. What "damaged" means: the value
is not bytes, is truncated or too long, has a bad magic, version, dtype or
shape, or its CRC does not match; for a large block, also a reference whose
file is missing or is not the file it names. With ``on_corrupt="miss"`` (the default)
:meth:`KVBlockStore.get` then warns (:class:`KVBlockCorruptWarning`), deletes
the entry and returns None, so the block is recomputed, exactly as on a miss;
with ``on_corrupt="raise"`` it raises :class:`KVBlockCorruptError`. A miss is
the default because the tier is a cache: recomputing a block is always
correct, and one bad block should not stop serving.
"""

from __future__ import annotations

import math
import os
import struct
import threading
import warnings
import zlib
from collections import OrderedDict
from typing import Any, Iterable

import numpy as np

from ..errors import ConfigError, DurableKVError
from .hashing import HASH_BYTES

__all__ = ["KVBlockStore", "KVBlockCorruptError", "KVBlockCorruptWarning", "encode_block",
           "decode_block"]

_MAGIC = b"DKVB"
_VERSION = 1               # values in the Cache: CRC-32
_FILE_VERSION = 2          # block files: XXH3-64
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_MAX_NDIM = 8
_REF_MAGIC = b"DKVF"
_REF = struct.Struct("<4sBQQ")          # magic, version, file length, block checksum
_REF_BYTES = _REF.size + 4              # + CRC-32 of those 21 bytes
#: default ``file_block_bytes``: blocks at least this big go to files
DEFAULT_FILE_BLOCK_BYTES = 1 << 20
_FILE_SUFFIX = ".kvb"


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
    head, payload, _crc = _encode_parts(block_hash, kv)
    return head + payload.tobytes()


def _encode_parts(block_hash: bytes, kv: np.ndarray,
                  version: int = _VERSION) -> tuple[bytes, memoryview, int]:
    """encode_block's header (checksum included), its payload as a byte view
    of ``kv`` (no copy when ``kv`` is C-contiguous and little-endian), and the
    checksum (CRC-32 in ``version`` 1, XXH3-64 in 2)."""
    dtype = kv.dtype.newbyteorder("<") if kv.dtype.byteorder == ">" else kv.dtype
    arr = np.ascontiguousarray(kv, dtype=dtype)
    payload = memoryview(arr.reshape(-1)).cast("B")
    dstr = dtype.str.encode("ascii")
    head = (_MAGIC + bytes([version, len(dstr)]) + dstr + bytes([kv.ndim])
            + b"".join(_U32.pack(n) for n in kv.shape) + _U64.pack(arr.nbytes))
    if version == _FILE_VERSION:
        digest = _xxh3(block_hash, head, payload)
        return head + _U64.pack(digest), payload, digest
    crc = zlib.crc32(payload, zlib.crc32(head, zlib.crc32(block_hash)))
    return head + _U32.pack(crc), payload, crc


#: bytes a block file is written in, each hashed while in the CPU cache
_CHUNK = 256 << 10


def _file_parts(block_hash: bytes, kv: np.ndarray) -> tuple[bytes, memoryview]:
    """A block file's header up to its checksum, and the payload as a byte
    view of ``kv`` (format version 2: the checksum is XXH3-64)."""
    _check_hash(block_hash)
    dtype = kv.dtype.newbyteorder("<") if kv.dtype.byteorder == ">" else kv.dtype
    arr = np.ascontiguousarray(kv, dtype=dtype)
    dstr = dtype.str.encode("ascii")
    head = (_MAGIC + bytes([_FILE_VERSION, len(dstr)]) + dstr + bytes([kv.ndim])
            + b"".join(_U32.pack(n) for n in kv.shape) + _U64.pack(arr.nbytes))
    return head, memoryview(arr.reshape(-1)).cast("B")


def _xxh3_state(*parts: Any) -> Any:
    import xxhash   # the llm extra; KVBlockStore checks for it before writing files

    h = xxhash.xxh3_64()
    for part in parts:
        h.update(part)
    return h


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    while data:
        n = os.pwrite(fd, data, offset)
        data, offset = data[n:], offset + n


def _xxh3(*parts: Any) -> int:
    import xxhash   # the llm extra; KVBlockStore checks for it before writing files

    h = xxhash.xxh3_64()
    for part in parts:
        h.update(part)
    return h.intdigest()


def decode_block(block_hash: bytes, data: Any) -> np.ndarray:
    """The array stored as ``data`` under ``block_hash``, bit-exact.

    :raises KVBlockCorruptError: the bytes do not decode (see module docstring).
    """
    def bad(detail: str) -> KVBlockCorruptError:
        return KVBlockCorruptError(block_hash, detail)

    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise bad(f"the stored value is a {type(data).__name__}, not bytes")
    return _decode(block_hash, memoryview(data).cast("B")).copy()


def _header(block_hash: bytes, data: memoryview) -> tuple:
    """Parse a stored block's header: ``(dtype, shape, length, checksum,
    version, head, payload_offset)``; ``head`` is the bytes the checksum
    covers before the payload.

    :raises KVBlockCorruptError: a header that does not parse.
    """
    def bad(detail: str) -> KVBlockCorruptError:
        return KVBlockCorruptError(block_hash, detail)

    if len(data) < 7 or data[:4] != _MAGIC:
        raise bad("no DKVB header (not a KV block)")
    version = data[4]
    if version not in (_VERSION, _FILE_VERSION):
        raise bad(f"format version {version}, this durablekv reads {_VERSION} and "
                  f"{_FILE_VERSION}")
    n = data[5]
    pos = 6 + n
    try:
        dtype = np.dtype(bytes(data[6:pos]).decode("ascii"))
    except (UnicodeDecodeError, TypeError, ValueError):
        raise bad(f"unknown dtype string {bytes(data[6:pos])!r}") from None
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
    head = bytes(data[:pos])
    if version == _FILE_VERSION:
        if len(data) < pos + 8:
            raise bad("truncated header")
        (checksum,) = _U64.unpack_from(data, pos)
        pos += 8
    else:
        (checksum,) = _U32.unpack_from(data, pos)
        pos += 4
    if length != math.prod(shape) * dtype.itemsize:
        raise bad(f"payload of {length} bytes does not hold shape {shape} of {dtype}")
    return dtype, shape, length, checksum, version, head, pos


def _checksum_ok(block_hash: bytes, version: int, head: bytes, payload: Any,
                 checksum: int) -> bool:
    if version == _FILE_VERSION:
        return _xxh3(block_hash, head, payload) == checksum
    return zlib.crc32(payload, zlib.crc32(head, zlib.crc32(block_hash))) == checksum


def _decode(block_hash: bytes, data: memoryview) -> np.ndarray:
    """decode_block on a byte view; the array shares ``data``'s memory."""
    dtype, shape, length, checksum, version, head, pos = _header(block_hash, data)
    payload = data[pos:]
    if len(payload) != length:
        raise KVBlockCorruptError(block_hash, f"payload is {len(payload)} bytes, the header "
                                  f"says {length}")
    if not _checksum_ok(block_hash, version, head, payload, checksum):
        raise KVBlockCorruptError(block_hash, "checksum mismatch (bit flip, torn write, or "
                                  "stored under another hash)")
    return np.frombuffer(payload, dtype=dtype).reshape(shape)


class KVBlockStore:
    """KV blocks by hash in a durablekv :class:`~durablekv.Cache` (keys and values bytes).

    Uses only the Cache's public API (``set``, ``get``, ``in``, ``delete``,
    ``keys``), so the blocks get the Cache's replay log and write-behind page
    store: a block whose ``put`` returned survives a killed process under the
    Cache's ``durability="log"`` and a power loss under ``"fsync"``. Blocks of
    ``file_block_bytes`` or more are written once to a file of their own, the
    Cache holding a reference (module docstring), with the same promises.

    :param cache: an open :class:`~durablekv.Cache` (or anything with that
        mapping API). The KVBlockStore does not close it.
    :param on_corrupt: ``"miss"`` (default: warn, delete, return None) or
        ``"raise"`` (:class:`KVBlockCorruptError`), for a damaged block.
    :param file_block_bytes: blocks whose payload (``kv_array.nbytes``) is at
        least this many bytes go to files (an int >= 1), or None: every block
        in the Cache. The default, ``"auto"``, is 1 MiB for a Cache in a local
        directory (files in ``<cache.path>/kvblocks``) and None for any other
        cache (a ``postgresql://`` one: a failover peer could not follow its
        references to this machine's files).
    :param block_dir: where the block files live (default: beside the Cache).
    :param max_file_bytes: a bound on the block files' bytes (int >= 1), or
        None (default: no bound, like a Cache without ``size_limit``). Over
        it, the least recently used files are deleted with their references.
    :raises TypeError: ``cache`` lacks that API (a path, say: open the Cache
        first, ``KVBlockStore(Cache("var/kv"))``).
    :raises ConfigError: a bad ``on_corrupt``, a size < 1, or files asked for
        with no local directory to put them in.

    Counters (ints since construction): ``puts``, ``hits``, ``misses``,
    ``corrupt``, ``file_puts``. Thread-safety: the Cache is thread-safe, the
    block files' index is locked; ``put`` may run on the pool's writer thread
    while ``get`` runs on the engine's.
    """

    def __init__(self, cache: Any, *, on_corrupt: str = "miss",
                 file_block_bytes: int | str | None = "auto",
                 block_dir: str | os.PathLike | None = None,
                 max_file_bytes: int | None = None) -> None:
        if on_corrupt not in ("miss", "raise"):
            raise ConfigError(f"on_corrupt must be 'miss' or 'raise', not {on_corrupt!r}")
        _check_cache(cache)
        if file_block_bytes == "auto":
            local = getattr(cache, "path", None)
            file_block_bytes = (DEFAULT_FILE_BLOCK_BYTES if block_dir is not None or (
                isinstance(local, (str, os.PathLike)) and os.path.isdir(local)) else None)
        for what, value in (("file_block_bytes", file_block_bytes),
                            ("max_file_bytes", max_file_bytes)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < 1):
                raise ConfigError(f"{what} must be a positive int (bytes) or None, "
                                  f"not {value!r}")
        self.cache = cache
        self.on_corrupt = on_corrupt
        self.puts = self.hits = self.misses = self.corrupt = self.file_puts = 0
        self.file_block_bytes = file_block_bytes
        self.max_file_bytes = max_file_bytes
        self.block_dir: str | None = None
        if file_block_bytes is not None:
            self.block_dir = _block_dir(cache, block_dir)
            try:
                import xxhash  # noqa: F401  (block files' checksum)
            except ImportError:
                raise ConfigError("large KV blocks go to files checksummed with XXH3, and "
                                  "the xxhash package is not installed: pip install "
                                  "'durablekv[llm]', or pass file_block_bytes=None to keep "
                                  "every block in the Cache") from None
        # block files, least recently used first: hash -> file bytes
        self._files: OrderedDict[bytes, int] = OrderedDict()
        self.file_bytes = 0
        self._lock = threading.Lock()
        if self.block_dir is not None:
            self._open_files()

    @property
    def name(self) -> str:
        """The Cache's name (the metrics ``cache`` label)."""
        return str(getattr(self.cache, "name", "kv"))

    # -- block files ----------------------------------------------------------

    def _path(self, block_hash: bytes) -> str:
        return os.path.join(self.block_dir, block_hash.hex() + _FILE_SUFFIX)

    def _open_files(self) -> None:
        """Index the block files, oldest first; delete temporaries and files no
        reference names (a crash between a file's rename and its reference)."""
        os.makedirs(self.block_dir, mode=0o700, exist_ok=True)
        found = []
        with os.scandir(self.block_dir) as it:
            for entry in it:
                name = entry.name
                if not name.endswith(_FILE_SUFFIX):
                    if name.endswith(".tmp"):
                        _unlink(entry.path)
                    continue
                try:
                    h = bytes.fromhex(name[:-len(_FILE_SUFFIX)])
                    st = entry.stat()
                except (ValueError, OSError):
                    continue
                if len(h) != HASH_BYTES:
                    continue
                if h not in self.cache:
                    _unlink(entry.path)
                    continue
                found.append((st.st_mtime_ns, h, st.st_size))
        for _mtime, h, size in sorted(found):
            self._files[h] = size
            self.file_bytes += size

    def _put_file(self, block_hash: bytes, kv_array: np.ndarray) -> None:
        """Write the block's file once (temporary name, fsync where the Cache's
        durability asks, rename), then set its reference.

        The payload goes out in chunks, each hashed just before it is
        written, while it is in the CPU cache (one pass over memory, not
        two); the header, which holds the checksum, is written last, at the
        file's start."""
        head, payload = _file_parts(block_hash, kv_array)
        path = self._path(block_hash)
        tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
        sync = getattr(self.cache, "durability", "log") in ("fsync", "sync")
        size = len(head) + 8 + len(payload)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0),
                     0o600)
        try:
            digest = _xxh3_state(block_hash, head)
            offset = len(head) + 8
            for start in range(0, len(payload), _CHUNK):
                chunk = payload[start:start + _CHUNK]
                digest.update(chunk)
                _pwrite_all(fd, chunk, offset + start)
            crc = digest.intdigest()
            _pwrite_all(fd, memoryview(head + _U64.pack(crc)), 0)
            if sync:
                os.fsync(fd)
        except BaseException:
            os.close(fd)
            _unlink(tmp)
            raise
        os.close(fd)
        os.replace(tmp, path)
        if sync:
            _fsync_dir(self.block_dir)
        ref = _REF.pack(_REF_MAGIC, 1, size, crc)
        self.cache.set(block_hash, ref + _U32.pack(zlib.crc32(ref)))
        with self._lock:
            self.file_bytes += size - self._files.pop(block_hash, 0)
            self._files[block_hash] = size
            victims = []
            while (self.max_file_bytes is not None and self.file_bytes > self.max_file_bytes
                   and len(self._files) > 1):
                h, n = self._files.popitem(last=False)
                self.file_bytes -= n
                victims.append(h)
        for h in victims:
            self.cache.delete(h)
            _unlink(self._path(h))
        self.file_puts += 1

    def _get_file(self, block_hash: bytes, ref: bytes) -> np.ndarray:
        """The block a reference names, read with one copy from the file.

        :raises KVBlockCorruptError: a bad reference, a missing or different file.
        """
        def bad(detail: str) -> KVBlockCorruptError:
            return KVBlockCorruptError(block_hash, detail)

        size, crc = self._check_ref(block_hash, ref)
        buf = bytearray(size)
        try:
            with open(self._path(block_hash), "rb", buffering=0) as f:
                got = f.readinto(buf)
                extra = f.read(1)
        except FileNotFoundError:
            raise bad(f"its file {self._path(block_hash)} is missing") from None
        if got != size or extra:
            raise bad(f"its file {self._path(block_hash)} is not {size} bytes")
        kv = _decode(block_hash, memoryview(buf))
        if _U64.unpack_from(buf, len(buf) - kv.nbytes - 8)[0] != crc:
            raise bad(f"its file {self._path(block_hash)} holds another version of the block")
        self._touch(block_hash)
        return kv

    def _touch(self, block_hash: bytes) -> None:
        """A block file was read: it is now the most recently used."""
        with self._lock:
            if block_hash in self._files:
                self._files.move_to_end(block_hash)

    def _forget_file(self, block_hash: bytes) -> None:
        if self.block_dir is None:
            return
        with self._lock:
            self.file_bytes -= self._files.pop(block_hash, 0)
        _unlink(self._path(block_hash))

    # -- the mapping ----------------------------------------------------------

    def put(self, block_hash: bytes, kv_array: np.ndarray) -> None:
        """Store ``kv_array`` under ``block_hash`` (replacing what was there).

        Returns once the Cache's ``set`` returned (its durability applies);
        a large block's file is written before its reference.

        :raises TypeError: a bad hash or array (see :func:`encode_block`).
        :raises OSError: a block file could not be written (disk full, say).
        """
        _check_hash(block_hash)
        if self.block_dir is not None and isinstance(kv_array, np.ndarray) and (
                kv_array.nbytes >= self.file_block_bytes):
            self._put_file(block_hash, kv_array)
        else:
            self.cache.set(block_hash, encode_block(block_hash, kv_array))
            self._forget_file(block_hash)   # a smaller block replaced a file's
        self.puts += 1

    def get(self, block_hash: bytes) -> np.ndarray | None:
        """The block stored under ``block_hash``, bit-exact (dtype and shape as
        stored), or None when it is not stored, or is damaged and
        ``on_corrupt="miss"``.

        :raises KVBlockCorruptError: a damaged block with ``on_corrupt="raise"``.
        """
        return self._read(block_hash, self._get_file, decode_block)

    def _read(self, block_hash: bytes, from_file: Any, from_value: Any) -> Any:
        """Look ``block_hash`` up and read it with ``from_file(hash, reference)``
        or ``from_value(hash, stored bytes)``; their result, or None for a miss
        (not stored, another layout, or damage handled by :meth:`drop_corrupt`).
        Counts the hit or the miss."""
        data = self.cache.get(_check_hash(block_hash))
        result = None
        if data is not None:
            try:
                if isinstance(data, bytes) and data[:4] == _REF_MAGIC and self.block_dir:
                    result = from_file(block_hash, data)
                else:
                    result = from_value(block_hash, data)
            except KVBlockCorruptError as exc:
                self.drop_corrupt(exc)       # counts the miss
                return None
        if result is None:
            self.misses += 1
        else:
            self.hits += 1
        return result

    def get_into(self, block_hash: bytes, out: np.ndarray) -> bool:
        """Read the block stored under ``block_hash`` into ``out`` (a writable,
        C-contiguous array of the stored dtype and shape); True when it did.

        A large block's file is read straight into ``out``'s memory (one copy
        from the page cache); a block in the Cache is copied once. False for a
        miss, a block of another dtype or shape (left stored: a layout miss,
        not damage), or a damaged block (``on_corrupt="miss"``); ``out`` may
        then hold part of a block and must not be used.

        :raises KVBlockCorruptError: a damaged block with ``on_corrupt="raise"``.
        :raises ValueError: ``out`` is not a writable, C-contiguous array.
        """
        if not (isinstance(out, np.ndarray) and out.flags.c_contiguous and out.flags.writeable):
            raise ValueError("get_into needs a writable, C-contiguous numpy array to fill")

        def from_value(h: bytes, data: Any) -> bool | None:
            kv = _decode(h, memoryview(data).cast("B"))
            if kv.dtype != out.dtype or kv.shape != out.shape:
                return None              # another layout: a miss, left stored
            np.copyto(out, kv)
            return True

        return self._read(block_hash, lambda h, ref: self._get_file_into(h, ref, out) or None,
                          from_value) is True

    def _get_file_into(self, block_hash: bytes, ref: bytes, out: np.ndarray) -> bool:
        """:meth:`get_into` for a block file: header, then the payload read
        into ``out``; False when the stored layout is not ``out``'s."""
        size, crc = self._check_ref(block_hash, ref)
        path = self._path(block_hash)
        head_len = size - out.nbytes
        if not 0 < head_len <= 4096:
            return False                 # another size: another layout
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except FileNotFoundError:
            raise KVBlockCorruptError(block_hash, f"its file {path} is missing") from None
        head = bytearray(head_len)
        view = memoryview(out).cast("B")
        try:
            # header and payload in one system call (the payload straight into
            # ``out``, the GIL released for all of it); a byte past the end
            # finds a file that is too long
            got = os.preadv(fd, [head, view, bytearray(1)], 0)
        finally:
            os.close(fd)
        if got != size:
            raise KVBlockCorruptError(block_hash, f"its file {path} is "
                                      f"{'cut short' if got < size else f'not {size} bytes'}")
        dtype, shape, length, checksum, version, hbytes, pos = _header(
            block_hash, memoryview(head))
        if pos != head_len or dtype != out.dtype or tuple(shape) != out.shape:
            return False
        digest = None
        if version == _FILE_VERSION:
            digest = _xxh3_state(block_hash, hbytes)
            digest.update(view)          # releases the GIL too
        ok = (digest.intdigest() == checksum if digest is not None
              else _checksum_ok(block_hash, version, hbytes, view, checksum))
        if checksum != crc or not ok:
            raise KVBlockCorruptError(block_hash, "checksum mismatch (bit flip, torn write, "
                                      "or another version of the block)")
        self._touch(block_hash)
        return True

    def _check_ref(self, block_hash: bytes, ref: bytes) -> tuple[int, int]:
        """A block file reference's (file size, block checksum).

        :raises KVBlockCorruptError: a damaged or unknown reference.
        """
        if len(ref) != _REF_BYTES or zlib.crc32(ref[:_REF.size]) != _U32.unpack_from(
                ref, _REF.size)[0]:
            raise KVBlockCorruptError(block_hash, "a damaged block file reference")
        _magic, version, size, crc = _REF.unpack_from(ref)
        if version != 1:
            raise KVBlockCorruptError(block_hash, f"block file reference version {version}, "
                                      "this durablekv reads 1")
        return size, crc

    def drop_corrupt(self, exc: KVBlockCorruptError) -> None:
        """Handle a damaged block per ``on_corrupt`` (the pool calls this too
        when a block decodes but does not fit it): raise, or warn, delete it
        and count it."""
        self.corrupt += 1
        if self.on_corrupt == "raise":
            raise exc
        warnings.warn(f"{exc}; treated as a miss", KVBlockCorruptWarning, stacklevel=3)
        self.cache.delete(exc.block_hash)
        self._forget_file(exc.block_hash)
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
        """Remove a block (and its file); True when it was stored."""
        found = bool(self.cache.delete(_check_hash(block_hash)))
        self._forget_file(block_hash)
        return found


def _block_dir(cache: Any, block_dir: str | os.PathLike | None) -> str:
    if block_dir is not None:
        return os.fspath(block_dir)
    path = getattr(cache, "path", None)
    if isinstance(path, (str, os.PathLike)) and os.path.isdir(path):
        return os.path.join(os.fspath(path), "kvblocks")
    raise ConfigError(f"file_block_bytes puts large KV blocks in files, and {type(cache).__name__} "
                      f"{getattr(cache, 'path', cache)!r:.80} is not a cache in a local "
                      "directory; pass block_dir= (a local directory for the files), or "
                      "file_block_bytes=None to keep every block in the cache")


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
