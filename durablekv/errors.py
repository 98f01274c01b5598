"""The durablekv exception tree.

Every error a user can meet is one of these classes. Each subclass also inherits
the built-in exception it resembles, so code written for a dict or for the
standard library keeps working (``except ValueError`` catches a bad ``expire``
and a closed cache alike)::

    DurableKVError (Exception)
     ├── CacheLockedError        the directory is open in another process
     │    └── NamespaceLockedError  a PostgreSQL namespace has another owner
     ├── CacheClosedError        (ValueError) use after close()
     ├── CacheNotOpenError       (RuntimeError) an AsyncCache used before it was opened
     ├── CacheFailedError        (RuntimeError) fail-stop after a write error
     ├── ConfigError             (ValueError) bad or conflicting settings
     ├── StoreError              problems with pages.sqlite3
     │    ├── CorruptStoreError  the file is not a readable durablekv store
     │    ├── SchemaVersionError the file was written by a newer durablekv
     │    └── HeldKeyError       a page waits for a failing page (flush cause)
     ├── LogError                problems with the replay log
     │    ├── LogCorruptionError a damaged record before the log's tail
     │    ├── LogFileGoneError   the active segment was deleted while open
     │    └── LogWriteError      (OSError) an append or fsync failed
     ├── WriteBehindError        a background flush to SQLite failed
     │    └── FlushTimeoutError  (TimeoutError) flush(timeout=...) ran out
     ├── TraceFormatError        (ValueError) a trace file could not be read
     └── MetricsServeError       (OSError) metrics.serve() could not listen

Context (``path``, ``offset``, ``lsn``, ``pid`` ...) is kept as attributes and
rendered in the message, which says what happened, where, and what to do.
"""

from __future__ import annotations

import errno
import os
import shlex

__all__ = [
    "DurableKVError",
    "CacheLockedError",
    "NamespaceLockedError",
    "CacheClosedError",
    "CacheNotOpenError",
    "CacheFailedError",
    "ConfigError",
    "StoreError",
    "CorruptStoreError",
    "SchemaVersionError",
    "HeldKeyError",
    "LogError",
    "LogCorruptionError",
    "LogFileGoneError",
    "LogWriteError",
    "WriteBehindError",
    "FlushTimeoutError",
    "TraceFormatError",
    "MetricsServeError",
]


class DurableKVError(Exception):
    """Root of every error raised by durablekv.

    Every subclass pickles and unpickles as itself, with its message and
    attributes, though most take other arguments than their message: an
    error raised in a ``multiprocessing`` or ``concurrent.futures`` worker
    reaches the parent as what it is (pickle calls ``cls(*args)`` by
    default, which those ``__init__`` signatures refuse).
    """

    def __reduce__(self) -> tuple:
        return _rebuild_error, (type(self), self.args, self.__dict__)


def _rebuild_error(cls: type, args: tuple, state: dict) -> BaseException:
    """An unpickled :class:`DurableKVError`: made without its ``__init__``."""
    exc = cls.__new__(cls, *args)
    exc.args = args
    exc.__dict__.update(state)
    return exc


class CacheLockedError(DurableKVError):
    """The cache directory is already open (in this or another process).

    :ivar path: the directory.
    :ivar pid: the owner's process id, or None when it could not be read.
    """

    def __init__(self, path: str, pid: int | None) -> None:
        self.path = path
        self.pid = pid
        if pid is not None and pid == os.getpid():
            super().__init__(
                f"cache directory {path!r} is already open in this process ({pid}), by another "
                "Cache object that was not closed (a Cache dropped without close() stays "
                "open until the process exits); close() that one first, or use "
                "'with Cache(...)' so that it closes itself"
            )
            return
        owner = f"process {pid}" if pid else "another process"
        super().__init__(
            f"cache directory {path!r} is already open in {owner}; "
            "close it there first, or open a different directory "
            "(one process owns a cache directory at a time)"
        )


class NamespaceLockedError(CacheLockedError):
    """A PostgreSQL store's namespace is owned by another session (its
    advisory lock is held).

    :ivar where: the server, without the password.
    :ivar namespace: the namespace.
    :ivar owner: the owning session as PostgreSQL reports it, or None.
    """

    def __init__(self, where: str, namespace: str, owner: str | None) -> None:
        self.path = where
        self.pid = None
        self.where = where
        self.namespace = namespace
        self.owner = owner
        DurableKVError.__init__(
            self, f"namespace {namespace!r} on {where} is already owned by "
            f"{owner or 'another session'}; close that cache first, or use another "
            "namespace (one cache owns a namespace at a time; a dead owner's lock ends "
            "with its database session)")


class CacheClosedError(DurableKVError, ValueError):
    """An operation was attempted on a cache that has been closed."""

    def __init__(self, path: str, forked: bool = False) -> None:
        self.path = path
        if forked:
            msg = (f"cache {path!r} was opened by the parent process and cannot be used "
                   "after fork(); the parent still owns it. A forked child must not open "
                   "a Cache (or any SQLite database) before it execs: start workers with "
                   "multiprocessing's 'spawn' or 'forkserver' method and open the cache there")
        else:
            msg = f"cache {path!r} is closed; open a new Cache({path!r}) to use it again"
        super().__init__(msg)


class CacheNotOpenError(DurableKVError, RuntimeError):
    """An :class:`~durablekv.aio.AsyncCache` was used before it was opened
    (or after its open failed). A ``RuntimeError``, as it was before it had
    a class of its own.

    :ivar path: the cache directory it was made for (None: a temporary one).
    """

    def __init__(self, path: str | None) -> None:
        self.path = path
        where = repr(path) if path is not None else "(a temporary directory)"
        super().__init__(
            f"AsyncCache {where} is not open; use 'async with AsyncCache(...) as cache:', "
            "or 'await cache.open()' before the first call")


class CacheFailedError(DurableKVError, RuntimeError):
    """The cache stopped accepting writes after an error it could not undo.

    Raised on every write after the failure (fail-stop) so that nothing is
    acknowledged that recovery could not rebuild. Close and reopen the cache;
    recovery replays the log.
    """

    def __init__(self, path: str, cause: BaseException) -> None:
        self.path = path
        self.cause = cause
        super().__init__(
            f"cache {path!r} has failed and accepts no more writes "
            f"(cause: {cause!r}); close it and reopen the directory to recover"
        )


class ConfigError(DurableKVError, ValueError):
    """A setting is invalid or conflicts with what is stored on disk."""


class StoreError(DurableKVError):
    """A problem with the SQLite page store (``pages.sqlite3``)."""

    def __init__(self, message: str, path: str | None = None) -> None:
        self.path = path
        super().__init__(message)


class HeldKeyError(StoreError):
    """A write-behind commit left out a page that must go with it.

    Raised inside the write-behind while it isolates a page that fails to
    store: a key moved from that page to another, and the other page cannot
    be stored alone (the failing page's stored image still holds the key).
    Both pages stay in memory and are retried; callers see it only as the
    cause inside a :class:`WriteBehindError`.
    """


class CorruptStoreError(StoreError):
    """``pages.sqlite3`` is damaged or is not a durablekv store."""

    def __init__(self, path: str, detail: str) -> None:
        super().__init__(
            f"page store {path!r} is damaged or not a durablekv store ({detail}); "
            "close the cache and open it with on_corruption='rebuild' to move the file aside and start empty "
            "(the replay log is still applied), or restore it from a backup",
            path,
        )
        self.detail = detail


class SchemaVersionError(StoreError):
    """The store was written by a newer version of durablekv."""

    def __init__(self, path: str, found: int, supported: int) -> None:
        super().__init__(
            f"page store {path!r} has schema version {found}, but this durablekv "
            f"supports up to {supported}; upgrade durablekv to open it",
            path,
        )
        self.found = found
        self.supported = supported


class LogError(DurableKVError):
    """A problem with the replay log."""


class LogFileGoneError(LogError):
    """The active replay log segment was deleted or replaced while the cache
    was open (found at the next fsync of the log or segment roll).

    :ivar path: the segment.
    """

    def __init__(self, path: str, message: str) -> None:
        self.path = path
        super().__init__(message)


class LogCorruptionError(LogError):
    """A damaged record was found before the tail of the replay log.

    A damaged record at the very end (a torn write) is repaired silently; one
    followed by more data is not, because skipping it could drop acknowledged
    writes.

    :ivar path: the log segment.
    :ivar offset: byte offset of the damaged record in that file.
    """

    def __init__(self, path: str, offset: int, detail: str) -> None:
        self.path = path
        self.offset = offset
        self.detail = detail
        super().__init__(
            f"replay log {path!r} is damaged at byte offset {offset} ({detail}); "
            "records after it cannot be trusted. Open with salvage_log=True (or run "
            f"`durablekv salvage {shlex.quote(os.path.dirname(path) or '.')}`) to keep the records "
            "before the damage and move the file aside, losing the records from there on, "
            "or restore the directory from a backup"
        )


class LogWriteError(LogError, OSError):
    """Appending to or fsyncing the replay log failed; the write was not acknowledged."""

    def __init__(self, path: str, cause: OSError, *, during_write: bool = True) -> None:
        self.path = path
        self.cause = cause
        if during_write:
            what = (f"could not append to replay log {path!r}: {cause.strerror or cause}; "
                    "the write was NOT stored")
        else:  # opening: no write was attempted
            what = (f"could not create replay log segment {path!r} while opening the cache: "
                    f"{cause.strerror or cause}; no write was attempted, and the cache did "
                    "not open")
        OSError.__init__(
            self,
            cause.errno,
            f"{what}. Free disk space or fix the file system (permissions, a read-only "
            "or immutable directory), then retry",
        )

    def __str__(self) -> str:
        return str(self.args[1])


class WriteBehindError(DurableKVError):
    """A background flush of dirty pages to SQLite failed.

    The pages stay dirty in memory and are retried; nothing acknowledged is lost
    while the process lives (and the replay log covers a crash).
    """

    def __init__(self, path: str, cause: BaseException | None, message: str | None = None) -> None:
        self.path = path
        self.cause = cause
        super().__init__(
            message
            or (
                f"write-behind flush to {path!r} failed: {cause!r}; the pages stay "
                f"dirty in memory and are retried. {_FLUSH_FIX}"
            )
        )

    @classmethod
    def at_close(cls, path: str, cause: BaseException | None,
                 durability: str) -> "WriteBehindError":
        """The error ``close()`` raises when its final flush fails: nothing
        is retried after close, so it says what the next open finds."""
        if durability == "none":
            fate = "the writes it had not stored are lost (durability='none' keeps no replay log)"
        else:
            fate = "its replay log is kept, and the next open replays every acknowledged write"
        return cls(path, cause, f"close(): the final flush to {path!r} failed: {cause!r}; the "
                                f"cache is closed and {fate}. {_FLUSH_FIX}")


_FLUSH_FIX = "Check disk space and whether another process holds a lock on the store"


class FlushTimeoutError(WriteBehindError, TimeoutError):
    """``flush(timeout=...)`` ran out before every acknowledged write was in SQLite."""

    def __init__(self, path: str, timeout: float, cause: BaseException | None = None) -> None:
        extra = f" (last flush error: {cause!r})" if cause is not None else ""
        super().__init__(
            path,
            cause,
            f"flush of {path!r} did not finish within {timeout} s{extra}; the writes "
            "are still pending in memory and will be written when the store accepts them",
        )
        self.timeout = timeout


class TraceFormatError(DurableKVError, ValueError):
    """A trace file is malformed or of an unknown format.

    :ivar path: the trace file.
    :ivar line: 1-based line (text formats) or record number (binary), or None.
    :ivar format_given: the format was named (``--format``), not detected: the
        message then does not suggest naming one.
    :ivar about_format: False for a well-formed request the replay cannot
        take (a value over ``max_value_bytes``): no advice on formats.
    """

    def __init__(self, path: str, line: int | None, detail: str,
                 format_given: bool = False, about_format: bool = True) -> None:
        self.path = path
        self.line = line
        self.detail = detail
        self.format_given = format_given
        self.about_format = about_format
        where = f"{path}:{line}" if line is not None else path
        if not about_format:
            super().__init__(f"{where}: {detail}")
            return
        fix = ("check that the file is in the format --format names"
               if format_given else "or pass --format explicitly")
        super().__init__(
            f"{where}: {detail}; see `durablekv replay --help` for the supported "
            f"formats, {fix}"
        )


class MetricsServeError(DurableKVError, OSError):
    """:func:`durablekv.metrics.serve` could not listen on its address and port.

    An ``OSError`` (``errno`` is the cause's), so ``except OSError`` still
    catches it; the cause is chained and kept.

    :ivar addr: the address it tried to bind.
    :ivar port: the TCP port it tried to bind.
    :ivar cause: the ``OSError`` from binding.
    """

    def __init__(self, addr: str, port: int, cause: OSError) -> None:
        self.addr = addr
        self.port = port
        self.cause = cause
        host = f"[{addr}]" if ":" in addr else addr
        if cause.errno == errno.EADDRINUSE:
            fix = ("the port is taken (by another program, or by a server not closed yet); "
                   "pick another port (port=0 picks a free one)")
        elif cause.errno == errno.EACCES:
            fix = ("binding this port needs privileges (ports below 1024 do); "
                   "pick another port (port=0 picks a free one)")
        else:
            fix = ("check that addr= is an address of this machine (the default, "
                   "'127.0.0.1', serves loopback only), or pick another port (port=0 "
                   "picks a free one)")
        OSError.__init__(
            self,
            cause.errno,
            f"cannot serve metrics on {host}:{port}: {cause.strerror or cause}; {fix}",
        )

    def __str__(self) -> str:
        return str(self.args[1])


# -- the HTTP client (durablekv.client) ----------------------------------------
# Drawn here rather than in the tree above so that the tree's other classes
# stay where they were:
#
#   DurableKVError
#    └── RemoteError              the server answered an error (status, error, detail)
#         ├── RemoteAuthError     (PermissionError) 401: missing or wrong token
#         ├── RemoteValueError    (ValueError) 400/413/414/422: bad key, value, ttl
#         ├── RemoteTypeError     (TypeError) 409: incr on a value that is not an int
#         └── ServerUnavailableError (ConnectionError) no answer (refused, timed out)

__all__ += ["RemoteError", "RemoteAuthError", "RemoteValueError", "RemoteTypeError",
            "ServerUnavailableError"]


class RemoteError(DurableKVError):
    """A durablekv server answered with an error.

    :ivar status: the HTTP status (0 when there was no answer).
    :ivar error: the server's short error name.
    :ivar detail: the server's explanation.
    :ivar url: the request's URL.
    """

    def __init__(self, status: int, error: str, detail: str, url: str = "") -> None:
        self.status = status
        self.error = error
        self.detail = detail
        self.url = url
        where = f" ({url})" if url else ""
        super().__init__(f"server answered {status} {error}: {detail}{where}" if status
                         else f"{error}: {detail}{where}")


class RemoteAuthError(RemoteError, PermissionError):
    """401: the server needs ``token=`` (its ``--token-file`` or
    ``DURABLEKV_TOKEN``), or the one given is wrong."""


class RemoteValueError(RemoteError, ValueError):
    """400, 413, 414 or 422: a bad key, value or ttl (as ``ValueError`` in the library)."""


class RemoteTypeError(RemoteError, TypeError):
    """409: ``incr`` on a value that is not an int (as ``TypeError`` in the library)."""


class ServerUnavailableError(RemoteError, ConnectionError):
    """No answer from the server: refused, reset or timed out. A write that
    got this may or may not have been applied."""
