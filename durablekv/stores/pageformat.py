"""The page blob format: one page's entries as bytes, and back.

Every store keeps pages as these blobs (the SQLite store in ``pages.data``,
the PostgreSQL store in a ``bytea``); the cache encodes them in
``durablekv.writeback`` and decodes them on a page fault. Pure functions, no
I/O.

Page blob format, version 2 (little-endian, columnar, so that a page fault
reads every header with one ``struct`` call and every key with one decode)::

    blob    = marker n flags slots [expires] klens vlens keys values
    marker  = u16 0xFFFF (a version-1 page starts with a slot number < 0xFFFF)
    n       = u16, entries in the page;  flags = u8, bits below
    slots   = n x u16
    expires = n x f64, NaN for none; left out when flag NO_TTL is set
    klens   = n x u32;  vlens = n x u32: byte lengths of each key and value
    keys    = the n keys back to back: each key's encoding
              (:func:`durablekv.codec.encode_key`); with flag ASCII_KEYS
              (every key a str of ASCII characters) just the characters;
              with flag INT_KEYS (every key an int in int64 range) n x i64
    values  = the n values back to back: each value's encoding (the cache's
              value codec), or with flag RAW_BYTES (every value ``bytes``
              under the safe codec) just the bytes

Version 1 (read, never written): for each used slot a header ``<HdII`` =
(slot, expire_at or NaN, key length, value length), the encoded key, then
the encoded value. Schema version 2 marks stores that may hold version-2
pages, so an older durablekv refuses them instead of misreading them.
"""

from __future__ import annotations

import functools
import struct
import zlib
from itertools import accumulate
from typing import Any, Iterator, Sequence

from .._accel import native as _native

__all__ = ["encode_page", "encode_columns", "decode_page", "split_page", "page_layout", "entry_sizes",
           "page_columns", "page_crc", "ASCII_KEYS", "RAW_BYTES", "NO_TTL", "INT_KEYS",
           "PAGE_SIZE_MAX"]

_ENTRY = struct.Struct("<HdII")  # a version-1 page entry header


assert _ENTRY.size == 18


_N_FLAGS = struct.Struct("<HB")


_U32 = struct.Struct("<I")


_NAN = float("nan")


_PID_N = struct.Struct("<qI")


def page_crc(page_id: int, n_entries: int, data: bytes) -> int | None:
    """The checksum stored beside a page (``pages.crc``, schema version 3):
    CRC-32 (zlib) of ``<qI`` (page id, entry count) followed by the blob, so
    a flipped bit in the blob, a wrong entry count, or a blob copied into
    another page's row is found when the page is read.

    :returns: the checksum (a u32), or None for fields no page can have (a
        page id outside int64, a count outside u32, a blob that is not
        bytes), which then match no stored checksum.
    """
    if type(data) is not bytes:
        return None
    try:
        head = _PID_N.pack(page_id, n_entries)
    except (struct.error, TypeError):
        return None
    return zlib.crc32(data, zlib.crc32(head))


def encode_page(entries: Sequence[tuple[int, bytes, bytes, float | None]]) -> bytes:
    """Pack ``(slot, key_bytes, value_bytes, expire_at)`` entries into a
    version-2 page blob (see the module docstring). ``key_bytes`` is the
    key's :func:`~durablekv.codec.encode_key` form, ``value_bytes`` the
    value codec's."""
    kbs = [e[1] for e in entries]
    vbs = [e[2] for e in entries]
    flags = 0
    if all(kb[:1] == b"s" for kb in kbs):
        body = [kb[5:] for kb in kbs]
        if all(map(bytes.isascii, body)):
            kbs = body
            flags |= ASCII_KEYS
    elif all(kb[:1] == b"q" and len(kb) == 9 for kb in kbs):
        kbs = [kb[1:] for kb in kbs]
        flags |= INT_KEYS
    if all(vb[:1] == b"b" and len(vb) >= 5 and _U32.unpack_from(vb, 1)[0] == len(vb) - 5
           for vb in vbs):
        # exactly the safe codec's bytes encoding, so the tag and length can
        # be dropped here and rebuilt from the column on read, losslessly
        vbs = [vb[5:] for vb in vbs]
        flags |= RAW_BYTES
    return encode_columns([e[0] for e in entries], kbs, vbs, [e[3] for e in entries], flags)


def encode_columns(slots: Sequence[int], kbs: Sequence[bytes], vbs: Sequence[bytes],
                   expires: Sequence[float | None], flags: int) -> bytes:
    """A version-2 page blob from parallel columns, keys and values already
    in the form ``flags`` names (ASCII_KEYS: bare ASCII text; INT_KEYS: bare
    int64; RAW_BYTES: bare bytes; otherwise their encodings). NO_TTL is
    added here when no entry has an expire_at.

    :raises struct.error: a slot, the entry count or a length does not fit its field.
    """
    if _native is not None:
        data = _native.encode_columns(slots, kbs, vbs, expires, flags)
        if data is not None:
            return data
        # input of a shape the kernel leaves to the code below (which raises
        # for what does not fit)
    return _py_encode_columns(slots, kbs, vbs, expires, flags)


def _py_encode_columns(slots: Sequence[int], kbs: Sequence[bytes], vbs: Sequence[bytes],
                       expires: Sequence[float | None], flags: int) -> bytes:
    """:func:`encode_columns` in Python (the reference the C kernel matches)."""
    n = len(slots)
    if expires.count(None) == n:
        head = _columns(n, False).pack(0xFFFF, n, flags | NO_TTL, *slots,
                                      *map(len, kbs), *map(len, vbs))
    else:
        head = _columns(n, True).pack(0xFFFF, n, flags, *slots,
                                     *[_NAN if x is None else x for x in expires],
                                     *map(len, kbs), *map(len, vbs))
    return b"".join((head, *kbs, *vbs))


ASCII_KEYS, RAW_BYTES, NO_TTL, INT_KEYS = 1, 2, 4, 8


_FLAGS = ASCII_KEYS | RAW_BYTES | NO_TTL | INT_KEYS


_COLUMNS: dict[tuple[int, bool], struct.Struct] = {}


def _columns(n: int, ttl: bool) -> struct.Struct:
    """The ``struct`` of a version-2 page header with ``n`` entries (cached)."""
    st = _COLUMNS.get((n, ttl))
    if st is None:
        st = _COLUMNS[n, ttl] = struct.Struct(f"<HHB{n}H{n if ttl else 0}d{n}I{n}I")
    return st


def split_page(data: bytes) -> tuple[Sequence[int], list[float | None], list[bytes], list[bytes]]:
    """``(slots, expires, key_bytes, value_bytes)`` of a page blob of either
    version, as parallel sequences; keys and values in their encoded form.

    :raises ValueError: the blob is damaged (truncated, lengths that do not
        add up to its size).
    """
    if data[:2] != b"\xff\xff":
        entries = list(_decode_v1(data))
        return ([e[0] for e in entries], [e[3] for e in entries],
                [e[1] for e in entries], [e[2] for e in entries])
    slots, exps, flags, kpos, vpos = page_layout(data)
    kbs = [data[a:b] for a, b in zip(kpos, kpos[1:])]
    if flags & ASCII_KEYS:
        kbs = [b"s" + _U32.pack(len(kb)) + kb for kb in kbs]
    elif flags & INT_KEYS:
        kbs = [b"q" + kb for kb in kbs]
    vbs = [data[a:b] for a, b in zip(vpos, vpos[1:])]
    if flags & RAW_BYTES:
        vbs = [b"b" + _U32.pack(len(vb)) + vb for vb in vbs]
    return slots, exps, kbs, vbs


def entry_sizes(data: bytes) -> list[int]:
    """The stored size in bytes (key + value, as the blob holds them) of each
    entry of a page blob of either version, in the blob's order (that of
    :func:`split_page`'s slots).

    :raises ValueError: the blob is damaged.
    """
    if data[:2] != b"\xff\xff":
        return [len(e[1]) + len(e[2]) for e in _decode_v1(data)]
    _slots, _exps, _flags, klens, vlens, _start = _page_header(data)
    return [a + b for a, b in zip(klens, vlens)]


def page_layout(data: bytes) -> tuple[Sequence[int], list[float | None], int, list[int],
                                      list[int]]:
    """Parse a version-2 page header: ``(slots, expires, flags, key_offsets,
    value_offsets)``; key ``i`` is ``data[key_offsets[i]:key_offsets[i + 1]]``
    and likewise for values (each offsets list has ``n + 1`` items).

    :raises ValueError: the blob is damaged.
    """
    slots, exps, flags, klens, vlens, start = _page_header(data)
    kpos = list(accumulate(klens, initial=start))
    vpos = list(accumulate(vlens, initial=kpos[-1]))
    return slots, exps, flags, kpos, vpos


def _page_header(data: bytes) -> tuple[Sequence[int], list[float | None], int, Sequence[int],
                                       Sequence[int], int]:
    """Parse and check a version-2 page header: ``(slots, expires, flags,
    key_lengths, value_lengths, header_size)``.

    :raises ValueError: the blob is damaged (cut short, lengths that do not
        add up to its size, impossible flags, int keys not 8 bytes each).
    """
    if len(data) < 5:
        raise ValueError("truncated page header")
    n, flags = _N_FLAGS.unpack_from(data, 2)
    ttl = not flags & NO_TTL
    st = _columns(n, ttl)
    start = st.size
    if len(data) < start:
        raise ValueError(f"page header for {n} entries runs past the page end")
    cols = st.unpack_from(data)
    slots = cols[3:3 + n]
    if ttl:
        exps = [None if e != e else e for e in cols[3 + n:3 + 2 * n]]
        klens, vlens = cols[3 + 2 * n:3 + 3 * n], cols[3 + 3 * n:]
    else:
        exps = [None] * n
        klens, vlens = cols[3 + n:3 + 2 * n], cols[3 + 2 * n:]
    end = start + sum(klens) + sum(vlens)
    if end != len(data):
        raise ValueError(f"entry lengths add up to {end} bytes, the page holds {len(data)}")
    if flags & ~_FLAGS or flags & ASCII_KEYS and flags & INT_KEYS:
        raise ValueError(f"page flags {flags:#04x} are not a valid combination")
    if flags & INT_KEYS and klens.count(8) != n:
        raise ValueError(f"an int-key page of {n} entries has keys that are not 8 bytes")
    return slots, exps, flags, klens, vlens, start


def page_columns(data: bytes) -> tuple[Sequence[int], list[float | None], int, list[Any],
                                        list[bytes]]:
    """Decode a version-2 page blob into ``(slots, expires, flags, keys,
    values)`` for a page fault: ``keys`` are str (ASCII_KEYS), int
    (INT_KEYS) or else the keys' encoded bytes; ``values`` are bare bytes
    (RAW_BYTES) or else the value codec's blobs. A column whose entries all
    have one length (fixed-width keys, fixed-size values) is cut with one
    cached ``struct`` call instead of a slice per entry.

    :raises ValueError: the blob is damaged (also UnicodeDecodeError for
        ASCII keys that are not ASCII).
    """
    if _native is not None:
        cols = _native.page_columns(data)
        if cols is not None:
            return cols
        # damaged, or not a version-2 blob: the code below raises its error
    return _py_page_columns(data)


def _py_page_columns(data: bytes) -> tuple[Sequence[int], list[float | None], int, list[Any],
                                           list[bytes]]:
    """:func:`page_columns` in Python (the reference the C kernel matches)."""
    slots, exps, flags, klens, vlens, start = _page_header(data)
    vstart = start + sum(klens)
    if flags & INT_KEYS:
        keys: list[Any] = list(_int64s(len(slots)).unpack_from(data, start))
    elif flags & ASCII_KEYS:
        keys = _cut(data[start:vstart].decode("ascii"), klens, 0)
    else:
        keys = _cut(data, klens, start)
    return slots, exps, flags, keys, _cut(data, vlens, vstart)


@functools.lru_cache(maxsize=512)
def _fixed(n: int, size: int) -> struct.Struct:
    """``n`` consecutive pieces of ``size`` bytes."""
    return struct.Struct(f"{size}s" * n)


@functools.lru_cache(maxsize=None)
def _int64s(n: int) -> struct.Struct:
    """``n`` little-endian int64s (the keys of an INT_KEYS page)."""
    return struct.Struct(f"<{n}q")


def _cut(buf: Any, lens: Sequence[int], pos: int) -> list[Any]:
    """``buf`` (bytes or str) cut into consecutive pieces of ``lens`` from ``pos``."""
    n = len(lens)
    if n and lens.count(lens[0]) == n:
        size = lens[0]
        if type(buf) is bytes:
            return list(_fixed(n, size).unpack_from(buf, pos))
        if size:
            return [buf[i:i + size] for i in range(pos, pos + n * size, size)]
    ends = list(accumulate(lens, initial=pos))
    return [buf[a:b] for a, b in zip(ends, ends[1:])]


def decode_page(data: bytes) -> Iterator[tuple[int, bytes, bytes, float | None]]:
    """Inverse of :func:`encode_page`, for either version: yields
    ``(slot, key_bytes, value_bytes, expire_at)``.

    :raises ValueError: the blob is damaged.
    """
    if data[:2] != b"\xff\xff":
        yield from _decode_v1(data)
        return
    slots, exps, kbs, vbs = split_page(data)
    yield from zip(slots, kbs, vbs, exps)


def _decode_v1(data: bytes) -> Iterator[tuple[int, bytes, bytes, float | None]]:
    pos, end = 0, len(data)
    unpack = _ENTRY.unpack_from
    size = _ENTRY.size
    count = 0
    while pos < end:
        count += 1
        if count > PAGE_SIZE_MAX:
            raise ValueError(f"more than {PAGE_SIZE_MAX} entries (the most a page can hold)")
        if pos + size > end:
            raise ValueError(f"truncated entry header at byte {pos}")
        slot, exp, kl, vl = unpack(data, pos)
        pos += size
        if pos + kl + vl > end:
            raise ValueError(f"entry at byte {pos - size} runs past the page end")
        kb = data[pos:pos + kl]
        pos += kl
        vb = data[pos:pos + vl]
        pos += vl
        yield slot, kb, vb, (None if exp != exp else exp)


#: Most slots a page may have (a slot number is a u16 in the page blob);
#: the constructor's bound on ``page_size``, and the bound on the stored one.
PAGE_SIZE_MAX = 65535
