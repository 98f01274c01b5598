"""The Grafana dashboard and its provisioning files agree with what the exporter exposes.

The PromQL itself is evaluated against a real Prometheus in
tests/test_prometheus_e2e.py; here everything is static and fast.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from durablekv.llm.metrics import KVPoolCollector
from durablekv.metrics import CacheCollector
from durablekv.stats import FLUSH_PAGES_BUCKETS, FLUSH_SECONDS_BUCKETS, CacheStats, Histogram

GRAFANA = Path(__file__).resolve().parents[1] / "grafana"
DASHBOARD = GRAFANA / "durablekv-dashboard.json"
DASHBOARD_PROVIDER = GRAFANA / "provisioning" / "dashboards" / "durablekv.yaml"
DATASOURCE = GRAFANA / "provisioning" / "datasources" / "prometheus.yaml"
PROM_DS = {"type": "prometheus", "uid": "${datasource}"}
METRIC_RE = re.compile(r"\bdurablekv_[A-Za-z0-9_]+")


class StubCache:
    """Only the names matter here, not the values."""

    name, path, closed = "stub", "/nonexistent", False

    def stats(self):
        return CacheStats()

    def histograms(self):
        return {"flush_seconds": Histogram(FLUSH_SECONDS_BUCKETS).snapshot(),
                "flush_pages": Histogram(FLUSH_PAGES_BUCKETS).snapshot()}


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text(encoding="utf-8"))


def panels(dashboard: dict) -> list[dict]:
    out = []
    for panel in dashboard["panels"]:
        out.append(panel)
        out.extend(panel.get("panels", []))  # panels inside collapsed rows
    return [p for p in out if p.get("type") != "row"]


class StubPool:
    """A block pool for KVPoolCollector (durablekv.llm.metrics needs no numpy)."""

    store = None

    def stats(self):
        return SimpleNamespace(num_blocks=1, free_blocks=1, cached_free_blocks=0, usage=0.0,
                               prefix_queries_tokens=0, prefix_hits_memory_tokens=0,
                               prefix_hits_durable_tokens=0, preemptions=0, evictions=0,
                               spilled_blocks=0)


def exposed_sample_names() -> set[str]:
    names = {s.name for family in CacheCollector(StubCache()).collect() for s in family.samples}
    return names | {s.name for family in KVPoolCollector(StubPool()).collect()
                    for s in family.samples}


def test_dashboard_identity(dashboard):
    assert dashboard["uid"] == "durablekv-overview"
    assert dashboard["title"]
    assert dashboard["id"] is None  # provisioned dashboards must not carry a database id
    assert isinstance(dashboard["schemaVersion"], int)


def test_template_variables(dashboard):
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    ds = variables["datasource"]
    assert ds["type"] == "datasource" and ds["query"] == "prometheus"
    cache = variables["cache"]
    assert cache["type"] == "query"
    assert cache["datasource"] == PROM_DS
    query = cache["query"]["query"] if isinstance(cache["query"], dict) else cache["query"]
    assert query == "label_values(durablekv_hits_total, cache)"
    assert cache["multi"] is True and cache["includeAll"] is True


def test_every_panel_has_targets_with_expressions(dashboard):
    ids = [p["id"] for p in panels(dashboard)]
    assert len(ids) == len(set(ids))
    for panel in panels(dashboard):
        assert panel["title"]
        assert panel["datasource"] == PROM_DS, panel["title"]
        assert panel["targets"], panel["title"]
        ref_ids = [t["refId"] for t in panel["targets"]]
        assert len(ref_ids) == len(set(ref_ids)), panel["title"]
        for target in panel["targets"]:
            assert target["expr"].strip(), panel["title"]
            assert target["datasource"] == PROM_DS, panel["title"]


def test_expressions_use_only_exposed_metrics_cache_selector_and_rate_interval(dashboard):
    exposed = exposed_sample_names()
    for panel in panels(dashboard):
        for target in panel["targets"]:
            expr = target["expr"]
            names = METRIC_RE.findall(expr)
            assert names, expr
            for name in names:
                assert name in exposed, f"{panel['title']!r}: {name} is not exposed"
            # every metric selector is narrowed to the chosen caches
            for match in re.finditer(r"\b(durablekv_[A-Za-z0-9_]+)(\{[^}]*\})?", expr):
                assert match.group(2) and 'cache=~"$cache"' in match.group(2), (panel["title"], expr)
            # every range vector uses Grafana's $__rate_interval
            for window in re.findall(r"\[([^\]]+)\]", expr):
                assert window == "$__rate_interval", (panel["title"], expr)
            if "rate(" in expr:
                assert "$__rate_interval" in expr


def test_panels_cover_the_issue(dashboard):
    exprs = {p["title"]: " ".join(t["expr"] for t in p["targets"]) for p in panels(dashboard)}
    everything = " ".join(exprs.values())
    for q in ("0.5", "0.9", "0.99"):
        assert f"histogram_quantile({q}, sum by (cache, le) (rate(durablekv_flush_duration_seconds_bucket" in everything
    assert 'tier="memory"' in everything and 'tier="store"' in everything
    assert "sum by (cache, tier) (rate(durablekv_evictions_total" in everything  # both tiers
    for name in ("durablekv_flush_pages_sum", "durablekv_flush_pages_count", "durablekv_sets_total",
                 "durablekv_deletes_total", "durablekv_misses_total", "durablekv_evictions_total",
                 "durablekv_page_faults_total", "durablekv_pending_pages",
                 "durablekv_oldest_unflushed_age_seconds", "durablekv_resident_pages",
                 "durablekv_max_pages", "durablekv_replay_log_bytes", "durablekv_store_bytes",
                 "durablekv_recovery_duration_seconds", "durablekv_recovered_records",
                 "durablekv_memory_bytes", "durablekv_max_memory_bytes",
                 "durablekv_store_data_bytes", "durablekv_size_limit_bytes"):
        assert name in everything, name


def test_panels_do_not_overlap(dashboard):
    taken = set()
    for panel in panels(dashboard):
        g = panel["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24, panel["title"]
        cells = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not cells & taken, panel["title"]
        taken |= cells


def _yaml_or_none(text: str):
    """Parse with PyYAML when it happens to be installed (it is not a dependency)."""
    try:
        import yaml
    except ImportError:
        return None
    return yaml.safe_load(text)


def test_dashboard_provider_yaml():
    text = DASHBOARD_PROVIDER.read_text(encoding="utf-8")
    assert "\t" not in text
    lines = [line for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    assert lines[0] == "apiVersion: 1"
    assert "providers:" in lines
    assert "    type: file" in lines
    assert "    options:" in lines
    path_lines = [line for line in lines if line.startswith("      path: ")]
    assert len(path_lines) == 1 and path_lines[0].split(": ", 1)[1].startswith("/")
    assert "path" in text.split("apiVersion", 1)[0], "the header comment says which path to set"
    parsed = _yaml_or_none(text)
    if parsed is not None:
        (provider,) = parsed["providers"]
        assert provider["type"] == "file" and provider["options"]["path"].startswith("/")


def test_datasource_yaml():
    text = DATASOURCE.read_text(encoding="utf-8")
    assert "\t" not in text
    lines = [line for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    assert lines[0] == "apiVersion: 1"
    assert "datasources:" in lines
    assert "    type: prometheus" in lines
    assert any(re.fullmatch(r"    url: https?://\S+", line) for line in lines)
    parsed = _yaml_or_none(text)
    if parsed is not None:
        (ds,) = parsed["datasources"]
        assert ds["type"] == "prometheus" and ds["url"].startswith("http")
