"""Sustained sets of unique keys: durablekv ``log`` mode vs raw SQLite executemany.

Each run is a fresh subprocess (``python -m bench.sustained IMPL DIR SECONDS
VALUE_BYTES``) that sets new 16-byte keys (``s:000000000001`` ...) for
SECONDS seconds, then makes everything durable, and prints one JSON line:
operations, the time of the write phase, the time of the final drain,
and its peak RSS (``VmHWM`` from ``/proc/self/status``). Running each in
its own process makes the peak RSS that implementation's alone.

``durablekv``  ``Cache(dir, durability="log")`` with the defaults
               (page_size 16, max_pages 4096 = 65,536 resident entries,
               flush_interval 0.05 s, flush_batch_pages 64): the memory tier
               fills after ~65k keys, then every new page evicts a dirty one,
               so the rate is what the write-behind path sustains
               (back-pressure included). The drain is ``close()``.
``sqlite``     the anchor: ``(key BLOB PRIMARY KEY, value BLOB)`` table, WAL,
               ``synchronous=NORMAL`` (a committed transaction survives a
               killed process, like ``log`` mode), rows collected in Python and
               written with ``executemany`` in 1000-row transactions. The
               drain is the last partial transaction.

The rate used for the target is operations / (write phase + drain): both
end with every acknowledged write stored in SQLite.
"""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import time
from typing import Any, Callable

from .util import REPO, Scratch, Settings, note, rotate, summarize

IMPLS = ("durablekv", "sqlite")
CHECK_EVERY = 1024


def _peak_rss_kib() -> dict[str, int]:
    out = {}
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith(("VmHWM:", "VmRSS:")):
                name, value, _unit = line.split()
                out[name[:-1]] = int(value)
    return out


def _write_for(seconds: float, batch: Callable[[int], None]) -> tuple[int, float, float]:
    """Call ``batch(i)`` (which writes keys i .. i + CHECK_EVERY - 1) until
    ``seconds`` have passed; return (keys written, start, end) in
    ``time.perf_counter`` seconds. The same loop times both sides."""
    perf = time.perf_counter
    i = 0
    t0 = perf()
    deadline = t0 + seconds
    while True:
        batch(i)
        i += CHECK_EVERY
        if perf() >= deadline:
            return i, t0, perf()


def _run_durablekv(directory: str, seconds: float, value: bytes) -> dict[str, Any]:
    from durablekv import Cache
    cache = Cache(directory, durability="log")
    s = cache.set

    def batch(i: int) -> None:
        for j in range(i, i + CHECK_EVERY):
            s(f"s:{j:014d}", value)
    i, t0, t1 = _write_for(seconds, batch)
    st = cache.stats()
    cache.close()
    t2 = time.perf_counter()
    return {"ops": i, "write_seconds": t1 - t0, "drain_seconds": t2 - t1,
            "evictions": st.evictions, "flushes": st.flushes, "flushed_pages": st.flushed_pages}


def _run_sqlite(directory: str, seconds: float, value: bytes) -> dict[str, Any]:
    conn = sqlite3.connect(os.path.join(directory, "raw.sqlite3"), isolation_level=None)
    conn.execute("PRAGMA journal_mode = WAL")
    conn.execute("PRAGMA synchronous = NORMAL")
    conn.execute("CREATE TABLE kv (key BLOB PRIMARY KEY, value BLOB)")
    sql = "INSERT OR REPLACE INTO kv (key, value) VALUES (?, ?)"
    rows: list[tuple[bytes, bytes]] = []

    def commit() -> None:
        conn.execute("BEGIN")
        conn.executemany(sql, rows)
        conn.execute("COMMIT")
        rows.clear()

    def batch(i: int) -> None:
        for j in range(i, i + CHECK_EVERY):
            rows.append((f"s:{j:014d}".encode(), value))
            if len(rows) == 1000:
                commit()
    i, t0, t1 = _write_for(seconds, batch)
    if rows:
        commit()
    conn.close()
    t2 = time.perf_counter()
    return {"ops": i, "write_seconds": t1 - t0, "drain_seconds": t2 - t1}


def child(argv: list[str]) -> None:
    impl, directory, seconds, vbytes = argv[0], argv[1], float(argv[2]), int(argv[3])
    value = os.urandom(vbytes)
    fn = {"durablekv": _run_durablekv, "sqlite": _run_sqlite}[impl]
    out = fn(directory, seconds, value)
    out.update(_peak_rss_kib())
    print(json.dumps(out), flush=True)


def run(cfg: Settings, scratch: Scratch, value_bytes: int = 100) -> list[dict[str, Any]]:
    samples: dict[str, list[dict[str, Any]]] = {i: [] for i in IMPLS}
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    for r in range(cfg.slow_repeat):
        for impl in rotate(IMPLS, r):
            d = scratch.sub(f"sustained-{impl}")
            proc = subprocess.run(
                [sys.executable, "-m", "bench.sustained", impl, d, str(cfg.sustained_seconds),
                 str(value_bytes)], capture_output=True, text=True, env=env, cwd=str(REPO),
                timeout=cfg.sustained_seconds * 20 + 120)
            scratch.remove(d)
            if proc.returncode != 0:
                raise RuntimeError(f"sustained {impl} child failed:\n{proc.stderr[-2000:]}")
            res = json.loads(proc.stdout.strip().splitlines()[-1])
            samples[impl].append(res)
            note(f"sustained {impl}: {res['ops']:,} sets in {res['write_seconds']:.1f} s "
                 f"+ {res['drain_seconds']:.2f} s drain, peak RSS {res['VmHWM'] / 1024:.0f} MiB")
    rows = []
    for impl in IMPLS:
        runs = samples[impl]
        rate = [x["ops"] / (x["write_seconds"] + x["drain_seconds"]) for x in runs]
        rate_write = [x["ops"] / x["write_seconds"] for x in runs]
        rows.append({
            "case": "sustained_unique_sets", "impl": impl, "value_bytes": value_bytes,
            "name": "durablekv (log)" if impl == "durablekv" else
                    "raw SQLite executemany, 1000-row transactions",
            "unit": "sets/s", "seconds": cfg.sustained_seconds,
            **summarize(rate),
            "write_phase_rate": summarize(rate_write),
            "drain_seconds": summarize([x["drain_seconds"] for x in runs]),
            "peak_rss_mib": summarize([x["VmHWM"] / 1024 for x in runs]),
            "runs": runs,
        })
    return rows


if __name__ == "__main__":
    child(sys.argv[1:])
