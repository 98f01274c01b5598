"""A bounded load generator over loopback, run in its own process.

``python -m bench.loadgen --proto http|redis --port P --op get_hit|get_miss|put|fill
--connections C --requests N --seconds T [--token TOKEN]``

C keep-alive connections, each sending its next request when the answer to
the last one is in (closed loop); it stops after N requests in all or T
seconds, whichever comes first, and prints one JSON line: requests, seconds,
req_s, p50_us, p99_us, errors (answers other than the expected one).

The client side is raw asyncio streams (uvloop when installed) with the
requests built once, so the generator costs the same for every server and
as little as Python allows: HTTP/1.1 with ``Content-Length`` answers, or
RESP for Redis.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time

KEYS = 1000
VALUE = b"v" * 100


def _http_request(method: str, path: str, token: str | None, body: bytes | None) -> bytes:
    head = f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n"
    if token:
        head += f"Authorization: Bearer {token}\r\n"
    if body is not None:
        head += f"Content-Type: application/octet-stream\r\nContent-Length: {len(body)}\r\n"
    return (head + "\r\n").encode() + (body or b"")


def _resp(*parts: bytes) -> bytes:
    out = [b"*%d\r\n" % len(parts)]
    for p in parts:
        out.append(b"$%d\r\n%s\r\n" % (len(p), p))
    return b"".join(out)


def requests_for(proto: str, op: str, token: str | None) -> tuple[list[bytes], int]:
    """The requests (cycled) and the status an answer must have (HTTP) or
    the first byte it must start with (Redis, as an int)."""
    if proto == "http":
        if op in ("put", "fill"):
            return [_http_request("PUT", f"/v1/keys/k{i}", token, VALUE)
                    for i in range(KEYS)], 204
        if op == "get_hit":
            return [_http_request("GET", f"/v1/keys/k{i}", token, None) for i in range(KEYS)], 200
        return [_http_request("GET", f"/v1/keys/miss{i}", token, None) for i in range(KEYS)], 404
    if op in ("put", "fill"):
        return [_resp(b"SET", b"k%d" % i, VALUE) for i in range(KEYS)], ord("+")
    if op == "get_hit":
        return [_resp(b"GET", b"k%d" % i) for i in range(KEYS)], ord("$")
    return [_resp(b"GET", b"miss%d" % i) for i in range(KEYS)], ord("$")


async def _http_answer(reader: asyncio.StreamReader) -> int:
    head = await reader.readuntil(b"\r\n\r\n")
    status = int(head[9:12])
    length = 0
    i = head.lower().find(b"content-length:")
    if i >= 0:
        length = int(head[i + 15:head.index(b"\r\n", i)])
    if length:
        await reader.readexactly(length)
    return status


async def _redis_answer(reader: asyncio.StreamReader) -> int:
    line = await reader.readline()
    if line[:1] == b"$":
        n = int(line[1:-2])
        if n >= 0:
            await reader.readexactly(n + 2)
    return line[0]


async def run(proto: str, port: int, op: str, connections: int, requests: int,
              seconds: float, token: str | None) -> dict:
    reqs, expected = requests_for(proto, op, token)
    answer = _http_answer if proto == "http" else _redis_answer
    if op == "fill":
        requests, connections = KEYS, min(connections, 8)
    left = [requests]
    lat: list[int] = []
    errors = [0]
    deadline = time.perf_counter() + seconds
    taken = [0]  # requests handed out, shared: "fill" sets every key exactly once

    async def conn(c: int) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            while left[0] > 0 and time.perf_counter() < deadline:
                left[0] -= 1
                i, taken[0] = taken[0], taken[0] + 1
                t0 = time.perf_counter_ns()
                writer.write(reqs[i % len(reqs)])
                got = await answer(reader)
                lat.append(time.perf_counter_ns() - t0)
                if got != expected:
                    errors[0] += 1
        finally:
            writer.close()

    t0 = time.perf_counter()
    await asyncio.gather(*(conn(c) for c in range(connections)))
    elapsed = time.perf_counter() - t0
    lat.sort()
    n = len(lat)
    return {"requests": n, "seconds": elapsed, "req_s": n / elapsed if elapsed else 0.0,
            "p50_us": lat[n // 2] / 1000 if n else None,
            "p99_us": lat[min(n - 1, int(n * 0.99))] / 1000 if n else None,
            "errors": errors[0]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.loadgen")
    p.add_argument("--proto", choices=("http", "redis"), required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--op", choices=("get_hit", "get_miss", "put", "fill"), required=True)
    p.add_argument("--connections", type=int, default=1)
    p.add_argument("--requests", type=int, default=10_000)
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--token")
    a = p.parse_args(argv)
    try:
        import uvloop
        runner = uvloop.run
    except ImportError:
        runner = asyncio.run
    res = runner(run(a.proto, a.port, a.op, a.connections, a.requests, a.seconds, a.token))
    print(json.dumps(res), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
