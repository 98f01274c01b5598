"""Prometheus metrics of block pools, read at scrape time (no numpy needed here).

Names follow vLLM's where one exists (``vllm:gpu_cache_usage_perc``,
``vllm:prefix_cache_queries``, ``vllm:prefix_cache_hits``,
``vllm:num_preemptions``), with the ``durablekv_`` prefix:

=========================================  =======  ==============================================
``durablekv_kv_cache_usage_perc``          gauge    blocks held by sequences / all blocks, 0..1
``durablekv_kv_blocks{state}``             gauge    blocks now: ``used``, ``cached`` (evictable), ``free``
``durablekv_prefix_cache_queries_total``   counter  prompt tokens looked up in the prefix cache
``durablekv_prefix_cache_hits_total{tier}`` counter prompt tokens found: ``tier="memory"|"durable"``
``durablekv_num_preemptions_total``        counter  sequences preempted (recompute)
``durablekv_kv_evictions_total``           counter  cached blocks evicted from memory
``durablekv_kv_spilled_blocks_total``      counter  blocks written to the durable tier (as they filled, or on eviction)
=========================================  =======  ==============================================

Every family has a ``cache`` label: the name given to :meth:`KVPoolCollector.add`,
by default the name of the durablekv Cache under the pool's
:class:`~durablekv.llm.kvstore.KVBlockStore` (so the Grafana dashboard's
``$cache`` variable selects a pool with its Cache), or ``"kv"`` without a store.
Like :class:`durablekv.metrics.CacheCollector`, nothing is registered globally::

    registry.register(KVPoolCollector(pool))
"""

from __future__ import annotations

import threading
from typing import Any, Iterator

from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric

__all__ = ["KVPoolCollector"]


def _pool_name(pool: Any) -> str:
    store = getattr(pool, "store", None)
    return store.name if store is not None else "kv"


class KVPoolCollector:
    """A prometheus_client collector over one or more block pools.

    :param pools: :class:`~durablekv.llm.pool.BlockPool` objects (anything with
        ``stats()`` returning :class:`~durablekv.llm.pool.PoolStats`).

    Scrapes read ``pool.stats()``, a snapshot of plain integers; they never
    block the engine for more than that copy.
    """

    def __init__(self, *pools: Any) -> None:
        self._lock = threading.Lock()   # guards _pools
        self._pools: list[tuple[str, Any]] = []
        for pool in pools:
            self.add(pool)

    def add(self, pool: Any, name: str | None = None) -> None:
        """Also report ``pool``, under the ``cache`` label ``name``."""
        with self._lock:
            self._pools.append((_pool_name(pool) if name is None else str(name), pool))

    def describe(self) -> Iterator[Metric]:
        return iter(self._families())

    @staticmethod
    def _families() -> list[Metric]:
        return [
            GaugeMetricFamily("durablekv_kv_cache_usage_perc",
                              "Share of KV blocks held by sequences (0..1); free and "
                              "evictable cached blocks are not in use", labels=["cache"]),
            GaugeMetricFamily("durablekv_kv_blocks", "KV blocks by state now",
                              labels=["cache", "state"]),
            CounterMetricFamily("durablekv_prefix_cache_queries",
                                "Prompt tokens looked up in the prefix cache", labels=["cache"]),
            CounterMetricFamily("durablekv_prefix_cache_hits",
                                "Prompt tokens found in the prefix cache, by tier",
                                labels=["cache", "tier"]),
            CounterMetricFamily("durablekv_num_preemptions",
                                "Sequences preempted (blocks freed, recomputed later)",
                                labels=["cache"]),
            CounterMetricFamily("durablekv_kv_evictions",
                                "Cached KV blocks evicted from memory", labels=["cache"]),
            CounterMetricFamily("durablekv_kv_spilled_blocks",
                                "KV blocks written to the durable tier", labels=["cache"]),
        ]

    def collect(self) -> Iterator[Metric]:
        usage, blocks, queries, hits, preempt, evict, spill = self._families()
        with self._lock:
            pools = list(self._pools)
        for name, pool in pools:
            s = pool.stats()
            usage.add_metric([name], s.usage)
            used = s.num_blocks - s.free_blocks - s.cached_free_blocks
            for state, n in (("used", used), ("cached", s.cached_free_blocks),
                             ("free", s.free_blocks)):
                blocks.add_metric([name, state], n)
            queries.add_metric([name], s.prefix_queries_tokens)
            hits.add_metric([name, "memory"], s.prefix_hits_memory_tokens)
            hits.add_metric([name, "durable"], s.prefix_hits_durable_tokens)
            preempt.add_metric([name], s.preemptions)
            evict.add_metric([name], s.evictions)
            spill.add_metric([name], s.spilled_blocks + getattr(s, "written_blocks", 0))
        yield from (usage, blocks, queries, hits, preempt, evict, spill)
