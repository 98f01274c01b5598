"""Tests for durablekv.metrics: CacheCollector, serve(), and what a scrape says.

Traffic tests drive a real ``Cache`` (``page_size=1`` makes it an exact LRU of
``max_pages`` entries, so hit/miss/eviction/page-fault counts are exact) and
check that an HTTP scrape, parsed with prometheus_client's own parser, agrees
with ``cache.stats()``. A few collector-contract tests use a small stand-in
object (``StubCache``) where a real cache cannot be put in the state needed
(``stats()`` that must not be called, a cache closing mid-scrape).
"""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
import urllib.request
from pathlib import Path

import pytest
from prometheus_client import REGISTRY, CollectorRegistry, generate_latest
from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_openmetrics
from prometheus_client.parser import text_string_to_metric_families

from durablekv.errors import CacheClosedError
from durablekv.metrics import METRIC_FAMILIES, CacheCollector, serve
from durablekv.stats import (
    FLUSH_PAGES_BUCKETS,
    FLUSH_SECONDS_BUCKETS,
    CacheStats,
    Histogram,
)

REPO = Path(__file__).resolve().parents[1]

# Sample name -> CacheStats field, written out here on purpose (not taken
# from durablekv.metrics) so a wrong mapping in the collector fails a test.
COUNTERS = {
    "durablekv_misses_total": "misses",
    "durablekv_sets_total": "sets",
    "durablekv_deletes_total": "deletes",
    "durablekv_page_faults_total": "page_faults",
    "durablekv_expirations_total": "expirations",
    "durablekv_flushes_total": "flushes",
    "durablekv_flushed_pages_total": "flushed_pages",
    "durablekv_flush_errors_total": "flush_errors",
}
GAUGES = {
    "durablekv_pending_pages": "pending_pages",
    "durablekv_dirty_pages": "dirty_pages",
    "durablekv_resident_pages": "resident_pages",
    "durablekv_max_pages": "max_pages",
    "durablekv_memory_bytes": "memory_bytes",
    "durablekv_max_memory_bytes": "max_memory_bytes",
    "durablekv_store_data_bytes": "store_data_bytes",
    "durablekv_size_limit_bytes": "size_limit",
    "durablekv_replay_log_bytes": "log_bytes",
    "durablekv_store_bytes": "store_bytes",
    "durablekv_oldest_unflushed_age_seconds": "oldest_unflushed_seconds",
    "durablekv_checkpoint_lsn": "checkpoint_lsn",
    "durablekv_last_lsn": "last_lsn",
    "durablekv_recovered_records": "recovered_records",
    "durablekv_recovery_torn_records": "torn_records",
    "durablekv_recovery_salvaged_bytes": "salvaged_bytes",
    "durablekv_recovery_duration_seconds": "recovery_seconds",
}
HISTOGRAMS = ("durablekv_flush_duration_seconds", "durablekv_flush_pages")
#: Counters with a tier label: tier -> CacheStats field.
TIERED = {
    "durablekv_hits_total": {"memory": "memory_hits", "store": "store_hits"},
    "durablekv_evictions_total": {"memory": "evictions", "store": "store_evictions"},
}
#: Every family DESIGN.md names (the collector may expose more).
DESIGN_FAMILIES = {
    "durablekv_hits", "durablekv_misses", "durablekv_evictions", "durablekv_page_faults",
    "durablekv_expirations", "durablekv_flush_duration_seconds", "durablekv_flush_pages",
    "durablekv_pending_pages", "durablekv_resident_pages", "durablekv_replay_log_bytes",
    "durablekv_store_bytes", "durablekv_recovery_duration_seconds",
}
OPENMETRICS_ACCEPT = "application/openmetrics-text; version=1.0.0; charset=utf-8"


# --------------------------------------------------------------------------- helpers

def open_cache(path, **kwargs):
    """A real Cache whose background batcher never flushes on its own during a
    test (explicit ``flush()`` only), so counters stand still between reads."""
    from durablekv import Cache

    kwargs.setdefault("page_size", 1)
    kwargs.setdefault("max_pages", 4)
    kwargs.setdefault("flush_interval", 3600.0)
    kwargs.setdefault("flush_batch_pages", 1024)
    return Cache(path, **kwargs)


def scrape(url: str, accept: str | None = None) -> tuple[str, str]:
    """GET the endpoint; return (Content-Type, body)."""
    request = urllib.request.Request(url, headers={"Accept": accept} if accept else {})
    with urllib.request.urlopen(request, timeout=10) as response:
        assert response.status == 200
        return response.headers["Content-Type"], response.read().decode("utf-8")


def samples_by_key(text: str) -> dict[tuple[str, frozenset], float]:
    """Every sample of a text-format scrape, keyed by (name, labels)."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            key = (s.name, frozenset(s.labels.items()))
            assert key not in out, f"duplicate sample {key}"
            out[key] = s.value
    return out


def value(samples, name, cache, **labels) -> float:
    return samples[(name, frozenset({"cache": cache, **labels}.items()))]


def traffic(cache) -> None:
    """Known traffic on a page_size=1, max_pages=4 cache (an exact LRU of 4 entries).

    6 sets (k0..k5): k0 and k1 are evicted -> 2 evictions; flush() -> all in SQLite.
    get k5, get k4: 2 memory hits. get k0: page fault, store hit, evicts k2 -> 3 evictions.
    get 'absent': 1 miss. delete k3: 1 delete. flush() again.
    """
    for i in range(6):
        cache[f"k{i}"] = {"i": i, "pad": "x" * 100}
    cache.flush()
    assert cache.get("k5") == {"i": 5, "pad": "x" * 100}
    assert cache.get("k4") == {"i": 4, "pad": "x" * 100}
    assert cache.get("k0") == {"i": 0, "pad": "x" * 100}
    assert cache.get("absent") is None
    assert cache.delete("k3") is True
    cache.flush()


def assert_scrape_matches_stats(samples, name: str, stats: CacheStats, histograms: dict) -> None:
    for sample, tiers in TIERED.items():
        for tier, field in tiers.items():
            assert value(samples, sample, name, tier=tier) == getattr(stats, field), sample
    for sample, field in COUNTERS.items():
        assert value(samples, sample, name) == getattr(stats, field), sample
    for sample, field in GAUGES.items():
        if field == "oldest_unflushed_seconds":  # moves with the clock while something is dirty
            continue
        want = getattr(stats, field)
        want = float("inf") if want is None else want  # an unset bound
        assert value(samples, sample, name) == pytest.approx(want), sample
    for family, key in (("durablekv_flush_duration_seconds", "flush_seconds"),
                        ("durablekv_flush_pages", "flush_pages")):
        snap = histograms[key]
        assert value(samples, family + "_count", name) == snap.count
        assert value(samples, family + "_sum", name) == pytest.approx(snap.sum)
        assert value(samples, family + "_bucket", name, le="+Inf") == snap.count


class StubCache:
    """The interface CacheCollector reads, for states a real Cache cannot be put in."""

    def __init__(self, name: str, stats: CacheStats | None = None) -> None:
        self.name = name
        self.path = f"/nonexistent/{name}"
        self.closed = False
        self._stats = stats or CacheStats()
        self.flush_seconds = Histogram(FLUSH_SECONDS_BUCKETS)
        self.flush_pages = Histogram(FLUSH_PAGES_BUCKETS)
        self.stats_calls = 0

    def stats(self) -> CacheStats:
        self.stats_calls += 1
        if self.closed:
            raise CacheClosedError(self.path)
        return self._stats

    def histograms(self) -> dict:
        return {"flush_seconds": self.flush_seconds.snapshot(),
                "flush_pages": self.flush_pages.snapshot()}


def global_registry_names() -> list[str]:
    return sorted(m.name for m in REGISTRY.collect())


# --------------------------------------------------------------------------- scrape vs stats

def test_scrape_agrees_with_stats_after_real_traffic(tmp_path):
    with open_cache(tmp_path / "c", name="main") as cache:
        traffic(cache)
        with serve(cache, port=0) as server:
            assert server.port > 0
            assert server.url == f"http://127.0.0.1:{server.port}/metrics"
            _, text = scrape(server.url)
        stats, histograms = cache.stats(), cache.histograms()

    # page_size=1 is an exact LRU of 4 entries: these numbers follow from traffic().
    assert (stats.memory_hits, stats.store_hits, stats.hits) == (2, 1, 3)
    assert stats.misses == 1
    assert stats.page_faults == 1
    assert stats.evictions == 3
    assert stats.sets == 6 and stats.deletes == 1
    assert stats.flushes >= 1 and stats.flushed_pages >= 6

    samples = samples_by_key(text)
    assert_scrape_matches_stats(samples, "main", stats, histograms)
    # the flush histograms and the flush counters describe the same transactions
    assert value(samples, "durablekv_flush_duration_seconds_count", "main") == stats.flushes
    assert value(samples, "durablekv_flush_pages_count", "main") == stats.flushes
    assert value(samples, "durablekv_flush_pages_sum", "main") == stats.flushed_pages
    assert value(samples, "durablekv_resident_pages", "main") <= 4
    assert value(samples, "durablekv_max_pages", "main") == 4


def test_a_salvaging_open_shows_the_bytes_it_gave_up(tmp_path):
    from durablekv.log.segments import HEADER, MAGIC, list_segments

    d = tmp_path / "c"
    cache = open_cache(d, max_pages=100)
    for i in range(10):
        cache[f"k{i}"] = "v" * 50
    cache._teardown(clean=False)  # as a killed process leaves it: nothing flushed
    (seg,) = list_segments(str(d))
    data = bytearray(Path(seg).read_bytes())
    fifth = len(MAGIC)
    for _ in range(4):
        fifth += HEADER.size + HEADER.unpack_from(data, fifth)[0]
    data[fifth + HEADER.size + 2] ^= 0xFF
    Path(seg).write_bytes(bytes(data))
    with open_cache(d, name="salvaged", salvage_log=True) as cache:
        assert len(cache) == 4
        with serve(cache, port=0) as server:
            _, text = scrape(server.url)
        stats = cache.stats()
    assert stats.salvaged_bytes == len(data) - fifth > 0
    samples = samples_by_key(text)
    assert value(samples, "durablekv_recovery_salvaged_bytes", "salvaged") == stats.salvaged_bytes


def test_every_design_family_is_exposed_with_help_and_cache_label(tmp_path):
    with open_cache(tmp_path / "c", name="only") as cache:
        cache["a"] = 1
        with serve(cache, port=0) as server:
            _, text = scrape(server.url)
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert DESIGN_FAMILIES <= set(families)
    assert set(families) == {name for name, _, _ in METRIC_FAMILIES}
    for family in families.values():
        assert family.documentation.strip(), f"{family.name} has no HELP text"
        assert family.samples, f"{family.name} has no samples"
        for s in family.samples:
            assert s.labels.get("cache") == "only", s
    assert {s.labels["tier"] for s in families["durablekv_hits"].samples} == {"memory", "store"}
    assert {s.labels["tier"] for s in families["durablekv_evictions"].samples} == \
        {"memory", "store"}
    types = {name: typ for name, typ, _ in METRIC_FAMILIES}
    assert types["durablekv_flush_duration_seconds"] == types["durablekv_flush_pages"] == "histogram"
    for name, typ in types.items():
        assert families[name].type == typ


def test_flush_histogram_uses_the_stats_buckets(tmp_path):
    with open_cache(tmp_path / "c") as cache:
        cache["a"] = 1
        cache.flush()
        with serve(cache, port=0) as server:
            _, text = scrape(server.url)
    families = {f.name: f for f in text_string_to_metric_families(text)}
    les = [s.labels["le"] for s in families["durablekv_flush_duration_seconds"].samples
           if s.name.endswith("_bucket")]
    assert [float(le) for le in les[:-1]] == list(FLUSH_SECONDS_BUCKETS)
    assert les[-1] == "+Inf"
    assert FLUSH_SECONDS_BUCKETS[0] == 1e-5 and FLUSH_SECONDS_BUCKETS[-1] == 10.0
    les = [s.labels["le"] for s in families["durablekv_flush_pages"].samples
           if s.name.endswith("_bucket")]
    assert [float(le) for le in les[:-1]] == [float(b) for b in FLUSH_PAGES_BUCKETS]


def test_two_caches_in_one_process_are_told_apart_by_the_cache_label(tmp_path):
    with open_cache(tmp_path / "a", name="alpha") as a, open_cache(tmp_path / "b", name="beta") as b:
        for i in range(3):
            a[f"k{i}"] = i
        a.get("k0"), a.get("k1"), a.get("nope")
        b["x"] = 1
        b.get("y"), b.get("z")
        registry = CollectorRegistry()
        registry.register(CacheCollector(a, b))
        samples = samples_by_key(generate_latest(registry).decode())
        with serve(a, b, port=0) as server:
            samples_http = samples_by_key(scrape(server.url)[1])
        stats_a, stats_b = a.stats(), b.stats()
    for s in (samples, samples_http):
        assert value(s, "durablekv_hits_total", "alpha", tier="memory") == stats_a.memory_hits == 2
        assert value(s, "durablekv_misses_total", "alpha") == stats_a.misses == 1
        assert value(s, "durablekv_sets_total", "alpha") == stats_a.sets == 3
        assert value(s, "durablekv_hits_total", "beta", tier="memory") == stats_b.memory_hits == 0
        assert value(s, "durablekv_misses_total", "beta") == stats_b.misses == 2
        assert value(s, "durablekv_sets_total", "beta") == stats_b.sets == 1


# --------------------------------------------------------------------------- lifecycle

def test_open_close_reopen_never_duplicates_and_leaves_global_registry_alone(tmp_path):
    before = global_registry_names()
    shared = CollectorRegistry()
    for round_ in range(3):
        cache = open_cache(tmp_path / "c", name="c")
        try:
            cache[f"round{round_}"] = round_
            collector = CacheCollector(cache)
            shared.register(collector)          # one registry, reused across reopens
            with serve(cache, port=0) as s1, serve(cache, port=0) as s2:
                assert s1.port != s2.port
                for server in (s1, s2):
                    samples = samples_by_key(scrape(server.url)[1])
                    assert value(samples, "durablekv_sets_total", "c") == 1  # counts since open
            samples = samples_by_key(generate_latest(shared).decode())
            assert value(samples, "durablekv_sets_total", "c") == 1
        finally:
            cache.close()
        # a collector still holding the closed cache scrapes fine and shows nothing for it
        text = generate_latest(shared).decode()
        assert 'cache="c"' not in text
        assert {f.name for f in text_string_to_metric_families(text)} >= {"durablekv_hits"}
        shared.unregister(collector)
    assert global_registry_names() == before
    assert "durablekv" not in generate_latest(REGISTRY).decode()


def test_closed_server_frees_its_port_and_close_is_idempotent(tmp_path):
    with open_cache(tmp_path / "c") as cache:
        server = serve(cache, port=0)
        port = server.port
        scrape(server.url)
        server.close()
        server.close()
        assert server.closed
        with pytest.raises(OSError):
            scrape(server.url)
        again = serve(cache, port=port)  # the same port can be bound again
        try:
            assert again.port == port
            scrape(again.url)
        finally:
            again.close()


def test_closed_cache_is_skipped_and_never_breaks_a_scrape(tmp_path):
    closed = open_cache(tmp_path / "closed", name="gone")
    closed["a"] = 1
    with open_cache(tmp_path / "open", name="here") as live:
        live["b"] = 2
        with serve(closed, live, port=0) as server:
            assert 'cache="gone"' in scrape(server.url)[1]
            closed.close()
            _, text = scrape(server.url)
    assert 'cache="gone"' not in text
    samples = samples_by_key(text)
    assert value(samples, "durablekv_sets_total", "here") == 1


def test_cache_closing_between_check_and_read_is_skipped():
    stub = StubCache("racy")
    collector = CacheCollector(stub)

    class ClosesOnRead(StubCache):
        closed = property(lambda self: False, lambda self, v: None)  # looks open...

        def stats(self):
            raise CacheClosedError(self.path)  # ...but closed before stats() ran

    registry = CollectorRegistry()
    registry.register(collector)
    collector.add(ClosesOnRead("late"))
    text = generate_latest(registry).decode()
    assert 'cache="racy"' in text and 'cache="late"' not in text


def test_describe_reads_no_cache_and_two_collectors_in_one_registry_clash():
    stub = StubCache("s")
    registry = CollectorRegistry()
    collector = CacheCollector(stub)
    registry.register(collector)
    assert stub.stats_calls == 0, "register() must use describe(), not read the cache"
    assert {m.name for m in collector.describe()} == {name for name, _, _ in METRIC_FAMILIES}
    # one collector carries several caches; a second one in the same registry is an error
    with pytest.raises(ValueError, match="Duplicated timeseries"):
        registry.register(CacheCollector(StubCache("t")))


def test_collector_rejects_two_open_caches_with_one_name_and_accepts_a_reopen():
    first = StubCache("same")
    collector = CacheCollector(first)
    with pytest.raises(ValueError, match="same"):
        collector.add(StubCache("same"))
    with pytest.raises(ValueError, match="same"):
        CacheCollector(StubCache("same"), StubCache("same"))
    first.closed = True
    reopened = StubCache("same")
    collector.add(reopened)                  # the closed one is dropped
    assert collector.caches == (reopened,)
    collector.remove(reopened)
    assert collector.caches == ()


# --------------------------------------------------------------------------- bug cases

def test_br027_total_suffix_collisions_histogram_and_content_type(tmp_path):
    # BR-027 scenario: 3 hits, 2 misses, 1 eviction, 1 flush.
    with open_cache(tmp_path / "c", name="br027", max_pages=2) as cache:
        cache["a"], cache["b"], cache["c"] = 1, 2, 3     # a is evicted (exact LRU of 2)
        assert (cache.get("b"), cache.get("c"), cache.get("b")) == (2, 3, 2)
        assert cache.get("x") is None and cache.get("y") is None
        cache.flush()
        stats, histograms = cache.stats(), cache.histograms()
        with serve(cache, port=0) as server:
            content_type, text = scrape(server.url)
            om_type, om_text = scrape(server.url, accept=OPENMETRICS_ACCEPT)
    assert (stats.hits, stats.misses, stats.evictions) == (3, 2, 1)
    assert stats.flushes == 1

    # 6. the content type is the Prometheus text format (and OpenMetrics on request)
    assert content_type.startswith("text/plain; version=0.0.4"), content_type
    assert om_type.startswith("application/openmetrics-text; version=1.0.0"), om_type

    # 2. both expositions parse with the official parsers
    families = list(text_string_to_metric_families(text))
    om_families = list(parse_openmetrics(om_text))
    assert [f.name for f in families] == [f.name for f in om_families]

    # 3. one _total on every counter sample, none anywhere else, never _total_total
    assert "_total_total" not in text and "_total_total" not in om_text
    for family in families:
        for s in family.samples:
            if family.type == "counter":
                assert s.name == family.name + "_total", s.name
                assert not family.name.endswith("_total")
            else:
                assert "_total" not in s.name, s.name
    # TYPE/HELP lines: OpenMetrics names the family by its base name; the 0.0.4
    # text format names it as its samples are named (Prometheus' text parser
    # reads a counter's TYPE under the sample name, hence "<base>_total").
    counters = {f.name for f in families if f.type == "counter"}
    for line in om_text.splitlines():
        if line.startswith(("# TYPE ", "# HELP ")):
            assert not line.split()[2].endswith("_total"), line
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, typ = line.split()
            assert (typ == "counter") == name.endswith("_total"), line
            if typ == "counter":
                assert name[: -len("_total")] in counters

    # 4. no two families share a base name once _total is stripped, and no
    #    family's name or sample name is another family's name or sample name
    #    (no gauge durablekv_evictions next to counter durablekv_evictions_total)
    bases = [f.name.removesuffix("_total") for f in families]
    assert len(bases) == len(set(bases))
    names_of = {f.name: {f.name} | {s.name for s in f.samples} for f in families}
    for a, names_a in names_of.items():
        for b, names_b in names_of.items():
            assert a == b or not names_a & names_b, (a, b, names_a & names_b)

    # 5. histogram buckets: increasing le ending in +Inf; _sum and _count; +Inf == _count
    samples = samples_by_key(text)
    for hist in HISTOGRAMS:
        family = next(f for f in families if f.name == hist)
        assert family.type == "histogram"
        les = [s.labels["le"] for s in family.samples if s.name == hist + "_bucket"]
        assert les[-1] == "+Inf"
        bounds = [float(le) for le in les]
        assert bounds == sorted(bounds) and len(set(bounds)) == len(bounds)
        counts = [s.value for s in family.samples if s.name == hist + "_bucket"]
        assert counts == sorted(counts), "cumulative bucket counts must not decrease"
        assert value(samples, hist + "_bucket", "br027", le="+Inf") == value(samples, hist + "_count", "br027")
        assert (hist + "_sum", frozenset({("cache", "br027")})) in samples

    # 7. and the numbers agree with cache.stats()
    assert_scrape_matches_stats(samples, "br027", stats, histograms)
    assert value(samples, "durablekv_flush_duration_seconds_count", "br027") == 1


WEIRD = 'we"ird\\name\nx'


def test_br028_label_values_and_help_are_escaped(tmp_path):
    with open_cache(tmp_path / "weird", name=WEIRD) as cache:
        assert cache.name == WEIRD
        cache["k"] = "v"
        cache.get("k"), cache.get("missing")
        with serve(cache, port=0) as server:
            _, text = scrape(server.url)
            _, om_text = scrape(server.url, accept=OPENMETRICS_ACCEPT)
        stats = cache.stats()

    escaped = 'cache="we\\"ird\\\\name\\nx"'   # what goes on the wire: we\"ird\\name\nx
    for body in (text, om_text):
        assert escaped in body
        for line in body.splitlines():
            if not line or line.startswith("#"):
                continue
            # one sample per line: name{labels} value, with the whole label set on this line
            assert re.fullmatch(r'durablekv_[a-z_]+\{cache="(?:[^"\\]|\\.)*"(?:,[a-z]+="[^"]*")*\} \S+', line), line
            assert escaped in line, line

    for families in (text_string_to_metric_families(text), parse_openmetrics(om_text)):
        seen = set()
        for family in families:
            for s in family.samples:
                assert s.labels["cache"] == WEIRD
                seen.add(s.name)
        assert "durablekv_misses_total" in seen
    samples = samples_by_key(text)
    assert value(samples, "durablekv_misses_total", WEIRD) == stats.misses == 1
    assert value(samples, "durablekv_hits_total", WEIRD, tier="memory") == stats.memory_hits == 1

    # HELP text: the parser gives back exactly the help the collector declares,
    # and each HELP stays on one line.
    helps = {name: help_ for name, _, help_ in METRIC_FAMILIES}
    for family in text_string_to_metric_families(text):
        assert family.documentation == helps[family.name]
    assert all("\n" not in h for h in helps.values())


def test_br028_help_with_backslash_and_newline_is_escaped():
    """HELP escaping is prometheus_client's; pin it for the text format we serve."""
    from prometheus_client.metrics_core import GaugeMetricFamily

    class Odd:
        def collect(self):
            g = GaugeMetricFamily("durablekv_odd", "a\\b\nc", labels=["cache"])
            g.add_metric([WEIRD], 1)
            yield g

    registry = CollectorRegistry()
    registry.register(Odd())
    text = generate_latest(registry).decode()
    assert "# HELP durablekv_odd a\\\\b\\nc\n" in text
    (family,) = text_string_to_metric_families(text)
    assert family.documentation == "a\\b\nc"
    assert family.samples[0].labels["cache"] == WEIRD


# --------------------------------------------------------------------------- hot path

def test_hot_path_does_not_import_prometheus_client(tmp_path):
    """gets and sets bump plain ints: using a Cache never imports prometheus_client."""
    code = textwrap.dedent(f"""
        import sys
        import durablekv
        import durablekv.cache
        from durablekv import Cache
        with Cache({str(tmp_path / "c")!r}, page_size=1, max_pages=2) as cache:
            for i in range(50):
                cache[i] = i
                cache.get(i)
                cache.get(i - 10)
                cache.get("missing")
            cache.delete(3)
            cache.flush()
            stats = cache.stats()
            cache.histograms()
        assert stats.sets == 50 and stats.hits > 0 and stats.misses > 0, stats
        loaded = sorted(m for m in sys.modules if m.split(".")[0] == "prometheus_client")
        assert not loaded, loaded
        print("ok")
    """)
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


@pytest.mark.parametrize("thing", ["x", None, 42])
def test_a_collector_of_something_that_is_not_a_cache_fails_at_once(thing):
    """Not at the first scrape, deep inside prometheus_client."""
    with pytest.raises(TypeError, match="CacheCollector carries durablekv.Cache objects"):
        CacheCollector(thing)
    with pytest.raises(TypeError, match=type(thing).__qualname__):
        CacheCollector().add(thing)
    with pytest.raises(TypeError):
        serve(thing, port=0)


def test_a_collector_given_a_list_of_caches_says_to_unpack_it(tmp_path):
    from durablekv import Cache
    with Cache(tmp_path / "c") as cache:
        with pytest.raises(TypeError, match=r"CacheCollector\(\*caches\)"):
            CacheCollector([cache])


def test_a_busy_port_is_an_oserror_that_names_the_port_and_the_fix(tmp_path):
    """serve() on a taken port raised prometheus_client's bare OSError
    ("[Errno 98] Address already in use"); only the CLI said which port and
    what to do. The library says it now, in the words the CLI uses, and it
    is still an OSError (chained to the original) for ``except OSError``."""
    import errno
    import socket

    from durablekv import DurableKVError, MetricsServeError

    with open_cache(tmp_path / "c") as cache, socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(OSError) as info:
            serve(cache, port=port)
        exc = info.value
        assert isinstance(exc, MetricsServeError) and isinstance(exc, DurableKVError)
        assert exc.errno == errno.EADDRINUSE and exc.port == port
        assert isinstance(exc.__cause__, OSError) and exc.cause is exc.__cause__
        msg = str(exc)
        assert msg.startswith(f"cannot serve metrics on 127.0.0.1:{port}: "), msg
        assert "pick another port (port=0 picks a free one)" in msg, msg
        with serve(cache, port=0) as server:  # the advice works
            assert server.port != port
            scrape(server.url)


# -- register(): caches opened by different parts of an application -----------------


def _families_by_name(text: str) -> dict:
    families = list(text_string_to_metric_families(text))
    names = [f.name for f in families]
    assert len(names) == len(set(names)), f"a family appears twice: {names}"
    return {f.name: f for f in families}


def test_two_parts_registering_their_own_cache_share_one_family_per_metric(tmp_path):
    from durablekv import Cache
    from durablekv.metrics import register, unregister

    registry = CollectorRegistry()
    a = Cache(tmp_path / "a", name="sessions", flush_interval=30)
    b = Cache(tmp_path / "b", name="pages", flush_interval=30)
    try:
        first = register(registry, a)    # one part of the application
        second = register(registry, b)   # another part, with the cache it opened
        assert first is second and first.caches == (a, b)
        assert register(registry, a) is first and first.caches == (a, b)  # no-op
        a["x"] = 1
        a.get("x")
        b.get("nope")
        text = generate_latest(registry).decode()
        fams = _families_by_name(text)
        assert {n for n, *_ in METRIC_FAMILIES} <= set(fams)
        for name, family in fams.items():
            assert {s.labels["cache"] for s in family.samples} == {"sessions", "pages"}, name
        hits = {(s.labels["cache"], s.labels["tier"]): s.value
                for s in fams["durablekv_hits"].samples if s.name.endswith("_total")}
        assert hits[("sessions", "memory")] == 1 and hits[("pages", "memory")] == 0
        # the OpenMetrics form is valid too (its parser is strict about families)
        from prometheus_client.openmetrics.exposition import generate_latest as om_latest
        om_names = [f.name for f in parse_openmetrics(om_latest(registry).decode())]
        assert len(om_names) == len(set(om_names)) and "durablekv_hits" in om_names

        unregister(registry, a)
        fams = _families_by_name(generate_latest(registry).decode())
        assert {s.labels["cache"] for s in fams["durablekv_misses"].samples} == {"pages"}
        unregister(registry, b)  # the last cache: the collector leaves the registry
        assert "durablekv_" not in generate_latest(registry).decode()
        again = register(registry, b)  # and a later register starts afresh
        assert again is not first and again.caches == (b,)
        b.close()  # a closed cache is skipped, and may still be unregistered
        assert "cache=" not in generate_latest(registry).decode()
        unregister(registry, b)
        unregister(registry, b)  # harmless
    finally:
        a.close()
        b.close()


def test_register_refuses_a_second_cache_of_the_same_name_and_names_the_fix(tmp_path):
    from durablekv.metrics import register

    registry = CollectorRegistry()
    register(registry, StubCache("same"))
    with pytest.raises(ValueError, match="give each open cache its own name="):
        register(registry, StubCache("same"))
    other = CollectorRegistry()
    other.register(CacheCollector(StubCache("x")))
    with pytest.raises(ValueError, match=r"durablekv.metrics.register\(registry, cache\)"):
        register(other, StubCache("y"))


@pytest.mark.parametrize("port", [-1, 65536, 99999, 1.5, "9109", True])
def test_serve_refuses_a_port_outside_0_to_65535(tmp_path, port):
    from durablekv import Cache
    from durablekv.metrics import serve
    with Cache(tmp_path / "c") as cache:
        with pytest.raises(ValueError, match="0..65535"):
            serve(cache, port=port)
