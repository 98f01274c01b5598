"""Writer process for the crash tests (run as a script, killed with SIGKILL).

Usage: python crash_writer.py DIR SEED DURABILITY MODE [POLICY]

Performs random sets, overwrites and deletes over a small key space, with a
tiny memory tier so pages are evicted and faulted back all the time, and
reports on stdout, unbuffered, one line per call:

    B <op> <key> <value>   before the call (op: S set, D delete)
    A                      after the call returned (acknowledged)

MODE picks a moment for the parent to kill at, announced by a marker line
after which the process pauses briefly:

    random     no marker (the parent kills at a random time)
    txn        "T": inside a flush's SQLite transaction, before COMMIT
    truncate   "U": while the log is being cut back after a checkpoint
    recovery   "R": while recovery re-applies log records at open
    noflush    no marker; the writer never flushes (everything stays in the log)
    replayflush "P": inside the 1st to 5th flush transaction that recovery,
               short of memory (3 pages, at most 1 waiting), waits for
"""

from __future__ import annotations

import os
import random
import sys
import time

from durablekv import Cache
from durablekv.log.replaylog import ReplayLog
from durablekv.stores.sqlite import SQLitePageStore

OUT = sys.stdout.fileno()


def say(line: str) -> None:
    os.write(OUT, (line + "\n").encode())


def pause_at(cls, name: str, marker: str, every: int = 1) -> None:
    real = getattr(cls, name)
    calls = [0]

    def wrapper(self, *args, **kwargs):
        calls[0] += 1
        if calls[0] % every == 0:
            say(marker)
            time.sleep(0.2)
        return real(self, *args, **kwargs)

    setattr(cls, name, wrapper)


def main() -> None:
    directory, seed, durability, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
    rng = random.Random(seed)
    if mode == "txn":
        pause_at(SQLitePageStore, "_commit", "T", every=rng.randrange(3, 20))
    elif mode == "truncate":
        pause_at(ReplayLog, "truncate_through", "U", every=rng.randrange(3, 20))
    elif mode == "recovery":
        pause_at(Cache, "_replay", "R", every=1)
    opts = dict(flush_interval=0.005, flush_batch_pages=2)
    if mode == "noflush":
        opts = dict(flush_interval=3600, flush_batch_pages=10**6, max_pending_pages=10**6)
    elif mode == "replayflush":
        opts["max_pending_pages"] = 1
        replaying = [False]
        commits, nth = [0], rng.randrange(1, 6)  # earlier commits hold part of the replay
        real_replay, real_commit = Cache._replay, SQLitePageStore._commit

        def replay(self, records):
            replaying[0] = True
            try:
                return real_replay(self, records)
            finally:
                replaying[0] = False

        def commit(self, conn):
            if replaying[0]:
                commits[0] += 1
                if commits[0] == nth:
                    say("P")
                    time.sleep(0.2)
            return real_commit(self, conn)

        Cache._replay, SQLitePageStore._commit = replay, commit
    # POLICY (optional, default lru): the memory tier's policy
    policy = sys.argv[5] if len(sys.argv) > 5 else "lru"
    cache = Cache(directory, page_size=4, max_pages=3, durability=durability,
                  segment_bytes=4096, policy=policy, **opts)
    say("READY")
    for i in range(10**9):
        if policy == "midpoint":
            # reads between the writes move entries through the tier's lists,
            # so recovery meets pages in memory in part
            cache.get(f"k{rng.randrange(200)}")
        key = f"k{rng.randrange(200)}"
        if rng.random() < 0.2:
            say(f"B D {key} -")
            cache.delete(key)
        else:
            value = f"{key}:{seed}:{i}"
            say(f"B S {key} {value}")
            # even keys hold bytes: their overwrites take the C set when the
            # extension runs (a str value takes the Python path)
            cache[key] = value.encode() if int(key[1:]) % 2 == 0 else value
        say("A")


if __name__ == "__main__":
    main()
