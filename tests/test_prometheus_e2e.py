"""End to end: `durablekv replay` serves /metrics, a real Prometheus scrapes it, and
every panel query of the Grafana dashboard returns data.

Needs the `prometheus` and `promtool` binaries (Debian package `prometheus`;
CI installs it). Skipped, with that reason, when they are not on PATH.

Flow: Prometheus starts first, with file-based service discovery, so it is
ready before the replay begins; the replay is started with --metrics-port 0,
its stderr line `metrics: http://127.0.0.1:PORT/metrics` gives the port, which
goes into the targets file; Prometheus scrapes every second. After the replay
has finished, held the endpoint for --hold seconds, written its JSON report
and exited, the test finds (query_range) the first moment Prometheus held the
final counters and evaluates, at that moment, the dashboard queries and the
hit ratio against the report. Every wait polls with a deadline.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from .conftest import need_binaries, no_traces

REPO = Path(__file__).resolve().parents[1]
TRACE = REPO.parent / "shared" / "traces" / "arc_OLTP.lis"
DASHBOARD = REPO / "grafana" / "durablekv-dashboard.json"
LIMIT = 300_000       # requests replayed: several seconds, so 1 s scrapes see it run
HOLD_SECONDS = 20     # the replay keeps serving this long after its report
RATE_INTERVAL = "15s"  # $__rate_interval: >= 4 x the 1 s scrape interval

pytestmark = [pytest.mark.prometheus]


@pytest.fixture(autouse=True)
def _binaries():
    need_binaries("prometheus", "promtool")  # skip locally, fail in CI


# --------------------------------------------------------------------------- helpers

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(what: str, check, timeout: float, interval: float = 0.25, procs=()):
    """Call check() until it returns something truthy; fail after `timeout` seconds,
    or at once if one of `procs` has exited."""
    deadline = time.monotonic() + timeout
    last_error = None
    while time.monotonic() < deadline:
        for proc in procs:
            if proc.poll() is not None:
                pytest.fail(f"{what}: process {proc.args[0]} exited with {proc.returncode}")
        try:
            result = check()
        except (OSError, ValueError, KeyError) as exc:  # not up yet / not there yet
            last_error, result = exc, None
        if result:
            return result
        time.sleep(interval)
    pytest.fail(f"timed out after {timeout} s waiting for {what} (last error: {last_error!r})")


def http_get(url: str, timeout: float = 5.0) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return response.read()


class Prometheus:
    def __init__(self, base: str) -> None:
        self.base = base

    def query(self, expr: str, at: float | None = None) -> list[dict]:
        params = {"query": expr}
        if at is not None:
            params["time"] = f"{at:.3f}"
        body = json.loads(http_get(f"{self.base}/api/v1/query?{urllib.parse.urlencode(params)}"))
        assert body["status"] == "success", (expr, body)
        assert body["data"]["resultType"] == "vector", (expr, body)
        return body["data"]["result"]

    def query_range(self, expr: str, start: float, end: float, step: float) -> list[tuple[float, float]]:
        params = {"query": expr, "start": f"{start:.3f}", "end": f"{end:.3f}", "step": str(step)}
        body = json.loads(http_get(f"{self.base}/api/v1/query_range?{urllib.parse.urlencode(params)}"))
        assert body["status"] == "success", (expr, body)
        result = body["data"]["result"]
        assert len(result) <= 1, (expr, result)
        return [(float(t), float(v)) for t, v in result[0]["values"]] if result else []

    def scalar(self, expr: str, at: float | None = None) -> float | None:
        result = self.query(expr, at)
        if not result:
            return None
        assert len(result) == 1, (expr, result)
        return float(result[0]["value"][1])


def promql_regex_literal(text: str) -> str:
    """The inside of a PromQL double-quoted string: a regex matching exactly `text`."""
    return json.dumps(re.escape(text))[1:-1]


def panel_queries() -> list[tuple[str, str, str]]:
    dashboard = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    out = []
    for panel in dashboard["panels"]:
        for p in [panel, *panel.get("panels", [])]:
            for target in p.get("targets", []):
                out.append((p["title"], target["refId"], target["expr"]))
    assert out
    return out


#: Metrics of durablekv.llm.metrics.KVPoolCollector (tests/llm/test_metrics.py).
LLM_METRIC_RE = re.compile(r"\bdurablekv_(kv_|prefix_cache_|num_preemptions)")


def substitute(expr: str, cache_regex: str) -> str:
    return (expr.replace("$__rate_interval", RATE_INTERVAL)
                .replace("${cache}", cache_regex).replace("$cache", cache_regex))


# --------------------------------------------------------------------------- the test

def test_replay_scraped_by_prometheus_serves_every_dashboard_query(tmp_path):
    if not TRACE.is_file():
        no_traces(TRACE)
    prom_port = free_port()
    targets = tmp_path / "targets.json"
    targets.write_text("[]")
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global:\n"
        "  scrape_interval: 1s\n"
        "  scrape_timeout: 1s\n"
        "  evaluation_interval: 1s\n"
        "scrape_configs:\n"
        "  - job_name: durablekv\n"
        "    file_sd_configs:\n"
        f"      - files: [{json.dumps(str(targets))}]\n"
        "        refresh_interval: 1s\n"
    )
    report_path = tmp_path / "report.json"
    procs: list[subprocess.Popen] = []
    logs = {name: open(tmp_path / f"{name}.log", "w+b") for name in ("prometheus", "replay-stdout")}
    stderr_lines: list[str] = []
    try:
        prometheus = subprocess.Popen(
            ["prometheus", f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{prom_port}"],
            stdout=logs["prometheus"], stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            cwd=tmp_path)
        procs.append(prometheus)
        prom = Prometheus(f"http://127.0.0.1:{prom_port}")
        wait_for("prometheus to be ready",
                 lambda: http_get(f"{prom.base}/-/ready") is not None, 60, procs=[prometheus])

        # --- the replay, serving /metrics on a port it picks itself
        replay = subprocess.Popen(
            [sys.executable, "-c", "import sys; from durablekv.cli import main; sys.exit(main())",
             "replay", str(TRACE), "--limit", str(LIMIT), "--dir", str(tmp_path / "cache"),
             "--page-size", "4", "--max-pages", "512",
             "--metrics-port", "0", "--hold", str(HOLD_SECONDS), "--json", str(report_path)],
            cwd=REPO, stdin=subprocess.DEVNULL, stdout=logs["replay-stdout"], stderr=subprocess.PIPE,
            text=True, errors="replace")
        procs.append(replay)
        run_started = time.time()

        def drain() -> None:  # progress output must never fill the pipe
            for line in replay.stderr:
                stderr_lines.append(line)
        threading.Thread(target=drain, daemon=True).start()

        def metrics_url():
            for line in stderr_lines:
                m = re.search(r"metrics: (http://127\.0\.0\.1:(\d+)/metrics)", line)
                if m:
                    return m.group(1), int(m.group(2))
            return None
        url, port = wait_for("the replay's 'metrics: http://127.0.0.1:PORT/metrics' line",
                             metrics_url, 60, procs=[replay])
        assert port != 0
        tmp_targets = tmp_path / "targets.json.tmp"
        tmp_targets.write_text(json.dumps([{"targets": [f"127.0.0.1:{port}"]}]))
        os.replace(tmp_targets, targets)

        # --- promtool lints a scrape: no problems at all (exit 0, nothing printed);
        # promtool exits 3 on any lint finding (bad suffix, missing HELP, ...) and 1
        # on a parse error, and every name and HELP here is ours to get right.
        scrape = http_get(url)
        lint = subprocess.run(["promtool", "check", "metrics"], input=scrape,
                              capture_output=True, timeout=60)
        assert lint.returncode == 0, lint.stdout.decode() + lint.stderr.decode()
        assert not (lint.stdout + lint.stderr).strip(), (lint.stdout + lint.stderr).decode()

        # --- Prometheus has samples from the replay's cache
        series = wait_for("prometheus to have durablekv samples",
                          lambda: prom.query("durablekv_sets_total"), 60, procs=[prometheus, replay])
        (sample,) = series
        cache_name = sample["metric"]["cache"]

        # --- the replay finishes, holds the endpoint, then writes its report and exits
        wait_for("the replay to finish", lambda: replay.poll() is not None,
                 600 + HOLD_SECONDS, interval=0.5, procs=[prometheus])
        assert replay.returncode == 0, "".join(stderr_lines)[-4000:]
        report = json.loads(report_path.read_text())
        for key in ("requests", "gets", "sets", "memory_hits", "store_hits", "misses", "hit_ratio",
                    "memory_hit_ratio", "store_hit_ratio", "evictions", "page_faults", "flushes",
                    "flushed_pages"):
            assert key in report, f"report lacks {key!r}: {sorted(report)}"
        assert report["requests"] == LIMIT
        assert report["gets"] == report["memory_hits"] + report["store_hits"] + report["misses"]
        assert report["gets"] > 0 and report["evictions"] > 0 and report["page_faults"] > 0

        # --- find when Prometheus first held the final counters (during the hold)
        exact = f"cache={json.dumps(cache_name)}"  # a PromQL string literal
        hits = f"sum(durablekv_hits_total{{{exact}}})"
        misses = f"sum(durablekv_misses_total{{{exact}}})"
        points = prom.query_range(f"{hits} + {misses}", start=run_started, end=time.time(), step=0.5)
        final = [t for t, v in points if v == report["gets"]]
        assert final, f"prometheus never scraped the final counters ({report['gets']} gets): {points[-5:]}"
        # The first moment with the final counters AND two samples in the rate
        # window: a replay faster than Prometheus's 5 s target tick can end
        # before the second scrape, and rate() of one sample is no data.
        samples = f"min(count_over_time(durablekv_sets_total{{{exact}}}[{RATE_INTERVAL}]))"
        at = next((t for t in final if (prom.scalar(samples, at=t) or 0) >= 2), None)
        assert at is not None, f"no moment with final counters and two samples: {points[-5:]}"
        during = {v for t, v in points if t < final[0]}  # scraped while it ran

        # --- final counters as Prometheus saw them agree with the report
        hit_ratio = prom.scalar(f"{hits} / ({hits} + {misses})", at=at)
        assert abs(hit_ratio - report["hit_ratio"]) <= 0.01, (hit_ratio, report["hit_ratio"])
        for tier in ("memory", "store"):
            tier_hits = f'sum(durablekv_hits_total{{{exact}, tier="{tier}"}})'
            ratio = prom.scalar(f"{tier_hits} / ({hits} + {misses})", at=at)
            assert abs(ratio - report[f"{tier}_hit_ratio"]) <= 0.01, (tier, ratio, report)
            assert prom.scalar(tier_hits, at=at) == report[f"{tier}_hits"]
        for name, key in (("durablekv_misses_total", "misses"),
                          ('durablekv_evictions_total{tier="memory"}', "evictions"),
                          ("durablekv_page_faults_total", "page_faults")):
            name, _, tier = name.partition("{")
            sel = f"{exact}, {tier.rstrip('}')}" if tier else exact
            assert prom.scalar(f"sum({name}{{{sel}}})", at=at) == report[key], name
        # look-aside: the cache saw the trace's sets plus one fill per miss
        assert prom.scalar(f"sum(durablekv_sets_total{{{exact}}})", at=at) == report["sets"] + report["misses"]
        # the report is taken after a final flush(); Prometheus may have scraped just before it
        assert 0 < prom.scalar(f"sum(durablekv_flushes_total{{{exact}}})", at=at) <= report["flushes"]

        # --- every dashboard query returns data, for the one cache and for "All"
        failures = []
        for cache_regex in (promql_regex_literal(cache_name), ".*"):
            for title, ref, expr in panel_queries():
                if LLM_METRIC_RE.search(expr):
                    continue  # the LLM row: a KVPoolCollector's metrics, not a replay's
                query = substitute(expr, cache_regex)
                assert "$" not in query, query
                if not prom.query(query, at=at):
                    failures.append(f"{title} [{ref}]: {query}")
        assert not failures, "dashboard queries without data:\n" + "\n".join(failures)

        # Prometheus hands new targets to the scraper on a 5 s tick, so it may catch only
        # the replay's last seconds; once it saw the counters before their final values,
        # the rates at `at` are real numbers, not 0/0.
        def panel_value(title_start: str, ref: str) -> float | None:
            expr = next(e for t, r, e in panel_queries() if t.startswith(title_start) and r == ref)
            return prom.scalar(substitute(expr, promql_regex_literal(cache_name)), at=at)
        if during:
            gets_rate = panel_value("Requests", "A")
            assert gets_rate is not None and gets_rate > 0, gets_rate
            ratio = panel_value("Hit ratio", "C")
            assert ratio is not None and 0 < ratio < 1, ratio
            flushes = prom.scalar(f"sum(increase(durablekv_flushes_total{{{exact}}}[{RATE_INTERVAL}]))", at=at)
            if flushes:
                p99 = panel_value("Flush latency", "C")
                assert p99 is not None and 0 < p99 <= 10, p99
    except BaseException:
        for name, log in logs.items():
            log.seek(0)
            sys.stderr.write(f"--- {name} (tail)\n{log.read()[-4000:].decode(errors='replace')}\n")
        sys.stderr.write("--- replay stderr (tail)\n" + "".join(stderr_lines)[-4000:] + "\n")
        raise
    finally:
        for proc in reversed(procs):
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout=15)
        for log in logs.values():
            log.close()


def test_dashboard_queries_are_valid_promql(tmp_path):
    """promtool parses every panel query (as recording rules), with Grafana's variables filled in."""
    rules = ["groups:", "  - name: durablekv-dashboard", "    rules:"]
    for i, (_, _, expr) in enumerate(panel_queries()):
        rules.append(f"      - record: durablekv_dashboard_query_{i}")
        rules.append(f"        expr: {json.dumps(substitute(expr, 'c'))}")
    path = tmp_path / "rules.yml"
    path.write_text("\n".join(rules) + "\n")
    result = subprocess.run(["promtool", "check", "rules", str(path)], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(panel_queries())} rules found" in result.stdout + result.stderr
