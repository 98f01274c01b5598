"""``python -m bench server``: the HTTP server under load, side by side.

Three servers in one run, each measured by the same load generator
(:mod:`bench.loadgen`, its own process) on loopback:

- ``durablekv``: ``durablekv serve`` (durability ``log``, the default), a real process;
- ``dict``: the same FastAPI app (:func:`durablekv.server.app.create_app`)
  backed by a plain dict (:class:`DictBackend`): the framework's ceiling;
- ``redis``: redis-server over loopback (``appendfsync everysec``), when installed.

For GET hit, GET miss and PUT at 1, 8 and 64 connections, each repetition
runs the three servers one after another (round robin); the report has the
median and the spread (min, max) of req/s and of the p50/p99 latencies, and
durablekv's throughput as a ratio of the dict-backed app's. The goal is 0.8x.

``python -m bench.server --serve-dict`` runs the dict-backed app alone
(the bench starts it as its own process).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Sequence

from .util import REPO, machine_info, note

OPS = ("get_hit", "get_miss", "put")
CONNECTIONS = (1, 8, 64)
_MISSING: Any = object()


class DictBackend:
    """AsyncCache's coroutines over a plain dict (no TTL, no disk): what the
    app costs with nothing behind it."""

    def __init__(self) -> None:
        self.d: dict[str, Any] = {}

    async def get(self, key: str, default: Any = None) -> Any:
        return self.d.get(key, default)

    async def contains(self, key: str) -> bool:
        return key in self.d

    async def set(self, key: str, value: Any, expire: float | None = None) -> None:
        self.d[key] = value

    async def add(self, key: str, value: Any, expire: float | None = None) -> bool:
        if key in self.d:
            return False
        self.d[key] = value
        return True

    async def delete(self, key: str) -> bool:
        return self.d.pop(key, _MISSING) is not _MISSING

    async def touch(self, key: str, expire: float | None = None) -> bool:
        return key in self.d

    async def incr(self, key: str, delta: int = 1) -> int:
        value = self.d.get(key, 0)
        if type(value) is not int:
            raise TypeError(f"cannot incr() key {key!r}: not an int")
        self.d[key] = value + delta
        return self.d[key]


def serve_dict() -> int:
    """Run the dict-backed app on a free loopback port; print the start line."""
    import signal

    import uvicorn

    from durablekv.server.app import create_app
    from durablekv.server.command import _bind, _Server
    sock = _bind("127.0.0.1", 0)
    port = sock.getsockname()[1]
    app = create_app(DictBackend())
    config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on",
                            server_header=False)
    server = _Server(config, f"durablekv serving dict on http://127.0.0.1:{port}")
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    server.run(sockets=[sock])
    return 0


class _Proc:
    """A server child process started by the bench and stopped by it."""

    def __init__(self, cmd: list[str]) -> None:
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                     text=True, cwd=str(REPO))
        line = self.proc.stdout.readline().strip()  # type: ignore[union-attr]
        if not line.startswith("durablekv serving"):
            self.stop()
            raise RuntimeError(f"server did not start: {cmd} said {line!r}")
        self.port = int(line.rsplit(":", 1)[1])

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _load(proto: str, port: int, op: str, conns: int, requests: int,
          seconds: float) -> dict[str, Any]:
    out = subprocess.run([sys.executable, "-m", "bench.loadgen", "--proto", proto, "--port",
                          str(port), "--op", op, "--connections", str(conns), "--requests",
                          str(requests), "--seconds", str(seconds)],
                         capture_output=True, text=True, cwd=str(REPO), timeout=seconds + 60)
    if out.returncode != 0:
        raise RuntimeError(f"load generator failed: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    def med(f: str) -> dict[str, float]:
        xs = [r[f] for r in runs if r[f] is not None]
        return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}
    return {"req_s": med("req_s"), "p50_us": med("p50_us"), "p99_us": med("p99_us"),
            "errors": sum(r["errors"] for r in runs), "requests": [r["requests"] for r in runs]}


def run(requests: int, seconds: float, repeat: int, redis: bool,
        connections: Sequence[int] = CONNECTIONS, ops: Sequence[str] = OPS,
        serve_args: Sequence[str] = ()) -> dict[str, Any]:
    tmp = tempfile.mkdtemp(prefix="durablekv-bench-server-")
    servers: dict[str, tuple[str, int]] = {}
    procs: list[Any] = []
    skipped = []
    try:
        dk = _Proc([sys.executable, "-m", "durablekv", "serve", os.path.join(tmp, "cache"),
                    "--port", "0", *serve_args])
        procs.append(dk)
        servers["durablekv"] = ("http", dk.port)
        dd = _Proc([sys.executable, "-m", "bench.server", "--serve-dict"])
        procs.append(dd)
        servers["dict"] = ("http", dd.port)
        if redis:
            from .redis_server import RedisServer, redis_available
            why = redis_available()
            if why is None:
                rs = RedisServer(tmp).start()
                procs.append(rs)
                servers["redis"] = ("redis", rs.port)
            else:
                skipped.append(why)
                note(why)
        for name, (proto, port) in servers.items():
            _load(proto, port, "fill", 8, 0, 60)
        cells: dict[str, Any] = {}
        for op in ops:
            for conns in connections:
                runs: dict[str, list[dict[str, Any]]] = {n: [] for n in servers}
                for rep in range(repeat):
                    order = list(servers)
                    order = order[rep % len(order):] + order[:rep % len(order)]
                    for name in order:
                        proto, port = servers[name]
                        runs[name].append(_load(proto, port, op, conns, requests, seconds))
                cell = {n: _summary(r) for n, r in runs.items()}
                ratio = cell["durablekv"]["req_s"]["median"] / cell["dict"]["req_s"]["median"]
                cell["ratio_vs_dict"] = ratio
                cells[f"{op}@{conns}"] = cell
                line = "  ".join(f"{n} {c['req_s']['median']:8.0f} req/s p99 "
                                 f"{c['p99_us']['median']:7.0f} us"
                                 for n, c in cell.items() if n in servers)
                note(f"{op:8} x{conns:<3} {line}  ratio {ratio:.2f}x")
        return {"cells": cells, "servers": list(servers), "skipped": skipped}
    finally:
        for p in procs:
            p.stop()
        shutil.rmtree(tmp, ignore_errors=True)


MARK_BEGIN, MARK_END = "<!-- bench:server -->", "<!-- /bench:server -->"


def table(res: dict[str, Any]) -> str:
    """The results as a markdown table (median req/s [min-max], p50/p99 us)."""
    names = res["servers"]
    head = "| case | " + " | ".join(f"{n} req/s (p50 / p99 us)" for n in names) + \
        " | durablekv / dict |"
    lines = [head, "|" + "---|" * (len(names) + 2)]
    for case, cell in res["cells"].items():
        op, conns = case.split("@")
        row = [f"{op.replace('_', ' ')}, {conns} conn"]
        for n in names:
            c = cell[n]
            r = c["req_s"]
            row.append(f"{r['median']:,.0f} [{r['min']:,.0f}-{r['max']:,.0f}] "
                       f"({c['p50_us']['median']:,.0f} / {c['p99_us']['median']:,.0f})")
        row.append(f"{cell['ratio_vs_dict']:.2f}x")
        lines.append("| " + " | ".join(row) + " |")
    m, st = res["machine"], res["settings"]
    lines.append("")
    lines.append(f"`{res['command'].strip()}` at {res['started_at']}: {m.get('cpu_model')} "
                 f"x{m.get('nproc')}, Python {m.get('python')}; {st['requests']} requests per "
                 f"run (or {st['seconds']} s), {st['repeat']} runs per cell, median [min-max]; "
                 f"{st['value_bytes']}-byte values over {st['keys']} keys; durablekv with "
                 f"durability={st['durability']}.")
    return "\n".join(lines)


def write_doc(res: dict[str, Any], path: str) -> None:
    """Replace the table between the bench markers in ``path``."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    a, b = text.index(MARK_BEGIN) + len(MARK_BEGIN), text.index(MARK_END)
    with open(path, "w", encoding="utf-8") as f:
        f.write(text[:a] + "\n" + table(res) + "\n" + text[b:])


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench server", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="1 repetition, 500 requests per run")
    p.add_argument("--requests", type=int, help="requests per run (default 20000)")
    p.add_argument("--seconds", type=float, default=10.0,
                   help="time limit of one run (default %(default)s)")
    p.add_argument("--repeat", type=int, help="repetitions (default 3)")
    p.add_argument("--no-redis", action="store_true")
    p.add_argument("--ops", default=",".join(OPS), help="subset of " + ",".join(OPS))
    p.add_argument("--connections", default=",".join(map(str, CONNECTIONS)),
                   help="connection counts (default %(default)s)")
    p.add_argument("--out", default="bench-server.json", help="results JSON (default %(default)s)")
    p.add_argument("--serve-args", default="", help="extra options for durablekv serve "
                   "(e.g. '--flush-interval 0.5')")
    p.add_argument("--doc", help="also rewrite the table in this page (docs/server.md)")
    p.add_argument("--from-json", metavar="RESULTS", help="run nothing: rewrite --doc from "
                   "an earlier results JSON")
    p.add_argument("--serve-dict", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.serve_dict:
        return serve_dict()
    if a.from_json:
        with open(a.from_json, encoding="utf-8") as f:
            res = json.load(f)
        print(table(res))
        if a.doc:
            write_doc(res, a.doc)
        return 0
    requests = a.requests or (500 if a.quick else 20_000)
    repeat = a.repeat or (1 if a.quick else 3)
    started = time.time()
    res: dict[str, Any] = {
        "schema": 1, "command": "python -m bench server " + " ".join(argv or sys.argv[2:]),
        "started_at": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "settings": {"requests": requests, "seconds": a.seconds, "repeat": repeat,
                     "value_bytes": 100, "keys": 1000, "durability": "log",
                     "connections": list(CONNECTIONS)},
        "machine": machine_info(tempfile.gettempdir()),
    }
    ops = tuple(o for o in a.ops.split(",") if o)
    unknown = set(ops) - set(OPS)
    if unknown:
        p.error(f"unknown --ops {sorted(unknown)}; choose from {', '.join(OPS)}")
    conns = tuple(int(c) for c in a.connections.split(",") if c)
    res["settings"]["connections"] = list(conns)
    res["settings"]["serve_args"] = a.serve_args
    res.update(run(requests, a.seconds, repeat, not a.no_redis, conns, ops,
                   a.serve_args.split()))
    res["duration_seconds"] = time.time() - started
    ratios = {k: c["ratio_vs_dict"] for k, c in res["cells"].items()}
    res["goal"] = {"target": "durablekv server >= 0.8x the dict-backed app's req/s",
                   "met": {k: r >= 0.8 for k, r in ratios.items()}}
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w", encoding="utf-8") as f:
        json.dump(res, f, indent=1)
        f.write("\n")
    note(f"wrote {a.out}")
    print(table(res))
    if a.doc:
        write_doc(res, a.doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
