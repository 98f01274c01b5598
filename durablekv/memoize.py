"""``memoize``: a decorator caching a function's results in a cache, with single flight.

:func:`memoize` works with any host that offers ``get(key, default)``,
``set(key, value, expire=)``, ``delete(key)``, ``_peek(key)`` (a value without
counting a hit, or :data:`~durablekv.config._MISSING`) and iteration over its keys:
``Cache.memoize`` and ``ShardedCache.memoize`` both call it, and a test can
pass a small fake. Concurrent callers of one memoized key run the function
once: the first runs it, the others wait on its :class:`_Flight`.
"""

from __future__ import annotations

import functools
import threading
from typing import Any, Callable, Iterable

from . import codec as _codec
from .config import _MISSING, _check_expire, _tags_refused


def _check_ignore(ignore: Any) -> frozenset:
    """``memoize(ignore=...)`` as a frozenset of ints >= 0 and strs."""
    if isinstance(ignore, (str, int)):
        ignore = (ignore,)
    try:
        left_out = frozenset(ignore)
    except TypeError:
        raise TypeError(f"memoize(ignore=...) takes argument positions (int) and keyword "
                        f"names (str), e.g. ignore={{0}} for a method's self; got "
                        f"{ignore!r:.60}") from None
    bad = [x for x in left_out
           if not (type(x) is str or (type(x) is int and x >= 0))]
    if bad:
        raise TypeError(f"memoize(ignore=...) takes argument positions (int >= 0) and keyword "
                        f"names (str), e.g. ignore={{0}} for a method's self; got {bad[0]!r}")
    return left_out


def _memoize_key_error(prefix: str, args: tuple, kwargs: dict, key: Any,
                       exc: TypeError, left_out: frozenset = frozenset()) -> TypeError:
    """The TypeError for a memoized call whose arguments cannot be a cache
    key: which function, which argument, and why. ``exc`` itself when the
    key is fine (the TypeError came from elsewhere, e.g. decoding a value)."""
    try:
        _codec.check_key(key)
    except TypeError:
        pass
    else:
        return exc
    return TypeError(_memoize_key_message(prefix, args, kwargs, exc, left_out))


def _memoize_key_message(prefix: str, args: tuple, kwargs: dict, exc: TypeError,
                          left_out: frozenset = frozenset()) -> str:
    ordinals = {1: "1st", 2: "2nd", 3: "3rd"}
    named = [(f"its {ordinals.get(i + 1, f'{i + 1}th')} positional argument", a, i, None)
             for i, a in enumerate(args)]
    named += [(f"its argument {k}=", v, None, k) for k, v in sorted(kwargs.items())]
    for label, value, i, name in named:
        if (i if i is not None else name) in left_out:
            continue  # not part of the key
        try:
            _codec.check_key(value)
        except TypeError as why:
            if isinstance(value, list):
                fix = "; pass a tuple instead of the list"
            elif isinstance(value, (str, int, float, bytes, tuple)) and \
                    type(value) not in (str, int, float, bytes, tuple):
                fix = ""  # a subclass: the key error already says to pass the plain value
            else:
                where = i if i is not None else name
                fix = (f"; pass a value of one of those types, or leave it out of the key: "
                       f"@cache.memoize(ignore={{{where!r}}}) (a method's self: every instance "
                       "then shares the results), or key=a function of the arguments that "
                       "returns a storable key")
            return (f"memoized {prefix}(): {label} ({value!r:.60}) cannot be part of a cache "
                    f"key: {why}{fix}")
    return f"memoized {prefix}(): its arguments cannot be a cache key: {exc}"


class _Flight:
    """One in-progress memoized call that other callers wait for."""

    __slots__ = ("_event", "_value", "_exc", "waiters")

    def __init__(self) -> None:
        self._event = threading.Event()
        self._value: Any = None
        self._exc: BaseException | None = None
        self.waiters = 0  # callers waiting for it (changed under the flights lock)

    def succeed(self, value: Any) -> None:
        self._value = value
        self._event.set()

    def fail(self, exc: BaseException) -> None:
        self._exc = exc
        self._event.set()

    def wait(self) -> Any:
        self._event.wait()
        if self._exc is not None:
            raise self._exc
        return self._value


def memoize(cache: Any, expire: float | None = None, *, name: str | None = None,
            ignore: Iterable[int | str] = (), key: Callable[..., Any] | None = None,
            tag: Any = None, typed: Any = None) -> Callable:
    """Decorator caching a function's results in ``cache`` (``Cache.memoize``; ``ShardedCache.memoize``).

    The cache key is ``("durablekv.memoize", name, args, sorted kwargs)``
    (``("durablekv.memoize", name, key(*args, **kwargs))`` with ``key=``);
    it and the results must be storable (else ``TypeError``, naming the
    argument and the fix). Concurrent callers with the same key share one
    call (single flight); an exception is not cached and is raised to
    every caller that waited for it. The function runs with no cache lock
    held.

    Use as ``@cache.memoize(expire=60)``, or bare as ``@cache.memoize``
    (no TTL), as with ``functools.lru_cache``. On a method, ``cache``
    cannot be part of a key: ``@cache.memoize(ignore={0})`` leaves it out
    (every instance then shares the results, as diskcache's
    ``memoize(ignore=...)`` does), or ``key=lambda cache, x: (cache.id, x)``
    names the instance (as cachetools' ``key=`` does).

    The wrapper has ``cache_key(*args, **kwargs)`` (the key a call would
    use; diskcache's ``__cache_key__``) and ``cache_clear()`` (remove
    every cached result of this function; returns how many; cachetools'
    and ``functools.lru_cache``'s name). ``cache_clear()`` walks the keys
    of the whole cache once. ``waiting(*args, **kwargs)`` tells how many
    callers wait for the call in flight with those arguments (0: none in
    flight).

    :param expire: TTL of cached results in seconds (None: never).
    :param name: key prefix; default the function's module and qualified name.
    :param ignore: positions (int) and keyword names (str) of arguments
        left out of the key (diskcache's ``ignore``); a keyword argument is
        left out by name only.
    :param key: ``key(*args, **kwargs)`` returning the key part for a
        call (a storable value), instead of the arguments themselves;
        not with ``ignore``.
    :param tag: not supported (see :meth:`evict`): ``TypeError``.
    :param typed: diskcache's; only None or False (what durablekv does:
        arguments a dict calls equal, ``1 == 1.0``, share a result). True
        is a ``TypeError`` that says to put the type in ``key=``.
    :raises TypeError: ``ignore`` holds something other than ints >= 0
        and str; ``key`` is not callable; both are given; ``tag`` given;
        ``typed`` true; a str first argument (diskcache's ``name``: pass
        ``name=``).
    :raises ValueError: ``expire`` negative, NaN or infinite.
    """
    if tag is not None:
        raise _tags_refused("memoize(tag=...)")
    if typed is not None and typed is not False:
        raise TypeError(
            f"memoize(typed={typed!r:.20}): durablekv keys are equal when a dict says so "
            "(1 == 1.0 == True are one key), in memory and on disk, so there is no typed=; "
            "to keep types apart, put the type in the key: "
            "@cache.memoize(key=lambda x: (type(x).__name__, x))")
    if isinstance(expire, str):
        raise TypeError(
            f"memoize({expire!r:.40}): the first argument is expire (seconds), not "
            f"diskcache's name; pass the name by keyword: @cache.memoize(name={expire!r:.40}) "
            "(with a TTL: @cache.memoize(expire=60, name=...))")
    if callable(expire):  # bare @cache.memoize: expire is the function
        return memoize(cache, name=name, ignore=ignore, key=key)(expire)
    _check_expire(expire)
    left_out = _check_ignore(ignore)
    if key is not None and not callable(key):
        raise TypeError(f"memoize(key=...) takes a function of the call's arguments "
                        f"returning its key, not {type(key).__qualname__} {key!r:.60}")
    if key is not None and left_out:
        raise TypeError("memoize() takes key= or ignore=, not both: leave the arguments "
                        "out in the key function itself")

    def decorator(func: Callable) -> Callable:
        prefix = name or f"{func.__module__}.{func.__qualname__}"
        inflight: dict[Any, _Flight] = {}
        flights = threading.Lock()

        def key_of(args: tuple, kwargs: dict) -> Any:
            if key is not None:
                return ("durablekv.memoize", prefix, key(*args, **kwargs))
            if left_out:
                args = tuple(a for i, a in enumerate(args) if i not in left_out)
                kwargs = {k: v for k, v in kwargs.items() if k not in left_out}
            return ("durablekv.memoize", prefix, args, tuple(sorted(kwargs.items())))

        @functools.wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            ck = key_of(args, kwargs)
            try:
                value = cache.get(ck, _MISSING)
                if value is _MISSING:
                    # A miss runs func and stores its result under the key:
                    # refuse a key no write takes first (a lookup with an
                    # IntEnum argument finds an equal int's result, as a
                    # dict would, but a miss must not run func in vain).
                    _codec.check_key(ck)
            except TypeError as exc:
                if key is not None:
                    raise TypeError(f"memoized {prefix}(): key= returned {ck[2]!r:.60}, "
                                    f"which cannot be a cache key: {exc}") from exc
                raise _memoize_key_error(prefix, args, kwargs, ck, exc, left_out) from exc
            if value is not _MISSING:
                return value
            with flights:
                flight = inflight.get(ck)
                leader = flight is None
                if leader:
                    flight = inflight[ck] = _Flight()
                else:
                    flight.waiters += 1
            if not leader:
                return flight.wait()
            try:
                value = cache._peek(ck)
                if value is _MISSING:
                    value = func(*args, **kwargs)
                    try:
                        cache.set(ck, value, expire=expire)
                    except TypeError as exc:
                        raise TypeError(f"memoized {prefix}() returned a result that cannot "
                                        f"be cached: {exc}") from exc
            except BaseException as exc:
                flight.fail(exc)
                raise
            else:
                flight.succeed(value)
                return value
            finally:
                with flights:
                    inflight.pop(ck, None)

        def cache_clear() -> int:
            removed = 0
            for k in cache:
                if type(k) is tuple and len(k) >= 2 and k[0] == "durablekv.memoize" \
                        and k[1] == prefix and cache.delete(k):
                    removed += 1
            return removed

        def waiting(*args: Any, **kwargs: Any) -> int:
            """How many callers are waiting for the call in flight with these
            arguments (0: none is in flight): what single flight saved."""
            with flights:
                flight = inflight.get(key_of(args, kwargs))
                return 0 if flight is None else flight.waiters

        wrapper.cache_key = lambda *a, **kw: key_of(a, kw)  # type: ignore[attr-defined]
        wrapper.waiting = waiting  # type: ignore[attr-defined]
        wrapper.cache_clear = cache_clear  # type: ignore[attr-defined]
        return wrapper

    return decorator
