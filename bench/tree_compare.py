"""``python -m bench.tree_compare BASE_TREE [THIS_TREE]``: the hot paths of
two source trees of durablekv side by side, in one run.

Each round runs, in a fresh subprocess per tree (alternating, so load on the
machine falls on both alike): ``set`` (durability="log", 100-byte values),
``get`` hits served from memory, overwrites of entries in memory, page faults (a memory tier far smaller
than the keys, random gets), and the look-aside replay of a prefix of the
cache2k orm-busy trace (``--trace``; get, set on a miss, a memory tier of 10%
of its distinct keys, as ``bench/macro.py`` replays it; ns per request); the
get cases take the best of ``--passes`` (5) passes. Prints per case the median
ns/op of each tree over the rounds, the spread (min-max), and THIS/BASE of the
medians and of the best rounds. Used to check that a change (page checksums,
the split of Cache into modules) costs nothing on the hot paths.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile

_CHILD = r"""
import json, random, sys, tempfile, time, timeit
from durablekv import Cache
n = int(sys.argv[1])
out = {}
val = b"v" * 100
with tempfile.TemporaryDirectory() as d:
    c = Cache(d + "/c", max_pages=1 << 16, page_size=16, flush_interval=0.05)
    keys = [f"key{i:08d}" for i in range(n)]
    t = time.perf_counter_ns()
    for k in keys:
        c[k] = val
    out["set"] = (time.perf_counter_ns() - t) / n
    c.flush()
    g = c.__getitem__
    # the best of several passes: the least disturbed by other load on the machine
    passes = int(sys.argv[4])
    out["get_hit_memory"] = min(timeit.repeat(lambda: [g(k) for k in keys], number=1,
                                              repeat=passes)) / n * 1e9
    # overwrites of resident entries (set's hot path), best of the passes
    s = c.__setitem__
    out["overwrite"] = min(timeit.repeat(lambda: [s(k, val) for k in keys], number=1,
                                         repeat=passes)) / n * 1e9
    c.close()
    c = Cache(d + "/c", max_pages=64)
    rng = random.Random(1)
    probe = [keys[rng.randrange(n)] for _ in range(n // 20)]
    g = c.__getitem__
    out["page_fault"] = min(timeit.repeat(lambda: [g(k) for k in probe], number=1,
                                          repeat=passes)) / len(probe) * 1e9
    c.close()
    trace, prefix = sys.argv[2], int(sys.argv[3])
    if trace:
        from array import array
        keys = array("i")
        with open(trace, "rb") as f:
            keys.frombytes(f.read(4 * prefix))
        if sys.byteorder == "little":
            keys.byteswap()
        keys = keys.tolist()
        max_pages = max(1, len(set(keys)) // 10 // 16)
        c = Cache(d + "/r", page_size=16, max_pages=max_pages, durability="log")
        get, set_ = c.get, c.set
        t = time.perf_counter_ns()
        for k in keys:
            if get(k) is None:
                set_(k, val)
        out["orm_busy_replay"] = (time.perf_counter_ns() - t) / len(keys)
        c.close()
import durablekv, os
out["package"] = os.path.realpath(durablekv.__file__)
print(json.dumps(out))
"""


def _once(tree: str, n: int, trace: str = "", prefix: int = 0,
          passes: int = 5) -> dict[str, float]:
    import site
    # -S: no site processing, so an editable install's path hook cannot put
    # this checkout's package (or its migrations) in front of ``tree``'s
    path = os.pathsep.join([os.path.abspath(tree), *site.getsitepackages()])
    env = dict(os.environ, PYTHONPATH=path)
    # cwd: a temporary directory, since ``-c`` puts the working directory first
    # on sys.path, where a checkout's own package would shadow ``tree``'s
    with tempfile.TemporaryDirectory() as cwd:
        res = subprocess.run([sys.executable, "-S", "-c", _CHILD, str(n), trace, str(prefix),
                              str(passes)],
                             env=env, capture_output=True, text=True, cwd=cwd)
    if res.returncode:
        raise RuntimeError(f"the benchmark child for {tree} failed:\n{res.stderr[-3000:]}")
    out = json.loads(res.stdout.strip().splitlines()[-1])
    where = out.pop("package")
    if not where.startswith(os.path.realpath(tree) + os.sep):
        raise RuntimeError(f"the child for {tree} imported durablekv from {where}")
    return out


def main(argv: list[str] | None = None) -> int:
    import argparse
    p = argparse.ArgumentParser(prog="python -m bench.tree_compare")
    p.add_argument("base", help="source tree to compare against (e.g. an export of main)")
    p.add_argument("this", nargs="?", default=".", help="this tree (default: .)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("-n", type=int, default=100_000, help="keys per round")
    here = os.path.dirname(os.path.abspath(__file__))
    p.add_argument("--trace", default=os.path.join(here, "..", "..", "shared", "traces",
                                                   "cache2k_orm-busy.i32be"),
                   help="orm-busy trace (big-endian int32 keys); '' skips the replay case")
    p.add_argument("--prefix", type=int, default=500_000, help="trace requests replayed")
    p.add_argument("--passes", type=int, default=5,
                   help="passes of each get case per round; the best one counts")
    args = p.parse_args(argv)
    runs: dict[str, list[dict[str, float]]] = {"base": [], "this": []}
    for _ in range(args.rounds):
        trace = args.trace if args.trace and os.path.exists(args.trace) else ""
        runs["base"].append(_once(args.base, args.n, trace, args.prefix, args.passes))
        runs["this"].append(_once(args.this, args.n, trace, args.prefix, args.passes))
    # this/base of the medians, and of the best rounds (load on the machine only
    # ever adds time, so the best round is the least disturbed)
    print(f"{'case':16} {'base ns/op':>22} {'this ns/op':>22} {'this/base':>9} {'best':>6}")
    for case in runs["base"][0]:
        b = [r[case] for r in runs["base"]]
        t = [r[case] for r in runs["this"]]
        mb, mt = statistics.median(b), statistics.median(t)
        print(f"{case:16} {mb:8.0f} ({min(b):5.0f}-{max(b):5.0f}) "
              f"{mt:8.0f} ({min(t):5.0f}-{max(t):5.0f}) {mt / mb:9.2f} {min(t) / min(b):6.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
