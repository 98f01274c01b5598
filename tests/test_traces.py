"""Tests for durablekv.traces: the real shared traces, every format's parser and errors, zipf_workload."""

from __future__ import annotations

import struct
from collections import Counter
from pathlib import Path

import pytest

from durablekv.errors import ConfigError, TraceFormatError
from durablekv.traces import FORMATS, Request, Trace, detect_format, open_trace, zipf_workload

from .conftest import TRACES, no_traces


@pytest.fixture
def traces() -> Path:
    if not TRACES.is_dir():
        no_traces(TRACES)
    return TRACES


def write(path: Path, text: str) -> Path:
    path.write_bytes(text.encode("utf-8"))
    return path


def count_and_unique(trace) -> tuple[int, int]:
    n, keys = 0, set()
    for r in trace:
        n += 1
        keys.add(r.key)
    return n, len(keys)


# --- the real traces --------------------------------------------------------------------


def test_arc_oltp_counts(traces):
    trace = open_trace(traces / "arc_OLTP.lis")
    assert trace.format == "arc" and trace.size_hint() is None
    n, unique, ops = 0, set(), set()
    for r in trace:
        n += 1
        unique.add(r.key)
        ops.add((r.op, r.size, r.ttl, r.time))
    assert (n, len(unique)) == (914_145, 186_880)
    assert ops == {("get", 512, None, None)}
    assert next(iter(trace)) == Request("get", 1, 512, None, None)


def test_scarab_counts(traces):
    path = traces / "scarab_recs.i64be"
    trace = open_trace(path)
    assert trace.format == "i64be" and trace.size_hint() == 1_245_184
    assert count_and_unique(trace) == (1_245_184, 258_368)
    first = [r.key for _, r in zip(range(4), trace)]
    assert first == list(struct.unpack(">4q", path.read_bytes()[:32]))


def test_orm_busy_keys_and_total(traces):
    path = traces / "cache2k_orm-busy.i32be"
    trace = open_trace(path)
    assert trace.format == "i32be" and trace.size_hint() == 5_000_000
    with open(path, "rb") as f:
        expected = list(struct.unpack(">16i", f.read(64)))
    head = [r for _, r in zip(range(16), trace)]
    assert [r.key for r in head] == expected
    assert all(r == Request("get", r.key, 0, None, None) for r in head)
    # The whole file: ~0.2 µs per record, so this stays around a second.
    assert count_and_unique(trace) == (5_000_000, 76_349)


def test_cloudphysics_counts(traces):
    trace = open_trace(traces / "cloudPhysicsIO.csv")
    assert trace.format == "cloudphysics"
    reqs = list(trace)
    assert len(reqs) == 113_872
    assert Counter(r.op for r in reqs) == {"get": 46_974, "set": 66_898}
    assert len({r.key for r in reqs}) == 48_974
    # first data line of the file: 1,5633898,2a,512,42932745
    assert reqs[0] == Request("set", 42932745, 512, None, 5633898.0)
    times = [r.time for r in reqs]
    assert times == sorted(times) and times[-1] - times[0] <= 7200
    assert all(r.size % 512 == 0 and 512 <= r.size <= 69_632 and r.ttl is None for r in reqs)


def test_cachelib_sample(traces):
    trace = open_trace(traces / "metakv_cachelib_sample1.csv")
    assert trace.format == "cachelib"
    reqs = list(trace)
    assert len(reqs) == 691
    assert len({r.key for r in reqs}) == 52
    assert all(isinstance(r.key, str) for r in reqs)
    sets = [r for r in reqs if r.op == "set"]
    assert sets and {r.ttl for r in sets} == {1320, 3600, 7200, 10800, 14400, 21600}
    assert all(r.ttl is None for r in reqs if r.op != "set")
    assert {r.op for r in reqs} == {"get", "set", "delete"}
    assert all(r.size == 0 for r in reqs if r.op == "delete")
    # first row: 604038471,82131353f9ddc8c6,48,GET,1,87,1,0,... ; second row has op_count 3
    assert reqs[0] == Request("get", "82131353f9ddc8c6", 87, None, 604038471.0)
    assert reqs[1] == reqs[2] == reqs[3] == Request("get", "a54f88ab02ece24d", 0, None, 604038471.0)
    assert reqs[4].key == "a54f88ab02ece24d" and reqs[5].key != "a54f88ab02ece24d"


def test_real_trace_detection(traces):
    assert {name: detect_format(traces / name) for name in (
        "arc_OLTP.lis", "cache2k_orm-busy.i32be", "scarab_recs.i64be",
        "cloudPhysicsIO.csv", "metakv_cachelib_sample1.csv")} == {
        "arc_OLTP.lis": "arc", "cache2k_orm-busy.i32be": "i32be", "scarab_recs.i64be": "i64be",
        "cloudPhysicsIO.csv": "cloudphysics", "metakv_cachelib_sample1.csv": "cachelib"}


def test_explicit_format_overrides_extension(traces):
    # the i64be file read as 32-bit keys: twice as many records, keys are the halves
    path = traces / "scarab_recs.i64be"
    trace = open_trace(path, format="i32be")
    assert trace.format == "i32be" and trace.size_hint() == 2 * 1_245_184
    assert [r.key for _, r in zip(range(4), trace)] == list(struct.unpack(">4i", path.read_bytes()[:16]))


# --- small files per format ---------------------------------------------------------------


TWITTER = (
    "0,key-a,5,100,1,get,0\n"
    "1,key-a,5,100,1,set,3600\n"
    "1,\"x\",y,9,12,2,gets,0\n"  # key contains a comma (and quotes are not special)
    "2,k3,2,7,3,add,60\r\n"
    "2,k3,2,0,3,delete,0\n"
    "3,k3,2,4,3,incr,0\n"
    "\n"
    "4,key-a,5,100,1,cas,120\n"
)


def test_twitter_file(tmp_path):
    path = write(tmp_path / "cluster52.0", TWITTER)
    assert detect_format(path) == "twitter"
    trace = open_trace(path)
    assert trace.format == "twitter" and trace.path == str(path)
    assert list(trace) == [
        Request("get", "key-a", 100, None, 0.0),
        Request("set", "key-a", 100, 3600.0, 1.0),
        Request("get", '"x",y', 12, None, 1.0),
        Request("set", "k3", 7, 60.0, 2.0),
        Request("delete", "k3", 0, None, 2.0),
        Request("set", "k3", 4, None, 3.0),
        Request("set", "key-a", 100, 120.0, 4.0),
    ]
    assert list(trace) == list(trace)  # re-iterable


def test_cachelib_columns_in_other_order(tmp_path):
    path = write(tmp_path / "kv.csv", (
        "ttl,op,size,key,op_count,op_time,cache_hits\n"
        "0,GET,10,alpha,2,100,1\n"
        "600,SET_LEASE,20,beta,1,101,0\n"
        "0,DELETE,0,alpha,1,102,0\n"
        "0,GET_LEASE,0,beta,1,103,0\n"
    ))
    assert detect_format(path) == "cachelib"
    assert list(open_trace(path)) == [
        Request("get", "alpha", 10, None, 100.0),
        Request("get", "alpha", 10, None, 100.0),
        Request("set", "beta", 20, 600.0, 101.0),
        Request("delete", "alpha", 0, None, 102.0),
        Request("get", "beta", 0, None, 103.0),
    ]


def test_cachelib_minimal_columns(tmp_path):
    path = write(tmp_path / "kv.csv", "\ufeffop,key\nSET,a\nGET,a\n")  # with a BOM
    assert list(open_trace(path)) == [Request("set", "a", 0, None, None), Request("get", "a", 0, None, None)]


def test_arc_multi_block_lines(tmp_path):
    path = write(tmp_path / "t.lis", "10 3 0 0\n\n7 1 0 1\n")
    assert [r.key for r in open_trace(path)] == [10, 11, 12, 7]


def test_binary_formats_small(tmp_path):
    keys = [0, 1, -1, 2**31 - 1, -(2**31)]
    path32 = tmp_path / "k.i32be"
    path32.write_bytes(struct.pack(">5i", *keys))
    assert [r.key for r in open_trace(path32)] == keys
    keys64 = [2**63 - 1, -(2**63), 42]
    path64 = tmp_path / "k.i64be"
    path64.write_bytes(struct.pack(">3q", *keys64))
    assert list(open_trace(path64)) == [Request("get", k, 0, None, None) for k in keys64]
    # an unknown extension works when the format is given
    other = tmp_path / "k.bin"
    other.write_bytes(path64.read_bytes())
    assert [r.key for r in open_trace(other, format="i64be")] == keys64
    assert [r.key for r in open_trace(other, "i32be")] == list(struct.unpack(">6i", path64.read_bytes()))


def test_cloudphysics_small(tmp_path):
    path = write(tmp_path / "io.csv", "version,time,op,size,lbn\n1,5,28,512,7\n1,6,2A,1024,8\n")
    assert detect_format(path) == "cloudphysics"
    assert list(open_trace(path)) == [Request("get", 7, 512, None, 5.0), Request("set", 8, 1024, None, 6.0)]


def test_format_override_beats_name(tmp_path):
    path = write(tmp_path / "looks_like.lis", "5,k,1,2,3,get,0\n")
    assert detect_format(path) == "arc"
    assert list(open_trace(path, format="twitter")) == [Request("get", "k", 2, None, 5.0)]


def test_every_format_detected(tmp_path):
    files = {
        "arc": write(tmp_path / "a.LIS", "1 1 0 0\n"),
        "i32be": tmp_path / "b.i32be",
        "i64be": tmp_path / "c.i64be",
        "cloudphysics": write(tmp_path / "d.csv", "version,time,op,size,lbn\n1,1,28,512,1\n"),
        "cachelib": write(tmp_path / "e.txt", "op_time,key,key_size,op,op_count,size,cache_hits,ttl\n"),
        "twitter": write(tmp_path / "f", "1,k,1,1,1,gets,0\n"),
    }
    files["i32be"].write_bytes(b"\0" * 8)
    files["i64be"].write_bytes(b"\0" * 8)
    assert {fmt: detect_format(p) for fmt, p in files.items()} == {f: f for f in FORMATS}
    assert {fmt: open_trace(p).format for fmt, p in files.items()} == {f: f for f in FORMATS}


# --- malformed input -------------------------------------------------------------------------


def assert_error(excinfo, path: Path, line: int | None, *words: str) -> None:
    err = excinfo.value
    assert isinstance(err, ValueError)  # TraceFormatError is a ValueError
    assert err.path == str(path)
    assert err.line == line
    message = str(err)
    assert message.startswith(f"{path}:{line}: " if line is not None else f"{path}: ")
    for word in words:
        assert word in message, (word, message)


BAD_TEXT = [
    # (file name, content, explicit format, line, words in the message)
    ("bad.lis", "1 1 0 0\n2 1 0 0\nx3 1 0 0\n", "auto", 3, ["start_block", "'x3'", "not an integer"]),
    ("bad.lis", "1 1 0 0\n2 1 0\n", "auto", 2, ["3 field(s) instead of 4"]),
    ("bad.lis", "1 0 0 0\n", "auto", 1, ["block_count must be >= 1"]),
    ("io.csv", "version,time,op,size,lbn\n1,1,28,512,1\n1,2,2a,512,lbn9\n", "auto", 3,
     ["lbn must be an integer", "'lbn9'"]),
    ("io.csv", "version,time,op,size,lbn\n1,1,28,512,1\n1,2,35,512,9\n", "auto", 3, ["unknown op code '35'"]),
    ("io.csv", "version,time,op,size,lbn\n1,1,28,512\n", "auto", 2, ["4 column(s) but the header has 5"]),
    ("io.csv", "time,op,size\n1,28,512\n", "cloudphysics", 1, ["lacks column(s) lbn"]),
    ("kv.csv", "key,op,op_count\na,GET,1\nb,PUT,1\n", "auto", 3, ["unknown op 'PUT'", "GET_LEASE"]),
    ("kv.csv", "key,op,op_count\na,GET,1\nb,GET,1\nc,GET,two\n", "auto", 4, ["op_count must be an integer"]),
    ("kv.csv", "key,op,op_count\na,GET,0\n", "auto", 2, ["op_count must be >= 1"]),
    ("kv.csv", "id,op\n1,GET\n", "cachelib", 1, ["lacks column(s) key"]),
    ("tw", "1,k,1,1,1,get,0\n2,k,1,1,get,0\n", "auto", 2, ["6 comma-separated field(s) instead of 7"]),
    ("tw", "1,k,1,1,1,get,0\n2,k,1,1,1,fetch,0\n", "auto", 2, ["unknown operation 'fetch'"]),
    ("tw", "1,k,1,1,1,get,0\n2,k,1,1,1,set,1h\n", "auto", 2, ["ttl must be an integer", "'1h'"]),
    ("tw", "1,k,1,1,1,get,0\nnoon,k,1,1,1,set,0\n", "auto", 2, ["timestamp must be a number"]),
    ("tw", "1,k,1,1,1,get,0\n2,k,1,-5,1,set,0\n", "auto", 2, ["value_size must be >= 0"]),
    ("x.csv", "when,what,where\n1,2,3\n", "auto", 1, ["unrecognised first line", "'when,what,where'"]),
]


@pytest.mark.parametrize("name,content,fmt,line,words", BAD_TEXT)
def test_malformed_text(tmp_path, name, content, fmt, line, words):
    path = write(tmp_path / name, content)
    with pytest.raises(TraceFormatError) as excinfo:
        list(open_trace(path, fmt))
    assert_error(excinfo, path, line, *words)


def test_binary_garbage_given_as_text(tmp_path):
    garbage = bytes(range(256)) * 4
    lis = tmp_path / "garbage.lis"
    lis.write_bytes(garbage)
    with pytest.raises(TraceFormatError) as excinfo:
        list(open_trace(lis))
    assert_error(excinfo, lis, 1, "binary data", ".i32be")
    csvfile = tmp_path / "garbage.csv"
    csvfile.write_bytes(b"\xff\xfe\x00\x01" + garbage)
    with pytest.raises(TraceFormatError) as excinfo:
        open_trace(csvfile)
    assert_error(excinfo, csvfile, 1, "binary data, not UTF-8", "0xff")
    # binary junk after valid lines is reported on its own line
    tw = tmp_path / "tw"
    tw.write_bytes(b"1,k,1,1,1,get,0\n2,k,1,1,1,get,0\n\xc3\x28\x00junk\n")
    with pytest.raises(TraceFormatError) as excinfo:
        list(open_trace(tw))
    assert_error(excinfo, tw, 3, "binary data, not UTF-8")


@pytest.mark.parametrize("fmt,size,line,offset", [("i32be", 10, 3, 8), ("i64be", 12, 2, 8), ("i64be", 3, 1, 0)])
def test_odd_sized_binary(tmp_path, fmt, size, line, offset):
    path = tmp_path / f"keys.{fmt}"
    path.write_bytes(b"\x01" * size)
    trace = open_trace(path)
    with pytest.raises(TraceFormatError) as excinfo:
        next(iter(trace))  # raised before any request is produced
    assert_error(excinfo, path, line, f"file size {size} bytes is not a multiple of",
                 f"at byte offset {offset}")


@pytest.mark.parametrize("name,fmt", [("e.lis", "auto"), ("e.i32be", "auto"), ("e.i64be", "auto"),
                                      ("e.csv", "cloudphysics"), ("e.csv", "cachelib"),
                                      ("e", "twitter")])
def test_empty_file(tmp_path, name, fmt):
    path = tmp_path / name
    path.write_bytes(b"")
    with pytest.raises(TraceFormatError) as excinfo:
        list(open_trace(path, fmt))
    assert_error(excinfo, path, None, "empty (0 bytes)")


def test_empty_file_detection(tmp_path):
    path = tmp_path / "e.csv"
    path.write_bytes(b"")
    with pytest.raises(TraceFormatError) as excinfo:
        open_trace(path)
    assert_error(excinfo, path, None, "empty")


def test_blank_csv_has_no_header(tmp_path):
    path = write(tmp_path / "kv.csv", "\n\n")
    with pytest.raises(TraceFormatError) as excinfo:
        list(open_trace(path, "cachelib"))
    assert_error(excinfo, path, None, "no header line")


def test_unknown_and_compressed_and_missing(tmp_path):
    path = write(tmp_path / "t.lis", "1 1 0 0\n")
    with pytest.raises(TraceFormatError) as excinfo:
        open_trace(path, format="parquet")
    assert_error(excinfo, path, None, "unknown trace format 'parquet'", "i32be")
    xz = tmp_path / "orm-busy.trace.xz"
    xz.write_bytes(b"\xfd7zXZ\x00\x00")
    with pytest.raises(TraceFormatError) as excinfo:
        open_trace(xz)
    assert_error(excinfo, xz, None, "compressed", "xz -d")
    with pytest.raises(FileNotFoundError):
        open_trace(tmp_path / "missing.lis")
    with pytest.raises(FileNotFoundError):
        open_trace(tmp_path / "missing.csv", format="cachelib")


def test_trace_repr_and_direct_construction(tmp_path):
    path = write(tmp_path / "t.lis", "4 1 0 0\n")
    trace = Trace(path, "arc")
    assert trace.path == str(path) and "arc" in repr(trace)
    assert list(trace) == [Request("get", 4, 512, None, None)]


# --- zipf_workload -----------------------------------------------------------------------------


def test_zipf_deterministic_and_seeded():
    a = list(zipf_workload(requests=20_000, keys=1_000, seed=1))
    assert a == list(zipf_workload(requests=20_000, keys=1_000, seed=1))
    b = list(zipf_workload(requests=20_000, keys=1_000, seed=2))
    assert [r.key for r in a] != [r.key for r in b]
    z = zipf_workload(requests=20_000, keys=1_000, seed=1)
    assert list(z) == list(z) == a  # re-iterable, same sequence
    assert z.format == "zipf" and z.path.startswith("<zipf") and z.size_hint() == 20_000


def test_zipf_shape():
    reqs = list(zipf_workload(requests=100_000, keys=10_000, alpha=0.99, seed=0, value_size=64))
    assert len(reqs) == 100_000
    assert all(r.op == "get" and r.size == 64 and r.ttl is None and r.time is None for r in reqs)
    counts = Counter(r.key for r in reqs)
    assert all(isinstance(k, int) and 0 <= k < 10_000 for k in counts)
    ranked = [c for _, c in counts.most_common()] + [0] * (10_000 - len(counts))
    top, median = ranked[0], ranked[len(ranked) // 2]
    # p(rank 1) / p(rank 5000) = 5000 ** 0.99, ~4,600: far above any sampling noise
    assert top > 8_000 and top > 100 * max(median, 1)
    hottest = [k for k, _ in counts.most_common(10)]
    assert sorted(hottest) != list(range(10))  # popularity is shuffled over the key space


def test_zipf_set_fraction():
    reqs = list(zipf_workload(requests=50_000, keys=1_000, set_fraction=0.3, seed=3))
    share = sum(r.op == "set" for r in reqs) / len(reqs)
    assert abs(share - 0.3) < 0.01
    assert {r.op for r in zipf_workload(requests=100, keys=10, set_fraction=1.0)} == {"set"}
    # the key sequence does not depend on set_fraction
    plain = [r.key for r in zipf_workload(requests=5_000, keys=1_000, seed=3)]
    assert [r.key for r in reqs[:5_000]] == plain


def test_zipf_alpha_zero_is_uniform():
    counts = Counter(r.key for r in zipf_workload(requests=100_000, keys=10, alpha=0.0))
    assert set(counts) == set(range(10))
    assert max(counts.values()) < 1.1 * min(counts.values())


@pytest.mark.parametrize("kwargs", [dict(keys=0), dict(requests=-1), dict(alpha=-1.0),
                                    dict(set_fraction=1.5), dict(value_size=-1)])
def test_zipf_bad_arguments(kwargs):
    with pytest.raises(ConfigError):
        zipf_workload(**kwargs)


@pytest.mark.parametrize("name,fmt", [("keys.i32be", "auto"), ("keys.i64be", "auto"),
                                      ("keys.bin", "i32be")])
def test_text_read_as_binary_is_refused(tmp_path, name, fmt):
    """A text file named like a raw key trace is not silently turned into
    keys like 0x31203220 ("1 2 ")."""
    p = tmp_path / name
    p.write_text("1 2 3 4\n5 6 7 8\n" * 10)
    with pytest.raises(TraceFormatError) as excinfo:
        list(open_trace(p, fmt))
    assert "text file" in str(excinfo.value) and "rename it" in str(excinfo.value)


def test_binary_keys_that_happen_to_be_printable_bytes_still_read(tmp_path):
    """No newline byte, so not text: read as keys."""
    p = tmp_path / "k.i32be"
    p.write_bytes(b"ABCDabcd")
    assert [r.key for r in open_trace(p)] == [0x41424344, 0x61626364]


@pytest.mark.parametrize("content", ["op_time,key,op\n", "version,time,op,size,lbn\n\n\n"])
def test_a_header_without_requests_is_refused(tmp_path, content):
    p = tmp_path / "t.csv"
    p.write_text(content)
    with pytest.raises(TraceFormatError) as excinfo:
        list(open_trace(p))
    assert "no requests" in str(excinfo.value)
