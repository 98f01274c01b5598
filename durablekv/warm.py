"""Warm restart: the residency list, and the preload that brings its pages back after open.

A reopened cache's memory tier starts empty, so every page its workload was
using must fault in again, one miss at a time. Database buffer pools solve
this the same way: InnoDB dumps the buffer pool's page ids at shutdown
(``innodb_buffer_pool_dump_at_shutdown``, ``ib_buffer_pool``) and loads them
in the background at start; PostgreSQL's ``pg_prewarm`` autoprewarm worker
writes ``autoprewarm.blocks`` at shutdown and every
``pg_prewarm.autoprewarm_interval``, and reads it back after recovery. Here:

* **The residency list** is the file ``resident.list`` in the cache
  directory: the ids of the resident pages, most recently used first. The
  write-behind thread saves it at most every :data:`RESIDENCY_INTERVAL`
  seconds (when the memory tier was used since the last save), and a clean
  close saves it last, so after a crash (``kill -9``) it is at most one
  interval old. It is written to ``resident.list.tmp`` (mode 0600) and
  renamed over the old one, without an fsync: it survives a killed process;
  after a power loss it may be gone or empty, which is a cold start.
* **The preload** runs after recovery on a thread of its own
  (``durablekv-warm[name]``): it reads the list, then, MRU first, takes the
  cache lock for each batch of :data:`WARM_BATCH` pages, reads those the
  memory tier does not hold from the store (as a page fault would, under the
  lock) and installs them, while there is room: it never evicts a page. A
  page a user faulted in or wrote meanwhile is already in memory and is
  skipped; a page the store no longer holds (deleted, or a list from another
  cache) is skipped; a page the store holds is read as it is now. So the list
  decides only *which* pages come back, never what they hold: correctness is
  the store's and the log's. Preloaded pages keep the list's order in the
  LRU and leave before any page used since open. The thread stops at the end
  of the list, when the tier is full, at ``clear()`` and at ``close()``.
  ``Cache(..., warm=False)`` neither reads nor writes the list.
* **Damage**: the list is a hint. A file that is missing is a cold start; one
  that is damaged, truncated, too big, not a regular file, or made for
  another page size is ignored with a logged warning and counted in
  ``stats().residency_errors``; a save that fails is logged and counted the
  same way. Neither ever fails an open or a flush.

File format (little-endian)::

    header  "DKVRES01" (8 bytes), u32 format version (1), u32 page_size,
            u32 count, u32 CRC-32 of the id bytes
    ids     count x u64 page ids, most recently used first

Open does none of this work: it starts the thread and returns (design
invariant 6: opening costs O(log suffix)).
"""

from __future__ import annotations

import array
import logging
import math
import os
import stat
import struct
import sys
import threading
import time
import zlib

from ._perms import replace_private_file
from ._threads import join_thread, start_thread
from .config import _OPEN, _REAL_MONOTONIC
from .errors import CorruptStoreError, StoreError

__all__ = ["RESIDENCY_FILE", "RESIDENCY_INTERVAL", "WARM_BATCH", "MAX_LISTED_PAGES",
           "encode_residency", "decode_residency"]

log = logging.getLogger("durablekv")

#: The residency list's file name in the cache directory.
RESIDENCY_FILE = "resident.list"

#: Seconds between saves of the residency list by the write-behind thread
#: (a crash loses at most this much recency, never data).
RESIDENCY_INTERVAL = 1.0

#: Pages the preload reads per hold of the cache lock.
WARM_BATCH = 8

#: Most page ids a residency list holds (8 MiB of ids); a longer file is damage.
MAX_LISTED_PAGES = 1 << 20

_MAGIC = b"DKVRES01"
_VERSION = 1
_HEADER = struct.Struct("<8sIIII")
assert _HEADER.size == 24
_ID_MAX = (1 << 62) - 1  # as the stores bound page ids (stores.base)


def encode_residency(page_ids: list[int], page_size: int) -> bytes:
    """The file's bytes for ``page_ids`` (MRU first; at most
    :data:`MAX_LISTED_PAGES` are kept) of a store with ``page_size`` slots per page."""
    ids = array.array("Q", page_ids[:MAX_LISTED_PAGES])
    if sys.byteorder != "little":  # pragma: no cover - big-endian hosts
        ids.byteswap()
    body = ids.tobytes()
    return _HEADER.pack(_MAGIC, _VERSION, page_size, len(ids), zlib.crc32(body)) + body


def decode_residency(data: bytes, page_size: int) -> list[int]:
    """The page ids (MRU first) of a residency list's bytes.

    :raises ValueError: the bytes are not a whole list for ``page_size``
        (the message says what is wrong).
    """
    if len(data) < _HEADER.size:
        raise ValueError(f"it is {len(data)} bytes, shorter than its {_HEADER.size}-byte header")
    magic, version, size, count, crc = _HEADER.unpack_from(data)
    if magic != _MAGIC:
        raise ValueError(f"it does not start with {_MAGIC!r} (found {magic!r})")
    if version != _VERSION:
        raise ValueError(f"format version {version}, expected {_VERSION}")
    if size != page_size:
        raise ValueError(f"it was written for page_size {size}, the store has {page_size}")
    if count > MAX_LISTED_PAGES:
        raise ValueError(f"it claims {count} pages, more than {MAX_LISTED_PAGES}")
    body = data[_HEADER.size:]
    if len(body) != 8 * count:
        raise ValueError(f"it claims {count} pages but holds {len(body)} bytes of ids, "
                         f"not {8 * count}")
    if zlib.crc32(body) != crc:
        raise ValueError("its ids fail their CRC-32")
    ids = array.array("Q")
    ids.frombytes(body)
    if sys.byteorder != "little":  # pragma: no cover - big-endian hosts
        ids.byteswap()
    out = ids.tolist()
    if out and (min(out) < 1 or max(out) > _ID_MAX):
        raise ValueError(f"a page id is outside 1 to {_ID_MAX}")
    if len(set(out)) != len(out):
        raise ValueError("it lists a page twice")
    return out


def _read_file(path: str) -> bytes | None:
    """The file's bytes (at most the largest list + 1 byte), or None when it
    does not exist.

    :raises ValueError: it is not a regular file, or is too big.
    :raises OSError: it cannot be read.
    """
    try:
        # O_NONBLOCK: a FIFO put there must not hold the preload up forever;
        # O_NOFOLLOW: a symlink is not our file
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno == getattr(os, "ELOOP", None) or os.path.islink(path):
            raise ValueError("it is a symbolic link, not a file the cache wrote") from exc
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError("it is not a regular file")
        limit = _HEADER.size + 8 * MAX_LISTED_PAGES
        if st.st_size > limit:
            raise ValueError(f"it is {st.st_size} bytes, more than a list can be ({limit})")
        chunks, left = [], limit + 1
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def _write_file(directory: str, data: bytes) -> None:
    """Replace the residency list with ``data`` (temporary file, mode 0600, then a rename).

    :raises OSError: it could not be written.
    """
    replace_private_file(os.path.join(directory, RESIDENCY_FILE), data)


def check_wait_timeout(timeout: object) -> float:
    """``wait_warm(timeout=...)``'s argument as float seconds (not None).

    :raises TypeError: not a number.
    :raises ValueError: negative, NaN or infinite.
    """
    if type(timeout) is bool or not isinstance(timeout, (int, float)):
        raise TypeError(f"wait_warm() timeout must be a number of seconds or None, "
                        f"got {type(timeout).__name__}")
    timeout = float(timeout)
    if not 0 <= timeout < math.inf:  # (False for NaN)
        raise ValueError(f"wait_warm() timeout must be a finite number of seconds "
                         f">= 0, got {timeout!r}; pass None to wait until it ends")
    return timeout


class WarmRestart:
    """Saving the residency list and the preload thread (mixed into
    :class:`~durablekv.cache.Cache`; see the module docstring)."""

    def _warm_init(self, warm: bool) -> None:
        """Set up the state (in ``_open``, before recovery)."""
        self.warm = warm
        self._warmed_pages = 0
        self._residency_errors = 0
        self._warm_seconds = 0.0
        self._warm_started_at = _REAL_MONOTONIC[0]()
        self._warm_thread: threading.Thread | None = None
        self._warm_done = threading.Event()
        self._warm_done.set()  # nothing to wait for until a preload starts
        self._residency_saved_at = -float("inf")
        self._residency_saved_ticks = -1
        self._residency_saves = 0
        self._warm_rest: list[int] = []  # listed pages a close kept the preload from

    def _warm_start(self) -> None:
        """Start the preload (end of ``_open``, recovery done): a thread that
        reads the list and installs its pages. No I/O here."""
        if not self.warm or self._temporary:
            return
        self._warm_done.clear()
        self._warm_started_at = _REAL_MONOTONIC[0]()
        # Preloaded pages are stamped between the ticks drawn so far
        # (recovery's) and every later one (users'): see _warm_pages.
        tier = self._tier
        self._warm_base = tier.draw_tick()
        self._warm_thread = threading.Thread(target=self._warm_run,
                                             name=f"durablekv-warm[{self.name}]", daemon=True)
        start_thread(self._warm_thread)

    def wait_warm(self, timeout: float | None = None) -> bool:
        """Wait for the warm restart's preload to end (its list done, the
        memory tier full, or the cache closed or cleared).

        :param timeout: seconds to wait at most (a finite number >= 0); None
            waits until it ends.
        :returns: True when it has ended (at once with ``warm=False``, or when
            there was no list), False when ``timeout`` passed first. Pages
            preloaded: ``stats().warmed_pages``.
        :raises TypeError, ValueError: a bad ``timeout``.

        Thread-safe. Gets and sets never wait for the preload; this is for
        tests, benchmarks and callers that want a warm tier before serving.
        """
        if timeout is not None:
            timeout = check_wait_timeout(timeout)
        return self._warm_done.wait(timeout)

    def _warm_gate(self) -> None:
        """Called by the preload thread before each batch (lock not held); a
        seam for tests, which replace it to step the preload."""

    def _warm_run(self) -> None:
        try:
            ids = self._warm_list()
            if ids:
                self._warm_pages(ids)
        except BaseException as exc:  # noqa: BLE001 - a hint: logged, never raised
            log.error("warm restart of %s stopped: %r", self.path, exc)
        finally:
            self._warm_seconds = _REAL_MONOTONIC[0]() - self._warm_started_at
            self._warm_done.set()

    def _warm_list(self) -> list[int]:
        """The saved residency list, [] when there is none or it is damaged
        (then logged and counted)."""
        path = os.path.join(self.path, RESIDENCY_FILE)
        try:
            data = _read_file(path)
            if data is None:
                return []
            return decode_residency(data, self.page_size)
        except (ValueError, OSError) as exc:
            with self._lock:
                self._residency_errors += 1
            log.warning("residency list %s is ignored (%s): it is only a hint of which pages "
                        "were in memory, so the memory tier starts cold; nothing stored is "
                        "affected, and the next save replaces it", path, exc)
            return []

    def _warm_pages(self, ids: list[int]) -> None:
        """Install the listed pages, MRU first, while the tier has room (in
        pages, ``max_pages``, and in bytes, ``max_memory_bytes``)."""
        tier = self._tier
        # Recency stamps in list order, strictly between the tick before
        # _warm_base and every tick drawn after it (floats compare with the
        # int ticks; exact while ticks stay below 2**53 / len(ids))
        base, step = self._warm_base, 1.0 / (len(ids) + 1)
        pos = 0
        while pos < len(ids):
            self._warm_gate()
            with self._lock:
                if self._store_keys.clear_pending:
                    return
                if self._state is not _OPEN:
                    # closing: the list saved at close keeps what was not read
                    self._warm_rest = ids[pos:]
                    return
                room = tier.warm_room()
                if room <= 0:
                    return
                batch = []
                while pos < len(ids) and len(batch) < min(room, WARM_BATCH):
                    if ids[pos] not in tier.pages:
                        batch.append((ids[pos], base - (pos + 1) * step))
                    pos += 1
                if not batch:
                    continue
                try:
                    rows = self._store.read_pages([pid for pid, _ in batch])
                    for pid, stamp in batch:
                        row = rows.get(pid)
                        if row is None:
                            continue  # gone from the store (deleted, or not this store's)
                        if not tier.warm_fits(row[0], len(row[1])):
                            return  # max_memory_bytes (or "midpoint"'s entries): never evicts
                        slots, keys, values, expires = self._decode_page(pid, row)
                        tier.install(pid, slots, keys, values, expires, len(row[1]),
                                     warm_stamp=stamp, **self._sizes(row))
                        self._warmed_pages += 1
                except CorruptStoreError as exc:
                    # marked damaged (_decode_page or the store); a get of that
                    # page's keys raises too
                    log.error("warm restart of %s stopped: %s", self.path, exc)
                    return
                except StoreError as exc:
                    log.warning("warm restart of %s stopped: the store could not be read "
                                "(%s); the pages left fault in when used", self.path, exc)
                    return
            time.sleep(0)  # let a writer waiting for the lock take it (no timing)

    def _warm_stop(self) -> None:
        """Wait for the preload thread (close; the state is no longer open,
        so it stops at its next batch)."""
        t = getattr(self, "_warm_thread", None)
        if t is not None and t is not threading.current_thread() and t.is_alive():
            join_thread(t)

    # -- saving ------------------------------------------------------------------------

    def _residency(self) -> list[int]:
        """Resident page ids, most recently used first. Only a list copy is
        made under the lock; the sort runs outside it (stamps move without
        the lock anyway: a memory hit stamps its page lock-free)."""
        with self._lock:
            pages = list(self._tier.pages.values())
        live = self._tier.recency(pages)
        live.sort(reverse=True)
        out = [pid for _, pid in live]
        if self._warm_rest:
            # a close stopped the preload: the pages it did not get to stay
            # listed, after every page in memory (a quick open and close must
            # not leave a colder list than it found)
            have = set(out)
            out += [pid for pid in self._warm_rest if pid not in have]
            del out[self._tier.max_pages:]
        return out

    def _save_residency(self) -> bool:
        """Write the residency list now; True when written. A failure is
        logged and counted (``stats().residency_errors``), never raised."""
        try:
            _write_file(self.path, encode_residency(self._residency(), self.page_size))
        except OSError as exc:
            with self._lock:
                self._residency_errors += 1
            log.warning("could not save the residency list of %s (%r); a restart will find "
                        "the memory tier colder than it was", self.path, exc)
            return False
        self._residency_saves += 1
        return True

    def _residency_tick(self) -> None:
        """Write-behind thread, each cycle: save the list when
        :data:`RESIDENCY_INTERVAL` has passed and the tier was used since."""
        if not self.warm or self._temporary or self._state is not _OPEN:
            return
        now = _REAL_MONOTONIC[0]()
        if now - self._residency_saved_at < RESIDENCY_INTERVAL:
            return
        ticks = self._tier.next_tick()
        if ticks == self._residency_saved_ticks:
            return
        if self._warm_thread is not None and not self._warm_done.is_set():
            return  # while preloading, the list on disk is still the better one
        self._residency_saved_at = now
        if self._save_residency():
            # after the write: whoever sees it knows a list taken after
            # tick ``ticks`` is on disk (tests/warm_writer.py waits for it)
            self._residency_saved_ticks = ticks

    def _residency_at_close(self) -> None:
        """Clean close (batcher stopped, preload stopped): save the final list."""
        if self.warm and not self._temporary and self._tier is not None:
            self._save_residency()

