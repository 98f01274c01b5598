"""Power loss (simulated), I/O errors on the log, failing SQLite flushes.

Power loss is simulated through the log's fault-injection seams: every
segment is cut back to the bytes that were fsynced when the "machine" dies.
SQLite commits with synchronous=FULL, so a committed flush is taken as
durable.
"""

from __future__ import annotations

import errno
import os
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from durablekv import (Cache, CacheClosedError, CacheFailedError, FlushTimeoutError, LogWriteError,
                       WriteBehindError)
from durablekv.check import check_directory
from durablekv.log.segments import list_segments
from durablekv.log import control as logcontrol, replaylog
from durablekv.log.replaylog import ReplayLog

REPO = Path(__file__).resolve().parents[1]
NEVER = dict(flush_interval=3600, flush_batch_pages=1_000_000, max_pending_pages=1_000_000)


class PowerLossLog:
    """Patch ReplayLog so tests know how many bytes of each segment are fsynced."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.synced: dict[str, int] = {}
        self.fsyncs = 0
        self.monkeypatch = monkeypatch
        self.boots = 0
        real_fsync = ReplayLog._fsync
        outer = self

        def _fsync(self_log: ReplayLog, fd: int) -> None:
            real_fsync(self_log, fd)
            path = os.readlink(f"/proc/self/fd/{fd}")
            size = os.fstat(fd).st_size
            if self_log._mm is not None and path == os.path.realpath(self_log._path):
                size = self_log._size  # a mapped segment: its records end there
            outer.synced[path] = size
            outer.fsyncs += 1

        monkeypatch.setattr(ReplayLog, "_fsync", _fsync)

    def power_loss(self, cache: Cache) -> None:
        """The machine dies: unsynced log bytes vanish, the process with them."""
        cache._teardown(clean=False)
        self.power_loss_files(cache.path)

    def power_loss_files(self, directory: str) -> None:
        """Unsynced log bytes in ``directory`` vanish, and the machine boots
        again (a new kernel boot id: replay.control's same-boot checks hold
        only while the machine has not restarted)."""
        for seg in list_segments(directory):
            keep = self.synced.get(os.path.realpath(seg), 0)
            with open(seg, "r+b") as f:
                f.truncate(keep)
        self.boots += 1
        boot = f"simulated-boot-{self.boots}"
        for module in (logcontrol, replaylog):
            self.monkeypatch.setattr(module, "boot_id", lambda: boot)


def contents(d) -> dict:
    with Cache(d) as cache:
        return dict(cache.items())


def test_power_loss_fsync_mode_loses_nothing_acknowledged(tmp_path, monkeypatch):
    pl = PowerLossLog(monkeypatch)
    d = tmp_path / "c"
    cache = Cache(d, durability="fsync", page_size=4, max_pages=2, **NEVER)
    acked = {}
    for i in range(300):
        cache[f"k{i % 50}"] = i
        acked[f"k{i % 50}"] = i
        if i % 97 == 0:
            cache.delete(f"k{i % 50}")
            del acked[f"k{i % 50}"]
    pl.power_loss(cache)
    assert contents(d) == acked
    assert check_directory(str(d)).ok


def test_power_loss_log_mode_loses_at_most_the_last_interval(tmp_path, monkeypatch):
    """Writes before the batcher's last log fsync survive; later ones may not."""
    pl = PowerLossLog(monkeypatch)
    d = tmp_path / "c"
    # max_pages large enough that nothing is evicted (an eviction kicks the batcher)
    cache = Cache(d, durability="log", page_size=4, max_pages=1000, **NEVER)
    for i in range(100):
        cache[f"a{i}"] = i
    cache._batcher.kick()
    cache.flush()  # a batcher cycle: fsyncs the log, then writes the pages
    cache._log.sync()  # the interval's fsync
    for i in range(100):
        cache[f"b{i}"] = i  # the "last interval": written to the OS, never fsynced
    pl.power_loss(cache)
    got = contents(d)
    assert all(got.get(f"a{i}") == i for i in range(100)), "synced writes were lost"
    assert not any(k.startswith("b") for k in got), "the simulation did not drop unsynced bytes"
    assert check_directory(str(d)).ok


def test_power_loss_log_mode_store_consistent_at_any_moment(tmp_path, monkeypatch):
    """Power loss at many points of a write stream: the store always checks out,
    and every write before the last fsync is present."""
    pl = PowerLossLog(monkeypatch)
    for cut in (1, 17, 64, 150):
        d = tmp_path / f"c{cut}"
        cache = Cache(d, durability="log", page_size=4, max_pages=3, flush_interval=3600,
                      flush_batch_pages=4)
        synced_upto = -1
        for i in range(cut):
            cache[f"k{i % 40}"] = i
            if i % 10 == 9:
                cache._log.sync()
                synced_upto = i
        pl.power_loss(cache)
        got = contents(d)
        for i in range(max(0, synced_upto - 39), synced_upto + 1):
            k = f"k{i % 40}"
            assert k in got and got[k] >= i, (cut, k, got.get(k))
        assert check_directory(str(d)).ok


@pytest.mark.parametrize("mode", ["log", "fsync"])
def test_power_loss_after_a_recovery_that_did_not_flush(tmp_path, monkeypatch, mode):
    """Records recovered from a killed ``log``-mode process may sit unsynced in
    the OS; open no longer stores them in SQLite before returning, so recovery
    fsyncs their segments. A power loss after more (synced) writes in the new
    segment then loses nothing and leaves no LSN gap."""
    pl = PowerLossLog(monkeypatch)
    d = tmp_path / "c"
    cache = Cache(d, durability="log", segment_bytes=2048, **NEVER)
    for i in range(100):
        cache[f"a{i}"] = i
    last = os.path.realpath(list_segments(str(d))[-1])
    cache._teardown(clean=False)  # killed: the open segment was never fsynced
    assert len(list_segments(str(d))) > 2 and last not in pl.synced
    cache = Cache(d, durability=mode, segment_bytes=2048, **NEVER)
    assert cache.stats().flushes == 0 and cache.stats().checkpoint_lsn == 0
    cache["b"] = 1
    cache._log.sync()
    pl.power_loss(cache)
    assert contents(d) == {**{f"a{i}": i for i in range(100)}, "b": 1}
    assert check_directory(str(d)).ok


def test_power_loss_log_mode_keeps_segments_created_since_the_last_fsync(tmp_path,
                                                                       monkeypatch):
    """A new segment's name is durable only once the directory is fsynced. In
    ``log`` mode the roll to a new segment leaves that to the interval's
    fsync, which must do it: here a power loss also drops every segment
    created since the last directory fsync, and the writes before the last
    log fsync must all survive, with no LSN gap."""
    import durablekv.log.replaylog as replaylog

    pl = PowerLossLog(monkeypatch)
    named: set[str] = set()
    real_fsync_dir = replaylog._fsync_dir

    def fsync_dir(directory: str) -> None:
        real_fsync_dir(directory)
        named.update(os.path.join(directory, n) for n in os.listdir(directory))

    monkeypatch.setattr(replaylog, "_fsync_dir", fsync_dir)
    d = tmp_path / "c"
    cache = Cache(d, durability="log", segment_bytes=2048, max_pages=1000, **NEVER)
    for i in range(200):
        cache[f"a{i}"] = i
    cache._log.sync()   # the interval's fsync
    assert len(list_segments(str(d))) > 3
    for i in range(20):
        cache[f"b{i}"] = i
    cache._teardown(clean=False)
    for seg in list_segments(str(d)):
        if seg not in named:
            os.unlink(seg)   # its directory entry never reached the disk
    pl.power_loss_files(str(d))
    got = contents(d)
    assert all(got.get(f"a{i}") == i for i in range(200)), "synced writes were lost"
    assert check_directory(str(d)).ok


def test_group_commit_shares_fsyncs(tmp_path, monkeypatch):
    pl = PowerLossLog(monkeypatch)
    cache = Cache(tmp_path / "c", durability="fsync", **NEVER)
    barrier = threading.Barrier(4)

    def writer(t: int) -> None:
        barrier.wait()
        for i in range(200):
            cache[(t, i)] = i

    threads = [threading.Thread(target=writer, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(cache) == 800
    assert pl.fsyncs <= 800 + 2  # never more than one per write (+ segment creation)
    cache.close()


# -- log write errors --------------------------------------------------------------------


def failing_write(monkeypatch, err: int, times: int):
    state = {"left": times}
    real = ReplayLog._write

    def _write(self, fd, data):
        if state["left"] > 0:
            state["left"] -= 1
            raise OSError(err, os.strerror(err))
        return real(self, fd, data)

    monkeypatch.setattr(ReplayLog, "_write", _write)
    return state


@pytest.mark.parametrize("err", [errno.ENOSPC, errno.EIO])
def test_log_write_error_stores_nothing_and_later_writes_work(tmp_path, monkeypatch, err):
    d = tmp_path / "c"
    cache = Cache(d)
    cache["before"] = 1
    failing_write(monkeypatch, err, times=1)
    with pytest.raises(LogWriteError) as exc:
        cache["x"] = 2
    assert exc.value.errno == err
    assert "replay" in str(exc.value) and "NOT stored" in str(exc.value)
    assert "x" not in cache and len(cache) == 1 and cache.stats().sets == 1
    cache["x"] = 3  # space is back
    cache.close()
    assert contents(d) == {"before": 1, "x": 3}


def test_short_log_write_leaves_no_partial_record(tmp_path, monkeypatch):
    d = tmp_path / "c"
    cache = Cache(d, **NEVER)
    cache["a"] = "A"
    real = ReplayLog._write
    calls = {"n": 0}

    def short(self, fd, data):
        calls["n"] += 1
        if calls["n"] == 1:
            return real(self, fd, data[:7])  # a disk that filled up mid-record
        return real(self, fd, data)

    monkeypatch.setattr(ReplayLog, "_write", short)
    with pytest.raises(LogWriteError):
        cache["b"] = "B"
    cache["c"] = "C"
    cache._teardown(clean=False)  # crash: recovery reads the log as written
    assert contents(d) == {"a": "A", "c": "C"}


def test_failed_fsync_fails_stop(tmp_path, monkeypatch):
    d = tmp_path / "c"
    cache = Cache(d, durability="fsync", **NEVER)
    cache["a"] = 1
    real = ReplayLog._fsync

    def bad_fsync(self, fd):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(ReplayLog, "_fsync", bad_fsync)
    with pytest.raises(LogWriteError):
        cache["b"] = 2
    with pytest.raises(CacheFailedError) as exc:
        cache["c"] = 3
    assert "reopen" in str(exc.value)
    monkeypatch.setattr(ReplayLog, "_fsync", real)
    cache.close()
    got = contents(d)
    assert got["a"] == 1 and "c" not in got


def test_real_file_size_limit_on_the_log(tmp_path):
    """EFBIG for real: RLIMIT_FSIZE in a subprocess; later writes work once lifted."""
    script = r"""
import resource, signal, sys
from durablekv import Cache, LogWriteError
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
c = Cache(sys.argv[1], flush_interval=3600)
c["small"] = "x"
soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, hard))
try:
    c["big"] = "y" * 100_000  # more than a mapped segment's first preallocation
except LogWriteError as exc:
    print("refused", exc.errno)
assert "big" not in c
resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
c["after"] = "z" * 8000
c.close()
print("ok")
"""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "-c", script, str(tmp_path / "c")], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    # The kernel writes up to the limit and returns a short count (the log cuts the
    # partial record off again and reports ENOSPC), or refuses outright (EFBIG).
    out = proc.stdout.split()
    assert out[0] == "refused" and int(out[1]) in (errno.EFBIG, errno.ENOSPC) and out[2] == "ok"
    got = contents(tmp_path / "c")
    assert got == {"small": "x", "after": "z" * 8000}


# -- failing SQLite flushes ----------------------------------------------------------------


def failing_store(monkeypatch, cache: Cache, message: str):
    state = {"fail": True, "calls": 0}
    real = cache._store.write_batch

    def write_batch(*args, **kwargs):
        state["calls"] += 1
        if state["fail"]:
            raise sqlite3.OperationalError(message)
        return real(*args, **kwargs)

    monkeypatch.setattr(cache._store, "write_batch", write_batch)
    return state


def test_br017_failing_flush_raises_and_recovers_when_the_fault_clears(tmp_path, monkeypatch):
    """br017/br018: flush() raises a typed error (never hangs); pages stay in memory;
    they reach SQLite once the store accepts writes again."""
    d = tmp_path / "c"
    cache = Cache(d, page_size=2, max_pages=2, flush_interval=0.01)
    state = failing_store(monkeypatch, cache, "database or disk is full")
    for i in range(10):
        cache[f"k{i}"] = i
    with pytest.raises(WriteBehindError) as exc:
        cache.flush()
    assert "disk is full" in str(exc.value)
    with pytest.raises(FlushTimeoutError) as exc:
        cache.flush(timeout=0.3)
    assert isinstance(exc.value, TimeoutError) and "disk is full" in str(exc.value)
    assert state["calls"] >= 2  # retried with back-off
    assert cache.get("k0") == 0 and cache.get("k9") == 9  # reads keep working
    st = cache.stats()
    assert st.flush_errors >= 2 and st.dirty_pages > 0
    state["fail"] = False
    cache.flush(timeout=10)
    assert cache.stats().dirty_pages == 0
    cache._teardown(clean=False)
    # even without the log, the store now holds everything
    for seg in list_segments(str(d)):
        os.unlink(seg)
    assert contents(d) == {f"k{i}": i for i in range(10)}


@pytest.mark.parametrize("durability", ["log", "none"])
def test_a_close_whose_final_flush_fails_says_what_became_of_the_writes(tmp_path, monkeypatch,
                                                                        durability):
    """The batcher's error says the pages are retried; after close() nothing
    is: the error says the cache is closed, and what the next open finds."""
    d = tmp_path / "c"
    cache = Cache(d, durability=durability, flush_interval=3600)
    failing_store(monkeypatch, cache, "database or disk is full")
    cache["a"] = 1
    with pytest.raises(WriteBehindError) as exc:
        cache.close()
    msg = str(exc.value)
    assert "close(): the final flush" in msg and "disk is full" in msg
    assert "retried" not in msg and cache.closed
    with pytest.raises(CacheClosedError):
        cache.get("a")
    if durability == "log":
        assert "the next open replays every acknowledged write" in msg
        assert contents(d) == {"a": 1}
    else:
        assert "are lost (durability='none' keeps no replay log)" in msg
        assert contents(d) == {}


def test_backpressure_refuses_writes_while_the_store_fails(tmp_path, monkeypatch):
    cache = Cache(tmp_path / "c", page_size=1, max_pages=2, max_pending_pages=4,
                  flush_interval=0.01)
    state = failing_store(monkeypatch, cache, "database or disk is full")
    with pytest.raises(WriteBehindError) as exc:
        for i in range(100):
            cache[i] = i
    assert "NOT stored" in str(exc.value)
    assert cache.stats().pending_pages <= 4 + 1
    stored = len(cache)
    state["fail"] = False
    cache[1000] = 1
    cache.close()
    assert len(contents(tmp_path / "c")) == stored + 1


class LockHolder:
    """Another process holding the store's write lock (BEGIN IMMEDIATE) until released."""

    def __init__(self, db: Path) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c",
             "import sqlite3, sys\n"
             "c = sqlite3.connect(sys.argv[1], isolation_level=None)\n"
             "c.execute('BEGIN IMMEDIATE')\n"
             "print('locked', flush=True)\n"
             "sys.stdin.readline()\n"
             "c.execute('ROLLBACK')\n", str(db)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout.readline().strip() == "locked"

    def release(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.write("\n")
            self.proc.stdin.flush()
            self.proc.wait(timeout=30)


def test_br019_lock_held_briefly_flush_waits_and_succeeds(tmp_path):
    d = tmp_path / "c"
    cache = Cache(d, busy_timeout=5.0, flush_interval=0.01)
    holder = LockHolder(d / "pages.sqlite3")
    try:
        cache["a"] = 1
        timer = threading.Timer(0.5, holder.release)
        timer.start()
        cache.flush(timeout=10)  # SQLite's busy timeout rides out the 0.5 s lock
        timer.join()
        assert cache.stats().flush_errors == 0
    finally:
        holder.release()
    cache.close()
    assert contents(d) == {"a": 1}


def test_br019_lock_held_too_long_is_a_typed_timeout(tmp_path):
    d = tmp_path / "c"
    cache = Cache(d, busy_timeout=0.2, flush_interval=0.01)
    holder = LockHolder(d / "pages.sqlite3")
    try:
        cache["a"] = 1
        with pytest.raises(FlushTimeoutError) as exc:
            cache.flush(timeout=1.0)
        assert "locked" in str(exc.value)
        assert cache["a"] == 1  # the memory tier keeps serving
        assert cache.stats().dirty_pages == 1  # the write stays queued
    finally:
        holder.release()
    cache.flush(timeout=30)  # written once the lock is released
    cache.close()
    assert contents(d) == {"a": 1}


# -- a real full file system (BR-018) -------------------------------------------------------


@pytest.fixture
def small_fs(tmp_path):
    """A 2 MiB tmpfs (needs root and mount permission; skipped otherwise,
    with mount's error as the reason). The skip hides no write path: the same
    ENOSPC paths run everywhere with injected errors and a real RLIMIT_FSIZE
    (test_log_write_error_stores_nothing_and_later_writes_work,
    test_real_file_size_limit_on_the_log); this one adds a real full file
    system, and the mapped log's preallocation on it (test_mapped_log.py).
    ``.ci/run`` sets DURABLEKV_REQUIRE_TMPFS=1, which turns the skip into a
    failure there, so CI cannot pass without running them."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        reason = f"cannot mount a small tmpfs here: {proc.stderr.strip()}"
        if os.environ.get("DURABLEKV_REQUIRE_TMPFS") == "1":
            pytest.fail(reason + "; DURABLEKV_REQUIRE_TMPFS=1 makes this a failure",
                        pytrace=False)
        pytest.skip(reason)
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_br018_disk_full_for_real(small_fs):
    d = small_fs / "c"
    filler = small_fs / "filler"
    filler.write_bytes(b"\0" * (1200 << 10))  # leaves ~800 KiB for the cache
    cache = Cache(d, page_size=4, max_pages=8, flush_interval=0.01, max_pending_pages=8)
    acked = {}
    error = None
    for i in range(5000):
        try:
            cache[f"k{i}"] = f"{i}:" + "v" * 2000
        except (LogWriteError, WriteBehindError) as exc:
            error = exc
            break
        acked[f"k{i}"] = f"{i}:" + "v" * 2000
    assert error is not None, "the file system never filled up"
    assert "NOT stored" in str(error)
    assert len(acked) > 20
    # reads of what is there keep working, from memory and from the store
    for k in list(acked)[:5] + list(acked)[-5:]:
        assert cache[k] == acked[k]
    filler.unlink()  # space comes back
    # A flush cycle that began before the unlink may still fail once after
    # it; the set then raises, as documented, and the caller retries.
    deadline = time.monotonic() + 30
    while True:
        try:
            cache["after"] = "ok"
            break
        except WriteBehindError:
            assert time.monotonic() < deadline, "the store never took writes again"
    acked["after"] = "ok"
    cache.flush(timeout=30)
    cache.close()
    with Cache(d) as cache:
        assert dict(cache.items()) == acked
    assert check_directory(str(d)).ok
    assert not [p for p in os.listdir(d) if p.endswith((".tmp", ".damaged"))]


# -- one page that SQLite keeps refusing (BR-017) ----------------------------------------


def test_br017_poison_page_is_isolated_and_the_rest_is_written(tmp_path, monkeypatch):
    d = tmp_path / "c"
    cache = Cache(d, page_size=1, max_pages=100, flush_interval=0.01)
    real = cache._store.write_batch
    state = {"poison": True}

    def write_batch(images, *args, **kwargs):
        if state["poison"] and any(b"bad" in img.data for img in images):
            raise sqlite3.OperationalError("poison: cannot store this row")
        return real(images, *args, **kwargs)

    monkeypatch.setattr(cache._store, "write_batch", write_batch)
    cache["good1"] = 1
    cache["bad"] = 2
    cache["good2"] = 3
    with pytest.raises(FlushTimeoutError) as exc:
        cache.flush(timeout=1.0)
    assert "poison" in str(exc.value)
    st = cache.stats()
    assert st.flush_errors >= 1 and st.dirty_pages == 1  # only the poison page is left
    assert cache._batcher.alive
    # good1 and good2 are in SQLite: a store-only reopen (log removed) shows them
    cache.set("later", 4)
    with pytest.raises(FlushTimeoutError):
        cache.flush(timeout=0.5)
    # the checkpoint stops below the poison page's change, so the log still covers it
    assert cache._store.checkpoint_lsn < 2
    conn = sqlite3.connect(f"file:{d / 'pages.sqlite3'}?mode=ro", uri=True)
    stored = {r[0] for r in conn.execute("SELECT data FROM pages")}
    conn.close()
    assert any(b"good1" in x for x in stored) and any(b"good2" in x for x in stored)
    assert any(b"later" in x for x in stored) and not any(b"bad" in x for x in stored)
    state["poison"] = False  # the fault clears: the page is retried and lands
    cache.flush(timeout=10)
    cache.close()
    assert contents(d) == {"good1": 1, "bad": 2, "good2": 3, "later": 4}


def poison_pages_holding_bad(cache: Cache) -> None:
    """From now on SQLite refuses (on this cache's connection) every flush
    holding a page with the key "bad" (BR-017's poison page)."""
    real = cache._store.write_batch

    def write_batch(images, *args, **kwargs):
        if any(b"bad" in img.data for img in images):
            raise sqlite3.OperationalError("poison: cannot store this row")
        return real(images, *args, **kwargs)

    cache._store.write_batch = write_batch


@pytest.mark.parametrize("first", ["bad", "k"])
def test_br017_a_key_moved_off_the_poison_page_waits_for_it(tmp_path, first):
    """k moves from the poison page (deleted there) to a new page. Storing the
    new page alone would leave k on two stored pages, the poison page's copy
    stale, and after a crash that copy came back ("old"), or the page fault
    called the store damaged. The new page now waits for the poison page;
    after a crash every acknowledged write reads back, in either order."""
    d = tmp_path / "c"
    cache = Cache(d, page_size=2, max_pages=100, flush_interval=0.01)
    cache["bad"] = "x"
    cache["k"] = "old"
    cache.flush()
    poison_pages_holding_bad(cache)
    cache["z"] = "zz"
    del cache["k"]
    cache["k"] = "new"   # on the page z opened
    with pytest.raises(FlushTimeoutError) as exc:
        cache.flush(timeout=1.0)
    assert "poison" in str(exc.value)       # the cause, not the page that waits
    assert cache.stats().dirty_pages == 2
    conn = sqlite3.connect(f"file:{d / 'pages.sqlite3'}?mode=ro", uri=True)
    assert conn.execute("SELECT count(*) FROM keys WHERE key = ?",
                        (b"s" + (1).to_bytes(4, "little") + b"k",)).fetchone() == (1,)
    conn.close()
    cache._teardown(clean=False)            # a crash
    with Cache(d, page_size=2, max_pages=1, flush_interval=0.01) as cache:
        cache.flush()
        for i in range(6):                  # k's page leaves memory
            cache[f"fill{i}"] = i
        cache.flush()
        want = {"bad": "x", "k": "new"}
        for key in (first, *(k for k in want if k != first)):
            assert cache.get(key) == want[key], key
        assert sorted(cache) == sorted(["bad", "z", "k"] + [f"fill{i}" for i in range(6)])
    assert check_directory(str(d)).ok


def test_a_waiting_flush_does_not_cut_the_back_off_short(tmp_path, monkeypatch):
    """While the store keeps failing, a flush(timeout=...) waiter made the
    batcher retry at once after every failure (about 300 to 1,000 attempts
    and WARNING lines in 3 s in the trial), although the log said "retrying
    in 1.000 s". Retries now keep to the back-off, which doubles from
    flush_interval (0.05 s) to 1 s: about 6 attempts in 2 s (12 allowed;
    a slow machine only makes fewer)."""
    cache = Cache(tmp_path / "c", flush_interval=0.05)
    attempts = []

    def write_batch(*args, **kwargs):
        attempts.append(1)
        raise sqlite3.OperationalError("disk I/O error")

    monkeypatch.setattr(cache._store, "write_batch", write_batch)
    cache["a"] = 1
    with pytest.raises(FlushTimeoutError):
        cache.flush(timeout=2.0)
    assert 1 <= len(attempts) <= 12, len(attempts)
    monkeypatch.undo()
    cache.flush(timeout=10)   # the store works again: the next retry lands
    cache.close()
    assert contents(tmp_path / "c") == {"a": 1}


def test_a_long_flush_interval_does_not_stretch_the_back_off(tmp_path, monkeypatch):
    """The back-off was capped at flush_interval when that was longer than
    1 s: with flush_interval=1000, a flush(timeout=5) that met a failing
    store waited for a retry 1000 s away and timed out although the store
    recovered at once. Retries now come at least every second."""
    cache = Cache(tmp_path / "c", flush_interval=1000)
    real = cache._store.write_batch
    calls = []

    def write_batch(*args, **kwargs):
        calls.append(1)
        if len(calls) <= 2:
            raise sqlite3.OperationalError("database is locked")
        return real(*args, **kwargs)

    monkeypatch.setattr(cache._store, "write_batch", write_batch)
    cache["a"] = 1
    cache.flush(timeout=5)
    assert len(calls) == 3
    cache.close()
    assert contents(tmp_path / "c") == {"a": 1}


def test_br017_a_page_that_waited_for_a_page_tried_later_is_stored_in_the_same_flush(
        tmp_path):
    """Page B took key k from page A; page C is the poison page. Halving
    tries B (A still uncommitted: B must wait) before A (which commits): B
    is tried once more at the end of the flush and stored, so only the
    poison page is left."""
    d = tmp_path / "c"
    cache = Cache(d, page_size=2, max_pages=100, flush_interval=3600)
    cache["a1"], cache["k"] = "A", "old"       # page A
    cache["bad"], cache["c1"] = "x", "C"       # page C
    cache.flush()
    poison_pages_holding_bad(cache)
    cache["b1"] = "B"                          # page B, dirty first
    del cache["k"]                             # page A
    cache["k"] = "new"                         # onto page B
    cache["c1"] = "C2"                         # page C
    pid = {key: cache._tier.table[key][0].page_id for key in ("b1", "a1", "c1")}
    assert [p.page_id for p in cache._tier.dirty.values()] == [pid["b1"], pid["a1"], pid["c1"]]
    with pytest.raises(WriteBehindError) as exc:
        cache.flush()
    assert f"page(s) [{pid['c1']}]" in str(exc.value)
    assert cache.stats().dirty_pages == 1
    cache._teardown(clean=False)
    assert contents(d) == {"a1": "A", "k": "new", "bad": "x", "c1": "C2", "b1": "B"}


def test_br017_unserializable_value_is_refused_in_the_callers_thread(tmp_path):
    with Cache(tmp_path / "c") as cache:
        with pytest.raises(TypeError) as exc:
            cache["f"] = lambda: 1
        assert "function" in str(exc.value)
        assert cache.stats().sets == 0 and len(cache) == 0
        cache.flush(timeout=5)
        assert cache.stats().flush_errors == 0


def test_page_byte_limit_moves_big_entries_to_other_pages(tmp_path, monkeypatch):
    """Pages stay under SQLite's blob limit: with the limit made small, inserts
    start new pages and a growing overwrite moves its entry."""
    import durablekv.tier.pages as pages

    monkeypatch.setattr(pages, "PAGE_BYTES_LIMIT", 10_000)
    d = tmp_path / "c"
    with Cache(d, page_size=16, max_pages=4) as cache:
        for i in range(10):
            cache[f"k{i}"] = "x" * 3000  # ~3 entries fit a page
        cache["k0"] = "y" * 6000  # overwrite that no longer fits its page
        cache.flush()
        conn = sqlite3.connect(f"file:{d / 'pages.sqlite3'}?mode=ro", uri=True)
        sizes = [r[0] for r in conn.execute("SELECT length(data) FROM pages")]
        conn.close()
        assert max(sizes) <= 10_000 + 16 * 64
        assert len(sizes) >= 4
    with Cache(d) as cache:
        assert cache["k0"] == "y" * 6000 and len(cache) == 10
    assert check_directory(str(d)).ok


def test_oversized_key_is_refused(tmp_path):
    with Cache(tmp_path / "c") as cache:
        with pytest.raises(ValueError) as exc:
            cache["k" * (2 << 20)] = 1
        assert "limit on keys" in str(exc.value)


def test_a_log_segment_that_cannot_be_deleted_is_kept_and_nothing_is_committed_twice(
        tmp_path, monkeypatch, caplog):
    """Cutting the log back after a commit can fail (here: EACCES on one
    segment). The commit stands: the segment stays listed and goes at the
    next checkpoint, no page is written again, and the key count is right."""
    d = tmp_path / "c"
    real_unlink = os.unlink
    refused: list[str] = []

    def unlink(path, *args, **kwargs):
        if str(path).endswith(".log") and not refused:
            refused.append(str(path))
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real_unlink(path, *args, **kwargs)

    with Cache(d, page_size=4, segment_bytes=4096, flush_interval=30.0,
               flush_batch_pages=1000) as c:
        commits = []
        real_commit = c._store._commit
        monkeypatch.setattr(c._store, "_commit",
                            lambda conn: (commits.append(1), real_commit(conn)))
        for i in range(300):
            c[f"k{i}"] = "x" * 40
        monkeypatch.setattr(os, "unlink", unlink)
        c.flush()
        assert len(refused) == 1 and commits == [1]
        assert "cannot delete this segment" in caplog.text
        assert refused[0] in list_segments(str(d))
        assert c._store.key_count == len(c) == 300
        c["more"] = "y"
        c.flush()   # the next checkpoint deletes it
        assert refused[0] not in list_segments(str(d)) and commits == [1, 1]
    with Cache(d) as c:
        assert len(c) == 301 and c["k299"] == "x" * 40


@pytest.mark.parametrize("cut", ["at once", "at the next set"])
def test_a_short_log_write_is_cut_off_and_the_log_stays_whole(tmp_path, monkeypatch, cut):
    """A write(2) that stores only part of a record (a full disk can do that)
    raises LogWriteError, and the part is cut off again; where that cut fails
    too, the next set retries it and refuses to write behind the torn part."""
    from durablekv.log import replaylog

    monkeypatch.setattr(replaylog, "mapped_append_refusal", lambda *args: "a test's write(2)")
    real_write, real_ftruncate = ReplayLog._write, os.ftruncate
    short, refused = [], []

    def write(self, fd, data):
        if short:
            short.clear()
            return real_write(self, fd, data[:len(data) // 2])
        return real_write(self, fd, data)

    def ftruncate(fd, length):
        if refused:
            raise OSError(errno.EIO, "Input/output error")
        return real_ftruncate(fd, length)

    monkeypatch.setattr(ReplayLog, "_write", write)
    monkeypatch.setattr(os, "ftruncate", ftruncate)
    path = tmp_path / "c"
    cache = Cache(path, flush_interval=3600, flush_batch_pages=10**6)
    assert cache._log.append_mode == "write"
    cache["a"] = 1
    short.append(True)
    if cut == "at the next set":
        refused.append(True)
    with pytest.raises(LogWriteError, match="short write"):
        cache["b"] = 2
    if refused:
        with pytest.raises(LogWriteError, match="Input/output error"):
            cache["x"] = 0
        refused.clear()
    cache["c"] = 3
    cache._teardown(clean=False)  # a crash: no flush, the log kept
    monkeypatch.undo()
    with Cache(path) as cache:
        assert dict(cache.items()) == {"a": 1, "c": 3}
