"""Restart cases: reopen after a clean close; recovery after SIGKILL.

``reopen``    caches of 10k, 100k and 1M entries (16-byte keys, 100 B values)
              are built and closed cleanly; each repetition times
              ``Cache(dir)`` for every size (round-robin), with the files in
              the OS page cache (``hot``) and after ``fsync`` +
              ``posix_fadvise(DONTNEED)`` of every file (``cold``). Design
              invariant 6 says the time does not grow with the store.
``recovery``  a child process (``python -m bench.restart DIR N``) opens a cache
              with ``flush_interval`` and ``flush_batch_pages`` so large that
              nothing is ever flushed and ``max_pages`` so large that nothing
              is evicted, writes N sets in ``log`` mode, says so, and is
              SIGKILLed. Each repetition copies that directory and times
              ``Cache(copy, max_pages=...)`` (defaults otherwise): the replay
              of N log records into the memory tier (open does not wait for
              the write-behind to store them; the log keeps them until it
              has). ``stats().recovered_records`` must equal N.
``reopen-after-kill``  a child (``python -m bench.restart --checkpointed DIR N K``)
              writes N sets in ``log`` mode, flushes (the store's checkpoint
              then covers all N, which stay in the active log segment), writes
              K more sets, says so, and is SIGKILLed. Each repetition copies
              that directory (fsyncing the copy, as the writer had fsynced its
              log at the flush) and times ``Cache(copy)`` with the C kernels and
              with ``DURABLEKV_PURE``'s fallback in turns: the open after a
              crash of a cache that was checkpointing, which should cost the
              K records after the checkpoint, not the N before it.
              ``stats().recovered_records`` must equal K. Run alone:
              ``python -m bench.restart reopen-after-kill [N [K [REPEAT]]]``.
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from typing import Any

from .util import REPO, Scratch, Settings, fsync_tree, note, rotate, summarize

VALUE = b"v" * 100


def _key(i: int) -> str:
    return f"r:{i:014d}"


def _build(directory: str, n: int) -> float:
    from durablekv import Cache
    t0 = time.perf_counter()
    with Cache(directory, durability="none", flush_batch_pages=256) as c:
        s = c.set
        for i in range(n):
            s(_key(i), VALUE)
    return time.perf_counter() - t0


def _drop_os_cache(directory: str) -> None:
    for name in os.listdir(directory):
        path = os.path.join(directory, name)
        if not os.path.isfile(path):
            continue
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        except OSError:
            pass
        finally:
            os.close(fd)


def _time_open(directory: str, probe_key: str) -> tuple[float, float]:
    """Seconds for ``Cache(directory)``, and for the first get after it."""
    from durablekv import Cache
    t0 = time.perf_counter()
    c = Cache(directory)
    t1 = time.perf_counter()
    try:
        v = c.get(probe_key)
        t2 = time.perf_counter()
        assert v == VALUE, f"reopened cache lost {probe_key!r}"
    finally:
        c.close()
    return t1 - t0, t2 - t1


def run_reopen(cfg: Settings, scratch: Scratch) -> list[dict[str, Any]]:
    dirs = {}
    for n in cfg.restart_sizes:
        d = scratch.sub(f"reopen-{n}")
        secs = _build(d, n)
        dirs[n] = d
        note(f"restart: built a closed cache of {n:,} entries in {secs:.1f} s")
    samples: dict[tuple[int, str], list[float]] = {}
    first_get: dict[tuple[int, str], list[float]] = {}
    for r in range(cfg.repeat):
        for n in rotate(list(cfg.restart_sizes), r):
            for temp in ("hot", "cold"):
                if temp == "cold":
                    _drop_os_cache(dirs[n])
                else:
                    _time_open(dirs[n], _key(0))  # make sure the files are cached
                o, g = _time_open(dirs[n], _key(n // 2))
                samples.setdefault((n, temp), []).append(o * 1e3)
                first_get.setdefault((n, temp), []).append(g * 1e3)
    rows = []
    for n in cfg.restart_sizes:
        store_bytes = sum(os.path.getsize(os.path.join(dirs[n], f)) for f in os.listdir(dirs[n])
                          if os.path.isfile(os.path.join(dirs[n], f)))
        for temp in ("hot", "cold"):
            rows.append({"case": "reopen", "entries": n, "page_cache": temp, "unit": "ms",
                         "store_bytes": store_bytes, **summarize(samples[(n, temp)]),
                         "first_get_ms": summarize(first_get[(n, temp)])})
        scratch.remove(dirs[n])
    return rows


def _killed_child(args: list[str], what: str) -> str:
    """Run ``python -m bench.restart ARGS``, wait for its ``DONE ...`` line,
    SIGKILL it; return that line."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.Popen([sys.executable, "-m", "bench.restart", *args],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, cwd=str(REPO))
    try:
        line = proc.stdout.readline()
        if not line.startswith("DONE"):
            proc.kill()
            raise RuntimeError(f"{what} failed: {line!r} {proc.stderr.read()[-2000:]}")
        os.kill(proc.pid, signal.SIGKILL)   # our own child
    finally:
        proc.wait()
        proc.stdin.close()
    return line


def _crash_dir(n: int, scratch: Scratch) -> tuple[str, int]:
    d = scratch.sub("crashed")
    line = _killed_child([d, str(n)], "crash writer")
    return d, int(line.split()[2])


def run_recovery(cfg: Settings, scratch: Scratch) -> list[dict[str, Any]]:
    from durablekv import Cache
    n = cfg.crash_records
    t0 = time.perf_counter()
    crashed, max_pages = _crash_dir(n, scratch)
    log_bytes = sum(os.path.getsize(os.path.join(crashed, f)) for f in os.listdir(crashed)
                    if f.startswith("replay-"))
    note(f"restart: {n:,} sets written and SIGKILLed in {time.perf_counter() - t0:.1f} s "
         f"({log_bytes / 1e6:.0f} MB of log)")
    import durablekv
    from durablekv._accel import pure_kernels
    # With the C kernels built, the fallback recovers the same log in turns
    # with them (native first, then pure, then native ...).
    kinds = ["native", "pure"] if durablekv.accelerated else ["native"]
    wall: dict[str, list[float]] = {k: [] for k in kinds}
    inside: dict[str, list[float]] = {k: [] for k in kinds}
    recovered: dict[str, list[int]] = {k: [] for k in kinds}
    for _r in range(cfg.slow_repeat):
        for kind in kinds:
            d = scratch.sub("recover")
            shutil.rmtree(d)
            shutil.copytree(crashed, d)
            with pure_kernels() if kind == "pure" else contextlib.nullcontext():
                t1 = time.perf_counter()
                c = Cache(d, max_pages=max_pages)
                t2 = time.perf_counter()
                try:
                    st = c.stats()
                    assert c.get(_key(n - 1)) == VALUE, \
                        "the last acknowledged set was not recovered"
                finally:
                    c.close()
            scratch.remove(d)
            wall[kind].append(t2 - t1)
            inside[kind].append(st.recovery_seconds)
            recovered[kind].append(st.recovered_records)
    scratch.remove(crashed)
    rows = []
    for kind in kinds:
        rate = [rec / w for rec, w in zip(recovered[kind], wall[kind])]
        if any(x != n for x in recovered[kind]):
            note(f"restart: recovery ({kind}) replayed {recovered[kind]} records, "
                 f"expected {n:,} each time")
        rows.append({"case": "recovery" if kind == "native" else "recovery-pure",
                     "kernels": kind if durablekv.accelerated else "pure", "records": n, "recovered_records": recovered[kind],
                     "all_recovered": all(x == n for x in recovered[kind]),
                     "log_bytes": log_bytes, "max_pages": max_pages, "unit": "records/s",
                     **summarize(rate), "open_seconds": summarize(wall[kind]),
                     "recovery_seconds_stat": summarize(inside[kind])})
    return rows


def _checkpointed_dir(n: int, k: int, scratch: Scratch) -> str:
    d = scratch.sub("checkpointed")
    _killed_child(["--checkpointed", d, str(n), str(k)], "checkpointed writer")
    return d


def run_reopen_after_kill(n: int = 100_000, k: int = 100, repeat: int = 7,
                          scratch: Scratch | None = None) -> list[dict[str, Any]]:
    """The ``reopen-after-kill`` case (see the module docstring): one row per
    kernel kind, open times in ms."""
    from durablekv import Cache
    import durablekv
    from durablekv._accel import pure_kernels
    own = scratch is None
    scratch = scratch or Scratch()
    try:
        crashed = _checkpointed_dir(n, k, scratch)
        log_bytes = sum(os.path.getsize(os.path.join(crashed, f)) for f in os.listdir(crashed)
                        if f.startswith("replay-"))
        kinds = ["native", "pure"] if durablekv.accelerated else ["pure"]
        wall: dict[str, list[float]] = {kind: [] for kind in kinds}
        for r in range(repeat):
            for kind in rotate(kinds, r):
                d = scratch.sub("reopen-after-kill")
                shutil.rmtree(d)
                shutil.copytree(crashed, d)
                fsync_tree(d)  # on disk as the writer's files were (it fsynced at the flush)
                with pure_kernels() if kind == "pure" else contextlib.nullcontext():
                    t1 = time.perf_counter()
                    c = Cache(d)
                    t2 = time.perf_counter()
                    try:
                        st = c.stats()
                        assert st.recovered_records == k, st.recovered_records
                        assert c.get(_key(n + k - 1)) == VALUE, \
                            "the last acknowledged set was not recovered"
                    finally:
                        c.close()
                scratch.remove(d)
                wall[kind].append((t2 - t1) * 1e3)
        scratch.remove(crashed)
        return [{"case": "reopen-after-kill", "kernels": kind, "checkpointed_records": n,
                 "records_after_checkpoint": k, "log_bytes": log_bytes,
                 "unit": "ms", **summarize(wall[kind])}
                for kind in kinds]
    finally:
        if own:
            scratch.close()


def checkpointed_child(directory: str, n: int, k: int) -> None:
    from durablekv import Cache
    c = Cache(directory, page_size=16, durability="log")
    s = c.set
    for i in range(n):
        s(_key(i), VALUE)
    c.flush()
    for i in range(n, n + k):
        s(_key(i), VALUE)
    sys.stdout.write(f"DONE {n} {k}\n")
    sys.stdout.flush()
    sys.stdin.read()   # the parent SIGKILLs us here; if it dies first, stdin ends
    os._exit(1)


def child(directory: str, n: int) -> None:
    from durablekv import Cache
    max_pages = math.ceil(n / 16) + 16
    c = Cache(directory, page_size=16, max_pages=max_pages, durability="log",
              flush_interval=1e9, flush_batch_pages=1 << 30)
    s = c.set
    for i in range(n):
        s(_key(i), VALUE)
    st = c.stats()
    assert st.flushes == 0 and st.evictions == 0, st
    sys.stdout.write(f"DONE {n} {max_pages}\n")
    sys.stdout.flush()
    sys.stdin.read()   # the parent SIGKILLs us here; if it dies first, stdin ends
    os._exit(1)


if __name__ == "__main__":
    if sys.argv[1] == "--checkpointed":
        checkpointed_child(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
    elif sys.argv[1] == "reopen-after-kill":
        args = [int(a) for a in sys.argv[2:5]]
        for row in run_reopen_after_kill(*args):
            print(f"{row['kernels']:>6}: open after kill {row['median']:.1f} ms median "
                  f"(min {row['min']:.1f}, q1 {row['q1']:.1f}, q3 {row['q3']:.1f}, "
                  f"max {row['max']:.1f}; n={row['n']}), {row['log_bytes'] / 1e6:.1f} MB of "
                  f"log, {row['checkpointed_records']:,} records below the checkpoint and "
                  f"{row['records_after_checkpoint']:,} after it")
    else:
        child(sys.argv[1], int(sys.argv[2]))
