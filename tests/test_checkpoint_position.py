"""The checkpoint position (``replay.pos``): an open after a crash parses only
the log records the store's checkpoint does not cover, and a position that
does not check out costs a full parse, never a record.

The crashed directories come from a real writer process killed with SIGKILL
after a checkpoint (the records below it stay in the active segment, as they
do until the segment is sealed). CI runs this file with the C kernels and
with ``DURABLEKV_PURE=1``.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import stat
import subprocess
import sys
import zlib
from pathlib import Path

import pytest

from durablekv import Cache
from durablekv.log import segments as logsegments
from durablekv.errors import LogCorruptionError
from durablekv.log.segments import (HEADER, POSITION_FILE, Position, list_segments,
                                   read_position)
from durablekv.log.replaylog import ReplayLog
from durablekv.log.control import read_control

from .conftest import REPO, open_cache, run_with_timeout

N, K = 2000, 30  # records below the checkpoint, records after it

WRITER = """
import os, sys
from durablekv import Cache
c = Cache(sys.argv[1], page_size=16, durability="log", flush_interval=3600, warm=False)
first, n, k, flush = (int(a) for a in sys.argv[2:6])
for i in range(first, first + n):
    c[f"k{i}"] = f"v{i}"
if flush:
    c.flush()                  # a checkpoint: replay.pos now points at its last record
c._batcher.stop()              # no later checkpoint: the k sets stay in the log alone
for i in range(first + n, first + n + k):
    c[f"k{i}"] = f"w{i}"       # acknowledged (in the OS), after the checkpoint
print("DONE", flush=True)
sys.stdin.read()               # SIGKILLed here
"""


def _killed_writer(directory: Path, n: int = N, k: int = K, first: int = 0,
                   flush: bool = True) -> None:
    """Run WRITER on ``directory`` (sets of keys ``first`` on: ``n``, a flush
    when ``flush``, ``k`` more) and SIGKILL it."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    args = [str(directory), str(first), str(n), str(k), str(int(flush))]
    proc = subprocess.Popen([sys.executable, "-c", WRITER, *args],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    try:
        line = run_with_timeout(proc.stdout.readline, 60.0)
        assert line.strip() == "DONE", f"the writer said {line!r}"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    assert proc.returncode == -signal.SIGKILL


@pytest.fixture(scope="module")
def crashed(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("crashed") / "cache"
    _killed_writer(d)
    return d


@pytest.fixture
def copy(crashed, tmp_path) -> Path:
    d = tmp_path / "copy"
    shutil.copytree(crashed, d)
    return d


def _reopen(d: Path) -> tuple[int, Cache]:
    """Open ``d``; ``(records parsed, cache)``. The caller closes it."""
    before = logsegments.parsed_records
    c = open_cache(d)
    return logsegments.parsed_records - before, c


def _assert_all_there(c: Cache, recovered: int = K, lives=((0, N, K),)) -> None:
    """Every key each writer life ``(first, n, k)`` set holds its value."""
    assert c.stats().recovered_records == recovered
    missing = [i for first, n, k in lives for i in range(first, first + n + k)
               if c.get(f"k{i}") != (f"v{i}" if i < first + n else f"w{i}")]
    assert not missing, f"{len(missing)} keys lost or wrong, first {missing[:5]}"


def _reopens_whole(d: Path, parsed: int) -> None:
    """Opening ``d`` parses ``parsed`` log records and finds every write."""
    got, c = _reopen(d)
    try:
        assert got == parsed
        _assert_all_there(c)
    finally:
        c.close()


def _position(d: Path) -> Position:
    pos, why = read_position(str(d))
    assert pos is not None, why
    return pos


def test_crash_after_checkpoint_parses_only_the_records_after_it(copy):
    pos = _position(copy)
    assert pos.lsn == N
    [segment] = list_segments(str(copy))
    assert pos.segment_lsn == 1 and os.path.basename(segment) == "replay-%020d.log" % 1
    assert stat.S_IMODE(os.stat(copy / POSITION_FILE).st_mode) == 0o600
    _reopens_whole(copy, parsed=K)


def test_the_same_directory_without_the_position_parses_everything(copy):
    os.unlink(copy / POSITION_FILE)
    _reopens_whole(copy, parsed=N + K)


def _bad_positions(d: Path) -> dict[str, tuple[bytes, str]]:
    """name -> (replay.pos bytes, words the log gives as the reason)."""
    good = _position(d)
    raw = good.encode()
    flipped = raw[:9] + bytes([raw[9] ^ 0xFF]) + raw[10:]
    other = b"DKVPOS99" + raw[8:40]  # another magic, with a good CRC
    rec = good.end - good.start
    return {
        "cut short": (raw[:20], "holds 20 bytes"),
        "bad crc": (flipped, "CRC does not match"),
        "bad magic": (other + zlib.crc32(other).to_bytes(4, "little"), "bad magic"),
        "past the checkpoint": (good._replace(lsn=N + K + 5).encode(), "past the store's checkpoint"),
        "another segment": (good._replace(segment_lsn=7).encode(), "not the log's first"),
        "wrong lsn": (good._replace(lsn=N - 1).encode(), "no record of LSN"),
        "shifted": (good._replace(start=good.start + 1, end=good.end + 1).encode(),
                    "no record of LSN"),
        "previous record": (good._replace(lsn=N - 1, start=good.start - rec,
                                          end=good.end - rec).encode(), None),
        "beyond the file": (good._replace(start=1 << 40, end=(1 << 40) + rec).encode(),
                            "do not fit"),
    }


@pytest.mark.parametrize("case", ["cut short", "bad crc", "bad magic", "past the checkpoint",
                                  "another segment", "wrong lsn", "shifted", "beyond the file"])
def test_a_position_that_does_not_check_out_costs_a_full_parse(copy, case, caplog):
    data, reason = _bad_positions(copy)[case]
    (copy / POSITION_FILE).write_bytes(data)
    with caplog.at_level(logging.INFO, logger="durablekv.replaylog"):
        _reopens_whole(copy, parsed=N + K)
    said = [r.getMessage() for r in caplog.records if POSITION_FILE in r.getMessage()]
    assert any(reason in m for m in said), said


@pytest.mark.parametrize("how", ["directory", "fifo", "symlink"])
def test_a_position_that_is_not_a_regular_file_costs_a_full_parse(copy, how, caplog):
    path = copy / POSITION_FILE
    good = path.read_bytes()
    path.unlink()
    if how == "directory":
        path.mkdir()
    elif how == "fifo":
        os.mkfifo(path)  # an open that blocked on it would hang the test
    else:
        target = copy.parent / "elsewhere.pos"
        target.write_bytes(good)  # even a good position is not followed
        path.symlink_to(target)
    with caplog.at_level(logging.INFO, logger="durablekv.replaylog"):
        parsed, c = run_with_timeout(lambda: _reopen(copy), 30.0)
    try:
        assert parsed == N + K
        _assert_all_there(c)
    finally:
        c.close()
    said = " ".join(r.getMessage() for r in caplog.records)
    assert ("not a regular file" if how != "symlink" else "cannot read it") in said


def test_an_older_position_that_checks_out_parses_from_there(copy):
    # The record before the newest covered one is as good a place to start
    # (the next checkpoint's save was lost, say): one record more is parsed.
    data, _ = _bad_positions(copy)["previous record"]
    (copy / POSITION_FILE).write_bytes(data)
    _reopens_whole(copy, parsed=K + 1)


def _suffix_offsets(d: Path) -> tuple[str, list[int]]:
    """The segment and the offsets of the records after the position."""
    [segment] = list_segments(str(d))
    data = Path(segment).read_bytes()
    offsets, at = [], _position(d).end
    while at + HEADER.size <= len(data):
        n = HEADER.unpack_from(data, at)[0]
        if n == 0:
            break  # the zero-filled end of a preallocated segment
        offsets.append(at)
        at += HEADER.size + n
    assert len(offsets) == K
    return segment, offsets


def test_damage_after_the_position_is_still_refused(copy):
    segment, offsets = _suffix_offsets(copy)
    with open(segment, "r+b") as f:
        f.seek(offsets[K // 2] + HEADER.size + 2)  # a payload byte: the CRC fails
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0x55]))
    with pytest.raises(LogCorruptionError) as err:
        open_cache(copy)
    assert err.value.offset == offsets[K // 2]


def test_a_torn_tail_after_the_position_is_cut(copy):
    segment, offsets = _suffix_offsets(copy)
    cut = offsets[-1] + 5  # the last record cut short, as by a crash:
    control, _ = read_control(str(copy))
    if control.append == "mmap":
        # a mapped segment keeps its preallocated size, zero-filled after it
        data = Path(segment).read_bytes()
        Path(segment).write_bytes(data[:cut] + bytes(len(data) - cut))
    else:
        with open(segment, "r+b") as f:
            f.truncate(cut)
    parsed, c = _reopen(copy)
    try:
        assert parsed == K - 1
        assert c.stats().torn_records == 1
        assert c.stats().recovered_records == K - 1
        assert c.get(f"k{N + K - 2}") == f"w{N + K - 2}"
    finally:
        c.close()


def test_damage_before_the_position_is_never_read(copy):
    # The records below the checkpoint are in the store: a full parse steps
    # over damage there (tests/test_log_damage.py), the position never reads it.
    [segment] = list_segments(str(copy))
    with open(segment, "r+b") as f:
        f.seek(4000)
        f.write(b"\xff" * 64)
    _reopens_whole(copy, parsed=K)


def test_a_clean_close_removes_the_position_with_the_log(copy):
    _, c = _reopen(copy)
    c.close()  # a final checkpoint covers everything: no log to replay
    assert not list_segments(str(copy)) and not (copy / POSITION_FILE).exists()


@pytest.mark.parametrize("flush", [True, False], ids=["checkpoint in the new segment",
                                                      "no checkpoint since recovery"])
def test_a_second_crash_after_recovery_loses_nothing(copy, flush):
    # Recovery goes on in a new segment. With a checkpoint there, the old
    # segment is deleted and the position names the new one; without, the
    # old one stays first (its position still holds) and the new one is
    # parsed whole.
    life2 = (N + K, 100, 10)
    _killed_writer(copy, first=life2[0], n=life2[1], k=life2[2], flush=flush)
    assert len(list_segments(str(copy))) == (1 if flush else 2)
    parsed, c = _reopen(copy)
    try:
        if flush:
            assert parsed == 10
            _assert_all_there(c, 10, ((0, N, K), life2))
        else:
            assert parsed == K + 110
            _assert_all_there(c, K + 110, ((0, N, K), life2))
    finally:
        c.close()


def test_position_is_saved_only_for_a_committed_checkpoint(tmp_path):
    log = ReplayLog(str(tmp_path), durability="log")
    log.start(1)
    sizes = [log.append(i, logsegments.OP_SET, b"k", b"v", None) for i in (1, 2, 3)]
    log.mark()  # a snapshot at LSN 3
    log.append(4, logsegments.OP_SET, b"k", b"v", None)
    log.truncate_through(2)  # a checkpoint that does not reach the mark
    assert read_position(str(tmp_path)) == (None, None)
    log.truncate_through(3)
    start = len(logsegments.MAGIC) + sizes[0] + sizes[1]
    assert read_position(str(tmp_path)) == (Position(3, 1, start, start + sizes[2]), None)
    log.close(remove=True)
    assert not (tmp_path / POSITION_FILE).exists()


def test_a_refused_position_is_replaced_at_the_next_checkpoint(copy):
    # One that names an LSN past every record here (a log deleted and
    # started again, say) must not hold back the saves that follow.
    data, _ = _bad_positions(copy)["past the checkpoint"]
    (copy / POSITION_FILE).write_bytes(data)
    _, c = _reopen(copy)
    try:
        c["after"] = 1
        c.flush()
        assert _position(copy).lsn == c.stats().last_lsn == N + K + 1
    finally:
        c.close()
