"""Failover: the primary is SIGKILLed mid-load, the synchronous standby is
promoted, and the cache goes on through its multi-host connection string
with no acknowledged write lost (real servers: tests/pg.py ``pg_pair``).

Once in the fast suite; 20 times in the stress suite, and 5 times each with
the log in the directory (``fsync``, ``log``).
"""

from __future__ import annotations

import contextlib
import threading
import time

import pytest

from durablekv import Cache
from durablekv.errors import WriteBehindError
from .pg import DEADLINE, PASSWORD, fence, pg_pair, promote, sync_state

psycopg = pytest.importorskip("psycopg")

WRITERS = 4


def failover_run(tmp_path, durability: str = "sync") -> dict:
    """One run; returns what it measured (acknowledged writes, the seconds
    from the kill to the first write acknowledged after the promotion)."""
    with pg_pair() as (primary, standby):
        url = (f"postgresql://postgres:{PASSWORD}@127.0.0.1:{primary.port},"
               f"127.0.0.1:{standby.port}/postgres?target_session_attrs=read-write")
        c = Cache(tmp_path / "c", store=url, namespace="load", durability=durability,
                  page_size=4, max_pages=8, flush_interval=0.02, busy_timeout=2)
        acked: list[list[int]] = [[] for _ in range(WRITERS)]
        ack_times: list[float] = []
        errors: list[BaseException] = []
        stop = threading.Event()

        refused: list[BaseException] = []

        def load(w: int) -> None:
            i = 0
            while not stop.is_set():
                try:
                    c[f"w{w}-{i}"] = i
                except WriteBehindError as exc:
                    # log/fsync: writes outrun the write-behind while no primary
                    # is reachable, and back-pressure refuses them loudly (not
                    # acknowledged); the writer tries again
                    if durability == "sync":
                        errors.append(exc)
                        return
                    refused.append(exc)
                    continue
                except BaseException as exc:  # noqa: BLE001 - the test reports it
                    errors.append(exc)
                    return
                acked[w].append(i)
                ack_times.append(time.monotonic())
                i += 1

        def total() -> int:
            return sum(map(len, acked))

        def wait_for(n: int) -> None:
            deadline = time.monotonic() + DEADLINE
            while total() < n and not errors:
                assert time.monotonic() < deadline, f"only {total()} of {n} writes in {DEADLINE} s"
                time.sleep(0.01)

        threads = [threading.Thread(target=load, args=(w,)) for w in range(WRITERS)]
        closed = False
        try:
            for t in threads:
                t.start()
            wait_for(400)
            with psycopg.connect(primary.url(), autocommit=True) as conn:
                # only a standby that was synchronous may be promoted
                assert sync_state(conn) == "sync"
            killed_at = time.monotonic()
            fence(primary)  # SIGKILL; its data directory can never serve again
            before = total()
            promote(standby)
            wait_for(before + 400)
        finally:
            stop.set()
            for t in threads:
                t.join(DEADLINE)
            if errors:
                with contextlib.suppress(Exception):
                    c.close()
                closed = True
        assert errors == [] and not closed
        first_after = min(t for t in ack_times if t > killed_at) - killed_at \
            if any(t > killed_at for t in ack_times) else None
        try:
            missing = [(w, i) for w in range(WRITERS) for i in acked[w]
                       if c.get(f"w{w}-{i}") != i]
            assert missing == []
            c.flush()
            assert c._store.integrity_check() == []
        finally:
            c.close()
        # every acknowledged write is on the promoted standby: a new machine sees it
        with Cache(tmp_path / "elsewhere", store=standby.url(), namespace="load",
                   durability=durability) as d:
            lost = [(w, i) for w in range(WRITERS) for i in acked[w] if d.get(f"w{w}-{i}") != i]
            assert lost == []
            assert len(d) == total()
        return {"acked": total(), "refused": len(refused),
                "first_write_after_kill_s": first_after}


def test_failover_to_the_synchronous_standby_loses_no_acknowledged_write(tmp_path):
    got = failover_run(tmp_path)
    assert got["acked"] >= 800 and got["first_write_after_kill_s"] is not None


@pytest.mark.stress
@pytest.mark.parametrize("run", range(20))
def test_failover_twenty_times(tmp_path, run):
    failover_run(tmp_path)


@pytest.mark.stress
@pytest.mark.parametrize("run", range(5))
@pytest.mark.parametrize("durability", ["fsync", "log"])
def test_failover_with_the_log_in_the_directory(tmp_path, durability, run):
    """The local log holds the writes; flush commits wait for the standby."""
    failover_run(tmp_path, durability)
