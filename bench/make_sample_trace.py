"""Write the small trace shipped in the package: ``durablekv/samples/web-sample.csv``.

The real traces (../shared/traces/README.md lists where each comes from) are
tens of MB and are not ours to redistribute, so a fresh clone and an
installed wheel carry this generated one instead: 10,000 requests of
web-like look-aside traffic in CacheLib's CSV format (``op_time,key,key_size,
op,op_count,size,ttl``), so ``durablekv replay`` exercises gets, sets,
deletes, value sizes and TTLs on it.

Shape (chosen to resemble an HTTP page cache, not fitted to any trace): keys
drawn from a Zipf(1.0) popularity over 2,000 keys, plus 25% of requests to
keys never seen again (one-hit wonders); 88% GET, 10% SET, 2% DELETE; a
value size per key, log-uniform between 100 B and 16 KiB; every SET with a
TTL of 5 min, 1 h or 1 day; about 12 requests per second of trace time.

Deterministic: ``python -m bench.make_sample_trace`` rewrites the file byte
for byte (only ``random.Random.random`` is used, whose sequence for a given
seed is stable across Python versions); tests/test_sample_trace.py checks it.
"""

from __future__ import annotations

import argparse
import bisect
import itertools
import math
import random
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SAMPLE = REPO / "durablekv" / "samples" / "web-sample.csv"

HEADER = "op_time,key,key_size,op,op_count,size,ttl\n"


def generate(requests: int = 10_000, keys: int = 2_000, alpha: float = 1.0,
             one_hit: float = 0.25, seed: int = 20261206) -> str:
    """The sample trace as CSV text (``requests`` rows after the header)."""
    rng = random.Random(seed)
    cdf = list(itertools.accumulate(1.0 / (r ** alpha) for r in range(1, keys + 1)))
    total = cdf[-1]
    sizes: dict[str, int] = {}
    fresh = itertools.count()
    now = 0.0
    out = [HEADER]
    for _ in range(requests):
        now += -math.log(1.0 - rng.random()) / 12.0
        if rng.random() < one_hit:
            key = f"o{next(fresh):06x}"
        else:
            rank = bisect.bisect_left(cdf, rng.random() * total)
            key = f"k{rank:05x}"
        if key not in sizes:
            sizes[key] = int(100 * (16384 / 100) ** rng.random())
        u = rng.random()
        op = "GET" if u < 0.88 else ("SET" if u < 0.98 else "DELETE")
        size = 0 if op == "DELETE" else sizes[key]
        ttl = (300, 3600, 86400)[int(rng.random() * 3)] if op == "SET" else 0
        out.append(f"{int(now)},{key},{len(key)},{op},1,{size},{ttl}\n")
    return "".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=SAMPLE)
    args = ap.parse_args()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(generate(), encoding="ascii", newline="\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
