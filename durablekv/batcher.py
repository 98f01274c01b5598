"""The write-behind batcher: the one thread that writes to SQLite.

Write-behind as in a database's background writer (PostgreSQL's bgwriter and
checkpointer): sets and deletes only touch memory and the replay log; this
thread later writes every dirty page, with the checkpoint LSN, in ONE SQLite
transaction. A page written many times between flushes costs one page write
(coalescing).

A cycle runs when ``interval`` seconds have passed since the last one, when
:meth:`kick` is called (the cache kicks once ``flush_batch_pages`` pages are
dirty, or a writer meets back-pressure), or when :meth:`flush_until` waits.

Duty cycle: re-encoding many hot pages costs Python time that writers pay
for too (the GIL). After a flush that took ``t`` seconds, the next one that
nobody is waiting for starts no sooner than ``duty_ratio * t * share``
seconds later, where ``share`` is the part of the flush's pages that had
been stored before (``Batch.rewritten``): rewriting hot pages is what waiting
saves, so with only hot pages the batcher takes at most about
``1 / (1 + duty_ratio)`` of the time (25 % by default) and their writes
coalesce longer instead. Pages written for the first time (new keys filling
new pages) cost the same whenever they are written, and waiting would only
leave SQLite idle while writers run into back-pressure: a flush of such
pages is followed by the next one as soon as enough pages are dirty. The
replay log is still fsynced every ``interval`` (durability ``log``), and a
:meth:`flush_until` or back-pressure (``kick(urgent=True)``) flushes at once.

The batcher knows its collaborators only by these protocols:

* ``source.take_snapshot() -> Snapshot | None`` (takes the source's lock and
  copies what is dirty), ``snapshot.size`` (pages in it), ``snapshot.page_id(i)``,
  ``snapshot.build(indices=None, uncommitted=()) -> Batch`` (encodes, outside
  any lock; the checkpoint stays below the changes of ``uncommitted`` pages),
  ``source.flush_done(snapshot, indices, added)`` (``added``: the keys whose
  index rows the commit added, as ``write_batch`` returned them) and
  ``source.flush_failed(snapshot, indices=None)``.
* ``source.background_work()``: run in this thread before each cycle, for
  work that must not race with commits (the key filter's store scan).
* ``store.write_batch(images, checkpoint_lsn, key_count, ttl_key_count, clear,
  held_pages=...) -> added`` and ``store.checkpoint_lsn``.
* ``log.sync()`` and ``log.truncate_through(lsn)`` (``log`` may be None).

Errors: a failed cycle is counted, remembered and retried with exponential
back-off (``interval`` doubling up to ``max_backoff`` seconds); the pages stay
dirty in memory. :meth:`flush_until` raises it to the caller who waits.

A failure that is not about the database as a whole (not "locked", "busy",
"full", an I/O error, ...) may be caused by one page: the batch is then
split in halves until the failing pages are found, every other page is
committed, and only the failing ones stay dirty and are retried (a poison
entry never blocks the rest of the queue). The checkpoint of each partial
commit stops below the first change of any page not yet committed, so
invariant 2 holds throughout.

Waits use ``threading.Condition``/``Event`` with real timeouts, never
sleep-polling, so they work under time-mocking libraries (freezegun).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Protocol, Sequence

from ._threads import join_thread, start_thread
from .errors import FlushTimeoutError, HeldKeyError, LogFileGoneError, WriteBehindError
from .stats import FLUSH_PAGES_BUCKETS, FLUSH_SECONDS_BUCKETS, Histogram

__all__ = ["WriteBehindBatcher", "Batch"]

log = logging.getLogger("durablekv.batcher")

# Captured in a tuple so time-mocking libraries that patch module attributes
# leave these real clocks alone (waits must follow real time).
_REAL = (time.monotonic, time.perf_counter)


@dataclass
class Batch:
    """What one flush transaction writes (built outside the cache's lock).

    ``rewritten``: how many of ``images`` had been stored before (the
    duty cycle waits in proportion to them; see the module docstring).
    ``held_pages``: ids of the snapshot's pages this commit leaves out (a
    failing page is being isolated); see ``Store.write_batch``.
    ``ttl_clock``: ``(offset, now)`` of the source's TTL clock, or None.
    ``size_limit``, ``keep_pages``, ``left_pages``: the store's byte bound
    (None: none), the pages it must not evict and the pages that left
    memory (see ``Store.write_batch``).
    """

    images: Sequence[Any]
    checkpoint_lsn: int
    key_count: int
    ttl_key_count: int
    clear: bool = False
    rewritten: int = 0
    held_pages: frozenset = frozenset()
    ttl_clock: tuple[float, float] | None = None
    size_limit: int | None = None
    keep_pages: frozenset = frozenset()
    left_pages: Sequence[int] = ()


class _Snapshot(Protocol):
    checkpoint_lsn: int
    size: int

    def page_id(self, index: int) -> int:
        """The id of item ``index``'s page (named in errors)."""

    def build(self, indices: list[int] | None = None,
              uncommitted: Any = frozenset()) -> Batch: ...


class FlushSource(Protocol):
    """What the batcher calls on its source (a cache hands it a
    :class:`~durablekv.writeback.CacheFlushSource`; tests/test_batcher.py
    an in-memory one). Every call but ``background_work`` comes from a
    cycle, so never two at once."""

    def take_snapshot(self) -> _Snapshot | None:
        """Copy what is dirty (under the source's own lock), or None when
        there is nothing to commit."""

    def flush_done(self, snapshot: Any, indices: list[int] | None, added: list) -> None:
        """``snapshot``'s items ``indices`` (all: None) are committed."""

    def flush_failed(self, snapshot: Any, indices: list[int] | None = None) -> None:
        """``snapshot``'s items ``indices`` (all: None) were not committed;
        they stay dirty."""

    def background_work(self) -> None:
        """Work to run on the batcher's thread before each cycle."""


class WriteBehindBatcher:
    """Owns the writer thread.

    :param source: a :class:`FlushSource` (see the module docstring).
    :param store: the page store.
    :param replay_log: the replay log to fsync each cycle (``log`` mode) and
        to cut back after checkpoints, or None.
    :param interval: seconds between cycles (``flush_interval``).
    :param sync_log: fsync the replay log at every cycle (durability ``log``).
    :param name: used in the thread name and messages.
    """

    def __init__(self, source: FlushSource, store: Any, replay_log: Any, *, interval: float,
                 sync_log: bool, name: str, path: str, max_backoff: float = 1.0,
                 duty_ratio: float = 3.0) -> None:
        self._source = source
        self._store = store
        self._log = replay_log
        self._interval = interval
        self._sync_log = sync_log
        self._path = path
        # a failing store is retried at least every max_backoff seconds,
        # however long flush_interval is (a flush() waiting must not wait it out)
        self._max_backoff = max_backoff
        self._duty_ratio = duty_ratio
        self._urgent = False    # someone waits for a flush (set without the lock)
        self._cooling = False   # inside the duty-cycle pause: plain kicks wait
        self._cond = threading.Condition()   # guards everything below
        self._wake = threading.Event()
        self._stop = False
        self._durable_lsn = store.checkpoint_lsn
        self._cycles = 0            # completed cycles (ok or failed)
        self._errors = 0            # failed cycles
        self._last_error: BaseException | None = None
        self._failing = False
        self.flush_seconds = Histogram(FLUSH_SECONDS_BUCKETS)
        self.flush_pages = Histogram(FLUSH_PAGES_BUCKETS)
        self.flushes = 0
        self.flushed_pages = 0
        self._cycle_pages = 0       # pages / rewritten pages committed by this cycle
        self._cycle_rewritten = 0
        self._thread = threading.Thread(target=self._run, name=f"durablekv-batcher[{name}]",
                                        daemon=True)

    # -- control -------------------------------------------------------------------

    def start(self) -> None:
        start_thread(self._thread)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def errors(self) -> int:
        return self._errors

    @property
    def last_error(self) -> BaseException | None:
        return self._last_error

    @property
    def failing(self) -> bool:
        """True while the latest cycle failed (cleared by the next success)."""
        return self._failing

    def kick(self, urgent: bool = False, retry: bool = False) -> None:
        """Ask for a cycle (cheap when one is already asked for).

        A plain kick waits out the duty-cycle pause; ``urgent`` (back-pressure)
        does not. While the store is failing, cycles wait out the back-off;
        ``retry`` asks for one attempt now (a caller that starts to wait:
        :meth:`flush_until`, back-pressure), once per request."""
        if retry:
            self._retry_now = True
        if urgent or retry:
            self._urgent = True
        elif self._cooling:
            return
        if not self._wake.is_set():
            self._wake.set()

    def stop(self) -> None:
        """Stop the thread after its current cycle (does not flush; see flush_until)."""
        with self._cond:
            self._stop = True
        self._wake.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            join_thread(self._thread)

    def flush_until(self, lsn: int, timeout: float | None = None) -> None:
        """Block until every change with LSN <= ``lsn`` is committed to SQLite.

        :param timeout: seconds to keep waiting through failed, retried cycles;
            None waits for success or for the first failure.
        :raises WriteBehindError: (``timeout`` None) a cycle failed.
        :raises FlushTimeoutError: (``timeout`` given) not done in time.
        :raises LogFileGoneError: the commit is done, but the log's active
            segment was deleted while open (see ``ReplayLog.gone``).
        """
        monotonic = _REAL[0]
        deadline = None if timeout is None else monotonic() + timeout
        with self._cond:
            errors_at_start = self._errors
            if self._durable_lsn < lsn:
                self._retry_now = True  # one attempt at once; then the back-off
            while self._durable_lsn < lsn:
                if self._stop or not self._thread.is_alive():
                    raise WriteBehindError(self._path, self._last_error,
                                           f"write-behind thread of {self._path!r} is not running; "
                                           "the cache is closed or failed")
                if deadline is None and self._errors > errors_at_start:
                    raise WriteBehindError(self._path, self._last_error) from self._last_error
                remaining = None
                if deadline is not None:
                    remaining = deadline - monotonic()
                    if remaining <= 0:
                        raise FlushTimeoutError(self._path, timeout, self._last_error)
                self._urgent = True
                self._wake.set()
                self._cond.wait(remaining)
        gone = getattr(self._log, "gone", None)
        if gone is not None:
            # committed, but the log lost its active segment: say so at every flush
            raise gone

    def cycle_once(self, timeout: float | None = None) -> None:
        """Block until a whole cycle that began after this call has run (for
        work that is not an LSN to wait for: eviction down to a size limit).

        :raises WriteBehindError: that cycle failed, or the thread is not running.
        :raises FlushTimeoutError: not done within ``timeout`` seconds.
        """
        monotonic = _REAL[0]
        deadline = None if timeout is None else monotonic() + timeout
        with self._cond:
            target = self._cycles + 2  # a cycle running now may have begun before this call
            errors_at_start = self._errors
            while self._cycles < target:
                if self._stop or not self._thread.is_alive():
                    raise WriteBehindError(self._path, self._last_error,
                                           f"write-behind thread of {self._path!r} is not running; "
                                           "the cache is closed or failed")
                if self._errors > errors_at_start:
                    raise WriteBehindError(self._path, self._last_error) from self._last_error
                remaining = None
                if deadline is not None:
                    remaining = deadline - monotonic()
                    if remaining <= 0:
                        raise FlushTimeoutError(self._path, timeout, self._last_error)
                self._urgent = True
                self._retry_now = True
                self._wake.set()
                self._cond.wait(remaining)

    # -- the thread ----------------------------------------------------------------

    def _run(self) -> None:
        backoff = 0.0
        monotonic = _REAL[0]
        next_flush = last_sync = retry_at = 0.0
        while True:
            wait = self._interval
            if backoff:
                wait = min(wait, max(0.0, retry_at - monotonic()))
            self._wake.wait(wait)
            self._wake.clear()
            with self._cond:
                stopping = self._stop
            if stopping:
                return
            retrying = backoff and monotonic() < retry_at and not self._retry_now
            if not retrying:
                self._retry_now = False
                urgent, self._urgent = self._urgent, False
            if retrying or (not urgent and not backoff and monotonic() < next_flush):
                # A pause: the duty cycle's, or a failing store's back-off,
                # which a wake-up (a flush() or a writer waiting, a kick) does
                # not cut short; its urgency waits for the retry. Pages wait;
                # the log is still fsynced on time.
                self._cooling = not retrying
                # (A wake right after a cycle, which has just synced, skips it.)
                if self._log is not None and self._sync_log and \
                        monotonic() - last_sync >= self._interval / 2:
                    last_sync = monotonic()
                    try:
                        self._log.sync()
                    except (OSError, LogFileGoneError) as exc:  # (the next cycle raises it)
                        log.error("fsync of the replay log of %s failed: %r", self._path, exc)
                continue
            self._cooling = False
            started = last_sync = monotonic()
            self._cycle_pages = self._cycle_rewritten = 0
            try:
                self._source.background_work()
                self._cycle()
                next_flush = monotonic() + self.pause_after(monotonic() - started)
            except BaseException as exc:  # noqa: BLE001 - reported to flush() callers
                with self._cond:
                    self._errors += 1
                    self._last_error = exc
                    self._failing = True
                    self._cycles += 1
                    self._cond.notify_all()
                backoff = min(max(backoff * 2, min(self._interval, self._max_backoff), 0.01),
                              self._max_backoff)
                retry_at = monotonic() + backoff
                log.warning("write-behind flush of %s failed (retrying in %.3f s): %r",
                            self._path, backoff, exc)
            else:
                backoff = 0.0
                with self._cond:
                    self._failing = False
                    self._cycles += 1
                    self._cond.notify_all()

    def pause_after(self, seconds: float) -> float:
        """Seconds the next unrequested cycle waits after a cycle that took
        ``seconds`` (the duty cycle, in proportion to the rewritten pages)."""
        if not self._cycle_pages:
            return self._duty_ratio * seconds
        return self._duty_ratio * seconds * self._cycle_rewritten / self._cycle_pages

    def run_cycle(self) -> None:
        """Run one cycle in the calling thread (for tests and open-time recovery,
        only while the thread is not running)."""
        self._cycle()

    def _cycle(self) -> None:
        gone: LogFileGoneError | None = None
        if self._log is not None and self._sync_log:
            try:
                self._log.sync()
            except LogFileGoneError as exc:
                # The store is now the only durable copy of what memory
                # holds: commit it, then report the loss of the log.
                gone = exc
        self._cycle_commit()
        if gone is not None:
            raise gone

    def _cycle_commit(self) -> None:
        snap = self._source.take_snapshot()
        if snap is None:
            return
        try:
            self._commit(snap, None, frozenset())
        except BaseException as exc:
            if snap.size < 2 or not _may_be_one_page(exc):
                self._source.flush_failed(snap)
                raise
            left = set(range(snap.size))
            failed = self._isolate(snap, list(range(snap.size)), left)
            waiting = [i for i, e in failed if isinstance(e, HeldKeyError)]
            if waiting:
                # Pages that waited for a page the halving had not tried yet:
                # once more, now that every page that can be stored is.
                failed = [f for f in failed if not isinstance(f[1], HeldKeyError)]
                failed = sorted(failed + self._isolate(snap, waiting, left))
            if failed:
                self._source.flush_failed(snap, [i for i, _ in failed])
                # the cause, not a page that only waits for the failing one
                first = next((e for _, e in failed if not isinstance(e, HeldKeyError)),
                             failed[0][1])
                pages = [snap.page_id(i) for i, _ in failed]
                raise WriteBehindError(
                    self._path, first,
                    f"write-behind flush to {self._path!r} cannot store page(s) {pages} "
                    f"({first!r}); every other page was written, these stay in memory and "
                    "are retried") from first

    def _commit(self, snap: Any, indices: list[int] | None, uncommitted: Any) -> None:
        """Write ``indices`` of ``snap`` (all when None) in one transaction."""
        batch = snap.build(indices, uncommitted)
        added: list = []
        bounded = batch.size_limit is not None
        if batch.images or batch.clear or batch.checkpoint_lsn > self._store.checkpoint_lsn or \
                (batch.ttl_clock is not None and batch.ttl_clock != self._store.ttl_clock) or \
                (bounded and (batch.left_pages or self._store.data_bytes > batch.size_limit)):
            t0 = _REAL[1]()
            # (the size_limit arguments only when set: a store may predate them)
            extra = ({"size_limit": batch.size_limit, "keep_pages": batch.keep_pages,
                      "left_pages": batch.left_pages} if bounded else {})
            added = self._store.write_batch(batch.images, batch.checkpoint_lsn, batch.key_count,
                                            batch.ttl_key_count, batch.clear,
                                            held_pages=batch.held_pages,
                                            ttl_clock=batch.ttl_clock, **extra)
            dt = _REAL[1]() - t0
            self.flush_seconds.observe(dt)
            self.flush_pages.observe(len(batch.images))
            self.flushes += 1
            self.flushed_pages += len(batch.images)
            self._cycle_pages += len(batch.images)
            self._cycle_rewritten += batch.rewritten
        self._source.flush_done(snap, indices, added)
        with self._cond:
            self._durable_lsn = max(self._durable_lsn, self._store.checkpoint_lsn)
        if self._log is not None:
            # The checkpoint is committed with synchronous=FULL: durable.
            self._log.truncate_through(self._store.checkpoint_lsn)

    def _isolate(self, snap: Any, indices: list[int], left: set[int]) -> list[tuple[int, BaseException]]:
        """Commit ``indices`` in halves; return ``(index, error)`` of pages that fail alone."""
        try:
            self._commit(snap, indices, left - set(indices))
        except BaseException as exc:  # noqa: BLE001 - narrowed down below
            if len(indices) == 1 or not _may_be_one_page(exc):
                return [(i, exc) for i in indices]
            mid = len(indices) // 2
            return (self._isolate(snap, indices[:mid], left)
                    + self._isolate(snap, indices[mid:], left))
        left.difference_update(indices)
        return []


_WHOLE_STORE = ("locked", "busy", "full", "disk i/o", "readonly", "read-only",
                "unable to open", "interrupted", "no such table", "malformed")


def _may_be_one_page(exc: BaseException) -> bool:
    """Whether a failed flush might be caused by one page's data (worth
    isolating) rather than by the database as a whole (worth retrying)."""
    text = f"{exc} {exc.__cause__ or ''}".lower()
    return not any(word in text for word in _WHOLE_STORE)
