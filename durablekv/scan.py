"""Iteration: ``iter(cache)``, ``keys()``, ``items()``, ``values()``.

:class:`Scans` (mixed into :class:`~durablekv.cache.Cache`) takes the key
list under the lock in slices (``_SCAN_BATCH`` keys, ``_SCAN_BATCH_PAGES``
stored pages at a time), so a long scan never holds the lock for long, and
reads stored pages without faulting them in (a scan does not evict the
working set).
"""

from __future__ import annotations

from collections.abc import ItemsView, KeysView, ValuesView
from typing import Any, Iterator

from . import codec as _codec
from .tier.pages import HAS_TTL


#: items()/values() take the lock once per this many keys in memory, or
#: pages read from the store.
_SCAN_BATCH = 1024


_SCAN_BATCH_PAGES = 64


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


class Scans:
    """Iteration over keys, items and values (see the module docstring)."""

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
            if not self._store_keys.clear_pending:
                in_memory = self._tier.pages
                table = self._tier.table
                decode = _codec.decode_key
                for ck, orig, pid, e in self._store.scan_index():
                    page = in_memory.get(pid)
                    if page is not None:
                        if not page.unloaded:
                            continue  # in memory whole: the table listed its keys
                        # policy="midpoint": in memory in part; its loaded
                        # keys are in the table, its unloaded ones only here
                        k = decode(orig if orig is not None else ck)
                        if k not in table:
                            keys.append(k)
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
        rows = {} if self._store_keys.clear_pending else \
            self._store.read_pages([p for p in pids if p not in tier.pages])
        # (a page in memory, even in part under policy="midpoint", is looked
        # up key by key below: _scan_lookup reads what memory lacks)
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
        if self._store_keys.clear_pending:
            return None
        found = self._store.find(_codec.canonical_key(key))
        if found is None:
            return None
        page = self._tier.pages.get(found[0])
        if page is not None and not page.unloaded:
            return None  # its page is in memory whole and no longer holds it
        # (page not None: in memory in part, policy="midpoint"; the stored
        # copy agrees with the loaded slots, which _decode_page checks)
        _slots, pkeys, values, expires = self._decode_page(
            found[0], None if found[1] is None else found[1:], partial=page)
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
                if self._last_lsn != lsn or self._counts.ttl_keys:
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
