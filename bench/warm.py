"""``python -m bench.warm``: the hit ratio right after a restart, warm and cold.

On ``cache2k_orm-busy.i32be`` (every request a get; look-aside: a miss is
followed by a set of a 100-byte value), the first ``--prefix`` of the trace
is replayed into a cache at ``page_size=16`` holding ``--memory`` of the
trace's unique keys. Then the next ``--next`` of the trace is replayed
against:

* ``never_restarted``: the same cache, still open;
* ``close_warm`` / ``close_cold``: the prefix's cache closed cleanly, and
  reopened with ``warm=True`` / ``warm=False``, the replay starting as soon
  as the constructor returns (the preload runs beside it);
* ``close_warm_waited``: as ``close_warm``, but ``wait_warm()`` first;
* ``kill_warm`` / ``kill_cold``: the prefix replayed by a child process
  that is SIGKILLed the moment it says it is done (its residency list is
  then up to ``RESIDENCY_INTERVAL`` old), reopened with ``warm=True`` /
  ``warm=False``.

Every restarted case opens its own copy of the directory, so all start from
the same files. Reported per case: the memory hit ratio (gets served from
a resident page / gets) of the next requests and of each tenth of them
(every key the prefix set is in the store, so a restarted cache finds it
either way; what a cold restart loses is memory hits, each miss a page
fault that reads SQLite), the overall hit ratio, the constructor's wall time, and for the warm cases
the seconds until the preload ended and the pages it read. Writes
``docs/bench/warm.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

from .util import REPO, TRACES, fsync_tree, machine_info, note

TRACE = "cache2k_orm-busy.i32be"
VALUE = b"\x00" * 100
PAGE_SIZE = 16


def _keys(path: str, start: int, end: int) -> list[int]:
    import array
    a = array.array("i")
    with open(path, "rb") as f:
        f.seek(4 * start)
        a.frombytes(f.read(4 * (end - start)))
    if sys.byteorder == "little":
        a.byteswap()
    return a.tolist()


def _unique(path: str) -> int:
    return len(set(_keys(path, 0, os.path.getsize(path) // 4)))


def _replay(cache, keys: list[int], parts: int = 1) -> list[tuple[int, int]]:
    """Look-aside replay; ``(memory hits, gets)`` for each of ``parts`` equal
    slices. Memory hits: every key the prefix set is in the store, so after
    a restart a get finds it either way; what a restart loses is the hits
    served from memory (a store hit is a page fault, a read of SQLite)."""
    get, set_ = cache.get, cache.set
    out = []
    step = math.ceil(len(keys) / parts)
    for p in range(0, len(keys), step):
        before = cache.stats().memory_hits
        for k in keys[p:p + step]:
            if get(k) is None:
                set_(k, VALUE)
        out.append((cache.stats().memory_hits - before, len(keys[p:p + step])))
    return out


def _child(directory: str, path: str, start: int, end: int, max_pages: int) -> None:
    """``--child``: replay requests ``start:end`` into ``directory``, say ``done``, wait for the kill."""
    from durablekv import Cache
    c = Cache(directory, page_size=PAGE_SIZE, max_pages=max_pages)
    _replay(c, _keys(path, start, end))
    os.write(1, b"done\n")
    time.sleep(3600)


def _case(name: str, directory: str, keys: list[int], max_pages: int, warm: bool,
          wait: bool) -> dict[str, Any]:
    from durablekv import Cache
    t0 = time.perf_counter()
    c = Cache(directory, max_pages=max_pages, warm=warm)
    open_s = time.perf_counter() - t0
    warm_s = None
    if wait:
        c.wait_warm()
        warm_s = time.perf_counter() - t0
    slices = _replay(c, keys, parts=10)
    if warm and not wait:
        c.wait_warm()
    st = c.stats()
    c.close()
    hits = sum(h for h, _ in slices)
    row = dict(case=name, memory_hit_ratio=hits / len(keys), hit_ratio=st.hit_ratio,
               hit_ratio_by_tenth=[round(h / n, 4) for h, n in slices],
               open_seconds=round(open_s, 5), recovered_records=st.recovered_records,
               warmed_pages=st.warmed_pages, page_faults=st.page_faults,
               residency_errors=st.residency_errors)
    if warm_s is not None:
        row["seconds_until_warm"] = round(warm_s, 4)
    note(f"{name}: memory hit ratio {row['memory_hit_ratio']:.4f}, open {open_s * 1e3:.1f} ms, "
         f"warmed {st.warmed_pages} pages" + (f" in {warm_s:.3f} s" if warm_s else ""))
    return row


def run(prefix: float, nxt: float, memory: float, tmp: str | None) -> dict[str, Any]:
    from durablekv import Cache
    from durablekv import warm as _warm
    path = str(TRACES / TRACE)
    total = os.path.getsize(path) // 4
    unique = _unique(path)
    start, end = 0, int(total * prefix)
    nend = end + int(total * nxt)
    max_pages = math.ceil(round(unique * memory) / PAGE_SIZE)
    first, second = _keys(path, start, end), _keys(path, end, nend)
    note(f"{TRACE}: {total} requests, {unique} unique keys; prefix {end}, next {nend - end}, "
         f"max_pages {max_pages} (page_size {PAGE_SIZE})")
    root = tempfile.mkdtemp(prefix="bench-warm-", dir=tmp)
    rows = []
    try:
        # never restarted: prefix and next in one open cache
        d = os.path.join(root, "never")
        c = Cache(d, page_size=PAGE_SIZE, max_pages=max_pages)
        t0 = time.perf_counter()
        _replay(c, first)
        note(f"prefix replayed in {time.perf_counter() - t0:.1f} s")
        base = c.stats()
        slices = _replay(c, second, parts=10)
        st = c.stats()
        c.close()
        hits = sum(h for h, _ in slices)
        rows.append(dict(case="never_restarted", memory_hit_ratio=hits / len(second),
                         hit_ratio=(st.hits - base.hits) / len(second),
                         hit_ratio_by_tenth=[round(h / n, 4) for h, n in slices],
                         page_faults=st.page_faults - base.page_faults))
        note(f"never_restarted: memory hit ratio {rows[-1]['memory_hit_ratio']:.4f}")
        # clean close
        d = os.path.join(root, "closed")
        c = Cache(d, page_size=PAGE_SIZE, max_pages=max_pages)
        _replay(c, first)
        c.close()
        for name, warm, wait in (("close_warm", True, False), ("close_warm_waited", True, True),
                                 ("close_cold", False, False)):
            copy = os.path.join(root, name)
            shutil.copytree(d, copy)
            fsync_tree(copy)
            rows.append(_case(name, copy, second, max_pages, warm, wait))
        # kill -9 right after the prefix
        d = os.path.join(root, "killed")
        env = dict(os.environ, PYTHONPATH=str(REPO))
        proc = subprocess.Popen([sys.executable, "-m", "bench.warm", "--child", d, path,
                                 str(start), str(end), str(max_pages)], stdout=subprocess.PIPE,
                                env=env, cwd=str(REPO))
        try:
            line = proc.stdout.readline()
            if line.strip() != b"done":
                raise RuntimeError(f"the replaying child said {line!r}")
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
        for name, warm, wait in (("kill_warm", True, False), ("kill_warm_waited", True, True),
                                 ("kill_cold", False, False)):
            copy = os.path.join(root, name)
            shutil.copytree(d, copy)
            fsync_tree(copy)
            rows.append(_case(name, copy, second, max_pages, warm, wait))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return dict(trace=TRACE, requests=total, unique_keys=unique, prefix_requests=end,
                next_requests=nend - end, memory_fraction=memory, page_size=PAGE_SIZE,
                max_pages=max_pages, residency_interval_seconds=_warm.RESIDENCY_INTERVAL,
                cases=rows, machine=machine_info(tmp or tempfile.gettempdir()),
                finished=time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime()))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        _child(argv[1], argv[2], int(argv[3]), int(argv[4]), int(argv[5]))
        return 0
    ap = argparse.ArgumentParser(prog="python -m bench.warm", description=__doc__.split("\n")[0])
    ap.add_argument("--prefix", type=float, default=0.4,
                    help="fraction of the trace replayed before the restart (default 0.4)")
    ap.add_argument("--next", type=float, default=0.1, dest="nxt",
                    help="fraction of the trace measured after it (default 0.1)")
    ap.add_argument("--memory", type=float, default=0.1,
                    help="memory tier as a fraction of the unique keys (default 0.1)")
    ap.add_argument("--json", default=str(REPO / "docs" / "bench" / "warm.json"))
    ap.add_argument("--tmp", default=None, help="directory for the caches (default: $TMPDIR)")
    a = ap.parse_args(argv)
    result = run(a.prefix, a.nxt, a.memory, a.tmp)
    with open(a.json, "w") as f:
        json.dump(result, f, indent=1)
        f.write("\n")
    note(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
