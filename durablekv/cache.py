"""Cache: the public facade. Owns the lifecycle and wires the parts together.

Data flow (see ``docs/architecture.md``)::

    set/delete ─► ReplayLog.append ─► MemoryTier (page table, LRU, dirty pages)
                                          │ dirty / evicted-dirty pages
                                          ▼
                              WriteBehindBatcher ─► SQLitePageStore
    get ─► page table ─(miss)─► key index ─► page fault (page read back)

The class is assembled from one module per component (mixins over the
cache's own state) and parts it holds: the log's recovery
(:class:`~durablekv.log.recovery.LogReplay`, open: log suffix -> memory
tier), the key counts (:class:`~durablekv.counts.KeyCounts`), the hot paths'
fields (:class:`~durablekv.fastpath.FastPath`); the mixins are
:mod:`~durablekv.faults` (key index, page faults), :mod:`~durablekv.expiry`
(TTL clock, sweeps), :mod:`~durablekv.writeback` (what the batcher calls),
:mod:`~durablekv.scan` (iteration), :mod:`~durablekv.atomic`
(read-modify-write ops), :mod:`~durablekv.writes` (log, apply,
back-pressure), :mod:`~durablekv.nowait` (calls that never wait, for asyncio), :mod:`~durablekv.lifecycle`, :mod:`~durablekv.introspect`;
:mod:`~durablekv.memoize` is a function of its host, and the argument
checks and the directory lock are :mod:`~durablekv.config` and
:mod:`~durablekv.dirlock`. This module keeps construction and wiring, the
hot paths (``get`` with its lock-free memory hit, ``set`` with its inline
path), ``delete``/``clear``/``len`` and ``flush``/``close``.

Locking: ``self._lock`` guards the memory tier, the counters, the LSN and the
log append (so file order is LSN order and the memory tier never disagrees
with the log). It is never held across an fsync, a SQLite commit, or user
code (memoized functions). The batcher has its own lock; lock order is
cache lock, then batcher lock, never the reverse.
"""

from __future__ import annotations

import errno
import logging
import math
import inspect
import os
import pwd
import stat
import sysconfig
import threading
from collections.abc import MutableMapping
from typing import Any, Callable, Iterable, Sequence

from . import codec as _codec
from .atomic import AtomicOps
from .batcher import WriteBehindBatcher
from .config import (DEFAULT_MAX_VALUE_BYTES, MAX_KEY_BYTES, _CLOSED, _CLOSING,
                     _FAILED, _FORKED, _Frozen, _MISSING, _OPEN,
                     _REAL_MONOTONIC, _U32_PACK, _cache_path, _check_clock, _check_config,
                     _check_expire, _check_timeout, _key_too_long, _make_cache_dir,
                     _make_temporary_dir, _not_in_durablekv, _tags_refused,
                     _temporary_cache_path, _timeout_refused,
                     unknown_options)
from .dirlock import _acquire_dir_lock
from .errors import CacheClosedError, CacheFailedError, ConfigError, WriteBehindError
from .counts import KeyCounts
from .storekeys import StoreKeys
from .expiry import Expiry
from .fastpath import FastPath
from .faults import PageFaults
from .introspect import Introspection
from .lifecycle import Lifecycle, _open_caches
from .memoize import memoize as _memoize
from .nowait import NoWait
from .tier import HAS_TTL, RESIDENT, SLOTTED, MemoryTier, make_tier
from .policies import check_policy
from .log.recovery import LogReplay, gc_paused as _gc_paused
from .log.segments import OP_CLEAR, OP_SET
from .log.replaylog import ReplayLog
from .scan import Scans
from .stores.base import PageStore
from .stores.factory import check_store_args, open_store, refuse_other_kinds
from .writeback import CacheFlushSource, WriteBack
from .warm import WarmRestart
from .writes import WritePath
from ._accel import native as _native

__all__ = ["Cache"]

#: The C memory hit (durablekv/_native.c hit_getter) each open cache installs
#: as its ``get``; None runs the Python one (no extension, DURABLEKV_PURE, or
#: a free-threaded build: the lock-free hit relies on the GIL).
_HIT_GETTER = (_native.hit_getter if _native is not None
               and not sysconfig.get_config_var("Py_GIL_DISABLED") else None)
#: The C overwrite (durablekv/_native.c hot_setter) each open cache installs
#: as its ``set`` (safe codec, durability "log" or "none"); None: the Python one.
_HOT_SETTER = (_native.hot_setter if _native is not None
               and not sysconfig.get_config_var("Py_GIL_DISABLED") else None)

log = logging.getLogger("durablekv")


def _unwritable(path: str, exc: OSError) -> str:
    """The message for a cache directory this process may not use: what was
    refused, and whose directory it is when another user's."""
    what = exc.strerror or str(exc)
    if exc.filename and os.path.abspath(exc.filename) != os.path.abspath(path):
        what += f" on {os.path.basename(exc.filename)}"
    try:
        st = os.stat(path)
    except OSError:
        st = None
    if st is None or st.st_uid == os.geteuid():
        return (f"cannot use cache directory {path!r} ({what}); a cache needs a directory "
                "this user may read and write")
    try:
        owner = pwd.getpwuid(st.st_uid).pw_name
    except KeyError:
        owner = f"uid {st.st_uid}"
    return (f"cannot use cache directory {path!r} ({what}): it belongs to {owner} (mode "
            f"{stat.S_IMODE(st.st_mode):04o}); open it as {owner}, or name a directory of "
            "this user's (a cache directory is private to its owner: docs/files.md)")


class Cache(PageFaults, Expiry, WriteBack, Scans, AtomicOps, WritePath, NoWait,
            Lifecycle, Introspection, WarmRestart, MutableMapping):
    """A persistent key/value cache: memory-speed reads, writes that survive a crash.

    :param directory: the cache directory (created if missing, mode 0700).
        Holds ``pages.sqlite3``, ``replay-*.log`` segments and ``LOCK``. None
        (or omitted): a new temporary directory, removed with everything in it
        by :meth:`close` (diskcache's ``Cache()``); ``path`` names it.
        A leading ``~`` is the user's home directory (``os.path.expanduser``,
        as diskcache does); ``path`` (and ``directory``) is the absolute path.
    :param page_size: slots per page; fixed when the store is created. None
        adopts the stored value (16 for a new store); a different explicit
        value raises :class:`ConfigError`.
    :param max_pages: the memory tier holds at most this many pages (so at
        most ``max_pages * page_size`` entries resident).
    :param max_memory_bytes: None (default: no byte bound) or a positive int:
        the most bytes of entries the memory tier keeps resident, counted as
        each page's encoded keys and values (added at set time; a page's
        stored blob size, entries plus about 14 bytes of framing each, once
        it is flushed or faulted in; an overwrite or a delete only adds until
        the page's next flush). When a call passes it, pages leave by the
        replacement policy exactly as for ``max_pages`` (dirty ones go
        pending for the write-behind, clean ones are dropped); both bounds
        hold together. Exact to a page: after every call, resident bytes
        are at most ``max_memory_bytes``, except that one page may be
        resident alone while its own bytes pass the bound (a page holds new
        entries only up to the bound, so that page holds a single entry
        bigger than ``max_memory_bytes``). Such an entry is logged, stored
        and readable like any other; its page is evicted by the next page
        that becomes resident. Pending pages (waiting for the write-behind)
        are not resident and are bounded by ``max_pending_pages`` instead.
        Under ``policy="midpoint"`` the same holds per entry: each entry is
        counted by its own bytes (encoded at set time, stored after a page
        fault), entries leave until the bound holds, and only one entry
        bigger than the bound may pass it, alone.
        Not stored: a store may be reopened with any bound (docs/api.md).
    :param size_limit: None (default: no bound) or a positive int: bytes of
        pages the store keeps on disk. When a flush leaves the store above
        it, the write-behind evicts the least recently used pages that are
        neither resident nor pending from the store too, in its next
        transactions (``stats().store_evictions``; docs/operations.md).
        Not stored.
    :param policy: the memory tier's replacement policy: ``"lru"`` (default,
        LRU of pages), ``"tinylfu"`` (W-TinyLFU of pages) or ``"midpoint"``
        (residency per entry inside pages: a young and an old sublist, a page
        fault's neighbours entering at the midpoint, as in InnoDB's buffer
        pool; ``max_memory_bytes`` then bounds the bytes of the entries in
        memory, not of pages); docs/policy.md. Not stored: a store may be
        reopened with any of them.
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
    :param warm: (a bool) warm restart, on by default: the ids of the
        resident pages are saved in ``resident.list`` (at close, and about
        every second while the cache is used, so also before a crash), and
        after the next open a background thread reads those pages back into
        the memory tier, most recently used first, while it has room (open
        does not wait; see :meth:`wait_warm`, ``stats().warmed_pages`` and
        docs/durability.md). The list is only a hint: what a page holds is
        always read from the store. False: the memory tier starts cold and
        no list is read or written.
    :param timeout: not a setting here: diskcache's SQLite ``timeout`` is
        ``busy_timeout``, so any value raises ``TypeError`` saying so.
    :raises CacheLockedError: the directory is open elsewhere.
    :raises ConfigError: an invalid or conflicting setting; a directory, or
        a file in it (``pages.sqlite3`` and its ``-wal``/``-shm``), that
        this user may not read and write, or that is of the wrong kind.
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
                 policy: str = "lru", max_memory_bytes: int | None = None,
                 size_limit: int | None = None, warm: bool = True,
                 timeout: Any = None, **unknown: Any) -> None:
        self._state = _CLOSED
        self._temporary = directory is None
        if unknown:
            raise unknown_options("Cache", unknown, _CACHE_OPTIONS)
        if timeout is not None:
            raise _timeout_refused(timeout)
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
                      segment_bytes=segment_bytes, salvage_log=salvage_log,
                      max_memory_bytes=max_memory_bytes, size_limit=size_limit)
        self.max_memory_bytes = max_memory_bytes
        self.size_limit = size_limit
        check_store_args(store, namespace, durability)
        self.policy = check_policy(policy)
        if type(warm) is not bool:
            raise ConfigError(f"warm={warm!r}: expected True (preload the pages that were "
                              "resident, the default) or False (start with a cold memory tier)")
        self._store_url, self.namespace = store, namespace
        if clock is not None:
            _check_clock(clock)
        codec = _codec.codec_by_name(serializer)
        if directory is None:
            # made in the try below whose cleanup removes it; settings are
            # checked first: a refused one leaves no directory behind
            directory = _temporary_cache_path()
        path = _cache_path(directory)
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
        if not self._temporary:
            _make_cache_dir(path)
        self._store: PageStore | None = None
        self._log: ReplayLog | None = None
        self._batcher: WriteBehindBatcher | None = None
        self._tier: MemoryTier | None = None
        self._lock_fd: tuple[int, int] | None = None
        self._warm_init(warm)
        # From the moment a temporary directory is made or the lock is taken,
        # any exception (one from a signal handler too: Ctrl-C) is cleaned up
        # after by the teardown below.
        try:
            if self._temporary:
                _make_temporary_dir(self)
            try:
                if self._store_url is None:
                    refuse_other_kinds(path)  # before LOCK is made in a directory not ours
                self._lock_fd = _acquire_dir_lock(path)
            except PermissionError as exc:
                raise ConfigError(_unwritable(path, exc)) from exc
            except OSError as exc:
                if exc.errno != errno.EROFS:
                    raise
                raise ConfigError(f"cache directory {path!r} is on a read-only file system; "
                                  "a cache needs a writable directory (durablekv check can "
                                  "still verify it)") from exc
            self._open(page_size, max_pages, on_corruption, salvage_log, busy_timeout,
                       segment_bytes)
        except BaseException:
            try:
                self._teardown(clean=False)
            finally:
                self._remove_if_temporary()
            raise

    # -- opening and recovery ------------------------------------------------------

    def _open(self, page_size, max_pages, on_corruption, salvage_log, busy_timeout,
              segment_bytes) -> None:
        self._store, self._log = open_store(
            self.path, self._store_url, namespace=self.namespace, durability=self.durability,
            page_size=page_size, serializer=self._codec.name, busy_timeout=busy_timeout,
            on_corruption=on_corruption, segment_bytes=segment_bytes)
        self.store_rebuilds = 0 if self._store.rebuilt_from is None else 1
        store = self._store
        self.page_size = store.page_size
        self.max_pages = max_pages
        # TTL time carries on from where the last open left it (see _now)
        self._ttl_clock = store.ttl_clock
        self._clock_offset, self._last_now = store.ttl_clock
        self._lock = threading.Lock()   # guards the tier, counters, LSN, log appends
        self._cond = threading.Condition(self._lock)  # back-pressure waits
        self._tier = make_tier(store.page_size, max_pages, self.policy,
                               max_bytes=self.max_memory_bytes,
                               next_page_id=store.max_page_id + 1,
                               track_departures=self.size_limit is not None,
                               fill_open=self._whole)
        self._store_evictions = 0
        self._store_stuck: tuple[int, int] | None = None  # see WriteBack._store_evicted
        # what get's memory hit and set's overwrite touch, for the Python
        # and the C paths alike (durablekv/fastpath.py); its log is set at open
        self._fast = FastPath(self._tier, open=_OPEN, has_ttl=HAS_TTL, frozen=_Frozen,
                              resident=RESIDENT, slotted=SLOTTED, log_write=ReplayLog._write,
                              max_key_bytes=MAX_KEY_BYTES, monotonic=_REAL_MONOTONIC[0],
                              get=Cache.get, set=Cache.set)
        self._counts = KeyCounts(store.key_count, store.ttl_key_count)
        self._last_lsn = store.checkpoint_lsn
        # which keys the store may hold: a pending clear, the Bloom filter of
        # its keys (ready at once for an empty store, else after the batcher's
        # background scan), the look-aside miss (see storekeys.py)
        self._store_keys = StoreKeys(store.key_count,
                                     empty=store.key_count == 0 and store.max_page_id == 0)
        self._failure: BaseException | None = None
        self._memory_hits = self._store_hits = self._misses = 0
        self._sets = self._deletes = self._expirations = 0
        # The write-behind's expiry sweep (_background_work). Off until the
        # recovery below is done: it reads stored pages in batches and may
        # wait for back-pressure between reading and installing them, and a
        # page the sweep rewrote meanwhile would be installed stale.
        self._sweep_on = False
        self._sweep_paused_until = 0.0  # monotonic; after a store read error
        self._batcher = WriteBehindBatcher(CacheFlushSource(self), store,
                                           self._log if self.durability != "none" else None,
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
            #: with salvage_log=True: what the log lacked that its control
            #: file says it held (deleted segments), in words; else None
            self.salvage_lost = result.lost
            self._state = _OPEN
            store.resume_snapshot()  # no commit runs until the batcher's first snapshot
            self._batcher.start()
            recovered = len(result.records)
            if recovered:
                self._replay(result.records)
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
        if self.size_limit is not None and store.data_bytes > self.size_limit:
            self._batcher.kick(urgent=True)  # cull down to the (new, smaller) bound
        if recovered:
            log.info("recovered %d log records in %.3f s for %s", recovered,
                     self.recovery_seconds, self.path)
        _open_caches[id(self)] = self
        self._fast.log = self._log
        if _HIT_GETTER is not None and type(self).get is Cache.get:
            # get's memory hit without a Python frame: the same steps as
            # get below, any other case handed to it. A subclass that
            # overrides get keeps its own. Dropped at close (_teardown).
            self.get = _HIT_GETTER(self, self._fast)
        if _HOT_SETTER is not None and type(self).set is Cache.set and \
                self._codec.name == "safe" and not self._sync_writes and \
                (self._log is None or type(self._log) is ReplayLog):
            # set's overwrite of a resident entry without a Python frame: the
            # hot path of set below, every other case handed to it; dropped
            # at close as get's is.
            self.set = _HOT_SETTER(self, self._fast)
        self._warm_start()  # a thread: open does not wait for it


    def _replay(self, records: Sequence[tuple]) -> None:
        """Apply the log records recovered at open (``(lsn, op, key, value,
        expire_at)`` after the store's checkpoint, in LSN order) through a
        :class:`~durablekv.log.recovery.LogReplay`, under the lock; then take
        its last LSN on.

        :raises LogCorruptionError: a record cannot be decoded.
        """
        with self._lock:
            replay = LogReplay(
                self._tier, self._store, self._codec, self._counts, self._store_keys,
                directory=self.path, max_pending_pages=self.max_pending_pages,
                clear=self._apply_clear, fault_in=self._fault_in, whole=self._whole,
                backpressure=self._backpressure)
            self._last_lsn = replay.apply(records)
            self._store_keys.key_added()
            if len(self._tier.dirty) >= self.flush_batch_pages:
                self._batcher.kick()

    # -- helpers -----------------------------------------------------------------------


    def _check_open(self) -> None:
        if self._state is not _OPEN:
            if self._state is _FAILED:
                raise CacheFailedError(self.path, self._failure)
            raise CacheClosedError(self.path, forked=self._state is _FORKED)


    # -- the mapping API -----------------------------------------------------------------

    def get(self, key: Any, default: Any = None) -> Any:
        """Return the value for ``key``, or ``default`` when missing or expired.

        A memory hit on an entry with no TTL takes no lock: one page-table
        lookup, whose entry holds the value (kept in step by every write),
        and an LRU touch of the page. Anything else takes the lock: a key whose
        page is not resident is found through the SQLite key index and its
        page is faulted in (a ``store`` hit). With the C extension an open
        cache's ``get`` is its C twin (``durablekv._native.hit_getter``): the
        same memory hit with no Python frame, every other case handed here.

        :raises TypeError: ``key`` has an unsupported type (as a dict would for
            an unhashable key).
        :raises CacheClosedError: the cache is closed.
        """
        # _memory_hit, inlined on purpose: a call per hit costs about a fifth
        # of a pure-Python memory hit (bench.tree_compare with DURABLEKV_PURE=1)
        if self._state is _OPEN:
            fast = self._fast
            try:
                ref = fast.table.get(key)
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
                        page.stamp = next(fast.ticks)
                        return v if type(v) is not _Frozen else self._codec.decode(v.blob)
                    if page.state == SLOTTED:
                        # policy="midpoint": only a young entry is hit without
                        # the lock (an old one moves; durablekv/tier/midpoint.py)
                        stamps, slot = page.stamps, ref[1]
                        if stamps[slot] > 0:
                            stamps[slot] = next(fast.ticks)
                            return v if type(v) is not _Frozen else self._codec.decode(v.blob)
        return self._get_locked(key, default)

    def _memory_hit(self, key: Any) -> Any:
        """The first step of :meth:`get`, which never waits: the value of
        ``key`` if it is a memory hit that needs no lock (counted as a hit,
        by the page's or the entry's recency tick), else ``_MISSING``.
        :class:`~durablekv.aio.AsyncCache` calls it on the event loop."""
        if self._state is _OPEN:
            fast = self._fast
            try:
                ref = fast.table.get(key)
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
                        page.stamp = next(fast.ticks)
                        return v if type(v) is not _Frozen else self._codec.decode(v.blob)
                    if page.state == SLOTTED:
                        # policy="midpoint": only a young entry is hit without
                        # the lock (an old one moves; durablekv/tier/midpoint.py)
                        stamps, slot = page.stamps, ref[1]
                        if stamps[slot] > 0:
                            stamps[slot] = next(fast.ticks)
                            return v if type(v) is not _Frozen else self._codec.decode(v.blob)
        return _MISSING

    def _get_locked(self, key: Any, default: Any) -> Any:
        """:meth:`get` under the lock: expiry, page faults, misses."""
        with self._lock:
            return self._get_held(key, default)

    def _get_held(self, key: Any, default: Any) -> Any:
        """:meth:`_get_locked`'s work, the lock held."""
        if self._state is not _OPEN:
            self._check_open()
        try:
            ref = self._fast.table.get(key)
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
            if self._tier.hit(page, slot):
                self._memory_hits += 1
            else:
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
                ref = self._fast.table.get(key)
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
            # The value's encoding (b"b" + u32 length + the bytes) is built
            # only off the hot path below, which logs the bytes as they are.
            vb = None
            held = value
            nbytes = len(kb) + len(value) + 5
            ck = kb  # a str key's encoding is its canonical key
        else:
            kb, vb, held, nbytes = self._encode_entry(key, value)
            ck = None
        with self._lock:
            if self._state is not _OPEN:
                self._check_open()
            fast = self._fast
            tier = fast.tier
            if tier.pending >= self.max_pending_pages:
                self._backpressure()
            if expire is None:
                ref = fast.table.get(key)
                if ref is not None:
                    page = ref[0]
                    if ref[2] is not HAS_TTL and page.state == RESIDENT and \
                            page.nbytes + nbytes <= tier.page_bytes_limit:
                        # The hot path: overwrite a live, resident entry. Same
                        # steps as _append + MemoryTier.update, without the calls.
                        lsn = self._last_lsn + 1
                        replay_log = fast.log
                        if replay_log is not None:
                            if vb is None:
                                replay_log.append_bytes(lsn, OP_SET, kb, value, None)
                            else:
                                replay_log.append(lsn, OP_SET, kb, vb, None)
                        try:  # (no cost unless it raises: see _failed_after_log)
                            self._last_lsn = lsn
                            page.values[ref[1]] = held
                            if type(ref) is list:
                                ref[2] = held
                            else:  # its first overwrite (see MemoryTier)
                                fast.table[key] = [page, ref[1], held]
                            page.nbytes += nbytes
                            tier.resident_bytes += nbytes
                            page.version += 1
                            if page.dirty_lsn is None:
                                page.dirty_lsn = lsn
                            dirty = fast.dirty
                            if page.page_id not in dirty:
                                dirty[page.page_id] = page
                                page.dirty_since = fast.monotonic()
                                if len(dirty) == self.flush_batch_pages:
                                    self._batcher.kick()
                            page.stamp = next(fast.ticks)
                            tier.locked_ticks += 1
                            if tier.max_bytes is not None and \
                                    tier.resident_bytes > tier.max_bytes:
                                tier.shrink(page)
                        except BaseException as exc:
                            self._failed_after_log(lsn, exc)
                            raise
                        self._sets += 1
                        lsn_to_sync = lsn
                        expire_at = None
                    else:
                        lsn_to_sync = None
                elif ck is not None and ((sk := self._store_keys).absent is key or
                                         sk.clear_pending or
                                         (sk.filter.ready and ck not in sk.filter)):
                    # A new key that SQLite cannot hold either (the look-aside
                    # miss, a pending clear, or the key filter says so: the
                    # questions _locate asks, with the key already encoded):
                    # insert it without asking _ref again. (Read inline from
                    # StoreKeys: no call per new key.)
                    if vb is None:
                        vb = b"b" + _U32_PACK(len(value)) + value
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
                    lsn_to_sync = self._logged_delete(key, kb, count=False)  # (a set)
            if lsn_to_sync is None:
                # An expired entry is gone: the key is stored anew (keeping the
                # new key object, as a dict does for a fresh key), not updated.
                if vb is None:
                    vb = b"b" + _U32_PACK(len(value)) + value
                lsn_to_sync = self._logged_set(key, kb, vb, held, expire_at,
                                               self._ref(key), nbytes)
        if self._sync_writes:
            self._sync(lsn_to_sync)

    def __setitem__(self, key: Any, value: Any) -> None:
        self.set(key, value)


    # -- calls that never wait (durablekv.aio runs them on an event loop's thread) --

    def delete(self, key: Any) -> bool:
        """Remove ``key``; return True if a live entry was there.

        :raises TypeError: unsupported key type.
        :raises LogWriteError, CacheClosedError, CacheFailedError: as for :meth:`set`.
        """
        kb = _codec.encode_key(key)
        with self._lock:
            self._open_for_writes()
            if self._tier.pending >= self.max_pending_pages:
                self._backpressure()  # (a page only in the store comes in pending)
            if self._ref(key, for_delete=True) is None:
                return False
            lsn = self._logged_delete(key, kb)
        if self._sync_writes:
            self._sync(lsn)
        return True

    def __delitem__(self, key: Any) -> None:
        if not self.delete(key):
            raise KeyError(key)


    def clear(self) -> None:
        """Remove every entry (one log record; the store is emptied by the next flush)."""
        with self._lock:
            self._check_open()
            lsn = self._append(OP_CLEAR, b"", b"", None)
            try:
                self._apply_clear(lsn)
            except BaseException as exc:
                self._failed_after_log(lsn, exc)
                raise
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
            counts = self._counts
            if not counts.ttl_keys:
                return counts.keys
            now = self._now()
            self._expire_in_memory(now)
            if self._store_keys.clear_pending or not counts.ttl_keys:
                return counts.keys
            # A page not in memory is exactly as committed, and its index
            # rows carry its entries' expiries; a page in memory was counted
            # above.
            pages = self._tier.pages
            # (a page in memory in part, policy="midpoint", holds no expired
            # loaded entry now: expiring one read the page in whole)
            return counts.keys - sum(n for pid, n in self._store.expired_by_page(now)
                                     if pid not in pages or pages[pid].unloaded)


    # -- lifecycle -------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._state in (_CLOSED, _CLOSING, _FORKED)

    @property
    def directory(self) -> str:
        """The cache directory: :attr:`path`, under diskcache's name for it
        (read-only)."""
        return self.path

    # diskcache's, not durablekv's: reading them raises an AttributeError
    # that says what to use instead (docs/diskcache.md)
    transact = _not_in_durablekv("transact")
    check = _not_in_durablekv("check")
    cull = _not_in_durablekv("cull")
    iterkeys = _not_in_durablekv("iterkeys")
    has_key = _not_in_durablekv("has_key")

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
        if self._store_over_limit():
            # nothing to store, but pages to evict (a store reopened with a
            # smaller size_limit, or pages that just left memory)
            self._batcher.cycle_once(timeout)

    def _store_over_limit(self) -> bool:
        """Whether the store passes ``size_limit`` and may evict something now."""
        limit = self.size_limit
        if limit is None or self._store.data_bytes <= limit:
            return False
        with self._lock:
            return self._store_stuck != (len(self._tier.pages), self._tier.evictions)

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
        try:
            self._teardown(clean=error is None and not failed)
        finally:
            self._remove_if_temporary()
        if isinstance(error, WriteBehindError):
            # The batcher's message says the pages are retried; not after close.
            raise WriteBehindError.at_close(self.path, error.cause, self.durability) from error
        if error is not None:
            raise error


    def __enter__(self) -> "Cache":
        """:raises CacheClosedError: the cache is closed (as any call would);
            ``with`` does not reopen it.
        :raises CacheFailedError: the cache has failed (see :meth:`set`)."""
        if self._state is not _OPEN:
            self._check_open()
        return self

    # -- copying and pickling: refused ------------------------------------------------


    def __exit__(self, *exc: Any) -> None:
        self.close()


    def __repr__(self) -> str:
        return f"<durablekv.Cache {self.path!r} {self._state}>"

    # -- stats -----------------------------------------------------------------------------


    # -- memoize -------------------------------------------------------------------------

    def memoize(self, expire: float | None = None, *, name: str | None = None,
                ignore: Iterable[int | str] = (), key: Callable[..., Any] | None = None,
                tag: Any = None, typed: Any = None) -> Callable:
        return _memoize(self, expire, name=name, ignore=ignore, key=key, tag=tag, typed=typed)

    memoize.__doc__ = _memoize.__doc__

    # -- batcher protocol (called from the batcher thread) -------------------------------


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



#: The keyword options Cache() takes (named in the error an unknown one gets).
_CACHE_OPTIONS = tuple(p for p in inspect.signature(Cache.__init__).parameters
                       if p not in ("self", "directory", "timeout", "unknown"))
