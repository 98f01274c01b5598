"""``python -m bench.policy_bytes``: LRU and TinyLFU under the same ``max_memory_bytes``.

A read-through replay through a real :class:`durablekv.Cache` (``durability
="none"``, a fresh directory per run): each request is a ``get``; a miss
``set``s the key. The traces carry no value sizes, so each key's value is
64 to 1023 bytes, fixed by the key's CRC-32 (the same for every run). The
memory hit ratio is memory hits / gets: a hit served from a resident page.
Faulting a page back from SQLite (a store hit) is not a memory hit.

Run it from another checkout to measure that checkout's code (the
``durablekv`` imported is reported); docs/policy.md has one run's table.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path

from .util import TRACES

CASES = (  # (trace, requests (None: all), page_size, max_pages, max_memory_bytes)
    ("cache2k_orm-busy.i32be", 1_000_000, 16, 4096, 1 << 20),
    ("cache2k_orm-busy.i32be", 1_000_000, 1, 100_000, 1 << 20),
    ("arc_OLTP.lis", None, 16, 4096, 4 << 20),
    ("arc_OLTP.lis", None, 1, 100_000, 4 << 20),
    # a loose byte bound: max_pages binds first
    ("cache2k_orm-busy.i32be", 1_000_000, 16, 256, 64 << 20),
)


def value_for(key) -> bytes:
    return b"v" * (64 + zlib.crc32(repr(key).encode()) % 960)


def replay(path: Path, limit: int | None, page_size: int, max_pages: int, max_bytes: int,
           policy: str) -> dict:
    from durablekv import Cache
    from durablekv.traces import open_trace
    keys = []
    for i, r in enumerate(open_trace(path)):
        if limit is not None and i >= limit:
            break
        keys.append(r.key)
    with tempfile.TemporaryDirectory() as d:
        t0 = time.perf_counter()
        with Cache(Path(d) / "c", page_size=page_size, max_pages=max_pages, durability="none",
                   max_memory_bytes=max_bytes, policy=policy, warm=False) as c:
            get = c.get
            for k in keys:
                if get(k) is None:
                    c[k] = value_for(k)
            s = c.stats()
        secs = time.perf_counter() - t0
    gets = s.memory_hits + s.store_hits + s.misses
    return dict(trace=path.name, requests=len(keys), page_size=page_size, max_pages=max_pages,
                max_memory_bytes=max_bytes, policy=policy, memory_hit_ratio=s.memory_hits / gets,
                store_hits=s.store_hits, misses=s.misses, evictions=s.evictions,
                resident_pages=s.resident_pages, seconds=round(secs, 1))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--traces", type=Path, default=TRACES)
    ap.add_argument("--out", type=Path, help="also write the rows here (JSON lines)")
    args = ap.parse_args(argv)
    import durablekv
    src = Path(durablekv.__file__).resolve().parent
    rev = subprocess.run(["git", "-C", str(src), "rev-parse", "--short", "HEAD"],
                         capture_output=True, text=True).stdout.strip() or "?"
    print(f"durablekv from {src} ({rev})", file=sys.stderr)
    rows = []
    for name, limit, ps, mp, mb in CASES:
        for policy in ("lru", "tinylfu"):
            row = replay(args.traces / name, limit, ps, mp, mb, policy)
            row["code"] = str(src)
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
    if args.out:
        args.out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    print("| trace | requests | page_size | max_pages | max_memory_bytes | LRU | TinyLFU |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for lru, lfu in zip(rows[::2], rows[1::2]):
        print(f"| {lru['trace']} | {lru['requests']:,} | {lru['page_size']} | "
              f"{lru['max_pages']:,} | {lru['max_memory_bytes']:,} | "
              f"{lru['memory_hit_ratio']:.3f} | {lfu['memory_hit_ratio']:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
