"""A storage backend for SGLang's hierarchical cache (HiCache) on durablekv:
an LLM server's prefix cache that survives a restart and a kill -9.

SGLang loads it as a dynamic backend::

    python -m sglang.launch_server --model-path meta-llama/Llama-3.1-8B-Instruct \\
        --enable-hierarchical-cache --hicache-storage-backend dynamic \\
        --hicache-storage-backend-extra-config '{"backend_name": "durablekv",
            "module_path": "durablekv.llm.sglang",
            "class_name": "DurableKVHiCacheStorage",
            "durablekv_path": "/var/cache/sglang-kv",
            "durablekv_size_limit": 107374182400}'

SGLang's factory calls ``DurableKVHiCacheStorage(storage_config, kwargs)`` and
then ``register_mem_pool_host(pool)``. Configuration comes from the extra
config: ``durablekv_path`` (required), and optionally ``durablekv_size_limit``
(bytes: bounds the page files and the Cache's store each),
``durablekv_max_pages``, ``durablekv_durability`` ("log", the default, keeps
acknowledged pages across a kill -9; "fsync" across a power loss) and
``durablekv_file_page_bytes`` (pages of at least this many bytes are files
of their own, written once; default 1 MiB). It serves SGLang's generic page path
(``batch_get``/``batch_set``); ``"interface_v1"`` (the zero-copy variants) is refused
with a ConfigError that says so.

Keys: SGLang's page hash (a hex string chained over the tokens) joined with
the model name, the tensor/pipeline/context-parallel rank and size (as
SGLang's file backend suffixes them), and the registered host pool's dtype
and layout; the stored key is its SHA-256, a 32-byte durablekv block hash.
A page's size is checked on read against the caller's page.
Values: the page's raw bytes in a :mod:`durablekv.llm.kvstore` block
(header, checksum over key and payload). ``get`` fills the caller's
preallocated page tensor and returns it, or None: a miss, a page of another
size, or a damaged page (dropped, a miss for its own key only: SGLang counts
a raising batch as zero hits, which would switch the tier off for every
key). ``batch_exists`` returns the longest stored prefix.

Each rank is a process of its own, and a durablekv directory belongs to one
process, so every rank stores under ``<durablekv_path>/<model>_tp<rank>_<size>...``
(MLA models, whose KV is the same on every rank, keep a copy per rank).
"""

from __future__ import annotations

import hashlib
import logging
import os
from typing import Any, List, Optional

import numpy as np
import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig

from ..errors import ConfigError, DurableKVError
from .kvstore import DEFAULT_FILE_BLOCK_BYTES, KVBlockStore

__all__ = ["DurableKVHiCacheStorage"]

log = logging.getLogger("durablekv.llm.sglang")

#: threads a batch's pages are read and written by: copies and checksums are
#: CPU work that releases the GIL, so no more threads than cores (measured on
#: 2 cores: 2 threads beat 4)
IO_THREADS = max(1, min(4, os.cpu_count() or 1))

#: extra-config keys this backend reads (beside SGLang's own)
OPTIONS = ("durablekv_path", "durablekv_size_limit", "durablekv_max_pages",
           "durablekv_durability", "durablekv_file_page_bytes")


def _rank_suffix(cfg: HiCacheStorageConfig) -> str:
    """The shard this rank owns, named as SGLang's file backend names it."""
    model = "-".join((cfg.model_name or "").split("/"))
    suffix = f"{model}_tp{cfg.tp_rank}_{cfg.tp_size}"
    if cfg.pp_size > 1:
        suffix += f"_pp{cfg.pp_rank}_{cfg.pp_size}"
    if cfg.attn_cp_size > 1:
        suffix += f"_cp{cfg.attn_cp_rank}_{cfg.attn_cp_size}"
    if getattr(cfg, "dcp_size", 1) > 1:
        suffix += f"_dcp{cfg.dcp_rank}_{cfg.dcp_size}_page{cfg.logical_page_size}"
    return suffix


def _bytes_view(t: torch.Tensor) -> np.ndarray:
    """A 1-D uint8 numpy view of a CPU tensor's memory (no copy)."""
    if t.device.type != "cpu":
        raise ValueError(f"HiCache pages are host tensors; got one on {t.device}")
    if not t.is_contiguous():
        raise ValueError("HiCache page tensors are contiguous; got a strided one")
    return t.view(-1).view(torch.uint8).numpy()


class DurableKVHiCacheStorage(HiCacheStorage):
    """SGLang's ``HiCacheStorage`` on a durablekv Cache (see the module docstring).

    :param storage_config: SGLang's ``HiCacheStorageConfig``; its
        ``extra_config`` holds ``durablekv_path`` and the other ``durablekv_*`` keys.
    :param kwargs: what SGLang's factory passes beside it (unused).
    :raises ConfigError: no ``durablekv_path``, or a bad option.
    :raises CacheLockedError: another process owns this rank's directory.
    """

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Any = None) -> None:
        from ..cache import Cache

        extra = dict(storage_config.extra_config or {})
        path = extra.get("durablekv_path")
        if not path:
            raise ConfigError(
                "the durablekv HiCache backend needs \"durablekv_path\" in "
                "--hicache-storage-backend-extra-config: the directory for the KV pages, "
                "e.g. {\"durablekv_path\": \"/var/cache/sglang-kv\", ...}")
        unknown = sorted(k for k in extra if k.startswith("durablekv_") and k not in OPTIONS)
        if unknown:
            raise ConfigError(f"unknown extra-config keys {unknown}; this backend reads "
                              f"{', '.join(OPTIONS)}")
        if extra.get("interface_v1"):
            raise ConfigError(
                "the durablekv HiCache backend serves SGLang's generic page path, not the "
                "zero-copy one: remove \"interface_v1\" from "
                "--hicache-storage-backend-extra-config")
        self.storage_config = storage_config
        self.suffix = _rank_suffix(storage_config)
        self.directory = os.path.join(os.fspath(path), self.suffix)
        size_limit = extra.get("durablekv_size_limit")
        options: dict[str, Any] = {"warm": False,
                                   "durability": extra.get("durablekv_durability", "log")}
        if size_limit is not None:
            options["size_limit"] = int(size_limit)
        if extra.get("durablekv_max_pages") is not None:
            options["max_pages"] = int(extra["durablekv_max_pages"])
        os.makedirs(self.directory, mode=0o700, exist_ok=True)
        self.cache = Cache(self.directory, name=f"hicache-{self.suffix}", **options)
        self.store = KVBlockStore(
            self.cache,
            file_block_bytes=int(extra.get("durablekv_file_page_bytes",
                                           DEFAULT_FILE_BLOCK_BYTES)),
            max_file_bytes=None if size_limit is None else int(size_limit))
        self.mem_pool_host: Any = None
        self._key_tail = f"|{self.suffix}|unregistered|unregistered"
        self._threads: Any = None
        self.misses = self.hits = self.sets = self.rejected = 0

    # -- keys -------------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """SGLang hands over the host pool: its dtype and layout join every key."""
        super().register_mem_pool_host(mem_pool_host)
        self._key_tail = (f"|{self.suffix}|{getattr(mem_pool_host, 'dtype', '?')}"
                          f"|{getattr(mem_pool_host, 'layout', '?')}")

    def _hash(self, key: str) -> bytes:
        """The durablekv block hash (32 bytes) of SGLang page ``key`` on this
        rank, for this pool's dtype and layout."""
        if not isinstance(key, str):
            raise TypeError(f"HiCache keys are page-hash strings, not {type(key).__name__}")
        return hashlib.sha256((key + self._key_tail).encode()).digest()

    # -- HiCacheStorage -------------------------------------------------------------

    def get(self, key: str, target_location: Optional[Any] = None,
            target_sizes: Optional[Any] = None) -> torch.Tensor | None:
        """Fill ``target_location`` (a host page tensor) with page ``key``; it, or None."""
        if target_location is None:
            raise ValueError("get() fills a preallocated page: pass target_location")
        try:
            found = self.store.get_into(self._hash(key),
                                        _bytes_view(target_location))
        except (OSError, DurableKVError) as exc:       # a miss for this key only
            log.warning("HiCache get of page %s failed: %r", key, exc)
            found = False
        if found:
            self.hits += 1
            return target_location
        self.misses += 1
        return None

    def batch_get(self, keys: List[str], target_locations: Optional[Any] = None,
                  target_sizes: Optional[Any] = None) -> List[torch.Tensor | None]:
        """:meth:`get` of each key into its target, the pages read by a few
        threads at once (reads and checksums release the GIL)."""
        targets = target_locations or [None] * len(keys)
        return self._in_slices(self.get, keys, targets)

    def set(self, key: str, value: Optional[Any] = None, target_location: Optional[Any] = None,
            target_sizes: Optional[Any] = None) -> bool:
        """Store page ``value`` (a host tensor) under ``key``; True once it is
        durable by the Cache's ``durability``."""
        if value is None:
            raise ValueError("set() stores a page tensor: pass value")
        h = self._hash(key)
        try:
            if h in self.store:          # a page's bytes are fixed by its key
                return True
            self.store.put(h, _bytes_view(value))
        except (OSError, DurableKVError) as exc:
            log.warning("HiCache set of page %s failed: %r", key, exc)
            self.rejected += 1
            return False
        self.sets += 1
        return True

    def batch_set(self, keys: List[str], values: Optional[Any] = None,
                  target_locations: Optional[Any] = None,
                  target_sizes: Optional[Any] = None) -> bool:
        """:meth:`set` of each page, written by a few threads at once; True
        when every one was stored."""
        return all(self._in_slices(self.set, keys, list(values or [])))

    def _in_slices(self, op: Any, keys: List[str], args: List[Any]) -> List[Any]:
        """``[op(k, a) for k, a in zip(keys, args)]``, the pairs dealt out to
        :data:`IO_THREADS` threads in interleaved slices (one task per thread,
        not per page: reads, writes and checksums release the GIL)."""
        n = min(IO_THREADS, len(keys))
        if n < 2:
            return [op(k, a) for k, a in zip(keys, args)]
        if self._threads is None:
            from concurrent.futures import ThreadPoolExecutor
            self._threads = ThreadPoolExecutor(max_workers=IO_THREADS,
                                               thread_name_prefix="durablekv-hicache")
        slices = list(self._threads.map(
            lambda i: [op(k, a) for k, a in zip(keys[i::n], args[i::n])], range(n)))
        out: List[Any] = [None] * len(keys)
        for i, part in enumerate(slices):
            out[i::n] = part
        return out

    def exists(self, key: str) -> bool:
        return self._hash(key) in self.store

    def batch_exists(self, keys: List[str], extra_info: Any = None) -> int:
        """How many leading ``keys`` are stored (SGLang's longest-prefix rule)."""
        n = 0
        for k in keys:
            if self._hash(k) not in self.store:
                break
            n += 1
        return n

    def clear(self) -> None:
        """Remove every page of this rank."""
        for h in list(self.cache):
            self.store.delete(h)
        self.cache.flush()

    def get_stats(self) -> dict[str, int]:
        return {"hits": self.hits, "misses": self.misses, "sets": self.sets,
                "rejected": self.rejected, "corrupt": self.store.corrupt}

    def close(self) -> None:
        """Flush and close the Cache (SGLang calls this when it detaches the backend)."""
        if self._threads is not None:
            self._threads.shutdown(wait=True)
            self._threads = None
        if not self.cache.closed:
            self.cache.close()
