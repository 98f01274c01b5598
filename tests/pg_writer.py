"""Writer process for the PostgreSQL store's crash tests (killed with SIGKILL).

Usage: python pg_writer.py DIR URL NAMESPACE DURABILITY MODE

Sets keys ``k0, k1, ...`` to ``v<i>`` in a cache on a PostgreSQL store and
prints ``A <i>`` (unbuffered) after each set returned. MODE:

    run      write until killed; flush every 50 sets
    hold     write 100 keys (no flush: the flush interval is 30 s), print
             "S" and wait to be killed
    commit   write 200 keys and flush; then 200 more and flush: that
             flush prints "T" inside its transaction, before COMMIT, and
             pauses (the parent kills it there)
"""

from __future__ import annotations

import os
import sys
import time

from durablekv import Cache
from durablekv.stores.postgres import PostgresPageStore

OUT = sys.stdout.fileno()


def say(line: str) -> None:
    os.write(OUT, (line + "\n").encode())


def main() -> None:
    directory, url, ns, durability, mode = sys.argv[1:6]
    c = Cache(directory, store=url, namespace=ns, durability=durability, page_size=4,
              max_pages=8, flush_interval=30.0)
    say("open")
    if mode == "commit":
        for i in range(200):
            c[f"k{i}"] = f"v{i}"
            say(f"A {i}")
        c.flush()
        say("F")
        flushes = [0]

        def pause(self):
            say("T")
            time.sleep(30)

        PostgresPageStore._before_commit = pause
        for i in range(200, 400):
            c[f"k{i}"] = f"v{i}"
            say(f"A {i}")
        c.flush()
        return
    if mode == "hold":
        for i in range(100):
            c[f"k{i}"] = f"v{i}"
            say(f"A {i}")
        say("S")
        time.sleep(60)
        return
    i = 0
    while True:
        c[f"k{i}"] = f"v{i}"
        say(f"A {i}")
        i += 1
        if i % 50 == 0:
            c.flush()


if __name__ == "__main__":
    main()
