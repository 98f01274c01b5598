"""Kill real writer processes with SIGKILL and check every acknowledged write.

A writer (tests/crash_writer.py) reports each call before it starts and after
it returns; the test kills it at a random moment, reopens the directory and
compares every key with a model built from the acknowledged calls. The one
call in flight at the kill may have landed or not; nothing acknowledged may
be missing, and nothing may come back that was never written.
"""

from __future__ import annotations

import os
import random
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from durablekv import Cache

WRITER = Path(__file__).with_name("crash_writer.py")
REPO = Path(__file__).resolve().parents[1]


def run_writer_and_kill(directory: Path, seed: int, durability: str, kill_after: float):
    """Start a writer, SIGKILL it after ``kill_after`` s of writing; return its lines."""
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen([sys.executable, str(WRITER), str(directory), str(seed), durability],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    buf = b""
    try:
        # wait (bounded) until it has opened the cache, then let it write
        deadline = time.monotonic() + 60
        while b"READY\n" not in buf:
            ready, _, _ = select.select([proc.stdout], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                raise AssertionError("writer did not start within 60 s")
            chunk = os.read(proc.stdout.fileno(), 65536)
            if not chunk:
                raise AssertionError(f"writer exited early: {proc.stderr.read().decode()}")
            buf += chunk
        end = time.monotonic() + kill_after
        while time.monotonic() < end:
            ready, _, _ = select.select([proc.stdout], [], [], end - time.monotonic())
            if ready:
                chunk = os.read(proc.stdout.fileno(), 65536)
                if not chunk:
                    break
                buf += chunk
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        buf += proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
        proc.stderr.close()
    assert proc.returncode == -signal.SIGKILL, "the writer must die by SIGKILL, not exit"
    return buf.decode().splitlines()


def apply_lines(model: dict, lines: list[str]):
    """Apply acknowledged calls to ``model``; return (acked, in_flight_or_None)."""
    pending = None
    acked = 0
    for line in lines:
        if line.startswith("B "):
            _, op, key, value = line.split(" ", 3)
            pending = (op, key, value)
        elif line == "A" and pending is not None:
            op, key, value = pending
            if op == "S":
                model[key] = value
            else:
                model.pop(key, None)
            pending = None
            acked += 1
    return acked, pending


def verify(directory: Path, model: dict, in_flight) -> int:
    """Reopen and compare every key; resolve the in-flight call in the model."""
    with Cache(directory, page_size=4, max_pages=3) as cache:
        if in_flight is not None:
            op, key, value = in_flight
            got = cache.get(key)
            allowed = {model.get(key), value if op == "S" else None}
            assert got in allowed, f"in-flight {in_flight}: got {got!r}, allowed {allowed!r}"
            if got is None:
                model.pop(key, None)
            else:
                model[key] = got
        actual = dict(cache.items())
        assert actual == model, _diff(model, actual)
        assert len(cache) == len(model)
    return len(model)


def _diff(model: dict, actual: dict) -> str:
    lost = {k: v for k, v in model.items() if actual.get(k) != v}
    extra = {k: v for k, v in actual.items() if k not in model}
    return f"lost or wrong: {lost}; never written: {extra}"


def crash_cycles(tmp_path: Path, durability: str, cycles: int, seed: int) -> tuple[int, int]:
    rng = random.Random(seed)
    directory = tmp_path / "cache"
    model: dict = {}
    total_acked = 0
    for cycle in range(cycles):
        lines = run_writer_and_kill(directory, seed * 1000 + cycle, durability,
                                    kill_after=rng.uniform(0.02, 0.6))
        acked, in_flight = apply_lines(model, lines)
        total_acked += acked
        verify(directory, model, in_flight)
    return total_acked, cycles


@pytest.mark.parametrize("durability", ["log", "fsync"])
def test_sigkill_loses_no_acknowledged_write(tmp_path, durability):
    acked, cycles = crash_cycles(tmp_path, durability, cycles=6, seed=7)
    assert acked > 100 * cycles, "the writer must have done real work before each kill"


@pytest.mark.stress
@pytest.mark.parametrize("durability", ["log", "fsync"])
def test_sigkill_many_cycles(tmp_path, durability):
    acked, cycles = crash_cycles(tmp_path, durability, cycles=60, seed=11)
    assert acked > 100 * cycles
