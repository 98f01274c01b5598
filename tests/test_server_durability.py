"""A 2xx on a write means what a return from ``set`` means: real processes.

A load generator (tests/server_loadgen.py, its own process) logs every
acknowledged write; the server is SIGKILLed mid-load, restarted on the
same directory, and must serve every acknowledged write (or a later one of
the same key). SIGTERM during load drains what is in flight, flushes,
closes and exits 0.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from tests.server_util import REPO, ServerProcess, running_server

from durablekv.client import Client  # noqa: E402

LOADGEN = Path(__file__).with_name("server_loadgen.py")


def _start_load(url: str, ack: Path, threads: int = 4) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, str(LOADGEN), url, str(ack), str(threads), "200000",
                          "60"], cwd=str(REPO), stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "started"
    return p


def _wait_acks(ack: Path, n: int, timeout: float = 60.0) -> None:
    """Wait (with a deadline) until the load generator logged ``n`` acknowledgements."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if ack.exists() and ack.read_bytes().count(b"\n") >= n:
            return
        time.sleep(0.01)
    pytest.fail(f"the load generator logged fewer than {n} acknowledged writes in {timeout} s")


def _acked(ack: Path) -> dict[str, int]:
    last: dict[str, int] = {}
    for line in ack.read_text().splitlines():
        key, seq = line.split()
        last[key] = max(last.get(key, 0), int(seq))
    return last


def _check_served(url: str, acked: dict[str, int]) -> None:
    with Client(url) as kv:
        res = kv.batch([{"op": "get", "key": k} for k in acked])
    lost = {k: (seq, r) for (k, seq), r in zip(acked.items(), res)
            if r["status"] != 200 or r["value"] < seq}
    assert not lost, f"{len(lost)} acknowledged writes not served after restart: " \
                     f"{list(lost.items())[:5]}"


@pytest.mark.parametrize("durability", ["log", "fsync"])
def test_sigkill_mid_load_loses_no_acknowledged_write(tmp_path, durability):
    d, ack = tmp_path / "cache", tmp_path / "acks"
    srv = ServerProcess(d, "--durability", durability, "--flush-interval", "0.2").wait_started()
    try:
        load = _start_load(srv.url, ack)
        _wait_acks(ack, 400 if durability == "log" else 100)
        srv.proc.kill()  # SIGKILL, mid-load
        srv.proc.wait(30)
        assert load.wait(60) == 0
    finally:
        srv.kill()
    acked = _acked(ack)
    assert len(acked) >= 20
    with running_server(d) as again:
        _check_served(again.url, acked)


def test_sigterm_drains_in_flight_flushes_and_exits_0(tmp_path):
    d, ack = tmp_path / "cache", tmp_path / "acks"
    srv = ServerProcess(d, "--durability", "log").wait_started()
    try:
        # A request in flight for sure: its handler asked for the body
        # ("100 Continue") and waits for it when SIGTERM arrives.
        u = urlsplit(srv.url)
        s = socket.create_connection((u.hostname, u.port), timeout=30)
        s.sendall(b"PUT /v1/keys/in-flight HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n"
                  b"Content-Type: application/json\r\nExpect: 100-continue\r\n\r\n")
        assert s.recv(1024).startswith(b"HTTP/1.1 100")
        load = _start_load(srv.url, ack)
        _wait_acks(ack, 300)
        srv.proc.terminate()  # SIGTERM, mid-load
        s.sendall(b"12345")
        assert s.recv(1024).startswith(b"HTTP/1.1 204"), "the in-flight request was dropped"
        s.close()
        assert srv.proc.wait(60) == 0, srv.stderr()
        assert load.wait(60) == 0
    finally:
        srv.kill()
    assert "Traceback" not in srv.stderr(), srv.stderr()
    acked = _acked(ack)
    acked["in-flight"] = 12345
    # closed cleanly: the store holds everything, the log was emptied
    assert not list(d.glob("replay*.log")) or all(p.stat().st_size <= 64
                                                  for p in d.glob("replay*.log"))
    with running_server(d) as again:
        _check_served(again.url, acked)
