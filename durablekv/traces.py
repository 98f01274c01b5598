"""Read cache access traces (and a synthetic Zipf workload) as a stream of requests.

Every reader yields :class:`Request` tuples ``(op, key, size, ttl, time)`` where
``op`` is ``"get"``, ``"set"`` or ``"delete"``, ``size`` is the value size in
bytes, ``ttl`` is seconds from ``time`` (None = no expiry) and ``time`` is the
trace's own clock in seconds (None when the trace has none). A :class:`Trace`
re-reads its file on every ``iter()``, so it can be replayed several times.

Formats (``FORMATS``) and how they map to requests:

``arc`` (``*.lis``)
    The ARC traces of Megiddo & Modha (USENIX FAST 2003), e.g. ``OLTP.lis``.
    Text, one line per request: ``start_block block_count ignored request_number``
    (space separated integers). A line expands to ``block_count`` gets of keys
    ``start_block``, ``start_block + 1``, ...; blocks are 512-byte pages, so
    ``size`` is 512. Reads only; no clock.
``i32be`` / ``i64be`` (``*.i32be`` / ``*.i64be``)
    Raw keys as used by the Caffeine simulator (cache2k ``orm-busy``, Scarab
    ``recs``): a headerless sequence of 32- or 64-bit big-endian signed
    integers. Every record is a get of that integer key, size 0, no clock.
``cloudphysics``
    CloudPhysics VMware block I/O (Waldspurger et al., FAST 2015; sample from
    libCacheSim). CSV with header ``version,time,op,size,lbn``. ``op`` is the
    SCSI opcode in hex: ``28`` READ(10) -> get, ``2a`` WRITE(10) -> set (the
    6-, 12- and 16-byte variants ``08/a8/88`` and ``0a/aa/8a`` too).
    key = ``lbn`` (int), size = ``size`` bytes, time = ``time`` seconds.
``cachelib``
    Meta key-value cache traces replayed by CacheLib's cachebench. CSV whose
    header has at least ``key`` and ``op``; ``op_time``, ``op_count``,
    ``size`` and ``ttl`` are used when present (columns are found by name,
    so any order works). ``GET``/``GET_LEASE`` -> get, ``SET``/``SET_LEASE``
    -> set, ``DELETE`` -> delete. A row stands for ``op_count`` identical
    requests. key stays a str; ttl 0 = none; time = ``op_time``.
``twitter``
    Twitter's twemcache traces (Yang et al., OSDI 2020). Headerless CSV
    ``timestamp,key,key_size,value_size,client_id,operation,ttl``. get/gets ->
    get; set/add/replace/cas/append/prepend/incr/decr -> set; delete ->
    delete. size = value_size, ttl 0 = none, time = timestamp. The key may
    contain commas (the first field is split from the left, the last five
    from the right).

:func:`detect_format` picks the format from the file name (``.lis``,
``.i32be``, ``.i64be``) or else from the first line (CSV header, or a line
that parses as a Twitter record). Anything malformed raises
:class:`~durablekv.errors.TraceFormatError` with the file and the line (text)
or record number (binary); a missing file raises ``FileNotFoundError``.
"""

from __future__ import annotations

import array
import csv
import os
import random
import stat
import sys
from functools import partial
from itertools import accumulate, repeat
from typing import IO, Iterator, NamedTuple

from .errors import ConfigError, TraceFormatError

__all__ = ["FORMATS", "Request", "Trace", "ZipfWorkload", "detect_format", "open_trace", "zipf_workload"]


class Request(NamedTuple):
    """One cache request."""

    op: str  #: "get", "set" or "delete"
    key: object  #: int for the integer traces, str for string keys
    size: int  #: value size in bytes (0 when the trace has none)
    ttl: float | None  #: seconds from ``time``; None = no expiry
    time: float | None  #: the trace's timestamp in seconds; None = no clock


FORMATS = ("arc", "i32be", "i64be", "cloudphysics", "cachelib", "twitter")

_EXTENSIONS = {".lis": "arc", ".i32be": "i32be", ".i64be": "i64be"}
_COMPRESSED = {".gz", ".xz", ".zst", ".bz2", ".lz4", ".zip"}
_WIDTH = {"i32be": 4, "i64be": 8}
_TYPECODE = {w: next(c for c in "hilq" if array.array(c).itemsize == w) for w in (4, 8)}
_CHUNK = 1 << 20  # bytes per read of a binary trace (a multiple of 8)
_SCSI_OPS = dict.fromkeys(("28", "08", "a8", "88"), "get") | dict.fromkeys(("2a", "0a", "aa", "8a"), "set")
_CACHELIB_OPS = {"GET": "get", "GET_LEASE": "get", "SET": "set", "SET_LEASE": "set", "DELETE": "delete"}
_TWITTER_OPS = {"get": "get", "gets": "get", "delete": "delete"} | dict.fromkeys(
    ("set", "add", "replace", "cas", "append", "prepend", "incr", "decr"), "set"
)
_TWITTER_LAYOUT = "'timestamp,key,key_size,value_size,client_id,operation,ttl'"
_ARC_LAYOUT = "4 space-separated integers 'start_block block_count ignored request_number'"

# Builds a Request from a 5-tuple in C (about twice as fast as Request(...)).
_new = partial(tuple.__new__, Request)


def detect_format(path: str | os.PathLike) -> str:
    """Return the format name (one of :data:`FORMATS`) of the trace at ``path``.

    Decided by the extension (``.lis`` -> arc, ``.i32be``, ``.i64be``, case
    insensitive) or else by the first line: a CloudPhysics header
    (``version,time,op,size,lbn``), a CSV header with ``key`` and ``op``
    columns (cachelib), or a headerless Twitter record.

    :raises TraceFormatError: compressed, empty, binary or unrecognised file.
    :raises FileNotFoundError: the file does not exist (content sniffing only).
    """
    path = os.fspath(path)
    ext = os.path.splitext(path)[1].lower()
    if ext in _EXTENSIONS:
        return _EXTENSIONS[ext]
    if ext in _COMPRESSED:
        raise TraceFormatError(path, None, f"{ext} is a compressed file; decompress it first "
                               "(xz -d, zstd -d, gunzip ...) and pass the uncompressed trace")
    with _open(path) as f:
        raw = f.readline(1 << 16)
    text = _decode(path, 1, raw, "and its name does not end in .lis, .i32be or .i64be "
                   "(pass format='i32be' or 'i64be' for raw binary keys)").lstrip("\ufeff").strip()
    columns = {c.strip().lower() for c in next(csv.reader([text]), [])}
    if {"time", "op", "size", "lbn"} <= columns:
        return "cloudphysics"
    if {"key", "op"} <= columns:
        return "cachelib"
    fields = _split_twitter(text)
    if fields and fields[5].strip().lower() in _TWITTER_OPS and all(
        _isint(fields[i]) for i in (0, 2, 3, 6)
    ):
        return "twitter"
    raise TraceFormatError(path, 1, f"unrecognised first line {_show(text)}; expected a CloudPhysics header "
                           "'version,time,op,size,lbn', a CacheLib header with 'key' and 'op' columns, "
                           f"a headerless Twitter record {_TWITTER_LAYOUT}, or a file named *.lis, *.i32be "
                           "or *.i64be")


def open_trace(path: str | os.PathLike, format: str = "auto") -> Trace:
    """Open the trace at ``path`` for (repeated) iteration.

    :param format: ``"auto"`` (see :func:`detect_format`) or one of :data:`FORMATS`,
        which overrides detection.
    :raises FileNotFoundError: no such file.
    :raises TraceFormatError: unknown format name or undetectable format. Errors in
        the body of the file are raised while iterating, before the bad request.
    """
    path = os.fspath(path)
    os.stat(path)
    return Trace(path, detect_format(path) if format == "auto" else format)


class Trace:
    """A trace file as an iterable of :class:`Request`; each ``iter()`` re-reads the file.

    :ivar path: the file (str).
    :ivar format: one of :data:`FORMATS`.
    """

    def __init__(self, path: str | os.PathLike, format: str) -> None:
        self.path = os.fspath(path)
        if format not in FORMATS:
            raise TraceFormatError(self.path, None, f"unknown trace format {format!r}; "
                                   f"expected 'auto' or one of {', '.join(FORMATS)}")
        self.format = format

    def __iter__(self) -> Iterator[Request]:
        if self.format in _WIDTH:
            return _read_binary(self.path, _WIDTH[self.format])
        return _not_empty(self.path, _READERS[self.format](self.path))

    def size_hint(self) -> int | None:
        """Number of requests when known without reading the file (binary formats), else None."""
        if self.format in _WIDTH:
            return os.stat(self.path).st_size // _WIDTH[self.format]
        return None

    def __repr__(self) -> str:
        return f"Trace({self.path!r}, format={self.format!r})"


class ZipfWorkload:
    """A seeded synthetic workload; see :func:`zipf_workload`."""

    format = "zipf"

    def __init__(self, requests: int, keys: int, alpha: float, seed: int,
                 set_fraction: float, value_size: int) -> None:
        if requests < 0 or keys < 1 or alpha < 0 or not 0 <= set_fraction <= 1 or value_size < 0:
            raise ConfigError(
                f"zipf_workload needs requests >= 0, keys >= 1, alpha >= 0, 0 <= set_fraction <= 1 "
                f"and value_size >= 0; got requests={requests}, keys={keys}, alpha={alpha}, "
                f"set_fraction={set_fraction}, value_size={value_size}")
        self.requests, self.keys, self.alpha, self.seed = requests, keys, alpha, seed
        self.set_fraction, self.value_size = set_fraction, value_size
        self.path = (f"<zipf requests={requests} keys={keys} alpha={alpha} seed={seed} "
                     f"set_fraction={set_fraction}>")
        rng = random.Random(seed)
        self._ranked = list(range(keys))  # _ranked[r] = key of popularity rank r
        rng.shuffle(self._ranked)
        self._cdf = list(accumulate(r ** -alpha for r in range(1, keys + 1)))
        self._op_seed = rng.getrandbits(64)
        self._state = rng.getstate()

    def __iter__(self) -> Iterator[Request]:
        rng = random.Random()
        rng.setstate(self._state)
        op_rng = random.Random(self._op_seed)
        left = self.requests
        while left:
            n = min(left, 1 << 16)
            keys = rng.choices(self._ranked, cum_weights=self._cdf, k=n)
            if self.set_fraction:
                ops = op_rng.choices(("get", "set"), cum_weights=(1 - self.set_fraction, 1.0), k=n)
            else:
                ops = repeat("get")
            yield from map(_new, zip(ops, keys, repeat(self.value_size), repeat(None), repeat(None)))
            left -= n

    def size_hint(self) -> int:
        """The number of requests."""
        return self.requests

    def __repr__(self) -> str:
        return f"ZipfWorkload{self.path}"


def zipf_workload(requests: int = 1_000_000, keys: int = 100_000, alpha: float = 0.99, seed: int = 0,
                  set_fraction: float = 0.0, value_size: int = 100) -> ZipfWorkload:
    """A deterministic Zipf(``alpha``) workload of ``requests`` requests over ``keys`` int keys.

    Key rank r (1-based) is drawn with probability proportional to ``r ** -alpha``;
    ranks map to keys ``0 .. keys-1`` through a permutation seeded by ``seed``, so
    the hottest key is not key 0. A fraction ``set_fraction`` (0..1) of requests are
    sets, the rest gets; every request has ``size=value_size`` bytes, ``ttl=None``
    and ``time=None``. The same arguments always give the same sequence, and the
    result can be iterated repeatedly.

    :raises ConfigError: an argument out of range.
    """
    return ZipfWorkload(requests, keys, alpha, seed, set_fraction, value_size)


# --- readers -------------------------------------------------------------------------


def _open(path: str) -> IO[bytes]:
    """Open ``path`` for binary reading; a 0-byte regular file is a TraceFormatError."""
    f = open(path, "rb")
    st = os.fstat(f.fileno())
    if stat.S_ISREG(st.st_mode) and st.st_size == 0:
        f.close()
        raise TraceFormatError(path, None, "the file is empty (0 bytes); expected at least one request")
    return f


def _read_binary(path: str, width: int) -> Iterator[Request]:
    with _open(path) as f:
        size = os.fstat(f.fileno()).st_size
        if _looks_like_text(f.read(4096)):
            raise TraceFormatError(path, None, (
                f"this is a text file, not raw {width * 8}-bit big-endian keys; it is read as "
                f"binary because it is named *.i{width * 8}be or format='i{width * 8}be' was "
                "given: rename it or pass the text format (arc, cloudphysics, cachelib, twitter)"))
        f.seek(0)
        if size % width:
            raise _odd_size(path, size, width)
        swap = sys.byteorder == "little"
        offset = 0
        while chunk := f.read(_CHUNK):
            if len(chunk) % width:
                raise _odd_size(path, offset + len(chunk), width)
            keys = array.array(_TYPECODE[width], chunk)
            if swap:
                keys.byteswap()
            yield from map(_new, zip(repeat("get"), keys, repeat(0), repeat(None), repeat(None)))
            offset += len(chunk)


def _not_empty(path: str, requests: Iterator[Request]) -> Iterator[Request]:
    """Pass ``requests`` through; a text trace that holds none (a header and
    no rows, only blank lines) is a TraceFormatError, not an empty replay."""
    first = next(requests, None)
    if first is None:
        raise TraceFormatError(path, None, "the trace holds no requests (a header or blank "
                               "lines only); expected at least one request")
    yield first
    yield from requests


def _looks_like_text(head: bytes) -> bool:
    """True when ``head`` (the start of a file) reads as lines of printable
    ASCII: a text file given to a binary reader. Raw key traces hold NUL and
    other control bytes almost at once (small keys start with zero bytes)."""
    return b"\n" in head and not head.translate(None, _TEXT_BYTES)


_TEXT_BYTES = bytes(range(0x20, 0x7F)) + b"\t\r\n"


def _odd_size(path: str, size: int, width: int) -> TraceFormatError:
    whole = size // width
    return TraceFormatError(path, whole + 1, (
        f"file size {size} bytes is not a multiple of {width}: {size % width} trailing byte(s) at byte "
        f"offset {whole * width} do not make a whole {width * 8}-bit big-endian record "
        f"(record {whole + 1}); the file is truncated or not a raw {width * 8}-bit key trace"))


def _read_arc(path: str) -> Iterator[Request]:
    with _open(path) as f:
        for n, line in enumerate(f, 1):
            fields = line.split()
            try:
                start, count = int(fields[0]), int(fields[1])
                ok = len(fields) == 4 and count >= 1
            except (IndexError, ValueError):
                ok = False
            if not ok:
                if not fields:
                    continue  # blank line
                raise _arc_error(path, n, line, fields)
            if count == 1:
                yield _new(("get", start, 512, None, None))
            else:
                yield from map(_new, zip(repeat("get"), range(start, start + count),
                                         repeat(512), repeat(None), repeat(None)))


def _arc_error(path: str, n: int, raw: bytes, fields: list[bytes]) -> TraceFormatError:
    if _is_binary(raw):
        detail = "binary data in a text trace (raw key files are .i32be/.i64be)"
    elif len(fields) != 4:
        detail = f"{len(fields)} field(s) instead of 4"
    else:
        detail = next((f"{name} {v.decode(errors='replace')!r} is not an integer"
                       for name, v in (("start_block", fields[0]), ("block_count", fields[1]))
                       if not _isint(v)), "block_count must be >= 1")
    return TraceFormatError(path, n, f"{detail}; expected {_ARC_LAYOUT}, got {_show(raw)}")


def _read_cloudphysics(path: str) -> Iterator[Request]:
    rows = _csv_rows(path)
    col, width = _header(path, rows, ("time", "op", "size", "lbn"),
                         "a CloudPhysics header 'version,time,op,size,lbn'")
    i_time, i_op, i_size, i_lbn = col["time"], col["op"], col["size"], col["lbn"]
    for n, row in rows:
        _check_width(path, n, row, width)
        op = _SCSI_OPS.get(row[i_op].strip().lower())
        if op is None:
            raise TraceFormatError(path, n, f"unknown op code {row[i_op]!r}; expected a SCSI opcode in "
                                   "hex: 28 (READ) or 2a (WRITE)")
        yield _new((op, _int(path, n, row[i_lbn], "lbn"), _int(path, n, row[i_size], "size", 0),
                    None, _float(path, n, row[i_time], "time")))


def _read_cachelib(path: str) -> Iterator[Request]:
    rows = _csv_rows(path)
    col, width = _header(path, rows, ("key", "op"), "a CacheLib header with at least 'key' and 'op' "
                         "columns (usually op_time,key,key_size,op,op_count,size,cache_hits,ttl,...)")
    i_key, i_op = col["key"], col["op"]
    i_count, i_size, i_ttl, i_time = (col.get(c) for c in ("op_count", "size", "ttl", "op_time"))
    for n, row in rows:
        _check_width(path, n, row, width)
        op = _CACHELIB_OPS.get(row[i_op].strip().upper())
        if op is None:
            raise TraceFormatError(path, n, f"unknown op {row[i_op]!r}; expected GET, GET_LEASE, SET, "
                                   "SET_LEASE or DELETE")
        if not row[i_key]:
            raise TraceFormatError(path, n, "the key column is empty; expected a key")
        count = 1 if i_count is None else _int(path, n, row[i_count], "op_count", 1)
        size = 0 if i_size is None else _int(path, n, row[i_size], "size", 0)
        ttl = None if i_ttl is None else float(_int(path, n, row[i_ttl], "ttl", 0)) or None
        time = None if i_time is None else _float(path, n, row[i_time], "op_time")
        yield from repeat(_new((op, row[i_key], size, ttl, time)), count)


def _read_twitter(path: str) -> Iterator[Request]:
    with _open(path) as f:
        for n, text in _text_lines(path, f):
            line = text.rstrip("\r\n")
            if not line.strip():
                continue
            fields = _split_twitter(line)
            if fields is None:
                raise TraceFormatError(path, n, f"{line.count(',') + 1} comma-separated field(s) instead "
                                       f"of 7; expected {_TWITTER_LAYOUT}, got {_show(line)}")
            ts, key, key_size, value_size, _client, op_name, ttl = fields
            op = _TWITTER_OPS.get(op_name.strip().lower())
            if op is None:
                raise TraceFormatError(path, n, f"unknown operation {op_name!r}; expected one of "
                                       f"{', '.join(_TWITTER_OPS)}")
            _int(path, n, key_size, "key_size", 0)
            size = _int(path, n, value_size, "value_size", 0)
            ttl_s = _int(path, n, ttl, "ttl", 0)
            yield _new((op, key, size, float(ttl_s) or None, _float(path, n, ts, "timestamp")))


_READERS = {"arc": _read_arc, "cloudphysics": _read_cloudphysics, "cachelib": _read_cachelib,
            "twitter": _read_twitter}


# --- helpers -------------------------------------------------------------------------


def _text_lines(path: str, f: IO[bytes]) -> Iterator[tuple[int, str]]:
    """(1-based line number, line decoded as UTF-8) for each line; a BOM on line 1 is dropped."""
    for n, raw in enumerate(f, 1):
        text = _decode(path, n, raw, "expected a UTF-8 text trace")
        yield n, (text[1:] if n == 1 and text.startswith("\ufeff") else text)


def _csv_rows(path: str) -> Iterator[tuple[int, list[str]]]:
    """(line number, fields) for each non-blank CSV record of ``path``."""
    with _open(path) as f:
        reader = csv.reader(text for _, text in _text_lines(path, f))
        try:
            for row in reader:
                if row:
                    yield reader.line_num, row
        except csv.Error as e:
            raise TraceFormatError(path, reader.line_num, f"malformed CSV ({e})") from None


def _header(path: str, rows: Iterator[tuple[int, list[str]]], required: tuple[str, ...],
            expected: str) -> tuple[dict[str, int], int]:
    """Read the header row; return ({lower-case column name: index}, number of columns)."""
    n, header = next(rows, (None, None))
    if header is None:
        raise TraceFormatError(path, None, f"no header line; expected {expected}")
    col: dict[str, int] = {}
    for i, name in enumerate(header):
        col.setdefault(name.strip().lower(), i)
    missing = [c for c in required if c not in col]
    if missing:
        raise TraceFormatError(path, n, f"the header lacks column(s) {', '.join(missing)}; expected "
                               f"{expected}, got {_show(','.join(header))}")
    return col, len(header)


def _check_width(path: str, n: int, row: list[str], width: int) -> None:
    if len(row) != width:
        raise TraceFormatError(path, n, f"{len(row)} column(s) but the header has {width}; "
                               f"got {_show(','.join(row))}")


def _split_twitter(line: str) -> list[str] | None:
    """Split a Twitter record into its 7 fields (the key may contain commas), or None."""
    ts, sep, rest = line.partition(",")
    tail = rest.rsplit(",", 5)
    return [ts, *tail] if sep and len(tail) == 6 else None


def _int(path: str, n: int, text: str, name: str, minimum: int | None = None) -> int:
    try:
        value = int(text)
    except ValueError:
        raise TraceFormatError(path, n, f"{name} must be an integer, got {text!r}") from None
    if minimum is not None and value < minimum:
        raise TraceFormatError(path, n, f"{name} must be >= {minimum}, got {value}")
    return value


def _float(path: str, n: int, text: str, name: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise TraceFormatError(path, n, f"{name} must be a number (seconds), got {text!r}") from None


def _isint(text: str | bytes) -> bool:
    try:
        int(text)
    except ValueError:
        return False
    return True


def _decode(path: str, n: int, raw: bytes, expected: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise TraceFormatError(path, n, f"binary data, not UTF-8 text (byte 0x{raw[e.start]:02x} at "
                               f"column {e.start + 1}); {expected}") from None


def _is_binary(raw: bytes) -> bool:
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        return True
    return b"\0" in raw


def _show(line: str | bytes) -> str:
    """A short repr of an offending line for error messages."""
    if isinstance(line, bytes):
        line = line.decode("utf-8", errors="replace")
    line = line.rstrip("\r\n")
    return repr(line if len(line) <= 80 else line[:77] + "...")
