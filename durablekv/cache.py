"""Cache: the public facade. Owns the lifecycle and wires the parts together.

Data flow (see ``docs/architecture.md``)::

    set/delete ─► ReplayLog.append ─► MemoryTier (page table, LRU, dirty pages)
                                          │ dirty / evicted-dirty pages
                                          ▼
                              WriteBehindBatcher ─► SQLitePageStore
    get ─► page table ─(miss)─► key index ─► page fault (page read back)

Locking: ``self._lock`` guards the memory tier, the counters, the LSN and the
log append (so file order is LSN order and the memory tier never disagrees
with the log). It is never held across an fsync, a SQLite commit, or user
code (memoized functions). The batcher has its own lock; lock order is
cache lock, then batcher lock, never the reverse.
"""

from __future__ import annotations

import atexit
import errno
import contextlib
import fcntl
import functools
import gc
import logging
import math
import operator
import os
import shutil
import struct
import sysconfig
import tempfile
import threading
import time
import warnings
import weakref
from collections.abc import ItemsView, KeysView, MutableMapping, ValuesView
from itertools import count, repeat
from numbers import Number
from typing import Any, Callable, Iterable, Iterator, Sequence

from ._perms import DIR_MODE, FILE_MODE
from . import codec as _codec
from .batcher import Batch, WriteBehindBatcher
from .keyfilter import KeyFilter
from .errors import (CacheClosedError, CacheFailedError, CacheLockedError, ConfigError,
                     CorruptStoreError, LogCorruptionError, LogWriteError, StoreError,
                     WriteBehindError)
from . import pages as _pages
from .pages import EMPTY, HAS_TTL, PAGE_BYTES_LIMIT, RESIDENT, MemoryTier, Page
from .policy import check_policy
from .replaylog import (OP_CLEAR, OP_DELETE, OP_SET, ReplayLog, _first_lsn_of, list_segments,
                        locate_record)
from .stats import CacheStats, HistogramSnapshot
from . import pgwire as _pgwire
from .store import (ASCII_KEYS, INT_KEYS, PAGE_SIZE_MAX, RAW_BYTES, STORE_FILE, PageImage,
                    SQLitePageStore, encode_columns, encode_page, mark_damaged, page_columns,
                    split_page)

__all__ = ["Cache"]

log = logging.getLogger("durablekv")

_MISSING: Any = object()
#: What :meth:`Cache._get_nowait` returns when only a waiting call can answer.
NOWAIT_UNSURE: Any = object()


_STR, _BYTES = {str}, {bytes}
_REAL_MONOTONIC = (time.monotonic,)
#: Smallest ``segment_bytes`` accepted.
MIN_SEGMENT_BYTES = 1024
_U32_PACK = struct.Struct("<I").pack
_Frozen = _codec.Frozen
_OPEN, _CLOSING, _CLOSED, _FAILED, _FORKED = "open", "closing", "closed", "failed", "forked"
DURABILITY_MODES = ("fsync", "log", "none", "sync")
#: Longest encoded key (bytes); keys live in the page blobs and the index.
MAX_KEY_BYTES = 1 << 20
#: Largest allowed max_value_bytes: one entry must fit in a page.
MAX_VALUE_BYTES_LIMIT = PAGE_BYTES_LIMIT - MAX_KEY_BYTES - 4096
#: ``max_value_bytes`` when not given: 64 MiB.
DEFAULT_MAX_VALUE_BYTES = 64 << 20
LOCK_FILE = "LOCK"

_open_caches: "weakref.WeakValueDictionary[int, Cache]" = weakref.WeakValueDictionary()
# fields of a recovered log record (lsn, op, key, value, expire_at)
_OP_OF, _KEY_OF, _VALUE_OF, _EXPIRE_OF = (operator.itemgetter(i) for i in range(1, 5))
#: Keys a flush added to the key index go into the key filter this many at a
#: time, each slice under the cache lock (about 2 ms each).
_FILTER_SLICE = 4096
#: Pages read from the store per statement when recovery faults pages in.
_FAULT_BATCH = 256
#: items()/values() take the lock once per this many keys in memory, or
#: pages read from the store.
_SCAN_BATCH = 1024
_SCAN_BATCH_PAGES = 64
#: The expiry sweep takes the cache lock once per this many stored pages
#: (about 30 us each: read, decode, remove the expired entries).
_SWEEP_SLICE = 16
#: Seconds the expiry sweep waits after a store read error.
_SWEEP_RETRY = 60.0


def _expired_keys(keys: Sequence[Any], expires: Sequence[float | None], now: float) -> list:
    """The keys whose expiry (parallel to ``keys``) is at or before ``now``;
    a free slot has none."""
    return [k for k, e in zip(keys, expires) if e is not None and now >= e]


def _count_of(counter: count) -> int:
    """The next value ``counter`` (an ``itertools.count``, step 1) will give:
    its repr is ``count(N)``."""
    return int(repr(counter)[6:-1])


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector for a bulk build (Mercurial's
    ``util.nogc`` does the same for its big dicts).

    Recovery makes millions of page-table entries, and every container made
    counts towards the collector's thresholds, so the collector would walk
    the growing table over and over (measured: two thirds of the time of
    building it). Reference counting still frees whatever is not in a cycle;
    cyclic garbage made meanwhile (by any thread) waits for the pause to end.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _close_all_at_exit() -> None:
    """Safety net: drain caches the application forgot to close."""
    for cache in list(_open_caches.values()):
        try:
            cache.close()
        except Exception as exc:  # pragma: no cover - reported, not raised at exit
            log.error("closing %s at exit failed: %r", cache.path, exc)


atexit.register(_close_all_at_exit)

#: Objects a forked child must keep alive and never close: closing the
#: parent's SQLite connections or lock file in the child could disturb the
#: parent, and SQLite's own mutexes may have been held by a parent thread at
#: the fork, so the child must make no SQLite call at all, not even a close
#: when the interpreter exits. They are made immortal (an extra reference
#: that is never dropped).
_inherited: list = []


def _immortal(obj: Any) -> None:
    _inherited.append(obj)
    try:
        import ctypes
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(obj))
    except (ImportError, AttributeError):  # pragma: no cover - not CPython
        pass


def _after_fork_in_child() -> None:
    """A forked child inherits open caches without their threads: retire them."""
    for cache in list(_open_caches.values()):
        cache._retire_after_fork()
    _open_caches.clear()


if hasattr(os, "register_at_fork"):
    import ctypes  # noqa: F401 - loaded now: a child must not dlopen after fork
    os.register_at_fork(after_in_child=_after_fork_in_child)


class _Snapshot:
    """Dirty pages copied under the cache lock; encoded later by the batcher.

    ``items[i]`` is ``(page, version, keys_version, index_changed, keys,
    values, expires, stored_n, stored_ttl_n, flight_lsn)``. The batcher may
    commit the items in several transactions when one page keeps failing
    (see :mod:`durablekv.batcher`); :meth:`build` then makes the checkpoint
    stop short of the first change still uncommitted.
    """

    __slots__ = ("cache", "items", "checkpoint_lsn", "clear", "clear_lsn", "built", "ttl_clock")

    def __init__(self, cache: "Cache", items: list, checkpoint_lsn: int, clear: bool,
                 clear_lsn: int, ttl_clock: tuple[float, float]) -> None:
        self.cache = cache
        self.ttl_clock = ttl_clock
        self.items = items
        self.checkpoint_lsn = checkpoint_lsn
        self.clear = clear
        self.clear_lsn = clear_lsn
        self.built: dict[int, tuple[int, int, int]] = {}  # i -> (n, ttl_n, blob bytes)

    @property
    def size(self) -> int:
        return len(self.items)

    def build(self, indices: list[int] | None = None,
              uncommitted: set[int] | frozenset = frozenset()) -> Batch:
        """Encode items ``indices`` (all when None). ``uncommitted`` are the
        other items not committed yet: the checkpoint stays below their changes.
        A pending clear goes with the first batch built after it."""
        codec = self.cache._codec
        to_blob = codec.to_blob
        raw_bytes = type(codec) is _codec.SafeCodec  # a bytes value is held as itself
        encode_key = _codec.encode_key
        canonical_key = _codec.canonical_key
        pack = _U32_PACK
        store = self.cache._store
        clear = self.clear
        count, ttl = (0, 0) if clear else (store.key_count, store.ttl_key_count)
        images = []
        rewritten = 0
        all_slots = range(self.cache.page_size)
        for i in (range(len(self.items)) if indices is None else indices):
            (page, _v, _kv, index_changed, keys, values, expires, stored_n, stored_ttl,
             _lsn) = self.items[i]
            if raw_bytes:
                # The common page, str keys and bytes values: encoded as
                # columns by C-level comprehensions, no per-entry tuples.
                if EMPTY in keys:
                    slots = [s for s, k in enumerate(keys) if k is not EMPTY]
                    ks = [keys[s] for s in slots]
                    vs = [values[s] for s in slots]
                    es = [expires[s] for s in slots]
                else:
                    slots, ks, vs, es = all_slots, keys, values, expires
                if set(map(type, ks)) == _STR and set(map(type, vs)) == _BYTES:
                    bodies = [k.encode("utf-8", "surrogatepass") for k in ks]
                    if all(map(bytes.isascii, bodies)):
                        n = len(slots)
                        ttl_n = n - es.count(None)
                        rows = None
                        if index_changed:
                            cks = [b"s" + pack(len(b)) + b for b in bodies]
                            rows = list(zip(cks, es, repeat(None)))
                        count += n - stored_n
                        ttl += ttl_n - stored_ttl
                        data = encode_columns(slots, bodies, vs, es, ASCII_KEYS | RAW_BYTES)
                        self.built[i] = (n, ttl_n, len(data))
                        images.append(PageImage(page.page_id, n, ttl_n, data, rows,
                                                stored_n > 0))
                        if stored_n:
                            rewritten += 1
                        continue
            entries = []
            rows = [] if index_changed else None
            ttl_n = 0
            for slot, k in enumerate(keys):
                if k is EMPTY:
                    continue
                e = expires[slot]
                # str keys and bytes values inline encode_key/to_blob (same
                # bytes); a str key is its own canonical form.
                if type(k) is str:
                    kb = k.encode("utf-8", "surrogatepass")
                    kb = ck = b"s" + pack(len(kb)) + kb
                else:
                    kb = encode_key(k)
                    ck = None
                v = values[slot]
                if raw_bytes and type(v) is bytes:
                    entries.append((slot, kb, b"b" + pack(len(v)) + v, e))
                else:
                    entries.append((slot, kb, to_blob(v), e))
                if e is not None:
                    ttl_n += 1
                if rows is not None:
                    if ck is None:
                        ck = canonical_key(k)
                    rows.append((ck, e, None if ck == kb else kb))
            n = len(entries)
            count += n - stored_n
            ttl += ttl_n - stored_ttl
            data = encode_page(entries)
            self.built[i] = (n, ttl_n, len(data))
            images.append(PageImage(page.page_id, n, ttl_n, data, rows, stored_n > 0))
            if stored_n:
                rewritten += 1
        checkpoint = self.checkpoint_lsn
        for j in uncommitted:
            lsn = self.items[j][9]
            if lsn is not None:
                checkpoint = min(checkpoint, lsn - 1)
        held = frozenset(self.items[j][0].page_id for j in uncommitted)
        return Batch(images, checkpoint, count, ttl, clear, rewritten, held, self.ttl_clock)


class Cache(MutableMapping):
    """A persistent key/value cache: memory-speed reads, writes that survive a crash.

    :param directory: the cache directory (created if missing, mode 0700).
        Holds ``pages.sqlite3``, ``replay-*.log`` segments and ``LOCK``. None
        (or omitted): a new temporary directory, removed with everything in it
        by :meth:`close` (diskcache's ``Cache()``); ``path`` names it.
    :param page_size: slots per page; fixed when the store is created. None
        adopts the stored value (16 for a new store); a different explicit
        value raises :class:`ConfigError`.
    :param max_pages: the memory tier holds at most this many pages (so at
        most ``max_pages * page_size`` entries resident).
    :param policy: the memory tier's replacement policy: ``"lru"`` (default,
        LRU of pages) or ``"tinylfu"`` (W-TinyLFU of pages; docs/policy.md).
        Not stored: a store may be reopened with either.
    :param flush_interval: seconds between write-behind flushes (and log
        fsyncs in ``durability="log"``).
    :param flush_batch_pages: a flush starts early once this many pages are dirty.
    :param durability: ``"fsync"``, ``"log"`` (default) or ``"none"``; see README;
        with a PostgreSQL store also ``"sync"``: a write returns once its log
        record is committed in PostgreSQL (see docs/postgres.md).
    :param name: label for metrics; default the directory's base name.
    :param clock: ``() -> float`` epoch seconds for TTLs; default
        ``time.time`` looked up at each call (so freezegun moves it). It is
        called once at open, and must return a finite int or float there
        (:class:`ConfigError` otherwise); later calls are not checked.
    :param serializer: ``"safe"`` (default; exact round trip of None, bool,
        int, float, str, bytes, tuple, list, dict) or ``"pickle"`` (any
        picklable object; UNSAFE for stores that others can write).
    :param max_value_bytes: values bigger than this raise ``ValueError``
        before anything is written (default 64 MiB). A ``bytes`` or ``str``
        value counts its data (UTF-8), anything else its encoded size.
    :param max_pending_pages: evicted dirty pages allowed to wait for the
        batcher before writers block (back-pressure); default
        ``max(4 * flush_batch_pages, 64)``.
    :param on_corruption: ``"raise"`` (default) or ``"rebuild"``: move a
        damaged ``pages.sqlite3`` aside and start empty (the replay log is
        still applied).
    :param salvage_log: (a bool; anything else is a :class:`ConfigError`)
        recover from a log damaged before its tail by keeping
        the good prefix and moving the damaged segment aside (loses the
        records after the damage; off by default). ``stats().salvaged_bytes``
        says how many bytes of the log were given up.
    :param busy_timeout: seconds SQLite waits for a lock held by another process
        (with a PostgreSQL store: seconds to wait for each host when connecting).
    :param store: None (default: ``pages.sqlite3`` in the directory) or a
        ``postgresql://`` URL: pages, key index and checkpoint in PostgreSQL
        (needs the ``postgres`` extra; see docs/postgres.md). The replay log
        stays in the directory.
    :param namespace: with ``store``: this cache's name in the database (one
        owner at a time, else :class:`~durablekv.errors.NamespaceLockedError`).
    :raises CacheLockedError: the directory is open elsewhere.
    :raises ConfigError: an invalid or conflicting setting.
    :raises CorruptStoreError, SchemaVersionError, LogCorruptionError: see
        :mod:`durablekv.errors`.
    :raises LogError: a log segment holding records to replay could not be
        fsynced (recovery does so before new records are appended).

    Recovery: log records after the store's checkpoint are applied to the
    memory tier as dirty pages; the constructor returns without waiting for
    them to reach SQLite (the log keeps them until the write-behind has
    stored them), except with ``durability="none"`` or ``salvage_log``,
    where they are flushed first.

    Every public method is thread-safe. A Cache cannot be copied
    (``copy.copy``, ``copy.deepcopy``) or pickled: it owns its directory, so
    these raise ``TypeError``; share the object between threads instead.
    """

    def __init__(self, directory: str | os.PathLike | None = None, *,
                 page_size: int | None = None,
                 max_pages: int = 4096, flush_interval: float = 0.05,
                 flush_batch_pages: int = 64, durability: str = "log",
                 name: str | None = None, clock: Callable[[], float] | None = None,
                 serializer: str | _codec.ValueCodec = "safe",
                 max_value_bytes: int = DEFAULT_MAX_VALUE_BYTES, max_pending_pages: int | None = None,
                 on_corruption: str = "raise", salvage_log: bool = False,
                 busy_timeout: float = 5.0, segment_bytes: int = 64 << 20,
                 store: str | None = None, namespace: str | None = None,
                 policy: str = "lru") -> None:
        self._state = _CLOSED
        self._temporary = directory is None
        if directory is not None and not isinstance(directory, (str, os.PathLike)):
            raise TypeError(f"the cache directory must be a path (str or os.PathLike), not "
                            f"{type(directory).__name__} {directory!r}; pass the directory's "
                            "path, e.g. Cache('var/cache')")
        if directory is not None and not os.fspath(directory):
            raise ConfigError("the cache directory is an empty path; name a directory "
                              "(use '.' for the current one)")
        _check_config(page_size=page_size, max_pages=max_pages, flush_interval=flush_interval,
                      flush_batch_pages=flush_batch_pages, durability=durability,
                      max_value_bytes=max_value_bytes, on_corruption=on_corruption,
                      max_pending_pages=max_pending_pages, busy_timeout=busy_timeout,
                      segment_bytes=segment_bytes, salvage_log=salvage_log)
        _pgwire.check_store_args(store, namespace, durability)
        self.policy = check_policy(policy)
        self._store_url, self.namespace = store, namespace
        if clock is not None:
            _check_clock(clock)
        codec = _codec.codec_by_name(serializer)
        if directory is None:
            # checked settings first: a refused one leaves no directory behind
            directory = tempfile.mkdtemp(prefix="durablekv-")  # 0700
        path = os.path.abspath(os.fspath(directory))
        self.path = path
        self.name = os.path.basename(path.rstrip(os.sep)) if name is None else str(name)
        self._codec = codec
        self.durability = durability
        # a write waits for its log record: fsynced, or committed in PostgreSQL ("sync")
        self._sync_writes = durability in ("fsync", "sync")
        self.flush_interval = float(flush_interval)
        self.flush_batch_pages = int(flush_batch_pages)
        self.max_value_bytes = int(max_value_bytes)
        self.max_pending_pages = (max(4 * flush_batch_pages, 64) if max_pending_pages is None
                                  else int(max_pending_pages))
        self._clock = clock
        self._clock_offset = 0.0
        self._last_now = -math.inf
        self._ttl_clock = (0.0, -math.inf)  # (offset, TTL time) for the store: see _now
        if os.path.exists(path) and not os.path.isdir(path):
            raise ConfigError(f"cache directory {path!r} is a file, not a directory; "
                              "name a directory (it is created if missing)")
        try:
            # private (0700) when created here; an existing directory keeps
            # the mode its owner gave it (see docs/files.md)
            os.makedirs(path, mode=DIR_MODE, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"cannot create cache directory {path!r}: {exc.strerror}") from exc
        if self._store_url is None:
            _pgwire.refuse_other_kinds(path)  # before LOCK is made in a directory not ours
        try:
            self._lock_fd = _acquire_dir_lock(path)
        except PermissionError as exc:
            raise ConfigError(f"cannot write in cache directory {path!r} ({exc.strerror}); "
                              "a cache needs a writable directory") from exc
        except OSError as exc:
            if exc.errno != errno.EROFS:
                raise
            raise ConfigError(f"cache directory {path!r} is on a read-only file system; "
                              "a cache needs a writable directory (durablekv check can "
                              "still verify it)") from exc
        self._store: SQLitePageStore | None = None
        self._log: ReplayLog | None = None
        self._batcher: WriteBehindBatcher | None = None
        try:
            self._open(page_size, max_pages, on_corruption, salvage_log, busy_timeout,
                       segment_bytes)
        except BaseException:
            self._teardown(clean=False)
            self._remove_if_temporary()
            raise

    # -- opening and recovery ------------------------------------------------------

    def _open(self, page_size, max_pages, on_corruption, salvage_log, busy_timeout,
              segment_bytes) -> None:
        self.store_rebuilds = 0
        try:
            self._store = (_pgwire.open_store(self._store_url, self.namespace, self.path,
                                              durability=self.durability, page_size=page_size,
                                              serializer=self._codec.name,
                                              connect_timeout=busy_timeout)
                           if self._store_url is not None else
                           SQLitePageStore(self.path, durability=self.durability,
                                           page_size=page_size, serializer=self._codec.name,
                                           busy_timeout=busy_timeout,
                                           verify=on_corruption == "rebuild"))
        except CorruptStoreError as exc:
            if on_corruption != "rebuild" or self._store_url is not None:
                raise
            # The new store, whole, before the damaged one moves; it starts
            # where the replay log does, which it continues.
            segments = list_segments(self.path)
            SQLitePageStore.prepare_rebuild(
                self.path, page_size=page_size, serializer=self._codec.name,
                checkpoint_lsn=_first_lsn_of(segments[0]) - 1 if segments else 0)
            aside = _move_aside(os.path.join(self.path, STORE_FILE))
            log.warning("page store %s is damaged (%s); moved it to %s and started empty",
                        exc.path, exc.detail, aside)
            self.store_rebuilds = 1
            self._store = SQLitePageStore(self.path, durability=self.durability,
                                          page_size=page_size, serializer=self._codec.name,
                                          busy_timeout=busy_timeout)
        store = self._store
        self.page_size = store.page_size
        self.max_pages = max_pages
        # TTL time carries on from where the last open left it (see _now)
        self._ttl_clock = store.ttl_clock
        self._clock_offset, self._last_now = store.ttl_clock
        self._lock = threading.Lock()   # guards the tier, counters, LSN, log appends
        self._cond = threading.Condition(self._lock)  # back-pressure waits
        self._tier = MemoryTier(store.page_size, max_pages, self.policy)
        # the tier's page table and LRU, for the hot path (never replaced:
        # MemoryTier.clear() empties them in place)
        self._table = self._tier.table
        self._ticks = self._tier.ticks  # LRU recency clock (MemoryTier)
        self._tier.next_page_id = store.max_page_id + 1
        self._count = store.key_count
        self._ttl_count = store.ttl_key_count
        self._last_lsn = store.checkpoint_lsn
        self._clear_pending = False
        self._clear_lsn = 0
        self._absent: Any = _MISSING  # a key just found absent from the store
        # Bloom filter of the store's keys (see keyfilter.py): ready at once for
        # an empty store, else after the batcher's background scan.
        self._filter = KeyFilter(2 * store.key_count)
        self._filter_building: KeyFilter | None = None
        if store.key_count == 0 and store.max_page_id == 0:
            self._filter.ready = True
        else:
            self._start_filter_build(self._filter)
        self._failure: BaseException | None = None
        self._memory_hits = self._store_hits = self._misses = 0
        self._sets = self._deletes = self._expirations = 0
        # The write-behind's expiry sweep (background_work). Off until the
        # recovery below is done: it reads stored pages in batches and may
        # wait for back-pressure between reading and installing them, and a
        # page the sweep rewrote meanwhile would be installed stale.
        self._sweep_on = False
        self._sweep_paused_until = 0.0  # monotonic; after a store read error
        # The log exists in every mode at recovery time: a directory last used
        # with durability="log" may hold records that must be replayed.
        self._log = (_pgwire.open_log(store, self.path) if self.durability == "sync" else
                     ReplayLog(self.path, durability=self.durability, segment_bytes=segment_bytes))
        self._batcher = WriteBehindBatcher(self, store, self._log if self.durability != "none" else None,
                                           interval=self.flush_interval,
                                           sync_log=self.durability == "log",
                                           name=self.name, path=self.path)
        t0 = _REAL_MONOTONIC[0]()
        # Reading the log makes a tuple and two bytes objects per record:
        # the collector would walk the growing list over and over.
        with _gc_paused():
            result = self._log.recover(store.checkpoint_lsn, salvage=salvage_log)
            self.torn_records = result.torn_records
            self.salvaged_bytes = result.salvaged_bytes
            self._state = _OPEN
            store.resume_snapshot()  # no commit runs until the batcher's first snapshot
            self._batcher.start()
            recovered = len(result.records)
            if recovered:
                try:
                    self._replay(result.records)
                except (ValueError, TypeError, IndexError) as exc:
                    # a record whose CRC holds but whose key or value does not
                    # decode (hand-made, or nested past MAX_NESTING)
                    raise self._undecodable_record(result.records, exc) from exc
            self._sweep_on = True
            # Free the records before the collector runs again: it then
            # walks only what the memory tier keeps.
            result.records = []
        # The recovered records are now dirty pages in memory, and the log
        # keeps every segment that holds them until a checkpoint passes them
        # (fsynced by recover()), so open does not wait for SQLite: a crash
        # before the write-behind stores them replays them again. Two cases
        # must wait: durability="none" drops the log here, and salvage moves
        # aside the damaged segment, which holds the last records applied.
        # It moves only after that flush: a process killed before it then
        # meets the same damage at its next open, and loses nothing kept.
        if recovered and (self.durability == "none" or result.salvaged):
            self._batcher.flush_until(self._last_lsn)
        if result.salvaged:
            self._log.set_aside(result)
        self._log.truncate_through(store.checkpoint_lsn)
        if self.durability == "none":
            self._log.close(remove=True)
            self._log = None
        else:
            self._log.start(self._last_lsn + 1)
        self.recovered_records = recovered
        self.recovery_seconds = _REAL_MONOTONIC[0]() - t0
        if recovered:
            log.info("recovered %d log records in %.3f s for %s", recovered,
                     self.recovery_seconds, self.path)
        _open_caches[id(self)] = self

    def _replay(self, records: list[tuple]) -> None:
        """Apply recovered log records in bulk (at open, before any other call).

        :param records: ``(lsn, op, key, value, expire_at)`` tuples, every
            record after the store's checkpoint, in LSN order.

        The outcome is what applying them one at a time through set and
        delete would give (values, expiry, counts, which key object is kept
        for equal keys such as ``1`` and ``1.0``), but each key costs one step:
        a clear discards everything before it; only each key's last record
        matters; keys that may be in the store are looked up in batches and
        their pages faulted in once; new keys fill fresh pages a page at a
        time. Every page changed is dirty since the first LSN replayed.

        The last LSN moves to the last record only at the end: while
        back-pressure waits for the batcher (the log holds more than memory),
        a flush may store a mix of old and new states, but its checkpoint
        stays where it was, so a crash replays all of it again.
        """
        with self._lock, _gc_paused():
            lsn, last_lsn = records[0][0], records[-1][0]
            now = _REAL_MONOTONIC[0]()
            ops = list(map(_OP_OF, records))
            if OP_CLEAR in ops:
                at = len(ops) - 1 - ops[::-1].index(OP_CLEAR)
                self._apply_clear(records[at][0])
                records, ops = records[at + 1:], ops[at + 1:]
            if records:
                self._replay_keys(records, OP_DELETE in ops, lsn, now)
            self._last_lsn = last_lsn
            self._absent = _MISSING
            if len(self._tier.dirty) >= self.flush_batch_pages:
                self._batcher.kick()

    def _undecodable_record(self, records: list[tuple], exc: Exception) -> LogCorruptionError:
        """The :class:`LogCorruptionError` for the first of ``records`` whose
        key or value cannot be decoded (``exc``: what replaying them raised)."""
        for lsn, op, kb, vb, _exp in records:
            try:
                _codec.decode_key(kb)
                if op == OP_SET:
                    self._codec.decode(vb)
            except (ValueError, TypeError, IndexError) as bad:
                path, offset = locate_record(self.path, lsn)
                return LogCorruptionError(path, offset, f"record LSN {lsn} has a CRC that "
                                          f"checks out but cannot be decoded: {bad}")
        path, offset = locate_record(self.path, records[0][0])
        return LogCorruptionError(path, offset, f"the records from LSN {records[0][0]} cannot "
                                  f"be replayed: {exc}")

    def _replay_keys(self, records: list[tuple], has_deletes: bool, lsn: int,
                     now: float) -> None:
        """:meth:`_replay` for records with no clear among them (lock held)."""
        # The last record of each key, by its logged bytes, in LSN order.
        final = dict(zip(map(_KEY_OF, records), records))
        recs = list(final.values())
        if len(recs) < len(records):
            recs.sort()  # by LSN: the order one-by-one replay leaves the LRU in
        kbs = list(map(_KEY_OF, recs))
        keys, others = _codec.decode_keys(kbs)
        # A key whose last set follows a delete is stored anew (a new key
        # object), not updated in place.
        fresh: set[int] = set()
        if has_deletes:
            deleted = {r[2] for r in records if r[1] == OP_DELETE}
            fresh = {i for i, kb in enumerate(kbs) if kb in deleted}
        cks = kbs  # a str or bytes key's encoding is its canonical key
        if others:
            recs, keys, cks, fresh = self._merge_equal_keys(records, recs, keys, kbs, others,
                                                            fresh)
        # Which keys are in the store now (memory holds nothing yet).
        if self._clear_pending or (self._filter.ready and self._filter.added == 0):
            located: dict[bytes, int] = {}  # a new or cleared store: nothing is
        elif self._filter.ready:
            f = self._filter
            located = self._store.locate_keys([ck for ck in cks if ck in f])
        else:
            located = self._store.locate_keys(cks)
        if located:
            new: list[int] = []
            by_page: dict[int, list[int]] = {}
            for i, ck in enumerate(cks):
                pid = located.get(ck)
                if pid is None:
                    new.append(i)
                else:
                    by_page.setdefault(pid, []).append(i)
            self._replay_into_pages(by_page, recs, keys, fresh, new, lsn, now)
            new.sort()
        else:
            new = list(range(len(recs)))
        if has_deletes:  # a delete of a key that is nowhere does nothing
            new = [i for i in new if recs[i][1] == OP_SET]
        if len(new) < len(recs):
            recs = [recs[i] for i in new]
            keys = [keys[i] for i in new]
        self._insert_new_keys(recs, keys, lsn, now)

    def _merge_equal_keys(self, records, recs, keys, kbs, others, fresh):
        """Merge the final records of keys that are equal but were logged as
        different bytes (``1``, ``1.0``, ``True``): the latest record wins;
        the key object kept is the one a one-by-one replay keeps (the first
        set after the last delete). Returns ``(recs, keys, cks, fresh)``."""
        cks = list(kbs)
        groups: dict[bytes, list[int]] = {}
        for i in others:
            cks[i] = ck = _codec.canonical_key(keys[i])
            groups.setdefault(ck, []).append(i)
        merged = [g for g in groups.values() if len(g) > 1]
        if not merged:
            return recs, keys, cks, fresh
        group_of = {kbs[i]: n for n, g in enumerate(merged) for i in g}
        first_set: list[bytes | None] = [None] * len(merged)
        had_delete = [False] * len(merged)
        for _lsn, op, kb, _vb, _e in records:
            n = group_of.get(kb)
            if n is None:
                continue
            if op == OP_DELETE:
                first_set[n] = None
                had_delete[n] = True
            elif first_set[n] is None:
                first_set[n] = kb
        dropped: set[int] = set()
        for n, g in enumerate(merged):
            last = g[-1]  # recs are in LSN order: the group's latest record
            dropped.update(g[:-1])
            if first_set[n] is not None:
                keys[last] = _codec.decode_key(first_set[n])
                # the entry's size counts the encoding of the key object kept
                lsn_, op, _kb, vb, expire_at = recs[last]
                recs[last] = (lsn_, op, first_set[n], vb, expire_at)
            if had_delete[n]:
                fresh.add(last)
            else:
                fresh.discard(last)
        keep = [i for i in range(len(recs)) if i not in dropped]
        renumber = {old: new for new, old in enumerate(keep)}
        return ([recs[i] for i in keep], [keys[i] for i in keep], [cks[i] for i in keep],
                {renumber[i] for i in fresh if i in renumber})

    def _replay_into_pages(self, by_page: dict[int, list[int]], recs: list[tuple],
                           keys: list[Any], fresh: set[int], new: list[int], lsn: int,
                           now: float) -> None:
        """Apply final records to keys the store holds: fault each page in once
        and update or remove its keys. Keys to insert anew are appended to
        ``new`` (lock held; back-pressure between pages)."""
        tier = self._tier
        table = tier.table
        from_blob = self._codec.memory_form_from_blob
        pids = list(by_page)
        for c in range(0, len(pids), _FAULT_BATCH):
            chunk = pids[c:c + _FAULT_BATCH]
            rows = self._store.read_pages([p for p in chunk if p not in tier.pages])
            for pid in chunk:
                if tier.pending >= self.max_pending_pages:
                    self._backpressure()
                if pid not in tier.pages:  # (a page in memory is authoritative)
                    self._fault_in(pid, rows.get(pid))
                for i in by_page[pid]:
                    key = keys[i]
                    ref = table.get(key)
                    if ref is None:
                        new.append(i)  # no longer on the page the index names
                        continue
                    page, slot, _ = ref
                    _lsn, op, kb, vb, expire_at = recs[i]
                    old = page.expires[slot]
                    nbytes = len(kb) + len(vb)
                    if op == OP_SET and i not in fresh and tier.fits(page, nbytes):
                        tier.update(page, slot, from_blob(vb), expire_at, now, lsn, nbytes)
                        self._ttl_count += (expire_at is not None) - (old is not None)
                        if page.state == RESIDENT:
                            tier.touch(page)
                        else:
                            tier.fault_pending(page)
                        continue
                    if op == OP_SET:
                        if i not in fresh:
                            # the page would outgrow PAGE_BYTES_LIMIT: move the
                            # entry, keeping the key object first stored (and
                            # counting its encoding in the entry's size)
                            keys[i] = page.keys[slot]
                            recs[i] = (_lsn, op, _codec.encode_key(keys[i]), vb, expire_at)
                        new.append(i)
                    tier.remove(key, now, lsn)
                    self._count -= 1
                    if old is not None:
                        self._ttl_count -= 1

    def _insert_new_keys(self, recs: list[tuple], keys: list[Any], lsn: int,
                         now: float) -> None:
        """Insert keys that are nowhere yet with their final sets (lock held;
        back-pressure between batches of pages). They enter the key filter
        when a flush stores them (:meth:`flush_done`), not here."""
        if not recs:
            return
        tier = self._tier
        held = self._codec.memory_forms_from_blobs(map(_VALUE_OF, recs))
        expires = list(map(_EXPIRE_OF, recs))
        nbytes = list(map(operator.add, map(len, map(_KEY_OF, recs)),
                          map(len, map(_VALUE_OF, recs))))
        self._filter_reserve(len(keys))
        pos = 0
        while pos < len(keys):
            room = self.max_pending_pages - tier.pending
            if room <= 0:
                self._backpressure()
                continue
            end = tier.insert_many(keys, held, expires, nbytes, now, lsn, pos, room)
            self._count += end - pos
            self._ttl_count += end - pos - expires[pos:end].count(None)
            pos = end

    # -- helpers -----------------------------------------------------------------------

    def _now(self) -> float:
        """TTL clock, epoch seconds, never going backwards (lock held).

        When the wall clock steps back, TTL time does not: an offset is added
        to the wall clock from then on, so that no entry outlives its TTL (it
        only ever expires early, never late). The offset and the TTL time
        reached go to the store with the next flush (which a step back asks
        for at once), and an open starts from them (a wall clock still or
        again behind is stepped over the same way)."""
        raw = self._clock() if self._clock is not None else time.time()
        now = raw + self._clock_offset
        if now < self._last_now:
            self._clock_offset += self._last_now - now
            now = self._last_now
            self._ttl_clock = (self._clock_offset, now)
            if self._batcher is not None:
                self._batcher.kick(urgent=True)
        self._last_now = now
        return now

    def _check_open(self) -> None:
        if self._state is not _OPEN:
            if self._state is _FAILED:
                raise CacheFailedError(self.path, self._failure)
            raise CacheClosedError(self.path, forked=self._state is _FORKED)

    def _retire_after_fork(self) -> None:
        """In a forked child: make every call raise, touch no file, hold no lock.

        The child has the parent's descriptors but not its batcher thread,
        and a lock another parent thread held at the fork stays held forever:
        so the locks are replaced, and the store, log and lock file are kept
        (never closed, never unlocked) but never used again.
        """
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._state = _FORKED
        for part in (self._store, self._log, self._batcher):
            if part is not None:
                _immortal(part)
        self._store = self._log = self._batcher = None
        self._lock_fd = None

    def _locate(self, key: Any) -> tuple | list | None:
        """Find a key whose page is not in memory: key index, then page fault;
        return its page-table entry ``(page, slot, value)`` (see MemoryTier).

        A key of a subclass (an ``IntEnum`` member, a namedtuple) is looked
        up as the plain key it equals (:func:`~durablekv.codec.lookup_key`),
        as the page table does for a resident page.

        :raises TypeError: an unsupported key (from ``canonical_key``): every
            answer but the look-aside one below comes after that check.
        """
        if self._absent is key:
            # This very object was looked up a moment ago and not found, so it
            # passed the key check; nothing has inserted it since (an insert
            # clears this), so it cannot have reached the store: a look-aside
            # miss + fill costs one index lookup, not two. (Identity, not
            # equality: an equal key of an unsupported type, such as an
            # IntEnum member inside a tuple, must still meet the check.)
            return None
        try:
            ck = _codec.canonical_key(key)
        except TypeError:
            # A key a write refuses but that equals a storable one (an
            # IntEnum member equals its int): found as the page table finds
            # it for a resident page, so the answer never depends on
            # residency. Anything else raises the TypeError.
            plain = _codec.lookup_key(key)
            if plain is key:
                raise
            ck = _codec.canonical_key(plain)
        if self._clear_pending:
            return None
        if self._filter.ready and ck not in self._filter:
            self._absent = key
            return None
        found = self._store.find(ck)
        if found is None:
            self._absent = key
            return None
        pid = found[0]
        if pid in self._tier.pages:
            return None  # its page is in memory and no longer holds it
        self._fault_in(pid, None if found[1] is None else found[1:])
        return self._tier.table.get(key)

    def _fault_in(self, pid: int, row: tuple[int, bytes] | None = None) -> Page:
        """Read page ``pid`` (or use ``row`` = (n, blob) already read) and make it resident."""
        if row is None:
            row = self._store.read_page(pid)
        slots, keys, values, expires = self._decode_page(pid, row)
        return self._tier.install(pid, slots, keys, values, expires, len(row[1]))

    def _check_disjoint(self, pid: int, keys: list[Any]) -> None:
        """A stored page that is not in memory cannot hold a key the memory
        tier holds: a key leaves a page only while that page is in memory,
        and the page stays there until a flush has stored it without the key.

        :raises CorruptStoreError: it does (the store is marked damaged).
        """
        table = self._tier.table
        if not table.keys().isdisjoint(keys):
            key = next(k for k in keys if k in table)
            raise self._damaged(f"page {pid} holds key {key!r}, which lives in another page")

    def _damaged(self, detail: str) -> CorruptStoreError:
        """Mark the store damaged (``detail`` says how) and return the error
        to raise: the next open refuses the store until it is repaired."""
        mark_damaged(self._store.path, detail)
        return CorruptStoreError(self._store.path, detail)

    def _decode_page(self, pid: int, row: tuple[int, bytes] | None
                     ) -> tuple[list[int], list[Any], list[Any], list[float | None]]:
        """``(slots, keys, values, expires)`` of a stored page that is not in
        memory (``row`` = ``(n_entries, blob)``, None when the key index named
        a page the store lacks), values in their memory form.

        :raises CorruptStoreError: the page is missing, cannot be decoded,
            disagrees with itself, or holds a key the memory tier holds (see
            :meth:`_check_disjoint`); the store is marked damaged.
        """
        if row is None:
            raise self._damaged(f"the key index points at page {pid}, which is missing")
        n, data = row
        from_blob = self._codec.memory_form_from_blob
        decode_key = _codec.decode_key
        try:
            if type(n) is not int or not 0 < n <= self.page_size:
                # before anything is decoded: a blob of any size costs no more
                raise ValueError(f"its row says {n!r} entries, not 1 to page_size "
                                 f"{self.page_size}")
            if data[:2] == b"\xff\xff":
                slots, expires, flags, keys, values = page_columns(data)
                if not flags & (ASCII_KEYS | INT_KEYS):
                    keys = [decode_key(kb) for kb in keys]
                if not flags & RAW_BYTES:
                    values = [from_blob(vb) for vb in values]
                elif type(self._codec) is not _codec.SafeCodec:
                    # another codec's blobs that happen to look like bytes (the
                    # safe codec holds a bytes value as itself)
                    values = [from_blob(b"b" + _U32_PACK(len(vb)) + vb) for vb in values]
            else:
                slots, expires, kbs, vbs = split_page(data)
                keys = [decode_key(kb) for kb in kbs]
                values = [from_blob(vb) for vb in vbs]
            count = len(slots)
            if count != n:
                raise ValueError(f"its row says {n} entries, its blob holds {count}")
            if count and max(slots) >= self.page_size:
                raise ValueError(f"slot {max(slots)} is past page_size {self.page_size}")
            if len(set(slots)) != count:
                raise ValueError("it lists a slot twice")
            if len(set(keys)) != count:
                raise ValueError("it holds a key twice")
        except (ValueError, IndexError, TypeError, UnicodeDecodeError) as exc:
            raise self._damaged(f"page {pid} cannot be decoded: {exc}") from exc
        self._check_disjoint(pid, keys)
        return slots, keys, values, expires

    def _ref(self, key: Any, now_fn=None) -> tuple | list | None:
        """The page-table entry ``(page, slot, value)`` of a live key, faulting
        its page in; None when absent.

        Expired entries found on the way are removed (lock held).
        """
        try:
            ref = self._tier.table.get(key)
        except TypeError:
            _codec.check_key(key)  # the same TypeError as set() gives, naming the type
            raise
        if ref is None:
            ref = self._locate(key)
            if ref is None:
                return None
        page, slot, _ = ref
        exp = page.expires[slot]
        if exp is not None and self._now() >= exp:
            self._expire(key)
            return None
        return ref

    def _expire(self, key: Any) -> None:
        """Drop an expired entry (no log record: replaying its set re-creates an
        entry that is just as expired)."""
        self._tier.remove(key, _REAL_MONOTONIC[0](), self._last_lsn + 1)
        self._count -= 1
        self._ttl_count -= 1
        self._expirations += 1

    def _backpressure(self) -> None:
        """Block (lock released) while too many evicted dirty pages wait."""
        tier = self._tier
        if tier.pending < self.max_pending_pages:
            return
        batcher = self._batcher
        errors = batcher.errors
        batcher.kick(retry=True)  # one attempt at once, even during a back-off
        while tier.pending >= self.max_pending_pages:
            if batcher.errors > errors and batcher.failing:
                raise WriteBehindError(self.path, batcher.last_error,
                                       f"{tier.pending} dirty pages are waiting and the "
                                       f"write-behind flush to {self.path!r} is failing "
                                       f"({batcher.last_error!r}); the write was NOT stored. "
                                       "Fix the store (disk space, locks) and retry")
            if self._state is not _OPEN:
                self._check_open()
            batcher.kick(urgent=True)
            self._cond.wait(0.5)
        if self._state is not _OPEN:
            # closed (or failed) while this waited with the lock released
            self._check_open()

    def _apply_set(self, key: Any, held: Any, expire_at: float | None,
                   ref: tuple | list | None, lsn: int, nbytes: int) -> None:
        """Apply a logged set (lock held). ``nbytes``: encoded key + value size."""
        tier = self._tier
        now = _REAL_MONOTONIC[0]()
        if ref is not None:
            page, slot, _ = ref
            old = page.expires[slot]
            if tier.fits(page, nbytes):
                tier.update(page, slot, held, expire_at, now, lsn, nbytes)
                self._ttl_count += (expire_at is not None) - (old is not None)
                if page.state == RESIDENT:
                    tier.touch(page)
                else:
                    tier.fault_pending(page)
            else:
                # The page would outgrow PAGE_BYTES_LIMIT: move the entry to
                # another page, keeping the key object first stored.
                key = page.keys[slot]
                tier.remove(key, now, lsn)
                tier.insert(key, held, expire_at, now, lsn, nbytes)
                self._ttl_count += (expire_at is not None) - (old is not None)
        else:
            tier.insert(key, held, expire_at, now, lsn, nbytes)
            self._absent = _MISSING  # (the key filter gets it when a flush stores it)
            self._count += 1
            if expire_at is not None:
                self._ttl_count += 1
        if tier.pending * 2 >= self.max_pending_pages:
            self._batcher.kick(urgent=True)
        elif len(tier.dirty) == self.flush_batch_pages:
            self._batcher.kick()

    def _apply_delete(self, key: Any, lsn: int) -> None:
        page, slot, _ = self._tier.table[key]
        if page.expires[slot] is not None:
            self._ttl_count -= 1
        self._tier.remove(key, _REAL_MONOTONIC[0](), lsn)
        self._count -= 1
        if self._tier.pending * 2 >= self.max_pending_pages:
            self._batcher.kick(urgent=True)

    def _filter_add_many(self, cks: list[bytes]) -> None:
        """Add keys a flush just committed to the store's key index to the key
        filter (lock held); start building a larger one when it is overfull.

        A filter being built (or not ready yet) gets nothing here: the
        batcher's scan that completes it (:meth:`background_work`) starts
        after the build did and reads every commit made before it, and no
        commit happens between that scan and its merge (one thread does
        both)."""
        f = self._filter
        if f.ready:
            f.add_many(cks)
            if f.overfull and self._filter_building is None:
                self._start_filter_build(KeyFilter(4 * max(f.added, self._count)))

    def _filter_reserve(self, n: int) -> None:
        """Make room for ``n`` new keys entering the memory tier at once
        (recovery; lock held): the flushes that store them add them to the
        filter, so size it for them now instead of rebuilding it each time
        it fills up."""
        f, building = self._filter, self._filter_building
        target = f if building is None else building
        if target.added + n <= 2 * target.capacity:  # not overfull afterwards
            return
        if building is None and f.ready and f.added == 0:
            # No flush has added a key since this filter was complete, so the
            # store holds none outside the pages in memory (a new or a cleared
            # store; a commit whose flush_done is still to come adds its keys
            # to whichever filter is current then): an empty bigger filter is
            # as complete.
            self._filter = KeyFilter(2 * n)
            self._filter.ready = True
            return
        self._start_filter_build(KeyFilter(2 * (max(target.added, self._count) + n)))

    def _start_filter_build(self, target: KeyFilter) -> None:
        """Start building ``target`` (lock held, or at open): the store's keys go
        in through the batcher's scan (:meth:`background_work`); once it is
        the filter, later commits add theirs through :meth:`flush_done`. Keys
        only in memory stay out of it: the page table finds them, and they go
        in when a flush stores them."""
        self._filter_building = target

    def background_work(self) -> None:
        """Batcher thread, between cycles: remove expired entries from stored
        pages (:meth:`_sweep_expired`), and scan the store's keys into the
        filter being built. No commit can happen meanwhile (this thread makes
        them)."""
        if self._sweep_on and _REAL_MONOTONIC[0]() >= self._sweep_paused_until:
            # Flushes must go on whatever the sweep meets.
            try:
                self._sweep_expired()
            except CorruptStoreError as exc:
                # The store is marked damaged (the next open refuses it) and a
                # get of that page's keys raises too.
                self._sweep_on = False
                log.error("expiry sweep of %s stopped: %s", self.path, exc)
            except StoreError as exc:
                # A failed read (I/O error, locked): the flush that follows
                # meets the same store and reports a lasting fault; the sweep
                # tries again later.
                self._sweep_paused_until = _REAL_MONOTONIC[0]() + _SWEEP_RETRY
                log.warning("expiry sweep of %s paused for %.0f s: %s", self.path,
                            _SWEEP_RETRY, exc)
        with self._lock:
            target = self._filter_building
        if target is None:
            return
        scanned = KeyFilter(target.capacity)
        scanned.add_all(self._store.iter_keys())
        with self._lock:
            if self._filter_building is target:
                target.merge(scanned)
                target.ready = True
                self._filter = target
                self._filter_building = None

    def _apply_clear(self, lsn: int) -> None:
        self._tier.clear()
        self._filter = KeyFilter(self._filter.capacity)
        self._filter.ready = True  # the store is about to be emptied
        self._filter_building = None
        self._count = 0
        self._ttl_count = 0
        self._clear_pending = True
        self._clear_lsn = lsn

    def _append(self, op: int, kb: bytes, vb: bytes, expire_at: float | None) -> int:
        """Assign the next LSN and log the record (lock held); return the LSN."""
        lsn = self._last_lsn + 1
        if self._log is not None:
            self._log.append(lsn, op, kb, vb, expire_at)
        self._last_lsn = lsn
        return lsn

    def _sync(self, lsn: int) -> None:
        """fsync mode: return once the record is on disk (no lock held)."""
        try:
            self._log.sync_to(lsn)
        except LogWriteError as exc:
            # After a failed fsync the kernel may have dropped the dirty pages:
            # what is on disk is unknown, so stop accepting writes (fail-stop).
            with self._lock:
                self._failure = exc
                self._state = _FAILED
            raise

    # -- the mapping API -----------------------------------------------------------------

    def get(self, key: Any, default: Any = None) -> Any:
        """Return the value for ``key``, or ``default`` when missing or expired.

        A memory hit on an entry with no TTL takes no lock: one page-table
        lookup, whose entry holds the value (kept in step by every write),
        and an LRU touch of the page. Anything else takes the lock: a key whose
        page is not resident is found through the SQLite key index and its
        page is faulted in (a ``store`` hit).

        :raises TypeError: ``key`` has an unsupported type (as a dict would for
            an unhashable key).
        :raises CacheClosedError: the cache is closed.
        """
        if self._state is _OPEN:
            table = self._table
            try:
                ref = table.get(key)
            except TypeError:
                ref = None  # the locked path raises the TypeError set() gives
            if ref is not None:
                # The entry's value is read in one load, which sees it before
                # a write or after it; an entry that left the table meanwhile
                # has the value it had when it left, live until then (see
                # MemoryTier). HAS_TTL: the expiry must be checked, locked.
                v = ref[2]
                if v is not HAS_TTL:
                    page = ref[0]
                    if page.state == RESIDENT:
                        # the tick is also the hit count (MemoryTier.ticks)
                        page.stamp = next(self._ticks)
                        return v if type(v) is not _Frozen else self._codec.decode(v.blob)
        return self._get_locked(key, default)

    def _get_locked(self, key: Any, default: Any) -> Any:
        """:meth:`get` under the lock: expiry, page faults, misses."""
        with self._lock:
            return self._get_held(key, default)

    def _get_held(self, key: Any, default: Any) -> Any:
        """:meth:`_get_locked`'s work, the lock held."""
        if self._state is not _OPEN:
            self._check_open()
        try:
            ref = self._table.get(key)
        except TypeError:
            _codec.check_key(key)  # the same TypeError as set() gives
            raise
        if ref is not None:
            page, slot, _ = ref
            exp = page.expires[slot]
            if exp is not None and self._now() >= exp:
                self._expire(key)
                self._misses += 1
                return default
            if page.state == RESIDENT:
                page.stamp = next(self._ticks)
                self._tier.locked_ticks += 1
                self._memory_hits += 1
            else:
                self._tier.fault_pending(page)
                self._store_hits += 1
            v = page.values[slot]
            return v if type(v) is not _Frozen else self._codec.decode(v.blob)
        # Not in the page table: _ref's steps without its second lookup.
        ref = self._locate(key)
        if ref is not None:
            page, slot, _ = ref
            exp = page.expires[slot]
            if exp is None or self._now() < exp:
                self._store_hits += 1
                return self._codec.from_memory(page.values[slot])
            self._expire(key)
        self._misses += 1
        return default

    def __getitem__(self, key: Any) -> Any:
        value = self.get(key, _MISSING)
        if value is _MISSING:
            raise KeyError(key)
        return value

    def __contains__(self, key: Any) -> bool:
        """``key in cache``: whether a live entry is there (no hit or miss is
        counted). An entry in memory with no TTL is found without the lock,
        by the page-table lookup of :meth:`get`'s memory hit.

        :raises TypeError: ``key`` has an unsupported type.
        :raises CacheClosedError: the cache is closed.
        """
        if self._state is _OPEN:
            try:
                ref = self._table.get(key)
            except TypeError:
                ref = None  # the locked path raises the TypeError set() gives
            if ref is not None and ref[2] is not HAS_TTL:
                return True
        return self._contains_locked(key)

    def _contains_locked(self, key: Any) -> bool:
        with self._lock:
            self._check_open()
            return self._ref(key) is not None

    def set(self, key: Any, value: Any, expire: float | None = None, *,
            tag: Any = None) -> None:
        """Store ``value`` under ``key``.

        :param expire: seconds from now (float) after which the entry is gone;
            None never expires; 0 stores nothing (the entry would already be
            expired) and removes an existing value.
        :raises TypeError: unsupported key or value type (names the type).
        :raises ValueError: ``expire`` negative, NaN or infinite; value bigger
            than ``max_value_bytes``.
        :raises LogWriteError: the replay log could not be written; nothing
            was stored.
        :raises CacheClosedError, CacheFailedError: closed or failed cache.
        :raises TypeError: ``tag`` given: entries carry no tag (see :meth:`evict`).

        Durability: returns once the log record is in the OS (``log``),
        fsynced (``fsync``), or only in memory (``none``); SQLite gets the
        page within about ``flush_interval`` seconds.
        """
        if expire is not None:
            expire = _check_expire(expire)
        if tag is not None:
            raise _tags_refused("set(..., tag=...)")
        if type(key) is str and type(value) is bytes and self._codec.name == "safe":
            # The common entry, encoded inline (_encode_entry's steps, no calls).
            kb = key.encode("utf-8", "surrogatepass")
            kb = b"s" + _U32_PACK(len(kb)) + kb
            if len(kb) > MAX_KEY_BYTES:
                raise _key_too_long(kb)
            if len(value) > self.max_value_bytes:
                raise self._value_too_big(key, len(value))
            vb = b"b" + _U32_PACK(len(value)) + value
            held = value
            nbytes = len(kb) + len(vb)
            ck = kb  # a str key's encoding is its canonical key
        else:
            kb, vb, held, nbytes = self._encode_entry(key, value)
            ck = None
        with self._lock:
            if self._state is not _OPEN:
                self._check_open()
            tier = self._tier
            if tier.pending >= self.max_pending_pages:
                self._backpressure()
            if expire is None:
                ref = tier.table.get(key)
                if ref is not None:
                    page = ref[0]
                    if ref[2] is not HAS_TTL and page.state == RESIDENT and \
                            page.nbytes + nbytes <= _pages.PAGE_BYTES_LIMIT:
                        # The hot path: overwrite a live, resident entry. Same
                        # steps as _append + MemoryTier.update, without the calls.
                        lsn = self._last_lsn + 1
                        if self._log is not None:
                            self._log.append(lsn, OP_SET, kb, vb, None)
                        self._last_lsn = lsn
                        page.values[ref[1]] = held
                        if type(ref) is list:
                            ref[2] = held
                        else:  # its first overwrite (see MemoryTier)
                            tier.table[key] = [page, ref[1], held]
                        page.nbytes += nbytes
                        page.version += 1
                        if page.dirty_lsn is None:
                            page.dirty_lsn = lsn
                        dirty = tier.dirty
                        if page.page_id not in dirty:
                            dirty[page.page_id] = page
                            page.dirty_since = _REAL_MONOTONIC[0]()
                            if len(dirty) == self.flush_batch_pages:
                                self._batcher.kick()
                        page.stamp = next(self._ticks)
                        tier.locked_ticks += 1
                        self._sets += 1
                        lsn_to_sync = lsn
                        expire_at = None
                    else:
                        lsn_to_sync = None
                elif ck is not None and (self._absent is key or self._clear_pending or (
                        self._filter.ready and ck not in self._filter)):
                    # A new key that SQLite cannot hold either (the look-aside
                    # miss, a pending clear, or the key filter says so: the
                    # questions _locate asks, with the key already encoded):
                    # insert it without asking _ref again.
                    lsn_to_sync = self._logged_set(key, kb, vb, held, None, None, nbytes)
                else:
                    lsn_to_sync = None
                expire_at = None
            else:
                expire_at = self._now() + expire
                lsn_to_sync = None
                if expire == 0:
                    # Already expired: store nothing, drop what was there.
                    ref = tier.table.get(key) or self._locate(key)
                    self._sets += 1
                    if ref is None:
                        return
                    lsn_to_sync = self._append(OP_DELETE, kb, b"", None)
                    self._apply_delete(key, lsn_to_sync)
            if lsn_to_sync is None:
                # An expired entry is gone: the key is stored anew (keeping the
                # new key object, as a dict does for a fresh key), not updated.
                lsn_to_sync = self._logged_set(key, kb, vb, held, expire_at,
                                               self._ref(key), nbytes)
        if self._sync_writes:
            self._sync(lsn_to_sync)

    def __setitem__(self, key: Any, value: Any) -> None:
        self.set(key, value)

    def _logged_set(self, key: Any, kb: bytes, vb: bytes, held: Any, expire_at: float | None,
                    ref: tuple | list | None, nbytes: int) -> int:
        """Log a set and apply it (lock held); return its LSN. ``ref``: the
        key's live page-table entry or None (see :meth:`_apply_set`)."""
        lsn = self._append(OP_SET, kb, vb, expire_at)
        self._apply_set(key, held, expire_at, ref, lsn, nbytes)
        self._sets += 1
        return lsn

    # -- calls that never wait (durablekv.aio runs them on an event loop's thread) --

    def _in_memory(self, key: Any) -> bool:
        """Whether ``key``'s entry, or its absence, is known without reading
        SQLite (lock held): its page is in memory, or the store cannot hold
        it (the look-aside miss, a pending clear, the key filter)."""
        try:
            if self._tier.table.get(key) is not None:
                return True
            if self._absent is key or self._clear_pending:
                return True
            return self._filter.ready and _codec.canonical_key(key) not in self._filter
        except TypeError:
            return False  # the waiting path raises the TypeError set() gives

    def _get_nowait(self, key: Any, default: Any) -> Any:
        """:meth:`get` if it can answer without waiting (the lock is free and
        nothing needs SQLite); :data:`NOWAIT_UNSURE` (nothing done) otherwise."""
        if not self._lock.acquire(blocking=False):
            return NOWAIT_UNSURE
        try:
            if self._state is not _OPEN or not self._in_memory(key):
                return NOWAIT_UNSURE
            return self._get_held(key, default)
        finally:
            self._lock.release()

    def _set_nowait(self, key: Any, value: Any, expire: float | None = None) -> bool:
        """:meth:`set` if it can be done without waiting; False (nothing done)
        when it could wait: fsync durability, the lock taken, back-pressure,
        a log segment to roll (an fsync), an entry that needs SQLite.

        :raises TypeError, ValueError: as :meth:`set` (nothing done).
        """
        if self.durability == "fsync":
            return False
        if expire is not None:
            expire = _check_expire(expire)
            if expire == 0:
                return False
        kb, vb, held, nbytes = self._encode_entry(key, value)
        if not self._lock.acquire(blocking=False):
            return False
        try:
            log = self._log
            if self._state is not _OPEN or self._tier.pending >= self.max_pending_pages or \
                    (log is not None and log._size >= log.segment_bytes) or \
                    not self._in_memory(key):
                return False
            expire_at = None if expire is None else self._now() + expire
            self._logged_set(key, kb, vb, held, expire_at, self._ref(key), nbytes)
            return True
        finally:
            self._lock.release()

    def _value_too_big(self, key: Any, size: int) -> ValueError:
        fix = ("store it elsewhere (max_value_bytes is at its largest, "
               f"MAX_VALUE_BYTES_LIMIT={MAX_VALUE_BYTES_LIMIT}: one entry must fit in a page)"
               if self.max_value_bytes >= MAX_VALUE_BYTES_LIMIT else
               f"store it elsewhere or raise max_value_bytes (up to {MAX_VALUE_BYTES_LIMIT})")
        return ValueError(f"value for key {key!r} is {size} bytes, over max_value_bytes="
                          f"{self.max_value_bytes}; {fix}")

    def _encode_entry(self, key: Any, value: Any) -> tuple[bytes, bytes, Any, int]:
        """``(key bytes, value bytes, memory form, encoded size)`` of an entry,
        with the key and value checks every write makes (set inlines these
        steps for a str key and a bytes value).

        :raises TypeError: unsupported key or value type.
        :raises ValueError: key or value over its size limit.
        """
        if type(key) is str:
            kb = key.encode("utf-8", "surrogatepass")
            kb = b"s" + _U32_PACK(len(kb)) + kb
        else:
            kb = _codec.encode_key(key)
        if len(kb) > MAX_KEY_BYTES:
            raise _key_too_long(kb)
        codec = self._codec
        vb = codec.encode(value)
        size = codec.value_bytes(value, vb)
        if size > self.max_value_bytes:
            raise self._value_too_big(key, size)
        return kb, vb, codec.memory_form(value, vb), len(kb) + len(vb)

    def _open_for_writes(self) -> None:
        """The checks every write makes first (lock held): open, and room
        for one more dirty page (back-pressure)."""
        if self._state is not _OPEN:
            self._check_open()
        if self._tier.pending >= self.max_pending_pages:
            self._backpressure()

    def add(self, key: Any, value: Any, expire: float | None = None, *,
            tag: Any = None) -> bool:
        """Store ``value`` under ``key`` only if no live entry is there (an
        expired one does not count); return True if it was stored.

        Atomic: of many threads adding the same key, one wins (Redis's
        ``SET ... NX``, diskcache's ``Cache.add``). ``expire`` is as for
        :meth:`set`, except that it cannot be 0: the entry would be expired
        as it is stored, and True would claim a key that is not there.

        :raises TypeError, ValueError: as for :meth:`set`; ValueError for
            ``expire=0``.
        :raises LogWriteError, CacheClosedError, CacheFailedError: as for :meth:`set`.
        :raises TypeError: ``tag`` given (see :meth:`evict`).
        """
        if tag is not None:
            raise _tags_refused("add(..., tag=...)")
        if expire is not None:
            expire = _check_expire(expire)
            if expire == 0:
                raise ValueError("add() with expire=0 would store an entry that is already "
                                 "expired; pass a positive expire, or None for no expiry")
        kb, vb, held, nbytes = self._encode_entry(key, value)
        with self._lock:
            self._open_for_writes()
            if self._ref(key) is not None:
                return False
            expire_at = None if expire is None else self._now() + expire
            lsn = self._logged_set(key, kb, vb, held, expire_at, None, nbytes)
        if self._sync_writes:
            self._sync(lsn)
        return True

    def incr(self, key: Any, delta: int = 1, default: int | None = 0) -> int:
        """Add ``delta`` to the int stored under ``key``; return the new value.

        Atomic: concurrent increments are never lost (Redis's ``INCRBY``,
        diskcache's ``Cache.incr``). A missing or expired key counts from
        ``default`` and is stored with no TTL; a live entry keeps its TTL.
        The new value is logged like any set, so it survives a crash under
        the cache's durability.

        :param delta: int to add (negative to subtract; see :meth:`decr`).
        :param default: int a missing key starts from; None makes a missing
            key a KeyError.
        :raises KeyError: ``key`` is missing and ``default`` is None.
        :raises TypeError: the stored value, ``delta`` or ``default`` is not
            an int (a bool does not count as one).
        :raises LogWriteError, CacheClosedError, CacheFailedError: as for :meth:`set`.
        """
        _check_counter_args("incr", delta, default)
        # refused before the lookup, as every write does (a lookup would
        # find an entry through an equal key of an unsupported type)
        _codec.check_key(key)
        with self._lock:
            self._open_for_writes()
            ref = self._ref(key)
            if ref is None:
                if default is None:
                    raise KeyError(key)
                value, expire_at = default + delta, None
            else:
                page, slot, _ = ref
                old = self._codec.from_memory(page.values[slot])
                if type(old) is not int:
                    raise TypeError(f"cannot incr() key {key!r}: its value is a "
                                    f"{type(old).__qualname__}, not an int")
                value, expire_at = old + delta, page.expires[slot]
            # encoded under the lock: the new value depends on the old one
            kb, vb, held, nbytes = self._encode_entry(key, value)
            lsn = self._logged_set(key, kb, vb, held, expire_at, ref, nbytes)
        if self._sync_writes:
            self._sync(lsn)
        return value

    def decr(self, key: Any, delta: int = 1, default: int | None = 0) -> int:
        """``incr(key, -delta, default)``: subtract ``delta``; return the new value.

        :raises KeyError, TypeError: as for :meth:`incr`.
        """
        _check_counter_args("decr", delta, default)
        return self.incr(key, -delta, default)

    def touch(self, key: Any, expire: float | None = None) -> bool:
        """Give a live entry a new TTL: ``expire`` seconds from now, or None
        for none; return True if ``key`` was there (Redis's ``EXPIRE`` and
        ``PERSIST``, diskcache's ``Cache.touch``). The value is unchanged;
        ``expire=0`` removes the entry (as :meth:`set` with ``expire=0`` does).

        :raises TypeError: unsupported key type.
        :raises ValueError: ``expire`` negative, NaN or infinite.
        :raises LogWriteError, CacheClosedError, CacheFailedError: as for :meth:`set`.
        """
        if expire is not None:
            expire = _check_expire(expire)
        # A write checks its key as set and delete do (a lookup would find an
        # entry through an equal key of an unsupported type, e.g. an IntEnum).
        _codec.encode_key(key)
        with self._lock:
            self._open_for_writes()
            ref = self._ref(key)
            if ref is None:
                return False
            page, slot, _ = ref
            # logged as a set of the same value, under the key object the
            # entry keeps (a set of an equal key keeps it too)
            kb = _codec.encode_key(page.keys[slot])
            if expire == 0:
                lsn = self._append(OP_DELETE, kb, b"", None)
                self._apply_delete(key, lsn)
                self._deletes += 1
            else:
                held = page.values[slot]
                vb = self._codec.to_blob(held)
                expire_at = None if expire is None else self._now() + expire
                lsn = self._logged_set(key, kb, vb, held, expire_at, ref, len(kb) + len(vb))
        if self._sync_writes:
            self._sync(lsn)
        return True

    def delete(self, key: Any) -> bool:
        """Remove ``key``; return True if a live entry was there.

        :raises TypeError: unsupported key type.
        :raises LogWriteError, CacheClosedError, CacheFailedError: as for :meth:`set`.
        """
        kb = _codec.encode_key(key)
        with self._lock:
            self._open_for_writes()
            if self._ref(key) is None:
                return False
            lsn = self._append(OP_DELETE, kb, b"", None)
            self._apply_delete(key, lsn)
            self._deletes += 1
        if self._sync_writes:
            self._sync(lsn)
        return True

    def __delitem__(self, key: Any) -> None:
        if not self.delete(key):
            raise KeyError(key)

    def pop(self, key: Any, default: Any = _MISSING) -> Any:
        """Remove ``key`` and return its value; ``default`` (or KeyError) when missing."""
        kb = _codec.encode_key(key)
        with self._lock:
            self._open_for_writes()
            ref = self._ref(key)
            if ref is None:
                if default is _MISSING:
                    raise KeyError(key)
                return default
            page, slot, _ = ref
            value = self._codec.from_memory(page.values[slot])
            lsn = self._append(OP_DELETE, kb, b"", None)
            self._apply_delete(key, lsn)
            self._deletes += 1
        if self._sync_writes:
            self._sync(lsn)
        return value

    def setdefault(self, key: Any, default: Any = None) -> Any:
        """Return the value of a live ``key``; if there is none, store
        ``default`` under it (no TTL) and return ``default``.

        Atomic, one step under the cache lock as :meth:`add` is: of many
        threads calling ``setdefault`` on the same missing key, exactly one
        stores its default and every caller gets that one stored value (the
        inherited ``MutableMapping.setdefault`` looked up, then stored, and
        two callers could each be told their default was stored).

        :raises TypeError, ValueError: as for :meth:`set` (``default`` is
            checked even when the key is present).
        :raises LogWriteError, CacheClosedError, CacheFailedError: as for :meth:`set`.
        """
        kb, vb, held, nbytes = self._encode_entry(key, default)
        with self._lock:
            self._open_for_writes()
            ref = self._ref(key)
            if ref is not None:
                page, slot, _ = ref
                return self._codec.from_memory(page.values[slot])
            lsn = self._logged_set(key, kb, vb, held, None, None, nbytes)
        if self.durability == "fsync":
            self._sync(lsn)
        return default

    def update(self, other: Any = (), /, **kwargs: Any) -> None:
        """``dict.update``: store each pair of ``other`` (a mapping, or an
        iterable of ``(key, value)`` pairs) and of ``kwargs``, in order.

        Each pair is one :meth:`set` (logged and applied atomically); the
        update as a whole is not one step, so a reader may see some of the
        pairs before the rest. Nothing is read and then written back, so no
        concurrent write is lost.

        :raises TypeError, ValueError, LogWriteError, CacheClosedError,
            CacheFailedError: as for :meth:`set`; pairs before the failing
            one stay stored.
        """
        MutableMapping.update(self, other, **kwargs)

    def popitem(self) -> tuple[Any, Any]:
        """Remove and return some ``(key, value)``; KeyError when empty."""
        while True:
            with self._lock:
                self._check_open()
                key = next(iter(self._tier.table), _MISSING)
                if key is _MISSING and not self._clear_pending:
                    row = self._store.any_key(set(self._tier.pages))
                    if row is not None:
                        key = _codec.decode_key(row[1] or row[0])
            if key is _MISSING:
                raise KeyError("popitem(): cache is empty")
            # pop() takes _MISSING as "no default": a key that expired or was
            # removed meanwhile raises KeyError, and another key is tried.
            try:
                return key, self.pop(key)
            except KeyError:
                continue

    def clear(self) -> None:
        """Remove every entry (one log record; the store is emptied by the next flush)."""
        with self._lock:
            self._check_open()
            lsn = self._append(OP_CLEAR, b"", b"", None)
            self._apply_clear(lsn)
            self._batcher.kick()
        if self._sync_writes:
            self._sync(lsn)

    def __len__(self) -> int:
        """Live entries: expired ones never count.

        Expired entries in memory are removed; those on pages only in SQLite
        are counted there (one indexed query) and left for a later access to
        remove, so ``len()`` faults no page in and evicts none (a page in
        memory left empty by the removals leaves the LRU, as after a delete)."""
        with self._lock:
            self._check_open()
            if not self._ttl_count:
                return self._count
            now = self._now()
            self._expire_in_memory(now)
            if self._clear_pending or not self._ttl_count:
                return self._count
            # A page not in memory is exactly as committed, and its index
            # rows carry its entries' expiries; a page in memory was counted
            # above.
            pages = self._tier.pages
            return self._count - sum(n for pid, n in self._store.expired_by_page(now)
                                     if pid not in pages)

    def expire(self) -> int:
        """Remove every entry whose TTL has passed, in memory and in SQLite;
        return how many were removed (int).

        As diskcache's ``Cache.expire()``. Entries in memory go at once.
        Pages only in SQLite that hold expired entries are found through the
        expiry index and read; their expired entries are removed and the
        write-behind rewrites them. Those pages wait for it outside the LRU
        order (as evicted dirty pages do), so the working set stays resident
        and no page fault is counted. Removing an expired entry writes no
        log record: replaying its set re-creates an entry that is just as
        expired.

        The write-behind does the same on its own, for up to
        ``flush_batch_pages`` pages before each flush it runs, so entries
        that expire unread do not stay on disk. Call this to reclaim them at
        once, or to bound the work to one place (after a bulk expiry).

        Back-pressure applies as for a write: while ``max_pending_pages``
        pages wait for the write-behind, this waits with the lock released.

        :raises CacheClosedError, CacheFailedError: closed or failed cache.
        :raises WriteBehindError: pages are waiting and the write-behind is
            failing.
        :raises CorruptStoreError: a stored page cannot be decoded (the store
            is marked damaged, as a get of one of its keys would).
        """
        with self._lock:
            self._check_open()
            if not self._ttl_count:
                return 0
            now = self._now()
            tier = self._tier
            removed = self._expire_in_memory(now)
            seen: set[int] = set()  # each page is done at most once
            while self._ttl_count and not self._clear_pending:
                room = self.max_pending_pages - tier.pending
                if room <= 0:
                    self._backpressure()  # the lock is released meanwhile
                    continue
                # Pages in memory are named too: one faulted in during a
                # back-pressure wait still holds its expired entries.
                pids = self._store.expired_pages(now, seen, room)
                if not pids:
                    break
                seen.update(pids)
                for pid in pids:
                    removed += self._expire_page(pid, now)
            return removed

    def _expire_in_memory(self, now: float) -> int:
        """Remove the entries in memory expired at ``now`` (lock held); return
        how many. Only page-table entries marked ``HAS_TTL`` are looked at."""
        doomed = [k for k, (p, s, v) in self._tier.table.items()
                  if v is HAS_TTL and now >= p.expires[s]]
        for k in doomed:
            self._expire(k)
        return len(doomed)

    def _sweep_expired(self) -> int:
        """Batcher thread, before each cycle: remove the expired entries of
        up to ``flush_batch_pages`` pages named by the expiry index, as
        :meth:`expire` does: a page in memory loses them there; a page only
        in SQLite is read and taken in as pending. Only while fewer than
        half of ``max_pending_pages`` pages wait (it never waits for
        back-pressure: this thread is the one that relieves it). The lock is
        taken once per ``_SWEEP_SLICE`` pages. The cycle that follows stores
        the pages it changed, and with them their index rows go. Returns the
        entries removed.

        :raises StoreError: the expiry scan or a page read failed.
        :raises CorruptStoreError: a stored page cannot be decoded.
        """
        removed = 0
        budget = self.flush_batch_pages
        seen: set[int] = set()  # pages done in this call: their rows go at the flush
        while budget > 0:
            with self._lock:
                tier = self._tier
                if self._state is not _OPEN or not self._ttl_count or self._clear_pending:
                    break
                # (at least one page: max_pending_pages may be 1)
                room = min(budget, _SWEEP_SLICE,
                           max(1, self.max_pending_pages // 2) - tier.pending)
                if room <= 0:
                    break
                now = self._now()
                pids = self._store.expired_pages(now, seen, room)
                seen.update(pids)
                for pid in pids:
                    removed += self._expire_page(pid, now)
            if len(pids) < room:
                break
            budget -= len(pids)
        return removed

    def _expire_page(self, pid: int, now: float) -> int:
        """Remove the entries of page ``pid`` expired at ``now`` (lock held);
        return how many. A page in memory loses them there (its index rows
        go when a flush stores it; until then the expiry index names it
        again, with nothing left to remove). A page only in SQLite is read
        and taken in as pending, not resident, and dirtied: the write-behind
        rewrites it.

        :raises CorruptStoreError: the stored page is missing or damaged.
        """
        page = self._tier.pages.get(pid)
        if page is not None:
            doomed = _expired_keys(page.keys, page.expires, now)
        else:
            row = self._store.read_page(pid)
            slots, keys, values, expires = self._decode_page(pid, row)
            doomed = _expired_keys(keys, expires, now)
            if not doomed:
                # Its index rows say otherwise: a disagreement that `durablekv
                # check` reports; the page stays as it is.
                return 0
            self._tier.install(pid, slots, keys, values, expires, len(row[1]), resident=False)
        for k in doomed:
            self._expire(k)
        return len(doomed)

    def _snapshot_keys(self) -> list[Any]:
        keys, stored = self._snapshot()
        for group in stored.values():
            keys += group
        return keys

    def _snapshot(self) -> tuple[list[Any], dict[int, list[Any]]]:
        """The live keys now: those in memory, and those only in the store,
        by page id."""
        stored: dict[int, list[Any]] = {}
        with self._lock:
            self._check_open()
            now = None
            keys = []
            for k, (p, s, v) in self._tier.table.items():
                if v is HAS_TTL:
                    e = p.expires[s]
                    if now is None:
                        now = self._now()
                    if now >= e:
                        continue
                keys.append(k)
            if not self._clear_pending:
                in_memory = self._tier.pages
                decode = _codec.decode_key
                for ck, orig, pid, e in self._store.scan_index():
                    if pid in in_memory:
                        continue
                    if e is not None:
                        if now is None:
                            now = self._now()
                        if now >= e:
                            continue
                    group = stored.get(pid)
                    if group is None:
                        group = stored[pid] = []
                    group.append(decode(orig if orig is not None else ck))
        return keys, stored

    def _scan_items(self) -> Iterator[tuple[Any, Any]]:
        """``(key, value)`` for a snapshot of the keys (``items()``, ``values()``).

        A scan reads without disturbing the cache: a page only in the store
        is decoded, not made resident; no page is touched in the LRU; no hit
        or miss is counted. One pass over a cache bigger than its memory tier
        would otherwise evict the working set and inflate the hit ratio (the
        scan problem that LRU-K and 2Q address in buffer pools).

        Entries are read a batch of keys (or store pages) at a time; each is
        yielded only if no write has come since its batch was read (the LSN
        has not moved) and it has not expired meanwhile, else it is looked up
        again. So a key deleted during the iteration is not yielded after its
        deletion, as when each key was read as it came. The lock is never
        held across a ``yield``.
        """
        keys, stored = self._snapshot()
        pids = list(stored)
        batches = [(keys[i:i + _SCAN_BATCH], None) for i in range(0, len(keys), _SCAN_BATCH)]
        batches += [(None, pids[i:i + _SCAN_BATCH_PAGES])
                    for i in range(0, len(pids), _SCAN_BATCH_PAGES)]
        for batch_keys, batch_pids in batches:
            with self._lock:
                self._check_open()
                lsn, now = self._last_lsn, self._now()
                if batch_keys is not None:
                    found = [e for key in batch_keys
                             if (e := self._scan_lookup(key, now)) is not None]
                else:
                    found = self._scan_pages(batch_pids, stored, now)
            for key, value, expire_at in found:
                with self._lock:
                    self._check_open()
                    now = self._now()
                    if self._last_lsn != lsn:
                        entry = self._scan_lookup(key, now)
                        if entry is None:
                            continue
                        key, value, expire_at = entry
                    elif expire_at is not None and now >= expire_at:
                        continue
                yield key, value

    def _scan_pages(self, pids: list[int], stored: dict[int, list[Any]],
                    now: float) -> list[tuple[Any, Any, float | None]]:
        """:meth:`_scan_items` for the snapshot keys of store pages ``pids``:
        each page not in memory is read and decoded once (lock held)."""
        tier = self._tier
        table = tier.table
        # After a clear() the store's pages are stale until a flush wipes
        # them: only memory holds entries then (_scan_lookup looks there).
        rows = {} if self._clear_pending else \
            self._store.read_pages([p for p in pids if p not in tier.pages])
        from_memory = self._codec.from_memory
        found = []
        for pid in pids:
            row = rows.get(pid)
            if row is None or pid in tier.pages:  # changed since the snapshot
                found += [e for key in stored[pid]
                          if (e := self._scan_lookup(key, now)) is not None]
                continue
            _slots, pkeys, values, expires = self._decode_page(pid, row)
            where = dict(zip(pkeys, range(len(pkeys))))
            for key in stored[pid]:
                j = where.get(key)
                if j is None or key in table:  # moved since the snapshot
                    e = self._scan_lookup(key, now)
                    if e is not None:
                        found.append(e)
                elif expires[j] is None or now < expires[j]:
                    found.append((key, from_memory(values[j]), expires[j]))
        return found

    def _scan_lookup(self, key: Any, now: float) -> tuple[Any, Any, float | None] | None:
        """``(key, value, expire_at)`` if ``key`` is live, read as
        :meth:`_scan_items` reads (lock held): memory first (it is
        authoritative), else the page the key index names, decoded but not
        made resident."""
        ref = self._tier.table.get(key)
        if ref is not None:
            page, slot, _ = ref
            e = page.expires[slot]
            if e is not None and now >= e:
                return None
            return key, self._codec.from_memory(page.values[slot]), e
        if self._clear_pending:
            return None
        found = self._store.find(_codec.canonical_key(key))
        if found is None or found[0] in self._tier.pages:
            return None  # gone, or its page is in memory and no longer holds it
        _slots, pkeys, values, expires = self._decode_page(
            found[0], None if found[1] is None else found[1:])
        for j, k in enumerate(pkeys):
            if k == key:
                if expires[j] is not None and now >= expires[j]:
                    return None
                return k, self._codec.from_memory(values[j]), expires[j]
        return None

    def __iter__(self) -> Iterator[Any]:
        """Iterate over the keys live when iteration starts (also ``keys()``).

        Reads and writes during iteration never break it. A key deleted (or
        expired) during the iteration is not yielded after its deletion, so
        ``for k in cache: cache[k]`` never raises KeyError for a key the loop
        itself removed; keys added meanwhile are not yielded. Each key is
        checked again, without disturbing the LRU, only when a write has come
        since the snapshot (the LSN moved) or entries carry a TTL. The lock
        is never held across a ``yield``.

        :raises CacheClosedError: the cache was closed during the iteration.
        """
        with self._lock:
            lsn = self._last_lsn
        # the snapshot now (a closed cache raises here), the checks as it is walked
        return self._live_keys(self._snapshot_keys(), lsn)

    def _live_keys(self, keys: list[Any], lsn: int) -> Iterator[Any]:
        """:meth:`__iter__`'s walk of snapshot ``keys`` taken at LSN ``lsn``."""
        for key in keys:
            with self._lock:
                self._check_open()
                if self._last_lsn != lsn or self._ttl_count:
                    entry = self._scan_lookup(key, self._now())
                    if entry is None:
                        continue
                    key = entry[0]
            yield key

    def keys(self) -> KeysView:
        return KeysView(self)

    def items(self) -> "_ItemsView":
        return _ItemsView(self)

    def values(self) -> "_ValuesView":
        return _ValuesView(self)

    # -- lifecycle -------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._state in (_CLOSED, _CLOSING, _FORKED)

    def flush(self, timeout: float | None = None) -> None:
        """Block until every write acknowledged before this call is in SQLite.

        :param timeout: seconds, a finite number >= 0 (0 only checks: it
            raises at once unless everything is stored already); None waits
            until the flush succeeds or fails.
        :raises TypeError: ``timeout`` is not a number.
        :raises ValueError: ``timeout`` is negative, NaN or infinite.
        :raises WriteBehindError: a flush failed (``timeout`` None).
        :raises FlushTimeoutError: not done within ``timeout`` (flushes keep
            being retried in the background).
        """
        if timeout is not None:
            timeout = _check_timeout(timeout)
        with self._lock:
            self._check_open()
            target = self._last_lsn
        # Wait by LSN only: pages dirtied by lazy expiry carry no LSN (they are
        # not acknowledged writes), so waiting for "checkpoint + 1" on their
        # account would never end.
        if target > self._store.checkpoint_lsn:
            self._batcher.flush_until(target, timeout)

    def close(self) -> None:
        """Flush, checkpoint, remove the replay log, release the directory
        (and remove it, with everything in it, for a temporary ``Cache()``).

        Idempotent. When the final flush fails the log is kept (nothing
        acknowledged is lost; the next open replays it) and the error is raised.
        """
        with self._lock:
            if self._state in (_CLOSED, _CLOSING, _FORKED):
                return
            failed = self._state is _FAILED
            self._state = _CLOSING
            target = self._last_lsn
        error: BaseException | None = None
        if not failed:
            try:
                if target > self._store.checkpoint_lsn:
                    self._batcher.flush_until(target)
            except BaseException as exc:  # noqa: BLE001 - re-raised below after cleanup
                error = exc
        self._teardown(clean=error is None and not failed)
        self._remove_if_temporary()
        if isinstance(error, WriteBehindError):
            # The batcher's message says the pages are retried; not after close.
            raise WriteBehindError.at_close(self.path, error.cause, self.durability) from error
        if error is not None:
            raise error

    def _remove_if_temporary(self) -> None:
        """Remove the temporary directory of ``Cache()`` (no directory given)."""
        if self._temporary:
            shutil.rmtree(self.path, ignore_errors=True)

    def _teardown(self, clean: bool) -> None:
        if _open_caches.get(id(self)) is self:
            del _open_caches[id(self)]
        if self._batcher is not None:
            self._batcher.stop()
            if clean and self._tier.dirty:
                # Pages dirtied by no logged write (expired entries removed):
                # close() waited by LSN only. One more cycle stores them. If
                # it fails, nothing acknowledged is lost: the checkpoint
                # already covers every write, and the entries read as expired.
                try:
                    self._batcher.run_cycle()
                except Exception as exc:  # noqa: BLE001 - logged; see above
                    log.warning("closing %s: pages whose expired entries were removed "
                                "could not be stored (%r); they stay on disk, expired",
                                self.path, exc)
        if clean and self._store is not None and self._ttl_clock != self._store.ttl_clock:
            # The clock stepped back since the last flush (which would have
            # stored the offset): store it now, with nothing else changed.
            store = self._store
            try:
                store.write_batch([], store.checkpoint_lsn, store.key_count,
                                  store.ttl_key_count, ttl_clock=self._ttl_clock)
            except StoreError as exc:
                log.error("closing %s: could not store the TTL clock's offset (%s); after "
                          "the restart, TTLs set since the wall clock stepped back may "
                          "last up to %.0f s longer", self.path, exc, self._ttl_clock[0])
        if self._log is not None:
            self._log.close(remove=clean)
        if self._store is not None:
            self._store.close(checkpoint_wal=clean)
        if self._lock_fd is not None:
            _release_dir_lock(self._lock_fd)
            self._lock_fd = None
        self._state = _CLOSED

    def __enter__(self) -> "Cache":
        """:raises CacheClosedError: the cache is closed (as any call would);
            ``with`` does not reopen it.
        :raises CacheFailedError: the cache has failed (see :meth:`set`)."""
        if self._state is not _OPEN:
            self._check_open()
        return self

    # -- copying and pickling: refused ------------------------------------------------

    def _refuse_copy(self, what: str) -> TypeError:
        return TypeError(
            f"a durablekv Cache cannot be {what}: it owns its directory {self.path!r} (the "
            "LOCK file, the SQLite connections, the replay log and the write-behind thread), "
            "and a copy would share them with no owner. Share the one Cache object instead "
            "(it is thread-safe); in another process, open Cache(directory) there after this "
            "process has closed it (one process owns a cache directory at a time); to copy "
            "the data, copy the entries (dict(cache.items())) or, once the cache is "
            "closed, the directory")

    def __copy__(self) -> "Cache":
        raise self._refuse_copy("copied (copy.copy)")

    def __deepcopy__(self, memo: dict) -> "Cache":
        raise self._refuse_copy("copied (copy.deepcopy)")

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise self._refuse_copy("pickled")

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        if getattr(self, "_state", _CLOSED) not in (_CLOSED, _CLOSING, _FORKED):
            warnings.warn(f"durablekv cache {getattr(self, 'path', '?')!r} was not closed; "
                          "use close() or a with-block (it is drained at exit)",
                          ResourceWarning, stacklevel=2)

    def __repr__(self) -> str:
        return f"<durablekv.Cache {self.path!r} {self._state}>"

    # -- stats -----------------------------------------------------------------------------

    def stats(self) -> CacheStats:
        """A :class:`~durablekv.stats.CacheStats` snapshot (cheap; thread-safe).

        Works after :meth:`close` too (the final numbers)."""
        if self._state is _FORKED:
            self._check_open()
        b = self._batcher
        with self._lock:
            tier = self._tier
            dirty = tier.dirty
            oldest = 0.0
            if dirty:
                first = next(iter(dirty.values()))
                if first.dirty_since is not None:
                    oldest = max(0.0, _REAL_MONOTONIC[0]() - first.dirty_since)
            # lock-free hits: the LRU ticks not drawn under the lock
            unlocked = _count_of(tier.ticks) - 1 - tier.locked_ticks
            memory_hits = self._memory_hits + unlocked
            s = dict(
                hits=memory_hits + self._store_hits, memory_hits=memory_hits,
                store_hits=self._store_hits, misses=self._misses, sets=self._sets,
                deletes=self._deletes, evictions=tier.evictions, page_faults=tier.page_faults,
                expirations=self._expirations, pending_pages=tier.pending,
                dirty_pages=len(dirty), resident_pages=tier.resident, max_pages=tier.max_pages,
                page_size=tier.page_size, oldest_unflushed_seconds=oldest,
                last_lsn=self._last_lsn)
        return CacheStats(
            flushes=b.flushes, flushed_pages=b.flushed_pages, flush_errors=b.errors,
            log_bytes=self._log.size_bytes() if self._log is not None else 0,
            store_bytes=self._store.size_bytes() if self._store is not None else 0,
            checkpoint_lsn=self._store.checkpoint_lsn if self._store is not None else 0,
            recovered_records=self.recovered_records, recovery_seconds=self.recovery_seconds,
            torn_records=self.torn_records, salvaged_bytes=self.salvaged_bytes, **s)

    def histograms(self) -> dict[str, HistogramSnapshot]:
        """``{"flush_seconds": ..., "flush_pages": ...}`` histogram snapshots."""
        if self._state is _FORKED:
            self._check_open()
        return {"flush_seconds": self._batcher.flush_seconds.snapshot(),
                "flush_pages": self._batcher.flush_pages.snapshot()}

    # -- memoize -------------------------------------------------------------------------

    def memoize(self, expire: float | None = None, *, name: str | None = None,
                ignore: Iterable[int | str] = (), key: Callable[..., Any] | None = None,
                tag: Any = None) -> Callable:
        """Decorator caching a function's results in this cache.

        The cache key is ``("durablekv.memoize", name, args, sorted kwargs)``
        (``("durablekv.memoize", name, key(*args, **kwargs))`` with ``key=``);
        it and the results must be storable (else ``TypeError``, naming the
        argument and the fix). Concurrent callers with the same key share one
        call (single flight); an exception is not cached and is raised to
        every caller that waited for it. The function runs with no cache lock
        held.

        Use as ``@cache.memoize(expire=60)``, or bare as ``@cache.memoize``
        (no TTL), as with ``functools.lru_cache``. On a method, ``self``
        cannot be part of a key: ``@cache.memoize(ignore={0})`` leaves it out
        (every instance then shares the results, as diskcache's
        ``memoize(ignore=...)`` does), or ``key=lambda self, x: (self.id, x)``
        names the instance (as cachetools' ``key=`` does).

        The wrapper has ``cache_key(*args, **kwargs)`` (the key a call would
        use; diskcache's ``__cache_key__``) and ``cache_clear()`` (remove
        every cached result of this function; returns how many; cachetools'
        and ``functools.lru_cache``'s name). ``cache_clear()`` walks the keys
        of the whole cache once.

        :param expire: TTL of cached results in seconds (None: never).
        :param name: key prefix; default the function's module and qualified name.
        :param ignore: positions (int) and keyword names (str) of arguments
            left out of the key (diskcache's ``ignore``); a keyword argument is
            left out by name only.
        :param key: ``key(*args, **kwargs)`` returning the key part for a
            call (a storable value), instead of the arguments themselves;
            not with ``ignore``.
        :param tag: not supported (see :meth:`evict`): ``TypeError``.
        :raises TypeError: ``ignore`` holds something other than ints >= 0
            and str; ``key`` is not callable; both are given; ``tag`` given.
        :raises ValueError: ``expire`` negative, NaN or infinite.
        """
        if tag is not None:
            raise _tags_refused("memoize(tag=...)")
        if callable(expire):  # bare @cache.memoize: expire is the function
            return self.memoize(name=name, ignore=ignore, key=key)(expire)
        _check_expire(expire)
        left_out = _check_ignore(ignore)
        if key is not None and not callable(key):
            raise TypeError(f"memoize(key=...) takes a function of the call's arguments "
                            f"returning its key, not {type(key).__qualname__} {key!r:.60}")
        if key is not None and left_out:
            raise TypeError("memoize() takes key= or ignore=, not both: leave the arguments "
                            "out in the key function itself")

        def decorator(func: Callable) -> Callable:
            prefix = name or f"{func.__module__}.{func.__qualname__}"
            inflight: dict[Any, _Flight] = {}
            flights = threading.Lock()

            def key_of(args: tuple, kwargs: dict) -> Any:
                if key is not None:
                    return ("durablekv.memoize", prefix, key(*args, **kwargs))
                if left_out:
                    args = tuple(a for i, a in enumerate(args) if i not in left_out)
                    kwargs = {k: v for k, v in kwargs.items() if k not in left_out}
                return ("durablekv.memoize", prefix, args, tuple(sorted(kwargs.items())))

            @functools.wraps(func)
            def wrapper(*args: Any, **kwargs: Any) -> Any:
                ck = key_of(args, kwargs)
                try:
                    value = self.get(ck, _MISSING)
                    if value is _MISSING:
                        # A miss runs func and stores its result under the key:
                        # refuse a key no write takes first (a lookup with an
                        # IntEnum argument finds an equal int's result, as a
                        # dict would, but a miss must not run func in vain).
                        _codec.check_key(ck)
                except TypeError as exc:
                    if key is not None:
                        raise TypeError(f"memoized {prefix}(): key= returned {ck[2]!r:.60}, "
                                        f"which cannot be a cache key: {exc}") from exc
                    raise _memoize_key_error(prefix, args, kwargs, ck, exc, left_out) from exc
                if value is not _MISSING:
                    return value
                with flights:
                    flight = inflight.get(ck)
                    leader = flight is None
                    if leader:
                        flight = inflight[ck] = _Flight()
                if not leader:
                    return flight.wait()
                try:
                    value = self._peek(ck)
                    if value is _MISSING:
                        value = func(*args, **kwargs)
                        try:
                            self.set(ck, value, expire=expire)
                        except TypeError as exc:
                            raise TypeError(f"memoized {prefix}() returned a result that cannot "
                                            f"be cached: {exc}") from exc
                except BaseException as exc:
                    flight.fail(exc)
                    raise
                else:
                    flight.succeed(value)
                    return value
                finally:
                    with flights:
                        inflight.pop(ck, None)

            def cache_clear() -> int:
                removed = 0
                for k in self:
                    if type(k) is tuple and len(k) >= 2 and k[0] == "durablekv.memoize" \
                            and k[1] == prefix and self.delete(k):
                        removed += 1
                return removed

            wrapper.cache_key = lambda *a, **kw: key_of(a, kw)  # type: ignore[attr-defined]
            wrapper.cache_clear = cache_clear  # type: ignore[attr-defined]
            return wrapper

        return decorator

    def evict(self, tag: Any) -> int:
        """Not supported: durablekv entries carry no tag (diskcache's
        ``evict(tag)``). Always raises.

        :raises TypeError: always, saying what to do instead.
        """
        raise _tags_refused(f"evict({tag!r:.40})")

    def volume(self) -> int:
        """Bytes the cache takes on disk now: ``pages.sqlite3``, its WAL, and
        the replay log's segments (diskcache's ``volume()``). Thread-safe.

        :raises CacheClosedError: the cache is closed.
        """
        with self._lock:
            self._check_open()
            store, log_ = self._store, self._log
        return store.size_bytes() + (log_.size_bytes() if log_ is not None else 0)

    def _peek(self, key: Any) -> Any:
        with self._lock:
            self._check_open()
            ref = self._ref(key)
            if ref is None:
                return _MISSING
            page, slot, _ = ref
            return self._codec.from_memory(page.values[slot])

    # -- batcher protocol (called from the batcher thread) -------------------------------

    def take_snapshot(self) -> _Snapshot | None:
        with self._lock:
            tier = self._tier
            if not tier.dirty and not self._clear_pending and \
                    self._last_lsn <= self._store.checkpoint_lsn and \
                    self._ttl_clock == self._store.ttl_clock:
                return None
            # A commit follows (see Store.pause_snapshot). First, so that a
            # failure here leaves no page marked as in flight.
            self._store.pause_snapshot()
            items = [(p, p.version, p.keys_version, p.keys_version != p.stored_keys_version,
                      list(p.keys), list(p.values), list(p.expires), p.stored_n, p.stored_ttl_n,
                      tier.start_flush(p))
                     for p in tier.dirty.values()]
            return _Snapshot(self, items, self._last_lsn, self._clear_pending, self._clear_lsn,
                             self._ttl_clock)

    def flush_done(self, snap: _Snapshot, indices: list[int] | None,
                   added: list[bytes]) -> None:
        """Record a committed flush of ``snap``'s items ``indices`` (all when
        None); ``added``: the canonical keys whose index rows it added.

        They go into the key filter first, and only then may their pages
        leave memory (``tier.flushed`` drops a clean pending page): a key not
        in the page table is in the filter if the store holds it (see
        keyfilter.py). Many keys (the first flush after a recovery) go in
        slices, the lock taken for each, so callers are not held up for the
        whole add; no page leaves memory in between."""
        start, n = 0, len(added)
        while n - start > _FILTER_SLICE:
            with self._lock:
                self._filter_committed(snap, added[start:start + _FILTER_SLICE])
            start += _FILTER_SLICE
        with self._lock:
            if start < n:
                self._filter_committed(snap, added[start:] if start else added)
            tier = self._tier
            for i in (range(len(snap.items)) if indices is None else indices):
                p, version, kv = snap.items[i][:3]
                n, ttl_n, nbytes = snap.built[i]
                tier.flushed(p, version, kv, n, ttl_n, nbytes)
            if snap.clear:
                snap.clear = False  # committed with these pages
                if self._clear_lsn == snap.clear_lsn:
                    self._clear_pending = False
            if indices is None:
                self._store.resume_snapshot()
            if len(tier.dirty) >= self.flush_batch_pages:
                # Pages dirtied while this flush ran: the writers' kick came
                # only if the count passed flush_batch_pages exactly, which it
                # does not while the flushed pages are still counted.
                self._batcher.kick()
            self._cond.notify_all()

    def _filter_committed(self, snap: _Snapshot, cks: list[bytes]) -> None:
        """Keys ``snap``'s commit added to the key index go into the key filter
        (lock held), unless the cache was cleared since the snapshot: the
        next flush deletes them from the store, and their pages are gone."""
        if self._clear_lsn == snap.clear_lsn:
            self._filter_add_many(cks)

    def flush_failed(self, snap: _Snapshot, indices: list[int] | None = None) -> None:
        with self._lock:
            for i in (range(len(snap.items)) if indices is None else indices):
                self._tier.flush_failed(snap.items[i][0])
            self._store.resume_snapshot()
            self._cond.notify_all()


if sysconfig.get_config_var("Py_GIL_DISABLED"):
    # A free-threaded CPython build: the unlocked memory hit of get and `in`
    # relies on the GIL (see docs/architecture.md, "Threads and locks"), so
    # they lock. The build decides, not whether the GIL is on at import: such a
    # build may run with the GIL on or off, and may switch it on later.
    def _get_with_lock(self: Cache, key: Any, default: Any = None) -> Any:
        return self._get_locked(key, default)

    def _contains_with_lock(self: Cache, key: Any) -> bool:
        return self._contains_locked(key)

    _get_with_lock.__doc__ = Cache.get.__doc__
    _contains_with_lock.__doc__ = Cache.__contains__.__doc__
    Cache.get = _get_with_lock  # type: ignore[method-assign]
    Cache.__contains__ = _contains_with_lock  # type: ignore[method-assign]


def _check_counter_args(op: str, delta: Any, default: Any) -> None:
    """incr/decr arguments: ints only (a bool is not one), ``default`` may be None."""
    if type(delta) is not int:
        raise TypeError(f"{op}() delta must be an int, got {type(delta).__qualname__} "
                        f"{delta!r}")
    if default is not None and type(default) is not int:
        raise TypeError(f"{op}() default must be an int or None, got "
                        f"{type(default).__qualname__} {default!r}")


def _key_too_long(kb: bytes) -> ValueError:
    return ValueError(f"key is {len(kb)} bytes encoded, over the {MAX_KEY_BYTES}-byte "
                      "limit on keys; use a shorter key (e.g. a hash of it)")


def _tags_refused(what: str) -> TypeError:
    return TypeError(
        f"{what}: durablekv does not store tags with entries (diskcache's tag=/evict(tag)); "
        "put the group in the key instead, e.g. cache[('user', 42)] = v, and remove a group "
        "with: for k in cache: if k[0] == 'user': cache.delete(k) (a memoized function's "
        "results: f.cache_clear())")


def _check_ignore(ignore: Any) -> frozenset:
    """``memoize(ignore=...)`` as a frozenset of ints >= 0 and strs."""
    if isinstance(ignore, (str, int)):
        ignore = (ignore,)
    try:
        left_out = frozenset(ignore)
    except TypeError:
        raise TypeError(f"memoize(ignore=...) takes argument positions (int) and keyword "
                        f"names (str), e.g. ignore={{0}} for a method's self; got "
                        f"{ignore!r:.60}") from None
    bad = [x for x in left_out
           if not (type(x) is str or (type(x) is int and x >= 0))]
    if bad:
        raise TypeError(f"memoize(ignore=...) takes argument positions (int >= 0) and keyword "
                        f"names (str), e.g. ignore={{0}} for a method's self; got {bad[0]!r}")
    return left_out


def _memoize_key_error(prefix: str, args: tuple, kwargs: dict, key: Any,
                       exc: TypeError, left_out: frozenset = frozenset()) -> TypeError:
    """The TypeError for a memoized call whose arguments cannot be a cache
    key: which function, which argument, and why. ``exc`` itself when the
    key is fine (the TypeError came from elsewhere, e.g. decoding a value)."""
    try:
        _codec.check_key(key)
    except TypeError:
        pass
    else:
        return exc
    return TypeError(_memoize_key_message(prefix, args, kwargs, exc, left_out))


def _memoize_key_message(prefix: str, args: tuple, kwargs: dict, exc: TypeError,
                          left_out: frozenset = frozenset()) -> str:
    ordinals = {1: "1st", 2: "2nd", 3: "3rd"}
    named = [(f"its {ordinals.get(i + 1, f'{i + 1}th')} positional argument", a, i, None)
             for i, a in enumerate(args)]
    named += [(f"its argument {k}=", v, None, k) for k, v in sorted(kwargs.items())]
    for label, value, i, name in named:
        if (i if i is not None else name) in left_out:
            continue  # not part of the key
        try:
            _codec.check_key(value)
        except TypeError as why:
            if isinstance(value, list):
                fix = "; pass a tuple instead of the list"
            elif isinstance(value, (str, int, float, bytes, tuple)) and \
                    type(value) not in (str, int, float, bytes, tuple):
                fix = ""  # a subclass: the key error already says to pass the plain value
            else:
                where = i if i is not None else name
                fix = (f"; pass a value of one of those types, or leave it out of the key: "
                       f"@cache.memoize(ignore={{{where!r}}}) (a method's self: every instance "
                       "then shares the results), or key=a function of the arguments that "
                       "returns a storable key")
            return (f"memoized {prefix}(): {label} ({value!r:.60}) cannot be part of a cache "
                    f"key: {why}{fix}")
    return f"memoized {prefix}(): its arguments cannot be a cache key: {exc}"


class _Flight:
    """One in-progress memoized call that other callers wait for."""

    __slots__ = ("_event", "_value", "_exc")

    def __init__(self) -> None:
        self._event = threading.Event()
        self._value: Any = None
        self._exc: BaseException | None = None

    def succeed(self, value: Any) -> None:
        self._value = value
        self._event.set()

    def fail(self, exc: BaseException) -> None:
        self._exc = exc
        self._event.set()

    def wait(self) -> Any:
        self._event.wait()
        if self._exc is not None:
            raise self._exc
        return self._value


class _ItemsView(ItemsView):
    def __iter__(self) -> Iterator[tuple[Any, Any]]:
        return self._mapping._scan_items()


class _ValuesView(ValuesView):
    def __contains__(self, value: Any) -> bool:
        # ValuesView's own version does mapping[key] for each snapshot key and
        # raises KeyError for a key deleted or expired since the snapshot.
        return any(v is value or v == value for v in self)

    def __iter__(self) -> Iterator[Any]:
        for _key, value in self._mapping._scan_items():
            yield value


def _check_expire(expire: Any) -> float | None:
    """``expire`` as float seconds. Any real number is taken (int, float,
    Decimal, Fraction, a NumPy scalar); bool and complex are not.

    :raises TypeError: not a real number.
    :raises ValueError: negative, NaN, infinite, or too big for a float."""
    if expire is None:
        return None
    if type(expire) is not float and type(expire) is not int:
        if isinstance(expire, (bool, complex)) or not isinstance(expire, Number):
            raise TypeError(f"expire must be a number of seconds or None, got "
                            f"{type(expire).__name__}")
    try:
        expire = float(expire)
    except (OverflowError, TypeError, ValueError):
        raise ValueError(f"expire must be a finite number of seconds >= 0 (or None for no "
                         f"expiry), got a {type(expire).__name__} too big for a "
                         "float") from None
    if math.isnan(expire) or math.isinf(expire) or expire < 0:
        raise ValueError(f"expire must be a finite number of seconds >= 0 (or None for no "
                         f"expiry), got {expire!r}")
    return expire


def _check_clock(clock: Any) -> None:
    """Call ``clock`` once (at open) and check what it returns.

    The TTL hot path (:meth:`Cache._now`) does no checks of its own, so a
    clock returning a str or None would fail later with a bare arithmetic
    TypeError, and one returning NaN or infinity would make every entry
    live for ever.

    :raises ConfigError: ``clock`` is not callable, raises, or does not
        return a finite int or float (a bool is not a number of seconds).
    """
    expected = ("a callable returning epoch seconds as a finite float, like time.time "
                "(pass clock=time.time, or leave it out for time.time)")
    if not callable(clock):
        raise ConfigError(f"clock must be {expected}; got {clock!r}, which is not callable")
    try:
        now = clock()
    except Exception as exc:
        raise ConfigError(f"clock must be {expected}; calling {clock!r} raised "
                          f"{exc!r}") from exc
    if type(now) is bool or not isinstance(now, (int, float)) or not math.isfinite(now):
        raise ConfigError(f"clock must be {expected}; {clock!r} returned {now!r} "
                          f"({type(now).__name__})")


def _check_timeout(timeout: Any) -> float:
    """``flush(timeout=...)``'s argument as float seconds (None is handled by the caller)."""
    if type(timeout) is bool or not isinstance(timeout, (int, float)):
        raise TypeError(f"flush() timeout must be a number of seconds or None, got "
                        f"{type(timeout).__name__}")
    timeout = float(timeout)
    if not 0 <= timeout < math.inf:  # (False for NaN)
        raise ValueError(f"flush() timeout must be a finite number of seconds >= 0, got "
                         f"{timeout!r}; pass None to wait until the flush succeeds or fails")
    return timeout


def _check_config(*, page_size, max_pages, flush_interval, flush_batch_pages, durability,
                  max_value_bytes, on_corruption, max_pending_pages, busy_timeout,
                  segment_bytes, salvage_log) -> None:
    def need_int(name: str, value: Any, lo: int, hi: int | None = None) -> None:
        if type(value) is not int or value < lo or (hi is not None and value > hi):
            rng = f">= {lo}" if hi is None else f"between {lo} and {hi}"
            raise ConfigError(f"{name} must be an integer {rng}, got {value!r}")

    if page_size is not None:
        need_int("page_size", page_size, 1, PAGE_SIZE_MAX)
    need_int("max_pages", max_pages, 1)
    need_int("flush_batch_pages", flush_batch_pages, 1)
    need_int("max_value_bytes", max_value_bytes, 1, MAX_VALUE_BYTES_LIMIT)
    if max_pending_pages is not None:
        need_int("max_pending_pages", max_pending_pages, 1)
    # a segment is sealed once it reaches this size: below a kilobyte that
    # would be a file (and a directory fsync) every few records
    need_int("segment_bytes", segment_bytes, MIN_SEGMENT_BYTES)
    for nm, v in (("flush_interval", flush_interval), ("busy_timeout", busy_timeout)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not (0 < v < math.inf):
            raise ConfigError(f"{nm} must be a positive number of seconds, got {v!r}")
    if durability not in DURABILITY_MODES:
        raise ConfigError(f"durability must be one of {DURABILITY_MODES}, got {durability!r}")
    if on_corruption not in ("raise", "rebuild"):
        raise ConfigError(f"on_corruption must be 'raise' or 'rebuild', got {on_corruption!r}")
    # Like the integer settings above: the exact type, no truthiness (a
    # salvage_log='no' must not give up log records).
    if type(salvage_log) is not bool:
        raise ConfigError(f"salvage_log must be True or False, got {salvage_log!r}")


def _acquire_dir_lock(path: str) -> tuple[int, int]:
    """Take the ownership lock of cache directory ``path``: ``(dir_fd, lock_fd)``.

    The lock is an exclusive ``flock`` on the directory itself (an open
    descriptor of it), which no file deletion can take away: deleting
    ``LOCK`` under a live owner no longer lets a second process in. ``LOCK``
    only names the owner's pid (and is flocked too, so that a durablekv from
    before this lock still sees the directory as taken).

    :raises CacheLockedError: another open file description holds it (a
        process, or another Cache in this one).
    """
    dir_fd = lock_directory(path, exclusive=True)
    lock_path = os.path.join(path, LOCK_FILE)
    try:
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, FILE_MODE)
    except BaseException:
        _unlock_directory(dir_fd)
        raise
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        pid = lock_owner_pid(fd)
        os.close(fd)
        _unlock_directory(dir_fd)
        raise CacheLockedError(path, pid) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return dir_fd, fd


def lock_directory(path: str, *, exclusive: bool) -> int:
    """``flock`` the directory ``path`` itself (exclusive: an owner; shared:
    ``durablekv check``), without waiting; returns the descriptor to keep.

    :raises CacheLockedError: it is held in a conflicting mode; names the
        pid in ``LOCK`` when there is one.
    """
    dir_fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(dir_fd, (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(dir_fd)
        raise CacheLockedError(path, _lock_file_pid(path)) from None
    except BaseException:
        os.close(dir_fd)
        raise
    return dir_fd


def _unlock_directory(dir_fd: int) -> None:
    try:
        fcntl.flock(dir_fd, fcntl.LOCK_UN)
    finally:
        os.close(dir_fd)


def _lock_file_pid(path: str) -> int | None:
    """The pid in directory ``path``'s ``LOCK`` file, or None."""
    try:
        fd = os.open(os.path.join(path, LOCK_FILE), os.O_RDONLY)
    except OSError:
        return None
    try:
        return lock_owner_pid(fd)
    finally:
        os.close(fd)


def lock_owner_pid(fd: int) -> int | None:
    """The pid the owner of a cache directory wrote into its ``LOCK`` file
    (open as ``fd``), or None when there is none to read (the file is empty:
    the owner is between taking the lock and writing its pid)."""
    try:
        return int(os.pread(fd, 32, 0).split()[0])
    except (ValueError, IndexError, OSError):
        return None


def _release_dir_lock(fds: tuple[int, int]) -> None:
    dir_fd, fd = fds
    try:
        try:
            os.ftruncate(fd, 0)
            fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)
    finally:
        _unlock_directory(dir_fd)


def _move_aside(path: str) -> str:
    stamp = time.strftime("%Y%m%dT%H%M%S")
    aside = f"{path}.corrupt-{stamp}"
    n = 1
    while os.path.exists(aside):
        n += 1
        aside = f"{path}.corrupt-{stamp}-{n}"
    # The WAL first, the damage marker last: a kill in between must not
    # leave the damaged store's WAL for the new store to apply, and must
    # leave the damaged store marked while it is still in place.
    for suffix in ("-wal", "-shm"):
        if os.path.exists(path + suffix):
            os.replace(path + suffix, aside + suffix)
    os.replace(path, aside)
    if os.path.exists(path + ".damaged"):
        os.replace(path + ".damaged", aside + ".damaged")
    return aside
