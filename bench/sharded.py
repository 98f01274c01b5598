"""``python -m bench.sharded``: write throughput of one Cache against a ShardedCache, by thread count.

Each of T threads sets its own unique keys (100 B values) into one cache for
a fixed count; the rate is all sets over the wall time of the slowest
thread. For each repetition, every (durability, threads) cell runs one Cache
and one ShardedCache back to back in alternating order, so the ratio
compares runs of the same minute on a shared machine. Reports the median
rate and the min..max over repetitions, and the ratio of medians.

    python -m bench.sharded --out docs/bench/sharded.json   # about 2 minutes
    python -m bench.sharded --quick                          # seconds
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import sysconfig
import tempfile
import threading
import time
from typing import Any, Callable

from durablekv import Cache
from durablekv.sharded import ShardedCache

VALUE = b"v" * 100


def _run_once(open_cache: Callable[[str], Any], threads: int, per_thread: int) -> float:
    """Sets per second of ``threads`` writers, each setting ``per_thread`` keys."""
    d = tempfile.mkdtemp(prefix="durablekv-sharded-")
    try:
        cache = open_cache(os.path.join(d, "c"))
        start = threading.Barrier(threads + 1)

        def work(t: int) -> None:
            keys = [f"t{t}:k{i}" for i in range(per_thread)]
            start.wait()
            s = cache.set
            for k in keys:
                s(k, VALUE)

        pool = [threading.Thread(target=work, args=(t,)) for t in range(threads)]
        for th in pool:
            th.start()
        start.wait()
        t0 = time.perf_counter()
        for th in pool:
            th.join()
        elapsed = time.perf_counter() - t0
        cache.close()
        return threads * per_thread / elapsed
    finally:
        shutil.rmtree(d, ignore_errors=True)


def run(threads: list[int], shards: int, repeat: int, sets: dict[str, int]) -> dict[str, Any]:
    impls: dict[str, Callable[[str, str], Any]] = {
        "Cache": lambda path, dur: Cache(path, durability=dur),
        f"ShardedCache({shards})": lambda path, dur: ShardedCache(path, shards=shards,
                                                                  durability=dur),
    }
    rates: dict[tuple[str, int, str], list[float]] = {}
    for r in range(repeat):
        for dur, total in sets.items():
            for t in threads:
                names = list(impls) if r % 2 == 0 else list(reversed(impls))
                for name in names:
                    rate = _run_once(lambda p, n=name: impls[n](p, dur), t, max(1, total // t))
                    rates.setdefault((dur, t, name), []).append(rate)
                    print(f"  rep {r + 1}/{repeat} {dur:5} threads={t} {name:16} "
                          f"{rate:10,.0f} sets/s", file=sys.stderr)
    rows = []
    for dur in sets:
        for t in threads:
            row: dict[str, Any] = {"durability": dur, "threads": t}
            for name in impls:
                xs = rates[(dur, t, name)]
                row[name] = {"median": statistics.median(xs), "min": min(xs), "max": max(xs),
                             "runs": xs}
            a, b = (row[n]["median"] for n in impls)
            row["ratio"] = b / a
            rows.append(row)
    return {"rows": rows, "impls": list(impls), "shards": shards, "repeat": repeat,
            "sets_per_cell": sets}


def table(res: dict[str, Any]) -> str:
    a, b = res["impls"]
    lines = [f"| durability | threads | {a} sets/s | {b} sets/s | ratio |",
             "|---|---|---|---|---|"]
    for row in res["rows"]:
        cells = [f"{row[n]['median']:,.0f} ({row[n]['min']:,.0f}–{row[n]['max']:,.0f})"
                 for n in (a, b)]
        lines.append(f"| {row['durability']} | {row['threads']} | {cells[0]} | {cells[1]} | "
                     f"{row['ratio']:.2f}x |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.sharded", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny counts, one repetition")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--shards", type=int, default=8)
    p.add_argument("--threads", default="1,2,4,8")
    p.add_argument("--out", help="write the results JSON here")
    args = p.parse_args(argv)
    threads = [int(x) for x in args.threads.split(",")]
    sets = {"log": 2_000, "fsync": 200} if args.quick else {"log": 80_000, "fsync": 4_000}
    repeat = 1 if args.quick else args.repeat
    res = run(threads, args.shards, repeat, sets)
    res["machine"] = {"python": sys.version.split()[0], "implementation": platform.python_implementation(),
                      "gil_disabled": bool(sysconfig.get_config_var("Py_GIL_DISABLED")),
                      "cpus": os.cpu_count(), "loadavg": os.getloadavg()[0]}
    print(table(res))
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(res, f, indent=1)
            f.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
