"""Side by side in one process: a logged set (durability="log") with the
replay log appended by write(2) and by stores into a mapped, preallocated
segment, each with the C kernels and with the Python code.

Usage: python -m bench.mapped_log [--n 20000] [--rounds 7] [--dir DIR]

The four variants run in interleaved rounds (A B C D, then again), each on
a fresh cache, so machine noise hits them alike; the report is each
variant's median time per set and the ratios of medians, with the spread
(min to max) of the per-round ratios. The directory must be on a file
system that takes mapped appends (ext4, xfs, tmpfs).
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import statistics
import tempfile
import time

import durablekv
from durablekv import Cache, _accel

VARIANTS = [("write", "native"), ("mmap", "native"), ("write", "pure"), ("mmap", "pure")]


def one(directory: str, append: str, impl: str, keys: list[str], value: bytes) -> float:
    """Seconds per set over ``keys`` (the write-behind never runs: the
    interval is an hour and the tier holds every key)."""
    ctx = contextlib.nullcontext() if impl == "native" else _accel.pure_kernels()
    with ctx:
        cache = Cache(directory, page_size=16, max_pages=1 << 20, flush_interval=3600,
                      max_pending_pages=1 << 20)
        try:
            log = cache._log
            if append == "write":
                log._leave_mapping()
                log.append_mode = "write"
            assert (log._mm is not None) == (append == "mmap"), log.append_reason
            s = cache.__setitem__
            t0 = time.perf_counter()
            for k in keys:
                s(k, value)
            dt = time.perf_counter() - t0
        finally:
            cache._teardown(clean=False)
    shutil.rmtree(directory)
    return dt / len(keys)


def append_only(directory: str, append: str, impl: str, keys: list[str], value: bytes) -> float:
    """Seconds per :meth:`ReplayLog.append_bytes` alone (no cache around it)."""
    from durablekv.log.replaylog import ReplayLog
    import os
    os.makedirs(directory)
    ctx = contextlib.nullcontext() if impl == "native" else _accel.pure_kernels()
    with ctx:
        log = ReplayLog(directory, append="auto" if append == "mmap" else "write")
        log.start(1)
        assert (log._mm is not None) == (append == "mmap"), log.append_reason
        a = log.append_bytes
        bkeys = [k.encode() for k in keys]
        t0 = time.perf_counter()
        for lsn, k in enumerate(bkeys, 1):
            a(lsn, 1, k, value, None)
        dt = time.perf_counter() - t0
        log.close()
    shutil.rmtree(directory)
    return dt / len(keys)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=20000)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--dir", default=None)
    args = ap.parse_args()
    if not durablekv.accelerated:
        raise SystemExit(f"the C kernels are not loaded ({durablekv.accelerated.reason})")
    root = tempfile.mkdtemp(dir=args.dir)
    keys = [f"key:{i}" for i in range(args.n)]
    for (size, fn) in ((100, one), (4096, one), (100, append_only), (4096, append_only)):
        value = b"v" * size
        times: dict[tuple[str, str], list[float]] = {v: [] for v in VARIANTS}
        for r in range(args.rounds):
            for v in VARIANTS:
                times[v].append(fn(f"{root}/{size}-{r}-{v[0]}-{v[1]}", *v, keys, value))
        med = {v: statistics.median(t) for v, t in times.items()}
        what = "Cache set" if fn is one else "ReplayLog.append_bytes alone"
        print(f"{what}, value {size} B, {args.n} sets x {args.rounds} rounds (median us/set):")
        for v in VARIANTS:
            print(f"  {v[0]:5} {v[1]:6} {med[v] * 1e6:7.2f}  "
                  f"(min {min(times[v]) * 1e6:.2f}, max {max(times[v]) * 1e6:.2f})")
        for impl in ("native", "pure"):
            ratios = [m / w for m, w in zip(times[("mmap", impl)], times[("write", impl)])]
            print(f"  mmap/write {impl:6}: {med[('mmap', impl)] / med[('write', impl)]:.2f} "
                  f"(per round {min(ratios):.2f} to {max(ratios):.2f})")
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
