"""cProfile of durablekv's slowest bench cases: ``python -m bench.profile [CASE ...]``.

Each case sets up the same workload as the bench, then profiles the calling
thread with cProfile and, separately, the write-behind batcher thread (its
``_run`` is wrapped here, at runtime, before the cache is opened; the library
is not modified). Prints the top functions by own time (``tottime``) as a
share of the thread's profiled time; ``--json`` writes them too.

Cases: ``get_hit`` (memory hit), ``set_log`` (overwrites, durability log),
``page_fault`` (get with a tier of ~1% of the keys), ``get_miss``,
``replay_orm`` (cache2k_orm-busy, 10% memory, page_size 16, first 300k
requests), ``sustained`` (unique-key sets, 5 s), ``recovery`` (reopen with
200k log records to replay).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import math
import os
import pstats
import shutil
import tempfile
import time
from typing import Any, Callable

N = 100_000
VALUE = os.urandom(100)
_BATCHER_PROFILES: list[cProfile.Profile] = []


def _patch_batcher() -> None:
    from durablekv.batcher import WriteBehindBatcher
    if getattr(WriteBehindBatcher._run, "_bench_profiled", False):
        return
    orig = WriteBehindBatcher._run

    def _run(self: Any) -> None:
        prof = cProfile.Profile()
        prof.enable()
        try:
            orig(self)
        finally:
            prof.disable()
            _BATCHER_PROFILES.append(prof)
    _run._bench_profiled = True  # type: ignore[attr-defined]
    WriteBehindBatcher._run = _run  # type: ignore[method-assign]


def _keys(n: int = N, prefix: str = "key:") -> list[str]:
    return [f"{prefix}{i:0{16 - len(prefix)}d}" for i in range(n)]


def _top(st: pstats.Stats, limit: int) -> tuple[float, list[dict[str, Any]]]:
    total = st.total_tt or 1e-12  # type: ignore[attr-defined]
    rows = []
    for (path, line, func), (_cc, nc, tt, ct, _callers) in st.stats.items():  # type: ignore[attr-defined]
        where = func if path == "~" else f"{os.path.basename(path)}:{line} {func}"
        rows.append({"function": where, "calls": nc, "tottime_s": tt, "tottime_pct": 100 * tt / total,
                     "cumtime_pct": 100 * ct / total})
    rows.sort(key=lambda r: r["tottime_s"], reverse=True)
    return total, rows[:limit]


def _profile(setup: Callable[[str], tuple[Callable[[], Any], Callable[[], Any]]],
             limit: int) -> dict[str, Any]:
    _patch_batcher()
    _BATCHER_PROFILES.clear()
    tmp = tempfile.mkdtemp(prefix="durablekv-profile-")
    try:
        work, teardown = setup(tmp)
        prof = cProfile.Profile()
        t0 = time.perf_counter()
        prof.enable()
        work()
        prof.disable()
        wall = time.perf_counter() - t0
        teardown()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    total, main = _top(pstats.Stats(prof), limit)
    out: dict[str, Any] = {"wall_seconds": wall, "main_thread_profiled_seconds": total,
                           "main_thread": main}
    if _BATCHER_PROFILES:
        merged = pstats.Stats(_BATCHER_PROFILES[0])
        for p in _BATCHER_PROFILES[1:]:
            merged.add(p)
        out["batcher_thread_profiled_seconds"], out["batcher_thread"] = _top(merged, limit)
    return out


# -- cases ------------------------------------------------------------------------------

def _filled(tmp: str, **kw: Any):
    from durablekv import Cache
    keys = _keys()
    c = Cache(tmp, **kw)
    for k in keys:
        c.set(k, VALUE)
    c.flush()
    return c, keys


def case_get_hit(tmp: str):
    c, keys = _filled(tmp, max_pages=math.ceil(2 * N / 16))
    g = c.get

    def work() -> None:
        for _ in range(5):
            for k in keys:
                g(k)
    return work, c.close


def case_set_log(tmp: str):
    c, keys = _filled(tmp, max_pages=math.ceil(2 * N / 16))
    import random
    order = keys[:]
    random.Random(1).shuffle(order)
    s = c.set

    def work() -> None:
        for k in order:
            s(k, VALUE)
    return work, c.close


def case_page_fault(tmp: str):
    c, keys = _filled(tmp, max_pages=64)
    import random
    order = keys[:]
    random.Random(2).shuffle(order)
    g = c.get

    def work() -> None:
        for k in order[:20_000]:
            g(k)
    return work, c.close


def case_get_miss(tmp: str):
    c, _keys_ = _filled(tmp, max_pages=math.ceil(2 * N / 16))
    missing = _keys(20_000, "nokey:")
    g = c.get

    def work() -> None:
        for k in missing:
            g(k)
    return work, c.close


def case_replay_orm(tmp: str):
    from durablekv import Cache

    from . import sim
    from .util import TRACES
    req = sim.load(TRACES / "cache2k_orm-busy.i32be", 300_000)
    slots = sim.slots_for(req, 0.10)
    c = Cache(tmp, page_size=16, max_pages=math.ceil(slots / 16))
    g, s = c.get, c.set

    def work() -> None:
        for k in req.keys:
            if g(k) is None:
                s(k, VALUE)
    return work, c.close


def case_sustained(tmp: str):
    from durablekv import Cache
    c = Cache(tmp, durability="log")
    s = c.set

    def work() -> None:
        deadline = time.perf_counter() + 5.0
        i = 0
        while time.perf_counter() < deadline:
            for j in range(i, i + 1024):
                s(f"s:{j:014d}", VALUE)
            i += 1024
    return work, c.close


def case_recovery(tmp: str):
    import signal
    import subprocess
    import sys

    from .util import REPO
    n = 200_000
    d = os.path.join(tmp, "crashed")
    os.makedirs(d)
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.Popen([sys.executable, "-m", "bench.restart", d, str(n)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    line = proc.stdout.readline()
    max_pages = int(line.split()[2])
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    proc.stdin.close()
    from durablekv import Cache
    box: list[Any] = []

    def work() -> None:
        box.append(Cache(d, max_pages=max_pages))
    return work, lambda: box[0].close()


CASES = {"get_hit": case_get_hit, "set_log": case_set_log, "page_fault": case_page_fault,
         "get_miss": case_get_miss, "replay_orm": case_replay_orm, "sustained": case_sustained,
         "recovery": case_recovery}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.profile", description=__doc__.split("\n\n")[0])
    p.add_argument("cases", nargs="*", default=list(CASES), help=", ".join(CASES))
    p.add_argument("--top", type=int, default=12)
    p.add_argument("--json", help="write the profiles as JSON here")
    args = p.parse_args(argv)
    out = {}
    for name in args.cases:
        res = _profile(CASES[name], args.top)
        out[name] = res
        print(f"\n== {name}: {res['wall_seconds']:.2f} s wall (under cProfile)")
        for thread in ("main_thread", "batcher_thread"):
            if thread not in res:
                continue
            print(f"  -- {thread.replace('_', ' ')}: {res[thread + '_profiled_seconds']:.2f} s profiled")
            for r in res[thread]:
                print(f"    {r['tottime_pct']:5.1f}%  (cum {r['cumtime_pct']:5.1f}%)  "
                      f"{r['calls']:>9,}  {r['function']}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
