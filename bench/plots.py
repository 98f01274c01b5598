"""Plots (matplotlib, Agg backend, PNG): hit-ratio curves and throughput bars.

``hit_ratio_<trace>.png``  memory-tier hit ratio against memory size (0.5% ..
    20% of the unique keys of the replayed requests) for page sizes 1, 4, 16,
    64 (durablekv's page-LRU, :func:`bench.sim.page_lru`, checked against
    durablekv itself by the macro case), with the entry-level LRU (an
    OrderedDict), entry-level W-TinyLFU, ``policy="tinylfu"`` per page
    size (dotted, :func:`bench.sim.page_tinylfu`) and Belady's OPT (:func:`bench.sim.opt`).
``throughput_micro.png``   operations/s per implementation: get hit, set,
    90/10 mix (100-byte values), from the micro results.
``throughput_replay.png``  requests/s of the look-aside replays with the
    memory tier at 10%, from the macro results.
"""

from __future__ import annotations

import os
import time
from typing import Any

from . import sim
from .macro import TRACE_FILES
from .util import TRACES, Settings, note



def _save(fig: Any, out_dir: str, name: str) -> str:
    """Lay out, write ``out_dir/name`` as PNG, free the figure; return the path."""
    import matplotlib.pyplot as plt
    fig.tight_layout()
    path = os.path.join(out_dir, name)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path

def hit_ratio_curves(cfg: Settings) -> dict[str, Any]:
    out = {}
    for name in TRACE_FILES:
        path = TRACES / name
        if not path.exists():
            continue
        t0 = time.perf_counter()
        req = sim.load(path, cfg.plot_prefix)
        c = sim.curves(req, cfg.plot_fractions, cfg.plot_page_sizes,
                       getattr(cfg, "plot_rehome", ()))
        c.update(requests=len(req.ops), gets=req.gets, unique_keys=req.unique,
                 whole_trace=req.whole)
        if cfg.plot_page_sizes and 1 in cfg.plot_page_sizes:
            c["page_size_1_equals_lru"] = c["page_lru"]["1"] == c["lru"]
        out[name] = c
        note(f"plots: hit-ratio curves of {name} ({len(req.ops):,} requests) in "
             f"{time.perf_counter() - t0:.1f} s")
    return out


def _plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def draw(results: dict[str, Any], curves: dict[str, Any], out_dir: str) -> list[str]:
    """Write every PNG for which there are results; return the file paths."""
    try:
        plt = _plt()
    except ImportError:
        note("plots: matplotlib is not installed; no PNG written")
        return []
    os.makedirs(out_dir, exist_ok=True)
    files = []
    for name, c in curves.items():
        fig, ax = plt.subplots(figsize=(7, 4.5))
        xs = [100 * f for f in c["fractions"]]
        ax.plot(xs, c["opt"], "k--", label="OPT (Belady)", linewidth=1.5)
        ax.plot(xs, c["lru"], color="0.55", linewidth=4, alpha=0.6, label="LRU (OrderedDict)")
        if c.get("tinylfu"):
            ax.plot(xs, c["tinylfu"], color="tab:red", linewidth=3, alpha=0.5,
                    label="W-TinyLFU (entries)")
        markers = "osd^v<>"
        for i, (ps, ys) in enumerate(c["page_lru"].items()):
            line, = ax.plot(xs, ys, marker=markers[i % len(markers)], linewidth=1.2,
                            label=f"durablekv page_size={ps} lru")
            tl = c.get("page_tinylfu", {}).get(ps)
            if tl:
                ax.plot(xs, tl, marker=markers[i % len(markers)], linestyle=":",
                        color=line.get_color(), linewidth=1.2,
                        label=f"durablekv page_size={ps} tinylfu")
        for ps, ys in c.get("page_rehome", {}).items():
            if ys:
                ax.plot(xs, ys, marker="x", linestyle="-.", linewidth=1.0,
                        label=f"page_size={ps} lru + re-homing (simulated)")
        for ps, ys in c.get("page_midpoint", {}).items():
            if ys:
                ax.plot(xs, ys, marker="*", linestyle="--", linewidth=1.0,
                        label=f"page_size={ps} midpoint (simulated)")
        for ps, t in c.get("tier_midpoint", {}).items():
            if t.get("fractions"):
                ax.plot([100 * f for f in t["fractions"]], t["memory_hit_ratio"],
                        linestyle="none", marker="P", markersize=9, color="tab:green",
                        label=f"durablekv page_size={ps} midpoint (the tier, run)")
        ax.set_xscale("log")
        ax.set_xticks(xs)
        ax.set_xticklabels([f"{x:g}%" for x in xs])
        ax.set_xlabel("memory tier size (% of unique keys)")
        ax.set_ylabel("memory hit ratio (hits / gets)")
        scope = "whole trace" if c["whole_trace"] else f"first {c['requests']:,} requests"
        ax.set_title(f"{name} — {scope}, {c['unique_keys']:,} unique keys", fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8, loc="lower right")
        files.append(_save(fig, out_dir, f"hit_ratio_{name.split('.')[0]}.png"))

    micro = [r for r in results.get("micro", []) if r.get("value_bytes") == 100]
    if micro:
        cases = [("get_hit_memory", "get hit"), ("set", "set"), ("mix_90_10", "90/10 mix")]
        names: list[str] = []
        for r in micro:
            if r["case"] in ("get_hit_memory", "set", "mix_90_10") and r["name"] not in names:
                names.append(r["name"])
        names.sort(key=lambda nm: not nm.startswith("durablekv"))  # durablekv first, stable
        fig, ax = plt.subplots(figsize=(8, 0.42 * len(names) * len(cases) / 2 + 2))
        h = 0.8 / len(cases)
        for j, (case, label) in enumerate(cases):
            vals = []
            for nm in names:
                row = next((r for r in micro if r["case"] == case and r["name"] == nm), None)
                vals.append(1e9 / row["median"] if row else 0)
            ys = [i + j * h for i in range(len(names))]
            ax.barh(ys, vals, height=h, label=label)
        ax.set_yticks([i + h for i in range(len(names))])
        ax.set_yticklabels(names, fontsize=8)
        ax.invert_yaxis()
        ax.set_xscale("log")
        ax.set_xlabel("operations per second, one thread (log scale; median)")
        ax.set_title("Micro: 16-byte keys, 100-byte values", fontsize=10)
        ax.grid(True, axis="x", which="both", alpha=0.3)
        ax.legend(fontsize=8)
        files.append(_save(fig, out_dir, "throughput_micro.png"))

    macro = [r for r in results.get("macro", []) if r.get("fraction") in (0.10, None)]
    if macro:
        traces = list(dict.fromkeys(r["trace"] for r in macro))
        impls = list(dict.fromkeys(r["name"] for r in macro))
        fig, ax = plt.subplots(figsize=(8, 4.5))
        w = 0.8 / len(impls)
        for j, nm in enumerate(impls):
            vals = []
            for t in traces:
                row = next((r for r in macro if r["trace"] == t and r["name"] == nm), None)
                vals.append(row["median"] if row else 0)
            ax.bar([i + j * w for i in range(len(traces))], vals, width=w, label=nm)
        ax.set_xticks([i + w * (len(impls) - 1) / 2 for i in range(len(traces))])
        ax.set_xticklabels([t.split(".")[0] for t in traces], fontsize=8)
        ax.set_yscale("log")
        ax.set_ylabel("requests per second (log scale; median)")
        ax.set_title("Look-aside replay, memory tier at 10% of the unique keys", fontsize=10)
        ax.grid(True, axis="y", which="both", alpha=0.3)
        ax.legend(fontsize=8)
        files.append(_save(fig, out_dir, "throughput_replay.png"))
    return files
