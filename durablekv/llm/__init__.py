"""durablekv.llm: paged KV blocks for LLM serving, with durablekv as the tier below memory.

What vLLM-style serving does with KV memory, in numpy (the ``llm`` extra):
chained block hashes (:mod:`.hashing`), paged attention (:mod:`.attention`),
a block pool with prefix caching, copy-on-write and LRU eviction
(:mod:`.pool`), a durable tier in a :class:`durablekv.Cache`
(:mod:`.kvstore`), continuous and static batching (:mod:`.scheduler`), a
tiny deterministic transformer (:mod:`.model`), the engine loop
(:mod:`.engine`), Prometheus metrics (:mod:`.metrics`) and the benchmark
behind ``durablekv llm-bench`` (:mod:`.bench`). See docs/llm.md.

Names are imported lazily, so ``durablekv.llm.metrics`` works without numpy.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = [
    "block_hashes",
    "paged_attention",
    "paged_prefill_attention",
    "BlockPool",
    "PoolStats",
    "PrefixMatch",
    "KVBlockStore",
    "KVBlockCorruptError",
    "KVBlockCorruptWarning",
    "Request",
    "Sequence",
    "ContinuousScheduler",
    "StaticScheduler",
    "TinyTransformer",
    "LLMEngine",
    "KVPoolCollector",
]

_WHERE = {
    "block_hashes": "hashing",
    "paged_attention": "attention",
    "paged_prefill_attention": "attention",
    "BlockPool": "pool",
    "PoolStats": "pool",
    "PrefixMatch": "pool",
    "KVBlockStore": "kvstore",
    "KVBlockCorruptError": "kvstore",
    "KVBlockCorruptWarning": "kvstore",
    "Request": "scheduler",
    "Sequence": "scheduler",
    "ContinuousScheduler": "scheduler",
    "StaticScheduler": "scheduler",
    "TinyTransformer": "model",
    "LLMEngine": "engine",
    "KVPoolCollector": "metrics",
}


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'durablekv.llm' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
