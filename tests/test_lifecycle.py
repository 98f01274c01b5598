"""Process lifecycle: exit without close, killed lock owners, fork, two processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import durablekv
from durablekv import Cache, CacheLockedError, LogWriteError

from .conftest import interrupt_first_removal, opened, owner_process

REPO = Path(__file__).resolve().parents[1]


def run(script: str, *args: str, check_rc: int | None = 0) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "-c", script, *args], env=env, capture_output=True,
                          text=True, timeout=120)
    if check_rc is not None:
        assert proc.returncode == check_rc, proc.stderr
    return proc


WRITE_100 = """
import sys
from durablekv import Cache
c = Cache(sys.argv[1], flush_interval=3600, flush_batch_pages=10**6, durability="none")
for i in range(100):
    c[i] = i
"""


def test_br016_normal_exit_without_close_loses_nothing(tmp_path):
    """Even with durability="none" (no log): the at-exit drain flushes."""
    run(WRITE_100 + "sys.exit(0)\n", str(tmp_path / "c"))
    with Cache(tmp_path / "c") as cache:
        assert dict(cache.items()) == {i: i for i in range(100)}


def test_br016_uncaught_exception_loses_nothing(tmp_path):
    proc = run(WRITE_100 + "raise RuntimeError('boom')\n", str(tmp_path / "c"), check_rc=1)
    assert "boom" in proc.stderr
    with Cache(tmp_path / "c") as cache:
        assert len(cache) == 100


def test_br016_sigkill_right_after_the_last_set(tmp_path):
    script = WRITE_100.replace('durability="none"', 'durability="log"') + \
        "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n"
    proc = run(script, str(tmp_path / "c"), check_rc=None)
    assert proc.returncode == -signal.SIGKILL
    with Cache(tmp_path / "c") as cache:
        assert dict(cache.items()) == {i: i for i in range(100)}
        assert cache.stats().recovered_records == 100


def test_second_process_gets_locked_error_naming_the_owner(tmp_path):
    d = tmp_path / "c"
    with Cache(d) as cache:
        cache["a"] = 1
        proc = run("import sys\nfrom durablekv import Cache, CacheLockedError\n"
                   "try:\n    Cache(sys.argv[1])\nexcept CacheLockedError as e:\n"
                   "    print(e.pid); print(e)\n", str(d))
        pid_line, message = proc.stdout.splitlines()[:2]
        assert int(pid_line) == os.getpid()
        assert f"process {os.getpid()}" in message and str(d) in message
        with pytest.raises(CacheLockedError):
            Cache(d)  # same process, second handle


def test_killed_owner_does_not_keep_the_lock(tmp_path):
    d = tmp_path / "c"
    owner = owner_process(d, close=False)
    try:
        with pytest.raises(CacheLockedError) as exc:
            Cache(d)
        assert exc.value.pid == owner.pid
        owner.kill()
        owner.wait(timeout=30)
    finally:
        if owner.poll() is None:
            owner.kill()
    with Cache(d) as cache:  # the flock died with its owner
        assert cache["x"] == 1


FORK_SCRIPT = r"""
import os, sys, threading
from durablekv import Cache, CacheClosedError
from durablekv.check import check_directory

parent_dir, other_dir = sys.argv[1], sys.argv[2]
cache = Cache(parent_dir, page_size=2, max_pages=2, flush_interval=0.001)
stop = threading.Event()

def writer():  # keeps the cache lock busy while we fork
    i = 0
    while not stop.is_set():
        cache[f"t{i % 50}"] = i
        i += 1

t = threading.Thread(target=writer)
t.start()
for n in range(20):
    pid = os.fork()
    if pid == 0:
        try:
            cache.get("t1")
        except CacheClosedError as exc:
            assert "fork" in str(exc), exc
        else:
            os._exit(3)
        cache.close()  # a no-op in the child: nothing of the parent's is touched
        with open(other_dir + str(n), "w") as f:
            f.write(str(n))
        sys.exit(0)  # normal exit: atexit and finalizers run in the child too
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, status
stop.set()
t.join()
cache["after"] = "forks"
cache.close()
with Cache(parent_dir) as again:
    assert again["after"] == "forks" and len(again) == 51
assert check_directory(parent_dir).ok
print("ok")
"""


def test_fork_never_hangs_the_child_nor_damages_the_parent(tmp_path):
    proc = run(FORK_SCRIPT, str(tmp_path / "parent"), str(tmp_path / "child"))
    assert proc.stdout.strip() == "ok"
    for n in range(20):  # every child ran to its normal exit
        assert (tmp_path / f"child{n}").read_text() == str(n)


def test_an_exception_from_a_signal_handler_never_leaves_the_lock_held(tmp_path):
    """A KeyboardInterrupt (here: any exception from a signal handler) can
    land between any two bytecodes of a get. Taking the lock with 'with'
    leaves no moment where it is held outside the block that releases it; a
    bare lock.acquire() before 'try' does, and then every later call and
    close() at exit would hang."""
    class Interrupted(Exception):
        pass

    def handler(signum, frame):
        raise Interrupted()

    old = signal.signal(signal.SIGALRM, handler)
    interrupted = 0
    try:
        with opened(tmp_path / "c") as cache:  # (a close() that hangs fails the test)
            cache["k"] = b"v"
            for _ in range(300):
                try:
                    # armed inside the try: on a loaded machine 0.5 ms can
                    # pass before the next bytecode runs
                    signal.setitimer(signal.ITIMER_REAL, 0.0005)
                    while True:
                        cache.get("k")
                except Interrupted:
                    interrupted += 1
                assert not cache._lock.locked()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    assert interrupted == 300


class _CutShort(threading.Event):
    """The wait at the end of Thread.start(), ended by an exception the way a
    signal handler's (Ctrl-C; SIGTERM in ``durablekv replay``) ends it: the
    thread is launched and runs, but has not yet reported that it runs."""

    def __init__(self) -> None:
        super().__init__()
        self.cut = False

    def wait(self, timeout=None):
        if not self.cut and threading.current_thread() is threading.main_thread():
            self.cut = True
            raise KeyboardInterrupt
        return super().wait(timeout)


def test_an_interrupt_before_a_thread_is_launched_does_not_hang_its_start(monkeypatch):
    """Thread.start() lists the thread before it launches it; an exception
    landing in between leaves a listed thread that never runs, and the wait
    for it to report must end (it spun for good, keeping SIGTERM's exit)."""
    from durablekv import _threads
    launch = "_start_joinable_thread" if hasattr(threading, "_start_joinable_thread") \
        else "_start_new_thread"

    def interrupted_launch(*args, **kwargs):
        raise KeyboardInterrupt  # as if it landed just before the launch

    monkeypatch.setattr(threading, launch, interrupted_launch)
    monkeypatch.setattr(_threads, "_LAUNCH_SECONDS", 0.05)
    phantom = threading.Thread(target=lambda: None, name="never-launched")
    try:
        with pytest.raises(KeyboardInterrupt):
            _threads.start_thread(phantom)
        assert not phantom.is_alive()
    finally:
        threading._limbo.pop(phantom, None)  # as 3.11's start() leaves it


@pytest.mark.parametrize("thread", ["durablekv-batcher", "durablekv-warm"])
def test_an_interrupt_while_open_starts_a_thread_still_closes_cleanly(tmp_path, monkeypatch,
                                                                    thread):
    """Seen in CI as 'cannot join thread before it is started' when SIGTERM
    reached a replay as it reopened its cache: the unwinding open must wait
    for the half-started thread and release the directory."""
    path = tmp_path / "c"
    with opened(path) as cache:
        cache["k"] = b"v"  # so a reopen has a warm list to preload
    start = threading.Thread.start
    cut = []

    def interrupted_start(self):
        if self.name.startswith(thread + "["):
            self._started = _CutShort()  # Thread.start waits on this Event
            cut.append(self)
        start(self)

    monkeypatch.setattr(threading.Thread, "start", interrupted_start)
    with pytest.raises(KeyboardInterrupt):
        Cache(path)
    monkeypatch.undo()
    assert len(cut) == 1 and not cut[0].is_alive()  # waited for, and stopped
    assert not [t for t in threading.enumerate() if t.name.startswith("durablekv-")]
    with opened(path) as cache:  # the directory lock was released
        assert cache["k"] == b"v"


def _ctrl_c_once_main_thread_is_in(function: str) -> threading.Thread:
    """A thread that sends SIGINT (Ctrl-C) to the main thread as soon as the
    main thread runs ``function`` (a frame of that name on its stack): a
    real signal, so a blocking wait there is cut short as Ctrl-C cuts it."""
    main = threading.main_thread().ident

    def watch():
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            frame = sys._current_frames().get(main)
            while frame is not None:
                if frame.f_code.co_name == function:
                    signal.pthread_kill(main, signal.SIGINT)
                    return
                frame = frame.f_back
            time.sleep(0.001)

    t = threading.Thread(target=watch, name="ctrl-c", daemon=True)
    t.start()
    return t


def test_ctrl_c_while_close_waits_for_the_write_behind_still_releases_the_directory(tmp_path):
    """Ctrl-C as close() waited for the write-behind thread to end its cycle
    stopped the close there: the log, the store and the directory lock were
    never released, a second close() did nothing (the cache said closing),
    and every later open in this process raised CacheLockedError. (Python
    3.11's Thread.join, cut short, also reports the running thread stopped.)
    Now the close waits for the thread, releases everything, then raises."""
    path = tmp_path / "c"
    cache = Cache(path)
    for i in range(100):
        cache[f"k{i}"] = i
    cache.flush()
    inside, gate = threading.Event(), threading.Event()

    def held_cycle():  # the write-behind's next cycle waits here
        inside.set()
        gate.wait(30)

    cache._background_work = held_cycle
    cache._batcher.kick(urgent=True)
    assert inside.wait(10)
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        watcher = _ctrl_c_once_main_thread_is_in("join")
        threading.Timer(0.3, gate.set).start()  # the cycle ends after the interrupt
        with pytest.raises(KeyboardInterrupt):
            cache.close()
        watcher.join()
    finally:
        signal.signal(signal.SIGINT, old)
        gate.set()
    assert cache.closed
    assert not [t for t in threading.enumerate() if t.name.startswith("durablekv-")]
    with opened(path) as again:  # the directory lock was released
        assert dict(again.items()) == {f"k{i}": i for i in range(100)}


@pytest.mark.parametrize("where", ["the residency list", "the replay log", "the store"])
def test_an_interrupt_in_the_last_steps_of_close_still_releases_the_directory(
        tmp_path, monkeypatch, where):
    """An exception from a signal handler (Ctrl-C) as close() saves the
    warm-restart list, closes the log or closes the store: what is left is
    still released (the log kept, so nothing acknowledged depends on the cut
    step), and the cache reopens in this process with every entry."""
    from durablekv.log.replaylog import ReplayLog
    from durablekv.stores.sqlite import SQLitePageStore
    from durablekv.warm import WarmRestart

    cls, name = {"the residency list": (WarmRestart, "_residency_at_close"),
                 "the replay log": (ReplayLog, "close"),
                 "the store": (SQLitePageStore, "close")}[where]
    real = getattr(cls, name)

    def interrupted(self, *args, **kwargs):
        real(self, *args, **kwargs)  # done, and the interrupt lands as it returns
        raise KeyboardInterrupt

    path = tmp_path / "c"
    cache = Cache(path)
    for i in range(100):
        cache[f"k{i}"] = i
    monkeypatch.setattr(cls, name, interrupted)
    with pytest.raises(KeyboardInterrupt):
        cache.close()
    monkeypatch.undo()
    assert cache.closed
    cache.close()  # idempotent, as ever
    with opened(path) as again:
        assert dict(again.items()) == {f"k{i}": i for i in range(100)}


@pytest.mark.parametrize("where", ["LOCK gets the pid", "open sets up its state"])
def test_an_interrupt_just_after_open_takes_the_directory_lock_releases_it(tmp_path,
                                                                          monkeypatch, where):
    """An exception from a signal handler (Ctrl-C) landing right after open
    took the directory's flock (as LOCK got this process's pid, or as open
    set up its state before the part that cleans up after itself) left the
    lock held: every later open in this process raised CacheLockedError."""
    from durablekv import dirlock
    from durablekv.warm import WarmRestart

    path = tmp_path / "c"
    with opened(path) as cache:
        cache["k"] = b"v"
    if where == "LOCK gets the pid":
        real = os.pwrite

        def interrupted(*args):
            real(*args)  # written, and the interrupt lands as it returns
            raise KeyboardInterrupt

        monkeypatch.setattr(dirlock.os, "pwrite", interrupted)
    else:
        def interrupted(self, warm):
            raise KeyboardInterrupt

        monkeypatch.setattr(WarmRestart, "_warm_init", interrupted)
    with pytest.raises(KeyboardInterrupt):
        Cache(path)
    monkeypatch.undo()
    with opened(path) as cache:  # the directory lock was released
        assert cache["k"] == b"v"


def test_an_interrupt_as_a_temporary_cache_makes_its_directory_leaves_none(tmp_path,
                                                                          monkeypatch):
    """Cache() with no directory makes one and removes it at close; Ctrl-C
    landing as mkdir returned it (inside tempfile.mkdtemp) left it behind,
    as the open's cleanup began later."""
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    real = os.mkdir

    def interrupted(path, *args, **kwargs):
        real(path, *args, **kwargs)
        raise KeyboardInterrupt  # the signal lands as mkdir returns

    with monkeypatch.context() as m:
        m.setattr(os, "mkdir", interrupted)
        with pytest.raises(KeyboardInterrupt):
            Cache()
    assert list(tmp_path.iterdir()) == []
    with Cache() as cache:  # and a temporary cache still works as before
        cache["k"] = b"v"
        made = Path(cache.path)
        assert made.parent == tmp_path and made.stat().st_mode & 0o777 == 0o700
    assert not made.exists()


def test_an_interrupt_as_close_removes_a_temporary_directory_still_removes_all_of_it(
        tmp_path, monkeypatch):
    """Ctrl-C landing in the removal of Cache()'s temporary directory (as a
    file's unlink returned) stopped it halfway and left the directory."""
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    cache = Cache()
    cache["k"] = b"v"

    def interrupt():
        raise KeyboardInterrupt

    with monkeypatch.context() as m:
        removing = interrupt_first_removal(m, interrupt)
        with pytest.raises(KeyboardInterrupt):
            cache.close()
    assert "cut" in removing
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("cut", ["at once", "at the next set"])
@pytest.mark.parametrize("how", ["the C kernel", "the write seam"])
def test_an_interrupt_as_a_log_record_is_written_leaves_the_log_whole(tmp_path, monkeypatch,
                                                                       how, cut):
    """Where records are appended with write(2) (file systems that get no
    mapped segment): Ctrl-C landing as a set's write returned left its
    record in the log while the set raised and took no LSN. A program that
    went on (a REPL) logged its next set under the same LSN, and after a
    crash the log could not be opened ('LSN 2 follows 2'); salvaging it
    dropped that acknowledged set. The record of a set that raised is cut."""
    from durablekv.log import replaylog
    from durablekv.log.replaylog import ReplayLog

    monkeypatch.setattr(replaylog, "mapped_append_refusal", lambda *args: "a test's write(2)")
    armed = []
    if how == "the C kernel":
        if replaylog._WRITE_RECORD is None:
            pytest.skip("needs the C kernels: " + durablekv.accelerated.reason
                        + " (the write seam case runs the Python path)")
        real_kernel = replaylog._WRITE_RECORD

        def kernel(*args):
            result = real_kernel(*args)
            if armed and armed.pop():
                raise KeyboardInterrupt  # the signal lands as the write returns
            return result

        monkeypatch.setattr(replaylog, "_WRITE_RECORD", kernel)
    else:
        real_write = ReplayLog._write

        def write(self, fd, data):
            n = real_write(self, fd, data)
            if armed and armed.pop():
                raise KeyboardInterrupt
            return n

        monkeypatch.setattr(ReplayLog, "_write", write)
    real_ftruncate = os.ftruncate
    refused = []  # while true, cutting the segment fails (an I/O error)

    def ftruncate(fd, length):
        if refused:
            raise OSError(5, "Input/output error")
        return real_ftruncate(fd, length)

    monkeypatch.setattr(os, "ftruncate", ftruncate)
    path = tmp_path / "c"
    cache = Cache(path, flush_interval=3600, flush_batch_pages=10**6)
    assert cache._log.append_mode == "write"
    cache["a"] = 1
    armed.append(True)
    if cut == "at the next set":
        refused.append(True)
    with pytest.raises(KeyboardInterrupt):
        cache["b"] = 2
    if refused:
        # the next set tries the cut again and, while it still fails,
        # refuses to write behind the stray record
        with pytest.raises(LogWriteError, match="Input/output error"):
            cache["x"] = 0
        refused.clear()
    cache["c"] = 3  # the program goes on
    assert dict(cache.items()) == {"a": 1, "c": 3}
    cache._teardown(clean=False)  # then crashes: no flush, the log kept
    monkeypatch.undo()
    with opened(path) as cache:
        assert dict(cache.items()) == {"a": 1, "c": 3}


def test_an_interrupt_as_open_pauses_the_garbage_collector_leaves_it_running(tmp_path,
                                                                             monkeypatch):
    """Open pauses the cyclic garbage collector while it reads the log; Ctrl-C
    landing as gc.disable() returned left it off for the rest of the process."""
    import gc

    assert gc.isenabled()
    real = gc.disable

    def interrupted():
        real()
        raise KeyboardInterrupt  # the signal lands as disable() returns

    try:
        with monkeypatch.context() as m:
            m.setattr(gc, "disable", interrupted)
            with pytest.raises(KeyboardInterrupt):
                Cache(tmp_path / "c")
        assert gc.isenabled()
    finally:
        gc.enable()
    with opened(tmp_path / "c") as cache:  # and the open cleaned up after itself
        cache["k"] = b"v"


@pytest.mark.parametrize("how", ["copy", "deepcopy", "pickle"])
def test_a_cache_cannot_be_copied_or_pickled(tmp_path, how):
    """A copy would share the directory's lock, SQLite connections and
    writer thread with no owner: copy.copy(cache) then close() hung forever
    in flush_until. Each way is refused with a TypeError that says what to
    do instead, and the original cache goes on working and closes."""
    import copy
    import pickle

    do = {"copy": copy.copy, "deepcopy": copy.deepcopy,
          "pickle": lambda c: pickle.dumps(c, protocol=pickle.HIGHEST_PROTOCOL)}[how]
    with opened(tmp_path / "c") as cache:
        cache["a"] = 1
        with pytest.raises(TypeError) as info:
            do(cache)
        msg = str(info.value)
        assert "cannot be" in msg and ("copied" in msg or "pickled" in msg)
        assert "owns its directory" in msg and str(tmp_path / "c") in msg
        assert "thread" in msg and "another process" in msg
        cache["b"] = 2
        cache.flush()
    with opened(tmp_path / "c") as again:
        assert dict(again.items()) == {"a": 1, "b": 2}


def test_vacuum_of_a_closed_store_gives_space_back_and_keeps_every_entry(tmp_path):
    """The README's way to shrink pages.sqlite3: VACUUM it while the cache is
    closed. Page ids (INTEGER PRIMARY KEY) and the key index survive it."""
    import sqlite3

    from durablekv.check import check_directory

    d = tmp_path / "c"
    with opened(d, page_size=16, max_pages=8) as c:
        for i in range(20_000):
            c.set(f"k{i}", b"v" * 200, expire=None if i % 10 else 3600)
        c.flush()
        for i in range(20_000):
            if i % 50:
                c.delete(f"k{i}")
        want = dict(c.items())
    path = d / "pages.sqlite3"
    before = path.stat().st_size
    conn = sqlite3.connect(path)
    conn.execute("VACUUM")
    conn.close()
    assert path.stat().st_size < before / 4
    assert check_directory(str(d)).ok
    with opened(d, page_size=16, max_pages=8) as c:
        assert len(c) == len(want) == 400
        assert dict(c.items()) == want
        assert c.get("k50") == b"v" * 200
        c.set("new", b"x")
    assert check_directory(str(d)).ok
