"""Shared helpers: settings, timing, statistics, machine description, temp dirs."""

from __future__ import annotations

import gc
import hashlib
import importlib.metadata
import os
import platform
import shutil
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

REPO = Path(__file__).resolve().parents[1]
#: The shared, read-only traces beside the repository (see its README.md).
TRACES = REPO.parent / "shared" / "traces"

_T0 = time.perf_counter()


def note(msg: str) -> None:
    """Progress line on stderr, stamped with the seconds since the bench started."""
    print(f"[bench {time.perf_counter() - _T0:7.1f}s] {msg}", file=sys.stderr, flush=True)


@dataclass
class Settings:
    """Sizes of every case; :func:`settings_for` fills them for quick/normal/full."""

    mode: str                   # "quick", "normal" or "full"
    keys: int                   # micro: distinct keys (100k)
    value_sizes: tuple[int, ...]
    repeat: int                 # micro repetitions
    slow_repeat: int            # macro / sustained / restart repetitions
    rep_seconds: float          # micro: target duration of one timed run
    min_ops: int                # micro: fewest operations in one timed run
    threads: int                # micro: the multi-threaded set case
    store_tier_entries: int     # micro page-fault case: entries that fit in memory
    sustained_seconds: float
    macro_prefix: int | None    # requests replayed per trace (None: whole trace)
    plot_prefix: int | None
    plot_fractions: tuple[float, ...] = (0.005, 0.01, 0.02, 0.05, 0.10, 0.20)
    plot_page_sizes: tuple[int, ...] = (1, 4, 16, 64)
    macro_fractions: tuple[float, ...] = (0.01, 0.10)
    restart_sizes: tuple[int, ...] = (10_000, 100_000, 1_000_000)
    crash_records: int = 1_000_000
    memory_entries: int = 100_000
    tmp: str | None = None
    redis: bool = True
    extra: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def settings_for(mode: str, repeat: int | None, tmp: str | None, redis: bool) -> Settings:
    if mode == "quick":
        s = Settings(mode, keys=2_000, value_sizes=(100, 4096), repeat=repeat or 2,
                     slow_repeat=min(repeat or 2, 2), rep_seconds=0.004, min_ops=50, threads=4,
                     store_tier_entries=64, sustained_seconds=0.3, macro_prefix=3_000,
                     plot_prefix=3_000, restart_sizes=(1_000, 2_000, 5_000), crash_records=5_000,
                     memory_entries=2_000, plot_fractions=(0.01, 0.05, 0.20),
                     plot_page_sizes=(1, 16))
    else:
        prefix = None if mode == "full" else 300_000
        s = Settings(mode, keys=100_000, value_sizes=(100, 4096), repeat=repeat or 5,
                     slow_repeat=min(repeat or 3, 3), rep_seconds=0.25, min_ops=200, threads=4,
                     store_tier_entries=1_024, sustained_seconds=10.0, macro_prefix=prefix,
                     plot_prefix=prefix)
    s.tmp = tmp
    s.redis = redis
    return s


# -- statistics ------------------------------------------------------------------------

def summarize(samples: Sequence[float]) -> dict[str, Any]:
    """Median, min, max and quartiles of the per-repetition samples."""
    xs = sorted(samples)
    if not xs:
        return {"n": 0}
    if len(xs) >= 2:
        q1, _, q3 = statistics.quantiles(xs, n=4, method="inclusive")
    else:
        q1 = q3 = xs[0]
    return {"n": len(xs), "median": statistics.median(xs), "min": xs[0], "max": xs[-1],
            "q1": q1, "q3": q3, "samples": list(samples)}


def rotate(items: Sequence[Any], r: int) -> list[Any]:
    """``items`` rotated by ``r``: repetition r starts with a different implementation."""
    if not items:
        return []
    r %= len(items)
    return list(items[r:]) + list(items[:r])


def timed_ns(fn: Callable[..., Any], *args: Any) -> int:
    """Run ``fn(*args)`` once with the cyclic GC paused (as ``timeit`` does); return ns."""
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        t0 = time.perf_counter_ns()
        fn(*args)
        return time.perf_counter_ns() - t0
    finally:
        if enabled:
            gc.enable()


# -- files -----------------------------------------------------------------------------

class Scratch:
    """A temporary directory for one bench run; :meth:`sub` hands out fresh subdirs."""

    def __init__(self, parent: str | None = None) -> None:
        self.root = tempfile.mkdtemp(prefix="durablekv-bench-", dir=parent)
        self._n = 0

    def sub(self, name: str) -> str:
        self._n += 1
        path = os.path.join(self.root, f"{self._n:04d}-{name}")
        os.makedirs(path)
        return path

    def remove(self, path: str) -> None:
        shutil.rmtree(path, ignore_errors=True)

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


# -- the machine -----------------------------------------------------------------------

def _read(path: str) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def _run(cmd: list[str], cwd: str | None = None) -> str:
    try:
        return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=10,
                              check=False).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def machine_info(tmp_root: str) -> dict[str, Any]:
    """What the numbers were measured on (printed into the JSON and the docs)."""
    cpu = next((line.split(":", 1)[1].strip() for line in _read("/proc/cpuinfo").splitlines()
                if line.startswith("model name")), platform.processor() or "unknown")
    mem_kib = next((int(line.split()[1]) for line in _read("/proc/meminfo").splitlines()
                    if line.startswith("MemTotal:")), 0)
    try:
        affinity = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        affinity = os.cpu_count()
    fs = _run(["stat", "-f", "-c", "%T", tmp_root])
    commit = _run(["git", "rev-parse", "HEAD"], cwd=str(REPO))
    diff = _run(["git", "diff", "HEAD", "--", "durablekv", "migrations"], cwd=str(REPO))
    import durablekv
    return {
        "nproc": affinity,
        "cpu_count": os.cpu_count(),
        "cpu_model": cpu,
        "ram_gib": round(mem_kib / 1024 / 1024, 1),
        "python": sys.version.split()[0],
        "python_implementation": platform.python_implementation(),
        "sqlite": sqlite3.sqlite_version,
        "os": f"{platform.system()} {platform.release()}",
        "tmp_dir": tmp_root,
        "tmp_filesystem": fs or "unknown",
        "durablekv": getattr(durablekv, "__version__", "?"),
        "git_commit": commit or None,
        # the library is edited while benches run: a hash of the uncommitted
        # library diff tells which working tree the numbers belong to
        "library_diff_sha256": hashlib.sha256(diff.encode()).hexdigest()[:16] if diff else None,
        "packages": {d: _version(d) for d in ("cachetools", "diskcache", "sqlitedict", "lmdb",
                                              "redis", "matplotlib")},
        "redis_server": _run(["redis-server", "--version"]) if shutil.which("redis-server") else None,
    }


def fmt_ns(ns: float) -> str:
    """A per-operation time with a sensible unit."""
    if ns != ns:
        return "n/a"
    if ns < 1_000:
        return f"{ns:.0f} ns"
    if ns < 1_000_000:
        return f"{ns / 1_000:.2f} µs"
    return f"{ns / 1_000_000:.2f} ms"


def fmt_rate(x: float) -> str:
    if x >= 1e6:
        return f"{x / 1e6:.2f} M"
    if x >= 1e3:
        return f"{x / 1e3:.1f} k"
    return f"{x:.0f}"


def fsync_tree(directory: str) -> None:
    """fsync every file in ``directory``, a copy the bench just made of a
    crashed cache: its files are then on disk as the crashed writer's were
    (it fsynced its log at its last flush), so a timed open does not pay for
    writing back the copy."""
    for name in os.listdir(directory):
        fd = os.open(os.path.join(directory, name), os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def chunks(seq: Sequence[Any], n: int) -> Iterable[Sequence[Any]]:
    for i in range(0, len(seq), n):
        yield seq[i:i + n]


def span(s: dict[str, Any], digits: int = 0) -> str:
    """A summarize() result as ``median (min..max)``."""
    return f"{s['median']:.{digits}f} ({s['min']:.{digits}f}..{s['max']:.{digits}f})"


def rounds_main(doc: str, run: Callable[..., list], markdown: Callable[[list, int], str],
                extra: Callable[[Any], dict] | None = None) -> None:
    """The command line of a side-by-side bench run in rounds: ``--rounds``,
    ``--json``, ``--markdown``, ``--tmpdir`` (and what ``extra`` adds to the
    parser and returns as ``run``'s keyword arguments); prints the table."""
    import argparse
    import json

    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--markdown", type=Path)
    ap.add_argument("--tmpdir")
    more = extra(ap) if extra else None
    args = ap.parse_args()
    rows = run(args.rounds, tmpdir=args.tmpdir, **(more(args) if more else {}))
    text = markdown(rows, args.rounds)
    print(text)
    if args.json:
        args.json.write_text(json.dumps({"rounds": args.rounds, "rows": rows}, indent=2) + "\n")
    if args.markdown:
        args.markdown.write_text(text)
