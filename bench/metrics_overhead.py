"""Replay throughput with the Prometheus collector scraped every second, vs without.

Both variants replay the same trace prefix in one process run, interleaved
(A, B, A, B, ...), and the medians are compared, since shared machines are
noisy. Usage:

    python -m bench.metrics_overhead [--trace PATH] [--requests N] [--repeat R]
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from durablekv import Cache
from durablekv.traces import open_trace

DEFAULT_TRACE = Path(__file__).resolve().parents[1].parent / "shared" / "traces" / \
    "cache2k_orm-busy.i32be"


def replay(keys: list, scrape: bool, max_pages: int) -> tuple[float, int]:
    """Look-aside replay of ``keys``; return (requests/s, scrapes done)."""
    from durablekv.metrics import serve

    with tempfile.TemporaryDirectory() as d, Cache(d, max_pages=max_pages) as cache:
        server = serve(cache, port=0) if scrape else None
        stop = threading.Event()
        scrapes = [0]

        def scraper() -> None:
            while not stop.wait(1.0):
                with urllib.request.urlopen(server.url, timeout=5) as r:
                    r.read()
                scrapes[0] += 1

        thread = threading.Thread(target=scraper, daemon=True) if scrape else None
        if thread:
            thread.start()
        get, set_ = cache.get, cache.set
        value = b"v" * 100
        t0 = time.perf_counter()
        for k in keys:
            if get(k) is None:
                set_(k, value)
        elapsed = time.perf_counter() - t0
        stop.set()
        if thread:
            thread.join()
            server.close()
        return len(keys) / elapsed, scrapes[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", default=str(DEFAULT_TRACE))
    ap.add_argument("--requests", type=int, default=1_000_000)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--max-pages", type=int, default=480, help="memory tier (default ~10%% of orm-busy's keys at page_size 16)")
    ap.add_argument("--json", help="write the result here")
    args = ap.parse_args()
    keys = [r.key for r in itertools.islice(open_trace(args.trace), args.requests)]
    runs: dict[str, list[float]] = {"without": [], "scraped_every_1s": []}
    scrapes = 0
    for _ in range(args.repeat):
        runs["without"].append(replay(keys, False, args.max_pages)[0])
        rate, n = replay(keys, True, args.max_pages)
        runs["scraped_every_1s"].append(rate)
        scrapes += n
    med = {k: statistics.median(v) for k, v in runs.items()}
    result = {
        "trace": args.trace, "requests": len(keys), "repeat": args.repeat,
        "median_requests_per_second": med,
        "spread": {k: [min(v), max(v)] for k, v in runs.items()},
        "ratio_scraped_to_without": med["scraped_every_1s"] / med["without"],
        "scrapes": scrapes,
    }
    print(json.dumps(result, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
