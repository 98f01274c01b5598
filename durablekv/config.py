"""Settings, limits, shared sentinels and the argument checks of :class:`~durablekv.cache.Cache`.

Pure functions with no state: each check raises the library error that names
the bad value and the fix (see :mod:`durablekv.errors`). The facade calls
them before it touches the disk, so a refused setting leaves nothing behind.
"""

from __future__ import annotations

import math
import os
import secrets
import struct
import tempfile
import time
from numbers import Number
from typing import Any, Iterable

from . import codec as _codec
from ._perms import DIR_MODE
from .errors import ConfigError
from .tier.pages import PAGE_BYTES_LIMIT
from .stores.pageformat import PAGE_SIZE_MAX


_MISSING: Any = object()


#: What :meth:`Cache._get_nowait` returns when only a waiting call can answer.
NOWAIT_UNSURE: Any = object()


_STR, _BYTES = {str}, {bytes}


_REAL_MONOTONIC = (time.monotonic,)


#: Smallest ``segment_bytes`` accepted.
MIN_SEGMENT_BYTES = 1024


_U32_PACK = struct.Struct("<I").pack


_Frozen = _codec.Frozen


_OPEN, _CLOSING, _CLOSED, _FAILED, _FORKED = "open", "closing", "closed", "failed", "forked"


DURABILITY_MODES = ("fsync", "log", "none", "sync")


#: Longest encoded key (bytes); keys live in the page blobs and the index.
MAX_KEY_BYTES = 1 << 20


#: Largest allowed max_value_bytes: one entry must fit in a page.
MAX_VALUE_BYTES_LIMIT = PAGE_BYTES_LIMIT - MAX_KEY_BYTES - 4096


#: ``max_value_bytes`` when not given: 64 MiB.
DEFAULT_MAX_VALUE_BYTES = 64 << 20


def _check_counter_args(op: str, delta: Any, default: Any) -> None:
    """incr/decr arguments: ints only (a bool is not one), ``default`` may be None."""
    if type(delta) is not int:
        raise TypeError(f"{op}() delta must be an int, got {type(delta).__qualname__} "
                        f"{delta!r}")
    if default is not None and type(default) is not int:
        raise TypeError(f"{op}() default must be an int or None, got "
                        f"{type(default).__qualname__} {default!r}")


def _key_too_long(kb: bytes) -> ValueError:
    return ValueError(f"key is {len(kb)} bytes encoded, over the {MAX_KEY_BYTES}-byte "
                      "limit on keys; use a shorter key (e.g. a hash of it)")


def _tags_refused(what: str) -> TypeError:
    return TypeError(
        f"{what}: durablekv does not store tags with entries (diskcache's tag=/evict(tag)); "
        "put the group in the key instead, e.g. cache[('user', 42)] = v, and remove a group "
        "with: for k in cache: if k[0] == 'user': cache.delete(k) (a memoized function's "
        "results: f.cache_clear())")


# -- what diskcache and Redis users reach for first (docs/diskcache.md) ------------------


def _expire_args_refused(args: tuple, kwargs: dict) -> TypeError:
    """``expire(key, seconds)`` (Redis's EXPIRE) or ``expire(now=...)``
    (diskcache's): durablekv's ``expire()`` takes no arguments."""
    does = ("it removes every expired entry now and returns how many, as diskcache's "
            "expire() does")
    shown = ", ".join([f"{a!r:.40}" for a in args] + [f"{k}=..." for k in kwargs])
    if args:
        seconds = f"{args[1]!r:.20}" if len(args) > 1 else "seconds"
        return TypeError(f"expire({shown}): expire() takes no arguments: {does}. To give a "
                         f"key a TTL (Redis's EXPIRE key seconds), call "
                         f"cache.touch({args[0]!r:.40}, expire={seconds})")
    return TypeError(f"expire({shown}): expire() takes no arguments: it removes every entry "
                     "expired by the cache's own clock (clock=, given when the cache is "
                     "opened) and returns how many, as diskcache's expire() does")


def _stats_args_refused(args: tuple, kwargs: dict) -> TypeError:
    """diskcache's ``stats(enable=True, reset=False)``."""
    shown = ", ".join([f"{a!r:.20}" for a in args] + [f"{k}={v!r:.20}" for k, v in kwargs.items()])
    return TypeError(
        f"stats({shown}): stats() takes no arguments: durablekv always counts (there is no "
        "enable= switch) and stats() returns a CacheStats of the counts since the cache was "
        "opened (s = cache.stats(); s.hits, s.misses are diskcache's pair). There is no "
        "reset=: to count from a point on, keep that point's stats() and subtract its "
        "fields (later.hits - earlier.hits)")


def _timeout_refused(timeout: Any) -> TypeError:
    """diskcache's ``Cache(directory, timeout=60)``."""
    return TypeError(
        f"Cache(timeout={timeout!r:.20}): diskcache's timeout (how long SQLite waits for a "
        "lock another process holds) is busy_timeout= here, in seconds (default 5): "
        f"Cache(directory, busy_timeout={timeout!r:.20})")


#: What diskcache's ``Cache`` has and durablekv's does not, and the way
#: instead: the AttributeError a lookup of one of these raises.
_NOT_IN_DURABLEKV: dict[str, str] = {
    "transact": (
        "durablekv has no transact() (diskcache's transaction): each call is atomic by "
        "itself, and add, incr/decr, setdefault, pop and touch read and write in one step "
        "under the cache lock, while the write-behind already commits many writes in one "
        "SQLite transaction. To keep other threads out of several calls, hold a "
        "threading.Lock of your own around them (a crash may still keep some of those "
        "writes and not the others; docs/diskcache.md)"),
    "check": (
        "durablekv has no check() method (diskcache's consistency check): with the cache "
        "closed, run `durablekv check DIR` (or durablekv.check.check_directory(path)); it "
        "verifies the store, its key index and the replay log without changing them, and "
        "says what to do about any damage"),
    "cull": (
        "durablekv has no cull() (diskcache's): it culls on its own, the memory tier by "
        "max_pages (or max_memory_bytes=) at every insert, the store by size_limit= at each "
        "write-behind flush; cache.expire() removes expired entries now"),
    "iterkeys": (
        "durablekv has no iterkeys() (diskcache's, and Python 2 dict's): iterate the cache "
        "itself (for key in cache) or use cache.keys()"),
    "has_key": "durablekv has no has_key() (Python 2 dict's): use key in cache",
}


def _not_in_durablekv(name: str) -> property:
    """A class attribute for diskcache's method ``name``, which durablekv
    does not have: reading it raises the AttributeError that says what to
    use instead (so ``hasattr`` is still False).

    A property, not a ``__getattr__`` on the class: a class with
    ``__getattr__`` gets a slower attribute lookup for every attribute
    (CPython's ``slot_tp_getattr_hook``, which also stops LOAD_ATTR
    specializing), and that put about 20 ns on the C memory hit's
    ``_state`` read and half as much again on the Python ``get``."""
    message = _NOT_IN_DURABLEKV[name]

    def refuse(self: Any) -> Any:
        raise AttributeError(message, name=name, obj=self)
    return property(refuse, doc=f"Not in durablekv (diskcache's {name}()): {message}")


# -- the cache directory --------------------------------------------------------------


def _cache_path(directory: Any) -> str:
    """The absolute path a cache directory argument names; a leading ``~``
    is the user's home directory (``os.path.expanduser``), as diskcache and
    a shell take it."""
    return os.path.abspath(os.path.expanduser(os.fspath(directory)))


def _temporary_cache_path() -> str:
    """The path of a new temporary cache directory (``durablekv-*`` in
    ``tempfile.gettempdir()``), not made yet: the cache makes it with
    :func:`_make_temporary_dir` inside the ``try`` whose cleanup removes it.
    (``tempfile.mkdtemp`` would make it before that ``try``, and an exception
    from a signal handler, Ctrl-C, landing as its mkdir returned would leave
    a directory nothing knows.)"""
    return os.path.join(tempfile.gettempdir(), f"durablekv-{secrets.token_hex(8)}")


def _make_temporary_dir(owner: Any) -> None:
    """Make ``owner.path`` (mode 0700), the directory
    :func:`_temporary_cache_path` named for a cache (or sharded cache) whose
    ``_temporary`` is true.

    :raises FileExistsError: the path exists (not this cache's): ``owner._temporary``
        is then false, so its cleanup never removes it.
    """
    try:
        os.mkdir(owner.path, DIR_MODE)
    except FileExistsError:
        owner._temporary = False
        raise


def _make_cache_dir(path: str) -> None:
    """Create the cache directory ``path`` (mode 0700, with any missing
    parents) unless it exists.

    :raises ConfigError: ``path`` or one of its parents is a file, or the
        directory cannot be created.
    """
    if os.path.exists(path) and not os.path.isdir(path):
        raise ConfigError(f"cache directory {path!r} is a file, not a directory; "
                          "name a directory (it is created if missing)")
    try:
        # private (0700) when created here; an existing directory keeps
        # the mode its owner gave it (see docs/files.md)
        os.makedirs(path, mode=DIR_MODE, exist_ok=True)
    except OSError as exc:
        parent = _first_existing_parent(path)
        if parent is not None and not os.path.isdir(parent):
            what = "a file, not a directory" if os.path.isfile(parent) else "not a directory"
            raise ConfigError(f"cannot create cache directory {path!r}: {parent!r} is {what}; "
                              "move it away, or name a cache directory somewhere "
                              "else") from exc
        raise ConfigError(f"cannot create cache directory {path!r}: {exc.strerror}; create it "
                          "yourself, or name a directory this user may write in") from exc


def _first_existing_parent(path: str) -> str | None:
    parent = os.path.dirname(path)
    while not os.path.exists(parent):
        up = os.path.dirname(parent)
        if up == parent:
            return None
        parent = up
    return parent


def _check_expire(expire: Any) -> float | None:
    """``expire`` as float seconds. Any real number is taken (int, float,
    Decimal, Fraction, a NumPy scalar); bool and complex are not.

    :raises TypeError: not a real number.
    :raises ValueError: negative, NaN, infinite, or too big for a float."""
    if expire is None:
        return None
    if type(expire) is not float and type(expire) is not int:
        if isinstance(expire, (bool, complex)) or not isinstance(expire, Number):
            raise TypeError(f"expire must be a number of seconds or None, got "
                            f"{type(expire).__name__}")
    try:
        expire = float(expire)
    except (OverflowError, TypeError, ValueError):
        raise ValueError(f"expire must be a finite number of seconds >= 0 (or None for no "
                         f"expiry), got a {type(expire).__name__} too big for a "
                         "float") from None
    if math.isnan(expire) or math.isinf(expire) or expire < 0:
        raise ValueError(f"expire must be a finite number of seconds >= 0 (or None for no "
                         f"expiry), got {expire!r}")
    return expire


def _check_clock(clock: Any) -> None:
    """Call ``clock`` once (at open) and check what it returns.

    The TTL hot path (:meth:`Cache._now`) does no checks of its own, so a
    clock returning a str or None would fail later with a bare arithmetic
    TypeError, and one returning NaN or infinity would make every entry
    live for ever.

    :raises ConfigError: ``clock`` is not callable, raises, or does not
        return a finite int or float (a bool is not a number of seconds).
    """
    expected = ("a callable returning epoch seconds as a finite float, like time.time "
                "(pass clock=time.time, or leave it out for time.time)")
    if not callable(clock):
        raise ConfigError(f"clock must be {expected}; got {clock!r}, which is not callable")
    try:
        now = clock()
    except Exception as exc:
        raise ConfigError(f"clock must be {expected}; calling {clock!r} raised "
                          f"{exc!r}") from exc
    if type(now) is bool or not isinstance(now, (int, float)) or not math.isfinite(now):
        raise ConfigError(f"clock must be {expected}; {clock!r} returned {now!r} "
                          f"({type(now).__name__})")


def _check_timeout(timeout: Any) -> float:
    """``flush(timeout=...)``'s argument as float seconds (None is handled by the caller)."""
    if type(timeout) is bool or not isinstance(timeout, (int, float)):
        raise TypeError(f"flush() timeout must be a number of seconds or None, got "
                        f"{type(timeout).__name__}")
    timeout = float(timeout)
    if not 0 <= timeout < math.inf:  # (False for NaN)
        raise ValueError(f"flush() timeout must be a finite number of seconds >= 0, got "
                         f"{timeout!r}; pass None to wait until the flush succeeds or fails")
    return timeout


#: Options of other caches that durablekv spells differently (diskcache,
#: cachetools), for the error an unknown keyword gets.
_OTHER_NAMES = {"eviction_policy": "policy", "disk": "serializer", "maxsize": "max_pages",
                "ttl": "expire= on each set", "directory": "the first argument"}


def unknown_options(owner: str, unknown: dict[str, Any], known: Iterable[str]) -> TypeError:
    """The ``TypeError`` for keyword arguments ``owner`` does not take: as
    Python's own, plus the option meant (``pagesize`` -> ``page_size``,
    diskcache's ``eviction_policy`` -> ``policy``)."""
    import difflib
    known = sorted(known)
    squashed = {k.replace("_", ""): k for k in known}
    parts = []
    for name in unknown:
        meant = _OTHER_NAMES.get(name) or squashed.get(name.replace("_", "").lower())
        if meant is None:
            close = difflib.get_close_matches(name, known, n=1, cutoff=0.75)
            meant = close[0] if close else None
        parts.append(f"{name!r}" + (f" (did you mean {meant}?)" if meant else ""))
    return TypeError(f"{owner}() got unexpected keyword argument{'s' if len(parts) > 1 else ''} "
                     f"{', '.join(parts)}; its options are {', '.join(known)}")


def _physical_memory() -> int | None:
    """Bytes of physical memory, or None where the system does not say."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


#: The fewest bytes a resident slot can take (a key, a value and the slot
#: that holds them; measured costs are hundreds): a bound on max_pages.
MIN_SLOT_BYTES = 64


def _check_config(*, page_size, max_pages, flush_interval, flush_batch_pages, durability,
                  max_value_bytes, on_corruption, max_pending_pages, busy_timeout,
                  segment_bytes, salvage_log, max_memory_bytes=None,
                  size_limit=None) -> None:
    def need_int(name: str, value: Any, lo: int, hi: int | None = None) -> None:
        if type(value) is not int or value < lo or (hi is not None and value > hi):
            rng = f">= {lo}" if hi is None else f"between {lo} and {hi}"
            raise ConfigError(f"{name} must be an integer {rng}, got {value!r}")

    if page_size is not None:
        need_int("page_size", page_size, 1, PAGE_SIZE_MAX)
    need_int("max_pages", max_pages, 1)
    memory = _physical_memory()
    slots = max_pages * (page_size or 1)
    if memory and slots * MIN_SLOT_BYTES > memory and max_memory_bytes is None:
        raise ConfigError(
            f"max_pages={max_pages}" + (f" (page_size={page_size})" if page_size else "") +
            f" lets the memory tier hold {'at least ' if not page_size else ''}{slots:,} "
            f"entries; at {MIN_SLOT_BYTES} bytes each at the very least that is "
            f"{slots * MIN_SLOT_BYTES / (1 << 30):,.0f} GiB, more than this machine's "
            f"{memory / (1 << 30):,.1f} GiB of memory. Pass a max_pages it can hold (the "
            "default is 4096), or bound the memory tier in bytes with max_memory_bytes=")
    for nm, v in (("max_memory_bytes", max_memory_bytes), ("size_limit", size_limit)):
        if v is not None and (type(v) is not int or v < 1):
            raise ConfigError(f"{nm} must be a positive integer number of bytes or None "
                              f"(no bound), got {v!r}; e.g. {nm}=256 << 20 for 256 MiB")
    need_int("flush_batch_pages", flush_batch_pages, 1)
    need_int("max_value_bytes", max_value_bytes, 1, MAX_VALUE_BYTES_LIMIT)
    if max_pending_pages is not None:
        need_int("max_pending_pages", max_pending_pages, 1)
    # a segment is sealed once it reaches this size: below a kilobyte that
    # would be a file (and a directory fsync) every few records
    need_int("segment_bytes", segment_bytes, MIN_SEGMENT_BYTES)
    for nm, v in (("flush_interval", flush_interval), ("busy_timeout", busy_timeout)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not (0 < v < math.inf):
            raise ConfigError(f"{nm} must be a positive number of seconds, got {v!r}")
    if durability not in DURABILITY_MODES:
        raise ConfigError(f"durability must be one of {DURABILITY_MODES}, got {durability!r}")
    if on_corruption not in ("raise", "rebuild"):
        raise ConfigError(f"on_corruption must be 'raise' or 'rebuild', got {on_corruption!r}")
    # Like the integer settings above: the exact type, no truthiness (a
    # salvage_log='no' must not give up log records).
    if type(salvage_log) is not bool:
        raise ConfigError(f"salvage_log must be True or False, got {salvage_log!r}")
