"""``python -m bench.policy``: the replacement-policy run behind docs/policy.md.

One run over every shared trace (whole traces): entry-level LRU, W-TinyLFU
and OPT, durablekv's memory tier at ``page_size=16`` under ``policy="lru"``
and ``policy="tinylfu"``, and item 1's candidates: page-LRU with re-homing
and partial pages with midpoint insertion (``bench.sim.page_midpoint``),
at 0.5% .. 20% of the unique keys (:func:`bench.sim.curves`). From that one
run it writes ``docs/bench/policy.json``, the ``hit_ratio_<trace>.png``
plots (:func:`bench.plots.draw`) and the table between the markers of
``docs/policy.md``. Nothing in the table is typed by hand.

Traces run in parallel, one process each (``--jobs``, default 2).
"""

from __future__ import annotations

import argparse
import json
import re
import time
from concurrent.futures import ProcessPoolExecutor
from typing import Any

from . import sim
from .macro import TRACE_FILES
from .util import REPO, TRACES

FRACTIONS = (0.005, 0.01, 0.02, 0.05, 0.10, 0.20)
TABLE_FRACTIONS = (0.01, 0.10)
MARK_BEGIN, MARK_END = "<!-- policy-table:begin -->", "<!-- policy-table:end -->"


def _one(name: str, fractions: tuple[float, ...], page_sizes: tuple[int, ...],
         rehome: tuple[int, ...], midpoint: tuple[int, ...]) -> tuple[str, dict[str, Any]]:
    t0 = time.perf_counter()
    req = sim.load(TRACES / name, None)
    c = sim.curves(req, fractions, page_sizes, rehome, midpoint)
    c.update(requests=len(req.ops), gets=req.gets, unique_keys=req.unique,
             whole_trace=req.whole, seconds=round(time.perf_counter() - t0, 1))
    return name, c


def run(fractions=FRACTIONS, page_sizes=(16,), rehome=(16,), midpoint=(16,),
        jobs: int = 2) -> dict[str, Any]:
    """Curves per trace (the shared traces that exist), in TRACE_FILES order."""
    names = [n for n in TRACE_FILES if (TRACES / n).exists()]
    with ProcessPoolExecutor(max_workers=jobs) as ex:
        done = dict(ex.map(_one, names, *zip(*[(fractions, page_sizes, rehome, midpoint)]
                                             * len(names))))
    return {n: done[n] for n in names}


def _gap(x: float, lru: float, opt: float) -> str:
    return "–" if opt - lru < 1e-9 else f"{100 * (x - lru) / (opt - lru):+.0f}%"


def table(curves: dict[str, Any]) -> str:
    """Markdown: trace x memory x page_size x policy, with LRU and OPT."""
    rows = ["| trace | memory | entries | page_size | LRU | TinyLFU | OPT | TinyLFU − LRU "
            "| of LRU→OPT gap | re-homing (LRU) | midpoint (LRU) "
            "| page faults (lru → midpoint) | ≥ entry LRU (lru / re-homing / midpoint) |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for name, c in curves.items():
        for f in TABLE_FRACTIONS:
            if f not in c["fractions"]:
                continue
            i = c["fractions"].index(f)
            lru, opt, slots = c["lru"][i], c["opt"][i], c["slots"][i]
            t = c["tinylfu"][i]
            rows.append(f"| {name} | {100 * f:g}% | {slots:,} | 1 (entries) | {lru:.4f} | {t:.4f} "
                        f"| {opt:.4f} | {100 * (t - lru):+.2f} | {_gap(t, lru, opt)} "
                        "| – | – | – | – |")
            for ps, ys in c["page_lru"].items():
                pl, pt = ys[i], c["page_tinylfu"][ps][i]
                rh = c["page_rehome"].get(ps)
                mp = c.get("page_midpoint", {}).get(ps)
                rhs = f"{rh[i]:.4f}" if rh else "–"
                mps = f"{mp[i]:.4f}" if mp else "–"
                fl = (f"{c['faults_page_lru'][ps][i]:,} → {c['faults_midpoint'][ps][i]:,}"
                      if mp else "–")
                ok = " / ".join(("yes" if ys_[i] >= lru else "no") if ys_ else "–"
                                for ys_ in (ys, rh, mp))
                rows.append(f"| {name} | {100 * f:g}% | {slots:,} | {ps} | {pl:.4f} | {pt:.4f} "
                            f"| {opt:.4f} | {100 * (pt - pl):+.2f} | {_gap(pt, pl, opt)} | {rhs} "
                            f"| {mps} | {fl} | {ok} |")
    return "\n".join(rows)


def write_doc(curves: dict[str, Any], path) -> None:
    """Replace the table between the markers of ``path``."""
    text = path.read_text()
    if MARK_BEGIN not in text or MARK_END not in text:
        raise SystemExit(f"{path}: no {MARK_BEGIN} ... {MARK_END} markers to put the table in")
    new = re.sub(re.escape(MARK_BEGIN) + ".*?" + re.escape(MARK_END),
                 lambda _: f"{MARK_BEGIN}\n{table(curves)}\n{MARK_END}", text, flags=re.S)
    path.write_text(new)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.policy", description=__doc__.split("\n")[0])
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--json", default=str(REPO / "docs" / "bench" / "policy.json"))
    p.add_argument("--doc", default=str(REPO / "docs" / "policy.md"))
    p.add_argument("--plots-dir", default=str(REPO / "docs" / "bench"))
    args = p.parse_args(argv)
    from pathlib import Path
    from . import plots
    curves = run(jobs=args.jobs)
    Path(args.json).write_text(json.dumps(curves, indent=1) + "\n")
    plots.draw({}, curves, args.plots_dir)
    write_doc(curves, Path(args.doc))
    print(table(curves))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
