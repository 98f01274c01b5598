"""``python -m bench``: run the cases, write the JSON, the table, the plots, the doc."""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import shlex
import sys
import tempfile
import time
import traceback
from typing import Any, Callable, Sequence

from .util import REPO, Scratch, machine_info, note, settings_for

CASES = ("micro", "sustained", "macro", "restart", "memory", "plots")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench",
        description="Benchmark durablekv against cachetools, diskcache, sqlitedict, lmdb, "
        "functools.lru_cache, dict/OrderedDict and Redis. Every case runs all implementations "
        "in this one process run, interleaved round-robin within each repetition, and reports "
        "the median and the spread. Writes JSON, a markdown table, PNG plots and (with --doc) "
        "docs/performance.md.",
        epilog="`python -m bench server --help`: the HTTP server's load bench. "
        "Reproduce the published numbers: pip install -e '.[bench]' && python -m bench "
        "--out docs/bench/results.json --table docs/bench/results.md --doc docs/performance.md")
    size = p.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true",
                      help="tiny sizes (2k keys, 3k-request prefixes, 0.3 s sustained runs): "
                      "checks that every case still runs, in well under a minute")
    size.add_argument("--full", action="store_true",
                      help="replay and plot whole traces instead of their first 300k requests")
    p.add_argument("--cases", default=",".join(CASES),
                   help="comma-separated subset of " + ",".join(CASES) + " (default: all; "
                   "'micro' includes 'sustained')")
    p.add_argument("--repeat", type=int, metavar="R",
                   help="repetitions of each micro case (default 5, quick 2); replays, sustained "
                   "runs and crash recovery use min(R, 3)")
    p.add_argument("--out", default="bench-results.json", help="results JSON (default %(default)s)")
    p.add_argument("--table", default="bench-results.md",
                   help="markdown table (default %(default)s)")
    p.add_argument("--doc", help="also write the performance page (docs/performance.md)")
    p.add_argument("--plots-dir", help="where the PNGs go (default docs/bench; a temporary "
                   "directory with --quick)")
    p.add_argument("--tmpdir", help="where the stores under test live (default: the system "
                   "temp directory)")
    p.add_argument("--no-redis", action="store_true", help="skip the Redis cases")
    p.add_argument("--from-json", metavar="RESULTS",
                   help="run nothing: rewrite --table (and --doc) from an earlier results JSON")
    return p


def _render(args: argparse.Namespace, res: dict[str, Any], plots_dir: str) -> None:
    from . import report
    report.table(res, args.table, plots_dir)
    if args.doc:
        report.performance_doc(res, args.doc, plots_dir, args.table, args.out)


def _loadavg() -> float:
    try:
        with open("/proc/loadavg", encoding="ascii") as f:
            return float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return float("nan")


def _rel(path: str) -> str:
    ap = os.path.abspath(path)
    try:
        rel = os.path.relpath(ap, REPO)
    except ValueError:
        return ap
    return ap if rel.startswith("..") else rel


def main(argv: Sequence[str] | None = None) -> int:
    if (sys.argv[1:] if argv is None else list(argv))[:1] == ["server"]:
        # `python -m bench server`: the HTTP server under load (bench/server.py)
        from . import server
        return server.main((sys.argv[1:] if argv is None else list(argv))[1:])
    args = build_parser().parse_args(argv)
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        print(f"python -m bench: unknown case(s) {unknown}; choose from {', '.join(CASES)}",
              file=sys.stderr)
        return 2
    if "micro" in cases and "sustained" not in cases:
        cases.append("sustained")
    if args.repeat is not None and args.repeat < 1:
        print("python -m bench: --repeat must be >= 1", file=sys.stderr)
        return 2
    if args.from_json:
        with open(args.from_json, encoding="utf-8") as f:
            res = json.load(f)
        from .report import targets
        res["targets"] = targets(res)
        plots_dir = args.plots_dir or str(REPO / res.get("plots", {}).get("dir", "docs/bench"))
        if args.out and os.path.abspath(args.out) == os.path.abspath(args.from_json):
            with open(args.out, "w", encoding="utf-8") as f:
                json.dump(res, f, indent=1, default=str)
                f.write("\n")
        _render(args, res, plots_dir)
        return 0
    mode = "quick" if args.quick else "full" if args.full else "normal"
    cfg = settings_for(mode, args.repeat, args.tmpdir, not args.no_redis)
    plots_dir = args.plots_dir or (tempfile.mkdtemp(prefix="durablekv-bench-plots-")
                                   if args.quick else str(REPO / "docs" / "bench"))
    scratch = Scratch(args.tmpdir)
    started = time.time()
    command = "python -m bench " + " ".join(shlex.quote(a) for a in
                                           (argv if argv is not None else sys.argv[1:]))
    res: dict[str, Any] = {
        "schema": 1, "command": command.strip(),
        "started_at": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "settings": cfg.as_dict(), "machine": machine_info(scratch.root),
        "cases_run": cases, "skipped": [], "errors": [],
    }
    from .impls import SETTINGS
    res["impl_settings"] = dict(SETTINGS)
    m = res["machine"]
    note(f"{mode} run on {m['cpu_model']} x{m['nproc']}, Python {m['python']}, SQLite "
         f"{m['sqlite']}; stores in {scratch.root}")

    def save() -> None:
        res["finished_at"] = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
        res["duration_seconds"] = time.time() - started
        from .report import targets
        res["targets"] = targets(res)
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(res, f, indent=1, default=str)
            f.write("\n")

    def step(name: str, fn: Callable[[], Any]) -> None:
        t0 = time.perf_counter()
        load = {"before": _loadavg()}
        try:
            res[name] = fn()
        except Exception as exc:  # noqa: BLE001 - recorded, the other cases still run
            tb = traceback.format_exc()
            res["errors"].append({"case": name, "error": repr(exc), "traceback": tb})
            note(f"{name} FAILED: {exc!r}\n{tb}")
        res.setdefault("case_seconds", {})[name] = time.perf_counter() - t0
        load["after"] = _loadavg()
        res.setdefault("load", {})[name] = load
        save()

    srv = None
    try:
        from .impls import missing_module
        for mod_key in ("cachetools", "diskcache", "sqlitedict", "lmdb"):
            if missing_module(mod_key):
                res["skipped"].append(f"{mod_key}: not installed (pip install -e '.[bench]')")
        redis_port = None
        if "micro" in cases:
            from .redis_server import RedisServer, redis_available
            why = "--no-redis" if args.no_redis else redis_available()
            if why is None:
                srv = RedisServer(scratch.root).start()
                redis_port = srv.port
                res["machine"]["redis_server_version"] = srv.version()
            else:
                res["skipped"].append(f"Redis: {why}")
                note(f"Redis cases skipped: {why}")
        if "micro" in cases:
            from . import micro
            step("micro", lambda: micro.run(cfg, scratch, redis_port))
        if srv is not None:
            srv.stop()
            srv = None
        if "sustained" in cases:
            from . import sustained
            step("sustained", lambda: sustained.run(cfg, scratch))
        if "restart" in cases:
            from . import restart
            step("restart", lambda: restart.run_reopen(cfg, scratch)
                 + restart.run_recovery(cfg, scratch))
        if "memory" in cases:
            from . import memory
            step("memory", lambda: memory.run(cfg))
        if "macro" in cases:
            from . import macro
            step("macro", lambda: macro.run(cfg, scratch))
        if "plots" in cases:
            from . import plots

            def do_plots() -> dict[str, Any]:
                curves = plots.hit_ratio_curves(cfg)
                files = plots.draw(res, curves, plots_dir)
                return {"curves": curves, "files": [_rel(f) for f in files], "dir": _rel(plots_dir)}
            step("plots", do_plots)
    finally:
        if srv is not None:
            srv.stop()
        scratch.close()
    save()
    _render(args, res, plots_dir)
    note(f"done in {(time.time() - started) / 60:.1f} min: {args.out}, {args.table}"
         + (f", {args.doc}" if args.doc else "") + f", plots in {plots_dir}")
    for t in res["targets"]:
        met = {True: "met", False: "MISSED", None: "not measured"}[t["met"]]
        ratio = f"{t['ratio']:.2f}x" if t["ratio"] is not None else "-"
        print(f"{met:>12}  {ratio:>8}  {t['target']} ({t['goal']}): {t['measured']}")
    if res["errors"]:
        print(f"{len(res['errors'])} case(s) failed: "
              + ", ".join(e["case"] for e in res["errors"]), file=sys.stderr)
        return 1
    return 0
