"""Child process for the warm-restart crash test (run as a script, killed with SIGKILL).

Usage: python warm_writer.py DIR

Opens DIR (``page_size=4``, ``max_pages=8``) with the residency list saved
at every write-behind cycle (``RESIDENCY_INTERVAL = 0``), sets keys ``k0`` ..
``k199`` and flushes them, reads a fixed set of them, waits until the write-behind thread has
saved the list twice since (so the last save began after the last read),
then prints one line, the resident page ids most recently used first, as
JSON, and waits to be killed. Nothing is closed: the parent kills it.
"""

from __future__ import annotations

import json
import os
import sys
import time

import durablekv.warm as warm
from durablekv import Cache

READS = [f"k{i}" for i in (5, 17, 33, 48, 61, 90, 122, 150, 181, 199, 5, 17)]


def main() -> None:
    warm.RESIDENCY_INTERVAL = 0.0
    cache = Cache(sys.argv[1], page_size=4, max_pages=8, flush_interval=0.005)
    for i in range(200):
        cache[f"k{i}"] = b"v%d" % i
    cache.flush()  # stored: the reopen replays no page into memory before the preload
    for k in READS:
        assert cache[k] is not None
    ticks = cache._tier.next_tick()  # nothing draws a tick after the reads
    while cache._residency_saved_ticks != ticks:
        time.sleep(0.005)  # (the child's own wait for its batcher; the test does not sleep)
    order = [p.page_id for p in reversed(cache._tier.lru_order())]
    os.write(1, (json.dumps(order) + "\n").encode())
    time.sleep(3600)


if __name__ == "__main__":
    main()
