"""One adapter per implementation, all with the same shape.

An adapter exposes ``get(key)``, ``set(key, value)`` and ``delete(key)`` as
plain callables (bound methods where the library has them, so no adapter
frame is timed), plus loops over key lists that the timed runs call. A
pipelined client overrides the loops. Settings chosen for each competitor,
and why, are in :data:`SETTINGS` (copied into the JSON and the docs).

Keys are ``str`` everywhere; values are ``bytes``. Where a library needs
``bytes`` keys (lmdb) the adapter encodes them, which is part of its cost.
"""

from __future__ import annotations

import math
import os
import threading
from collections import OrderedDict
from typing import Any, Callable, Sequence

from .util import chunks

#: What each competitor is configured with, and why (goes into the report).
SETTINGS = {
    "durablekv": "Cache(page_size=16, durability='log' unless named, flush_interval=0.05, "
                 "flush_batch_pages=64 — the defaults); max_pages large enough to hold every key "
                 "(except in the page-fault case, where the memory tier holds ~1% of the keys). "
                 "After each timed run, flush() waits for the write-behind backlog (timed "
                 "apart as the drain), so it never runs during another implementation's turn.",
    "dict": "plain dict: d.get / d[k] = v / d.pop — the floor for any in-memory cache (no bound, "
            "no eviction).",
    "OrderedDict LRU": "a bounded LRU on collections.OrderedDict (get: get + move_to_end; set: "
                       "setitem + move_to_end + popitem(last=False) when over maxsize) — the "
                       "classic recipe, the floor for an LRU in Python.",
    "functools.lru_cache": "lru_cache(maxsize=N) around a dict lookup; only get-hit applies "
                           "(it has no set or delete).",
    "cachetools.LRUCache": "LRUCache(maxsize=N); behind a threading.Lock in the threaded case "
                           "(cachetools is not thread-safe).",
    "cachetools.LRUCache + Lock": "the same LRUCache with every call made under one "
                                  "threading.Lock, as cachetools asks of a cache shared "
                                  "between threads (durablekv locks every call except a "
                                  "get or `in` of an entry in memory with no TTL).",
    "diskcache.Cache": "diskcache.Cache(directory) with its defaults (SQLite WAL, "
                       "synchronous=NORMAL, size_limit 1 GiB, least-recently-stored eviction).",
    "diskcache.FanoutCache": "FanoutCache(directory) with its defaults (8 shards, timeout=0.010 "
                             "s); a set that times out returns False and is counted as failed.",
    "sqlitedict": "SqliteDict(autocommit=False, journal_mode='WAL'), commit() after every 1000 "
                  "writes (autocommit=True costs one transaction per write; batching commits is "
                  "its documented idiom for bulk writes); default pickle encoding. Its writes "
                  "return before its worker thread runs them: the drain column shows the rest.",
    "lmdb": "lmdb.open(map_size=16 GiB, sync=False, metasync=False): one transaction per "
            "operation; without sync a committed write survives a killed process but not a "
            "power loss, the same promise as durablekv's durability='log'.",
    "Redis": "redis-server on loopback, --appendonly yes --appendfsync everysec --save '' "
             "(same promise as 'log' mode plus a 1 s window), automatic AOF rewrite off (a "
             "forked rewrite would steal a CPU from whatever is being timed); redis-py, one "
             "round trip per op.",
    "Redis pipelined": "the same server; redis-py pipeline(transaction=False), 100 ops per "
                       "round trip (the per-op time is the batch time / 100).",
}


class Impl:
    """Base adapter. Subclasses set ``get``/``set``/``delete`` in :meth:`open`."""

    key = "?"
    name = "?"
    family = "memory"          # memory | disk | server | durablekv
    supports = frozenset({"get", "set", "delete"})
    thread_safe = True
    settings = ""

    get: Callable[..., Any]
    set: Callable[..., Any]
    delete: Callable[..., Any]

    def open(self, path: str | None, n_keys: int = 0) -> None:
        """Create the store in ``path`` (a fresh directory) sized for ``n_keys`` keys."""
        raise NotImplementedError

    def close(self) -> None:
        pass

    def sync(self) -> None:
        """Make everything written so far durable/visible (untimed)."""

    def quiesce(self) -> None:
        """Finish background work left by the last timed run (timed apart as the *drain*)."""

    def populate(self, keys: Sequence[str], value: bytes) -> None:
        self.loop_set(keys, value)
        self.sync()

    # The timed loops. Local names keep the loop overhead equal for all.
    def loop_get(self, keys: Sequence[str]) -> None:
        g = self.get
        for k in keys:
            g(k)

    def loop_set(self, keys: Sequence[str], value: bytes) -> None:
        s = self.set
        for k in keys:
            s(k, value)

    def loop_delete(self, keys: Sequence[str]) -> None:
        d = self.delete
        for k in keys:
            d(k)

    def loop_mix(self, keys: Sequence[str], is_set: Sequence[bool], value: bytes) -> None:
        g, s = self.get, self.set
        for k, w in zip(keys, is_set):
            if w:
                s(k, value)
            else:
                g(k)

    def threaded_set(self) -> Callable[[Sequence[str], bytes], None]:
        """A set loop that may run in several threads at once."""
        if self.thread_safe:
            return self.loop_set
        lock = threading.Lock()
        s = self.set

        def loop(keys: Sequence[str], value: bytes) -> None:
            for k in keys:
                with lock:
                    s(k, value)
        return loop

    def extra(self) -> dict[str, Any]:
        """Counters worth reporting (failed ops, page faults ...)."""
        return {}


# -- durablekv ------------------------------------------------------------------------

class DurableKV(Impl):
    family = "durablekv"
    settings = SETTINGS["durablekv"]

    def __init__(self, durability: str = "log", page_size: int = 16,
                 max_entries: int | None = None, label: str | None = None,
                 **kwargs: Any) -> None:
        self.durability = durability
        self.page_size = page_size
        self.max_entries = max_entries
        self.kwargs = kwargs
        self.key = label or f"durablekv-{durability}" + (f"-ps{page_size}" if page_size != 16 else "")
        suffix = f"{durability}" + (f", page_size={page_size}" if page_size != 16 else "")
        self.name = f"durablekv ({suffix})"
        self.cache = None
        self.path: str | None = None

    def max_pages(self, n_keys: int) -> int:
        # Default: room for twice the keys, so that the delete case (which
        # re-inserts what it deleted into fresh pages) never evicts.
        entries = self.max_entries if self.max_entries is not None else 2 * n_keys + self.page_size * 4
        return max(1, math.ceil(entries / self.page_size))

    def open(self, path: str | None, n_keys: int = 0) -> None:
        from durablekv import Cache
        self.path = path
        self._n_keys = n_keys
        self.cache = Cache(path, page_size=self.page_size, max_pages=self.max_pages(n_keys),
                           durability=self.durability, **self.kwargs)
        self._bind()

    def _bind(self) -> None:
        c = self.cache
        self.get, self.set, self.delete = c.get, c.set, c.delete

    def populate(self, keys: Sequence[str], value: bytes) -> None:
        if self.durability == "fsync":
            # One fsync per set would make setup take minutes: write the keys
            # in "log" mode, then reopen in fsync mode and fault them back in.
            from durablekv import Cache
            self.cache.close()
            with Cache(self.path, max_pages=self.max_pages(self._n_keys),
                       durability="log") as c:
                s = c.set
                for k in keys:
                    s(k, value)
            self.cache = Cache(self.path, max_pages=self.max_pages(self._n_keys),
                               durability=self.durability, **self.kwargs)
            self._bind()
            self.loop_get(keys)
        else:
            self.loop_set(keys, value)
        self.sync()

    def sync(self) -> None:
        self.cache.flush()

    def quiesce(self) -> None:
        self.cache.flush()

    def close(self) -> None:
        if self.cache is not None:
            self.cache.close()
            self.cache = None

    def extra(self) -> dict[str, Any]:
        st = self.cache.stats()
        return {"page_faults": st.page_faults, "memory_hits": st.memory_hits,
                "store_hits": st.store_hits, "misses": st.misses, "evictions": st.evictions,
                "resident_pages": st.resident_pages}


class DurableKVPure(DurableKV):
    """The same durablekv setup with its pure-Python kernels (the fallback a
    machine without a C compiler runs), switched per call loop in the same
    process, so that the native and the fallback runs take turns like any
    two implementations. Only when the C kernels are built: otherwise the
    plain adapter already runs the fallback."""

    def __init__(self, base: DurableKV) -> None:
        super().__init__(base.durability, base.page_size, base.max_entries, base.key,
                         **base.kwargs)
        self.key = base.key + "-pure"
        self.name = base.name.replace("durablekv (", "durablekv fallback (", 1)

    def _pure(self, fn: Callable[..., Any], *args: Any) -> Any:
        from durablekv._accel import pure_kernels
        with pure_kernels():
            return fn(*args)

    def open(self, path: str | None, n_keys: int = 0) -> None:
        self._pure(super().open, path, n_keys)

    def populate(self, keys: Sequence[str], value: bytes) -> None:
        self._pure(super().populate, keys, value)

    def loop_get(self, keys: Sequence[str]) -> None:
        self._pure(super().loop_get, keys)

    def loop_set(self, keys: Sequence[str], value: bytes) -> None:
        self._pure(super().loop_set, keys, value)

    def loop_delete(self, keys: Sequence[str]) -> None:
        self._pure(super().loop_delete, keys)

    def loop_mix(self, keys: Sequence[str], is_set: Sequence[bool], value: bytes) -> None:
        self._pure(super().loop_mix, keys, is_set, value)

    def sync(self) -> None:
        self._pure(super().sync)

    def quiesce(self) -> None:
        self._pure(super().quiesce)

    def close(self) -> None:
        self._pure(super().close)


def pure_twins(impls: Sequence[DurableKV]) -> list[DurableKV]:
    """A :class:`DurableKVPure` for each adapter, when the C kernels run
    (else none: the adapters themselves run the fallback)."""
    import durablekv
    return [DurableKVPure(i) for i in impls] if durablekv.accelerated else []


# -- in-memory ------------------------------------------------------------------------

class Dict(Impl):
    key, name, family = "dict", "dict", "memory"
    settings = SETTINGS["dict"]

    def open(self, path: str | None, n_keys: int = 0) -> None:
        d: dict[str, Any] = {}
        self.d = d
        self.get, self.set, self.delete = d.get, d.__setitem__, d.pop


class _ODLRU:
    """The OrderedDict LRU recipe (bounded; evicts the least recently used)."""

    __slots__ = ("od", "maxsize")
    _MISS = object()

    def __init__(self, maxsize: int) -> None:
        self.od: OrderedDict[Any, Any] = OrderedDict()
        self.maxsize = maxsize

    def get(self, key: Any, default: Any = None) -> Any:
        od = self.od
        v = od.get(key, _ODLRU._MISS)
        if v is _ODLRU._MISS:
            return default
        od.move_to_end(key)
        return v

    def set(self, key: Any, value: Any) -> None:
        od = self.od
        od[key] = value
        od.move_to_end(key)
        if len(od) > self.maxsize:
            od.popitem(last=False)

    def delete(self, key: Any) -> bool:
        return self.od.pop(key, _ODLRU._MISS) is not _ODLRU._MISS


class OrderedDictLRU(Impl):
    key, name, family = "odict-lru", "OrderedDict LRU", "memory"
    thread_safe = False
    settings = SETTINGS["OrderedDict LRU"]

    def open(self, path: str | None, n_keys: int = 0) -> None:
        self.lru = _ODLRU(max(n_keys, 1))
        self.get, self.set, self.delete = self.lru.get, self.lru.set, self.lru.delete


class LruCacheFn(Impl):
    key, name, family = "lru_cache", "functools.lru_cache", "memory"
    supports = frozenset({"get"})
    settings = SETTINGS["functools.lru_cache"]

    def open(self, path: str | None, n_keys: int = 0) -> None:
        import functools
        self.source: dict[str, Any] = {}
        self.get = functools.lru_cache(maxsize=max(n_keys, 1))(self.source.get)
        self.set = self.source.__setitem__
        self.delete = self.source.pop

    def populate(self, keys: Sequence[str], value: bytes) -> None:
        for k in keys:
            self.source[k] = value
        self.loop_get(keys)  # each call is a miss that fills the lru_cache

    def close(self) -> None:
        self.get.cache_clear()


class CachetoolsLRU(Impl):
    key, name, family = "cachetools", "cachetools.LRUCache", "memory"
    thread_safe = False
    settings = SETTINGS["cachetools.LRUCache"]

    def open(self, path: str | None, n_keys: int = 0) -> None:
        import cachetools
        c = cachetools.LRUCache(maxsize=max(n_keys, 1))
        self.c = c
        self.get, self.set = c.get, c.__setitem__
        self.delete = lambda k: c.pop(k, None)


class CachetoolsLocked(CachetoolsLRU):
    """cachetools.LRUCache behind a threading.Lock, as its documentation asks
    of any cache shared between threads (``cachetools.cached(cache, lock=...)``
    takes the lock the same way). durablekv takes a lock on every call; this
    is the like-for-like comparison for a thread-safe in-memory LRU."""

    key, name = "cachetools-locked", "cachetools.LRUCache + Lock"
    thread_safe = True
    settings = SETTINGS["cachetools.LRUCache + Lock"]

    def open(self, path: str | None, n_keys: int = 0) -> None:
        super().open(path, n_keys)
        c, lock = self.c, threading.Lock()

        def get(key: Any, default: Any = None) -> Any:
            with lock:
                return c.get(key, default)

        def set(key: Any, value: Any) -> None:
            with lock:
                c[key] = value

        def delete(key: Any) -> Any:
            with lock:
                return c.pop(key, None)

        self.get, self.set, self.delete = get, set, delete


# -- on disk ----------------------------------------------------------------------------

class DiskCache(Impl):
    key, name, family = "diskcache", "diskcache.Cache", "disk"
    settings = SETTINGS["diskcache.Cache"]

    def open(self, path: str | None, n_keys: int = 0) -> None:
        import diskcache
        self.c = diskcache.Cache(path)
        self.get, self.set, self.delete = self.c.get, self.c.set, self.c.delete

    def close(self) -> None:
        self.c.close()


class FanoutCache(Impl):
    key, name, family = "fanoutcache", "diskcache.FanoutCache", "disk"
    settings = SETTINGS["diskcache.FanoutCache"]

    def open(self, path: str | None, n_keys: int = 0) -> None:
        import diskcache
        self.c = c = diskcache.FanoutCache(path)
        self.failed = 0
        cset = c.set

        def set_(k: str, v: bytes) -> None:
            if not cset(k, v):
                self.failed += 1
        self.get, self.set, self.delete = c.get, set_, c.delete

    def close(self) -> None:
        self.c.close()

    def extra(self) -> dict[str, Any]:
        return {"failed_sets": self.failed}


class SqliteDictImpl(Impl):
    key, name, family = "sqlitedict", "sqlitedict", "disk"
    settings = SETTINGS["sqlitedict"]
    COMMIT_EVERY = 1000

    def open(self, path: str | None, n_keys: int = 0) -> None:
        from sqlitedict import SqliteDict
        d = SqliteDict(os.path.join(path, "db.sqlite"), tablename="bench", autocommit=False,
                       journal_mode="WAL", outer_stack=False)
        self.d = d
        pending = [0]
        setitem, delitem, getitem, commit = d.__setitem__, d.__delitem__, d.__getitem__, d.commit
        every = self.COMMIT_EVERY

        def get(k: str, default: Any = None) -> Any:
            try:
                return getitem(k)
            except KeyError:
                return default

        def set_(k: str, v: bytes) -> None:
            setitem(k, v)
            pending[0] += 1
            if pending[0] >= every:
                pending[0] = 0
                commit()

        def delete(k: str) -> bool:
            try:
                delitem(k)
            except KeyError:
                return False
            pending[0] += 1
            if pending[0] >= every:
                pending[0] = 0
                commit()
            return True
        self.get, self.set, self.delete = get, set_, delete

    def sync(self) -> None:
        self.d.commit()

    def quiesce(self) -> None:
        # SqliteDict queues writes for its worker thread and returns at once;
        # commit() (blocking) waits until the queue has been executed.
        self.d.commit()

    def close(self) -> None:
        self.d.commit()
        self.d.close()


class Lmdb(Impl):
    key, name, family = "lmdb", "lmdb", "disk"
    settings = SETTINGS["lmdb"]

    def open(self, path: str | None, n_keys: int = 0) -> None:
        import lmdb
        self.env = env = lmdb.open(path, map_size=16 << 30, sync=False, metasync=False,
                                   max_readers=64)
        begin = env.begin

        def get(k: str, default: Any = None) -> Any:
            with begin() as txn:
                v = txn.get(k.encode())
            return default if v is None else v

        def set_(k: str, v: bytes) -> None:
            with begin(write=True) as txn:
                txn.put(k.encode(), v)

        def delete(k: str) -> bool:
            with begin(write=True) as txn:
                return txn.delete(k.encode())
        self.get, self.set, self.delete = get, set_, delete

    def populate(self, keys: Sequence[str], value: bytes) -> None:
        for batch in chunks(keys, 1000):
            with self.env.begin(write=True) as txn:
                for k in batch:
                    txn.put(k.encode(), value)

    def close(self) -> None:
        self.env.close()


# -- Redis ----------------------------------------------------------------------------

class Redis(Impl):
    key, name, family = "redis", "Redis", "server"
    settings = SETTINGS["Redis"]
    db = 0

    def __init__(self, port: int) -> None:
        self.port = port

    def open(self, path: str | None, n_keys: int = 0) -> None:
        import redis
        self.r = r = redis.Redis(host="127.0.0.1", port=self.port, db=self.db)
        r.flushdb()
        self.get, self.set, self.delete = r.get, r.set, r.delete

    def populate(self, keys: Sequence[str], value: bytes) -> None:
        p = self.r.pipeline(transaction=False)
        for batch in chunks(keys, 1000):
            for k in batch:
                p.set(k, value)
            p.execute()

    def close(self) -> None:
        self.r.flushdb()
        self.r.close()


class RedisPipelined(Redis):
    key, name = "redis-pipe", "Redis pipelined"
    settings = SETTINGS["Redis pipelined"]
    db = 1
    BATCH = 100

    def loop_get(self, keys: Sequence[str]) -> None:
        p = self.r.pipeline(transaction=False)
        for batch in chunks(keys, self.BATCH):
            for k in batch:
                p.get(k)
            p.execute()

    def loop_set(self, keys: Sequence[str], value: bytes) -> None:
        p = self.r.pipeline(transaction=False)
        for batch in chunks(keys, self.BATCH):
            for k in batch:
                p.set(k, value)
            p.execute()

    def loop_delete(self, keys: Sequence[str]) -> None:
        p = self.r.pipeline(transaction=False)
        for batch in chunks(keys, self.BATCH):
            for k in batch:
                p.delete(k)
            p.execute()

    def loop_mix(self, keys: Sequence[str], is_set: Sequence[bool], value: bytes) -> None:
        p = self.r.pipeline(transaction=False)
        for i in range(0, len(keys), self.BATCH):
            for k, w in zip(keys[i:i + self.BATCH], is_set[i:i + self.BATCH]):
                if w:
                    p.set(k, value)
                else:
                    p.get(k)
            p.execute()

    def threaded_set(self) -> Callable[[Sequence[str], bytes], None]:
        return self.loop_set  # each call makes its own pipeline


# -- availability ---------------------------------------------------------------------

_MODULES = {"cachetools": "cachetools", "cachetools-locked": "cachetools", "diskcache": "diskcache", "fanoutcache": "diskcache",
            "sqlitedict": "sqlitedict", "lmdb": "lmdb"}


def missing_module(impl_key: str) -> str | None:
    """The module an implementation needs when it is not installed, else None."""
    mod = _MODULES.get(impl_key)
    if mod is None:
        return None
    try:
        __import__(mod)
    except ImportError:
        return mod
    return None


def competitors(redis_port: int | None) -> list[Impl]:
    """Fresh adapters for every installed competitor (not durablekv)."""
    out: list[Impl] = [Dict(), OrderedDictLRU(), LruCacheFn()]
    for cls in (CachetoolsLRU, CachetoolsLocked, DiskCache, FanoutCache, SqliteDictImpl, Lmdb):
        if missing_module(cls.key) is None:
            out.append(cls())
    if redis_port is not None:
        out += [Redis(redis_port), RedisPipelined(redis_port)]
    return out
