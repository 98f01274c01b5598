"""Page faults: find a key whose page is not in memory and make that page resident.

:class:`PageFaults` (mixed into :class:`~durablekv.cache.Cache`): key filter
-> key index (``store.find``) -> page read (``store.read_page``) -> decode ->
``MemoryTier.install``. A stored page that disagrees with itself or with the
memory tier marks the store damaged and raises
:class:`~durablekv.errors.CorruptStoreError`.
"""

from __future__ import annotations

from typing import Any

from . import codec as _codec
from .config import _U32_PACK
from .errors import CorruptStoreError
from .tier.pages import UNLOADED, Page
from .stores.pageformat import (ASCII_KEYS, INT_KEYS, RAW_BYTES, entry_sizes, page_columns,
                                split_page)
from .stores.sqlitefile import mark_damaged


class PageFaults:
    """Key index look-ups and page faults (see the module docstring)."""

    def _locate(self, key: Any, for_delete: bool = False) -> tuple | list | None:
        """Find a key whose page is not in memory: key index, then page fault;
        return its page-table entry ``(page, slot, value)`` (see MemoryTier).

        ``for_delete``: the caller removes the key at once, so its page comes
        in outside the LRU order (pending under ``lru``/``tinylfu``, doomed
        under ``midpoint``) and leaves with the flush that stores the removal:
        a delete of a key only in the store evicts nothing resident.

        A key of a subclass (an ``IntEnum`` member, a namedtuple) is looked
        up as the plain key it equals (:func:`~durablekv.codec.lookup_key`),
        as the page table does for a resident page.

        :raises TypeError: an unsupported key (from ``canonical_key``): every
            answer but the look-aside one below comes after that check.
        """
        keys = self._store_keys
        if keys.absent is key:
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
        if keys.clear_pending:
            return None
        if keys.excluded(ck):
            keys.found_absent(key)
            return None
        found = self._store.find(ck)
        if found is None:
            keys.found_absent(key)
            return None
        pid = found[0]
        row = None if found[1] is None else found[1:]
        page = self._tier.pages.get(pid)
        if page is not None:
            if not page.unloaded:
                return None  # its page is in memory and no longer holds it
            # policy="midpoint": the page is in memory in part; read the rest in
            self._fill(page, row, want=key, for_write=for_delete)
        else:
            page = self._fault_in(pid, row, want=key, for_write=for_delete)
        ref = self._tier.table.get(key)
        if for_delete and ref is None:
            # (not on the page the index names: nothing will dirty it)
            if self._tier.per_entry:
                self._tier.settle(page)
            else:
                self._tier.fault_pending(page)
        return ref

    def _fault_in(self, pid: int, row: tuple[int, bytes] | None = None,
                  want: Any = UNLOADED, for_write: bool = False) -> Page:
        """Read page ``pid`` (or use ``row`` = (n, blob) already read) and make
        it resident (``want``: the key whose access faulted, for
        ``policy="midpoint"``, which makes that entry young and the rest old;
        ``for_write``: under ``"midpoint"``, take the entries in doomed, for a
        caller that changes the page at once, so none can leave memory
        before the change makes the page dirty: see
        :meth:`~durablekv.tier.midpoint.MidpointTier.settle` if it does not)."""
        if row is None:
            row = self._store.read_page(pid)
        slots, keys, values, expires = self._decode_page(pid, row)
        if not self._tier.per_entry:
            return self._tier.install(pid, slots, keys, values, expires, len(row[1]),
                                      resident=not for_write)
        return self._tier.install(pid, slots, keys, values, expires, len(row[1]), want=want,
                                  resident=not for_write, sizes=entry_sizes(row[1]))

    def _sizes(self, row: tuple[int, bytes]) -> dict[str, Any]:
        """``install``'s ``sizes=`` for a tier that keeps entry sizes
        (``policy="midpoint"``), from a stored page already decoded."""
        return {"sizes": entry_sizes(row[1])} if self._tier.per_entry else {}

    def _fill(self, page: Page, row: tuple[int, bytes] | None = None, *,
              want: Any = UNLOADED, for_write: bool = False) -> None:
        """Read the unloaded entries of ``page`` (in memory in part, under
        ``policy="midpoint"``) back in from its stored copy (``row`` if
        already read); see :meth:`durablekv.tier.midpoint.MidpointTier.fill`.

        :raises CorruptStoreError: the stored page is missing, damaged, or
            disagrees with the entries in memory (the store is marked damaged).
        """
        if row is None:
            row = self._store.read_page(page.page_id)
        slots, keys, values, expires = self._decode_page(page.page_id, row, partial=page)
        self._tier.fill(page, slots, keys, values, expires, want=want, for_write=for_write,
                        sizes=entry_sizes(row[1]))

    def _whole(self, page: Page) -> None:
        """Before ``page`` changes: read its unloaded entries in (they come in
        outside the memory budget and leave after the flush that stores the
        change), so that a flush writes the whole page."""
        self._fill(page, for_write=True)

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

    def _decode_page(self, pid: int, row: tuple[int, bytes] | None, partial: Page | None = None
                     ) -> tuple[list[int], list[Any], list[Any], list[float | None]]:
        """``(slots, keys, values, expires)`` of a stored page that is not in
        memory (``row`` = ``(n_entries, blob)``, None when the key index named
        a page the store lacks), values in their memory form. ``partial``: the
        page is in memory in part (``policy="midpoint"``, clean): its loaded
        slots must hold the stored keys, the others keys memory lacks.

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
        if partial is None:
            self._check_disjoint(pid, keys)
        else:
            self._check_partial(partial, slots, keys)
        return slots, keys, values, expires

    def _check_partial(self, page: Page, slots: list[int], keys: list[Any]) -> None:
        """The stored copy of a clean page in memory in part matches it: the
        same slots in use, the loaded ones holding the same keys, and no
        unloaded key held elsewhere in memory.

        :raises CorruptStoreError: it does not (the store is marked damaged).
        """
        table = self._tier.table
        mine = page.keys
        if len(slots) != page.used:
            raise self._damaged(f"page {page.page_id} holds {len(slots)} entries in the store "
                                f"and {page.used} in memory, with no change to store")
        for slot, key in zip(slots, keys):
            held = mine[slot]
            if held is UNLOADED:
                if key in table:
                    raise self._damaged(f"page {page.page_id} holds key {key!r}, which lives "
                                        "in another page")
            elif held != key or type(held) is not type(key):
                raise self._damaged(f"page {page.page_id} slot {slot} holds {key!r} in the "
                                    f"store and {held!r} in memory, with no change to store")

    def _ref(self, key: Any, now_fn=None, for_delete: bool = False) -> tuple | list | None:
        """The page-table entry ``(page, slot, value)`` of a live key, faulting
        its page in; None when absent (``for_delete``: see :meth:`_locate`).

        Expired entries found on the way are removed (lock held).
        """
        try:
            ref = self._tier.table.get(key)
        except TypeError:
            _codec.check_key(key)  # the same TypeError as set() gives, naming the type
            raise
        if ref is None:
            ref = self._locate(key, for_delete)
            if ref is None:
                return None
        page, slot, _ = ref
        exp = page.expires[slot]
        if exp is not None and self._now() >= exp:
            self._expire(key)
            return None
        return ref
