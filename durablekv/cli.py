"""durablekv command line: replay cache traces, check and salvage cache directories,
serve one over HTTP, and run the LLM KV-block bench.

``durablekv replay [TRACE]`` replays a cache access trace (or, with no TRACE,
a generated Zipf workload) through a Cache as look-aside caching and reports
hit ratios by tier, evictions, page faults, flushes, throughput and latency.
``durablekv check DIR`` verifies a closed cache directory.
``durablekv salvage DIR`` opens a cache whose replay log is damaged with
``salvage_log=True`` and closes it again, writing nothing else.
``durablekv serve DIR`` serves a cache over HTTP; ``durablekv llm-bench``
runs the LLM KV-block workload.
"""

from __future__ import annotations

import argparse
import array
import json
import math
import os
import secrets
import signal
import sys
import textwrap
import tempfile
import threading
import time
from typing import Any, Sequence

from . import __version__
from .config import DEFAULT_MAX_VALUE_BYTES as MAX_VALUE_BYTES
from .errors import ConfigError, DurableKVError, TraceFormatError
from .lifecycle import remove_tree
from .policies import POLICIES, is_exact_lru, residency
from .cliargs import (add_byte_limit_arguments, float_between as _float_between,
                      non_negative_float as _non_negative_float, port as _port,
                      positive_float as _positive_float, positive_int as _positive_int)
from .stores.sqlitefile import stored_meta as _stored_meta, stored_serializer as _stored_serializer
from .traces import FORMATS, open_trace, zipf_workload

__all__ = ["main", "replay"]

_MISS = object()


class TraceClock:
    """The trace's own clock, used as the cache's TTL clock during a replay."""

    __slots__ = ("now",)

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _percentile_us(samples: "array.array[int]", q: float) -> float:
    if not samples:
        return 0.0
    ordered = sorted(samples)
    idx = min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))
    return ordered[idx] / 1000.0


def replay(trace: Any, directory: str, *, page_size: int | None = None, max_pages: int = 4096,
           durability: str = "log", flush_interval: float = 0.05, value_size: int = 100,
           limit: int | None = None, metrics_port: int | None = None, hold: float = 0.0,
           progress: bool | None = None, name: str | None = None,
           on_corruption: str = "raise", salvage_log: bool = False,
           on_report: Any = None, serializer: str = "safe",
           policy: str = "lru", max_memory_bytes: int | None = None,
           size_limit: int | None = None) -> dict[str, Any]:
    """Replay ``trace`` (an iterable of :class:`~durablekv.traces.Request`) into a
    cache at ``directory``; return the report as a flat dict.

    Look-aside: a get that misses is followed by a set of a value of the
    request's size (``value_size`` bytes when the trace has no sizes); set
    ops set; delete ops delete. TTLs follow the trace's own timestamps.
    ``page_size`` None adopts an existing cache's (16 for a new one).
    ``serializer`` is passed to :class:`~durablekv.Cache` (``"safe"``,
    ``"json"`` (another name for it) or ``"pickle"``); an existing cache
    must be opened with the one it was created with.
    ``policy`` is the memory tier's replacement policy (``"lru"``, ``"midpoint"`` or
    ``"tinylfu"``, see :class:`~durablekv.Cache`). ``max_memory_bytes`` and
    ``size_limit`` (bytes, None: no bound) bound the memory tier and the store
    as in :class:`~durablekv.Cache`.
    ``on_report(report)`` is called as soon as the report is ready, before
    the ``hold`` seconds of metrics serving.

    :raises TraceFormatError: a malformed trace, or a value size over the
        cache's ``max_value_bytes``.
    :raises ConfigError: the metrics port cannot be served.
    """
    from tqdm import tqdm

    from .cache import Cache

    clock = TraceClock()
    values: dict[int, bytes] = {}
    gets = sets = deletes = fills = requests = 0
    get_ns = array.array("q")
    set_ns = array.array("q")
    server = None
    total = trace.size_hint() if hasattr(trace, "size_hint") else None
    if limit is not None:
        total = limit if total is None else min(total, limit)
    cache = Cache(directory, page_size=page_size, max_pages=max_pages, durability=durability,
                  flush_interval=flush_interval, clock=clock, name=name,
                  on_corruption=on_corruption, salvage_log=salvage_log,
                  serializer=serializer, policy=policy, max_memory_bytes=max_memory_bytes,
                  size_limit=size_limit)
    max_value = cache.max_value_bytes
    try:
        if metrics_port is not None:
            from .metrics import serve
            try:
                server = serve(cache, port=metrics_port)
            except OSError as exc:
                # the library's message (MetricsServeError); main() turns
                # "pick another port (port=0 ..." into --metrics-port
                raise ConfigError(str(exc)) from None
            print(f"metrics: {server.url}", file=sys.stderr, flush=True)
        bar = tqdm(total=total, unit="req", unit_scale=True, disable=None if progress is None
                   else not progress, file=sys.stderr, mininterval=0.5, smoothing=0.1)
        perf = time.perf_counter_ns
        get, set_ = cache.get, cache.set
        t_start = time.perf_counter()
        for req in trace:
            if limit is not None and requests >= limit:
                break
            requests += 1
            op, key, size, ttl, t = req
            if t is not None:
                clock.now = t
            if size <= 0:
                size = value_size
            elif size > max_value:
                raise TraceFormatError(getattr(trace, "path", "?"), None,
                                       f"request {requests}: value size {size} bytes is over "
                                       f"the cache's max_value_bytes ({max_value})",
                                       about_format=False)
            if op == "get":
                gets += 1
                t0 = perf()
                v = get(key, _MISS)
                t1 = perf()
                get_ns.append(t1 - t0)
                if v is _MISS:
                    val = values.get(size)
                    if val is None:
                        val = values[size] = b"\x00" * size
                    fills += 1
                    t0 = perf()
                    set_(key, val, ttl)
                    set_ns.append(perf() - t0)
            elif op == "set":
                sets += 1
                val = values.get(size)
                if val is None:
                    val = values[size] = b"\x00" * size
                t0 = perf()
                set_(key, val, ttl)
                set_ns.append(perf() - t0)
            else:
                deletes += 1
                cache.delete(key)
            if not requests & 0x3FFF:
                bar.update(0x4000)
                if _terminating[0]:
                    raise _Terminated()
        elapsed = time.perf_counter() - t_start
        bar.update(requests & 0x3FFF)
        bar.close()
        t0 = time.perf_counter()
        cache.flush()
        final_flush = time.perf_counter() - t0
        st = cache.stats()
        report = {
            "trace": getattr(trace, "path", str(trace)),
            "format": getattr(trace, "format", "?"),
            "page_size": cache.page_size,
            "max_pages": max_pages,
            "policy": policy,
            # entries the memory tier holds: the size of the LRU cache its
            # hit ratio compares with
            "memory_slots": cache.page_size * max_pages,
            "durability": durability,
            "requests": requests,
            "gets": gets,
            "sets": sets,
            "deletes": deletes,
            "fills": fills,
            "cache_sets": st.sets,
            "memory_hits": st.memory_hits,
            "store_hits": st.store_hits,
            "hits": st.hits,
            "misses": st.misses,
            "hit_ratio": st.hits / gets if gets else 0.0,
            "overall_hit_ratio": st.hits / gets if gets else 0.0,  # hit_ratio, by a clear name
            "memory_hit_ratio": st.memory_hits / gets if gets else 0.0,
            "store_hit_ratio": st.store_hits / gets if gets else 0.0,
            "evictions": st.evictions,
            "store_evictions": st.store_evictions,
            "max_memory_bytes": max_memory_bytes,
            "memory_bytes": st.memory_bytes,
            "size_limit": size_limit,
            "store_data_bytes": st.store_data_bytes,
            "store_file_bytes": st.store_bytes,
            "page_faults": st.page_faults,
            "expirations": st.expirations,
            "flushes": st.flushes,
            "flushed_pages": st.flushed_pages,
            "sets_per_flushed_page": st.sets / st.flushed_pages if st.flushed_pages else 0.0,
            "elapsed_seconds": elapsed,
            "final_flush_seconds": final_flush,
            "requests_per_second": requests / elapsed if elapsed > 0 else 0.0,
            "get_latency_p50_us": _percentile_us(get_ns, 0.50),
            "get_latency_p99_us": _percentile_us(get_ns, 0.99),
            "set_latency_p50_us": _percentile_us(set_ns, 0.50),
            "set_latency_p99_us": _percentile_us(set_ns, 0.99),
        }
        if on_report is not None:
            on_report(report)
        if server is not None and hold > 0:
            print(f"replay done; serving metrics for {hold:g} s more", file=sys.stderr, flush=True)
            time.sleep(hold)
    finally:
        try:
            cache.close()
        finally:
            if server is not None:
                server.close()
    return report


#: what an eviction from memory counts, by the tier's residency
_UNITS = {"page": "pages", "entry": "entries"}


def _print_report(r: dict[str, Any], out=None) -> None:
    def pct(x: float) -> str:
        return f"{100 * x:6.2f} %"

    slots = r.get("memory_slots", r["page_size"] * r["max_pages"])
    if r.get("max_memory_bytes") is not None:
        # the byte bound, not the slots, may be what limits the tier
        compare = "<- bounded by bytes too: not an LRU figure of a fixed entry count"
        tier = (f"the memory tier holds at most {slots:,} entries and "
                f"{r['max_memory_bytes']:,} bytes of them; an entry-count LRU of the same "
                f"memory holds as many entries as fit in those bytes")
    elif residency(r.get("policy", "lru")) == "entry":
        # residency per entry: the budget is max_pages x page_size entries
        compare = f"<- compare this one with an LRU cache of {slots:,} entries"
        tier = (f"the memory tier holds at most {slots:,} entries (midpoint: residency per "
                f"entry, a page fault's neighbours entering at the midpoint)")
    elif r["page_size"] == 1:
        compare = f"<- compare this one with an LRU cache of {slots:,} entries"
        tier = ("the memory tier is exactly such an LRU"
                if is_exact_lru(r.get("policy", "lru"), r["page_size"])
                else f"the memory tier runs {r['policy']} over {slots:,} entries")
    else:
        # A page fault brings back a whole page from the store, so a faulted
        # key's neighbours then hit in memory: a single-tier LRU of this many
        # entries has no such store to read them from.
        compare = "<- not an LRU figure at this page size"
        tier = (f"a page fault reads back all {r['page_size']} entries of a page from the store, "
                f"so neighbours of a faulted key count as memory hits; for a figure to compare "
                f"with an LRU cache of {slots:,} entries, replay with --page-size 1 "
                f"--max-pages {slots}")

    def bound(v: Any) -> str:
        return "none" if v is None else f"{v:,}"

    bounded_store = r.get("size_limit") is not None
    lines = [
        f"trace              {r['trace']} ({r['format']})",
        f"cache              page_size={r['page_size']} max_pages={r['max_pages']} "
        f"policy={r.get('policy', 'lru')} durability={r['durability']}",
        f"requests           {r['requests']:,}  (gets {r['gets']:,}, sets {r['sets']:,}, "
        f"deletes {r['deletes']:,})",
        # The memory tier is the cache of bounded size; the store never
        # evicts, so the overall ratio is no LRU figure.
        f"memory hit ratio   {pct(r['memory_hit_ratio'])} of gets  {compare}",
        *(f"                   {line}" for line in textwrap.wrap(f"({tier})", 70)),
        f"overall hit ratio  {pct(r['hit_ratio'])} of gets  (memory, plus store "
        f"{pct(r['store_hit_ratio']).strip()}" + (
            f": the store is bounded by size_limit={r['size_limit']:,} bytes)" if bounded_store
            else ": the store never evicts,"),
        *(() if bounded_store else (
            "                   so this is the hit ratio of an unbounded cache, not of one "
            "this size)",)),
        f"hits               memory {r['memory_hits']:,}, store {r['store_hits']:,}, "
        f"misses {r['misses']:,}",
        f"evictions          {r['evictions']:,} "
        f"{_UNITS[residency(r.get('policy', 'lru'))]} from memory, "
        f"{r.get('store_evictions', 0):,} from the store",
        f"memory bytes       {r.get('memory_bytes', 0):,} resident "
        f"(max_memory_bytes {bound(r.get('max_memory_bytes'))})",
        f"store bytes        {r.get('store_data_bytes', 0):,} in pages, "
        f"{r.get('store_file_bytes', 0):,} on disk (size_limit {bound(r.get('size_limit'))})",
        *(["                   (above size_limit: pages resident in memory are never evicted "
           "from the store;", "                   give size_limit room for the memory tier, "
           "see docs/api.md)"]
          if r.get("size_limit") is not None and r.get("store_data_bytes", 0) > r["size_limit"]
          else []),
        f"page faults        {r['page_faults']:,}",
        f"flushes            {r['flushes']:,} ({r['flushed_pages']:,} pages written for "
        f"{r['cache_sets']:,} cache sets: the trace's sets plus a fill per get miss)",
        f"throughput         {r['requests_per_second']:,.0f} requests/s "
        f"({r['elapsed_seconds']:.2f} s, then {r['final_flush_seconds']:.2f} s final flush)",
        f"get latency        p50 {r['get_latency_p50_us']:.1f} us, p99 {r['get_latency_p99_us']:.1f} us",
        f"set latency        p50 {r['set_latency_p50_us']:.1f} us, p99 {r['set_latency_p99_us']:.1f} us",
    ]
    print("\n".join(lines), file=sys.stdout if out is None else out)  # stdout at call time


class _SubcommandParser(argparse.ArgumentParser):
    """A subcommand's parser: it refuses arguments it does not know itself.

    argparse hands a subcommand's unknown arguments back to the top-level
    parser, which then prints its own usage (``durablekv [-h] [--version]
    {replay,check} ...``) instead of the subcommand's options. Refused here,
    the error comes with ``usage: durablekv replay ...`` (exit status 2).
    """

    def parse_known_args(self, args=None, namespace=None):
        # Options it does not know, spotted first: argparse would otherwise
        # report a missing positional (``check --bogus``: "required: dir")
        # and never mention the option that was mistyped.
        args = list(args) if args is not None else None
        before = args[:args.index("--")] if args and "--" in args else (args or [])
        self._unknown_options = [a for a in before if self._is_unknown_option(a)]
        namespace, extras = super().parse_known_args(args, namespace)
        if extras:
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return namespace, extras

    def _is_unknown_option(self, arg: str) -> bool:
        if not arg.startswith("-") or arg == "-":
            return False
        try:
            float(arg)
            return False  # a negative number is a value
        except ValueError:
            pass
        name = arg.split("=", 1)[0]
        # argparse accepts an unambiguous prefix of a long option
        return not any(opt == name or (name.startswith("--") and opt.startswith(name))
                       for opt in self._option_string_actions)

    def error(self, message: str):
        unknown = getattr(self, "_unknown_options", None)
        if unknown and message.startswith("the following arguments are required"):
            message = f"unrecognized arguments: {' '.join(unknown)}"
        super().error(message)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="durablekv", description=__doc__.split("\n\n")[0])
    parser.add_argument("--version", action="version", version=f"durablekv {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_SubcommandParser)

    p = sub.add_parser("replay", help="replay a cache trace (or a Zipf workload) and report",
                       description="Replay a cache access trace through durablekv as look-aside "
                       "caching (a get that misses is followed by a set) and report hit ratios "
                       "by tier, evictions, page faults, flushes, throughput and latency. "
                       "Formats: " + ", ".join(FORMATS) + ". With no TRACE, a seeded Zipf "
                       "workload is replayed.")
    p.add_argument("trace", nargs="?", help="trace file (omit for a generated Zipf workload)")
    p.add_argument("--format", default="auto", choices=("auto",) + FORMATS,
                   help="trace format (default: from the file name or CSV header)")
    # (type=: a leading ~ is the home directory, as for Cache: no shell
    # expands it in --dir=~/c, or in a quoted or unit-file argument)
    p.add_argument("--dir", type=os.path.expanduser,
                   help="cache directory (default: a temporary directory, removed "
                   "afterwards); an existing cache there is reopened and replayed into")
    p.add_argument("--page-size", type=_positive_int, default=None,
                   help="slots per page (default: an existing cache's, else 16)")
    p.add_argument("--max-pages", type=_positive_int, default=4096,
                   help="pages resident in memory (default 4096)")
    p.add_argument("--policy", choices=POLICIES, default="lru",
                   help="the memory tier's replacement policy (default lru; docs/policy.md)")
    add_byte_limit_arguments(p)
    p.add_argument("--durability", choices=("fsync", "log", "none"), default="log",
                   help="what a set survives: fsync (power loss), log (a killed process; the "
                   "default), none (no replay log); see docs/durability.md")
    p.add_argument("--flush-interval", type=_positive_float, default=0.05,
                   help="seconds between write-behind flushes (default 0.05)")
    p.add_argument("--value-size", type=_positive_int, default=100,
                   help="bytes per value when the trace has no sizes (default 100)")
    p.add_argument("--limit", type=_positive_int, help="replay only the first N requests")
    p.add_argument("--requests", type=_positive_int,
                   help="Zipf workload: requests (default 1,000,000)")
    p.add_argument("--keys", type=_positive_int,
                   help="Zipf workload: distinct keys (default 100,000)")
    p.add_argument("--alpha", type=_float_between(0.0, 100.0),
                   help="Zipf workload: skew (default 0.99)")
    p.add_argument("--set-fraction", type=_float_between(0.0, 1.0),
                   help="Zipf workload: share of set requests (default 0.1)")
    p.add_argument("--seed", type=int, help="Zipf workload: random seed (default 0)")
    p.add_argument("--metrics-port", type=_port,
                   help="serve Prometheus /metrics on 127.0.0.1:PORT during the replay (0: any free port)")
    p.add_argument("--hold", type=_non_negative_float, default=0.0,
                   help="with --metrics-port: keep serving this many seconds after the replay")
    p.add_argument("--json", metavar="REPORT", help="also write the report as JSON to this file")
    p.add_argument("--on-corruption", choices=("raise", "rebuild"), default="raise",
                   help="a damaged page store: stop (default), or move it aside and start empty")
    p.add_argument("--serializer", choices=SERIALIZERS,
                   help="with --dir: the cache's serializer ('json' is another name for "
                   "'safe'; default: the one an existing store records, else safe)")
    p.add_argument("--salvage-log", action="store_true",
                   help="a replay log damaged before its tail: keep the good prefix, move the "
                   "damaged file aside (loses the records after the damage), then replay into "
                   "the directory; `durablekv salvage DIR` salvages without replaying")
    p.add_argument("--progress", dest="progress", action="store_true", default=None,
                   help="always show a progress bar (default: only on a terminal)")
    p.add_argument("--no-progress", dest="progress", action="store_false",
                   help="never show a progress bar")
    p.set_defaults(func=_cmd_replay)

    c = sub.add_parser("check", help="verify a closed cache directory",
                       description="Verify a cache directory that no process has open: SQLite "
                       "integrity, the key index against the pages, the replay log's records "
                       "and CRCs. It changes nothing (a store from an older durablekv is not "
                       "upgraded). Exit status 0 when healthy, 1 on damage, 2 when it could not "
                       "check.")
    c.add_argument("dir", type=os.path.expanduser, help="cache directory")
    c.set_defaults(func=_cmd_check)

    s = sub.add_parser("salvage", help="open a cache whose replay log is damaged, keeping "
                       "the records before the damage",
                       description="Open a closed cache directory with salvage_log=True and "
                       "close it again, writing nothing of its own: the log records before the "
                       "first damage go to the store, and the damaged segment and every later "
                       "one are moved aside (replay-*.log.damaged). The writes behind the "
                       "damage are lost. Run `durablekv check DIR` first: it says whether "
                       "salvage is needed and how many records it keeps. Exit status 0 when "
                       "the cache opened (salvaged or not), 1 when the cache refused to open "
                       "(open in another process, a damaged store), 2 for a DIR that is not a "
                       "cache directory, a bad option or a file system error.")
    s.add_argument("dir", type=os.path.expanduser, help="cache directory")
    s.add_argument("--serializer", choices=SERIALIZERS,
                   help="the cache's serializer ('json' is another name for 'safe'; default: "
                   "the one its store records; needed when pages.sqlite3 is missing)")
    s.add_argument("--on-corruption", choices=("raise", "rebuild"), default="raise",
                   help="a damaged page store: stop (default), or move it aside and start "
                   "empty, then apply the replay log (as replay --on-corruption does); "
                   "rebuild first checks the whole store as `durablekv check` does, so it "
                   "also finds damage an open does not look for (a page failing its checksum)")
    s.set_defaults(func=_cmd_salvage)

    b = sub.add_parser("llm-bench", help="LLM KV blocks: batching, prefix caching, durable tier",
                       description="Run seeded multi-turn chats through the paged KV cache "
                       "(durablekv.llm; needs the llm extra) and compare, in one run, static vs "
                       "continuous batching and prefix caching off / memory / memory + "
                       "durablekv / after a restart. See docs/llm.md.")
    b.add_argument("--json", metavar="OUT", help="also write the report as JSON to this file")
    b.add_argument("--quick", action="store_true", help="a small run (a few seconds), no plots")
    b.add_argument("--plots", metavar="DIR", help="also write PNG plots into DIR (needs "
                   "matplotlib: pip install '.[bench]'; default: no plots)")
    b.add_argument("--repeats", type=_positive_int, help="runs per configuration (default 3; "
                   "1 with --quick); medians with min/max")
    b.add_argument("--output-spread", type=_float_between(0.0, 1.0),
                   help="output lengths vary by this share around their mean (default 0.5)")
    b.add_argument("--seed", type=int, default=0, help="workload and weight seed (default 0)")
    b.add_argument("--progress", dest="progress", action="store_true", default=None,
                   help="always show a progress bar (default: only on a terminal)")
    b.add_argument("--no-progress", dest="progress", action="store_false",
                   help="never show a progress bar")
    b.set_defaults(func=_cmd_llm_bench)
    for sp in (p, c, s, b):
        sp.set_defaults(flags=frozenset(sp._option_string_actions))

    from .server.command import add_arguments as _serve_arguments  # no FastAPI import
    v = sub.add_parser("serve", help="serve a cache directory over HTTP (the server extra)",
                       description="Serve DIR over HTTP (FastAPI on uvicorn): PUT/GET/HEAD/"
                       "DELETE /v1/keys/KEY, POST /v1/keys/KEY/incr and /touch, POST /v1/batch, "
                       "/metrics, /healthz. Prints 'durablekv serving DIR on http://HOST:PORT' once "
                       "listening; SIGTERM or SIGINT drains, flushes, closes and exits 0. "
                       "See docs/server.md.")
    _serve_arguments(v)
    v.set_defaults(flags=frozenset(v._option_string_actions))
    return parser


#: The Zipf workload's options and their defaults (None on the command line
#: means "not given", so that giving one with a TRACE is an error).
#: ``--serializer`` choices: Cache's serializer names ("json" is another
#: name for "safe").
SERIALIZERS = ("safe", "json", "pickle")

_ZIPF_DEFAULTS = {"requests": 1_000_000, "keys": 100_000, "alpha": 0.99,
                  "set_fraction": 0.1, "seed": 0}


def _cmd_replay(args: argparse.Namespace) -> int:
    if args.hold and args.metrics_port is None:
        raise ConfigError("--hold keeps the metrics endpoint up after the replay; "
                          "it needs --metrics-port")
    if args.value_size > MAX_VALUE_BYTES:
        raise ConfigError(f"--value-size {args.value_size} is over the cache's largest value "
                          f"({MAX_VALUE_BYTES} bytes); pass at most --value-size {MAX_VALUE_BYTES}")
    if args.trace is not None:
        zipf_only = [f"--{n.replace('_', '-')}" for n in _ZIPF_DEFAULTS
                     if getattr(args, n) is not None]
        if zipf_only:
            raise ConfigError(f"{', '.join(zipf_only)} shape the generated Zipf workload and "
                              "do nothing with a TRACE; use --limit N to replay the first N "
                              "requests of a trace")
        if os.path.isdir(args.trace):
            raise ConfigError(f"TRACE {args.trace!r} is a directory; pass a trace file "
                              "(e.g. one of ../shared/traces/*)")
    if args.json:
        parent = os.path.dirname(os.path.abspath(args.json))
        if os.path.isdir(args.json):
            raise ConfigError(f"cannot write the JSON report to {args.json!r}: it is a "
                              "directory; name a file")
        if not os.path.isdir(parent) or not os.access(parent, os.W_OK):
            raise ConfigError(f"cannot write the JSON report to {args.json!r}: "
                              f"{parent!r} is not a writable directory")
    for name, default in _ZIPF_DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, default)
    if args.trace is None:
        trace: Any = zipf_workload(requests=args.requests, keys=args.keys, alpha=args.alpha,
                                   seed=args.seed, set_fraction=args.set_fraction,
                                   value_size=args.value_size)
    else:
        trace = open_trace(args.trace, args.format)
    tmp = None
    directory = args.dir
    if directory is None:
        # Named here, made in the try below that removes it: SIGTERM's
        # exception may land as mkdir returns (tempfile.mkdtemp would then
        # leave a directory whose name nothing here knows).
        tmp = directory = os.path.join(tempfile.gettempdir(),
                                       f"durablekv-replay-{secrets.token_hex(8)}")
    serializer = args.serializer
    if serializer is None:
        # an existing store says what it holds; a new cache gets the default
        serializer = (_stored_serializer(directory) if os.path.isdir(directory) else None) \
            or "safe"
    json_failed: list[str] = []

    def report_ready(report: dict[str, Any]) -> None:
        # The report first: a long replay's results must reach the terminal
        # even when the JSON file cannot be written (its directory removed
        # meanwhile, a full disk); a closed stdout (`| head`) is caught, so
        # the JSON is still written after it.
        try:
            _print_report(report)
            sys.stdout.flush()
        except BrokenPipeError:
            # The reader left; Python would report the pipe again at exit.
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        if args.json:
            path = os.path.abspath(args.json)
            try:
                with open(path, "w", encoding="utf-8") as f:
                    json.dump(report, f, indent=2)
                    f.write("\n")
            except OSError as exc:
                json_failed.append(path)
                print(f"durablekv: the replay finished (report above), but its JSON report "
                      f"could not be written to {path!r}: {exc.strerror or exc}; pass "
                      "--json a path in a writable directory", file=sys.stderr)

    try:
        if tmp is not None:
            try:
                os.mkdir(tmp, 0o700)
            except FileExistsError:
                tmp = None  # not this replay's: never removed here
                raise
        replay(trace, directory, page_size=args.page_size, max_pages=args.max_pages,
               durability=args.durability, flush_interval=args.flush_interval,
               value_size=args.value_size, limit=args.limit,
               metrics_port=args.metrics_port, hold=args.hold, progress=args.progress,
               name="replay" if tmp else None, on_corruption=args.on_corruption,
               salvage_log=args.salvage_log, on_report=report_ready,
               serializer=serializer, policy=args.policy,
               max_memory_bytes=args.max_memory_bytes, size_limit=args.size_limit)
    finally:
        if tmp is not None:
            remove_tree(tmp)
    return 1 if json_failed else 0


def _cmd_llm_bench(args: argparse.Namespace) -> int:
    # The model's matrices are tiny: threaded BLAS only adds hand-offs (about 6x
    # slower on a shared 2-core machine). Must be set before numpy loads.
    for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(var, "1")
    try:
        from .llm.bench import main as llm_bench  # numpy: the llm extra
    except ImportError as exc:
        print(f"durablekv: llm-bench needs numpy ({exc}); pip install 'durablekv[llm]'",
              file=sys.stderr)
        return 2
    return llm_bench(args)


def _cmd_check(args: argparse.Namespace) -> int:
    from .check import check_directory

    result = check_directory(args.dir)
    for line in result.lines:
        print(line)
    return 0 if result.ok else 1 if result.damaged else 2


def _mark_store_damage(directory: str) -> None:
    """Before a rebuilding salvage: check the page store as ``durablekv
    check`` does and record damage found in its damage marker, so that the
    open rebuilds it. An open reads no more of the store than it needs (even
    rebuild mode's ``quick_check`` sees only SQLite's structure), so a page
    that fails its checksum, or a key index that disagrees with the pages,
    would otherwise be left in place, to fail a read later."""
    from .check import COUNT_ONLY, check_directory
    from .stores.sqlitefile import DAMAGE_MARKER, STORE_FILE, mark_damaged
    store = os.path.join(directory, STORE_FILE)
    if not os.path.isfile(store) or os.path.exists(os.path.join(directory, DAMAGE_MARKER)):
        return  # nothing to check, or the open refuses (rebuilds) it anyway
    # (a wrong count alone is no reason to throw the store away)
    found = [line[8:] for line in check_directory(directory, log=False).lines
             if line.startswith("DAMAGE") and COUNT_ONLY not in line]
    if found:
        more = f" (and {len(found) - 1} more problems)" if len(found) > 1 else ""
        mark_damaged(store, f"durablekv salvage found: {found[0]}{more}")
        where = "" if found[0].startswith(store) else f"{store}: "
        print(f"note    {where}{found[0]}{more}; marked damaged, so the open below "
              "rebuilds it")


def _cmd_salvage(args: argparse.Namespace) -> int:
    from .cache import Cache
    directory = args.dir
    if not os.path.exists(directory):
        raise ConfigError(f"no such directory: {directory!r}; name a cache directory")
    if not os.path.isdir(directory):
        raise ConfigError(f"{directory!r} is a file, not a cache directory")
    from .log.segments import list_segments
    from .stores.sqlitefile import STORE_FILE
    store = os.path.join(directory, STORE_FILE)
    if not list_segments(directory) and not (os.path.exists(store) and os.path.getsize(store)):
        # Opening would make a new, empty cache here (an empty file is what
        # SQLite leaves when it is asked to open a path that was not there).
        what = "is empty" if os.path.exists(store) else "is missing"
        hint = ("; it is a ShardedCache directory: salvage each shard-NN directory in it"
                if os.path.exists(os.path.join(directory, "SHARDS")) else "")
        raise ConfigError(f"{directory!r} is not a durablekv cache directory ({STORE_FILE} "
                          f"{what}, no replay log); salvage repairs an existing cache{hint}")

    def aside() -> set[str]:
        return {n for n in os.listdir(directory) if n.endswith(".damaged")}

    serializer = args.serializer
    if serializer is None:
        serializer = _stored_serializer(directory)
        if serializer is None:
            # The log does not say which serializer wrote its values; a
            # wrong guess would fail halfway and leave a store that claims it.
            raise ConfigError(f"{directory!r} has a replay log but no {STORE_FILE} to say which "
                              "serializer wrote it; pass --serializer safe (the default when "
                              "the cache was made) or --serializer pickle")
    page_size = None
    if args.on_corruption == "rebuild":
        _mark_store_damage(directory)
        # A rebuilt store keeps the damaged one's page_size (when it can be
        # read), so the application opens it with the page_size it passes.
        stored = _stored_meta(directory, "page_size")
        page_size = stored if type(stored) is int and stored >= 1 else None
    before = aside()
    # Opening does the salvage; closing flushes and checkpoints. Nothing
    # else is written (unlike `replay --salvage-log`, which then replays).
    with Cache(directory, salvage_log=True, serializer=serializer, page_size=page_size,
               on_corruption=args.on_corruption) as cache:
        st = cache.stats()
        rebuilt = cache.store_rebuilds
        lost = cache.salvage_lost
    moved = sorted(aside() - before)
    print(f"ok      replay log: {st.recovered_records} records after the store's checkpoint "
          "applied and stored")
    if st.torn_records:
        print(f"note    replay log: cut a torn tail ({st.torn_records} record"
              f"{'s' if st.torn_records != 1 else ''}) off the last segment, as every open does")
    if lost is not None:
        print(f"lost    replay log: {lost}")
    if not st.salvaged_bytes and lost is not None:
        print("result  SALVAGED: the cache opens normally now, with what the store and the "
              "log that is left hold; the writes the missing segments recorded are lost")
        return 0
    if not st.salvaged_bytes and rebuilt:
        print("result  REBUILT: the damaged store was moved aside (pages.sqlite3.corrupt-*, "
              "kept for inspection) and a new one made from the replay log; what only the "
              "damaged store held is not in the new one")
        return 0
    if not st.salvaged_bytes:
        print("result  NOTHING TO SALVAGE: the log had no damage that stops an open")
        return 0
    print(f"salvage gave up the {st.salvaged_bytes} bytes of log from the first damage to "
          "its end: the writes recorded there are lost")
    for name in moved:
        print(f"moved   {os.path.join(directory, name)}")
    print("result  SALVAGED: the cache opens normally now; the .damaged files are kept "
          "for inspection and may be deleted")
    return 0


#: The Python API's words in error messages, and the flags that do the same.
#: A message is rewritten only with flags its subcommand has (see
#: :func:`_for_cli`); tests/test_cli.py checks each flag exists somewhere.
_API_TO_FLAGS = (
    ("open it with serializer='pickle'", "pass --serializer pickle"),
    ("open it with serializer='safe'", "pass --serializer safe"),
    ("open it with serializer='json'", "pass --serializer json"),
    ("on_corruption='rebuild'", "--on-corruption rebuild"),
    ("salvage_log=True", "--salvage-log"),
    ("without page_size (or with page_size=", "without --page-size (or with --page-size "),
    ("format='i32be' or 'i64be'", "--format i32be or i64be"),
    ("format='i32be'", "--format i32be"),
    ("format='i64be'", "--format i64be"),
    ("Open with --salvage-log", "Run with --salvage-log"),
    ("pick another port (port=0 picks a free one)",
     "pick another --metrics-port (0 picks a free one)"),
)


def _flag_of(replacement: str) -> str:
    """The option a :data:`_API_TO_FLAGS` replacement names (``--serializer``)."""
    return next(w for w in replacement.split() if w.startswith("--"))


def _for_cli(exc: BaseException, flags: frozenset[str] | None = None) -> str:
    """An error message with the API's parameter names turned into flags.

    :param flags: the option strings of the subcommand that prints it; a
        phrase is rewritten only when that subcommand has the flag (a hint
        must never name an option the command refuses). None: all of them.
    """
    msg = str(exc)
    for api, flag in _API_TO_FLAGS:
        if flags is None or _flag_of(flag) in flags:
            msg = msg.replace(api, flag)
    return msg


#: Set by SIGTERM. The handler's exception can be lost when the signal
#: lands while Python runs code whose errors it only reports (a ``__del__``,
#: a weakref or gc callback); the replay loop checks this flag as well.
_terminating = [False]


def _terminate(signum: int, frame: Any) -> None:
    _terminating[0] = True
    raise _Terminated()


class _Terminated(KeyboardInterrupt):
    """SIGTERM (``kill``, ``timeout``): unwind like Ctrl-C, so the cache is
    closed and a temporary replay directory removed."""


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    previous = None
    flags = getattr(args, "flags", None)
    if threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGTERM, _terminate)
    try:
        return args.func(args)
    except TraceFormatError as exc:
        if getattr(args, "format", "auto") != "auto" and exc.about_format and \
                not exc.format_given:
            # the readers do not know --format was given: do not suggest it
            exc = TraceFormatError(exc.path, exc.line, exc.detail, format_given=True)
        print(f"durablekv: bad trace: {_for_cli(exc, flags)}", file=sys.stderr)
        return 2
    except FileNotFoundError as exc:
        print(f"durablekv: no such file: {exc.filename}", file=sys.stderr)
        return 2
    except ConfigError as exc:
        print(f"durablekv: {_for_cli(exc, flags)}", file=sys.stderr)
        return 2
    except OSError as exc:
        where = f": {exc.filename}" if exc.filename else ""
        print(f"durablekv: {exc.strerror or exc}{where}", file=sys.stderr)
        return 2
    except DurableKVError as exc:
        print(f"durablekv: {_for_cli(exc, flags)}", file=sys.stderr)
        return 1
    except _Terminated:
        print("durablekv: terminated", file=sys.stderr)
        return 143
    except KeyboardInterrupt:
        print("durablekv: interrupted", file=sys.stderr)
        return 130
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
        _terminating[0] = False


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
