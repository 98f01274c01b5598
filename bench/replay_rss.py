"""Peak RSS of ``durablekv replay`` for one trace at several ``--max-pages``.

Each run is its own child process (``python -m durablekv replay``, a fresh
temporary cache directory); its peak resident set size is read with
``os.wait4`` (``ru_maxrss``, KiB on Linux). Prints one line per run::

    python bench/replay_rss.py ../shared/traces/cloudPhysicsIO.csv 4096 256 64
    python bench/replay_rss.py zipf 4096          # the built-in Zipf workload
"""

from __future__ import annotations

import os
import subprocess
import sys
import time


def peak_rss(argv: list[str]) -> tuple[float, float, int]:
    """``(peak RSS in MiB, wall seconds, exit code)`` of one child running ``argv``."""
    t0 = time.monotonic()
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL)
    _pid, status, usage = os.wait4(proc.pid, 0)
    return usage.ru_maxrss / 1024, time.monotonic() - t0, os.waitstatus_to_exitcode(status)


def main(args: list[str]) -> int:
    if len(args) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    trace, sizes = args[0], [int(a) for a in args[1:]]
    for max_pages in sizes:
        argv = [sys.executable, "-m", "durablekv", "replay", "--no-progress",
                "--max-pages", str(max_pages)]
        if trace != "zipf":
            argv.insert(4, trace)
        rss, wall, rc = peak_rss(argv)
        print(f"{os.path.basename(trace)} --max-pages {max_pages}: peak RSS {rss:,.0f} MiB, "
              f"{wall:.1f} s wall, exit {rc}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
