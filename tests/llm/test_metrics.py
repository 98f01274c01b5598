"""KVPoolCollector: vLLM-style names, parsed back with prometheus_client's own parser."""

from __future__ import annotations

import subprocess
import sys

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from durablekv import Cache
from durablekv.llm.engine import LLMEngine
from durablekv.llm.kvstore import KVBlockStore
from durablekv.llm.metrics import KVPoolCollector
from durablekv.llm.model import TinyTransformer
from durablekv.llm.scheduler import ContinuousScheduler, Request


def samples(registry):
    text = generate_latest(registry).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_metrics_follow_the_pool(tmp_path):
    with Cache(tmp_path / "kv", name="chat") as cache:
        model = TinyTransformer(vocab_size=64, num_heads=2, num_kv_heads=1, head_dim=4)
        pool = model.make_pool(10, 4, store=KVBlockStore(cache))
        registry = CollectorRegistry()
        registry.register(KVPoolCollector(pool))
        sched = ContinuousScheduler(pool, max_num_seqs=4)
        engine = LLMEngine(model, pool, sched)
        system = list(range(8))
        engine.generate([Request(i, system + [10 + i] * 5, 12) for i in range(4)])
        assert pool.flush_writes(timeout=30)  # (the writer thread's count, settled)
        s = samples(registry)
        stats = pool.stats()
        c = (("cache", "chat"),)
        assert s[("durablekv_prefix_cache_queries_total", c)] == stats.prefix_queries_tokens > 0
        assert s[("durablekv_prefix_cache_hits_total", c + (("tier", "memory"),))] == \
            stats.prefix_hits_memory_tokens > 0
        assert s[("durablekv_prefix_cache_hits_total", c + (("tier", "durable"),))] == \
            stats.prefix_hits_durable_tokens
        assert s[("durablekv_num_preemptions_total", c)] == sched.num_preemptions > 0
        assert s[("durablekv_kv_evictions_total", c)] == stats.evictions
        assert s[("durablekv_kv_spilled_blocks_total", c)] == \
            stats.spilled_blocks + stats.written_blocks > 0
        assert s[("durablekv_kv_cache_usage_perc", c)] == 0.0          # all finished
        assert sum(s[("durablekv_kv_blocks", c + (("state", st),))]
                   for st in ("used", "cached", "free")) == 10
        # mid-run: blocks in use show up as usage
        engine.add_request(Request("x", list(range(30)), 3))
        engine.step()
        s = samples(registry)
        assert s[("durablekv_kv_cache_usage_perc", c)] == pool.stats().usage > 0


def test_collector_module_needs_no_numpy():
    code = ("import sys; sys.modules['numpy'] = None\n"
            "from durablekv.llm.metrics import KVPoolCollector\n"
            "print(len(list(KVPoolCollector().describe())))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=60).stdout
    assert out.strip() == "7"


def test_promtool_finds_no_problem():
    """promtool lints the exposition (naming rules, HELP); CI has it, a laptop may not."""
    from ..conftest import need_binaries

    need_binaries("promtool")  # skip locally, fail in CI

    class Stub:
        store = None

        def stats(self):
            from durablekv.llm.pool import PoolStats
            return PoolStats(num_blocks=4, free_blocks=2, prefix_queries_tokens=9,
                             prefix_hits_memory_tokens=4)

    registry = CollectorRegistry()
    registry.register(KVPoolCollector(Stub()))
    lint = subprocess.run(["promtool", "check", "metrics"], input=generate_latest(registry),
                          capture_output=True, timeout=60)
    assert lint.returncode == 0 and not (lint.stdout + lint.stderr).strip(), lint


def test_dashboard_has_the_llm_row():
    import json
    from pathlib import Path

    dash = json.loads((Path(__file__).resolve().parents[2] / "grafana" /
                       "durablekv-dashboard.json").read_text(encoding="utf-8"))
    exprs = " ".join(t["expr"] for p in dash["panels"] for t in p.get("targets", []))
    for name in ("durablekv_kv_cache_usage_perc", "durablekv_prefix_cache_queries_total",
                 'durablekv_prefix_cache_hits_total{cache=~"$cache", tier="memory"}',
                 'durablekv_prefix_cache_hits_total{cache=~"$cache", tier="durable"}',
                 "durablekv_num_preemptions_total", "durablekv_kv_blocks"):
        assert name in exprs, name
