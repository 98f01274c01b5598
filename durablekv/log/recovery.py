"""Recovery: the replay log's suffix (records after the store's checkpoint) -> the memory tier.

:class:`LogReplay` applies the records :meth:`ReplayLog.recover
<durablekv.log.replaylog.ReplayLog.recover>` returned, once, at open, before
any other call, under the cache's lock. The result is what applying them one
at a time through set and delete would give, at one step per key. It works
through the parts it is handed: the memory tier's own methods (``update``,
``remove``, ``insert_many``, ``hit``), the store's key index
(``locate_keys``, ``read_pages``), the key counts
(:class:`~durablekv.counts.KeyCounts`), and the cache's page faults, clear
and back-pressure as callables; it writes no state of the cache's. The last
LSN applied is returned, for the caller to take on.
"""

from __future__ import annotations

import contextlib
import gc
import operator
from typing import Any, Callable, Iterator, Sequence

from .. import codec as _codec
from ..config import _REAL_MONOTONIC
from ..errors import LogCorruptionError
from .segments import OP_CLEAR, OP_DELETE, OP_SET, locate_record

__all__ = ["LogReplay", "gc_paused"]


# fields of a recovered log record (lsn, op, key, value, expire_at)
_OP_OF, _KEY_OF, _VALUE_OF, _EXPIRE_OF = (operator.itemgetter(i) for i in range(1, 5))


#: Pages read from the store per statement when recovery faults pages in.
_FAULT_BATCH = 256


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector for a bulk build (Mercurial's
    ``util.nogc`` does the same for its big dicts).

    Recovery makes millions of page-table entries, and every container made
    counts towards the collector's thresholds, so the collector would walk
    the growing table over and over (measured: two thirds of the time of
    building it). Reference counting still frees whatever is not in a cycle;
    cyclic garbage made meanwhile (by any thread) waits for the pause to end.
    """
    enabled = gc.isenabled()
    try:
        # in the try: an exception from a signal handler (Ctrl-C) may land
        # as disable() returns, and must not leave the collector off
        gc.disable()
        yield
    finally:
        if enabled:
            gc.enable()


class LogReplay:
    """Bulk replay of recovered log records into a memory tier (see the
    module docstring). Built and used once, at open, under the cache's lock.

    :param tier: the memory tier (:class:`~durablekv.tier.pages.MemoryTier`
        or an entry tier), empty but for what a clear left.
    :param store: the page store: ``locate_keys(cks) -> {ck: page id}`` and
        ``read_pages(ids) -> {id: (n, blob)}``.
    :param codec: the value codec (memory forms of logged values).
    :param counts: the cache's :class:`~durablekv.counts.KeyCounts`.
    :param store_keys: the cache's :class:`~durablekv.storekeys.StoreKeys`:
        which keys the store may hold (a pending clear, the key filter),
        and room in the filter for the keys recovery adds.
    :param directory: the cache directory (named in a damage error).
    :param max_pending_pages: the pending-page bound: ``backpressure`` is
        called when the tier reaches it.
    :param clear: ``clear(lsn)``: apply a logged clear.
    :param fault_in: ``fault_in(pid, row, for_write=True) -> page``: install
        a stored page from ``row`` (see ``Cache._fault_in``).
    :param whole: ``whole(page)``: read the unloaded entries of a page in
        memory in part (entry residency) before it changes.
    :param backpressure: ``backpressure()``: wait (the lock released) until
        the write-behind has stored pending pages.
    """

    def __init__(self, tier: Any, store: Any, codec: Any, counts: Any, store_keys: Any, *,
                 directory: str,
                 max_pending_pages: int, clear: Callable[[int], None],
                 fault_in: Callable[..., Any], whole: Callable[[Any], None],
                 backpressure: Callable[[], None]) -> None:
        self.tier = tier
        self.store = store
        self.codec = codec
        self.counts = counts
        self.store_keys = store_keys
        self.directory = directory
        self.max_pending_pages = max_pending_pages
        self.clear = clear
        self.fault_in = fault_in
        self.whole = whole
        self.backpressure = backpressure

    def apply(self, records: Sequence[tuple]) -> int:
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

        :returns: the last LSN applied (``records[-1]``'s). The caller
            moves its LSN there only afterwards: while back-pressure waits
            for the batcher (the log holds more than memory), a flush may
            store a mix of old and new states, but its checkpoint stays where
            it was, so a crash replays all of it again.
        :raises LogCorruptionError: a record whose CRC checks out cannot be
            decoded (see :meth:`undecodable`).
        """
        try:
            with gc_paused():
                self._apply(records)
        except (ValueError, TypeError, IndexError) as exc:
            # a record whose CRC holds but whose key or value does not
            # decode (hand-made, or nested past MAX_NESTING)
            raise self.undecodable(records, exc) from exc
        return records[-1][0]

    def _apply(self, records: Sequence[tuple]) -> None:
        """:meth:`apply`'s steps, the collector paused."""
        lsn = records[0][0]
        now = _REAL_MONOTONIC[0]()
        if type(records) is list:
            ops = list(map(_OP_OF, records))
            if OP_CLEAR in ops:
                at = len(ops) - 1 - ops[::-1].index(OP_CLEAR)
                self.clear(records[at][0])
                records, ops = records[at + 1:], ops[at + 1:]
            if records:
                self._replay_keys(records, OP_DELETE in ops, lsn, now)
        else:
            # A _native.Records (the C kernels): the same steps, worked
            # out in C over the log's bytes (see _native.c, reduce).
            finals, first, fresh, has_deletes = records.reduce()
            if first:
                self.clear(records[first - 1][0])
                records = records[first:]
            if records:
                self._replay_keys(records, has_deletes, lsn, now, (finals, fresh))

    def undecodable(self, records: Sequence[tuple], exc: Exception) -> LogCorruptionError:
        """The :class:`LogCorruptionError` for the first of ``records`` whose
        key or value cannot be decoded (``exc``: what replaying them raised)."""
        for lsn, op, kb, vb, _exp in records:
            try:
                _codec.decode_key(kb)
                if op == OP_SET:
                    self.codec.decode(vb)
            except (ValueError, TypeError, IndexError) as bad:
                path, offset = locate_record(self.directory, lsn)
                return LogCorruptionError(path, offset, f"record LSN {lsn} has a CRC that "
                                          f"checks out but cannot be decoded: {bad}")
        path, offset = locate_record(self.directory, records[0][0])
        return LogCorruptionError(path, offset, f"the records from LSN {records[0][0]} cannot "
                                  f"be replayed: {exc}")

    def _replay_keys(self, records: Sequence[tuple], has_deletes: bool, lsn: int,
                     now: float, reduced: tuple[Any, list[int]] | None = None) -> None:
        """:meth:`apply` for records with no clear among them.

        ``reduced``: for a ``_native.Records``, ``(finals, fresh)`` from its
        ``reduce()``; the final records then stay a ``_native.Records`` (no
        tuple made per record) until a step needs a list.
        """
        recs: Any
        if reduced is None:
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
        else:
            recs, fresh_at = reduced
            fresh = set(fresh_at)
            keys, others = recs.decode_keys(_codec.decode_key)
            kbs = None  # made below only where a step needs them
        # Which keys may be in the store now (memory holds nothing yet).
        f = self.store_keys.filter
        nowhere = self.store_keys.nothing_stored()
        if kbs is None and (others or not nowhere):
            kbs = recs.column("key")
        cks = kbs  # a str or bytes key's encoding is its canonical key
        if others:
            recs, keys, cks, fresh = self._merge_equal_keys(records, recs, keys, kbs, others,
                                                            fresh)
        if nowhere:
            located: dict[bytes, int] = {}  # a new or cleared store: nothing is
        elif f.ready:
            located = self.store.locate_keys([ck for ck in cks if ck in f])
        else:
            located = self.store.locate_keys(cks)
        if located:
            recs = list(recs)  # (_replay_into_pages replaces some)
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
            ops = list(map(_OP_OF, recs)) if type(recs) is list else recs.column("op")
            new = [i for i in new if ops[i] == OP_SET]
        if len(new) < len(recs):
            recs = [recs[i] for i in new] if type(recs) is list else recs.take(new)
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
        recs = list(recs)  # (a _native.Records is read-only)
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
        ``new`` (back-pressure between pages)."""
        tier = self.tier
        table = tier.table
        from_blob = self.codec.memory_form_from_blob
        pids = list(by_page)
        for c in range(0, len(pids), _FAULT_BATCH):
            chunk = pids[c:c + _FAULT_BATCH]
            rows = self.store.read_pages([p for p in chunk if p not in tier.pages])
            for pid in chunk:
                if tier.pending >= self.max_pending_pages:
                    self.backpressure()
                target = tier.pages.get(pid)
                if target is None:  # (a page in memory is authoritative)
                    # (policy="midpoint": taken in for the changes below,
                    # outside the budget, so that no entry of it leaves
                    # memory before the first change dirties it)
                    target = self.fault_in(pid, rows.get(pid), for_write=True)
                elif target.unloaded:  # (policy="midpoint": but maybe not whole)
                    self.whole(target)
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
                        self.counts.expiry_changed(old is not None, expire_at is not None)
                        tier.hit(page, slot)
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
                    self.counts.removed(1, old is not None)
                if tier.per_entry:
                    tier.settle(target)  # (nothing changed it: what came in for it leaves)

    def _insert_new_keys(self, recs: Sequence[tuple], keys: list[Any], lsn: int,
                         now: float) -> None:
        """Insert keys that are nowhere yet with their final sets
        (back-pressure between batches of pages). They enter the key filter
        when a flush stores them, not here.

        :param recs: a list of record tuples or a ``_native.Records``."""
        if not recs:
            return
        tier = self.tier
        codec = self.codec
        if type(recs) is list:
            held = codec.memory_forms_from_blobs(map(_VALUE_OF, recs))
            expires = list(map(_EXPIRE_OF, recs))
            nbytes = list(map(operator.add, map(len, map(_KEY_OF, recs)),
                              map(len, map(_VALUE_OF, recs))))
        else:
            if type(codec).memory_forms_from_blobs is _codec.SafeCodec.memory_forms_from_blobs:
                # what SafeCodec's C kernel does, read from the log's bytes
                held = recs.memory_forms(codec.memory_form_from_blob)
            else:
                held = codec.memory_forms_from_blobs(recs.column("value"))
            expires = recs.column("expire_at")
            nbytes = recs.column("nbytes")
        self.store_keys.reserve(len(keys), self.counts.keys)
        pos = 0
        while pos < len(keys):
            room = self.max_pending_pages - tier.pending
            if room <= 0:
                self.backpressure()
                continue
            end = tier.insert_many(keys, held, expires, nbytes, now, lsn, pos, room)
            self.counts.added(end - pos, end - pos - expires[pos:end].count(None))
            pos = end
