"""The C kernels (durablekv._native) and the pure-Python code are one format.

Files written with one implementation are read with the other (replay-log
segments, store pages, damaged records), and a property test compares
each kernel with its Python twin on random input, byte for byte and error
for error. The writer is a real process (tests/format_writer.py) that
loaded the kernels its environment chose; the reader switches with
:func:`durablekv._accel.pure_kernels`.

The suite runs twice in CI (.ci/run): as it is, where
``DURABLEKV_REQUIRE_NATIVE=1`` makes a missing extension a failure, and with
``DURABLEKV_PURE=1``, where the tests that need both implementations in one
process skip and every other test runs the fallback.
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import durablekv
from durablekv import Cache, LogCorruptionError, _accel, codec
from durablekv.log import segments as logsegments
from durablekv.stores import pageformat

sys.path.insert(0, str(Path(__file__).parent))
from format_writer import dataset  # noqa: E402

WRITER = Path(__file__).with_name("format_writer.py")

PURE_FORCED = os.environ.get("DURABLEKV_PURE", "") not in ("", "0")


def test_accelerated_says_which_implementation_runs():
    if PURE_FORCED:
        assert not durablekv.accelerated and durablekv.accelerated.kernels == ()
        assert "DURABLEKV_PURE" in durablekv.accelerated.reason
        assert logsegments._native is None and codec._native is None
    elif os.environ.get("DURABLEKV_REQUIRE_NATIVE", "") not in ("", "0"):
        assert durablekv.accelerated, durablekv.accelerated.reason
    if durablekv.accelerated:
        assert set(durablekv.accelerated.kernels) == set(_accel.KERNELS)
        assert "native" in repr(durablekv.accelerated)


needs_both = pytest.mark.skipif(not durablekv.accelerated,
                                reason="needs the C kernels and the Python code in one process")


def implementation(name: str):
    """A context that runs the reader's kernels: ``native`` or ``pure``."""
    return contextlib.nullcontext() if name == "native" else _accel.pure_kernels()


def write(directory: Path, writer: str, mode: str) -> None:
    env = {k: v for k, v in os.environ.items() if k != "DURABLEKV_PURE"}
    if writer == "pure":
        env["DURABLEKV_PURE"] = "1"
    proc = subprocess.run([sys.executable, str(WRITER), str(directory), mode], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.stdout == "written\n", proc.stderr
    assert proc.returncode == (-9 if mode == "log" else 0), proc.stderr


def check_contents(c: Cache) -> None:
    _ops, expected = dataset()
    assert len(c) == len(expected)
    for key, value in expected.items():
        got = c.get(key, default=KeyError)
        assert got == value or (isinstance(value, float) and math.isnan(value)), (key, got)
        assert type(got) is type(value), (key, got)
    ops, _ = dataset()
    for op, key, _v, _e in ops:
        if op == "delete":
            assert key not in c


@needs_both
@pytest.mark.parametrize("writer,reader", [("native", "pure"), ("pure", "native")])
@pytest.mark.parametrize("mode", ["log", "store"])
def test_one_implementation_reads_what_the_other_wrote(tmp_path, writer, reader, mode):
    """``log``: the writer was killed before any flush, so the reader's
    recovery parses and applies every record; ``store``: the writer closed,
    so the reader page-faults every entry in (4 pages of memory)."""
    write(tmp_path / "c", writer, mode)
    with implementation(reader):
        with Cache(tmp_path / "c", max_pages=4) as c:
            if mode == "log":
                assert c.stats().recovered_records == len(dataset()[0])
            check_contents(c)
        with Cache(tmp_path / "c", max_pages=4) as c:  # what the reader stored back
            check_contents(c)


@needs_both
def test_both_write_the_same_log_and_page_bytes(tmp_path):
    """The same operations give the same segment bytes and the same page blobs."""
    import sqlite3
    write(tmp_path / "n", "native", "log")
    write(tmp_path / "p", "pure", "log")
    (seg_n,), (seg_p,) = (sorted((tmp_path / d).glob("replay-*.log")) for d in "np")
    assert seg_n.read_bytes() == seg_p.read_bytes()
    for d in "np":
        with implementation("native" if d == "n" else "pure"):
            Cache(tmp_path / d, max_pages=4).close()
    pages = [sqlite3.connect(tmp_path / d / "pages.sqlite3").execute(
        "select page_id, data from pages order by page_id").fetchall() for d in "np"]
    assert pages[0] and pages[0] == pages[1]


@needs_both
def test_no_expiry_is_written_as_float_nan_by_every_kernel(tmp_path):
    """A record or page entry with no expiry holds the bytes of
    struct.pack("<d", float("nan")), as the Python code writes it, from each
    C kernel and from the C overwrite. (Py_NAN is a NaN with the sign bit set
    on Python 3.10 on x86: the kernels wrote other bytes than the Python code.)"""
    from durablekv._accel import native
    nan = struct.pack("<d", float("nan"))
    want = logsegments._py_encode_record(7, 1, b"k", b"b\x01\x00\x00\x00v", None)
    assert want[17:25] == nan  # header (16), op (1), then the expiry
    assert native.encode_record(7, 1, b"k", b"b\x01\x00\x00\x00v", None) == want
    buf = bytearray(64)
    size = native.store_bytes_record(buf, 3, 7, 1, b"k", b"v", None)
    assert bytes(buf[3:3 + size]) == want
    cols = ([0], [b"k"], [b"v"], [None, 1.5][:1], 0)
    two = ([0, 1], [b"k", b"l"], [b"v", b"w"], [None, 1.5], 0)
    for args in (cols, two):
        assert pageformat.encode_columns(*args) == pageformat._py_encode_columns(*args)
    c = Cache(str(tmp_path / "c"))
    try:
        assert "set" in vars(c)
        c["k"] = b"1"
        c["k"] = b"2"  # the C overwrite
        log = c._log
        assert log._mm is not None
        rec = bytes(log._mm[log._last_start:log._size])
        assert rec == logsegments._py_encode_record(
            c._last_lsn, 1, codec.encode_key("k"), b"b\x01\x00\x00\x002", None)
    finally:
        c.close()


def _damaged_log(tmp_path: Path, writer: str) -> Path:
    write(tmp_path / "c", writer, "log")
    (seg,) = sorted((tmp_path / "c").glob("replay-*.log"))
    # a mapped segment left by a crash ends in its unused, zero-filled
    # preallocated end: cut it, so the file ends at its last record
    data = seg.read_bytes()
    seg.write_bytes(data[:logsegments.scan_segment(data, 0, None, 1).good_end])
    as_write_appended(tmp_path / "c")  # (a write(2) log's shape: a cut there is a torn tail)
    return seg


@needs_both
@pytest.mark.parametrize("writer", ["native", "pure"])
def test_damaged_records_are_found_the_same_by_both(tmp_path, writer):
    seg = _damaged_log(tmp_path, writer)
    data = seg.read_bytes()
    # a flipped bit in the middle, a torn tail, a zero-filled tail, garbage
    cut = len(data) - 37
    variants = {
        "flip": data[:len(data) // 2] + bytes([data[len(data) // 2] ^ 0x10])
        + data[len(data) // 2 + 1:],
        "torn": data[:cut],
        "zeros": data[:cut] + bytes(4096),
        "garbage": data[:cut] + os.urandom(300),
        "magic": b"DKVLOG2\n" + data[8:],
    }
    for name, blob in variants.items():
        got = {}
        for impl in ("native", "pure"):
            with implementation(impl):
                scan = logsegments.scan_segment(blob, 0, None, 1)
            got[impl] = (scan.records, scan.runs, scan.good_end, scan.intact_after,
                         None if scan.damage is None else (scan.damage.offset, scan.damage.detail),
                         [(d.offset, d.detail, r, w) for d, r, w in scan.stepped_over])
        assert got["native"] == got["pure"], name
        assert got["native"][4] is not None or got["native"][5], name  # damage found


@needs_both
@pytest.mark.parametrize("writer,reader", [("native", "pure"), ("pure", "native")])
def test_torn_tail_and_mid_log_damage_at_open(tmp_path, writer, reader):
    seg = _damaged_log(tmp_path, writer)
    data = seg.read_bytes()
    mid = len(data) // 2
    seg.write_bytes(data[:mid] + bytes([data[mid] ^ 0x01]) + data[mid + 1:])
    with implementation(reader):
        with pytest.raises(LogCorruptionError) as info:
            Cache(tmp_path / "c", max_pages=4)
    seg.write_bytes(data[:-5])  # the last record torn by the crash
    with implementation(reader):
        with Cache(tmp_path / "c", max_pages=4) as c:
            s = c.stats()
            assert s.recovered_records == len(dataset()[0]) - 1 and s.torn_records == 1
    assert info.value.offset > 0


# -- the kernels against their Python twins, on random input ----------------------

_SETTINGS = settings(max_examples=300, deadline=None,
                     suppress_health_check=[HealthCheck.too_slow])
_exp = st.one_of(st.none(), st.floats(allow_nan=False), st.just(float("nan")))


def _both(fn_native, fn_pure, *args):
    """Each implementation's result, or its exception's type and message."""
    out = []
    for fn in (fn_native, fn_pure):
        try:
            out.append(("ok", fn(*args)))
        except Exception as exc:  # the comparison is the point
            out.append((type(exc), str(exc)))
    return out


@needs_both
@_SETTINGS
@given(lsn=st.integers(0, 2 ** 64 - 1), op=st.integers(0, 255), key=st.binary(max_size=300),
       value=st.binary(max_size=3000), exp=_exp)
def test_encode_record_matches(lsn, op, key, value, exp):
    a = logsegments.encode_record(lsn, op, key, value, exp)
    b = logsegments._py_encode_record(lsn, op, key, value, exp)
    assert a == b


@needs_both
def test_write_record_matches_encode(tmp_path):
    from durablekv._accel import native
    fd = os.open(tmp_path / "f", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    try:
        want = b""
        for lsn, (k, v, e) in enumerate([(b"k", b"v", None), (b"", b"", 1.5),
                                         (b"x" * 600, b"y" * 70000, float("inf"))], 1):
            written, size = native.write_record(fd, lsn, 1, k, v, e)
            rec = logsegments._py_encode_record(lsn, 1, k, v, e)
            assert written == size == len(rec)
            want += rec
    finally:
        os.close(fd)
    assert (tmp_path / "f").read_bytes() == want
    with pytest.raises(OSError):
        native.write_record(fd, 1, 1, b"k", b"v", None)  # closed: EBADF, as os.write


_records = st.lists(st.tuples(st.integers(1, 3), st.binary(max_size=40), st.binary(max_size=200),
                              _exp), max_size=12)


@needs_both
@_SETTINGS
@given(records=_records, cut=st.integers(0, 10 ** 6), flips=st.lists(
    st.tuples(st.integers(0, 10 ** 6), st.integers(1, 255)), max_size=3),
    tail=st.binary(max_size=40), same_shape=st.booleans())
def test_parse_segment_matches(records, cut, flips, tail, same_shape):
    if same_shape and records:  # runs of one shape take the Python parser's fast path
        records = [records[0]] * len(records)
    data = bytearray(logsegments.MAGIC + b"".join(
        logsegments._py_encode_record(i + 1, op, k, v, e) for i, (op, k, v, e) in
        enumerate(records)))
    for at, x in flips:
        if data:
            data[at % len(data)] ^= x
    blob = bytes(data[:cut % (len(data) + 1)] + tail) if cut % 3 else bytes(data)
    got = []
    for impl in ("native", "pure"):
        with implementation(impl):
            recs, end, damage = logsegments._parse_segment(blob)
        got.append((_nan_safe(recs), end,
                    None if damage is None else (damage.offset, damage.detail)))
    assert got[0] == got[1]


def _nan_safe(records):
    return [tuple("nan" if isinstance(x, float) and x != x else x for x in r) for r in records]


_keys = st.one_of(st.text(max_size=20), st.binary(max_size=20), st.integers(-2 ** 70, 2 ** 70),
                  st.floats(allow_nan=False), st.none(), st.booleans(),
                  st.tuples(st.text(max_size=5), st.integers()))


@needs_both
@_SETTINGS
@given(keys=st.lists(_keys, max_size=20), junk=st.lists(st.binary(max_size=12), max_size=3))
def test_decode_keys_matches(keys, junk):
    blobs = [codec.encode_key(k) for k in keys] + junk
    a, b = _both(codec.decode_keys, codec._py_decode_keys, blobs)
    if a[0] == "ok":
        assert _nan_safe([a[1][0]]) == _nan_safe([b[1][0]]) and a[1][1] == b[1][1]
        assert list(map(type, a[1][0])) == list(map(type, b[1][0]))
    else:
        assert a == b


_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False),
              st.text(max_size=30), st.binary(max_size=300)),
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.tuples(inner, inner),
                            st.dictionaries(st.text(max_size=4), inner, max_size=3)),
    max_leaves=10)


@needs_both
@_SETTINGS
@given(values=st.lists(_values, max_size=20), junk=st.lists(st.binary(max_size=12), max_size=2))
def test_memory_forms_match(values, junk):
    c = codec.SafeCodec()
    blobs = [c.encode(v) for v in values] + junk
    a, b = _both(c.memory_forms_from_blobs, c._py_memory_forms_from_blobs, blobs)
    if a[0] == "ok":
        norm = [x.blob if type(x) is codec.Frozen else x for x in a[1]]
        assert norm == [x.blob if type(x) is codec.Frozen else x for x in b[1]]
    else:
        assert a == b


_entries = st.lists(st.tuples(_keys, st.binary(max_size=200), st.one_of(st.none(),
                    st.floats(allow_nan=False))), max_size=20, unique_by=lambda e: repr(e[0]))


@needs_both
@_SETTINGS
@given(entries=_entries, ascii_keys=st.booleans(), flips=st.lists(
    st.tuples(st.integers(0, 10 ** 5), st.integers(1, 255)), max_size=2),
    cut=st.integers(-3, 3))
def test_page_blobs_match(entries, ascii_keys, flips, cut):
    if ascii_keys:
        entries = [(f"key{i}", v, e) for i, (_k, v, e) in enumerate(entries)]
    encoded = [(slot, codec.encode_key(k), b"b" + struct.pack("<I", len(v)) + v, e)
               for slot, (k, v, e) in enumerate(entries)]
    # encode_page -> encode_columns: the kernel and the Python twin, same bytes
    blobs = []
    for impl in ("native", "pure"):
        with implementation(impl):
            blobs.append(pageformat.encode_page(encoded))
    assert blobs[0] == blobs[1]
    data = bytearray(blobs[0])
    for at, x in flips:
        data[at % len(data)] ^= x
    data = bytes(data[:len(data) + cut]) if cut < 0 else bytes(data) + b"\x01" * cut
    a, b = _both(pageformat.page_columns, pageformat._py_page_columns, data)
    assert _nan_safe([a]) == _nan_safe([b])


@needs_both
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n_keys=st.integers(1, 120), page_size=st.sampled_from([1, 4, 16]),
       max_pages=st.sampled_from([1, 2, 5]), policy=st.sampled_from(["lru", "tinylfu", "midpoint"]),
       keys_kind=st.sampled_from(["ascii", "int", "mixed"]), ttl=st.booleans(),
       order=st.randoms(use_true_random=False))
def test_page_faults_build_the_same_tier_with_the_kernels_and_without(
        n_keys, page_size, max_pages, policy, keys_kind, ttl, order):
    """One stored cache read back by page faults (gets, deletes, contains)
    with the C kernels and with the pure-Python code: the same answers and
    the very same memory tier after every step (pages, slots, values,
    expiries, page table order, LRU state, counts)."""
    from .conftest import Clock
    def key(i):
        return {"ascii": f"k{i}", "int": i * 3, "mixed": (f"k{i}", b"x", 1.5, "\u00e9")[i % 4]
                if i % 4 else i}[keys_kind]
    tmp = Path(tempfile.mkdtemp(prefix="durablekv-native-faults-"))
    try:
        clock = Clock()
        opts = dict(page_size=page_size, clock=clock, warm=False, flush_interval=3600,
                    policy=policy)
        with Cache(tmp / "c", max_pages=10_000, **opts) as c:
            for i in range(n_keys):
                c.set(key(i), b"v" * (i % 5) if i % 3 else [i],
                      expire=100 if ttl and i % 4 == 0 else None)
        shutil.copytree(tmp / "c", tmp / "pure")
        steps = list(range(n_keys)) * 2
        order.shuffle(steps)
        got = {}
        for name, d in (("native", tmp / "c"), ("pure", tmp / "pure")):
            with implementation(name):
                c = Cache(d, max_pages=max_pages, **opts)
                try:
                    trail = []
                    for j, i in enumerate(steps):
                        k = key(i)
                        if j % 11 == 10:
                            trail.append(("del", c.delete(k)))
                        elif j % 7 == 6:
                            trail.append(("in", k in c))
                        else:
                            trail.append(("get", c.get(k, default="missing")))
                        with c._lock:
                            trail.append(tier_layout(c._tier, times=False))
                    got[name] = trail
                finally:
                    c.close()
        assert got["native"] == got["pure"]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@needs_both
def test_encode_columns_refusals_match():
    """Input the kernel leaves to the Python code gets the Python code's error."""
    for args in [([70000], [b"k"], [b"v"], [None], 0), ([1, 2], [b"k"], [b"v"], [None], 0),
                 ([1], ["k"], [b"v"], [None], 0), ([1], [b"k"], [b"v"], [3], 0)]:
        a, b = _both(pageformat.encode_columns, pageformat._py_encode_columns, *args)
        assert a == b, args


# -- recovery: the same memory tier with the kernels and without ----------------------------

from .conftest import Clock, as_write_appended, tier_layout  # noqa: E402
from .test_recovery import OPS, crash, run_ops  # noqa: E402


@needs_both
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(stored=OPS, logged=OPS, page_size=st.sampled_from([1, 2, 4, 16]),
       max_pages=st.sampled_from([1, 3, 10_000]), fresh=st.integers(0, 80),
       ttl=st.booleans())
def test_recovery_builds_the_same_tier_with_the_kernels_and_without(stored, logged, page_size,
                                                                    max_pages, fresh, ttl):
    """One crashed directory recovered with the C kernels and with the
    pure-Python code: the very same memory tier (every page's slots,
    values, expiries, counts and versions, the page table in its order, the
    LRU stamps and heap, the dirty order, the free list, the next page id)
    and the same counts and last LSN. The log holds a store's worth of
    history (sets, TTLs, deletes, clears, equal keys such as 1 and 1.0)
    and then ``fresh`` new keys, which recovery places a whole page at a
    time."""
    _recover_both_ways(stored, logged, page_size, max_pages, fresh, ttl)


@needs_both
@pytest.mark.parametrize("page_size", [1, 4])
def test_recovery_of_keys_deleted_and_set_again_is_the_same_both_ways(page_size):
    """The cases recovery treats apart, each present for sure (the property
    test above finds them only now and then): a stored key deleted and set
    again (stored anew, not updated in place), a stored key deleted, equal
    keys logged as different bytes (1, 1.0, True), a clear in the middle,
    TTLs and overwrites."""
    stored = [("set", k, b"s") for k in ("a", "b", "c", 1, "d")]
    logged = [("del", "a"), ("set", "a", b"A"), ("set", 1.0, b"one"), ("del", "b"),
              ("ttl", "c", b"C", 5), ("set", "c", b"C2"), ("set", "e", b"E"), ("set", True, b"t"),
              ("clear",), ("set", "d", b"D"), ("del", "d"), ("set", "d", b"D2"),
              ("set", 2, b"2"), ("set", 2.0, b"2f"), ("del", "zz"), ("set", "f", b"F")]
    for cut in (len(logged), 8):  # with the clear, and without it
        _recover_both_ways(stored, logged[:cut], page_size, 10_000, 20, True)


def _recover_both_ways(stored, logged, page_size, max_pages, fresh, ttl):
    from unittest import mock
    tmp = Path(tempfile.mkdtemp(prefix="durablekv-native-recovery-"))
    try:
        with mock.patch.object(Cache, "_sweep_expired", return_value=0):
            clock = Clock()
            opts = dict(page_size=page_size, clock=clock, warm=False, flush_interval=3600,
                        flush_batch_pages=1_000_000, max_pending_pages=1_000_000)
            cache = Cache(tmp / "c", max_pages=10_000, **opts)
            run_ops(cache, clock, stored, {}, {})
            cache.flush()
            run_ops(cache, clock, logged, {}, {})
            for i in range(fresh):
                cache.set(f"fresh{i}", b"x" * (i % 7), expire=100 if ttl and i % 5 == 0 else None)
            crash(cache)
            shutil.copytree(tmp / "c", tmp / "pure")
            got = {}
            for name, d in (("native", tmp / "c"), ("pure", tmp / "pure")):
                with implementation(name):
                    c = Cache(d, max_pages=max_pages, **opts)
                    try:
                        with c._lock:
                            got[name] = (tier_layout(c._tier, times=False), c._counts.keys,
                                         c._counts.ttl_keys, c._last_lsn, c.recovered_records)
                    finally:
                        crash(c)
            assert got["native"] == got["pure"]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# -- recovery reads records in place (_native.Records) ----------------------------------

def _py_reduce(records):
    """What ``Records.reduce()`` must give, worked out as recovery's
    pure-Python path does: the position after the last clear; each key's
    last record after it (by its logged bytes) in LSN order; the positions
    among those of keys with a delete after the clear; any delete at all."""
    ops = [r[1] for r in records]
    first = len(ops) - ops[::-1].index(logsegments.OP_CLEAR) if logsegments.OP_CLEAR in ops else 0
    after = records[first:]
    finals = sorted(dict((r[2], r) for r in after).values())
    deleted = {r[2] for r in after if r[1] == logsegments.OP_DELETE}
    fresh = [i for i, r in enumerate(finals) if r[2] in deleted]
    return finals, first, fresh, logsegments.OP_DELETE in ops[first:]


_small_keys = st.sampled_from([codec.encode_key(k) for k in ("a", "b", "", 1, 1.0, True, b"a",
                                                              "é", ("t", 1), None)])


@needs_both
@_SETTINGS
@given(records=st.lists(st.tuples(st.integers(1, 3), _small_keys, st.binary(max_size=30), _exp),
                        max_size=40),
       cut=st.integers(0, 10 ** 6), flip=st.tuples(st.integers(0, 10 ** 6), st.integers(0, 255)))
def test_records_read_in_place_match_the_parsed_tuples(records, cut, flip):
    """index_segment stops where parse_segment does and its Records gives the
    same tuples (items, negative indices, slices, iteration, take, column,
    join); reduce, decode_keys and memory_forms give what the Python code
    works out from those tuples."""
    from durablekv._accel import native
    data = bytearray(logsegments.MAGIC + b"".join(
        logsegments._py_encode_record(i + 1, op, k, v, e)
        for i, (op, k, v, e) in enumerate(records)))
    at, x = flip
    if x and cut % 2:
        data[at % len(data)] ^= x
    blob = bytes(data)
    want, end, stopped = native.parse_segment(blob, 8)
    recs, end2, stopped2 = native.index_segment(blob, 8)
    assert (end2, stopped2) == (end, stopped)
    nan_safe = _nan_safe
    assert nan_safe(recs) == nan_safe(want) and len(recs) == len(want)
    if want:
        assert nan_safe([recs[-1], recs[0]]) == nan_safe([want[-1], want[0]])
    assert nan_safe(recs[1:-1]) == nan_safe(want[1:-1])
    assert nan_safe(recs[::-2]) == nan_safe(want[::-2])
    with pytest.raises(IndexError):
        recs[len(recs)]
    half = len(recs) // 2
    joined = native.Records.join([recs[:half], recs[half:]])
    assert nan_safe(joined) == nan_safe(want)
    idx = list(range(0, len(recs), 3))
    assert nan_safe(recs.take(idx)) == nan_safe([want[i] for i in idx])
    for n, name in enumerate(("lsn", "op", "key", "value", "expire_at")):
        assert nan_safe([(v,) for v in recs.column(name)]) == nan_safe([(r[n],) for r in want])
    assert recs.column("nbytes") == [len(r[2]) + len(r[3]) for r in want]
    assert recs.lsns_step_by_one() == (
        [r[0] for r in want] == list(range(want[0][0], want[0][0] + len(want))) if want else True)
    finals, first, fresh, has_deletes = recs.reduce()
    w_finals, w_first, w_fresh, w_has = _py_reduce(want)
    assert (nan_safe(finals), first, fresh, has_deletes) == \
        (nan_safe(w_finals), w_first, w_fresh, w_has)
    assert _both(finals.decode_keys, lambda f: codec._py_decode_keys([r[2] for r in w_finals]),
                 codec.decode_key) == [("ok", codec._py_decode_keys([r[2] for r in w_finals]))] * 2
    safe = codec.SafeCodec()
    sets = finals.take([i for i, r in enumerate(w_finals) if r[1] == logsegments.OP_SET])
    a, b = _both(sets.memory_forms, lambda f: safe._py_memory_forms_from_blobs(
        [r[3] for r in sets]), safe.memory_form_from_blob)
    assert a == b


@needs_both
def test_native_recovery_reads_the_log_in_place(tmp_path):
    """With the kernels, ReplayLog.recover hands over a _native.Records (no
    tuple per record), with the records the pure-Python code returns as a
    list."""
    from durablekv._accel import native
    from durablekv.log.replaylog import ReplayLog
    c = Cache(tmp_path / "c", warm=False, flush_interval=3600)
    for i in range(50):
        c.set(f"k{i % 20}", i)
        if i % 7 == 0:
            c.delete(f"k{i % 5}")
    from .test_recovery import crash
    crash(c)
    shutil.copytree(tmp_path / "c", tmp_path / "p")
    got = ReplayLog(str(tmp_path / "c")).recover(0).records
    with _accel.pure_kernels():
        want = ReplayLog(str(tmp_path / "p")).recover(0).records
    assert type(got) is native.Records and type(want) is list
    assert list(got) == want and len(want) > 50


@needs_both
def test_records_take_survives_an_index_that_changes_the_list():
    """Records.take read the list's item array in place while calling each
    item's __index__, which may change the list (and free that array)."""
    from durablekv._accel import native
    data = b"".join(native.encode_record(i, 1, b"k%d" % i, b"v", None) for i in range(1, 6))
    recs = native.index_segment(data, 0)[0]
    indices: list = []

    class Shifty:
        def __index__(self):
            indices[:] = list(range(10000))  # the list's array is replaced
            return 0

    indices[:] = [Shifty(), 1, 2]
    assert [r[0] for r in recs.take(indices)] == [1, 2, 3]
