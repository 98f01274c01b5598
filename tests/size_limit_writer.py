"""Writer process for the size_limit crash test (run as a script, killed with SIGKILL).

Usage: python size_limit_writer.py DIR SEED MODE

Sets and deletes keys over a key space larger than the store's bound, with
values of mixed sizes (10 B to 64 KiB) that name their key and a version,
so that a stale value is told apart from the latest one. The cache has a
small memory tier and ``size_limit``, so pages are evicted from the store
all the time. One line per call on stdout, unbuffered:

    B <op> <key> <version>   before the call (op: S set, D delete)
    A                        after the call returned (acknowledged)
    E <n>                    store evictions so far (every 50 calls)

MODE ``txn``: the writer prints "T" inside a flush transaction that evicts
(just before its COMMIT) and pauses, for the parent to kill it there.
"""

from __future__ import annotations

import os
import random
import sys
import time

from durablekv import Cache
from durablekv.stores.sqlite import SQLitePageStore

OUT = sys.stdout.fileno()
#: the bounds the test opens the cache with, in the writer and at verification
OPTIONS = dict(page_size=4, max_pages=8, size_limit=256 << 10, max_memory_bytes=128 << 10,
               flush_interval=0.01, flush_batch_pages=4)
SIZES = (10, 100, 1000, 10_000, 64 << 10)


def say(line: str) -> None:
    os.write(OUT, (line + "\n").encode())


def value_of(key: str, version: str, size: int) -> bytes:
    head = f"{key}:{version}:".encode()
    return head + b"v" * max(0, size - len(head))


def main() -> None:
    directory, seed, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    rng = random.Random(seed)
    if mode == "txn":
        real_evict = SQLitePageStore._evict
        real_commit = SQLitePageStore._commit
        state = {"evicted": False, "seen": 0}

        def evict(self, *args, **kwargs):
            out = real_evict(self, *args, **kwargs)
            state["evicted"] = bool(out[1])
            return out

        def commit(self, conn):
            if state["evicted"]:
                state["seen"] += 1
                if state["seen"] >= 3:
                    say("T")
                    time.sleep(5)
            state["evicted"] = False
            return real_commit(self, conn)

        SQLitePageStore._evict = evict
        SQLitePageStore._commit = commit
    versions: dict[str, int] = {}
    with Cache(directory, **OPTIONS) as cache:
        say("READY")
        for i in range(1_000_000):
            key = f"k{rng.randrange(400)}"
            if rng.random() < 0.1:
                say(f"B D {key} -")
                cache.delete(key)
            else:
                n = versions.get(key, 0) + 1
                versions[key] = n
                version = f"{seed}.{n}"  # unique across the crash cycles
                say(f"B S {key} {version}")
                cache[key] = value_of(key, version, rng.choice(SIZES))
            say("A")
            if i % 50 == 0:
                say(f"E {cache.stats().store_evictions}")


if __name__ == "__main__":
    main()
