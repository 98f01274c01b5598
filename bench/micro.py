"""Micro cases: the cost of one operation, per implementation.

16-byte ``str`` keys (``key:000000000042``), ``bytes`` values of 100 B and
4 KiB, 100k keys. For each value size every store is opened and filled with
the same keys, then each case runs its repetitions; within a repetition the
implementations take turns (round-robin, rotating the starting one), each
timing a run of ``n`` operations on the same keys (a different window of a
seeded shuffle in each repetition). ``n`` is calibrated per implementation
so that one run lasts about ``rep_seconds`` (at least ``min_ops``, at most
all keys); the calibration run doubles as the warm-up.

Cases (``case`` field of a result):

``get_hit_memory``  get of a present key; durablekv holds every key in memory
``get_hit_store``   durablekv with a memory tier of ~1% of the keys, after a
                    flush: almost every get is a page fault (its rate is
                    recorded); the disk stores and Redis serve the same gets
``get_miss``        get of a key never stored
``set``             overwrite of a present key; durablekv in each durability mode
``set_threads``     the same from 4 threads (disjoint keys), ns per op of wall time
``delete``          delete of a present key (the key is put back, untimed, after each run)
``mix_90_10``       90% gets, 10% sets (seeded)
"""

from __future__ import annotations

import gc
import os
import random
import threading
import time
from typing import Any, Callable, Sequence

from .impls import DurableKV, Impl, competitors, pure_twins
from .util import Scratch, Settings, note, rotate, summarize, timed_ns

CASES = ("get_hit_memory", "get_hit_store", "get_miss", "set", "set_threads", "delete",
         "mix_90_10")

#: The anchor each case's ratios are taken against (see report.TARGETS).
ANCHORS = {"get_hit_memory": "cachetools", "get_hit_store": "diskcache",
           "get_miss": "cachetools", "set": "diskcache", "set_threads": "diskcache",
           "delete": "diskcache", "mix_90_10": "cachetools"}


def make_keys(n: int, prefix: str = "key:") -> list[str]:
    width = 16 - len(prefix)
    return [f"{prefix}{i:0{width}d}" for i in range(n)]


class _Windows:
    """Key windows of a seeded shuffle: repetition r of a case uses window r."""

    def __init__(self, keys: Sequence[str], seed: int) -> None:
        self.perm = list(keys)
        random.Random(seed).shuffle(self.perm)

    def take(self, n: int, r: int | None) -> list[str]:
        """Window ``r``; ``None``: the calibration window, the last ``n`` keys.

        Repetitions start at the front, so the calibration run (also the
        warm-up) does not leave the first repetition's keys in memory: it
        did, and with ``--quick`` a page-fault case then measured half its
        gets as memory hits."""
        perm, total = self.perm, len(self.perm)
        if r is None:
            return perm[max(0, total - n):]
        start = (r * n) % total
        out = perm[start:start + n]
        if len(out) < n:
            out += perm[:n - len(out)]
        return out


def _threaded(loop: Callable[[Sequence[str], bytes], None], keys: Sequence[str], value: bytes,
              threads: int) -> int:
    """Run ``loop`` over ``threads`` disjoint slices at once; wall-clock ns."""
    parts = [keys[i::threads] for i in range(threads)]
    barrier = threading.Barrier(threads + 1)
    errors: list[BaseException] = []

    def work(part: Sequence[str]) -> None:
        barrier.wait()
        try:
            loop(part, value)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller
            errors.append(exc)

    ts = [threading.Thread(target=work, args=(p,)) for p in parts]
    for t in ts:
        t.start()
    barrier.wait()
    t0 = time.perf_counter_ns()
    for t in ts:
        t.join()
    dt = time.perf_counter_ns() - t0
    if errors:
        raise errors[0]
    return dt


class _Case:
    """How one case runs a timed batch of ``n`` ops for an implementation."""

    def __init__(self, name: str, value: bytes, missing: Sequence[str], threads: int) -> None:
        self.name, self.value, self.missing, self.threads = name, value, missing, threads

    def keys_for(self, windows: _Windows, n: int, r: int | None) -> list[str]:
        if self.name == "get_miss":
            if r is None:
                return list(self.missing[-n:])
            return list(self.missing[(r * n) % max(1, len(self.missing) - n):][:n])
        return windows.take(n, r)

    def run(self, impl: Impl, keys: list[str], flags: list[bool]) -> tuple[int, int]:
        """Time one batch; return (ns for the operations, ns to drain afterwards).

        The drain (:meth:`Impl.quiesce`: durablekv's write-behind flush,
        sqlitedict's pending queue and commit) is timed separately and never
        overlaps the next implementation's turn.
        """
        name, v = self.name, self.value
        if name in ("get_hit_memory", "get_hit_store", "get_miss"):
            dt = timed_ns(impl.loop_get, keys)
        elif name == "set":
            dt = timed_ns(impl.loop_set, keys, v)
        elif name == "set_threads":
            dt = _threaded(impl.threaded_set(), keys, v, self.threads)
        elif name == "delete":
            dt = timed_ns(impl.loop_delete, keys)
        elif name == "mix_90_10":
            dt = timed_ns(impl.loop_mix, keys, flags[:len(keys)], v)
        else:
            raise ValueError(name)
        drain = timed_ns(impl.quiesce)
        if name == "delete":
            impl.loop_set(keys, v)   # put them back, untimed
            impl.quiesce()
        return dt, drain


def _counters(impl: Impl) -> dict[str, int]:
    return impl.extra()


def _measure(case: _Case, impls: list[Impl], windows: _Windows, flags: list[bool],
             cfg: Settings, value_bytes: int) -> list[dict[str, Any]]:
    """Calibrate each implementation, then the round-robin repetitions."""
    total = len(windows.perm)
    n_ops: dict[str, int] = {}
    for impl in impls:
        probe = min(total, max(cfg.min_ops, 500 if cfg.mode != "quick" else cfg.min_ops))
        keys = case.keys_for(windows, probe, None)
        dt, _drain = case.run(impl, keys, flags)
        per_op = max(dt / probe, 1.0)
        n_ops[impl.key] = int(min(total, max(cfg.min_ops, cfg.rep_seconds * 1e9 / per_op)))
    samples: dict[str, list[float]] = {i.key: [] for i in impls}
    with_drain: dict[str, list[float]] = {i.key: [] for i in impls}
    before = {i.key: _counters(i) for i in impls}
    for r in range(cfg.repeat):
        for impl in rotate(impls, r):
            n = n_ops[impl.key]
            keys = case.keys_for(windows, n, r)
            dt, drain = case.run(impl, keys, flags)
            samples[impl.key].append(dt / n)
            with_drain[impl.key].append((dt + drain) / n)
    rows = []
    for impl in impls:
        row = {"case": case.name, "value_bytes": value_bytes,
               "threads": case.threads if case.name == "set_threads" else 1,
               "impl": impl.key, "name": impl.name, "family": impl.family, "unit": "ns/op",
               "ops_per_rep": n_ops[impl.key], **summarize(samples[impl.key]),
               "with_drain": summarize(with_drain[impl.key])}
        after = _counters(impl)
        if after:
            delta = {k: after[k] - before[impl.key].get(k, 0) for k in after
                     if k not in ("resident_pages",)}
            ops = n_ops[impl.key] * cfg.repeat
            if case.name.startswith("get") and "page_faults" in delta:
                row["page_fault_rate"] = delta.get("page_faults", 0) / ops
                row["memory_hit_rate"] = delta.get("memory_hits", 0) / ops
            row["counters"] = delta   # over the repetitions (and a delete case's put-backs)
        rows.append(row)
    return rows


def _verify(impl: Impl, keys: Sequence[str], value: bytes, missing: Sequence[str]) -> None:
    """The hit cases must hit and the miss case must miss: check a sample."""
    for k in keys[:: max(1, len(keys) // 50)]:
        got = impl.get(k)
        if got != value:
            raise AssertionError(f"{impl.name}: get({k!r}) after populate returned "
                                 f"{type(got).__name__} of {len(got or b'')} bytes, not the value")
    if "set" in impl.supports:
        for k in missing[:5]:
            if impl.get(k) is not None:
                raise AssertionError(f"{impl.name}: get({k!r}) of a missing key found something")


def run(cfg: Settings, scratch: Scratch, redis_port: int | None,
        cases: Sequence[str] = CASES) -> list[dict[str, Any]]:
    keys = make_keys(cfg.keys)
    missing = make_keys(cfg.keys, prefix="nokey:")
    rows: list[dict[str, Any]] = []
    for vsize in cfg.value_sizes:
        value = os.urandom(vsize)
        flags_rng = random.Random(90_10)
        flags = [flags_rng.random() < 0.10 for _ in range(cfg.keys)]
        windows = _Windows(keys, seed=vsize)
        dkv = {mode: DurableKV(mode) for mode in ("log", "none", "fsync")}
        store = [DurableKV("log", page_size=ps, max_entries=cfg.store_tier_entries,
                           label=f"durablekv-store-ps{ps}") for ps in (16, 1)]
        for s in store:
            s.name = f"durablekv (page fault, page_size={s.page_size})"
        # the fallback's twins of the target cases' adapters, taking turns with them
        # (--quick: the log adapter's twin only, so the smoke run stays short)
        pure = dict(zip(("log", "store"), pure_twins(
            [dkv["log"]] if cfg.mode == "quick" else [dkv["log"], store[0]])))
        others = competitors(redis_port)
        everyone: list[Impl] = [*dkv.values(), *store, *pure.values(), *others]
        opened: list[Impl] = []
        dirs: list[str] = []
        try:
            for impl in everyone:
                t0 = time.perf_counter()
                dirs.append(scratch.sub(impl.key))
                impl.open(dirs[-1], cfg.keys)
                opened.append(impl)
                impl.populate(keys, value)
                _verify(impl, keys, value, missing)
                note(f"micro {vsize} B: {impl.name} filled with {cfg.keys:,} keys in "
                     f"{time.perf_counter() - t0:.1f} s")
            # Everything filled so far lives until the end of this value size:
            # move it out of the collector's view, so the gc.collect() before
            # each timed run stays short (the runs themselves pause the GC).
            gc.collect()
            gc.freeze()
            if "get_hit_store" in cases:
                for s in store:
                    st = s.cache.stats()
                    assert st.pending_pages == 0 and st.dirty_pages == 0, st
            plain = [i for i in others if "set" in i.supports]
            twin = [pure["log"]] if pure else []
            lineup = {
                "get_hit_memory": [dkv["log"], *twin, *others],
                "get_hit_store": [*store, *([pure["store"]] if "store" in pure else []),
                                  *[i for i in others if i.family in ("disk", "server")]],
                "get_miss": [dkv["log"], *plain],
                "set": [dkv["none"], dkv["log"], *twin, dkv["fsync"], *plain],
                "set_threads": [dkv["none"], dkv["log"], dkv["fsync"], *plain],
                "mix_90_10": [dkv["log"], *plain],
                "delete": [dkv["log"], *plain],
            }
            for name in ("get_hit_memory", "get_hit_store", "get_miss", "set", "set_threads",
                         "mix_90_10", "delete"):
                if name not in cases:
                    continue
                t0 = time.perf_counter()
                case = _Case(name, value, missing, cfg.threads)
                rows += _measure(case, lineup[name], windows, flags, cfg, vsize)
                note(f"micro {vsize} B: {name} done in {time.perf_counter() - t0:.1f} s")
        finally:
            gc.unfreeze()
            for impl in opened:
                try:
                    impl.close()
                except Exception as exc:  # noqa: BLE001 - report, keep closing the rest
                    note(f"closing {impl.name} failed: {exc!r}")
            for path in dirs:
                scratch.remove(path)
    return rows
