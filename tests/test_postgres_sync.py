"""``durability="sync"`` and what each durability mode loses, on real PostgreSQL.

The table in docs/postgres.md, row by row: the writer process is SIGKILLed
after 100 acknowledged sets that no flush has stored, then

* "process killed": the same directory is opened again;
* "machine lost": the directory is deleted and a new one opened;
* "PostgreSQL lost": the server's data directory is destroyed (a new empty
  server) and the same directory is opened again.

And the sync log itself: committed before a write returns, group commit, an
unknown-outcome COMMIT retried idempotently by LSN, a taken-over namespace
that stops the old owner instead of letting it write.
"""

from __future__ import annotations

import os
import shutil
import threading
import time

import pytest

from durablekv import Cache
from durablekv.errors import CacheFailedError, ConfigError, LogWriteError
from .pg import DEADLINE, kill_at, open_with_deadline, pg_cache, pg_server, writer

psycopg = pytest.importorskip("psycopg")


def _kill_after_hold(directory, pg, ns, durability) -> list[int]:
    """Run the writer in "hold" mode, SIGKILL it once it has 100 acknowledged
    sets (none flushed), return the acknowledged indices."""
    acked = kill_at(writer(directory, pg, ns, durability, "hold"), "S")
    assert acked == list(range(100))
    return acked


def _lost(c, acked) -> int:
    return sum(c.get(f"k{i}") != f"v{i}" for i in acked)


@pytest.mark.parametrize("durability,lost",
                         [("sync", 0), ("fsync", 0), ("log", 0), ("none", 100)])
def test_row_process_killed(pg, pg_ns, tmp_path, durability, lost):
    acked = _kill_after_hold(tmp_path / "c", pg, pg_ns, durability)
    with open_with_deadline(tmp_path / "c", pg, pg_ns, durability=durability) as c:
        assert _lost(c, acked) == lost


@pytest.mark.parametrize("durability,lost",
                         [("sync", 0), ("fsync", 100), ("log", 100), ("none", 100)])
def test_row_machine_lost(pg, pg_ns, tmp_path, durability, lost):
    """Only "sync" keeps what the write-behind has not stored yet: the other
    modes' replay log was in the lost directory."""
    acked = _kill_after_hold(tmp_path / "c", pg, pg_ns, durability)
    shutil.rmtree(tmp_path / "c")
    with open_with_deadline(tmp_path / "elsewhere", pg, pg_ns, durability=durability) as c:
        assert _lost(c, acked) == lost


@pytest.mark.parametrize("durability", ["sync", "fsync", "log"])
def test_row_postgresql_lost_without_a_standby(tmp_path, durability):
    """A flush stored 50 sets, 100 more were acknowledged, then the server's
    data is destroyed. "sync": everything was in PostgreSQL, all lost, and
    the cache opens empty. "fsync", "log": the local log still holds the 100 but not
    segments the flush's checkpoint let go (the segments are 1 KiB here); the
    open refuses loudly, because the namespace was created anew
    (ConfigError), instead of serving a cache with a hole."""
    from durablekv.config import MIN_SEGMENT_BYTES
    with pg_server() as server:
        c = pg_cache(tmp_path / "c", server, "n", durability=durability,
                     segment_bytes=MIN_SEGMENT_BYTES)
        for i in range(50):
            c[f"f{i}"] = i
        c.flush()
        for i in range(100):
            c[f"k{i}"] = i
        c._teardown(clean=False)  # the process dies without a flush ...
        server.kill()  # ... and so does the server, its data with it
        shutil.rmtree(server.data)
        server.initdb()
        server.start()
        if durability == "sync":
            with pg_cache(tmp_path / "c2", server, "n", durability=durability) as d:
                assert len(d) == 0
        else:
            with pytest.raises(ConfigError, match="was created anew .* the database lost "
                               "the store this log continues"):
                pg_cache(tmp_path / "c", server, "n", durability=durability)



def test_a_sync_write_is_committed_in_postgresql_before_it_returns(pg, pg_ns, tmp_path):
    with pg_cache(tmp_path / "c", pg, pg_ns, durability="sync") as c, \
            psycopg.connect(pg.url(), autocommit=True) as other:
        for i in range(1, 6):
            c[i] = i
            lsns = [r[0] for r in other.execute(
                "SELECT l.lsn FROM dkv_log l JOIN dkv_namespaces n USING (ns_id) "
                "WHERE n.name = %s ORDER BY l.lsn", (pg_ns,))]
            assert lsns == list(range(1, i + 1))
        c.flush()
        c[6] = 6  # the next flush's checkpoint lets the log rows go
        c.flush()
        left = other.execute("SELECT count(*) FROM dkv_log l JOIN dkv_namespaces n "
                             "USING (ns_id) WHERE n.name = %s", (pg_ns,)).fetchone()[0]
        assert left == 0


def test_concurrent_sync_writers_share_one_commit(pg, pg_ns, tmp_path, monkeypatch):
    """The first commit is held until all 8 writers have queued a record;
    then one transaction commits the other 7 (group commit)."""
    from durablekv.stores.pglog import PgReplayLog
    real = PgReplayLog._fenced_insert
    sizes: list[int] = []
    go = threading.Event()

    def held(self, rows):
        if not sizes:
            sizes.append(len(rows))
            assert go.wait(DEADLINE), "the writers did not queue their records"
        else:
            sizes.append(len(rows))
        return real(self, rows)

    with pg_cache(tmp_path / "c", pg, pg_ns, durability="sync") as c:
        monkeypatch.setattr(PgReplayLog, "_fenced_insert", held)
        threads = [threading.Thread(target=c.__setitem__, args=(i, i)) for i in range(8)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + DEADLINE
        while len(c._log._queue) < 7:  # 1 in the held commit, 7 waiting
            assert time.monotonic() < deadline
            time.sleep(0.005)
        go.set()
        for t in threads:
            t.join(DEADLINE)
        assert sizes == [1, 7]
        assert [c[i] for i in range(8)] == list(range(8))


def test_an_unknown_outcome_log_commit_is_retried_idempotently(pg, pg_ns, tmp_path, monkeypatch):
    """The connection dies just after COMMIT (the writer cannot tell whether
    it landed): the retry inserts by LSN with ON CONFLICT DO NOTHING, the
    write succeeds, and each record is there once."""
    from durablekv.stores.pglog import PgReplayLog
    lost = []

    def lose_connection(self, conn):
        if not lost:
            lost.append(conn.info.backend_pid)
            with psycopg.connect(pg.url(), autocommit=True) as killer:
                killer.execute("SELECT pg_terminate_backend(%s)", (conn.info.backend_pid,))
            conn.execute("SELECT 1")  # raises: the server closed the connection

    with pg_cache(tmp_path / "c", pg, pg_ns, durability="sync") as c:
        c["a"] = 1
        monkeypatch.setattr(PgReplayLog, "_after_commit", lose_connection)
        c["b"] = 2  # landed, the answer lost, retried: not reported as failed
        assert lost and c["b"] == 2
        rows = psycopg.connect(pg.url()).execute(
            "SELECT lsn FROM dkv_log l JOIN dkv_namespaces n USING (ns_id) WHERE n.name = %s "
            "ORDER BY lsn", (pg_ns,)).fetchall()
        assert rows == [(1,), (2,)]
        c["c"] = 3
    with pg_cache(tmp_path / "c", pg, pg_ns, durability="sync") as c:
        assert (c["a"], c["b"], c["c"]) == (1, 2, 3)


def test_an_unknown_outcome_flush_commit_is_resolved_by_its_flush_number(
        pg, pg_ns, tmp_path, monkeypatch):
    from durablekv.stores.postgres import PostgresPageStore
    lost = []

    def lose_connection(self):
        if not lost:
            pid = self._w.info.backend_pid
            lost.append(pid)
            with psycopg.connect(pg.url(), autocommit=True) as killer:
                killer.execute("SELECT pg_terminate_backend(%s)", (pid,))
            self._w.execute("SELECT 1")

    with pg_cache(tmp_path / "c", pg, pg_ns, page_size=4) as c:
        for i in range(20):
            c[i] = i
        monkeypatch.setattr(PostgresPageStore, "_after_commit", lose_connection)
        c.flush()  # landed: not retried, not reported failed
        assert lost and c._store._flush_seq == 1 and c.stats().checkpoint_lsn == 20
        assert c._store.integrity_check() == []


def test_a_taken_over_namespace_stops_the_old_owner(pg, pg_ns, tmp_path):
    """The old owner's sessions die (a network cut, say) and another cache
    takes the namespace; the old owner's next write fails stop instead of
    writing into the new owner's log."""
    old = pg_cache(tmp_path / "a", pg, pg_ns, durability="sync")
    try:
        old["x"] = 1
        with psycopg.connect(pg.url(), autocommit=True) as admin:
            admin.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                          "WHERE application_name = %s AND pid <> pg_backend_pid()",
                          (f"durablekv pid {os.getpid()}",))
        with open_with_deadline(tmp_path / "b", pg, pg_ns, durability="sync") as new:
            assert new["x"] == 1
            new["y"] = 2
            with pytest.raises(LogWriteError, match="taken over"):
                old["z"] = 3
            with pytest.raises(CacheFailedError):
                old["w"] = 4
            assert new.get("z") is None
    finally:
        old._teardown(clean=False)


def test_sync_needs_a_postgresql_store(tmp_path):
    with pytest.raises(ConfigError, match="durability='sync' .* needs a PostgreSQL store"):
        Cache(tmp_path / "c", durability="sync")


def test_every_write_path_commits_before_it_returns(pg, pg_ns, tmp_path):
    """setdefault, add, incr, touch and pop, and the event loop's no-wait set
    (which must decline: the record has to reach PostgreSQL first), each
    return only once their record is committed: the directory lost right
    after loses none of them."""
    c = pg_cache(tmp_path / "c", pg, pg_ns, durability="sync")
    c["gone"] = 1
    assert c._set_nowait("nowait", 1) is False and "nowait" not in c
    assert c.setdefault("sd", 1) == 1
    assert c.add("add", 2) is True
    assert c.incr("n", 5) == 5
    assert c.touch("sd", 3600) is True
    assert c.pop("gone") == 1
    c._teardown(clean=False)  # killed, and its directory with it
    shutil.rmtree(tmp_path / "c")
    with open_with_deadline(tmp_path / "elsewhere", pg, pg_ns, durability="sync") as c:
        assert (c.get("sd"), c.get("add"), c.get("n"), c.get("gone")) == (1, 2, 5, None)
