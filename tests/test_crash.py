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


MARKERS = {"txn": "T", "truncate": "U", "recovery": "R", "replayflush": "P"}


def run_writer_and_kill(directory: Path, seed: int, durability: str, kill_after: float,
                        mode: str = "random", policy: str = "lru") -> list[str]:
    """Start a writer; SIGKILL it at its mode's marker, or ``kill_after`` s after it
    started writing; return the lines it reported.

    The markers of ``txn`` and ``truncate`` come while the writer writes, so
    the kill waits for them (a loaded machine writes slower, and a kill at
    the random time instead once failed the test's coverage check). Those of
    ``recovery`` and ``replayflush`` come only while the cache opens: when
    the writer is ready without one (nothing to replay), the kill falls back
    to the random time."""
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen([sys.executable, str(WRITER), str(directory), str(seed), durability,
                             mode, policy], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    marker = MARKERS.get(mode)
    waits_for_marker = mode in ("txn", "truncate")
    buf = b""
    started = None
    try:
        deadline = time.monotonic() + 60
        while True:
            now = time.monotonic()
            if started is None and b"READY\n" in buf:
                started = now
            if marker is not None and f"\n{marker}\n".encode() in b"\n" + buf:
                break
            if started is not None and now - started >= kill_after and not waits_for_marker:
                break
            if now > deadline:
                raise AssertionError("writer did not start within 60 s" if started is None else
                                     f"writer did not reach its {marker!r} marker within 60 s")
            limit = deadline if started is None or waits_for_marker else started + kill_after
            ready, _, _ = select.select([proc.stdout], [], [], max(0.0, limit - now))
            if ready:
                chunk = os.read(proc.stdout.fileno(), 65536)
                if not chunk:
                    raise AssertionError(f"writer exited: {proc.stderr.read().decode()[-2000:]}")
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


def apply_lines(model: dict, uncertain: dict, lines: list[str]) -> int:
    """Apply the acknowledged calls to ``model``; return how many there were.

    A call begun but not acknowledged when the writer died may or may not
    have landed: ``uncertain[key]`` holds the values its key may have
    (None = absent) until a later acknowledged call on that key settles it.
    """
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
            uncertain.pop(key, None)
            pending = None
            acked += 1
    if pending is not None:
        op, key, value = pending
        before = uncertain.get(key, {model.get(key)})
        uncertain[key] = before | {value if op == "S" else None}
    return acked


def verify(directory: Path, model: dict, uncertain: dict, policy: str = "lru") -> int:
    """Reopen and compare every key; settle the uncertain ones from what is there."""
    with Cache(directory, page_size=4, max_pages=3, policy=policy) as cache:
        # (the writer stores bytes under even keys: compared as text)
        actual = {k: v.decode() if type(v) is bytes else v for k, v in cache.items()}
        assert len(cache) == len(actual)
    for key, allowed in uncertain.items():
        got = actual.get(key)
        assert got in allowed, f"in-flight call on {key}: got {got!r}, allowed {allowed!r}"
        if got is None:
            model.pop(key, None)
        else:
            model[key] = got
    uncertain.clear()
    assert actual == model, _diff(model, actual)
    return len(model)


def _diff(model: dict, actual: dict) -> str:
    lost = {k: v for k, v in model.items() if actual.get(k) != v}
    extra = {k: v for k, v in actual.items() if k not in model}
    return f"lost or wrong: {lost}; never written: {extra}"


def crash_cycles(tmp_path: Path, durability: str, cycles: int, seed: int,
                 modes=("random", "txn", "recovery", "truncate", "random", "recovery",
                        "replayflush"), policy: str = "lru"):
    """Run ``cycles`` write-kill-verify rounds on one directory; return
    (acknowledged calls, keys checked, kills by where they landed).

    A "recovery" round first kills a writer at random (leaving log records
    behind the checkpoint), then kills the next writer while it replays them,
    before anything verifies the directory. A "replayflush" round first kills
    a writer that never flushed (the whole log to replay), then kills the
    next one inside a flush that its recovery, short of memory, waits for
    (part of the recovered state in SQLite, the checkpoint not moved).
    """
    rng = random.Random(seed)
    directory = tmp_path / "cache"
    model: dict = {}
    uncertain: dict = {}
    acked_total = checked = 0
    kills: dict[str, int] = {}
    for cycle in range(cycles):
        mode = modes[cycle % len(modes)]
        rounds = {"recovery": ["random", "recovery"],
                  "replayflush": ["noflush", "replayflush"]}.get(mode, [mode])
        for i, m in enumerate(rounds):
            lines = run_writer_and_kill(directory, seed * 1000 + cycle * 10 + i, durability,
                                        kill_after=rng.uniform(0.02, 0.6), mode=m,
                                        policy=policy)
            landed = m if MARKERS.get(m) in lines or m in ("random", "noflush") else "random"
            kills[landed] = kills.get(landed, 0) + 1
            acked_total += apply_lines(model, uncertain, lines)
        checked += verify(directory, model, uncertain, policy)
    return acked_total, checked, kills


@pytest.mark.parametrize("durability", ["log", "fsync"])
def test_sigkill_loses_no_acknowledged_write(tmp_path, durability):
    """At least 20 kill-and-verify cycles, some inside a flush transaction,
    some while the log is cut back, some during recovery at open."""
    acked, checked, kills = crash_cycles(tmp_path, durability, cycles=24, seed=7)
    assert acked > 50 * 24, "the writer must have done real work before the kills"
    assert kills.get("txn", 0) >= 2 and kills.get("truncate", 0) >= 2, kills
    # replayflush rounds are 3 of the 24 cycles; one landing is enough to
    # keep the path covered without making the test depend on timing
    assert kills.get("recovery", 0) >= 2 and kills.get("replayflush", 0) >= 1, kills
    print(f"{durability}: 24 cycles, {acked} acknowledged calls, {checked} key checks, "
          f"kills {kills}, 0 lost")


def test_sigkill_midpoint_policy(tmp_path):
    """The same kills with policy="midpoint": pages in memory in part, entries
    left while their page was dirty, and pages read back whole before they
    change lose nothing either (a 3-page tier of 12 entries over 200 keys)."""
    acked, checked, kills = crash_cycles(tmp_path, "log", cycles=14, seed=13,
                                         policy="midpoint")
    assert acked > 50 * 14, "the writer must have done real work before the kills"
    assert kills.get("txn", 0) >= 1 and kills.get("recovery", 0) >= 1, kills
    print(f"midpoint: 14 cycles, {acked} acknowledged calls, {checked} key checks, "
          f"kills {kills}, 0 lost")


@pytest.mark.stress
@pytest.mark.parametrize("durability", ["log", "fsync"])
def test_sigkill_many_cycles(tmp_path, durability):
    acked, checked, kills = crash_cycles(tmp_path, durability, cycles=200, seed=11)
    assert acked > 50 * 200
    print(f"{durability}: 200 cycles, {acked} acknowledged calls, {checked} key checks, "
          f"kills {kills}, 0 lost")


@pytest.mark.stress
def test_sigkill_many_cycles_midpoint(tmp_path):
    acked, checked, kills = crash_cycles(tmp_path, "log", cycles=100, seed=17, policy="midpoint")
    assert acked > 50 * 100
    print(f"midpoint: 100 cycles, {acked} acknowledged calls, {checked} key checks, "
          f"kills {kills}, 0 lost")
