"""PostgreSQL page store vs SQLite page store, side by side in one run.

``python -m bench.postgres [--repeat R] [--keys N] [--json OUT]``

Starts real PostgreSQL servers from Debian's binaries (the tests' harness,
``tests/pg.py``; ``fsync=on`` here, as SQLite's ``synchronous=FULL``), on
loopback, and measures, each case repeated R times with the stores in turns:

``sustained``   N sets of 100-byte values (16-byte keys), ``durability="log"``,
                then ``flush()``: sets per second, flush included.
``fault``       N keys stored and the memory tier 16 pages of 16: N random
                gets, each a page fault: microseconds per get.
``latency``     2000 sets one at a time, each timed: p50 and p99 of
                ``fsync`` on SQLite, ``fsync`` on the PostgreSQL store (the
                log is local: the same) and ``sync`` (the record committed
                in PostgreSQL).
``failover``    a primary and a synchronous standby; a ``sync`` writer; the
                primary SIGKILLed, the standby promoted: seconds from the
                kill to the acknowledgement of the first set begun after
                the primary's processes were gone.

Prints a markdown table (medians, with min-max over the repetitions).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import threading
import time

from durablekv import Cache

from .util import REPO, summarize

sys.path.insert(0, str(REPO))
from tests.pg import PASSWORD, fence, pg_pair, pg_server, promote  # noqa: E402

_VALUE = b"v" * 100


def _key(i: int) -> str:
    return f"key-{i:012d}"


def sustained(store_kw: dict, directory: str, n: int) -> float:
    """Sets per second for ``n`` sets + the flush."""
    with Cache(directory, page_size=16, max_pages=4096, **store_kw) as c:
        t = time.perf_counter()
        for i in range(n):
            c[_key(i)] = _VALUE
        c.flush()
        return n / (time.perf_counter() - t)


def fault(store_kw: dict, directory: str, n: int) -> float:
    """Microseconds per get when every get faults a page in."""
    with Cache(directory, page_size=16, max_pages=4096, **store_kw) as c:
        for i in range(n):
            c[_key(i)] = _VALUE
    rng = random.Random(1)
    order = [rng.randrange(n) for _ in range(n)]
    with Cache(directory, max_pages=16, **store_kw) as c:
        t = time.perf_counter()
        for i in order:
            c[_key(i)]
        dt = time.perf_counter() - t
        assert c.stats().store_hits >= n // 2
    return dt / n * 1e6


def latency(store_kw: dict, directory: str, n: int = 2000) -> tuple[float, float]:
    """(p50, p99) microseconds of single sets."""
    xs = []
    with Cache(directory, **store_kw) as c:
        for i in range(n):
            t = time.perf_counter()
            c[_key(i)] = _VALUE
            xs.append(time.perf_counter() - t)
    q = statistics.quantiles(xs, n=100)
    return q[49] * 1e6, q[98] * 1e6


def failover(tmp: str) -> float:
    """Seconds from SIGKILL of the primary to the first write acknowledged after it."""
    with pg_pair() as (primary, standby):
        url = (f"postgresql://postgres:{PASSWORD}@127.0.0.1:{primary.port},"
               f"127.0.0.1:{standby.port}/postgres?target_session_attrs=read-write")
        c = Cache(os.path.join(tmp, "failover"), store=url, namespace="bench",
                  durability="sync", busy_timeout=2)
        acks: list[float] = []
        starts: list[float] = []  # (start of each acknowledged set, parallel to acks)
        stop = threading.Event()

        def load() -> None:
            i = 0
            while not stop.is_set():
                t0 = time.monotonic()
                c[_key(i)] = _VALUE
                starts.append(t0)
                acks.append(time.monotonic())
                i += 1
        t = threading.Thread(target=load)
        t.start()
        try:
            while len(acks) < 200:
                time.sleep(0.01)
            killed = time.monotonic()
            fence(primary)  # returns once the primary's processes are gone
            dead = time.monotonic()
            promote(standby)
            deadline = time.monotonic() + 60
            while not starts or starts[-1] <= dead:
                if time.monotonic() > deadline:
                    raise RuntimeError("no write after the failover in 60 s")
                time.sleep(0.005)
        finally:
            stop.set()
            t.join(60)
            c.close()
        # the first set begun after the primary was gone (one begun before may
        # have committed before the kill and returned after it)
        return min(a for a, s in zip(acks, starts) if s > dead) - killed


def _fmt(s: dict, unit: str) -> str:
    return f"{s['median']:.1f} {unit} ({s['min']:.1f}-{s['max']:.1f})"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.postgres", description=__doc__.split("\n")[0])
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--keys", type=int, default=20_000)
    p.add_argument("--failovers", type=int, default=3)
    p.add_argument("--json", help="write the samples here")
    args = p.parse_args(argv)
    tmp = tempfile.mkdtemp(prefix="dkv-bench-pg-")
    res: dict[str, dict[str, list]] = {}
    try:
        with pg_server("fsync=on", "synchronous_commit=on") as pg:
            stores = {"sqlite": {}, "postgres": {"store": pg.url()}}
            for r in range(args.repeat):
                for name in (list(stores) if r % 2 == 0 else list(stores)[::-1]):
                    kw = stores[name]
                    for case, fn in (("sustained", sustained), ("fault", fault)):
                        d = os.path.join(tmp, f"{case}-{name}-{r}")
                        extra = {"namespace": f"{case}-{r}"} if kw else {}
                        res.setdefault(case, {}).setdefault(name, []).append(
                            fn({**kw, **extra}, d, args.keys))
                        shutil.rmtree(d, ignore_errors=True)
                    modes = ("fsync",) if not kw else ("fsync", "sync")
                    for mode in modes:
                        d = os.path.join(tmp, f"lat-{name}-{mode}-{r}")
                        extra = {"namespace": f"lat-{mode}-{r}"} if kw else {}
                        p50, p99 = latency({**kw, **extra, "durability": mode}, d)
                        res.setdefault("latency_p50", {}).setdefault(f"{name} {mode}", []).append(p50)
                        res.setdefault("latency_p99", {}).setdefault(f"{name} {mode}", []).append(p99)
        res["failover"] = {"postgres sync": [failover(tmp) for _ in range(args.failovers)]}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    sm = {case: {k: summarize(v) for k, v in by.items()} for case, by in res.items()}
    print(f"PostgreSQL store vs SQLite store, {args.keys} keys, {args.repeat} repetitions "
          "(median, min-max):\n")
    print("| case | SQLite store | PostgreSQL store | ratio PG/SQLite |")
    print("|---|---|---|---|")
    for case, unit in (("sustained", "sets/s"), ("fault", "µs/get")):
        a, b = sm[case]["sqlite"], sm[case]["postgres"]
        print(f"| {case} | {_fmt(a, unit)} | {_fmt(b, unit)} | {b['median'] / a['median']:.2f} |")
    for q in ("p50", "p99"):
        lat = sm[f"latency_{q}"]
        a = lat["sqlite fsync"]
        for mode in ("fsync", "sync"):
            b = lat[f"postgres {mode}"]
            print(f"| set latency {q}, SQLite fsync vs PG {mode} | {_fmt(a, 'µs')} | "
                  f"{_fmt(b, 'µs')} | {b['median'] / a['median']:.2f} |")
    f = summarize([x * 1e3 for x in res["failover"]["postgres sync"]])
    print(f"| primary kill -> first write after promotion (sync) | - | {_fmt(f, 'ms')} | - |")
    print("\n(failover pair: the tests' servers, fsync=off; the other cases: fsync=on)")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as out:
            json.dump(sm, out, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
