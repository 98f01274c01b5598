"""``python -m bench.policy``: the replacement-policy run behind docs/policy.md.

One run over every shared trace (whole traces): entry-level LRU, W-TinyLFU
and OPT, durablekv's memory tier at ``page_size=16`` under ``policy="lru"``
and ``policy="tinylfu"``, and item 1's candidates: page-LRU with re-homing
and partial pages with midpoint insertion (``bench.sim.page_midpoint``),
at 0.5% .. 20% of the unique keys (:func:`bench.sim.curves`); and the tier
itself, ``Cache(policy="midpoint", page_size=16)``, replayed at the table's
two sizes (:func:`tier_curves`), which must equal the simulator's figure
(tests/test_midpoint.py checks the two agree request for request). From that one
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
README_BEGIN, README_END = "<!-- readme-policy-table:begin -->", "<!-- readme-policy-table:end -->"
SHORT_NAMES = {"cache2k_orm-busy.i32be": "orm-busy", "arc_OLTP.lis": "arc_OLTP",
               "scarab_recs.i64be": "scarab", "cloudPhysicsIO.csv": "cloudPhysics"}


def tier_replay(req: sim.Requests, page_size: int, max_pages: int, policy: str) -> dict[str, int]:
    """Replay ``req`` through a real :class:`durablekv.Cache` (a temporary
    directory, ``durability="none"``, the default write-behind) as look-aside
    caching, as the simulators count it: a missed get is followed by a set,
    a set is a set, a delete a delete. Returns its ``stats()`` counts."""
    import tempfile
    from durablekv import Cache
    get_, set_ = sim.GET, sim.SET
    with tempfile.TemporaryDirectory(prefix="durablekv-policy-") as tmp, \
            Cache(tmp + "/c", page_size=page_size, max_pages=max_pages, policy=policy,
                  durability="none", warm=False) as cache:
        get, put, delete = cache.get, cache.set, cache.delete
        for op, k in zip(req.ops, req.keys):
            if op == get_:
                if get(k) is None:
                    put(k, b"")
            elif op == set_:
                put(k, b"")
            else:
                delete(k)
        st = cache.stats()
    return {"memory_hits": st.memory_hits, "store_hits": st.store_hits, "misses": st.misses,
            "page_faults": st.page_faults}


def tier_curves(req: sim.Requests, c: dict[str, Any], page_size: int = 16,
                policy: str = "midpoint") -> dict[str, Any]:
    """The real tier under ``policy`` at ``page_size``, at the table's memory
    sizes (``TABLE_FRACTIONS`` of the unique keys, the slots ``c`` has)."""
    gets = max(req.gets, 1)
    out: dict[str, Any] = {"fractions": [], "memory_hit_ratio": [], "page_faults": [],
                           "seconds": []}
    for f in TABLE_FRACTIONS:
        if f not in c["fractions"]:
            continue
        slots = c["slots"][c["fractions"].index(f)]
        t0 = time.perf_counter()
        r = tier_replay(req, page_size, -(-slots // page_size), policy)
        out["fractions"].append(f)
        out["memory_hit_ratio"].append(r["memory_hits"] / gets)
        out["page_faults"].append(r["page_faults"])
        out["seconds"].append(round(time.perf_counter() - t0, 1))
    return out


def _tier_one(name: str, c: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    return name, tier_curves(sim.load(TRACES / name, None), c)


def _one(name: str, fractions: tuple[float, ...], page_sizes: tuple[int, ...],
         rehome: tuple[int, ...], midpoint: tuple[int, ...]) -> tuple[str, dict[str, Any]]:
    t0 = time.perf_counter()
    req = sim.load(TRACES / name, None)
    c = sim.curves(req, fractions, page_sizes, rehome, midpoint)
    # the tier itself, not a simulator: Cache(policy="midpoint", page_size=16)
    c["tier_midpoint"] = {"16": tier_curves(req, c)}
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


def readme_table(curves: dict[str, Any]) -> str:
    """The README's short form of :func:`table`: trace x memory, with the
    entry-level policies (page_size 1) and the page tier's (page_size 16)
    side by side, and whether the tier's LRU reaches the entry LRU."""
    rows = ["| trace | memory | LRU | TinyLFU | OPT | ps16 LRU | ps16 TinyLFU "
            "| ps16 midpoint (the tier, run) | ps16 midpoint ≥ entry LRU |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for name, c in curves.items():
        for f in TABLE_FRACTIONS:
            if f not in c["fractions"] or "16" not in c["page_lru"]:
                continue
            i = c["fractions"].index(f)
            lru = c["lru"][i]
            pl = c["page_lru"]["16"][i]
            tm = c.get("tier_midpoint", {}).get("16")
            if tm and f in tm["fractions"]:
                mp = tm["memory_hit_ratio"][tm["fractions"].index(f)]
                mps = f"{mp:.3f}"
                ok = "yes" if mp >= lru else f"no ({100 * (mp - lru):+.1f} pts)"
            else:
                mps, ok = "–", "–"
            rows.append(f"| {SHORT_NAMES.get(name, name)} | {100 * f:g}% | {lru:.3f} "
                        f"| {c['tinylfu'][i]:.3f} | {c['opt'][i]:.3f} | {pl:.3f} "
                        f"| {c['page_tinylfu']['16'][i]:.3f} | {mps} | {ok} |")
    return "\n".join(rows)


def _replace(path, begin: str, end: str, body: str) -> None:
    text = path.read_text()
    if begin not in text or end not in text:
        raise SystemExit(f"{path}: no {begin} ... {end} markers to put the table in")
    path.write_text(re.sub(re.escape(begin) + ".*?" + re.escape(end),
                           lambda _: f"{begin}\n{body}\n{end}", text, flags=re.S))


def write_doc(curves: dict[str, Any], path) -> None:
    """Replace the table between the markers of ``path``."""
    _replace(path, MARK_BEGIN, MARK_END, table(curves))


def write_readme(curves: dict[str, Any], path) -> None:
    """Replace the short table between the README's markers."""
    _replace(path, README_BEGIN, README_END, readme_table(curves))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.policy", description=__doc__.split("\n")[0])
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--json", default=str(REPO / "docs" / "bench" / "policy.json"))
    p.add_argument("--doc", default=str(REPO / "docs" / "policy.md"))
    p.add_argument("--plots-dir", default=str(REPO / "docs" / "bench"))
    p.add_argument("--readme", default=str(REPO / "README.md"))
    p.add_argument("--from-json", action="store_true",
                   help="do not run: redraw the plots and rewrite both tables from --json "
                   "(the run that wrote it)")
    p.add_argument("--tier-only", action="store_true",
                   help="run only the tier (tier_curves) and store it into --json's run, "
                   "then rewrite as --from-json does")
    args = p.parse_args(argv)
    from pathlib import Path
    from . import plots
    if args.tier_only:
        curves = json.loads(Path(args.json).read_text())
        with ProcessPoolExecutor(max_workers=args.jobs) as ex:
            done = dict(ex.map(_tier_one, curves, curves.values()))
        for name, tier in done.items():
            curves[name]["tier_midpoint"] = {"16": tier}
        Path(args.json).write_text(json.dumps(curves, indent=1) + "\n")
    elif args.from_json:
        curves = json.loads(Path(args.json).read_text())
    else:
        curves = run(jobs=args.jobs)
        Path(args.json).write_text(json.dumps(curves, indent=1) + "\n")
    plots.draw({}, curves, args.plots_dir)
    write_doc(curves, Path(args.doc))
    write_readme(curves, Path(args.readme))
    print(table(curves))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
