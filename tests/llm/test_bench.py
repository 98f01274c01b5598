"""``durablekv llm-bench --quick`` runs end to end through the real command line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
KEYS = ("static", "continuous", "prefix_off", "prefix_memory", "prefix_durable",
        "durable_killed", "restart_cold", "prefix_after_restart", "prefix_after_kill")
RESTARTS = ("restart_cold", "prefix_after_restart", "prefix_after_kill")


def run_cli(*args, env=None, cwd=None):
    full = dict(os.environ, PYTHONPATH=str(REPO))
    full.update(env or {})
    return subprocess.run([sys.executable, "-m", "durablekv", *args], capture_output=True,
                          text=True, timeout=300, cwd=cwd or REPO, env=full)


def test_quick_bench_report(tmp_path):
    out = tmp_path / "llm.json"
    proc = run_cli("llm-bench", "--quick", "--json", str(out), "--no-progress", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(out.read_text())
    for key in KEYS:
        x = r[key]
        for field in ("tokens_per_s", "ttft_p50_s", "ttft_p99_s", "prefix_hit_rate",
                      "tpot_p50_s", "tpot_p99_s", "preemptions", "kv_usage_mean"):
            assert isinstance(x[field], (int, float)), (key, field)
        assert x["tokens_per_s"] > 0 and 0 <= x["ttft_p50_s"] <= x["ttft_p99_s"]
        assert 0.0 <= x["prefix_hit_rate"] <= 1.0
        assert abs(x["prefix_hit_rate"] - x["prefix_hit_rate_memory"]
                   - x["prefix_hit_rate_durable"]) < 1e-12
        if key not in RESTARTS:
            assert x["output_tokens"] == r["static"]["output_tokens"]     # the same requests
    assert r["outputs_identical"] is True
    assert r["prefix_off"]["prefix_hit_rate"] == 0.0
    assert r["prefix_memory"]["prefix_hit_rate_memory"] > 0
    assert r["prefix_memory"]["prefix_hit_rate_durable"] == 0.0
    assert r["prefix_durable"]["written_blocks"] > 0           # as they filled
    assert r["prefix_durable"]["write_drops"] == 0
    # restarts: new processes on new requests over the same system prompts
    assert r["restart_workload"]["user_seed"] != r["workload"]["user_seed"]
    assert len({r[k]["output_tokens"] for k in RESTARTS}) == 1
    assert r["restart_cold"]["output_tokens"] != r["static"]["output_tokens"]
    assert r["restart_cold"]["blocks_at_open"] == 0 == r["restart_cold"]["blocks_reused"]
    for key in ("prefix_after_restart", "prefix_after_kill"):
        # the system prompts' blocks, computed before the restart, are served again
        assert r[key]["blocks_at_open"] > 0 and r[key]["blocks_reused"] > 0, key
        assert r[key]["prefix_hit_rate_reused"] > 0
    # everything the killed run had written by its report survived the SIGKILL
    killed = r["durable_killed"]
    assert killed["distinct_blocks_put"] > 0
    assert r["prefix_after_kill"]["blocks_at_open"] >= killed["distinct_blocks_put"]
    for key in ("prefix_durable", "durable_killed") + RESTARTS:
        x = r[key]
        assert x["block_bytes"] > 0 and x["store_bytes"] > 0 and x["durable_put_mb_s"] > 0
        assert 0 < x["durable_put_p50_us"] <= x["durable_put_p99_us"]
    for gains in r["restart_gain"].values():
        assert gains["tokens_per_s"]["median"] > 0 and gains["ttft_p50_s"]["median"] > 0
    for key in ("batching", "scheduling_gain", "prefix_gain", "spread_sweep", "load_sweep"):
        assert key in r
    assert r["batching"]["gain"]["median"] > 0
    assert [p["spread"] for p in r["spread_sweep"]] == [0.0, 0.9]
    assert "scheduling gain" in proc.stdout and "batching gain" in proc.stdout
    assert not any(tmp_path.glob("**/*.png"))                         # no plots with --quick
    assert [p["batch_size"] for p in r["batching"]["decode_micro"]] == [1, 4]

    from durablekv.llm.bench import render_findings, render_markdown
    table = render_markdown(r)
    assert "| `prefix_after_kill` |" in table and "decode steps only, batch 4" in table
    assert "kill -9" in render_findings(r)


def test_command_line_needs_no_numpy_until_llm_bench(tmp_path):
    blocker = tmp_path / "sitecustomize.py"
    blocker.write_text("import sys\nsys.modules['numpy'] = None\n")
    env = {"PYTHONPATH": f"{tmp_path}{os.pathsep}{REPO}"}
    assert run_cli("--help", env=env).returncode == 0
    proc = run_cli("llm-bench", "--quick", env=env)
    assert proc.returncode == 2
    assert "llm-bench needs numpy" in proc.stderr and "durablekv[llm]" in proc.stderr


def test_readme_numbers_are_the_committed_run():
    """The README's LLM lines quote docs/bench/llm.json; keep them in step
    (the gains and latencies are in docs/llm.md, from the same run)."""
    r = json.loads((REPO / "docs" / "bench" / "llm.json").read_text())
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    section = readme.split("## As a service, scale-out and LLM KV blocks", 1)[1].split("\n## ", 1)[0]
    text = " ".join(section.split())
    assert f'{r["prefix_memory"]["prefix_hit_rate"]:.0%} in memory only' in text
    assert f'{r["prefix_durable"]["prefix_hit_rate"]:.0%} with the durable tier' in text
    killed = r["durable_killed"]
    assert "found every block written before the kill" in text
    assert r["prefix_after_kill"]["blocks_at_open"] >= killed["distinct_blocks_put"]
    assert r["outputs_identical"] is True and r["quick"] is False


def test_the_large_block_bench_runs_and_reports_both_sides(monkeypatch, tmp_path):
    """bench/llm_blocks.py on small blocks: rows for each size and mode, with
    durablekv and the file-per-block floor side by side."""
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    try:
        from bench import llm_blocks
    finally:
        sys.path.pop(0)
    monkeypatch.setattr(llm_blocks, "CASES", ((64 << 10, 4), (256 << 10, 2)))
    rows = llm_blocks.run(2, ("log", "fsync"), str(tmp_path))
    assert [(r["block_bytes"], r["durability"]) for r in rows] == [
        (64 << 10, "log"), (64 << 10, "fsync"), (256 << 10, "log"), (256 << 10, "fsync")]
    for r in rows:
        for impl in ("durablekv", "in_cache", "file"):
            assert r[f"{impl}_put_mb_s"]["median"] > 0 and r[f"{impl}_get_mb_s"]["median"] > 0
        assert r["durablekv_put_ratio"]["n"] == 2 and r["in_cache_put_ratio"]["n"] == 2
        assert r["file_disk_bytes"] == r["block_bytes"] * r["blocks"]
    assert "| 64 KiB x 4 | log |" in llm_blocks.markdown(rows, 2)


def test_docs_benchmark_text_is_generated_from_the_committed_run():
    """docs/llm.md's tables and findings are render_docs() of docs/bench/llm.json:
    no number or verdict in them was typed by hand (python -m bench.llm_docs)."""
    import sys
    sys.path.insert(0, str(REPO))
    try:
        from bench.llm_docs import generated
    finally:
        sys.path.pop(0)
    from durablekv.llm.bench import render_docs

    r = json.loads((REPO / "docs" / "bench" / "llm.json").read_text())
    doc = (REPO / "docs" / "llm.md").read_text(encoding="utf-8")
    assert generated(doc) == render_docs(r)


def test_findings_call_noise_what_the_repeats_do_not_separate():
    from durablekv.llm.bench import _compare

    assert _compare({"median": 1.3, "min": 0.9, "max": 1.5}, "higher", "lower").startswith(
        "within noise")
    assert _compare({"median": 1.3, "min": 1.1, "max": 1.5}, "higher", "lower").startswith(
        "higher")
    assert _compare({"median": 0.8, "min": 0.7, "max": 0.95}, "higher", "lower").startswith(
        "lower")
    assert "one repeat" in _compare({"median": 1.3, "min": 1.3, "max": 1.3}, "a", "b")
