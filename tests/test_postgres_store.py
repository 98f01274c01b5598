"""The PostgreSQL page store against real PostgreSQL servers (tests/pg.py).

The Cache API on the store (a dict-model state machine across flush, close,
reopen and a move to a new directory), the flush transaction (atomic when
the process is killed before COMMIT; checkpoint committed with the pages),
the namespace lock (a second opener refused; a SIGKILLed owner's lock ends
with its session and the next opener recovers every acknowledged write),
and bad input: unreachable or wrong connection strings (host named,
password never printed), a newer schema, a standby that refuses writes,
and a server that disappears mid-flush.
"""

from __future__ import annotations

import os
import signal
import tempfile
import time

import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, rule, run_state_machine_as_test

from durablekv import Cache
from durablekv.errors import (CacheLockedError, ConfigError, NamespaceLockedError,
                              SchemaVersionError, StoreError, WriteBehindError)
from .conftest import open_cache
from .pg import (DEADLINE, PASSWORD, PgServer, kill_at, open_with_deadline, pg_cache, pg_server,
                 read_until, store_rows, writer)
from .test_cache_api import CacheVsDict

psycopg = pytest.importorskip("psycopg") if os.environ.get(
    "DURABLEKV_REQUIRE_POSTGRES") != "1" else __import__("psycopg")



def store_check(pg, ns: str) -> list[str]:
    """The store's own index/page agreement check, on a fresh connection."""
    from durablekv.stores.postgres import PostgresPageStore
    s = PostgresPageStore(pg.url(), ns)
    try:
        return s.integrity_check()
    finally:
        s.close()


# -- the Cache API on the store ------------------------------------------------------------


def test_the_mapping_api_agrees_with_a_dict_across_flush_close_reopen_and_a_new_directory(pg):
    counter = [0]

    class PgCacheVsDict(CacheVsDict):
        def __init__(self):
            RuleBasedStateMachine.__init__(self)  # not CacheVsDict's: no SQLite cache
            counter[0] += 1
            self.ns = f"model-{counter[0]}"
            self.tmp = tempfile.TemporaryDirectory()
            self.path = os.path.join(self.tmp.name, "c")
            self.cache = pg_cache(self.path, pg, self.ns, page_size=2, max_pages=2,
                                  flush_batch_pages=3)
            self.model = {}
            self.moves = 0

        @rule()
        def reopen(self):
            self.cache.close()
            self.cache = pg_cache(self.path, pg, self.ns, max_pages=2, flush_batch_pages=3)

        @rule()
        def move(self):
            """After a flush everything is in PostgreSQL: a new directory
            (an empty replay log) sees the same contents."""
            self.cache.flush()
            self.cache.close()
            self.moves += 1
            self.path = os.path.join(self.tmp.name, f"c{self.moves}")
            self.cache = pg_cache(self.path, pg, self.ns, max_pages=2, flush_batch_pages=3)

        def teardown(self):
            try:
                self.cache.flush()
                self.cache.close()
                assert store_check(pg, self.ns) == []
            finally:
                self.tmp.cleanup()

    run_state_machine_as_test(PgCacheVsDict, settings=settings(
        max_examples=15, stateful_step_count=25, deadline=None,
        suppress_health_check=[HealthCheck.too_slow]))


def test_ttl_clear_and_store_hits_on_the_postgres_store(pg, pg_ns, tmp_path):
    from .conftest import Clock
    clock = Clock(1000.0)
    with pg_cache(tmp_path / "c", pg, pg_ns, page_size=4, max_pages=2, clock=clock) as c:
        for i in range(40):
            c.set(i, i * 10, expire=5 if i % 2 else None)
        c.flush()
    # a new directory: everything comes from PostgreSQL
    with pg_cache(tmp_path / "d", pg, pg_ns, max_pages=2, clock=clock) as c:
        assert len(c) == 40 and c[7] == 70 and c.stats().store_hits >= 1
        clock.now += 10
        assert c.get(7) is None and c[8] == 80  # (the get removes key 7)
        assert c.expire() == 19 and len(c) == 20
        c.flush()
        assert c._store.integrity_check() == []
        c.clear()
        c.flush()
        assert len(c) == 0
    meta, keys = store_rows(pg, pg_ns)
    assert keys == {} and meta["key_count"] == "0"


def test_the_page_blobs_are_the_sqlite_stores_bytes(pg, pg_ns, tmp_path):
    import sqlite3
    with open_cache(tmp_path / "sqlite", page_size=4) as a, \
            pg_cache(tmp_path / "pg", pg, pg_ns, page_size=4) as b:
        for c in (a, b):
            for i in range(20):
                c[f"key{i}"] = b"v" * i
            c.flush()
    with sqlite3.connect(tmp_path / "sqlite" / "pages.sqlite3") as conn:
        lite = dict(conn.execute("SELECT page_id, data FROM pages"))
    with psycopg.connect(pg.url()) as conn:
        pgs = dict(conn.execute("SELECT p.page_id, p.data FROM dkv_pages p JOIN dkv_namespaces n "
                                "USING (ns_id) WHERE n.name = %s", (pg_ns,)))
    assert lite == pgs and len(pgs) == 5


# -- the flush transaction -----------------------------------------------------------------


def test_a_process_killed_before_commit_leaves_the_previous_flush_whole(pg, pg_ns, tmp_path):
    acked = kill_at(writer(tmp_path / "c", pg, pg_ns, "fsync", "commit"), "T")
    assert acked == list(range(400))
    meta, keys = store_rows(pg, pg_ns)
    # exactly the first flush: no key of the half-written second one
    assert int(meta["key_count"]) == len(keys) == 200
    assert int(meta["checkpoint_lsn"]) == 200
    # the replay log holds the rest: reopening recovers every acknowledged set
    with open_with_deadline(tmp_path / "c", pg, pg_ns) as c:
        assert c.recovered_records == 200
        assert all(c[f"k{i}"] == f"v{i}" for i in acked)
        c.flush()
        assert c._store.integrity_check() == []
    meta, keys = store_rows(pg, pg_ns)
    assert int(meta["checkpoint_lsn"]) == 400 and len(keys) == 400


def test_the_checkpoint_commits_with_the_pages_and_a_failed_flush_moves_neither(
        pg, pg_ns, tmp_path, monkeypatch):
    from durablekv.stores.postgres import PostgresPageStore
    with pg_cache(tmp_path / "c", pg, pg_ns, page_size=4) as c:
        for i in range(10):
            c[i] = i
        c.flush()
        meta, keys = store_rows(pg, pg_ns)
        assert meta["checkpoint_lsn"] == "10" and len(keys) == 10

        def fail(self):
            raise RuntimeError("injected failure before COMMIT")
        monkeypatch.setattr(PostgresPageStore, "_before_commit", fail)
        for i in range(10, 20):
            c[i] = i
        with pytest.raises(WriteBehindError, match="injected failure"):
            c.flush()
        meta, keys = store_rows(pg, pg_ns)
        assert meta["checkpoint_lsn"] == "10" and len(keys) == 10 and meta["key_count"] == "10"
        assert c._store.checkpoint_lsn == 10
        monkeypatch.undo()
        c.flush(timeout=10)
        meta, keys = store_rows(pg, pg_ns)
        assert meta["checkpoint_lsn"] == "20" and len(keys) == 20
    assert store_check(pg, pg_ns) == []


# -- one owner per namespace -----------------------------------------------------------------


def test_a_second_opener_of_a_namespace_is_refused(pg, pg_ns, tmp_path):
    with pg_cache(tmp_path / "a", pg, pg_ns) as c:
        c["x"] = 1
        with pytest.raises(NamespaceLockedError, match=rf"namespace '{pg_ns}' .*already owned by "
                           rf"durablekv pid {os.getpid()}") as info:
            pg_cache(tmp_path / "b", pg, pg_ns)
        assert isinstance(info.value, CacheLockedError) and PASSWORD not in str(info.value)
        # another namespace in the same database is independent
        with pg_cache(tmp_path / "b", pg, pg_ns + "-other") as d:
            d["x"] = 2
            assert c["x"] == 1
    with pg_cache(tmp_path / "b", pg, pg_ns) as c:  # closed: the lock is free
        assert c.get("x") in (None, 1)  # (not flushed: the log stayed in directory a)


def test_a_killed_owner_releases_the_namespace_and_the_next_opener_recovers(pg, pg_ns, tmp_path):
    proc = writer(tmp_path / "c", pg, pg_ns, "fsync", "run")
    acked: list[int] = []
    try:
        read_until(proc, "open", acked)
        deadline = time.monotonic() + DEADLINE
        for line in proc.stdout:
            acked.append(int(line.split()[1]))
            if len(acked) >= 180 or time.monotonic() > deadline:
                break
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    finally:
        proc.kill()
    assert len(acked) >= 180
    with open_with_deadline(tmp_path / "c", pg, pg_ns) as c:
        missing = [i for i in acked if c.get(f"k{i}") != f"v{i}"]
        assert missing == []
        c.flush()
        assert c._store.integrity_check() == []


# -- bad input ---------------------------------------------------------------------------------


def test_an_unreachable_server_is_named_without_the_password(tmp_path):
    from .pg import _free_port
    port = _free_port()
    url = f"postgresql://app:{PASSWORD}@127.0.0.1:{port}/cache"
    with pytest.raises(StoreError, match=rf"cannot connect to PostgreSQL at "
                       rf"postgresql://app@127.0.0.1:{port}/cache") as info:
        Cache(tmp_path / "c", store=url, namespace="n", busy_timeout=2)
    assert PASSWORD not in str(info.value) and "check that the server runs" in str(info.value)
    assert PASSWORD not in repr(info.value.__cause__ or "")


def test_a_wrong_password_is_refused_without_printing_it(pg, tmp_path):
    url = f"postgresql://postgres:not-{PASSWORD}@127.0.0.1:{pg.port}/postgres"
    with pytest.raises(StoreError, match="password authentication failed") as info:
        Cache(tmp_path / "c", store=url, namespace="n")
    assert PASSWORD not in str(info.value) and f"127.0.0.1:{pg.port}" in str(info.value)


@pytest.mark.parametrize("kw,words", [
    (dict(store="mysql://h/db", namespace="n"), "store must be None .* or a 'postgresql://' URL"),
    (dict(store="postgresql://u:pw@h/db"), "needs namespace="),
    (dict(store="postgresql://u:pw@h/db", namespace=""), "needs namespace="),
    (dict(namespace="n"), "no store= was given"),
    (dict(store="postgresql://u:pw@h/db?badoption=1", namespace="n"), "cannot be parsed"),
])
def test_bad_store_arguments_are_config_errors(tmp_path, kw, words):
    with pytest.raises(ConfigError, match=words) as info:
        Cache(tmp_path / "c", **kw)
    assert ":pw@" not in str(info.value)


def test_a_database_with_a_newer_schema_is_refused(pg, tmp_path):
    with psycopg.connect(pg.url(), autocommit=True) as conn:
        conn.execute("CREATE DATABASE newer")
    url = pg.url("newer")
    Cache(tmp_path / "a", store=url, namespace="n").close()
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("UPDATE dkv_schema SET version = 99")
    with pytest.raises(SchemaVersionError, match="schema version 99, but this durablekv "
                       "supports up to 2; upgrade durablekv"):
        Cache(tmp_path / "b", store=url, namespace="n")


def test_a_standby_that_refuses_writes_is_named(pg, tmp_path):
    standby = PgServer()
    try:
        standby._tool("pg_basebackup", "-D", str(standby.data), "-d", pg.url(), "-R",
                      "-X", "stream", "-c", "fast", "--no-sync", timeout=DEADLINE)
        standby.start()
        with pytest.raises(StoreError, match=rf"127.0.0.1:{standby.port} .*is a read-only "
                           "standby and refuses writes") as info:
            Cache(tmp_path / "c", store=standby.url(), namespace="n")
        assert PASSWORD not in str(info.value)
        # listing the standby first and the primary second finds the primary
        both = (f"postgresql://postgres:{PASSWORD}@127.0.0.1:{standby.port},127.0.0.1:{pg.port}"
                "/postgres?target_session_attrs=read-write")
        with Cache(tmp_path / "d", store=both, namespace="via-both") as c:
            c["x"] = 1
            c.flush()
    finally:
        standby.remove()


def test_a_server_that_disappears_mid_flush_keeps_writes_in_the_log(tmp_path):
    """Writes go on being acknowledged (the replay log holds them); flushes
    fail loudly; after the server is back, nothing acknowledged is lost."""
    with pg_server() as server:
        c = open_cache(tmp_path / "c", store=server.url(), namespace="n", page_size=4,
                       durability="fsync")
        try:
            for i in range(50):
                c[i] = i
            c.flush()
            server.kill()
            for i in range(50, 100):
                c[i] = i
            with pytest.raises(WriteBehindError, match=r"unreachable or read-only|"
                               r"unable to open a connection") as info:
                c.flush()
            assert PASSWORD not in str(info.value)
            assert c[75] == 75
        finally:
            with pytest.raises(WriteBehindError):
                c.close()
        server.start()
        with open_cache(tmp_path / "c", store=server.url(), namespace="n") as c:
            assert [c.get(i) for i in range(100)] == list(range(100))
            c.flush()


def test_a_directory_whose_log_belongs_to_another_store_is_refused(pg, pg_ns, tmp_path):
    """Its records after the checkpoint would be replayed into the wrong namespace."""
    c = pg_cache(tmp_path / "c", pg, pg_ns)
    c["x"] = "from the first namespace"
    assert os.stat(tmp_path / "c" / "STORE").st_mode & 0o777 == 0o600  # private, as LOCK
    c._teardown(clean=False)  # as a killed process leaves it: the log holds x
    with pytest.raises(ConfigError, match=rf"belongs to namespace '{pg_ns}' .*not to namespace "
                       rf"'{pg_ns}-b'"):
        pg_cache(tmp_path / "c", pg, pg_ns + "-b")
    with pg_cache(tmp_path / "c", pg, pg_ns) as c:  # its own namespace recovers it
        assert c["x"] == "from the first namespace"
    with pg_cache(tmp_path / "c", pg, pg_ns + "-b") as c:  # closed cleanly: no log left
        assert c.get("x") is None
    lite = open_cache(tmp_path / "lite")
    lite["y"] = 1
    lite._teardown(clean=False)
    with pytest.raises(ConfigError, match="belongs to the SQLite store pages.sqlite3"):
        pg_cache(tmp_path / "lite", pg, pg_ns + "-c")
    # ... and the other way round: the SQLite store refuses a namespace's directory
    with pytest.raises(ConfigError, match=rf"belongs to PostgreSQL namespace '{pg_ns}-b'"):
        open_cache(tmp_path / "c")
    assert not (tmp_path / "c" / "pages.sqlite3").exists()


def test_a_page_changed_in_the_database_fails_its_checksum(pg, pg_ns, tmp_path):
    from durablekv.errors import CorruptStoreError
    with pg_cache(tmp_path / "c", pg, pg_ns, page_size=4) as c:
        for i in range(8):
            c[i] = b"value %d" % i
        c.flush()
    with psycopg.connect(pg.url(), autocommit=True) as conn:  # one flipped bit
        conn.execute("UPDATE dkv_pages SET data = set_byte(data, length(data) - 1, "
                     "get_byte(data, length(data) - 1) # 1) WHERE page_id = 1 AND ns_id = "
                     "(SELECT ns_id FROM dkv_namespaces WHERE name = %s)", (pg_ns,))
    with pg_cache(tmp_path / "d", pg, pg_ns, max_pages=1) as c:
        with pytest.raises(CorruptStoreError, match="page 1 fails its checksum"):
            [c[i] for i in range(8)]
        assert any("page 1: fails its checksum" in p for p in c._store.integrity_check())


def _doc_sql(section: str) -> list[str]:
    """The statements of the ```sql blocks under ``section`` in docs/postgres.md."""
    import re
    from pathlib import Path
    doc = (Path(__file__).resolve().parents[1] / "docs" / "postgres.md").read_text()
    part = doc.split(f"## {section}\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```sql\n(.*?)```", part, re.S)
    return [stmt.strip() for block in blocks for stmt in block.split(";") if stmt.strip()]


def test_a_role_without_create_on_public_gets_the_grants_to_run(pg, tmp_path):
    """PostgreSQL 15+: a role that does not own the database may not create
    tables in public. The error names the grant, and the SQL of
    docs/postgres.md ("Setting up the database") then makes the open work."""
    create_role, create_db, grant_db, grant_schema = _doc_sql("Setting up the database")
    assert create_role.startswith("CREATE ROLE app") and grant_schema.startswith("GRANT USAGE")
    admin = psycopg.connect(pg.url(), autocommit=True)
    try:
        admin.execute(create_role)
        admin.execute("CREATE DATABASE cache")  # owned by postgres, not app
        admin.execute(grant_db)
    finally:
        admin.close()
    url = f"postgresql://app:secret@127.0.0.1:{pg.port}/cache"
    version = psycopg.connect(pg.url(), autocommit=True).execute("SHOW server_version_num")
    if int(version.fetchone()[0]) >= 150000:
        with pytest.raises(StoreError) as info:
            Cache(tmp_path / "c", store=url, namespace="n")
        msg = str(info.value)
        assert "permission denied for schema public" in msg, msg
        assert "GRANT USAGE, CREATE ON SCHEMA public TO app" in msg and "secret" not in msg
    admin = psycopg.connect(pg.url("cache"), autocommit=True)
    try:
        admin.execute(grant_schema)
    finally:
        admin.close()
    with Cache(tmp_path / "c", store=url, namespace="n") as cache:
        cache["a"] = 1
    with Cache(tmp_path / "c", store=url, namespace="n") as cache:
        assert cache["a"] == 1


def test_a_database_that_does_not_exist_names_how_to_create_it(pg, tmp_path):
    url = f"postgresql://postgres:{PASSWORD}@127.0.0.1:{pg.port}/nosuchdb"
    with pytest.raises(StoreError) as info:
        Cache(tmp_path / "c", store=url, namespace="n")
    msg = str(info.value)
    assert 'database "nosuchdb" does not exist' in msg and "CREATE DATABASE" in msg
    assert PASSWORD not in msg
