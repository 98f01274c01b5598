"""``python -m bench.tier_parity --base TREE [--jobs 2]``: the memory tier of
two source trees driven by the same trace with no Cache and no threads, so
every replacement decision is deterministic and the two can be compared
count for count.

:mod:`bench.policy_parity` replays through ``durablekv replay``, whose
write-behind thread decides when dirty pages become clean; under
``policy="tinylfu"`` on a trace with writes that timing moves the counts from
run to run (on the same tree). Here the tier alone takes each request
(a get: a hit, or an insert after a miss; a set: an update or an insert; a
delete: a removal) and every 1,000 requests every dirty page is marked
flushed, the same in both trees. Cases: every shared trace, ``page_size`` 1
and 16, 1% and 10% of the distinct keys, policies ``lru`` and ``tinylfu``
(``midpoint``'s tier needs per-entry sizes from a store: it is checked by
:mod:`bench.policy_parity`).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from .policy_parity import FRACTIONS, PAGE_SIZES, distinct_keys, traces
from .util import REPO

POLICIES = ("lru", "tinylfu")

_CHILD = r"""
import json, sys
try:
    from durablekv.tier.pages import MemoryTier, EMPTY
except ImportError:          # a tree from before the tier package
    from durablekv.pages import MemoryTier, EMPTY
from durablekv.traces import open_trace
path, ps, mp, policy = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
t = MemoryTier(ps, mp, policy)
hits = faults = misses = 0
def flush_all():
    for p in list(t.dirty.values()):
        n = sum(k is not EMPTY for k in p.keys)
        t.flushed(p, p.version, p.keys_version, n, 0, 10 * max(n, 1))
for lsn, (op, key, _size, _ttl, _t) in enumerate(open_trace(path), 1):
    ref = t.table.get(key)
    if op == "get":
        if ref is not None:
            if t.hit(ref[0], ref[1]):
                hits += 1
            else:
                faults += 1
        else:
            misses += 1
            t.insert(key, b"", None, 0.0, lsn, 10)
    elif op == "delete":
        if ref is not None:
            t.remove(key, 0.0, lsn)
    elif ref is not None:
        t.update(ref[0], ref[1], b"", None, 0.0, lsn, 0)
        t.hit(ref[0], ref[1])
    else:
        t.insert(key, b"", None, 0.0, lsn, 10)
    if lsn % 1000 == 0:
        flush_all()
print(json.dumps(dict(hits=hits, faults=faults, misses=misses, evictions=t.evictions,
                      page_faults=t.page_faults, resident=t.resident)))
"""


def drive(tree: Path, case: dict[str, Any]) -> dict[str, int]:
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, case["path"], str(case["page_size"]),
         str(case["max_pages"]), case["policy"]],
        env=dict(os.environ, PYTHONPATH=str(tree)), capture_output=True, text=True,
        timeout=3600)
    if proc.returncode != 0:
        raise RuntimeError(f"{case} with {tree} failed:\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", type=Path, required=True, help="the source tree to compare with")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    todo = []
    for path in traces():
        unique = distinct_keys(path)
        for page_size in PAGE_SIZES:
            for fraction in FRACTIONS:
                for policy in POLICIES:
                    todo.append({"trace": path.name, "path": str(path), "page_size": page_size,
                                 "fraction": fraction, "policy": policy,
                                 "max_pages": max(1, round(unique * fraction / page_size))})
    if not todo:
        print("no traces beside the repository: nothing to drive", file=sys.stderr)
        return 1
    trees = {"base": args.base.resolve(), "this": REPO}
    with ThreadPoolExecutor(args.jobs) as pool:
        futures = {(n, i): pool.submit(drive, tree, case)
                   for i, case in enumerate(todo) for n, tree in trees.items()}
        for (n, i), fut in futures.items():
            todo[i][n] = fut.result()
    print("| trace | page | memory | policy | memory hits (base) | memory hits (this) | same counts |")
    print("|---|---|---|---|---:|---:|---|")
    for c in todo:
        same = "yes" if c["base"] == c["this"] else "**NO**"
        print(f"| {c['trace']} | {c['page_size']} | {c['fraction']:.0%} | {c['policy']} | "
              f"{c['base']['hits']} | {c['this']['hits']} | {same} |")
    if args.json:
        args.json.write_text(json.dumps(todo, indent=1) + "\n")
    return 0 if all(c["base"] == c["this"] for c in todo) else 2


if __name__ == "__main__":
    sys.exit(main())
