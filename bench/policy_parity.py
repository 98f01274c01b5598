"""``python -m bench.policy_parity [--base TREE] [--jobs 2] [--json OUT]``:
does a change to the memory tier or a policy keep every replacement decision?

Replays every shared trace with ``durablekv replay`` (``--durability none``)
at ``page_size`` 1 and 16, a memory tier of 1% and 10% of the trace's
distinct keys, under each policy, and records the counts the replay reports
(memory hits, store hits, misses, page faults, evictions; the table shows the
memory hit ratio, since the store never evicts here). With ``--base``,
the same cases run against that source tree too (a checkout of the previous
main, say) and a table shows the two side by side with any difference
marked: a refactoring of the tier must leave it with none.

Each replay is a subprocess of its own (``PYTHONPATH`` points at the tree),
``--jobs`` at a time.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from .util import REPO, TRACES

PAGE_SIZES = (1, 16)
FRACTIONS = (0.01, 0.10)
POLICIES = ("lru", "tinylfu", "midpoint")
COUNTS = ("memory_hits", "store_hits", "misses", "page_faults", "evictions")


def traces() -> list[Path]:
    """Every trace file in ``../shared/traces`` (none on a clone without it)."""
    if not TRACES.is_dir():
        return []
    return sorted(p for p in TRACES.iterdir() if p.is_file() and p.name != "README.md")


def distinct_keys(path: Path) -> int:
    from durablekv.traces import open_trace
    return len({key for _op, key, _size, _ttl, _t in open_trace(path)})


def cases(paths: list[Path], policies: tuple[str, ...] = POLICIES) -> list[dict[str, Any]]:
    out = []
    for path in paths:
        unique = distinct_keys(path)
        for page_size in PAGE_SIZES:
            for fraction in FRACTIONS:
                max_pages = max(1, round(unique * fraction / page_size))
                for policy in policies:
                    out.append({"trace": path.name, "path": str(path), "unique": unique,
                                "page_size": page_size, "fraction": fraction,
                                "max_pages": max_pages, "policy": policy})
    return out


def replay(tree: Path, case: dict[str, Any]) -> dict[str, Any]:
    """One ``durablekv replay`` of ``case`` with the package from ``tree``."""
    with tempfile.TemporaryDirectory(prefix="durablekv-parity-") as tmp:
        report = os.path.join(tmp, "report.json")
        env = dict(os.environ, PYTHONPATH=str(tree))
        proc = subprocess.run(
            [sys.executable, "-m", "durablekv", "replay", case["path"],
             "--page-size", str(case["page_size"]), "--max-pages", str(case["max_pages"]),
             "--policy", case["policy"], "--durability", "none", "--no-progress",
             "--json", report],
            env=env, cwd=tmp, capture_output=True, text=True, timeout=3600)
        if proc.returncode != 0:
            raise RuntimeError(f"replay of {case} with {tree} failed:\n{proc.stderr[-2000:]}")
        with open(report) as f:
            got = json.load(f)
    return {k: got[k] for k in COUNTS} | {"memory_hit_ratio": got["memory_hit_ratio"]}


def run(trees: dict[str, Path], jobs: int,
        policies: tuple[str, ...] = POLICIES) -> list[dict[str, Any]]:
    todo = cases(traces(), policies)
    with ThreadPoolExecutor(jobs) as pool:
        futures = {(name, i): pool.submit(replay, tree, case)
                   for i, case in enumerate(todo) for name, tree in trees.items()}
        for (name, i), fut in futures.items():
            todo[i][name] = fut.result()
    return todo


def markdown(rows: list[dict[str, Any]], names: list[str]) -> str:
    head = ["trace", "page", "memory", "policy"] + [f"{n} memory hit ratio" for n in names]
    lines = ["| " + " | ".join(head) + (" | same counts |" if len(names) > 1 else " |"),
             "|" + "---|" * (len(head) + (len(names) > 1))]
    for r in rows:
        cells = [r["trace"], str(r["page_size"]), f"{r['fraction']:.0%}", r["policy"]]
        cells += [f"{r[n]['memory_hit_ratio']:.4f}" for n in names]
        if len(names) > 1:
            same = all(r[n] == r[names[0]] for n in names[1:])
            cells.append("yes" if same else "**NO**")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", type=Path, help="a second source tree to compare with")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--policy", action="append", choices=POLICIES,
                    help="only this policy (repeat for more; default: all)")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--markdown", type=Path)
    args = ap.parse_args(argv)
    if not traces():
        print(f"no traces in {TRACES}: nothing to replay", file=sys.stderr)
        return 1
    trees = {"this": REPO}
    if args.base:
        trees = {"base": args.base.resolve(), "this": REPO}
    rows = run(trees, args.jobs, tuple(args.policy or POLICIES))
    table = markdown(rows, list(trees))
    print(table)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    if args.markdown:
        args.markdown.write_text(table)
    if args.base and any(r["base"] != r["this"] for r in rows):
        print("the two trees differ on some case (marked NO)", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
