"""Writer process for the crash tests (run as a script, killed with SIGKILL).

Usage: python crash_writer.py DIR SEED DURABILITY [MAX_OPS]

Performs random sets, overwrites and deletes over a small key space, with a
tiny memory tier so pages are evicted and faulted back all the time, and
reports on stdout, unbuffered, one line per call:

    B <op> <key> <value>   before the call (op: S set, D delete)
    A                      after the call returned (acknowledged)

The parent kills it at a random moment, reopens the cache and checks every
key against the acknowledged calls.
"""

from __future__ import annotations

import os
import random
import sys

from durablekv import Cache


def main() -> None:
    directory, seed, durability = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    max_ops = int(sys.argv[4]) if len(sys.argv) > 4 else 10**9
    rng = random.Random(seed)
    out = sys.stdout.fileno()
    cache = Cache(directory, page_size=4, max_pages=3, flush_interval=0.005,
                  flush_batch_pages=2, durability=durability)
    os.write(out, b"READY\n")
    for i in range(max_ops):
        key = f"k{rng.randrange(200)}"
        if rng.random() < 0.2:
            os.write(out, f"B D {key} -\n".encode())
            cache.delete(key)
        else:
            value = f"{key}:{seed}:{i}"
            os.write(out, f"B S {key} {value}\n".encode())
            cache[key] = value
        os.write(out, b"A\n")
    cache.close()
    os.write(out, b"DONE\n")


if __name__ == "__main__":
    main()
