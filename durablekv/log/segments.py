"""Replay log segments: the on-disk format, and reading and scanning one segment.

Pure functions over bytes and file names, no state: :class:`~durablekv.log.replaylog.ReplayLog`
appends and recovers through them, and ``durablekv check`` reads the same
segments without opening a cache.

On-disk format (all integers little-endian)
-------------------------------------------

The log is a series of segment files ``replay-<first LSN, 20 digits>.log`` in
the cache directory. A segment starts with the 8-byte magic
``b"DKVLOG1\\n"`` followed by records::

    record  = header payload
    header  = <IIQ  length u32 | crc u32 | lsn u64          (16 bytes)
    payload = <BdI  op u8 | expire_at f64 (NaN: none) | key length u32   (13 bytes)
              key bytes (durablekv.codec.encode_key)
              value bytes (the value codec; empty for a delete or clear)

``length`` is the payload's size; ``crc`` is CRC-32 (zlib) of the 12 bytes
``length, lsn`` followed by the payload. Ops: 1 set, 2 delete, 3 clear.
LSNs increase by exactly one from record to record across segments.

Damage inside a segment is searched past (:func:`_next_intact_record`) for at
most :data:`RESYNC_LIMIT` candidate offsets.

The checkpoint position (``replay.pos``)
----------------------------------------

Records at or below the store's checkpoint need no replay, but the active
segment holds them until it is sealed, so an open after a crash would parse
them all to find the few after the checkpoint. After each checkpoint the log
writes where the last record it covers lies (:class:`Position`, 44 bytes)::

    magic "DKVPOS01" | lsn u64 | segment first LSN u64 | start u64 | end u64 | crc u32

``lsn`` is a record the checkpoint covers, in the segment opened for
``segment first LSN``, at byte offsets ``start`` to ``end``; ``crc`` is CRC-32
of the 40 bytes before it. Recovery parses from ``end`` instead of from the
segment's start when the position checks out against the files
(:func:`position_refusal`): the record at ``start`` has that LSN, a good CRC
and ends at ``end``. The file is a hint, never data: it is written without
an fsync (renamed over the old one), and one that is missing, damaged, or
describes another state of the log only costs the full parse (the reason is
logged). The same idea as a database's control file (PostgreSQL's
``pg_control`` records the checkpoint's redo location so that recovery
starts there, not at the oldest WAL file), with the difference that here a
bad hint is never an error.
"""

from __future__ import annotations

import mmap
import os
import re
import struct
import zlib
from operator import itemgetter
from typing import Any, NamedTuple, Sequence

from .._accel import native as _native
from .._perms import read_private_file

__all__ = ["LogRecord", "OP_SET", "OP_DELETE", "OP_CLEAR", "MAGIC", "HEADER", "PAYLOAD",
           "POSITION_FILE", "Position", "encode_record", "list_segments", "read_position",
           "read_segment", "scan_segment", "segment_name"]


MAGIC = b"DKVLOG1\n"
HEADER = struct.Struct("<IIQ")
PAYLOAD = struct.Struct("<BdI")
assert HEADER.size == 16 and PAYLOAD.size == 13
_LEN_LSN = struct.Struct("<IQ")
_HEADER_PACK, _PAYLOAD_PACK, _LEN_LSN_PACK = HEADER.pack, PAYLOAD.pack, _LEN_LSN.pack
_crc32 = zlib.crc32
_LSN_OF = itemgetter(0)
OP_SET, OP_DELETE, OP_CLEAR = 1, 2, 3
_NAN = float("nan")
_MAX_RECORD = 1 << 31
#: records the scans of this process parsed (tests read it to see what a
#: recovery had to read)
parsed_records = 0


class LogRecord(NamedTuple):
    """One parsed record. The parser itself builds plain tuples in this field
    order (a tuple costs a fraction of a class instance, and recovery makes
    millions); :func:`read_segment` hands out ``LogRecord`` instances."""

    lsn: int
    op: int
    key: bytes
    value: bytes
    expire_at: float | None


def segment_name(first_lsn: int) -> str:
    return f"replay-{first_lsn:020d}.log"


#: A segment's file name, exactly as :func:`segment_name` makes it.
_SEGMENT_NAME = re.compile(r"replay-[0-9]{20}\.log")


def list_segments(directory: str) -> list[str]:
    """Paths of the log segments in ``directory``, oldest first.

    Only names exactly of the form :func:`segment_name` makes
    (``replay-<20 digits>.log``) are segments; any other file (a
    ``replay-abc.log``, an editor's backup, a ``*.damaged`` file salvage
    moved aside) is not, and recovery, ``durablekv check`` and salvage
    leave it alone: it is never read, cut as a torn tail, or deleted.
    """
    names = sorted(n for n in os.listdir(directory) if _SEGMENT_NAME.fullmatch(n))
    return [os.path.join(directory, n) for n in names]


def encode_record(lsn: int, op: int, key: bytes, value: bytes, expire_at: float | None) -> bytes:
    """One record's bytes (header and payload, the format above).

    :param key: the key's encoding; :param value: the value's (``b""`` for
        a delete or clear); :param expire_at: seconds on the cache's clock, or None.
    :raises struct.error: ``op`` or a length does not fit its field.
    """
    if _native is not None:
        try:
            return _native.encode_record(lsn, op, key, value, expire_at)
        except (TypeError, ValueError, OverflowError):
            pass  # the Python code below raises the error it always has
    return _py_encode_record(lsn, op, key, value, expire_at)


def _py_encode_record(lsn: int, op: int, key: bytes, value: bytes,
                      expire_at: float | None) -> bytes:
    """:func:`encode_record` in Python (the reference the C kernel matches)."""
    payload = PAYLOAD.pack(op, _NAN if expire_at is None else expire_at, len(key)) + key + value
    n = len(payload)
    crc = zlib.crc32(payload, zlib.crc32(_LEN_LSN.pack(n, lsn)))
    return HEADER.pack(n, crc, lsn) + payload


def map_segment(path: str) -> bytes:
    """A segment's bytes, memory-mapped (an ``mmap``, or ``b""`` for an empty
    file): a scan of a huge or sparse segment reads it through the page cache
    instead of copying it all into memory first. Release with :func:`unmap_segment`."""
    with open(path, "rb") as f:
        if not os.fstat(f.fileno()).st_size:
            return b""
        return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)  # type: ignore[return-value]


def unmap_segment(data: bytes) -> None:
    if isinstance(data, mmap.mmap):
        data.close()


class _Damage(Exception):
    def __init__(self, offset: int, detail: str) -> None:
        self.offset = offset
        self.detail = detail


def read_segment(path: str) -> tuple[list[LogRecord], int, _Damage | None, int]:
    """Parse one segment: ``(records, good_end_offset, damage_or_None, file_size)``.

    ``damage`` describes the first bad record; ``good_end_offset`` is where it
    starts (everything before it is valid).
    """
    with open(path, "rb") as f:
        data = f.read()
    records, good_end, damage = _parse_segment(data)
    return list(map(LogRecord._make, records)), good_end, damage, len(data)


def _parse_segment(data: bytes, pos: int | None = None, compact: bool = False
                   ) -> tuple[Any, int, _Damage | None]:
    """Parse records from ``pos`` (default: after the magic) to the first
    damage: ``(records, good_end, damage or None)``, as :func:`_py_parse_segment`.

    The C kernel, where it runs, takes every record the Python parser would
    take; at the first one it refuses, the Python parser describes the
    damage, so the errors are the same either way.

    ``compact``: with the C kernels, ``records`` is a ``_native.Records``
    (see :func:`join_records`) instead of a list: the same tuples on
    indexing and iteration, but none made until asked for.
    """
    if _native is None:
        return _py_parse_segment(data, pos)
    start = pos
    if start is None:
        if len(data) < len(MAGIC) or data[:len(MAGIC)] != MAGIC:
            return _py_parse_segment(data, pos)
        start = len(MAGIC)
    parse = _native.index_segment if compact else _native.parse_segment
    records, end, stopped = parse(data, start)
    if not stopped:
        return records, end, None
    more, end, damage = _py_parse_segment(data, end)
    return (records if not more else [*records, *more]), end, damage


def _py_parse_segment(data: bytes, pos: int | None = None
                      ) -> tuple[list[tuple], int, _Damage | None]:
    """Parse records from ``pos`` (default: after the magic) to the first damage.

    Records come back as plain ``(lsn, op, key, value, expire_at)`` tuples
    (:class:`LogRecord`'s field order). This loop is most of the cost of
    recovery, so it does the least per record:

    * The CRC input (length, LSN, payload) is the record's bytes from offset
      8 on, seeded with the CRC of the 4 length bytes (one value per
      distinct length, kept in a dict): one ``zlib.crc32`` call a record.
    * Logs mostly hold runs of records of one shape (same length, same key
      length). Once two records in a row share a shape, the rest of the run
      is read with one precompiled struct per record (header, payload
      fields, key and value in one C call). A record is taken there only if
      it has that exact shape, a good CRC and a valid op, so it is one the
      general path would take, with the same result; anything else leaves
      the run and goes through the general path, which finds the damage.
    """
    size = len(data)
    if pos is None:
        if size < len(MAGIC):
            if data[:size] == MAGIC[:size]:
                return [], 0, (_Damage(0, "segment header cut short") if size else None)
            return [], 0, _Damage(0, "not a durablekv log segment (bad magic)")
        if data[:len(MAGIC)] != MAGIC:
            return [], 0, _Damage(0, "not a durablekv log segment (bad magic)")
        pos = len(MAGIC)
    records: list[tuple] = []
    append = records.append
    unpack_header, unpack_payload = HEADER.unpack_from, PAYLOAD.unpack_from
    crc32 = _crc32
    seeds: dict[int, int] = {}
    shapes: dict[tuple[int, int], object] = {}
    hsize, psize = HEADER.size, PAYLOAD.size
    key_at = hsize + psize
    last_n = last_klen = -1
    while pos < size:
        if pos + hsize > size:
            return records, pos, _Damage(pos, "record header cut short")
        n, crc, lsn = unpack_header(data, pos)
        if n < psize or n > _MAX_RECORD:
            return records, pos, _Damage(pos, f"impossible record length {n}")
        end = pos + hsize + n
        if end > size:
            return records, pos, _Damage(pos, f"record of {n} bytes cut short at end of file")
        seed = seeds.get(n)
        if seed is None:
            seed = seeds[n] = crc32(n.to_bytes(4, "little"))
        # header = length (4) | crc (4) | lsn (8): bytes 8.. are the LSN, then the payload
        if crc32(data[pos + 8:end], seed) != crc:
            return records, pos, _Damage(pos, f"CRC mismatch in record LSN {lsn}")
        op, exp, klen = unpack_payload(data, pos + hsize)
        if not 0 < op < 4 or psize + klen > n:  # ops 1, 2, 3
            return records, pos, _Damage(pos, f"malformed record LSN {lsn}")
        k = pos + key_at + klen
        append((lsn, op, data[pos + key_at:k], data[k:end], None if exp != exp else exp))
        pos = end
        if n != last_n or klen != last_klen:
            last_n, last_klen = n, klen
            continue
        # A run of records of one shape: the rest of it, one struct call each.
        unpack = shapes.get((n, klen))
        if unpack is None:
            if len(shapes) >= 64:
                shapes.clear()
            unpack = shapes[n, klen] = struct.Struct(
                f"<IIQBdI{klen}s{n - psize - klen}s").unpack_from
        rsize = hsize + n
        end = pos + rsize
        while end <= size:
            length, crc, lsn, op, exp, key_len, key, value = unpack(data, pos)
            if length != n or key_len != klen or not 0 < op < 4 or \
                    crc32(data[pos + 8:end], seed) != crc:
                break
            append((lsn, op, key, value, None if exp != exp else exp))
            pos = end
            end += rsize
    return records, pos, None


def is_compact(records: Sequence[tuple]) -> bool:
    """Whether ``records`` is a ``_native.Records`` (not a list)."""
    return type(records) is not list


def lsns_step_by_one(records: Sequence[tuple]) -> bool:
    """Whether each record's LSN is the one before it plus one."""
    if is_compact(records):
        return records.lsns_step_by_one()  # type: ignore[attr-defined]
    first = records[0][0] if records else 0
    return list(map(_LSN_OF, records)) == list(range(first, first + len(records)))


def join_records(chunks: list[Sequence[tuple]]) -> Sequence[tuple]:
    """The records of ``chunks`` (lists of tuples or ``_native.Records``) in
    order: one ``_native.Records`` when every chunk is one, else a list.

    A ``_native.Records`` reads records in place in copies of the segments'
    bytes: ``len``, indexing (a tuple, or a ``Records`` for a slice) and
    iteration give what the list would; its bulk methods (``reduce``,
    ``decode_keys``, ``memory_forms``, ``column``, ``take``, see
    ``_native.c``) are what recovery uses instead of making a tuple, an int
    and two bytes objects per record only to free most of them.
    """
    if chunks and not any(type(c) is list for c in chunks):
        return type(chunks[0]).join(chunks)  # type: ignore[attr-defined]
    out: list[tuple] = []
    for c in chunks:
        out += c
    return out


def _record_offset(records: list[tuple], runs: list[tuple[int, int]], index: int) -> int:
    """Byte offset in its segment of ``records[index]``, parsed in ``runs``
    of ``(offset, count)`` contiguous records (damage stepped over between runs)."""
    start = 0
    for offset, count in runs:
        if index < start + count:
            fixed = HEADER.size + PAYLOAD.size
            return offset + sum(fixed + len(r[2]) + len(r[3]) for r in records[start:index])
        start += count
    raise IndexError(index)


def locate_record(directory: str, lsn: int) -> tuple[str, int]:
    """``(segment path, byte offset)`` of the record ``lsn`` in the log in
    ``directory`` (for error messages), or the directory and 0 when no
    segment holds it."""
    for path in reversed(list_segments(directory)):
        if _first_lsn_of(path) > lsn:
            continue
        data = map_segment(path)
        try:
            pos = len(MAGIC)
            while pos + HEADER.size <= len(data):
                n, _crc, at = HEADER.unpack_from(data, pos)
                if at == lsn:
                    return path, pos
                pos += HEADER.size + n
        finally:
            unmap_segment(data)
    return directory, 0


def _first_lsn_of(path: str) -> int:
    """The first LSN a segment was opened for, from its name."""
    name = os.path.basename(path)
    try:
        return int(name[len("replay-"):-len(".log")])
    except ValueError:
        return 0


POSITION_FILE = "replay.pos"
POSITION_MAGIC = b"DKVPOS01"
_POSITION = struct.Struct("<8sQQQQ")
POSITION_SIZE = _POSITION.size + 4
assert POSITION_SIZE == 44


class Position(NamedTuple):
    """Where a record the store's checkpoint covers lies in the log (see
    "The checkpoint position" above).

    :ivar lsn: the record's LSN.
    :ivar segment_lsn: the first LSN of the segment holding it (its name,
        :func:`segment_name`).
    :ivar start: byte offset of the record in that segment.
    :ivar end: byte offset just after it, where the records after it begin.
    """

    lsn: int
    segment_lsn: int
    start: int
    end: int

    def encode(self) -> bytes:
        """The 44 bytes of ``replay.pos``."""
        body = _POSITION.pack(POSITION_MAGIC, *self)
        return body + _crc32(body).to_bytes(4, "little")


def read_position(directory: str) -> tuple[Position | None, str | None]:
    """``(position, None)`` from ``replay.pos`` in ``directory``, or ``(None,
    why)`` when it is missing (``why`` None then), unreadable or damaged."""
    data, why = read_private_file(os.path.join(directory, POSITION_FILE), POSITION_SIZE)
    if data is None:
        return None, why
    if len(data) != POSITION_SIZE:
        return None, f"it holds {len(data)} bytes, not {POSITION_SIZE}"
    body = data[:-4]
    if int.from_bytes(data[-4:], "little") != _crc32(body):
        return None, "its CRC does not match (a save cut short)"
    magic, *fields = _POSITION.unpack(body)
    if magic != POSITION_MAGIC:
        return None, "not a durablekv checkpoint position (bad magic)"
    return Position(*fields), None


def position_refusal(data: bytes, pos: Position, after_lsn: int) -> str | None:
    """Why ``pos`` may not be resumed from in the segment ``data`` whose
    first LSN is ``pos.segment_lsn``, with the store's checkpoint at
    ``after_lsn``; None when it may.

    It may when the store's checkpoint covers the record (``pos.lsn <=
    after_lsn``) and the segment holds exactly that record at ``pos.start``
    to ``pos.end``: right magic, a whole record there, that LSN, a good CRC.
    Every record before it then has a smaller LSN (LSNs increase through a
    segment), so the store holds them all.
    """
    lsn, first, start, end = pos
    if lsn > after_lsn:
        return (f"it is for LSN {lsn}, past the store's checkpoint {after_lsn} (a store "
                "older than the log, or rebuilt)")
    if lsn < first:
        return f"LSN {lsn} cannot be in the segment opened for LSN {first}"
    if data[:len(MAGIC)] != MAGIC:
        return "the segment's header is damaged"
    hsize = HEADER.size
    if not len(MAGIC) <= start or start + hsize + PAYLOAD.size > end or end > len(data):
        return f"offsets {start} to {end} do not fit the segment's {len(data)} bytes"
    n, crc, at = HEADER.unpack_from(data, start)
    if hsize + n != end - start or at != lsn:
        return f"no record of LSN {lsn} lies at offsets {start} to {end}"
    if _crc32(data[start + 8:end], _crc32(n.to_bytes(4, "little"))) != crc:
        return f"the record of LSN {lsn} at offset {start} fails its CRC"
    return None


class SegmentScan(NamedTuple):
    """What :func:`scan_segment` found in one segment.

    :ivar records: the intact records, as plain ``(lsn, op, key, value,
        expire_at)`` tuples, in file order.
    :ivar runs: ``(offset, count)`` of each run of contiguous records parsed
        (a run ends at damage that was stepped over).
    :ivar stepped_over: ``(damage, resume_offset, why)`` for each damage
        stepped over because it can hide no record after ``after_lsn`` (see
        :func:`scan_segment`); ``resume_offset`` is the next intact record,
        or None when the damage runs to the end of the file (the next
        segment continues the log); ``why`` says why nothing is lost.
    :ivar damage: the first damage not stepped over, or None; parsing
        stopped there.
    :ivar good_end: where ``damage`` starts (the file size when None).
    :ivar intact_after: an intact record lies behind ``damage``.
    :ivar unused_end: the segment ends in the unused, zero-filled end of a
        preallocated segment (see :func:`is_unused_end`), from ``good_end``
        to the end of the file; not damage (``damage`` is None).
    :ivar resumed: the checkpoint position the scan started from, or None
        (it parsed the whole segment).
    :ivar resume_refused: why the position given was not used, or None.
    :ivar torn_unused: when ``damage`` is a torn tail (the last segment, no
        intact record behind it): how many of the bytes from ``good_end`` to
        the end of the file are the unused, zero-filled end of a preallocated
        segment after the torn record (see :func:`split_torn_tail`); 0
        otherwise. The torn record is the rest.
    """

    records: list[tuple]
    runs: list[tuple[int, int]]
    stepped_over: list[tuple[_Damage, int | None, str]]
    damage: _Damage | None
    good_end: int
    intact_after: bool
    unused_end: bool = False
    resumed: Position | None = None
    resume_refused: str | None = None
    torn_unused: int = 0


#: A mapped segment grows by whole preallocation steps, each a multiple of
#: this many bytes (see ``ReplayLog(prealloc_bytes=)``).
PREALLOC_ALIGN = 4096


def is_unused_end(data: bytes, good_end: int) -> bool:
    """Whether ``data[good_end:]`` is the unused end of a preallocated
    (mapped) segment: not empty, every byte zero, and the file's size a
    multiple of :data:`PREALLOC_ALIGN`.

    The first unused byte is found exactly: a record's length field is at
    least 13, so a record never starts with the four zero bytes there, and
    a record stored into the mapping is either whole or has nonzero bytes
    where it was cut. A zero-filled tail of any other size is what a power
    loss leaves behind appends made with write(2): a torn tail, as before.
    """
    size = len(data)
    return (good_end < size and size % PREALLOC_ALIGN == 0
            and _next_nonzero(data, good_end) is None)


def split_torn_tail(data: bytes, offset: int) -> tuple[int, int]:
    """``(torn, unused)``: how the torn tail ``data[offset:]`` of a last
    segment divides into the torn record and the unused, zero-filled end of a
    preallocated segment after it.

    A process killed while it stored a record into a mapped segment leaves
    the record torn (some of its bytes stored) and the rest of the
    preallocated file zero-filled, as :func:`is_unused_end` describes. The
    torn record ends where its length field says, when that end lies within
    the file and only zeros follow it; otherwise (a length field cut short or
    garbage) at its last nonzero byte. ``unused`` is 0 unless the file's
    size is a multiple of :data:`PREALLOC_ALIGN`: a zero-filled tail of any
    other size is what a power loss leaves behind write(2) appends, all of
    it torn.
    """
    size = len(data)
    if offset >= size or size % PREALLOC_ALIGN:
        return size - offset, 0
    end = None
    if offset + HEADER.size <= size:
        n = HEADER.unpack_from(data, offset)[0]
        if PAYLOAD.size <= n <= _MAX_RECORD and offset + HEADER.size + n <= size:
            end = offset + HEADER.size + n
    if end is None or _next_nonzero(data, end) is not None:
        end = _last_nonzero_end(data, offset)
        if end == offset:  # all zeros: no record to tell apart (is_unused_end's case)
            return size - offset, 0
    return end - offset, size - end


def scan_segment(data: bytes, after_lsn: int, next_segment: str | None,
                 first_lsn: int | None = None, resume: Position | None = None,
                 compact: bool = False) -> SegmentScan:
    """Parse a segment's bytes as recovery does, given the checkpoint ``after_lsn``.

    ``next_segment`` is the path of the segment after this one (None for the
    last); ``first_lsn`` is the LSN this segment was opened for (from its
    name, :func:`segment_name`). Damage is stepped over when it can hide no
    record the store lacks: the first record behind it (the next intact
    record in this file, else the first of the next segment) has an LSN at
    or below ``after_lsn + 1``, or exactly one more than the record before
    the damage (``first_lsn`` when the damage comes before any record, as
    in a damaged segment header), so no record fits in between. Parsing
    stops at any other damage.

    Damage in the LAST segment with no intact record behind it is a torn
    write from a crash (``intact_after`` False): a crash can only damage the
    end of the log (the record being appended is cut short, or after a power
    loss on some file systems the tail is zero-filled or holds garbage). An
    intact record behind the damage means the middle of the log is corrupt,
    and dropping the tail would drop acknowledged writes.

    ``resume``: a checkpoint position in this segment (see
    :func:`read_position`). When it checks out (:func:`position_refusal`),
    parsing starts at its end, as if the record there were the segment's
    first: the records before it are all in the store. Otherwise the whole
    segment is parsed and ``resume_refused`` says why.

    ``compact``: ``records`` may be a ``_native.Records`` (see
    :func:`_parse_segment`) when one run holds them all; a list otherwise.
    """
    global parsed_records
    records: Sequence[tuple] = []
    runs: list[tuple[int, int]] = []
    stepped: list[tuple[_Damage, int | None, str]] = []
    pos: int | None = None
    resumed = refused = None
    if resume is not None:
        refused = position_refusal(data, resume, after_lsn)
        if refused is None:
            resumed, pos, first_lsn = resume, resume.end, resume.lsn + 1

    def scan(damage: _Damage | None, good_end: int, intact_after: bool,
             unused_end: bool = False) -> SegmentScan:
        torn_unused = 0
        if damage is not None and next_segment is None and not intact_after:
            torn_unused = split_torn_tail(data, good_end)[1]
        return SegmentScan(records, runs, stepped, damage, good_end, intact_after, unused_end,
                           resumed, refused, torn_unused)

    def hides_nothing(lsn_behind: int) -> str | None:
        if lsn_behind <= after_lsn + 1:
            return "the records there are already in the store"
        before = records[-1][0] if records else first_lsn and first_lsn - 1
        if before and lsn_behind == before + 1:
            return f"it holds no record: LSN {lsn_behind} follows {before}"
        return None

    while True:
        recs, good_end, damage = _parse_segment(data, pos, compact)
        parsed_records += len(recs)
        runs.append((len(MAGIC) if pos is None else pos, len(recs)))
        records = recs if not records else [*records, *recs]
        if damage is None:
            return scan(None, good_end, False)
        try:
            nxt = _next_intact_record(data, damage.offset + 1)
        except _ResyncGaveUp as gave_up:
            # Whether intact records lie behind is not known: not a torn
            # tail to cut, but damage to refuse (salvage keeps the prefix).
            damage.detail += (f"; no intact record found in the {gave_up.stop - gave_up.start} "
                              f"bytes after it that are not zero-filled (the search stops "
                              f"after {RESYNC_LIMIT} offsets), the {len(data) - gave_up.stop} "
                              "bytes from there on were not searched")
            return scan(damage, good_end, True)
        if nxt is not None:
            why = hides_nothing(HEADER.unpack_from(data, nxt)[2])
            if why:
                stepped.append((damage, nxt, why))
                pos = nxt
                continue
        elif next_segment is not None:
            why = hides_nothing(_first_lsn_of(next_segment))
            if why:
                stepped.append((damage, None, why))
                return scan(None, len(data), False)
        elif damage.offset == good_end and is_unused_end(data, good_end):
            return scan(None, good_end, False, True)
        return scan(damage, good_end, nxt is not None)


def scan_segment_file(path: str, after_lsn: int, next_segment: str | None,
                      resume: Position | None = None, compact: bool = False
                      ) -> tuple[SegmentScan, int]:
    """:func:`scan_segment` of the segment file ``path`` (memory-mapped, see
    :func:`map_segment`): ``(scan, file size)``. A compact ``records`` holds
    a copy of the bytes it parsed, not the mapping."""
    data = map_segment(path)
    try:
        return (scan_segment(data, after_lsn, next_segment, _first_lsn_of(path), resume,
                             compact), len(data))
    finally:
        unmap_segment(data)


def start_gap_detail(checkpoint: int, first: int) -> str:
    """Why a log whose first record after the store's checkpoint is LSN
    ``first`` (not ``checkpoint + 1``) cannot be replayed."""
    return (f"the store's checkpoint is LSN {checkpoint} but the log continues at LSN {first}: "
            f"records {checkpoint + 1} to {first - 1}, acknowledged but never stored, are "
            "missing; pages.sqlite3 is older than the log (put back from a backup, or its "
            "-wal file deleted) or was replaced")


#: Most candidate offsets (bytes that are not part of a zero-filled run) a
#: resync search after damage tries before it gives up: bounds the time a
#: segment full of garbage can cost (about a second) while a damaged record
#: or a torn region of a few MiB in front of intact records is still stepped over.
RESYNC_LIMIT = 4 << 20
_ZERO_BLOCKS = {1 << i: bytes(1 << i) for i in range(6, 17)}


def _next_nonzero(data: bytes, start: int) -> int | None:
    """Offset of the first nonzero byte of ``data`` at or after ``start``, or
    None. Compares chunks that double from 64 bytes to 64 KiB against zeros
    (a memcmp): a short zero run (inside a record) costs one small chunk, and
    the zero-filled end of a preallocated segment (up to a MiB) goes at
    memory speed, where a regular expression or ``lstrip`` is about a
    hundred times slower; only the chunk holding the byte is stripped."""
    size, step = len(data), 64
    pos = start
    while pos < size:
        chunk = data[pos:pos + step]
        if chunk != (_ZERO_BLOCKS.get(len(chunk)) or bytes(len(chunk))):
            return pos + len(chunk) - len(chunk.lstrip(b"\0"))
        pos += step
        step = min(step * 2, 64 << 10)
    return None


def _last_nonzero_end(data: bytes, start: int) -> int:
    """Offset just past the last nonzero byte of ``data`` at or after
    ``start`` (``start`` when there is none): :func:`_next_nonzero` from the
    end, in chunks that double from 64 bytes to 64 KiB."""
    pos, step = len(data), 64
    while pos > start:
        lo = max(start, pos - step)
        chunk = data[lo:pos]
        if chunk != (_ZERO_BLOCKS.get(len(chunk)) or bytes(len(chunk))):
            return lo + len(chunk.rstrip(b"\0"))
        pos = lo
        step = min(step * 2, 64 << 10)
    return start


#: Candidate offsets tried by resync searches in this process (tests read it
#: to bound the work a damaged tail costs).
resync_probes = 0


class _ResyncGaveUp(Exception):
    """The resync search tried :data:`RESYNC_LIMIT` offsets and found nothing."""

    def __init__(self, start: int, stop: int) -> None:
        self.start, self.stop = start, stop


def _next_intact_record(data: bytes, start: int) -> int | None:
    """Offset of the first record at or after ``start`` whose CRC checks out.

    Zero-filled runs (what a crash or power loss leaves at the end of a file,
    and what a sparse file reads as) are skipped in C, a block at a time: a
    record's length field is at least 13, so a record cannot start where
    four zero bytes do.

    :raises _ResyncGaveUp: :data:`RESYNC_LIMIT` other offsets were tried.
    """
    global resync_probes
    hsize, psize = HEADER.size, PAYLOAD.size
    size = len(data)
    unpack = HEADER.unpack_from
    stop = size - hsize - psize + 1
    pos = start
    probes = 0
    try:
        while pos < stop:
            if not data[pos] and data[pos:pos + 4] == b"\0\0\0\0":
                nonzero = _next_nonzero(data, pos + 4)
                if nonzero is None:
                    return None
                pos = max(pos + 1, nonzero - 3)
                continue
            probes += 1
            if probes > RESYNC_LIMIT:
                raise _ResyncGaveUp(start, pos)
            n, crc, lsn = unpack(data, pos)
            if psize <= n and pos + hsize + n <= size:
                payload = data[pos + hsize:pos + hsize + n]
                if zlib.crc32(payload, zlib.crc32(_LEN_LSN.pack(n, lsn))) == crc:
                    return pos
            pos += 1
        return None
    finally:
        resync_probes += probes
