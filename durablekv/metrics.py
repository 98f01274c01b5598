"""Prometheus exporter: a custom collector that reads cache counters at scrape time.

The cache never touches prometheus_client: it keeps plain integers
(:class:`durablekv.stats.CacheStats`) and plain histograms
(:class:`durablekv.stats.HistogramSnapshot`). :class:`CacheCollector` turns a
snapshot of those into metric families when Prometheus scrapes, so a get or a
set costs no metric object, and importing :mod:`durablekv` does not import
prometheus_client (only importing this module does).

Nothing here registers anything in prometheus_client's global ``REGISTRY``:
the application registers its caches where it wants them, or calls
:func:`serve`, which uses a registry of its own::

    from durablekv.metrics import register, serve, unregister
    register(registry, cache)        # each part of an application, for the cache it opened
    register(registry, other)        # joins the same collector: one family per metric
    unregister(registry, cache)      # the collector leaves the registry with its last cache
    server = serve(cache, port=9109, addr="127.0.0.1")
    server.port, server.url; server.close()           # port=0 picks a free port

Closed caches are skipped: a scrape after ``cache.close()`` simply has no
series for that cache (Prometheus marks them stale), and never fails. Its
counters count "since open", so a cache reopened under the same name starts
again from zero, which ``rate()`` treats as an ordinary counter reset.

Every family carries a ``cache`` label (the cache's ``name``); the shards of
a :class:`~durablekv.sharded.ShardedCache` (pass the ShardedCache itself)
also carry a ``shard`` label, and ``sum by (cache)`` adds them up. Label values
and HELP text are escaped by prometheus_client's exposition code, so any
name (quotes, backslashes, newlines) scrapes as valid text format.
"""

from __future__ import annotations

import math

import threading
import weakref
from typing import Any, Callable, Iterator, NamedTuple

from prometheus_client import CollectorRegistry, start_http_server

from .errors import MetricsServeError
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.utils import floatToGoString

from durablekv.errors import CacheClosedError
from durablekv.stats import CacheStats, HistogramSnapshot

__all__ = ["CacheCollector", "MetricsServer", "serve", "register", "unregister",
           "METRIC_FAMILIES"]


class _Family(NamedTuple):
    """One exposed metric family.

    ``name`` is the family name as Prometheus stores it (a counter's samples
    get ``_total`` from prometheus_client; the name here never has it).
    ``source`` reads the value from a :class:`CacheStats` (counters, gauges)
    or names the key of ``cache.histograms()`` (histograms).
    """

    name: str
    type: str  # "counter", "gauge" or "histogram"
    help: str
    source: Any


def _field(name: str) -> Callable[[CacheStats], float]:
    return lambda s: getattr(s, name)


#: Every family the collector exposes besides ``durablekv_hits`` (which has a
#: ``tier`` label too), in exposition order. Base units: seconds, bytes.
_SIMPLE: tuple[_Family, ...] = (
    _Family("durablekv_misses", "counter",
            "Gets that found no live entry (absent or expired), since the cache was opened.",
            _field("misses")),
    _Family("durablekv_sets", "counter",
            "Writes of a value acknowledged (set, add, incr, decr, touch), since open.", _field("sets")),
    _Family("durablekv_deletes", "counter",
            "Entries removed by delete, pop, popitem or touch(key, 0), since open.", _field("deletes")),
    _Family("durablekv_page_faults", "counter",
            "Pages made resident again from SQLite or the write-behind queue, since open.",
            _field("page_faults")),
    _Family("durablekv_warmed_pages", "counter",
            "Pages the warm restart read back into the memory tier after open (not page "
            "faults), since open.", _field("warmed_pages")),
    _Family("durablekv_residency_errors", "counter",
            "Residency lists ignored as damaged or foreign at open, and failed saves of the "
            "list (warm restart hints; no data is lost), since open.",
            _field("residency_errors")),
    _Family("durablekv_expirations", "counter",
            "Entries dropped because their TTL had passed, since open.", _field("expirations")),
    _Family("durablekv_flushes", "counter",
            "Write-behind transactions committed to SQLite, since open.", _field("flushes")),
    _Family("durablekv_flushed_pages", "counter",
            "Pages written to SQLite by write-behind transactions, since open.",
            _field("flushed_pages")),
    _Family("durablekv_flush_errors", "counter",
            "Write-behind flush attempts that failed, since open.", _field("flush_errors")),
    _Family("durablekv_flush_duration_seconds", "histogram",
            "Duration of one write-behind transaction (pages + checkpoint) in seconds.",
            "flush_seconds"),
    _Family("durablekv_flush_pages", "histogram",
            "Pages written by one write-behind transaction.", "flush_pages"),
    _Family("durablekv_pending_pages", "gauge",
            "Evicted dirty pages waiting for the write-behind batcher.", _field("pending_pages")),
    _Family("durablekv_dirty_pages", "gauge",
            "Pages (resident or pending) whose latest version is not yet in SQLite.",
            _field("dirty_pages")),
    _Family("durablekv_resident_pages", "gauge",
            "Pages in the memory tier.", _field("resident_pages")),
    _Family("durablekv_max_pages", "gauge",
            "Bound of the memory tier in pages.", _field("max_pages")),
    _Family("durablekv_memory_bytes", "gauge",
            "Bytes of the resident pages' entries (what max_memory_bytes bounds).",
            _field("memory_bytes")),
    _Family("durablekv_max_memory_bytes", "gauge",
            "Bound of the memory tier in bytes (+Inf when there is none).",
            _field("max_memory_bytes")),
    _Family("durablekv_store_data_bytes", "gauge",
            "Bytes of the page blobs in the store as last committed (what size_limit bounds).",
            _field("store_data_bytes")),
    _Family("durablekv_size_limit_bytes", "gauge",
            "Bound of the store in bytes of page blobs (+Inf when there is none).",
            _field("size_limit")),
    _Family("durablekv_oldest_unflushed_age_seconds", "gauge",
            "Age in seconds of the oldest acknowledged write not yet in SQLite (0 when none).",
            _field("oldest_unflushed_seconds")),
    _Family("durablekv_replay_log_bytes", "gauge",
            "Bytes in the replay log's segments.", _field("log_bytes")),
    _Family("durablekv_store_bytes", "gauge",
            "Bytes of pages.sqlite3 and its WAL.", _field("store_bytes")),
    _Family("durablekv_checkpoint_lsn", "gauge",
            "Checkpoint LSN: every change with an LSN up to this one is in SQLite.",
            _field("checkpoint_lsn")),
    _Family("durablekv_last_lsn", "gauge",
            "LSN of the latest acknowledged change.", _field("last_lsn")),
    _Family("durablekv_recovered_records", "gauge",
            "Replay-log records applied again when the cache was last opened.",
            _field("recovered_records")),
    _Family("durablekv_recovery_torn_records", "gauge",
            "Damaged records cut from the replay log's tail when the cache was last opened.",
            _field("torn_records")),
    _Family("durablekv_recovery_salvaged_bytes", "gauge",
            "Bytes of a damaged replay log that salvage_log gave up on (moved aside, their "
            "writes lost) when the cache was last opened.", _field("salvaged_bytes")),
    _Family("durablekv_recovery_duration_seconds", "gauge",
            "Seconds spent replaying the log when the cache was last opened.",
            _field("recovery_seconds")),
)

_HITS = _Family(
    "durablekv_hits", "counter",
    'Gets that found a live entry, by tier: "memory" (resident page) or "store" '
    "(needed a page fault), since open.",
    {"memory": "memory_hits", "store": "store_hits"},
)

_EVICTIONS = _Family(
    "durablekv_evictions", "counter",
    'Pages evicted (entries, for tier "memory" under policy "midpoint"), by tier: '
    '"memory" (left the memory tier by its policy, for max_pages or max_memory_bytes) '
    'or "store" (deleted from the store for size_limit), since open.',
    {"memory": "evictions", "store": "store_evictions"},
)

#: Counters with a ``tier`` label; ``source`` maps each tier to its CacheStats field.
_TIERED = (_HITS, _EVICTIONS)

#: ``(name, type, help)`` of every family, in exposition order (for docs and tests).
METRIC_FAMILIES: tuple[tuple[str, str, str], ...] = tuple(
    (f.name, f.type, f.help) for f in (*_TIERED, *_SIMPLE)
)


def _histogram_buckets(snap: HistogramSnapshot) -> list[tuple[str, float]]:
    """``le`` buckets of a snapshot, cumulative, ``+Inf`` last (equal to ``count``)."""
    if len(snap.cumulative) != len(snap.bounds) + 1:
        raise ValueError(f"histogram snapshot has {len(snap.cumulative)} cumulative counts "
                         f"for {len(snap.bounds)} bounds; expected bounds + 1 (+Inf last)")
    les = [floatToGoString(b) for b in snap.bounds] + ["+Inf"]
    return list(zip(les, snap.cumulative))


class CacheCollector:
    """A prometheus_client collector for one or more caches.

    Register it in a :class:`prometheus_client.CollectorRegistry`; at each
    scrape it takes ``cache.stats()`` and ``cache.histograms()`` of every open
    cache it carries and exposes them with a ``cache`` label. It keeps no
    metric objects between scrapes, so the hot path of a cache never sees it.

    :param caches: objects with ``name``, ``closed``, ``stats()`` and
        ``histograms()`` (a :class:`durablekv.Cache`). Their names must differ
        among the caches that are open at the same time.
    :raises ValueError: two open caches share a ``name``.
    :raises TypeError: one of ``caches`` is not a cache.

    Thread-safety: :meth:`collect`, :meth:`add` and :meth:`remove` may run
    concurrently; a lock guards the list of caches only, never a scrape.
    Closed caches are skipped (see the module docstring) and dropped from the
    list by the next :meth:`add`.
    """

    def __init__(self, *caches: Any) -> None:
        self._lock = threading.Lock()  # guards self._caches (a tuple, replaced on change)
        self._caches: tuple[Any, ...] = ()
        for cache in caches:
            self.add(cache)

    @property
    def caches(self) -> tuple[Any, ...]:
        """The caches this collector carries (open or closed), in order."""
        return self._caches

    def add(self, cache: Any) -> None:
        """Carry one more cache; closed caches already carried are dropped.

        :raises ValueError: an open cache with the same ``name`` is carried already.
        :raises TypeError: ``cache`` is not a cache (it lacks ``name``,
            ``closed``, ``stats()`` or ``histograms()``).
        """
        if isinstance(getattr(cache, "shards", None), tuple):  # a ShardedCache: its shards
            for shard in cache.shards:
                self.add(shard)
            return
        missing = [a for a in ("name", "closed", "stats", "histograms") if not hasattr(cache, a)]
        if missing:
            hint = ("; pass the caches themselves: CacheCollector(*caches)"
                    if isinstance(cache, (list, tuple, set)) else "")
            raise TypeError(f"CacheCollector carries durablekv.Cache objects; got "
                            f"{type(cache).__qualname__} {cache!r:.60}, which has no "
                            f"{', '.join(missing)}{hint}")
        with self._lock:
            kept = tuple(c for c in self._caches if not c.closed)
            if any(c is cache for c in kept):
                self._caches = kept
                return
            for other in kept:
                if other.name == cache.name and _shard(other) == _shard(cache):
                    raise ValueError(
                        f"a cache named {cache.name!r} is already exported by this collector "
                        f"(path {getattr(other, 'path', '?')!r}); give each open cache its own "
                        f"name= or close the other one first")
            self._caches = kept + (cache,)

    def remove(self, cache: Any) -> None:
        """Stop exporting ``cache`` (no error if it was not carried); for a
        ShardedCache, every one of its shards."""
        gone = getattr(cache, "shards", None)
        gone = gone if isinstance(gone, tuple) else (cache,)
        with self._lock:
            self._caches = tuple(c for c in self._caches if not any(c is g for g in gone))

    def describe(self) -> Iterator[Metric]:
        """The families this collector exposes, without samples.

        A registry calls this at ``register()`` to detect name clashes without
        reading any cache.
        """
        yield from self._families()

    def collect(self) -> Iterator[Metric]:
        """One family per metric, with a sample set per open cache."""
        snapshots = []
        for cache in self._caches:  # a tuple, replaced whole by add(): no lock needed
            if cache.closed:
                continue
            try:
                shard = _shard(cache)
                labels = [cache.name] if shard is None else [cache.name, str(shard)]
                snapshots.append((labels, cache.stats(), cache.histograms()))
            except CacheClosedError:  # closed between the check and the read
                continue
        # A ShardedCache's shards carry a ``shard`` label beside ``cache``;
        # every sample of a family has the same label names, so a plain
        # cache exported beside them gets shard="" (to Prometheus, no label).
        sharded = any(len(labels) == 2 for labels, _, _ in snapshots)
        if sharded:
            snapshots = [(labels if len(labels) == 2 else labels + [""], s, h)
                         for labels, s, h in snapshots]
        all_families = self._families(["cache", "shard"] if sharded else ["cache"])
        for family, spec in zip(all_families, _TIERED):
            for labels, stats, _ in snapshots:
                for tier, field in spec.source.items():
                    family.add_metric(labels + [tier], getattr(stats, field))
            yield family
        for family, spec in zip(all_families[len(_TIERED):], _SIMPLE):
            for labels, stats, histograms in snapshots:
                if spec.type == "histogram":
                    snap = histograms[spec.source]
                    family.add_metric(labels, _histogram_buckets(snap), snap.sum)
                else:
                    value = spec.source(stats)
                    # an unset bound (None) is no bound: +Inf
                    family.add_metric(labels, math.inf if value is None else value)
            yield family

    @staticmethod
    def _families(labels: list[str] | None = None) -> list[Metric]:
        labels = labels or ["cache"]
        tiered = [CounterMetricFamily(f.name, f.help, labels=labels + ["tier"])
                  for f in _TIERED]
        kinds = {"counter": CounterMetricFamily, "gauge": GaugeMetricFamily,
                 "histogram": HistogramMetricFamily}
        return tiered + [kinds[f.type](f.name, f.help, labels=labels) for f in _SIMPLE]


def _shard(cache: Any) -> int | None:
    """The shard index of a ShardedCache's shard, None for any other cache."""
    return getattr(cache, "shard", None)


#: The one collector :func:`register` keeps in each registry (weakly: a
#: registry that goes away takes its entry with it).
_shared: "weakref.WeakKeyDictionary[Any, CacheCollector]" = weakref.WeakKeyDictionary()
_shared_lock = threading.Lock()  # guards _shared, and each register/unregister as one step


def register(registry: Any, *caches: Any) -> CacheCollector:
    """Export ``caches`` in ``registry``; the one registration call that cannot collide.

    Each registry gets one shared :class:`CacheCollector`, made and
    registered by the first call; later calls (from any part of the
    application, for the cache it opened) add their caches to it. So the
    exposition has one family per metric name, with the ``cache`` label
    telling the caches apart. (Two separate ``CacheCollector`` objects in
    one registry would describe the same families, which prometheus_client
    refuses as "Duplicated timeseries".) Registering a cache already
    exported there is a no-op.

    :param registry: a :class:`prometheus_client.CollectorRegistry` (e.g.
        ``prometheus_client.REGISTRY``: the application chooses).
    :param caches: :class:`durablekv.Cache` objects (see :class:`CacheCollector`).
    :returns: the registry's shared collector.
    :raises ValueError: an open cache with the same ``name`` is exported in
        this registry already (caches before it in ``caches`` stay
        registered); or a ``CacheCollector`` registered directly with
        ``registry.register()`` already exposes the families.
    :raises TypeError: one of ``caches`` is not a cache.

    Thread-safe.
    """
    with _shared_lock:
        collector = _shared.get(registry)
        if collector is None:
            collector = CacheCollector()
            try:
                registry.register(collector)
            except ValueError as exc:
                raise ValueError(
                    f"the registry already holds a CacheCollector registered with "
                    f"registry.register() ({exc}); register every cache of a registry "
                    "with durablekv.metrics.register(registry, cache), or add it to that "
                    "collector with collector.add(cache)") from exc
            _shared[registry] = collector
        for cache in caches:
            collector.add(cache)
    return collector


def unregister(registry: Any, *caches: Any) -> None:
    """Stop exporting ``caches`` in ``registry`` (see :func:`register`).

    When no open cache is left, the shared collector leaves the registry,
    so a later :func:`register` starts afresh. Caches never registered
    there are ignored. A cache that is closed needs no unregister (a scrape
    skips it), but unregistering it is harmless. Thread-safe.
    """
    with _shared_lock:
        collector = _shared.get(registry)
        if collector is None:
            return
        for cache in caches:
            collector.remove(cache)
        if not any(not c.closed for c in collector.caches):
            registry.unregister(collector)
            del _shared[registry]


class MetricsServer:
    """A running ``/metrics`` endpoint; made by :func:`serve`.

    :ivar port: the TCP port it listens on (the chosen one when asked for 0).
    :ivar url: ``http://HOST:PORT/metrics``.
    :ivar registry: its own :class:`~prometheus_client.CollectorRegistry`.
    :ivar collector: the :class:`CacheCollector` in that registry; ``add()``
        more caches to it while serving.
    """

    def __init__(self, collector: CacheCollector, addr: str, port: int) -> None:
        self.collector = collector
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(collector)
        try:
            started = start_http_server(port, addr=addr, registry=self.registry)
        except OSError as exc:
            raise MetricsServeError(addr, port, exc) from exc
        if not isinstance(started, tuple):  # prometheus_client < 0.17 returned None
            raise RuntimeError("durablekv.metrics needs prometheus_client>=0.17, whose "
                               "start_http_server returns (server, thread)")
        self._httpd, self._thread = started
        self._closed = False
        self._close_lock = threading.Lock()  # guards self._closed
        self.port: int = self._httpd.server_address[1]
        host = {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "::1"}.get(addr, addr)
        if ":" in host:
            host = f"[{host}]"
        self.url = f"http://{host}:{self.port}/metrics"

    def close(self) -> None:
        """Stop serving and free the port; idempotent. Blocks up to ~0.5 s
        (the server's poll interval). The caches are not closed."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join()

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> "MetricsServer":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "serving"
        return f"<MetricsServer {self.url} {state}>"


def serve(*caches: Any, port: int = 9109, addr: str = "127.0.0.1") -> MetricsServer:
    """Serve the caches' metrics over HTTP at ``/metrics`` from a daemon thread.

    Uses prometheus_client's own WSGI server and a registry of its own (never
    the global ``REGISTRY``), so any number of servers, opened and closed in
    one process, never clash ("Duplicated timeseries").

    :param caches: the caches to export (see :class:`CacheCollector`).
    :param port: TCP port; 0 picks a free one (read it from ``.port``).
    :param addr: address to bind; the default serves loopback only.
    :returns: a :class:`MetricsServer`; ``close()`` it (or use ``with``).
    :raises MetricsServeError: (an ``OSError``) the port is taken or the
        address cannot be bound; the message names them and what to do.
    :raises ValueError: two caches share a ``name``, or ``port`` is not 0..65535.
    """
    if type(port) is not int or not 0 <= port <= 65535:
        raise ValueError(f"port={port!r}: a TCP port is an int 0..65535 (0 picks a free one)")
    return MetricsServer(CacheCollector(*caches), addr, port)

