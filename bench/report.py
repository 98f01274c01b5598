"""Targets, the markdown table and docs/performance.md — all from the results JSON.

Nothing here holds a measured number: every figure is read from the results
dictionary that :mod:`bench.cli` writes, so regenerating the bench
regenerates the documents.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Iterable

from .impls import SETTINGS
from .util import fmt_ns, fmt_rate

VSIZE = {100: "100 B", 4096: "4 KiB"}


def _find(rows: Iterable[dict[str, Any]], **want: Any) -> dict[str, Any] | None:
    for r in rows:
        if all(r.get(k) == v for k, v in want.items()):
            return r
    return None


def _target(tid: str, text: str, goal: str, measured: str, ratio: float | None,
            ok: Callable[[float], bool], detail: str = "") -> dict[str, Any]:
    return {"id": tid, "target": text, "goal": goal, "measured": measured,
            "ratio": ratio, "met": (ok(ratio) if ratio is not None else None), "detail": detail}


def _versus(rows: Iterable[dict[str, Any]], tid: str, text: str, goal: str,
            ok: Callable[[float], bool], measured: Callable[[dict, dict], str],
            mine: dict[str, Any], theirs: dict[str, Any], speedup: bool = False) -> dict[str, Any]:
    """A target comparing durablekv's row ``mine`` with the row ``theirs``:
    ratio = median / their median, or their median / ours with ``speedup``."""
    rows = list(rows)
    d, a = _find(rows, **mine), _find(rows, **theirs)
    if not (d and a):
        return _target(tid, text, goal, "not measured", None, ok)
    ratio = a["median"] / d["median"] if speedup else d["median"] / a["median"]
    t = _target(tid, text, goal, measured(d, a), ratio, ok)
    # the fallback's twin of durablekv's row (impl + "-pure"), same run
    p = _find(rows, **dict(mine, impl=mine["impl"] + "-pure")) if "impl" in mine else None
    if p:
        t["ratio_pure"] = a["median"] / p["median"] if speedup else p["median"] / a["median"]
        t["met_pure"] = ok(t["ratio_pure"])
        t["measured_pure"] = measured(p, a)
    return t


def targets(res: dict[str, Any]) -> list[dict[str, Any]]:
    """Every target of issue 5 with its measured ratio (None when not measured)."""
    micro = res.get("micro", [])
    out = []
    def ns(d: dict[str, Any], a: dict[str, Any]) -> str:
        return f"{fmt_ns(d['median'])} vs {fmt_ns(a['median'])}"

    for vb in (100, 4096):
        at = {"value_bytes": vb}
        out.append(_versus(
            micro, f"memory-get-{vb}", f"memory get hit ({VSIZE[vb]}) vs cachetools.LRUCache get hit",
            "<= 1.0x the time", lambda x: x <= 1.0, ns,
            dict(case="get_hit_memory", impl="durablekv-log", **at),
            dict(case="get_hit_memory", impl="cachetools", **at)))
    for vb in (100, 4096):
        at = {"value_bytes": vb}
        out.append(_versus(
            micro, f"set-log-vs-diskcache-{vb}",
            f"set, durability='log' ({VSIZE[vb]}), speed-up over diskcache.Cache.set",
            ">= 30x faster", lambda x: x >= 30.0, ns,
            dict(case="set", impl="durablekv-log", **at), dict(case="set", impl="diskcache", **at),
            speedup=True))
        out.append(_versus(
            micro, f"set-log-vs-odict-{vb}",
            f"set, durability='log' ({VSIZE[vb]}) vs an OrderedDict LRU set",
            "<= 3x the time", lambda x: x <= 3.0, ns,
            dict(case="set", impl="durablekv-log", **at), dict(case="set", impl="odict-lru", **at)))
    for vb in (100, 4096):
        at = {"value_bytes": vb}

        def faults(d: dict[str, Any], a: dict[str, Any]) -> str:
            rate = (f", {100 * d['page_fault_rate']:.0f}% page faults"
                    if "page_fault_rate" in d else "")
            return ns(d, a) + rate
        out.append(_versus(
            micro, f"store-get-{vb}", f"store get hit, page fault, page_size=16 ({VSIZE[vb]}) vs "
            "diskcache.Cache get hit", "<= 1.0x the time", lambda x: x <= 1.0, faults,
            dict(case="get_hit_store", impl="durablekv-store-ps16", **at),
            dict(case="get_hit_store", impl="diskcache", **at)))
    out.append(_versus(
        res.get("sustained", []), "sustained", "sustained unique-key sets (log) vs raw SQLite "
        "executemany, 1000-row transactions (rate incl. the final drain)", ">= 0.7x the rate",
        lambda x: x >= 0.7,
        lambda d, a: f"{fmt_rate(d['median'])}/s vs {fmt_rate(a['median'])}/s",
        dict(impl="durablekv"), dict(impl="sqlite")))
    for impl, label in (("durablekv-ps16", "page_size=16"), ("durablekv-ps1", "page_size=1")):
        at = {"trace": "cache2k_orm-busy.i32be", "fraction": 0.10}
        out.append(_versus(
            res.get("macro", []), f"replay-orm-busy-{impl}",
            f"replay of cache2k_orm-busy, memory at 10% ({label}) vs the same replay through "
            "cachetools.LRUCache", ">= 0.8x the throughput", lambda x: x >= 0.8,
            lambda d, a: f"{fmt_rate(d['median'])} vs {fmt_rate(a['median'])} requests/s",
            dict(impl=impl, **at), dict(impl="cachetools", **at)))
    reopen = [r for r in res.get("restart", []) if r.get("case") == "reopen"]
    for temp in ("hot", "cold"):
        rows = [r for r in reopen if r["page_cache"] == temp]
        worst = max(rows, key=lambda r: r["median"]) if rows else None
        out.append(_target(
            f"reopen-{temp}", f"reopen after a clean close ({temp} OS page cache), worst store "
            "size", "< 50 ms at every size",
            ", ".join(f"{r['entries']:,}: {r['median']:.1f} ms" for r in rows) or "not measured",
            worst["median"] / 50.0 if worst else None, lambda x: x < 1.0,
            "ratio = worst median / 50 ms"))
    rec = _find(res.get("restart", []), case="recovery")
    out.append(_target(
        "recovery", "crash recovery of un-checkpointed log records after SIGKILL",
        ">= 500k records/s",
        f"{rec['records']:,} records in {rec['open_seconds']['median']:.2f} s = "
        f"{fmt_rate(rec['median'])} records/s" if rec else "not measured",
        rec["median"] / 500_000 if rec else None, lambda x: x >= 1.0,
        "ratio = measured rate / 500k/s"))
    pure = _find(res.get("restart", []), case="recovery-pure")
    if pure:
        out[-1].update(ratio_pure=pure["median"] / 500_000, met_pure=pure["median"] >= 500_000,
                       measured_pure=f"{fmt_rate(pure['median'])} records/s")
    mem = res.get("memory", [])
    a = _find(mem, impl="cachetools")
    for impl in ("durablekv-ps16", "durablekv-ps16-overwritten", "durablekv-ps1"):
        d = _find(mem, impl=impl)
        ratio = d["median"] / a["median"] if d and a else None
        out.append(_target(
            f"memory-{impl}", f"bytes per resident entry, {d['name'] if d else impl} vs "
            "cachetools.LRUCache", "<= 1.5x",
            f"{d['median']:.0f} vs {a['median']:.0f} bytes" if ratio else "not measured",
            ratio, lambda x: x <= 1.5))
    return out


# -- markdown ----------------------------------------------------------------------------

def _spread(r: dict[str, Any], fmt: Callable[[float], str]) -> str:
    if r.get("n", 0) < 2:
        return fmt(r["median"])
    return f"{fmt(r['median'])} ({fmt(r['min'])} – {fmt(r['max'])})"


def _ratio(x: float | None) -> str:
    if x is None:
        return "–"
    return f"{x:.2f}x" if x < 100 else f"{x:.0f}x"


CASE_TITLES = {
    "get_hit_memory": "get, hit in memory",
    "get_hit_store": "get, hit in the store (durablekv: page fault)",
    "get_miss": "get, miss",
    "set": "set (overwrite), one thread",
    "set_threads": "set (overwrite), {threads} threads, wall time per op",
    "delete": "delete",
    "mix_90_10": "90% get / 10% set",
}
ANCHOR_NAMES = {"cachetools": "cachetools.LRUCache", "diskcache": "diskcache.Cache"}


def _micro_md(res: dict[str, Any]) -> list[str]:
    from .micro import ANCHORS, CASES
    micro = res.get("micro", [])
    if not micro:
        return []
    sizes = sorted({r["value_bytes"] for r in micro})
    lines = ["## Micro: time per operation", "",
             f"{res['settings']['keys']:,} keys of 16 bytes (str), bytes values. Median over "
             f"{res['settings']['repeat']} repetitions (min – max); in each repetition the "
             "implementations take turns. Ratio: median / the anchor's median in the same "
             "case (below 1 is faster than the anchor). *with drain*: the time per operation "
             "when the background work left after the run (durablekv's write-behind flush, "
             "sqlitedict's queued writes) is counted too; shown where it adds over 5%.", ""]
    threads = max((r.get("threads", 1) for r in micro), default=1)
    for case in CASES:
        rows = [r for r in micro if r["case"] == case]
        if not rows:
            continue
        anchor = ANCHORS[case]
        lines += [f"### {CASE_TITLES[case].format(threads=threads)}", "",
                  "| implementation | " + " | ".join(
                      f"{VSIZE.get(s, s)}: time/op | ops/s" for s in sizes)
                  + f" | ratio to {ANCHOR_NAMES.get(anchor, anchor)} |",
                  "|---|" + "---:|---:|" * len(sizes) + "---:|"]
        names = list(dict.fromkeys(r["impl"] for r in rows))
        for impl in names:
            cells = []
            ratios = []
            name = next(r["name"] for r in rows if r["impl"] == impl)
            note = ""
            for s in sizes:
                r = _find(rows, impl=impl, value_bytes=s)
                a = _find(rows, impl=anchor, value_bytes=s)
                if r is None:
                    cells += ["–", "–"]
                    continue
                cell = _spread(r, fmt_ns)
                wd = r.get("with_drain", {}).get("median")
                if wd and wd > 1.05 * r["median"]:
                    cell += f"<br>with drain: {fmt_ns(wd)}"
                cells += [cell, fmt_rate(1e9 / r["median"])]
                ratios.append(_ratio(r["median"] / a["median"]) if a else "–")
                if "page_fault_rate" in r and case == "get_hit_store" \
                        and impl.startswith("durablekv"):
                    note = f" — {100 * r['page_fault_rate']:.0f}% faults"
                failed = r.get("counters", {}).get("failed_sets")
                if failed:
                    note = f" — {failed:,} sets failed (timeout)"
            lines.append(f"| {name}{note} | " + " | ".join(cells) + " | " + " / ".join(ratios) + " |")
        lines.append("")
    return lines


def _sustained_md(res: dict[str, Any]) -> list[str]:
    rows = res.get("sustained", [])
    if not rows:
        return []
    r0 = rows[0]
    lines = ["## Sustained unique-key sets", "",
             f"{r0['seconds']:g} s of sets of new 16-byte keys with {r0['value_bytes']}-byte values, "
             "each run in its own process; the rate counts the final drain (everything in "
             "SQLite). Median (min – max) over runs.", "",
             "| implementation | sets/s incl. drain | sets/s while writing | drain | peak RSS |",
             "|---|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['name']} | {_spread(r, fmt_rate)} | "
                     f"{_spread(r['write_phase_rate'], fmt_rate)} | "
                     f"{r['drain_seconds']['median']:.2f} s | "
                     f"{r['peak_rss_mib']['median']:.0f} MiB |")
    return lines + [""]


def _macro_md(res: dict[str, Any]) -> list[str]:
    rows = res.get("macro", [])
    if not rows:
        return []
    lines = ["## Macro: look-aside replay of real traces", "",
             "A get that misses is followed by a set. Memory = the memory tier as a share of "
             "the unique keys of the replayed requests. durablekv keeps every key in SQLite, "
             "so its hits are split into memory and store (page fault) hits. *exact*: the "
             "memory hits equal the simulated page-LRU (page_size=1: the entry LRU).", ""]
    for trace in dict.fromkeys(r["trace"] for r in rows):
        tr = [r for r in rows if r["trace"] == trace]
        t0 = tr[0]
        scope = "whole trace" if t0["whole_trace"] else f"first {t0['requests']:,} requests"
        cap = f"; values capped at {t0['value_cap']} B" if t0.get("value_cap") else ""
        lines += [f"### {trace} ({scope}, {t0['unique_keys']:,} unique keys{cap})", "",
                  "| implementation | memory | requests/s | hit ratio: memory | store | overall | exact |",
                  "|---|---:|---:|---:|---:|---:|:---:|"]
        for r in tr:
            mem = f"{100 * r['fraction']:g}% ({r['slots']:,})" if r["fraction"] else "unbounded"
            if "memory_hit_ratio" in r:
                hr = (f"{r['memory_hit_ratio']:.4f} | {r['store_hit_ratio']:.4f} | "
                      f"{r['hit_ratio']:.4f}")
            else:
                hr = f"{r['hit_ratio']:.4f} | – | {r['hit_ratio']:.4f}"
            exact = {True: "yes", False: "**no**"}.get(r.get("exact"), "–")
            lines.append(f"| {r['name']} | {mem} | {_spread(r, fmt_rate)} | {hr} | {exact} |")
        lines.append("")
    return lines


def _restart_md(res: dict[str, Any]) -> list[str]:
    rows = res.get("restart", [])
    if not rows:
        return []
    lines = ["## Restart", "", "Reopen after a clean close: `Cache(dir)` wall time, median "
             "(min – max); *cold* = files fsynced and dropped from the OS page cache first.", "",
             "| entries | store size | reopen, hot | reopen, cold | first get after a cold open |",
             "|---:|---:|---:|---:|---:|"]
    for n in dict.fromkeys(r["entries"] for r in rows if r["case"] == "reopen"):
        hot = _find(rows, case="reopen", entries=n, page_cache="hot")
        cold = _find(rows, case="reopen", entries=n, page_cache="cold")
        ms = lambda x: f"{x:.1f} ms"  # noqa: E731
        lines.append(f"| {n:,} | {hot['store_bytes'] / 1e6:.1f} MB | {_spread(hot, ms)} | "
                     f"{_spread(cold, ms)} | {_spread(cold['first_get_ms'], ms)} |")
    rec = _find(rows, case="recovery")
    if rec:
        lines += ["", f"Crash recovery: {rec['records']:,} un-checkpointed `log` records "
                  f"({rec['log_bytes'] / 1e6:.0f} MB of log) after SIGKILL; `Cache(dir)` replays "
                  "them into the memory tier and returns; the write-behind stores the "
                  "rebuilt pages afterwards (the log keeps the records until then).", "",
                  "| kernels | records recovered | open time | records/s | "
                  "recovery_seconds (stats) |",
                  "|---|---:|---:|---:|---:|"]
        for r in (rec, _find(rows, case="recovery-pure")):
            if r:
                lines.append(f"| {r.get('kernels', '?')} | {r['recovered_records'][0]:,} | "
                             f"{_spread(r['open_seconds'], lambda x: f'{x:.2f} s')} | "
                             f"{_spread(r, fmt_rate)} | "
                             f"{r['recovery_seconds_stat']['median']:.2f} s |")
    return lines + [""]


def _memory_md(res: dict[str, Any]) -> list[str]:
    rows = res.get("memory", [])
    if not rows:
        return []
    a = _find(rows, impl="cachetools")
    lines = ["## Memory per resident entry", "",
             f"tracemalloc, {rows[0]['entries']:,} entries (16-byte str keys, 100-byte values "
             "held by the caller, so only the structure is counted).", "",
             "| implementation | bytes per entry | ratio to cachetools.LRUCache |", "|---|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['name']} | {r['median']:.0f} | "
                     f"{_ratio(r['median'] / a['median']) if a else '–'} |")
    return lines + [""]


def _targets_md(res: dict[str, Any]) -> list[str]:
    """The targets table. With the C kernels built, the fallback's columns
    come from its twin runs in the same run (cases without a twin: "–")."""
    rows = res.get("targets", [])
    both = any("ratio_pure" in t for t in rows)
    yes = {True: "yes", False: "**no**", None: "–"}
    if not both:
        lines = ["## Targets", "", "| target | goal | measured | ratio | met |",
                 "|---|---|---|---:|:---:|"]
    else:
        lines = ["## Targets", "",
                 "Fast path: the C kernels (`durablekv._native`); fallback: the same cases "
                 "with the pure-Python kernels, taking turns with the fast path in the same run.",
                 "", "| target | goal | measured (fast path) | ratio | met | measured "
                 "(fallback) | ratio | met |", "|---|---|---|---:|:---:|---|---:|:---:|"]
    for t in rows:
        detail = f" ({t['detail']})" if t.get("detail") else ""
        line = (f"| {t['target']}{detail} | {t['goal']} | {t['measured']} | "
                f"{_ratio(t['ratio'])} | {yes[t['met']]} |")
        if both:
            line += (f" {t.get('measured_pure', '–')} | {_ratio(t.get('ratio_pure'))} | "
                     f"{yes[t.get('met_pure')]} |")
        lines.append(line)
    return lines + [""]


def _machine_md(res: dict[str, Any]) -> list[str]:
    m = res["machine"]
    pk = ", ".join(f"{k} {v}" for k, v in m["packages"].items() if v)
    commit = (m.get("git_commit") or "?")[:12]
    dirty = f" + uncommitted library changes (diff sha256 {m['library_diff_sha256']})" \
        if m.get("library_diff_sha256") else ""
    return [
        "## Machine", "",
        f"- CPU: {m['cpu_model']}, {m['nproc']} CPUs available (nproc)",
        f"- RAM: {m['ram_gib']} GiB; OS: {m['os']}; temp files on {m['tmp_filesystem']}",
        f"- Python {m['python']} ({m['python_implementation']}), SQLite {m['sqlite']}",
        f"- durablekv {m['durablekv']} at commit {commit}{dirty}",
        f"- competitors: {pk}"
        + (f"; {m['redis_server'].split(' sha')[0]}" if m.get("redis_server") else ""),
        "- load average (1 min) at the start of each case: "
        + ", ".join(f"{k} {v['before']:.1f}" for k, v in res.get("load", {}).items())
        + " (other processes share the machine; the interleaving spreads their effect "
        "over all implementations)",
        f"- run: `{res['command']}`, mode {res['settings']['mode']}, "
        f"{res['duration_seconds'] / 60:.1f} min, finished {res['finished_at']}",
        "",
    ]


def _plots_md(res: dict[str, Any], link_base: str) -> list[str]:
    files = res.get("plots", {}).get("files", [])
    if not files:
        return []
    lines = ["## Plots", ""]
    for f in files:
        base = os.path.basename(f)
        lines += [f"![{base}]({link_base}/{base})", ""]
    return lines


def _settings_md(res: dict[str, Any]) -> list[str]:
    lines = ["## How each implementation is set up", ""]
    lines += [f"- **{k}**: {v}" for k, v in res.get("impl_settings", SETTINGS).items()]
    skipped = res.get("skipped", [])
    if skipped:
        lines += ["", "Skipped in this run:", ""] + [f"- {s}" for s in skipped]
    return lines + [""]


def body(res: dict[str, Any], link_base: str, machine_first: bool = False) -> list[str]:
    head = _machine_md(res) + _targets_md(res) if machine_first else _targets_md(res)
    tail = [] if machine_first else _machine_md(res)
    return (head + _micro_md(res) + _sustained_md(res) + _macro_md(res)
            + _restart_md(res) + _memory_md(res) + _plots_md(res, link_base)
            + tail + _settings_md(res))


def table(res: dict[str, Any], path: str, plots_dir: str) -> None:
    link = os.path.relpath(plots_dir, os.path.dirname(os.path.abspath(path)) or ".")
    lines = ["# durablekv benchmark results", "",
             f"Generated by `{res['command']}`; do not edit (rerun the bench).", ""]
    lines += body(res, link)
    _write(path, lines)


REPRODUCE = ("pip install -e '.[bench]' && python -m bench --out docs/bench/results.json "
             "--table docs/bench/results.md --doc docs/performance.md")


def performance_doc(res: dict[str, Any], path: str, plots_dir: str, table_path: str | None,
                    json_path: str | None) -> None:
    here = os.path.dirname(os.path.abspath(path)) or "."
    link = os.path.relpath(plots_dir, here)
    s = res["settings"]
    refs = []
    if table_path:
        refs.append(f"[{os.path.basename(table_path)}]({os.path.relpath(table_path, here)})")
    if json_path:
        refs.append(f"[{os.path.basename(json_path)}]({os.path.relpath(json_path, here)})")
    lines = [
        "# Performance", "",
        "This page is generated by the benchmark suite in `bench/`; every number below comes "
        "from one run of it" + (f" (raw data: {', '.join(refs)})" if refs else "") + ". "
        "To reproduce it (Redis cases need `redis-server` on PATH, e.g. "
        "`apt-get install redis-server`; without it they are skipped):", "",
        "```bash", REPRODUCE, "```", "",
        "## Method", "",
        "- Every case runs durablekv and its competitors in the same process run, interleaved: "
        "within each repetition the implementations take turns, and the one that starts rotates. "
        "Tables show the median and the spread (min – max) over the repetitions "
        f"({s['repeat']} for micro cases, {s['slow_repeat']} for replays, sustained runs and "
        "crash recovery).",
        "- Micro timings run with the cyclic garbage collector paused (as `timeit` does) and "
        "include the Python loop around each call, which is the same for every implementation. "
        "The number of operations per timed run is calibrated so that one run lasts about "
        f"{s['rep_seconds']} s (disk stores and Redis do fewer operations than dict).",
        "- Disk stores use the OS page cache as they would in production; nothing is dropped "
        "between repetitions except in the *cold* reopen case.",
        "- The Redis server runs on the same machine and competes for the same CPUs; its numbers "
        "are round-trip bound.",
        f"- Replays use the first {s['macro_prefix']:,} requests of each trace"
        if s.get("macro_prefix") else "- Replays use whole traces",
        "" if s.get("macro_prefix") is None else
        "  (`--full` replays whole traces; its LRU numbers then match the reference table of "
        "the traces README).",
        "",
    ]
    lines += body(res, link, machine_first=True)
    _write(path, lines)


def _write(path: str, lines: list[str]) -> None:
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    text = "\n".join(lines).rstrip() + "\n"
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
