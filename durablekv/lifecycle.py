"""Lifecycle support: teardown, the exit-time safety net, forks, copy refusal.

:class:`Lifecycle` (mixed into :class:`~durablekv.cache.Cache`). ``close()``
and ``flush()`` stay in the facade; the teardown they share is here. The
``atexit`` drain over open caches is a safety net, documented as such; a
forked child retires every inherited cache without touching its files.
"""

from __future__ import annotations

import logging
import atexit
import os
import shutil
import threading
import warnings
import weakref
from types import BuiltinFunctionType
from typing import Any, TYPE_CHECKING

from .config import _CLOSED, _CLOSING, _FORKED
from .dirlock import _release_dir_lock
from .errors import StoreError

if TYPE_CHECKING:
    from .cache import Cache

log = logging.getLogger("durablekv")


_open_caches: "weakref.WeakValueDictionary[int, Cache]" = weakref.WeakValueDictionary()


def _close_all_at_exit() -> None:
    """Safety net: drain caches the application forgot to close."""
    for cache in list(_open_caches.values()):
        try:
            cache.close()
        except Exception as exc:  # pragma: no cover - reported, not raised at exit
            log.error("closing %s at exit failed: %r", cache.path, exc)


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


def remove_tree(path: str) -> None:
    """``shutil.rmtree(path, ignore_errors=True)``, finished even when an
    exception from a signal handler (Ctrl-C; SIGTERM in ``durablekv
    replay``) cuts it short; the exception then propagates. Cut short, it
    left the rest of the directory behind."""
    try:
        shutil.rmtree(path, ignore_errors=True)
    except BaseException:
        shutil.rmtree(path, ignore_errors=True)
        raise


class Lifecycle:
    """Teardown, fork retirement and copy refusal."""

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
        self._drop_fast_paths()
        for part in (self._store, self._log, self._batcher):
            if part is not None:
                _immortal(part)
        self._store = self._log = self._batcher = None
        self._fast.log = None
        self._lock_fd = None

    def _drop_fast_paths(self) -> None:
        """Drop the C ``get`` and ``set`` that open installed on the instance
        (see Cache.__init__): they hold the cache, so this ends the cycle,
        and a later call is the Python method, which raises. An attribute
        the user set there (a test's monkeypatch) is theirs and stays."""
        d = self.__dict__
        for name in ("get", "set"):
            fn = d.get(name)
            if type(fn) is BuiltinFunctionType and \
                    type(fn.__self__).__module__ == "durablekv._native":
                del d[name]

    def _remove_if_temporary(self) -> None:
        """Remove the temporary directory of ``Cache()`` (no directory given)."""
        if self._temporary:
            remove_tree(self.path)

    def _teardown(self, clean: bool) -> None:
        if _open_caches.get(id(self)) is self:
            del _open_caches[id(self)]
        try:
            self._teardown_threads(clean)
        except BaseException:
            # An exception from a signal handler (Ctrl-C; SIGTERM in
            # `durablekv replay`) cut the steps above short: the threads have
            # ended (join_thread), and what is left is released all the same,
            # keeping the log (the next open replays what it must). Before,
            # the cache stayed "closing" with its directory locked for good.
            clean = False
            raise
        finally:
            try:
                if self._log is not None:
                    self._log.close(remove=clean)
                    if not clean and self._store is not None and \
                            self._store.checkpoint_lsn >= self._last_lsn and \
                            hasattr(self._log, "forget_control"):
                        # The store holds every record (a log deleted while
                        # open, whose loss the write-behind made up for):
                        # the next open must not look for them.
                        self._log.forget_control()
            finally:
                try:
                    if self._store is not None:
                        self._store.close(checkpoint_wal=clean)
                finally:
                    if self._lock_fd is not None:
                        _release_dir_lock(self._lock_fd)
                        self._lock_fd = None
                    self._state = _CLOSED
                    # The C memory hit and overwrite hold the cache (see
                    # Cache.__init__): dropping them ends that cycle, and a
                    # later call is the Python one, which raises.
                    self._drop_fast_paths()

    def _teardown_threads(self, clean: bool) -> None:
        """:meth:`_teardown`'s first steps: stop the preload and the
        write-behind, and (``clean``) store what they leave."""
        self._warm_stop()  # the state is no longer open: it stops at its next batch
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
        if clean:
            self._residency_at_close()  # the warm restart's list (a hint; never raises)

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

    def __del__(self) -> None:
        if getattr(self, "_state", _CLOSED) not in (_CLOSED, _CLOSING, _FORKED):
            warnings.warn(f"durablekv cache {getattr(self, 'path', '?')!r} was not closed; "
                          "use close() or a with-block (it is drained at exit)",
                          ResourceWarning, stacklevel=2)


atexit.register(_close_all_at_exit)

if hasattr(os, "register_at_fork"):
    import ctypes  # noqa: F401 - loaded now: a child must not dlopen after fork
    os.register_at_fork(after_in_child=_after_fork_in_child)
