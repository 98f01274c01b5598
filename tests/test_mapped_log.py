"""The replay log's mapped append path: records stored into a mapping of a
preallocated segment (ext4, xfs, tmpfs), write(2) everywhere else.

What must hold: the same bytes as the write(2) path, with the C kernel and
with the Python code; a full file system is an error from preallocation
(never a SIGBUS on a store into the mapping) and nothing acknowledged is
lost; a process killed with SIGKILL leaves a zero-filled preallocated end
that the next open cuts exactly, as no damage; on a file system where a
store could still fault, the mapping is refused and the log says so.
"""

from __future__ import annotations

import mmap
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import durablekv
from durablekv import Cache, LogWriteError, _accel
from durablekv.check import check_directory
from durablekv.log.segments import OP_DELETE, OP_SET, encode_record, list_segments, read_segment
from durablekv.log.replaylog import MAPPED_FS_TYPES, ReplayLog, mapped_append_refusal

from .test_faults import small_fs  # noqa: F401 - the 2 MiB tmpfs fixture

REPO = Path(__file__).resolve().parents[1]

#: With DURABLEKV_REQUIRE_NATIVE (.ci/run's first pass) missing kernels, or no
#: file system here that takes mapped appends, fail these tests; they skip only
#: where the fallback is forced or not built.
_NATIVE_REQUIRED = (os.environ.get("DURABLEKV_REQUIRE_NATIVE", "") not in ("", "0")
                    and os.environ.get("DURABLEKV_PURE", "") in ("", "0"))
if _NATIVE_REQUIRED and not durablekv.accelerated:
    raise RuntimeError(f"DURABLEKV_REQUIRE_NATIVE is set but {durablekv.accelerated!r}")
needs_native = pytest.mark.skipif(not durablekv.accelerated,
                                  reason="needs the C kernels: " + durablekv.accelerated.reason)
if _NATIVE_REQUIRED and mapped_append_refusal("/dev/shm") is not None \
        and mapped_append_refusal(os.getcwd()) is not None:
    # CI's first pass: the mapped log must be tested there, not skipped
    raise RuntimeError("DURABLEKV_REQUIRE_NATIVE is set but neither /dev/shm nor the working "
                       f"directory takes mapped appends: {mapped_append_refusal('/dev/shm')}")
needs_mapping = pytest.mark.skipif(mapped_append_refusal("/dev/shm") is not None
                                   and mapped_append_refusal(os.getcwd()) is not None,
                                   reason="neither /dev/shm nor the working directory takes "
                                   f"mapped appends: {mapped_append_refusal('/dev/shm')}")


def implementation(name: str):
    import contextlib
    return contextlib.nullcontext() if name == "native" else _accel.pure_kernels()


RECORDS = [
    (OP_SET, b"k", b"v", None),
    (OP_SET, b"\x00key", b"x" * 100, 1.5e9),
    (OP_DELETE, b"gone", b"", None),
    (OP_SET, b"big", bytes(range(256)) * 700, None),  # 179 KiB: grows the mapping
    (OP_SET, b"after", b"y" * 4096, float("inf")),
]


def _fill(log: ReplayLog) -> None:
    lsn = 1
    for _ in range(3):
        for op, key, value, exp in RECORDS:
            log.append(lsn, op, key, value, exp)
            lsn += 1
        log.append_bytes(lsn, OP_SET, b"raw", b"r" * 300, None)
        lsn += 1


def _files(directory: Path) -> list[bytes]:
    return [Path(p).read_bytes() for p in list_segments(str(directory))]


@needs_native
def test_the_store_kernel_builds_encode_records_bytes():
    m = mmap.mmap(-1, 1 << 20)
    at = 8
    for lsn, (op, key, value, exp) in enumerate(RECORDS, 1):
        size = durablekv._native.store_record(m, at, lsn, op, key, value, exp)
        assert m[at:at + size] == encode_record(lsn, op, key, value, exp)
        at += size
    raw = b"r" * 300
    size = durablekv._native.store_bytes_record(m, at, 99, OP_SET, b"raw", raw, None)
    assert m[at:at + size] == encode_record(99, OP_SET, b"raw", b"b" + len(raw).to_bytes(4, "little")
                                            + raw, None)
    # a record that does not fit: minus its size, nothing stored
    before = m[len(m) - 40:]
    assert durablekv._native.store_record(m, len(m) - 40, 1, OP_SET, b"k", b"v" * 100, None) == -130
    assert m[len(m) - 40:] == before


@pytest.mark.parametrize("impl", ["native", "pure"])
def test_mapped_and_written_segments_hold_the_same_bytes(tmp_path, impl):
    """Rolls, growth of the mapping and a clean close: file for file, byte
    for byte what the write(2) path writes, in either implementation."""
    if impl == "native" and not durablekv.accelerated:
        pytest.skip("needs the C kernels: " + durablekv.accelerated.reason)
    out = {}
    for mode in ("write", "auto"):
        d = tmp_path / mode
        d.mkdir()
        with implementation(impl):
            log = ReplayLog(str(d), segment_bytes=200_000, append=mode, fstype="ext4",
                            prealloc_bytes=64 << 10)
            assert log.append_mode == ("mmap" if mode == "auto" else "write")
            log.start(1)
            _fill(log)
            assert log.size_bytes() == sum(map(os.path.getsize, list_segments(str(d))))
            log.close()
            size = log.size_bytes()
        out[mode] = _files(d)
        assert sum(map(len, out[mode])) == size
    assert len(out["write"]) > 1  # it rolled
    assert out["auto"] == out["write"]


def test_a_copy_on_write_file_system_is_refused_and_says_why(tmp_path, caplog):
    for fstype in ("btrfs", "zfs", "bcachefs", "nfs4", "overlay", "fuse.sshfs"):
        why = mapped_append_refusal(str(tmp_path), fstype)
        assert why is not None and fstype in why and "write" not in fstype
    assert {"ext4", "xfs", "tmpfs"} == MAPPED_FS_TYPES
    log = ReplayLog(str(tmp_path), fstype="btrfs")
    assert log.append_mode == "write" and "btrfs" in log.append_reason
    log.start(1)
    _fill(log)
    (seg,) = list_segments(str(tmp_path))
    assert os.path.getsize(seg) == log.size_bytes()  # no preallocated end: write(2) appends
    log.close()
    assert len(read_segment(seg)[0]) == 18
    # the mapped path says so when it starts a segment
    d = tmp_path / "m"
    d.mkdir()
    with caplog.at_level("INFO", logger="durablekv.replaylog"):
        log = ReplayLog(str(d), fstype="tmpfs")
        log.start(1)
        log.close()
    assert log.append_mode == "mmap"
    assert any("stored into a mapping" in r.getMessage() for r in caplog.records)


@needs_mapping
def test_a_full_tmpfs_fails_at_preallocation_and_loses_nothing(small_fs):  # noqa: F811
    """ENOSPC comes from posix_fallocate as a LogWriteError for the record
    that did not fit; the process takes no SIGBUS, every acknowledged record
    is read back, and appends work again once there is room."""
    d = small_fs / "log"
    d.mkdir()
    filler = small_fs / "filler"
    filler.write_bytes(b"\0" * (1500 << 10))
    log = ReplayLog(str(d), durability="log")  # tmpfs: detected, not injected
    assert log.append_mode == "mmap", log.append_reason
    log.start(1)
    acked = []
    error = None
    for lsn in range(1, 2000):
        try:
            log.append(lsn, OP_SET, b"k%d" % lsn, b"v" * 4000, None)
        except LogWriteError as exc:
            error = exc
            break
        acked.append(lsn)
    assert error is not None, "the file system never filled up"
    assert "preallocate" in str(error) and "NOT stored" in str(error), str(error)
    assert log.last_lsn == acked[-1] and len(acked) > 20
    filler.unlink()  # room again: the same LSN goes in
    log.append(acked[-1] + 1, OP_SET, b"after", b"ok", None)
    log.sync()
    got = ReplayLog(str(d)).recover(0)
    assert [r[0] for r in got.records] == acked + [acked[-1] + 1]
    assert got.torn_records == 0
    log.close()


@needs_mapping
def test_a_cache_on_a_full_tmpfs_refuses_the_set_and_keeps_every_acknowledged_one(small_fs):  # noqa: F811
    d = small_fs / "c"
    filler = small_fs / "filler"
    filler.write_bytes(b"\0" * (1200 << 10))
    cache = Cache(d, page_size=4, max_pages=4096, flush_interval=3600)
    assert cache._log.append_mode == "mmap", cache._log.append_reason
    acked = {}
    for i in range(5000):
        try:
            cache[f"k{i}"] = "v" * 3000
        except LogWriteError as exc:
            assert "NOT stored" in str(exc)
            assert f"k{i}" not in cache
            break
        acked[f"k{i}"] = "v" * 3000
    else:
        pytest.fail("the file system never filled up")
    filler.unlink()
    cache.close()
    with Cache(d) as cache:
        assert dict(cache.items()) == acked
    assert check_directory(str(d)).ok


KILLED_WRITER = r"""
import os, signal, sys
from durablekv import Cache
c = Cache(sys.argv[1], durability="log", flush_interval=3600, page_size=16, max_pages=4096)
print(c._log.append_mode, flush=True)
n = int(sys.argv[2])
for i in range(n if n else 10 ** 9):
    c[f"k{i}"] = "v%d" % i * (1 + i % 50)
    os.write(1, b"A %d\n" % i)
if n:
    os.kill(os.getpid(), signal.SIGKILL)
"""


def _writer(directory: Path, n: int) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.Popen([sys.executable, "-c", KILLED_WRITER, str(directory), str(n)],
                            env=env, stdout=subprocess.PIPE, text=True)


@needs_mapping
def test_sigkill_after_a_write_leaves_an_unused_end_that_is_no_damage(tmp_path, caplog):
    d = Path("/dev/shm") if mapped_append_refusal(str(tmp_path)) else tmp_path
    d = Path(os.path.join(d, f"dkv-mapped-{os.getpid()}"))
    try:
        proc = _writer(d, 500)
        out, _ = proc.communicate(timeout=120)
        assert proc.returncode == -signal.SIGKILL
        lines = out.splitlines()
        assert lines[0] == "mmap" and len(lines) == 501
        (seg,) = list_segments(str(d))
        size = os.path.getsize(seg)
        assert size % 4096 == 0 and Path(seg).read_bytes()[-4096:] == bytes(4096)
        report = check_directory(str(d))
        assert report.ok and not [line for line in report.lines if "torn" in line], report.lines
        with caplog.at_level("INFO", logger="durablekv.replaylog"):
            with Cache(d, page_size=16) as cache:
                assert cache.stats().torn_records == 0 and cache.stats().salvaged_bytes == 0
                assert {k: cache[k] for k in (f"k{i}" for i in range(500))} == \
                    {f"k{i}": "v%d" % i * (1 + i % 50) for i in range(500)}
        assert any("unused preallocated end" in r.getMessage() for r in caplog.records)
        assert not any(r.levelname == "WARNING" for r in caplog.records)
    finally:
        import shutil
        shutil.rmtree(d, ignore_errors=True)


@needs_mapping
@pytest.mark.parametrize("after", [37, 400, 2500])
def test_sigkill_mid_write_loses_no_acknowledged_write(tmp_path, after):
    """Killed at a moment the writer does not choose (while it stores): every
    acknowledged set is there after the reopen, whatever the tail holds."""
    d = Path("/dev/shm") if mapped_append_refusal(str(tmp_path)) else tmp_path
    d = Path(os.path.join(d, f"dkv-mapped-{os.getpid()}-{after}"))
    try:
        proc = _writer(d, 0)
        assert proc.stdout.readline().strip() == "mmap"
        acked = -1
        while acked < after:
            acked = int(proc.stdout.readline().split()[1])
        os.kill(proc.pid, signal.SIGKILL)
        for line in proc.stdout:  # acknowledged before the signal landed
            if line.startswith("A "):
                acked = int(line.split()[1])
        proc.wait(timeout=60)
        assert check_directory(str(d)).ok
        with Cache(d, page_size=16) as cache:
            for i in range(acked + 1):
                assert cache[f"k{i}"] == "v%d" % i * (1 + i % 50), i
            assert cache.stats().torn_records <= 1 and cache.stats().salvaged_bytes == 0
    finally:
        import shutil
        shutil.rmtree(d, ignore_errors=True)
