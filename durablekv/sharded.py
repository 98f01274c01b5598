"""ShardedCache: N independent caches behind one mapping, keys routed by a stable hash.

Each shard is a full :class:`~durablekv.cache.Cache` in its own subdirectory
(``shard-00``, ``shard-01``, ...) with its own lock, memory tier, replay log,
batcher and SQLite file. A key always goes to the same shard:

    shard = crc32(canonical_key(key)) % shards

``canonical_key`` maps keys that a dict calls equal (``1 == 1.0 == True``)
to one byte string, and CRC-32 is the same on every process and machine, so
the routing never depends on Python's salted ``hash()`` (the mistake that
makes ``PYTHONHASHSEED`` reshuffle a cache between runs). A checksum, not a
cryptographic hash, is enough to spread keys (Redis Cluster routes by
CRC16) and costs a tenth of BLAKE2b on a short key.

Why shards: one :class:`Cache` serialises its writers on one lock and one log
file. Shards give each group of keys its own lock, log and SQLite writer
thread, the way Redis Cluster splits keys into hash slots and memcached
clients spread keys over servers, but inside one process and one directory.
What it does not give: an operation that spans shards (``clear``,
iteration, ``len``) is done shard by shard, not as one atomic step.

The shard count is fixed when the directory is created (stored in
``SHARDS``): reopening with another count would send keys to shards that do
not hold them, so it raises :class:`ConfigError`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from itertools import chain
from zlib import crc32
from collections.abc import ItemsView, KeysView, MutableMapping, ValuesView
from typing import Any, Callable, Iterator

from . import codec as _codec
from .cache import _CACHE_OPTIONS, Cache
from .config import (_cache_path, _expire_args_refused, _make_cache_dir, _make_temporary_dir,
                     _not_in_durablekv, _stats_args_refused, _temporary_cache_path,
                     unknown_options)
from .memoize import memoize as _memoize
from .errors import ConfigError
from .lifecycle import remove_tree
from .stats import CacheStats

__all__ = ["ShardedCache", "shard_of", "DEFAULT_SHARDS", "MAX_SHARDS"]

DEFAULT_SHARDS = 8
MAX_SHARDS = 256
SHARDS_FILE = "SHARDS"
_FORMAT = 1
_MISSING: Any = object()
_canonical = _codec.canonical_key


def shard_of(key: Any, shards: int) -> int:
    """The shard index in ``[0, shards)`` that holds ``key``.

    Stable across processes, machines and Python versions: the CRC-32 of the
    key's canonical encoding (equal keys, ``1 == 1.0 == True``, share one
    shard). A lookup key of a subclass (an ``IntEnum`` member) routes as the
    plain value a dict would find.

    :raises TypeError: the key has an unsupported type.
    :raises ValueError: the key is or contains NaN.
    """
    t = type(key)
    if t is str or t is int:  # their own lookup keys: skip the call
        return crc32(_canonical(key)) % shards
    return crc32(_canonical(_codec.lookup_key(key))) % shards


def _shard_dir(index: int) -> str:
    return f"shard-{index:02d}"


def _read_shard_count(path: str) -> int | None:
    meta = os.path.join(path, SHARDS_FILE)
    try:
        with open(meta, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        return None
    try:
        doc = json.loads(text)
        n, fmt = doc["shards"], doc.get("format", _FORMAT)
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ConfigError(f"{meta!r} is damaged ({text[:80]!r}); it names the shard count "
                          'of this sharded cache: restore it as {"format": 1, "shards": N} '
                          "with N the number of shard-NN directories") from exc
    if type(n) is not int or not 1 <= n <= MAX_SHARDS or fmt != _FORMAT:
        raise ConfigError(f"{meta!r} holds an invalid shard count {n!r} (format {fmt!r}); "
                          f"expected an int in [1, {MAX_SHARDS}] and format {_FORMAT}: restore "
                          'it as {"format": 1, "shards": N} with N the number of shard-NN '
                          "directories")
    return n


def _write_shard_count(path: str, shards: int) -> None:
    meta = os.path.join(path, SHARDS_FILE)
    tmp = f"{meta}.tmp.{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, json.dumps({"format": _FORMAT, "shards": shards}).encode() + b"\n")
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, meta)
    dfd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


class ShardedCache(MutableMapping):
    """A persistent cache split into ``shards`` :class:`Cache` shards.

    The same API and mapping contract as :class:`Cache` (``get/set/add/incr/
    decr/touch/delete/pop/popitem/setdefault/clear/expire/flush/close/
    stats/memoize``, ``in``, ``len``, iteration, views, ``==``); every
    single-key operation is the shard's own, so it keeps that shard's
    atomicity and durability.

    :param directory: the parent directory (created 0700 if missing); shard
        ``i`` lives in ``directory/shard-NN``. None: a new temporary
        directory, removed with everything in it by :meth:`close` (as
        ``Cache()`` and diskcache's ``FanoutCache()``). A leading ``~`` is
        the user's home directory, as for :class:`Cache`.
    :param shards: number of shards, an int in [1, 256]; fixed when the
        directory is created. None adopts the stored count (8 for a new
        directory); an explicit different count raises :class:`ConfigError`.
    :param name: the metrics ``cache`` label of every shard (default: the
        directory's base name); shards are told apart by a ``shard`` label.
    :param options: every other keyword is passed to each shard's
        :class:`Cache` (``page_size``, ``durability``, ``clock``, ...).
        ``max_pages`` is per shard: the memory tier holds at most
        ``shards * max_pages`` pages in all. ``max_memory_bytes`` and
        ``size_limit`` are for the whole cache, bytes being what a machine
        has: each shard gets ``max(1, N // shards)`` (keys are spread evenly
        by hash), so the memory tiers hold at most ``N`` bytes in all plus
        one page per shard, and the stores as much plus one flush's overshoot
        per shard (see ``Cache``).
    :raises ConfigError: a bad shard count or option.
    :raises CacheLockedError: a shard is open elsewhere (no shard stays open).
    :raises ConfigError: ``SHARDS`` is damaged or missing beside shard directories.
    """

    def __init__(self, directory: str | os.PathLike | None = None, shards: int | None = None,
                 *, name: str | None = None, **options: Any) -> None:
        self._shards: list[Cache] = []
        self._temporary = directory is None
        if shards is not None and (type(shards) is not int or not 1 <= shards <= MAX_SHARDS):
            raise ConfigError(f"shards must be an int in [1, {MAX_SHARDS}], not {shards!r}")
        unknown = {k: v for k, v in options.items() if k not in _CACHE_OPTIONS and k != "timeout"}
        if unknown:  # before any directory is made
            raise unknown_options("ShardedCache", unknown, (*_CACHE_OPTIONS, "shards"))
        if directory is None:
            # made in the try below whose cleanup removes it (as Cache's)
            directory = _temporary_cache_path()
        if not isinstance(directory, (str, os.PathLike)) or not os.fspath(directory):
            raise TypeError(f"the cache directory must be a non-empty path (str or "
                            f"os.PathLike), not {directory!r}; e.g. "
                            "ShardedCache('var/cache', shards=8)")
        if "name" in options or "directory" in options:
            raise ConfigError("pass name= once, to ShardedCache")
        path = self.path = _cache_path(directory)
        try:
            if self._temporary:
                _make_temporary_dir(self)
            else:
                _make_cache_dir(path)
            self._open_shards(path, shards, name, options)
        except BaseException:
            self._close_all(raise_first=False)
            raise

    def _open_shards(self, path: str, shards: int | None, name: str | None,
                     options: dict[str, Any]) -> None:
        """Read or write ``SHARDS`` in ``path`` and open every shard (the
        caller closes the ones opened if this raises)."""
        stored = _read_shard_count(path)
        plain = [f for f in os.listdir(path)
                 if f == "pages.sqlite3" or (f.startswith("replay-") and f.endswith(".log"))]
        if plain:
            raise ConfigError(f"{path!r} holds a plain Cache ({', '.join(sorted(plain))}), not a "
                              "ShardedCache; open it with Cache(), or give the ShardedCache a "
                              "directory of its own")
        if stored is None:
            if any(e.startswith("shard-") for e in os.listdir(path)):
                raise ConfigError(f"{path!r} has shard directories but no {SHARDS_FILE} file "
                                  'naming their count; restore it as {"format": 1, "shards": '
                                  "N} with N the number of shard-NN directories")
            stored = DEFAULT_SHARDS if shards is None else shards
            _write_shard_count(path, stored)
        elif shards is not None and shards != stored:
            raise ConfigError(f"{path!r} was created with shards={stored}, not {shards}: keys "
                              f"are routed by shard count, so it cannot change; open it with "
                              f"shards={stored} (or None), or use a new directory")
        self.name = os.path.basename(path.rstrip(os.sep)) if name is None else str(name)
        self.shard_count = stored
        self.max_memory_bytes = options.get("max_memory_bytes")
        self.size_limit = options.get("size_limit")
        for opt in ("max_memory_bytes", "size_limit"):
            total = options.get(opt)
            if type(total) is int and total >= 1:
                options[opt] = max(1, total // stored)
            # anything else goes to Cache as given, which refuses it
        for i in range(stored):
            shard = Cache(os.path.join(path, _shard_dir(i)), name=self.name, **options)
            shard.shard = i
            self._shards.append(shard)


    # -- routing ---------------------------------------------------------------------

    @property
    def directory(self) -> str:
        """The parent directory: :attr:`path`, under diskcache's name for it."""
        return self.path

    # as Cache's: an AttributeError that says what to use instead
    transact = _not_in_durablekv("transact")
    check = _not_in_durablekv("check")
    cull = _not_in_durablekv("cull")
    iterkeys = _not_in_durablekv("iterkeys")
    has_key = _not_in_durablekv("has_key")

    @property
    def shards(self) -> tuple[Cache, ...]:
        """The shard caches, in shard order (index ``i`` holds ``shard_of(k) == i``)."""
        return tuple(self._shards)

    @property
    def page_size(self) -> int:
        """Slots per page (the same in every shard)."""
        return self._shards[0].page_size

    @property
    def max_pages(self) -> int:
        """The memory bound of ONE shard, in pages (``shard_count`` times it in all)."""
        return self._shards[0].max_pages

    @property
    def durability(self) -> str:
        return self._shards[0].durability

    def shard_for(self, key: Any) -> Cache:
        """The shard :class:`Cache` that holds ``key`` (see :func:`shard_of`)."""
        t = type(key)
        if t is str or t is int:
            return self._shards[crc32(_canonical(key)) % self.shard_count]
        return self._shards[shard_of(key, self.shard_count)]

    # -- single-key operations: the shard's own -----------------------------------------

    def get(self, key: Any, default: Any = None) -> Any:
        return self.shard_for(key).get(key, default)

    def __getitem__(self, key: Any) -> Any:
        return self.shard_for(key)[key]

    def __contains__(self, key: Any) -> bool:
        return key in self.shard_for(key)

    def set(self, key: Any, value: Any, expire: float | None = None) -> None:
        self.shard_for(key).set(key, value, expire=expire)

    def __setitem__(self, key: Any, value: Any) -> None:
        self.shard_for(key)[key] = value

    def add(self, key: Any, value: Any, expire: float | None = None) -> bool:
        return self.shard_for(key).add(key, value, expire=expire)

    def incr(self, key: Any, delta: int = 1, default: int | None = 0) -> int:
        return self.shard_for(key).incr(key, delta, default)

    def decr(self, key: Any, delta: int = 1, default: int | None = 0) -> int:
        return self.shard_for(key).decr(key, delta, default)

    def touch(self, key: Any, expire: float | None = None) -> bool:
        return self.shard_for(key).touch(key, expire)

    def delete(self, key: Any) -> bool:
        return self.shard_for(key).delete(key)

    def __delitem__(self, key: Any) -> None:
        del self.shard_for(key)[key]

    def pop(self, key: Any, default: Any = _MISSING) -> Any:
        shard = self.shard_for(key)
        return shard.pop(key) if default is _MISSING else shard.pop(key, default)

    def setdefault(self, key: Any, default: Any = None) -> Any:
        return self.shard_for(key).setdefault(key, default)

    def _peek(self, key: Any) -> Any:
        return self.shard_for(key)._peek(key)

    # -- whole-cache operations: shard by shard ------------------------------------------

    def popitem(self) -> tuple[Any, Any]:
        """Remove and return some ``(key, value)``; KeyError when every shard is empty."""
        for shard in self._shards:
            try:
                return shard.popitem()
            except KeyError:
                continue
        raise KeyError("popitem(): cache is empty")

    def clear(self) -> None:
        """Remove every entry of every shard (shard by shard: not one atomic step)."""
        for shard in self._shards:
            shard.clear()

    def __len__(self) -> int:
        return sum(len(shard) for shard in self._shards)

    def expire(self, *args: Any, **kwargs: Any) -> int:
        """Remove expired entries from every shard; return how many were removed.
        No arguments, as :meth:`Cache.expire` (a key's TTL: :meth:`touch`)."""
        if args or kwargs:
            raise _expire_args_refused(args, kwargs)
        return sum(shard.expire() for shard in self._shards)

    def __iter__(self) -> Iterator[Any]:
        """Keys of every shard, shard by shard. Every shard's snapshot is taken
        when iteration starts, so it follows :meth:`Cache.__iter__`'s rules."""
        return chain.from_iterable([iter(shard) for shard in self._shards])

    def keys(self) -> KeysView:
        return KeysView(self)

    def items(self) -> ItemsView:
        return _ItemsView(self)

    def values(self) -> ValuesView:
        return _ValuesView(self)

    def memoize(self, expire: float | None = None, **kwargs: Any) -> Callable:
        """As :meth:`Cache.memoize`; each result is stored in its key's shard."""
        return _memoize(self, expire, **kwargs)

    # -- lifecycle -----------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return all(shard.closed for shard in self._shards)

    def flush(self, timeout: float | None = None) -> None:
        """Every write acknowledged before this call is in SQLite, in every shard.

        :param timeout: seconds for all shards together (None: wait).
        :raises FlushTimeoutError, WriteBehindError: as :meth:`Cache.flush`.
        """
        if timeout is None:
            for shard in self._shards:
                shard.flush()
            return
        deadline = time.monotonic() + _check_timeout(timeout)
        for shard in self._shards:
            shard.flush(max(0.0, deadline - time.monotonic()))

    def wait_warm(self, timeout: float | None = None) -> bool:
        """Wait for every shard's warm-restart preload to end (:meth:`Cache.wait_warm`).

        :param timeout: seconds for all shards together (None: wait).
        :returns: True when every shard's preload has ended, False when
            ``timeout`` passed first.
        """
        if timeout is None:
            return all([shard.wait_warm() for shard in self._shards])
        from .warm import check_wait_timeout
        deadline = time.monotonic() + check_wait_timeout(timeout)
        return all([shard.wait_warm(max(0.0, deadline - time.monotonic()))
                     for shard in self._shards])

    def close(self) -> None:
        """Close every shard (flush, checkpoint, release); the first error is raised
        after all shards were closed. Idempotent."""
        self._close_all(raise_first=True)

    def _close_all(self, raise_first: bool) -> None:
        first: BaseException | None = None
        for shard in self._shards:
            try:
                shard.close()
            except BaseException as exc:  # noqa: BLE001 - re-raised once all are closed
                first = first or exc
        if self._temporary:
            remove_tree(self.path)
        if first is not None and raise_first:
            raise first

    def __enter__(self) -> "ShardedCache":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        return f"<ShardedCache {self.path!r} shards={self.shard_count} {state}>"

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise TypeError("a ShardedCache cannot be pickled or copied: it owns its directory; "
                        "share the object between threads instead")

    def volume(self) -> int:
        """Bytes all shards take on disk now (see :meth:`Cache.volume`)."""
        return sum(shard.volume() for shard in self._shards)

    # -- stats ---------------------------------------------------------------------------

    def shard_stats(self) -> list[CacheStats]:
        """One :class:`CacheStats` per shard, in shard order."""
        return [shard.stats() for shard in self._shards]

    def stats(self, *args: Any, **kwargs: Any) -> CacheStats:
        """The shards' :class:`CacheStats` summed (no arguments, as :meth:`Cache.stats`).

        Counters, gauges (``pending_pages``, ``resident_pages``, bytes) and
        ``max_pages`` are sums; ``page_size`` is the shards' (all equal);
        ``oldest_unflushed_seconds`` is the oldest of any shard. LSNs are per
        shard, so ``last_lsn`` and ``checkpoint_lsn`` are sums too: their
        difference is the number of changes not yet in SQLite in all.
        """
        if args or kwargs:
            raise _stats_args_refused(args, kwargs)
        return sum_stats(self.shard_stats())


def sum_stats(parts: list[CacheStats]) -> CacheStats:
    """Sum per-shard :class:`CacheStats` (see :meth:`ShardedCache.stats`)."""
    total: dict[str, Any] = {}
    for f in dataclasses.fields(CacheStats):
        values = [getattr(p, f.name) for p in parts]
        if f.name in ("page_size", "policy"):
            total[f.name] = values[0] if values else f.default
        elif f.name in ("max_memory_bytes", "size_limit"):
            total[f.name] = None if not values or None in values else sum(values)
        elif f.name == "oldest_unflushed_seconds":
            total[f.name] = max(values, default=0.0)
        else:
            total[f.name] = sum(values)
    return CacheStats(**total)


def _check_timeout(timeout: Any) -> float:
    from .config import _check_timeout as check
    return check(timeout)


class _ItemsView(ItemsView):
    def __iter__(self) -> Iterator[tuple[Any, Any]]:
        return chain.from_iterable([iter(s.items()) for s in self._mapping._shards])


class _ValuesView(ValuesView):
    def __contains__(self, value: Any) -> bool:
        return any(v is value or v == value for v in self)

    def __iter__(self) -> Iterator[Any]:
        return chain.from_iterable([iter(s.values()) for s in self._mapping._shards])
