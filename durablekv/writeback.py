"""The cache's side of the write-behind: snapshots of dirty pages, and what a flush reports back.

The batcher (:mod:`durablekv.batcher`) is handed a :class:`CacheFlushSource`,
the small object with the four calls of its source protocol
(:class:`~durablekv.batcher.FlushSource`): ``take_snapshot()``,
``flush_done(snap, indices, added)``, ``flush_failed(snap, indices)`` and
``background_work()``. They run the cache's private steps of the same names
(:class:`WriteBack`), which are not part of the cache's API.
:class:`_Snapshot` copies dirty pages under the cache lock and encodes them
later (off the lock) into a :class:`~durablekv.batcher.Batch`. The key filter's build (a scan of the
store's keys on the batcher thread) lives here too: flushes feed it.

DESIGN.md put ``_Snapshot`` under scans; the code shows it is the write-behind's
snapshot (dirty pages to encode), not a read snapshot, so it lives here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import logging
from itertools import repeat

from . import codec as _codec
from .batcher import Batch
from .config import _BYTES, _REAL_MONOTONIC, _STR, _U32_PACK
from .errors import CorruptStoreError, StoreError
from .expiry import _SWEEP_RETRY
from .keyfilter import KeyFilter
from .tier.pages import EMPTY, PENDING
from .stores.base import PageImage
from .stores.pageformat import ASCII_KEYS, RAW_BYTES, encode_columns, encode_page

if TYPE_CHECKING:
    from .cache import Cache

log = logging.getLogger("durablekv")


#: Keys a flush added to the key index go into the key filter this many at a
#: time, each slice under the cache lock (about 2 ms each).
_FILTER_SLICE = 4096


class _Snapshot:
    """Dirty pages copied under the cache lock; encoded later by the batcher.

    ``items[i]`` is ``(page, version, keys_version, index_changed, keys,
    values, expires, stored_n, stored_ttl_n, flight_lsn)``. The batcher may
    commit the items in several transactions when one page keeps failing
    (see :mod:`durablekv.batcher`); :meth:`build` then makes the checkpoint
    stop short of the first change still uncommitted.
    """

    __slots__ = ("cache", "items", "checkpoint_lsn", "clear", "clear_lsn", "built", "ttl_clock",
                 "keep", "left", "seen")

    def __init__(self, cache: "Cache", items: list, checkpoint_lsn: int, clear: bool,
                 clear_lsn: int, ttl_clock: tuple[float, float],
                 keep: frozenset = frozenset(), left: list | None = None,
                 seen: tuple[int, int] | None = None) -> None:
        self.cache = cache
        self.keep = keep  # with size_limit: ids of the pages in memory
        self.left = left or []  # with size_limit: pages that left memory clean
        # with size_limit: (pages in memory, evictions) when keep was taken
        self.seen = seen
        self.ttl_clock = ttl_clock
        self.items = items
        self.checkpoint_lsn = checkpoint_lsn
        self.clear = clear
        self.clear_lsn = clear_lsn
        self.built: dict[int, tuple[int, int, int]] = {}  # i -> (n, ttl_n, blob bytes)

    @property
    def size(self) -> int:
        return len(self.items)

    def page_id(self, index: int) -> int:
        """The id of item ``index``'s page."""
        return self.items[index][0].page_id

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
        return Batch(images, checkpoint, count, ttl, clear, rewritten, held, self.ttl_clock,
                     self.cache.size_limit, self.keep, self.left)


class CacheFlushSource:
    """A cache as the write-behind batcher's source
    (:class:`~durablekv.batcher.FlushSource`): each call runs the cache's
    private step of that name, looked up at the call (so a test may replace
    one on the cache or its class)."""

    __slots__ = ("_cache",)

    def __init__(self, cache: "Cache") -> None:
        self._cache = cache

    def take_snapshot(self) -> "_Snapshot | None":
        """The dirty pages, copied under the cache's lock; None: nothing to commit."""
        return self._cache._take_snapshot()

    def flush_done(self, snap: "_Snapshot", indices: list[int] | None,
                   added: list[bytes]) -> None:
        """``snap``'s items ``indices`` (all: None) are committed; ``added``:
        the canonical keys whose index rows the commit added."""
        self._cache._flush_done(snap, indices, added)

    def flush_failed(self, snap: "_Snapshot", indices: list[int] | None = None) -> None:
        """``snap``'s items ``indices`` (all: None) were not committed."""
        self._cache._flush_failed(snap, indices)

    def background_work(self) -> None:
        """Between cycles, on the batcher's thread: the expiry sweep and the
        key filter's scan."""
        self._cache._background_work()


class WriteBack:
    """The cache's steps behind :class:`CacheFlushSource`."""

    def _background_work(self) -> None:
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
        self._residency_tick()  # the warm restart's list, at most every RESIDENCY_INTERVAL
        with self._lock:
            target = self._store_keys.building
        if target is None:
            return
        scanned = KeyFilter(target.capacity)
        scanned.add_all(self._store.iter_keys())
        with self._lock:
            self._store_keys.finish_build(target, scanned)

    def _take_snapshot(self) -> _Snapshot | None:
        with self._lock:
            tier = self._tier
            keys = self._store_keys
            limit = self.size_limit
            if not tier.dirty and not keys.clear_pending and \
                    self._last_lsn <= self._store.checkpoint_lsn and \
                    self._ttl_clock == self._store.ttl_clock and \
                    (limit is None or not tier.departed and (
                        self._store.data_bytes <= limit or
                        self._store_stuck == (len(tier.pages), tier.evictions))):
                return None
            # A commit follows (see Store.pause_snapshot). First, so that a
            # failure here leaves no page marked as in flight.
            self._store.pause_snapshot()
            if self._log is not None:
                self._log.mark()  # where the checkpoint this snapshot makes ends in the log
            items = [(p, p.version, p.keys_version, p.keys_version != p.stored_keys_version,
                      list(p.keys), list(p.values), list(p.expires), p.stored_n, p.stored_ttl_n,
                      tier.start_flush(p))
                     for p in tier.dirty.values()]
            if limit is None:
                return _Snapshot(self, items, self._last_lsn, keys.clear_pending,
                                 keys.clear_lsn, self._ttl_clock)
            # The store evicts no resident page. A page it evicts is then
            # either out of memory (its committed image was its latest state)
            # or pending and written by this very transaction, which it
            # leaves memory with; either way any later change is in the log
            # after the checkpoint, so recovery brings back no older value.
            # (A page faulted in, or changed, while the commit runs stays in
            # memory: flush_done has it written again.)
            left = tier.take_departed()
            # (a midpoint page in memory in part too: the store holds the rest)
            keep = frozenset([pid for pid, p in tier.pages.items() if p.state != PENDING])
            return _Snapshot(self, items, self._last_lsn, keys.clear_pending, keys.clear_lsn,
                             self._ttl_clock, keep, left, (len(tier.pages), tier.evictions))

    def _flush_done(self, snap: _Snapshot, indices: list[int] | None,
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
                self._store_keys.committed(added[start:start + _FILTER_SLICE],
                                           snap.clear_lsn, self._counts.keys)
            start += _FILTER_SLICE
        with self._lock:
            if start < n:
                self._store_keys.committed(added[start:] if start else added,
                                           snap.clear_lsn, self._counts.keys)
            tier = self._tier
            for i in (range(len(snap.items)) if indices is None else indices):
                p, version, kv = snap.items[i][:3]
                n, ttl_n, nbytes = snap.built[i]
                tier.flushed(p, version, kv, n, ttl_n, nbytes)
            if self.size_limit is not None:
                self._store_evicted(snap.seen)
            # a page's exact size (its blob) may pass what its sets accounted
            tier.shrink()
            if snap.clear:
                snap.clear = False  # committed with these pages
                self._store_keys.clear_committed(snap.clear_lsn)
            if indices is None:
                self._store.resume_snapshot()
            if len(tier.dirty) >= self.flush_batch_pages:
                # Pages dirtied while this flush ran: the writers' kick came
                # only if the count passed flush_batch_pages exactly, which it
                # does not while the flushed pages are still counted.
                self._batcher.kick()
            self._cond.notify_all()

    def _store_evicted(self, seen: tuple[int, int] | None) -> None:
        """Account for the pages the store just evicted for ``size_limit``
        (lock held): their entries leave ``len()``. A page faulted in from
        the store while the commit ran is in memory but no longer stored:
        it is written again (as a page never stored) by the next flush.

        ``seen``: (pages in memory, evictions) when the snapshot took the
        pages the store had to keep. A store still over its bound is stuck
        until those change; compared with the tier as the snapshot saw it,
        so that pages leaving memory with this very flush (a midpoint page
        whose entries were all doomed) make the next cycle evict them."""
        store, tier = self._store, self._tier
        evicted = store.take_evicted()
        self._store_evictions += len(evicted)
        for pid, n, ttl_n in evicted:
            page = tier.pages.get(pid)
            if page is None:
                self._counts.removed(n, ttl_n)
                continue
            tier.store_lost(page, _REAL_MONOTONIC[0](), self._last_lsn + 1)
        limit = self.size_limit
        self._store_stuck = seen if store.data_bytes > limit else None

    def _flush_failed(self, snap: _Snapshot, indices: list[int] | None = None) -> None:
        with self._lock:
            if snap.left:
                # their last use is recorded by a later flush instead
                self._tier.give_back_departed(snap.left)
                snap.left = []
            for i in (range(len(snap.items)) if indices is None else indices):
                self._tier.flush_failed(snap.items[i][0])
            self._store.resume_snapshot()
            self._cond.notify_all()
