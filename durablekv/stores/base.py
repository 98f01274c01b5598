"""The ``PageStore`` protocol: what the cache, the batcher, recovery and ``check`` need from a store.

A page store keeps three things, changed together in one transaction per
flush: **pages** (``page_id -> (n_entries, blob)``, blobs in the format of
:mod:`durablekv.stores.pageformat`), the **key index** (canonical key bytes,
see :func:`durablekv.codec.canonical_key`, to the page that holds the entry,
with its ``expire_at`` and, when it differs, the key's own encoding
``orig``), and **meta** (``page_size``, serializer, ``checkpoint_lsn``, key
counts, the TTL clock). :class:`~durablekv.stores.sqlite.SQLitePageStore` is
the first implementation; every implementation passes ``tests/stores/``.

Contracts every store keeps (the conformance suite tests each one):

1. **Batch atomicity.** :meth:`PageStore.write_batch` applies every image,
   every index change, the counts and the checkpoint LSN, or none of them;
   a batch that raises, or a process killed during it, leaves the store as
   it was before the batch (on reopen too).
2. **Checkpoint ordering.** ``checkpoint_lsn`` never goes backwards within
   a store's life; it is readable after a commit and after a reopen, and
   equals the value of the last committed batch.
3. **Index agrees with pages.** After any committed batch, each index row
   names a page that holds that key, and each entry of each page has its
   index row; ``key_count``/``ttl_key_count`` equal what the index holds.
4. **Reopen.** A closed store opened again (same directory or URL) reads the
   same pages, index, counts, checkpoint and TTL clock.
5. **Damage detection.** A page whose stored bytes do not match its
   checksum (:func:`~durablekv.stores.pageformat.page_crc`) is never handed
   back as good: reading it raises
   :class:`~durablekv.errors.CorruptStoreError`.
6. **Meta validation.** Opening a store whose meta is out of bounds
   (:func:`meta_problems`) raises :class:`~durablekv.errors.CorruptStoreError`;
   one made with other fixed settings (``page_size``, serializer) raises
   :class:`~durablekv.errors.ConfigError`.
7. **Size limit.** A batch with ``size_limit`` evicts least recently used
   pages not in ``keep_pages`` until :attr:`PageStore.data_bytes` is at most
   the limit; evicted keys are gone from pages, index and counts, every
   other key keeps its value, and :meth:`PageStore.take_evicted` reports
   each evicted page once.

Threads: the cache calls the read methods under its lock; only the batcher
thread calls :meth:`PageStore.write_batch` and :meth:`PageStore.iter_keys`
(and open/close, when that thread is not running).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import AbstractSet as Set
from typing import Any, Container, Iterable, Iterator, Protocol, Sequence, runtime_checkable

from .pageformat import PAGE_SIZE_MAX

__all__ = ["PageImage", "PageStore", "meta_problems", "ordered_migrations"]


@dataclass(frozen=True)
class PageImage:
    """One page as the batcher writes it.

    :ivar page_id: the page's id.
    :ivar n: entries in the page (0 deletes the row).
    :ivar ttl_n: entries that have an expire_at.
    :ivar data: the page blob (see module docstring).
    :ivar index_rows: ``(canonical_key, expire_at, orig_or_None)`` for every
        entry when the page's key set changed since it was last stored, else
        None (value-only change: the index is left alone).
    :ivar stored: the store may hold this page (a committed row and index
        rows). False only for a page id that has no committed rows (never
        stored, or committed empty since): its index rows are inserted
        without reading or deleting anything first.
    """

    page_id: int
    n: int
    ttl_n: int
    data: bytes
    index_rows: Sequence[tuple[bytes, float | None, bytes | None]] | None
    stored: bool = True


#: Bounds on page ids and LSNs read from disk (far beyond any real store,
#: well inside int64 so that no later arithmetic or packing overflows).
_ID_MAX = (1 << 62) - 1


#: What a store whose meta has no page_size is (every store records it at creation).
MISSING_PAGE_SIZE = ("meta page_size is missing, which every durablekv store records when it "
                     "is created (this one has pages or a serializer): the meta table was "
                     "changed")


def meta_problems(meta: dict[str, Any], max_page_id: Any, min_page_id: Any,
                  store_bytes: int) -> list[str]:
    """What is wrong with settings and counters read from a store's ``meta``
    table (and the page-id range of its ``pages``), each naming the field,
    the value found and the bound; [] when all hold. The bounds are the
    constructor's (``page_size`` 1 to :data:`PAGE_SIZE_MAX`) and what a store
    of ``store_bytes`` bytes can hold (every key takes at least a byte of
    its index, so ``key_count`` cannot exceed it)."""
    out: list[str] = []

    def need_int(name: str, value: Any, lo: int, hi: int, why: str = "") -> bool:
        if type(value) is int and lo <= value <= hi:
            return True
        out.append(f"meta {name}={value!r} is not an integer from {lo} to {hi}{why}")
        return False

    if "page_size" in meta:
        need_int("page_size", meta["page_size"], 1, PAGE_SIZE_MAX)
    elif max_page_id is not None or "serializer" in meta:
        out.append(MISSING_PAGE_SIZE)
    if "serializer" in meta and type(meta["serializer"]) is not str:
        out.append(f"meta serializer={meta['serializer']!r} is not a codec name")
    need_int("checkpoint_lsn", meta.get("checkpoint_lsn"), 0, _ID_MAX)
    if "data_bytes" in meta:
        need_int("data_bytes", meta["data_bytes"], 0, _ID_MAX)
    bound = max(store_bytes, 0)
    if need_int("key_count", meta.get("key_count"), 0, bound,
                f" (a store of {store_bytes} bytes cannot hold more keys)"):
        need_int("ttl_key_count", meta.get("ttl_key_count"), 0, meta["key_count"],
                 " (key_count)")
    for name in ("ttl_clock_offset", "ttl_clock_now"):
        value = meta.get(name)
        if name in meta and not (type(value) in (int, float) and value == value and
                                 (name == "ttl_clock_now" or math.isfinite(value))):
            out.append(f"meta {name}={value!r} is not a " +
                       ("finite number" if name == "ttl_clock_offset" else "number"))
    if max_page_id is not None and (type(max_page_id) is not int or
                                    not 0 <= min_page_id <= max_page_id <= _ID_MAX):
        out.append(f"page ids run from {min_page_id!r} to {max_page_id!r}, outside 0 to "
                   f"{_ID_MAX}")
    return out


@runtime_checkable
class PageStore(Protocol):
    """What a page store provides (see the module docstring for the contracts).

    Counters are plain attributes, read under the cache lock and updated by
    :meth:`write_batch` when its transaction commits.
    """

    #: where the store lives (a file path, or a URL naming the namespace); in messages
    path: str
    #: slots per page, fixed when the store was created
    page_size: int
    #: LSN of the last log record every committed batch covers (0: none)
    checkpoint_lsn: int
    #: entries in the store, and those of them with an expiry
    key_count: int
    ttl_key_count: int
    #: highest page id the store held at open (0: none); new pages are numbered above it
    max_page_id: int
    #: bytes of the page blobs as last committed (``Cache(size_limit=)`` bounds it)
    data_bytes: int
    #: ``(offset seconds, TTL time reached)`` of the TTL clock as last committed,
    #: ``(0.0, -inf)`` when it never stepped over a wall clock that went back
    ttl_clock: tuple[float, float]

    def find(self, ckey: bytes) -> tuple[int, int | None, bytes | None] | None:
        """The page holding canonical key ``ckey``: ``(page_id, n_entries,
        blob)``; ``(page_id, None, None)`` when the index names a page that is
        missing; None when the key is not in the index.

        :raises CorruptStoreError: the page fails its checksum.
        :raises StoreError: the read failed.
        """
        ...

    def read_page(self, page_id: int) -> tuple[int, bytes] | None:
        """``(n_entries, blob)`` of a committed page, or None when absent.

        :raises CorruptStoreError: the page fails its checksum.
        """
        ...

    def read_pages(self, page_ids: Sequence[int]) -> dict[int, tuple[int, bytes]]:
        """``{page_id: (n_entries, blob)}`` for those of ``page_ids`` that exist
        (recovery and scans, in batches).

        :raises CorruptStoreError: a page fails its checksum.
        """
        ...

    def locate_keys(self, ckeys: Sequence[bytes]) -> dict[bytes, int]:
        """``{canonical key: page_id}`` for those of ``ckeys`` in the index (recovery)."""
        ...

    def scan_index(self) -> Iterator[tuple[bytes, bytes | None, int, float | None]]:
        """Every committed index row ``(key, orig, page_id, expire_at)`` (scans)."""
        ...

    def iter_keys(self, batch: int = 10_000) -> Iterator[bytes]:
        """Every committed canonical key (the key filter's build; batcher thread only)."""
        ...

    def expired_by_page(self, now: float) -> list[tuple[int, int]]:
        """``(page_id, entries)`` per committed page holding entries with
        ``expire_at <= now`` (epoch seconds): ``len()`` counts them out."""
        ...

    def expired_pages(self, now: float, skip: Container[int], limit: int) -> list[int]:
        """Ids of up to ``limit`` committed pages not in ``skip`` holding
        entries with ``expire_at <= now`` (the expiry sweep and ``expire()``)."""
        ...

    def any_key(self, exclude_pages: set[int]) -> tuple[bytes, bytes | None] | None:
        """Some committed ``(key, orig)`` on a page not in ``exclude_pages``,
        or None (``popitem`` when memory holds nothing)."""
        ...

    def write_batch(self, images: Sequence[PageImage], checkpoint_lsn: int, key_count: int,
                    ttl_key_count: int, clear: bool = False, *,
                    held_pages: Set[int] = frozenset(),
                    ttl_clock: tuple[float, float] | None = None,
                    size_limit: int | None = None, keep_pages: Container[int] = frozenset(),
                    left_pages: Sequence[int] = ()) -> list[bytes]:
        """Write ``images`` (``n == 0`` deletes the page), their index changes,
        the counts and ``checkpoint_lsn`` in ONE transaction (contract 1).

        Every page written gets ``checkpoint_lsn`` as its *last use*, and so do
        the stored pages ``left_pages`` (pages that just left the memory
        tier). Then, when ``size_limit`` is given and :attr:`data_bytes`
        passes it, the same transaction evicts stored pages, least recently
        used first (smallest last use, then page id), skipping ``keep_pages``
        (the pages in the cache's memory), with their index rows, until
        ``data_bytes <= size_limit`` or only kept pages are left (contract 7).
        The counts stored are ``key_count``/``ttl_key_count`` less the
        evicted entries; :meth:`take_evicted` tells which pages went.

        :param clear: delete every page and index row first (``Cache.clear()``).
        :param held_pages: dirty pages left out of this commit; a key moving
            from one of them into a page written here is refused.
        :param ttl_clock: the TTL clock to store, when it changed.
        :param size_limit: bytes of page blobs to evict down to; None: none.
        :param keep_pages: ids of pages never to evict in this batch.
        :param left_pages: ids of stored pages whose last use becomes
            ``checkpoint_lsn`` (unknown ids are ignored).
        :returns: canonical keys whose index rows this commit added.
        :raises StoreError: the transaction failed and was rolled back.
        :raises HeldKeyError: see ``held_pages`` (nothing was written).
        """
        ...

    def take_evicted(self) -> list[tuple[int, int, int]]:
        """``(page_id, entries, entries with an expiry)`` of the pages that
        committed batches evicted since the last call (each reported once)."""
        ...

    def pause_snapshot(self) -> None:
        """Before a commit (cache lock held): reads stop sharing a read
        snapshot, so the commit is not held back by a reader. A store with no
        such snapshot makes this a no-op."""
        ...

    def resume_snapshot(self) -> None:
        """After a commit: reads may share a snapshot again (or a no-op)."""
        ...

    def size_bytes(self) -> int:
        """Bytes the store takes on disk (``stats().store_bytes``)."""
        ...

    def integrity_check(self) -> list[str]:
        """A full check of the store's own structure; [] when healthy."""
        ...

    def close(self, checkpoint_wal: bool = False) -> None:
        """Release connections and files; idempotent. ``checkpoint_wal``: fold
        any write-ahead log into the main store first (a clean close)."""
        ...


def ordered_migrations(files: Iterable[Any]) -> list[tuple[int, str, str]]:
    """A store's schema migrations as ``(version, name, sql)`` in order, from
    ``files`` (paths or ``importlib.resources`` entries named ``NNNN_*.sql``;
    other names are ignored).

    :raises RuntimeError: the numbers do not run 1, 2, 3, ... (a packaging error).
    """
    out = []
    for p in files:
        prefix = p.name.split("_", 1)[0]
        if p.name.endswith(".sql") and prefix.isdigit():
            out.append((int(prefix), p.name, p.read_text(encoding="utf-8")))
    out.sort()
    for i, (v, name, _) in enumerate(out, 1):
        if v != i:
            raise RuntimeError(f"migration {name} is out of sequence (expected number {i})")
    return out
