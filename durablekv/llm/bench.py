"""``durablekv llm-bench``: multi-turn chats through the paged KV cache, side by side.

Workload (seeded): ``conversations`` chats, each with ``turns`` turns and one
of ``system_prompts`` shared system prompts. Turn ``k``'s prompt is the whole
history (system prompt, earlier user messages and the model's replies) plus
a new user message; its output length is drawn uniformly from
``output_len * [1 - spread, 1 + spread]`` (``spread`` = 0: all equal). Chats
are closed-loop clients: ``concurrency`` turns are in flight at once; when a
turn finishes, its chat goes to the back of the queue of chats waiting to
send their next turn, so many other turns run between two turns of one chat
(and a small pool has evicted its history by then: the durable tier's case).

Every configuration runs the same requests, and, decoding greedily, must
produce the same tokens; the report says whether it did. Times are wall
clock (:func:`time.perf_counter`), so they depend on the machine and its load;
the ratios between configurations measured in one run are what to read.
With ``repeats`` > 1 each configuration runs that many times, interleaved,
and the report gives the median and the spread (min, max).

Configurations (JSON keys):

- ``static`` / ``continuous``: the two schedulers, both with prefix caching in
  memory (as vLLM serves by default), on the same requests; ``continuous``
  is the same configuration as ``prefix_memory``, run separately.
- ``prefix_off`` / ``prefix_memory`` / ``prefix_durable``: continuous batching
  with prefix caching off, in memory only, and with evicted blocks spilling
  to a durablekv Cache; ``prefix_after_restart``: the same workload again in
  a fresh pool over the Cache that ``prefix_durable`` left (closed after
  :meth:`~durablekv.llm.pool.BlockPool.spill_cached`, then reopened).
- ``batching``: continuous, prefix caching in memory, one matmul per step for
  the batch vs one per sequence; and ``decode_micro``, decode steps alone at
  fixed batch sizes, the same comparison without prefill or scheduling.
- ``spread_sweep``: static vs continuous at several output-length spreads.
- ``load_sweep``: static vs continuous at several concurrencies.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections import deque
from dataclasses import asdict, dataclass, replace
from typing import Any, Callable

import numpy as np

from ..cache import Cache
from .engine import LLMEngine
from .kvstore import KVBlockStore
from .model import Segment, TinyTransformer
from .scheduler import ContinuousScheduler, Request, StaticScheduler

__all__ = ["Workload", "BenchConfig", "run_workload", "run_bench", "batching_micro",
           "render_markdown", "main"]


@dataclass(frozen=True)
class Workload:
    """The chat workload (sizes in tokens)."""

    conversations: int = 48
    turns: int = 4
    system_prompts: int = 4
    system_len: int = 96
    user_len: int = 24
    output_len: int = 48
    spread: float = 0.5
    concurrency: int = 8
    seed: int = 0


@dataclass(frozen=True)
class BenchConfig:
    """Model and engine sizes."""

    vocab_size: int = 512
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    block_size: int = 16
    num_blocks: int = 160
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 512


class Chat:
    """One conversation: its fixed inputs and its history so far."""

    def __init__(self, cid: int, system: list[int], users: list[list[int]], outs: list[int]):
        self.cid, self.system, self.users, self.outs = cid, system, users, outs
        self.history = list(system)
        self.turn = 0

    def next_request(self, now: float) -> Request:
        prompt = self.history + self.users[self.turn]
        return Request((self.cid, self.turn), prompt, self.outs[self.turn], arrival_time=now)


def make_chats(w: Workload, vocab: int) -> list[Chat]:
    rng = np.random.default_rng(w.seed)
    systems = [rng.integers(0, vocab, w.system_len).tolist() for _ in range(w.system_prompts)]
    chats = []
    lo = max(1, round(w.output_len * (1 - w.spread)))
    hi = max(lo, round(w.output_len * (1 + w.spread)))
    for c in range(w.conversations):
        system = systems[int(rng.integers(0, w.system_prompts))]
        users = [rng.integers(0, vocab, max(1, int(rng.integers(w.user_len // 2,
                                                                   w.user_len * 3 // 2 + 1))))
                 .tolist() for _ in range(w.turns)]
        outs = [int(rng.integers(lo, hi + 1)) for _ in range(w.turns)]
        chats.append(Chat(c, system, users, outs))
    return chats


def output_tokens(w: Workload, vocab: int) -> int:
    return sum(sum(c.outs) for c in make_chats(w, vocab))


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return 0.0
    return float(np.percentile(np.asarray(xs), q * 100, method="higher"))


def run_workload(w: Workload, cfg: BenchConfig, *, scheduler: str = "continuous",
                 prefix: str = "off", cache: Cache | None = None, batched: bool = True,
                 on_tokens: Callable[[int], None] | None = None) -> dict[str, Any]:
    """Run the chats once; return the measurements (wall clock).

    :param scheduler: ``"continuous"`` or ``"static"``.
    :param prefix: ``"off"``, ``"memory"`` or ``"durable"`` (needs ``cache``).
    :param cache: the durablekv Cache of the durable tier.
    """
    model = TinyTransformer(vocab_size=cfg.vocab_size, num_layers=cfg.num_layers,
                            num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads,
                            head_dim=cfg.head_dim, seed=w.seed, batched=batched)
    store = KVBlockStore(cache) if prefix == "durable" else None
    pool = model.make_pool(cfg.num_blocks, cfg.block_size, enable_prefix_caching=prefix != "off",
                           store=store)
    cls = StaticScheduler if scheduler == "static" else ContinuousScheduler
    sched = cls(pool, max_num_seqs=cfg.max_num_seqs,
                max_num_batched_tokens=cfg.max_num_batched_tokens)
    clock = time.perf_counter
    engine = LLMEngine(model, pool, sched, clock=clock)
    chats = make_chats(w, cfg.vocab_size)
    ready = deque(chats)
    in_flight = 0
    seqs = []
    usage = []
    start = clock()
    while ready or in_flight:
        while ready and in_flight < w.concurrency:
            chat = ready.popleft()
            seqs.append((chat, engine.add_request(chat.next_request(clock()))))
            in_flight += 1
        finished = engine.step()
        usage.append(pool.stats().usage)
        for seq in finished:
            in_flight -= 1
            chat = chats[seq.request.request_id[0]]
            chat.history = list(seq.token_ids)
            chat.turn += 1
            if chat.turn < w.turns:
                ready.append(chat)
            if on_tokens:
                on_tokens(len(seq.output_token_ids))
    wall = clock() - start
    ttft = [s.first_token_time - s.request.arrival_time for _, s in seqs]
    tpot = [(s.finish_time - s.first_token_time) / (len(s.output_token_ids) - 1)
            for _, s in seqs if len(s.output_token_ids) > 1]
    prompt_tokens = sum(s.num_prompt_tokens for _, s in seqs)
    mem = sum(s.cached_tokens_memory for _, s in seqs)
    dur = sum(s.cached_tokens_durable for _, s in seqs)
    out_tokens = sum(len(s.output_token_ids) for _, s in seqs)
    digest = hashlib.sha256()
    for _, s in sorted(seqs, key=lambda cs: cs[1].request.request_id):
        digest.update(np.asarray(s.output_token_ids, dtype=np.int64).tobytes())
    if prefix == "durable":
        pool.spill_cached()          # graceful shutdown: the durable tier keeps every block
    st = pool.stats()
    return {
        "tokens_per_s": out_tokens / wall,
        "ttft_p50_s": _pct(ttft, 0.5), "ttft_p99_s": _pct(ttft, 0.99),
        "tpot_p50_s": _pct(tpot, 0.5), "tpot_p99_s": _pct(tpot, 0.99),
        "prefix_hit_rate": (mem + dur) / prompt_tokens,
        "prefix_hit_rate_memory": mem / prompt_tokens,
        "prefix_hit_rate_durable": dur / prompt_tokens,
        "requests": len(seqs), "output_tokens": out_tokens, "prompt_tokens": prompt_tokens,
        "tokens_computed": model.tokens_computed, "steps": engine.num_steps,
        "mean_batch_size": float(np.mean(engine.batch_sizes)) if engine.batch_sizes else 0.0,
        "preemptions": st.preemptions, "evictions": st.evictions,
        "spilled_blocks": st.spilled_blocks, "written_blocks": st.written_blocks,
        "write_drops": st.write_drops,
        "kv_usage_mean": float(np.mean(usage)) if usage else 0.0,
        "kv_usage_max": float(np.max(usage)) if usage else 0.0,
        "wall_s": wall, "outputs_sha256": digest.hexdigest(),
    }


def batching_micro(cfg: BenchConfig, *, batch_sizes: list[int], steps: int, context: int,
                   repeats: int, seed: int = 0) -> list[dict[str, Any]]:
    """Decode steps alone, at a fixed batch size: one matmul per layer for the
    whole batch vs one per sequence (the same tokens, positions and KV).

    Each sequence first gets a ``context``-token prefill; then ``steps`` decode
    steps run in each mode, alternating, ``repeats`` times.
    """
    model = TinyTransformer(vocab_size=cfg.vocab_size, num_layers=cfg.num_layers,
                            num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads,
                            head_dim=cfg.head_dim, seed=seed)
    rng = np.random.default_rng(seed)
    out = []
    for batch in batch_sizes:
        per_seq_blocks = -(-(context + steps) // cfg.block_size)
        pool = model.make_pool(batch * per_seq_blocks, cfg.block_size,
                               enable_prefix_caching=False)
        for i in range(batch):
            prompt = rng.integers(0, cfg.vocab_size, context).tolist()
            pool.add_sequence(i, prompt)
            pool.allocate_slots(i, 0, context + steps)
            model.forward(pool, [Segment(i, prompt, 0)])
        token = [int(rng.integers(0, cfg.vocab_size))]
        rates: dict[bool, list[float]] = {True: [], False: []}
        for _ in range(repeats):
            for batched in (False, True):
                model.batched = batched
                t0 = time.perf_counter()
                for step in range(steps):
                    model.forward(pool, [Segment(i, token, context + step) for i in range(batch)])
                rates[batched].append(batch * steps / (time.perf_counter() - t0))
        gains = [b / p for b, p in zip(rates[True], rates[False])]
        out.append({"batch_size": batch,
                    "batched_tokens_per_s": statistics.median(rates[True]),
                    "per_sequence_tokens_per_s": statistics.median(rates[False]),
                    "gain": {"median": statistics.median(gains), "min": min(gains),
                             "max": max(gains)}})
    return out


_TIMED = ("tokens_per_s", "ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s", "wall_s")


def _summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Median of each timed value over the repeats (with min/max), the rest from run 1."""
    out = dict(runs[0])
    out["repeats"] = len(runs)
    for key in _TIMED:
        vals = [r[key] for r in runs]
        out[key] = statistics.median(vals)
        out[key + "_min"], out[key + "_max"] = min(vals), max(vals)
    return out


def _ratio(runs_a: list[dict], runs_b: list[dict], key: str = "tokens_per_s") -> dict[str, float]:
    """a/b per repeat (paired: the same repeat ran both), median and spread."""
    vals = [a[key] / b[key] for a, b in zip(runs_a, runs_b)]
    return {"median": statistics.median(vals), "min": min(vals), "max": max(vals)}


def run_bench(*, quick: bool = False, repeats: int | None = None, spread: float | None = None,
              seed: int = 0, workdir: str | None = None, progress: bool = False,
              plots_dir: str | None = None) -> dict[str, Any]:
    """Run every configuration (see the module docstring); return the report."""
    from tqdm import tqdm

    if quick:
        w = Workload(conversations=8, turns=2, system_prompts=2, system_len=32, user_len=12,
                     output_len=12, concurrency=4, seed=seed)
        cfg = BenchConfig(vocab_size=256, num_heads=2, num_kv_heads=1, head_dim=8,
                          block_size=8, num_blocks=40, max_num_seqs=8,
                          max_num_batched_tokens=256)
        repeats = repeats or 1
        spreads, loads = [0.0, 0.9], [2, 4]
    else:
        w = Workload(seed=seed)
        cfg = BenchConfig()
        repeats = repeats or 3
        spreads, loads = [0.0, 0.25, 0.5, 0.75, 1.0], [1, 2, 4, 8, 16]
    if spread is not None:
        w = replace(w, spread=spread)
    plan: list[tuple[str, Workload, dict]] = []
    mem = {"prefix": "memory"}
    for _ in range(repeats):          # interleaved: machine noise hits every configuration
        plan += [("static", w, {"scheduler": "static", **mem}), ("continuous", w, mem),
                 ("per_seq", w, {"batched": False, **mem}), ("prefix_off", w, {}),
                 ("prefix_memory", w, mem),
                 ("prefix_durable", w, {"prefix": "durable"}),
                 ("prefix_after_restart", w, {"prefix": "durable"})]
        for s in spreads:
            sw = replace(w, spread=s)
            plan += [(f"spread:{s}:static", sw, {"scheduler": "static", **mem}),
                     (f"spread:{s}:continuous", sw, mem)]
        for c in loads:
            lw = replace(w, concurrency=c)
            plan += [(f"load:{c}:static", lw, {"scheduler": "static", **mem}),
                     (f"load:{c}:continuous", lw, mem)]
    total = sum(output_tokens(pw, cfg.vocab_size) for _, pw, _ in plan)
    tmp = tempfile.mkdtemp(prefix="durablekv-llm-bench-", dir=workdir)
    results: dict[str, list[dict]] = {}
    bar = tqdm(total=total, unit="tok", desc="llm-bench", disable=not progress, file=sys.stderr)
    try:
        cache_dir = None
        for i, (name, pw, kw) in enumerate(plan):
            bar.set_postfix_str(name)
            if name == "prefix_durable":
                cache_dir = os.path.join(tmp, f"kv-{i}")
            if kw.get("prefix") == "durable":
                with Cache(cache_dir, name="llm-bench") as cache:   # after_restart: reopened
                    res = run_workload(pw, cfg, cache=cache, on_tokens=bar.update, **kw)
            else:
                res = run_workload(pw, cfg, on_tokens=bar.update, **kw)
            results.setdefault(name, []).append(res)
    finally:
        bar.close()
        shutil.rmtree(tmp, ignore_errors=True)

    main_keys = ("static", "continuous", "prefix_off", "prefix_memory", "prefix_durable",
                 "prefix_after_restart")
    report: dict[str, Any] = {k: _summarize(results[k]) for k in main_keys}
    report["batching"] = {
        "batched": _summarize(results["continuous"]),
        "per_sequence": _summarize(results["per_seq"]),
        "gain": _ratio(results["continuous"], results["per_seq"]),
    }
    report["batching"]["decode_micro"] = batching_micro(
        cfg, batch_sizes=[1, 4, 16] if not quick else [1, 4], steps=8 if quick else 32,
        context=cfg.block_size * 4, repeats=repeats, seed=seed)
    report["scheduling_gain"] = _ratio(results["continuous"], results["static"])
    report["prefix_gain"] = {
        "memory_vs_off": _ratio(results["prefix_memory"], results["prefix_off"]),
        "durable_vs_off": _ratio(results["prefix_durable"], results["prefix_off"]),
        "after_restart_vs_off": _ratio(results["prefix_after_restart"], results["prefix_off"]),
    }
    report["spread_sweep"] = [
        {"spread": s, "static": _summarize(results[f"spread:{s}:static"]),
         "continuous": _summarize(results[f"spread:{s}:continuous"]),
         "gain": _ratio(results[f"spread:{s}:continuous"], results[f"spread:{s}:static"])}
        for s in spreads]
    report["load_sweep"] = [
        {"concurrency": c, "static": _summarize(results[f"load:{c}:static"]),
         "continuous": _summarize(results[f"load:{c}:continuous"])} for c in loads]
    digests = {r["outputs_sha256"] for k in ("static", "continuous", "per_seq", "prefix_off",
                                             "prefix_memory", "prefix_durable",
                                             "prefix_after_restart")
               for r in results[k]}
    report["outputs_identical"] = len(digests) == 1
    report["workload"] = asdict(w)
    report["config"] = asdict(cfg)
    report["quick"] = quick
    if plots_dir:
        report["plots"] = plot(report, plots_dir)
    return report


def plot(report: dict[str, Any], directory: str) -> list[str]:
    """Throughput and TTFT vs load; hit rate by tier; gain vs output-length spread (PNGs)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(directory, exist_ok=True)
    paths = []
    loads = report["load_sweep"]
    xs = [p["concurrency"] for p in loads]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for sched, style in (("static", "o--"), ("continuous", "s-")):
        a.plot(xs, [p[sched]["tokens_per_s"] for p in loads], style, label=sched)
        b.plot(xs, [p[sched]["ttft_p50_s"] * 1e3 for p in loads], style, label=f"{sched} p50")
        b.plot(xs, [p[sched]["ttft_p99_s"] * 1e3 for p in loads], style, alpha=0.5,
               label=f"{sched} p99")
    a.set(xlabel="concurrent chats", ylabel="generated tokens/s", title="Throughput vs load")
    b.set(xlabel="concurrent chats", ylabel="TTFT (ms)", title="TTFT vs load", yscale="log")
    for ax in (a, b):
        ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    paths.append(os.path.join(directory, "llm_load.png"))
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    keys = ("prefix_off", "prefix_memory", "prefix_durable", "prefix_after_restart")
    fig, ax = plt.subplots(figsize=(6.5, 4))
    mem = [report[k]["prefix_hit_rate_memory"] for k in keys]
    dur = [report[k]["prefix_hit_rate_durable"] for k in keys]
    labels = ["off", "memory", "memory +\ndurablekv", "after\nrestart"]
    ax.bar(labels, mem, label="memory (block pool)")
    ax.bar(labels, dur, bottom=mem, label="durable (durablekv Cache)")
    ax.set(ylabel="prompt tokens served from cache", ylim=(0, 1), title="Prefix hit rate by tier")
    ax.legend()
    fig.tight_layout()
    paths.append(os.path.join(directory, "llm_hit_rate.png"))
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    sw = report["spread_sweep"]
    fig, ax = plt.subplots(figsize=(6.5, 4))
    ax.errorbar([p["spread"] for p in sw], [p["gain"]["median"] for p in sw],
                yerr=[[p["gain"]["median"] - p["gain"]["min"] for p in sw],
                      [p["gain"]["max"] - p["gain"]["median"] for p in sw]], fmt="o-")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set(xlabel="output length spread (0: all equal)",
           ylabel="continuous / static tokens/s", title="Scheduling gain vs output-length spread")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    paths.append(os.path.join(directory, "llm_spread.png"))
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    return paths


def render_markdown(r: dict[str, Any]) -> str:
    """The report's headline tables in Markdown (docs/llm.md quotes this output)."""
    def span(x: dict, key: str, scale: float = 1.0, fmt: str = "{:.0f}") -> str:
        if x.get("repeats", 1) == 1:
            return fmt.format(x[key] * scale)
        return (fmt.format(x[key] * scale) + " (" + fmt.format(x[key + "_min"] * scale) + ".."
                + fmt.format(x[key + "_max"] * scale) + ")")

    def gain(g: dict) -> str:
        return f"{g['median']:.2f}x ({g['min']:.2f}..{g['max']:.2f})"

    lines = ["| configuration | tokens/s | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | "
             "TPOT p99 ms | hit rate (memory + durable) | preemptions | KV use mean/max |",
             "|---|---|---|---|---|---|---|---|---|"]
    for k in ("static", "continuous", "prefix_off", "prefix_memory", "prefix_durable",
              "prefix_after_restart"):
        x = r[k]
        lines.append(
            f"| `{k}` | {span(x, 'tokens_per_s')} | {span(x, 'ttft_p50_s', 1e3, '{:.1f}')} | "
            f"{span(x, 'ttft_p99_s', 1e3, '{:.1f}')} | {span(x, 'tpot_p50_s', 1e3, '{:.2f}')} | "
            f"{span(x, 'tpot_p99_s', 1e3, '{:.2f}')} | {x['prefix_hit_rate']:.1%} "
            f"({x['prefix_hit_rate_memory']:.1%} + {x['prefix_hit_rate_durable']:.1%}) | "
            f"{x['preemptions']} | {x['kv_usage_mean']:.0%} / {x['kv_usage_max']:.0%} |")
    lines += ["", "| ratio (median of per-repeat ratios, min..max) | tokens/s |", "|---|---|",
              f"| batching: one matmul for the batch / one per sequence (whole workload) | "
              f"{gain(r['batching']['gain'])} |"]
    for p in r["batching"]["decode_micro"]:
        lines.append(f"| batching, decode steps only, batch {p['batch_size']} | "
                     f"{gain(p['gain'])} |")
    lines.append(f"| scheduling: continuous / static | {gain(r['scheduling_gain'])} |")
    for name in ("memory_vs_off", "durable_vs_off", "after_restart_vs_off"):
        g = r["prefix_gain"][name]
        lines.append(f"| prefix caching: {name.replace('_', ' ')} | {gain(g)} |")
    for p in r["spread_sweep"]:
        lines.append(f"| continuous / static at output spread {p['spread']:.2f} | "
                     f"{gain(p['gain'])} |")
    ttft = [f"{p['concurrency']}: {p['static']['ttft_p50_s'] * 1e3:.0f} / "
            f"{p['continuous']['ttft_p50_s'] * 1e3:.0f}" for p in r["load_sweep"]]
    lines += ["", "TTFT p50 ms static / continuous by concurrent chats: " + "; ".join(ttft) + ".",
              f"Identical tokens in every configuration: {r['outputs_identical']}."]
    return "\n".join(lines) + "\n"


def _print_report(r: dict[str, Any], out=None) -> None:
    out = out or sys.stdout

    def row(name: str, x: dict) -> None:
        print(f"  {name:22s} {x['tokens_per_s']:9.0f} tok/s  TTFT p50 {x['ttft_p50_s']*1e3:8.1f}"
              f" ms p99 {x['ttft_p99_s']*1e3:8.1f} ms  TPOT p50 {x['tpot_p50_s']*1e3:6.2f} ms"
              f" p99 {x['tpot_p99_s']*1e3:6.2f} ms  hit {x['prefix_hit_rate']:5.1%}"
              f" (mem {x['prefix_hit_rate_memory']:5.1%}, durable"
              f" {x['prefix_hit_rate_durable']:5.1%})  preempt {x['preemptions']:3d}"
              f"  KV use {x['kv_usage_mean']:4.0%}/{x['kv_usage_max']:4.0%}", file=out)

    def gain(g: dict) -> str:
        return f"{g['median']:.2f}x (min {g['min']:.2f}, max {g['max']:.2f})"

    reps = r["static"]["repeats"]
    print(f"llm-bench ({'quick' if r['quick'] else 'full'}; medians of {reps} run(s))", file=out)
    for k in ("static", "continuous", "prefix_off", "prefix_memory", "prefix_durable",
              "prefix_after_restart"):
        row(k, r[k])
    print(f"  batching gain (one matmul for the batch vs one per sequence): "
          f"{gain(r['batching']['gain'])}", file=out)
    for p in r["batching"]["decode_micro"]:
        print(f"    decode only, batch {p['batch_size']:2d}: batched "
              f"{p['batched_tokens_per_s']:7.0f} tok/s, per sequence "
              f"{p['per_sequence_tokens_per_s']:7.0f} tok/s: {gain(p['gain'])}", file=out)
    print(f"  scheduling gain (continuous vs static, same requests): "
          f"{gain(r['scheduling_gain'])}", file=out)
    for name, g in r["prefix_gain"].items():
        print(f"  prefix caching {name.replace('_', ' ')}: {gain(g)}", file=out)
    print("  output-length spread sweep, continuous/static tokens/s:", file=out)
    for p in r["spread_sweep"]:
        print(f"    spread {p['spread']:.2f}: {gain(p['gain'])}", file=out)
    print("  load sweep (concurrent chats): tokens/s static / continuous, TTFT p50 ms", file=out)
    for p in r["load_sweep"]:
        s, c = p["static"], p["continuous"]
        print(f"    {p['concurrency']:3d}: {s['tokens_per_s']:7.0f} / {c['tokens_per_s']:7.0f}"
              f"   {s['ttft_p50_s']*1e3:7.1f} / {c['ttft_p50_s']*1e3:7.1f}", file=out)
    print(f"  identical tokens in every configuration: {r['outputs_identical']}", file=out)


def main(args: argparse.Namespace) -> int:
    """The ``durablekv llm-bench`` command (arguments from :mod:`durablekv.cli`)."""
    progress = sys.stderr.isatty() if args.progress is None else args.progress
    plots = args.plots   # only where asked: a run never overwrites committed plots by default
    # Refuse what would fail after minutes of work, before any of it.
    if args.plots is not None and importlib.util.find_spec("matplotlib") is None:
        print(f"durablekv: llm-bench --plots {args.plots} needs matplotlib, which is not "
              "installed: pip install '.[bench]', or leave out --plots", file=sys.stderr)
        return 2
    for what, path in (("--json", args.json and os.path.dirname(os.path.abspath(args.json))),
                       ("--plots", plots)):
        if path and not (os.path.isdir(path) and os.access(path, os.W_OK)):
            if what == "--plots" and not os.path.exists(path):
                continue  # made by plot()
            print(f"durablekv: llm-bench {what}: {path!r} is not a writable directory; "
                  f"pass {what} a path in one", file=sys.stderr)
            return 2
    if args.quick:
        print("durablekv: llm-bench --quick: one tiny run of each configuration, to check that "
              "everything runs; its ratios are noise (docs/llm.md has a full run's)",
              file=sys.stderr)
    report = run_bench(quick=args.quick, repeats=args.repeats, spread=args.output_spread,
                       seed=args.seed, progress=progress, plots_dir=plots)
    _print_report(report)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=2, sort_keys=True)
            f.write("\n")
    return 0 if report["outputs_identical"] else 1
