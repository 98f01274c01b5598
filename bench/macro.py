"""Macro cases: look-aside replays of the real traces in ../shared/traces.

Every request of the trace (a prefix of ``macro_prefix`` requests in normal
mode, the whole trace with ``--full``) goes through the same loop for every
implementation: a get that misses is followed by a set of a value of the
trace's size (100 B when the trace has none); a set op sets. The requests
are read into memory first, so trace parsing is not timed. The garbage
collector stays on (this is a throughput, not a per-op, number).

Configurations per trace, memory tier at 1% and 10% of the unique keys in
the replayed requests (``slots``):

* durablekv, ``page_size=16``, ``max_pages=ceil(slots/16)`` (the default page size)
* durablekv, ``page_size=1``, ``max_pages=slots`` (exactly an LRU of ``slots`` entries)
* ``cachetools.LRUCache(maxsize=slots)``
* ``diskcache.Cache`` (defaults; unbounded here, so it does not depend on ``slots``)

durablekv keeps every key in its SQLite store, so its hits are split by
tier: ``memory`` (the page was resident) and ``store`` (a page fault). The
memory hits are checked against :func:`bench.sim.page_lru` (and, for
``page_size=1``, against the entry LRU and cachetools): ``exact`` in the results.

``metakv_cachelib_sample1.csv`` is left out: 691 requests over 52 keys
(a format fixture, as the traces README says) give no meaningful memory
tier at 1%. In normal mode the values of ``cloudPhysicsIO.csv`` (median
53 KB) are capped at ``VALUE_CAP`` bytes: with real sizes one replay
writes ~5 GB and takes ~40 s per configuration; ``--full`` uses real sizes.
"""

from __future__ import annotations

import math
import time
from typing import Any, Callable

from . import sim
from .impls import missing_module
from .util import TRACES, Scratch, Settings, note, rotate, summarize

TRACE_FILES = ("cache2k_orm-busy.i32be", "arc_OLTP.lis", "scarab_recs.i64be",
               "cloudPhysicsIO.csv")
DEFAULT_VALUE = 100
VALUE_CAP = 4096


def _loop(get: Callable[[Any], Any], set_: Callable[[Any, Any], Any],
          delete: Callable[[Any], Any], req: sim.Requests, values: list[bytes]) -> tuple[int, float]:
    """The look-aside replay; returns (get hits, seconds)."""
    hits = 0
    GET, SET = sim.GET, sim.SET
    t0 = time.perf_counter()
    for op, k, v in zip(req.ops, req.keys, values):
        if op == GET:
            if get(k) is None:
                set_(k, v)
            else:
                hits += 1
        elif op == SET:
            set_(k, v)
        else:
            delete(k)
    return hits, time.perf_counter() - t0


class _Run:
    """One configuration of one trace: builds a fresh store per repetition."""

    def __init__(self, key: str, name: str, fraction: float | None, page_size: int | None,
                 slots: int | None) -> None:
        self.key, self.name, self.fraction = key, name, fraction
        self.page_size, self.slots = page_size, slots
        self.samples: list[float] = []
        self.results: list[dict[str, Any]] = []

    def once(self, req: sim.Requests, values: list[bytes], scratch: Scratch) -> None:
        extra: dict[str, Any] = {}
        if self.key.startswith("durablekv"):
            from durablekv import Cache
            d = scratch.sub("replay-dkv")
            max_pages = math.ceil(self.slots / self.page_size)
            c = Cache(d, page_size=self.page_size, max_pages=max_pages, durability="log")
            try:
                hits, secs = _loop(c.get, c.set, c.delete, req, values)
                st = c.stats()
                t0 = time.perf_counter()
                c.flush()
                extra["final_flush_seconds"] = time.perf_counter() - t0
            finally:
                c.close()
                scratch.remove(d)
            extra.update(max_pages=max_pages, memory_hits=st.memory_hits,
                         store_hits=st.store_hits, misses=st.misses, page_faults=st.page_faults,
                         evictions=st.evictions, flushes=st.flushes,
                         flushed_pages=st.flushed_pages)
            assert st.hits == hits, (st, hits)
        elif self.key == "cachetools":
            import cachetools
            c = cachetools.LRUCache(maxsize=self.slots)
            hits, secs = _loop(c.get, c.__setitem__, lambda k: c.pop(k, None), req, values)
        elif self.key == "diskcache":
            import diskcache
            d = scratch.sub("replay-diskcache")
            c = diskcache.Cache(d)
            try:
                hits, secs = _loop(c.get, c.set, c.delete, req, values)
            finally:
                c.close()
                scratch.remove(d)
        else:  # pragma: no cover
            raise ValueError(self.key)
        self.samples.append(len(req.ops) / secs)
        self.results.append({"hits": hits, "seconds": secs, **extra})


def _values(req: sim.Requests, cap: int | None) -> list[bytes]:
    cache: dict[int, bytes] = {}
    out = []
    for size in req.sizes:
        size = size if size > 0 else DEFAULT_VALUE
        if cap is not None:
            size = min(size, cap)
        v = cache.get(size)
        if v is None:
            v = cache[size] = b"\x00" * size
        out.append(v)
    return out


def run(cfg: Settings, scratch: Scratch, traces: tuple[str, ...] = TRACE_FILES) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for name in traces:
        path = TRACES / name
        if not path.exists():
            note(f"macro: {path} is missing; skipped")
            continue
        t0 = time.perf_counter()
        req = sim.load(path, cfg.macro_prefix)
        cap = VALUE_CAP if (cfg.mode != "full" and name.startswith("cloudPhysics")) else None
        values = _values(req, cap)
        runs: list[_Run] = []
        for f in cfg.macro_fractions:
            slots = sim.slots_for(req, f)
            runs.append(_Run("durablekv-ps16", "durablekv (page_size=16)", f, 16, slots))
            runs.append(_Run("durablekv-ps1", "durablekv (page_size=1)", f, 1, slots))
            if missing_module("cachetools") is None:
                runs.append(_Run("cachetools", "cachetools.LRUCache", f, None, slots))
        if missing_module("diskcache") is None:
            runs.append(_Run("diskcache", "diskcache.Cache (unbounded)", None, None, None))
        for r in range(cfg.slow_repeat):
            for run_ in rotate(runs, r):
                run_.once(req, values, scratch)
        # expected memory hits from the simulators
        for run_ in runs:
            res = run_.results[-1]
            row: dict[str, Any] = {
                "case": "replay", "trace": name, "requests": len(req.ops), "gets": req.gets,
                "unique_keys": req.unique, "whole_trace": req.whole, "impl": run_.key,
                "name": run_.name, "fraction": run_.fraction, "slots": run_.slots,
                "page_size": run_.page_size, "value_cap": cap, "unit": "requests/s",
                **summarize(run_.samples),
                "hit_ratio": res["hits"] / max(req.gets, 1),
                "seconds": summarize([x["seconds"] for x in run_.results]),
                "last_run": res,
            }
            if run_.key.startswith("durablekv"):
                gets = max(req.gets, 1)
                row["memory_hit_ratio"] = res["memory_hits"] / gets
                row["store_hit_ratio"] = res["store_hits"] / gets
                expect = sim.page_lru(req, run_.page_size, res["max_pages"])
                row["simulated"] = expect
                row["exact"] = (expect["memory_hits"] == res["memory_hits"]
                                and expect["store_hits"] == res["store_hits"])
            elif run_.key == "cachetools":
                row["simulated_lru_hits"] = lru_hits = sim.lru(req, run_.slots)
                row["exact"] = lru_hits == res["hits"]
            ref = sim.REFERENCE.get((name, run_.slots)) if req.whole else None
            if ref is not None and run_.key in ("durablekv-ps1", "cachetools"):
                # --full: the exact LRU must reproduce the traces README's table
                got = res["memory_hits"] if run_.key == "durablekv-ps1" else res["hits"]
                row["reference_lru_hits"] = ref[0]
                row["matches_reference"] = got == ref[0]
            rows.append(row)
        note(f"macro {name}: {len(req.ops):,} requests, {len(runs)} configurations x "
             f"{cfg.slow_repeat} in {time.perf_counter() - t0:.1f} s")
    return rows
