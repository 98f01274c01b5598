"""One open :class:`~durablekv.Cache` per directory per process, shared by
every framework backend instance that names the directory.

Frameworks make backend instances freely: Django one per alias per thread,
Flask-Caching one per app, aiocache one per ``@cached`` decorator, a script
beside them one more. A durablekv directory is owned by one open Cache (its
lock refuses a second, in this process or another), so the backends share:
:func:`open_shared` returns the Location of a directory, opening it the first
time, and every later caller with the same options gets the same Cache. A
second *process* still gets :class:`~durablekv.errors.CacheLockedError`,
with the integration's advice added.

Tests (Django's among them) delete a cache directory under a live backend.
That is noticed: :meth:`Location.alive` compares the directory's inode with
the one opened, a backend whose Location is no longer alive asks for a new
one (a new, empty Cache), and what the old Cache logs about its vanished
files is dropped by a filter on durablekv's loggers, only for directories
that were deleted this way.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import re
import threading
from typing import Any, Callable

from ..cache import Cache
from ..errors import CacheLockedError

__all__ = ["Location", "open_shared", "close_all", "make_private_dirs", "check_options",
           "delete_some"]


class Location:
    """One open Cache on a directory, shared in this process.

    :ivar path: the directory (absolute).
    :ivar options: the Cache's keyword arguments.
    :ivar cache: the open :class:`~durablekv.Cache`.
    :ivar lock: a lock for a backend's read-compare-write steps.
    """

    def __init__(self, path: str, options: dict[str, Any]) -> None:
        self.path = path
        self.options = options
        make_private_dirs(path)
        st = os.stat(path)
        self.ident = (st.st_dev, st.st_ino)
        self.cache = Cache(path, **options)
        #: for the few read-compare-write steps a backend needs beyond the
        #: Cache's own atomic operations (aiocache's compare-and-set)
        self.lock = threading.Lock()
        self._async: Any = None
        self._async_lock = threading.Lock()

    def alive(self) -> bool:
        """The directory this Cache opened is still there (not deleted or
        replaced) and the Cache is open."""
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return False
        return (st.st_dev, st.st_ino) == self.ident and not self.cache.closed

    def aio(self) -> Any:
        """An :class:`~durablekv.aio.AsyncCache` over the shared Cache (made once)."""
        if self._async is None:
            with self._async_lock:
                if self._async is None:
                    from ..aio import AsyncCache
                    self._async = AsyncCache.wrap(self.cache)
        return self._async

    def close(self) -> None:
        """Flush and close (errors about a deleted directory are the filter's
        to drop; the Cache is closed either way)."""
        if self._async is not None:
            self._async._executor.shutdown(wait=False)
        with contextlib.suppress(Exception):
            self.cache.close()


_locations: dict[str, Location] = {}
_locations_lock = threading.Lock()
#: directories deleted under their Cache: what their Caches log is dropped
#: (until a new Cache opens there)
_gone: set[str] = set()


def _mentions(text: str, path: str) -> bool:
    """``text`` names ``path`` or a file in it ("/a/b" is not in "/a/bc")."""
    return re.search(re.escape(path) + r"(?![\w.-])", text) is not None


class _DeletedLocationFilter(logging.Filter):
    """Drops durablekv's log records about a shared directory that was deleted
    under its Cache, and has that Cache closed off the thread that logged.
    Records about any other cache pass."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not _locations and not _gone:
            return True
        try:
            text = record.getMessage()
        except Exception:       # a record that does not format: not ours to judge
            return True
        if getattr(record, "_durablekv_rechecked", False):
            return True
        if any(_mentions(text, path) for path in list(_gone)):
            return False
        named = [loc for loc in list(_locations.values()) if _mentions(text, loc.path)]
        if any(not loc.alive() for loc in named):
            threading.Thread(target=_reap, name="durablekv-contrib-reap", daemon=True).start()
            return False
        if named and record.levelno >= logging.WARNING:
            # The directory may be going right now (rmtree takes the files
            # first): say it only if the directory is still there in a moment.
            timer = threading.Timer(RECHECK_SECONDS, _recheck, (record, named))
            timer.daemon = True
            timer.start()
            return False
        return True


#: how long a warning about a shared directory waits, in case it is being deleted
RECHECK_SECONDS = 0.5


def _recheck(record: logging.LogRecord, named: list["Location"]) -> None:
    """Emit a held warning unless its directory was deleted meanwhile."""
    if any(not loc.alive() for loc in named):
        _reap()
        return
    record._durablekv_rechecked = True
    logging.getLogger(record.name).handle(record)


_LOGGERS = ("durablekv", "durablekv.batcher", "durablekv.replaylog", "durablekv.store",
            "durablekv.lifecycle")
_filter = _DeletedLocationFilter()
for _name in _LOGGERS:
    logging.getLogger(_name).addFilter(_filter)


def _reap() -> None:
    """Close the Caches of directories that are gone."""
    with _locations_lock:
        dead = [(path, loc) for path, loc in _locations.items() if not loc.alive()]
        for path, _loc in dead:
            del _locations[path]
            _gone.add(path)
    for _path, loc in dead:
        loc.close()


def open_shared(directory: Any, options: dict[str, Any], *,
                mismatch: Callable[[str, dict, dict], Exception],
                locked_hint: str = "") -> Location:
    """The shared Location of ``directory`` (opened, or reopened when the
    directory was deleted or replaced).

    :param options: keyword arguments of :class:`~durablekv.Cache`.
    :param mismatch: builds the error raised when the directory is open with
        other options: ``mismatch(path, open_options, asked_options)``.
    :param locked_hint: words added to a :class:`CacheLockedError` (another
        process owns the directory): what to do, for this integration.
    :raises CacheLockedError: another process owns the directory.
    :raises ConfigError, TypeError: bad options (from :class:`~durablekv.Cache`).
    """
    path = os.path.abspath(os.fspath(directory))
    _reap()     # a deleted directory's Cache goes before it says so again
    with _locations_lock:
        loc = _locations.get(path)
        if loc is not None:
            if loc.alive():
                if loc.options != options:
                    raise mismatch(path, loc.options, options)
                return loc
            del _locations[path]
            loc.close()
        try:
            loc = _locations[path] = Location(path, options)
        except CacheLockedError as exc:
            if locked_hint:
                exc.args = (f"{exc}; {locked_hint}",)
            raise
        _gone.discard(path)
        return loc


def close_all() -> None:
    """Flush and close every shared Cache of this process (also run at exit).
    A backend used afterwards opens its directory again."""
    with _locations_lock:
        locs = list(_locations.values())
        _locations.clear()
        _gone.update(loc.path for loc in locs if not loc.alive())
    for loc in locs:
        loc.close()


atexit.register(close_all)


def make_private_dirs(path: str) -> None:
    """Create ``path`` and its missing parents, each 0700 (other users must
    not read what a cache holds: pickles, HTTP responses)."""
    missing = []
    p = path
    while not os.path.isdir(p):
        missing.append(p)
        parent = os.path.dirname(p)
        if parent == p:
            break
        p = parent
    for d in reversed(missing):
        with contextlib.suppress(FileExistsError):
            os.mkdir(d, 0o700)
            os.chmod(d, 0o700)      # whatever the umask


def check_options(owner: str, options: dict[str, Any], own: tuple[str, ...] = ()) -> None:
    """Refuse, when a backend is built, keyword arguments neither it nor
    :class:`~durablekv.Cache` takes (a backend opens its Cache lazily, so the
    Cache's own check would come only at the first operation).

    :raises TypeError: as Python's own, with the option probably meant.
    """
    import inspect

    from ..config import unknown_options

    known = {p for p in inspect.signature(Cache.__init__).parameters if p != "self"}
    known.discard("directory")
    unknown = {k: v for k, v in options.items() if k not in known}
    if unknown:
        raise unknown_options(owner, unknown, known | set(own))


def delete_some(cache: Cache, n: int) -> None:
    """Delete ``n`` entries of ``cache`` (the first its iteration yields): the
    culling of frameworks whose rule is a count, not an order."""
    doomed = []
    if n > 0:
        for key in cache:
            doomed.append(key)
            if len(doomed) >= n:
                break
    for key in doomed:
        cache.delete(key)
