"""The store factory the conformance suite runs against: one per PageStore implementation.

A factory opens a store at one fixed location (every ``open()`` reopens the
same one), and knows the few implementation-specific moves a test needs:
damage a stored page, write a raw meta value, and open the store in a child
process (for the kill test). Add an implementation by adding a factory class
and its name to ``STORES`` and :func:`store_factory`.
"""

from __future__ import annotations

import sqlite3
import textwrap
from pathlib import Path
from typing import Any

import pytest

from durablekv.stores.sqlite import SQLitePageStore
from durablekv.stores.sqlitefile import STORE_FILE


class SQLiteFactory:
    """``SQLitePageStore`` in a temporary cache directory."""

    name = "sqlite"
    #: a method called inside the batch's transaction, just before it commits
    commit_hook = "_commit"

    def __init__(self, tmp_path: Path) -> None:
        self.directory = tmp_path / "store"
        self.directory.mkdir()

    def open(self, **kw: Any) -> SQLitePageStore:
        return SQLitePageStore(self.directory, **kw)

    def child_source(self) -> str:
        """Python source run in a child: defines ``store`` (opened at this factory's location)."""
        return textwrap.dedent(f"""
            from durablekv.stores.sqlite import SQLitePageStore
            store = SQLitePageStore({str(self.directory)!r})
        """)

    def _sql(self, statement: str, params: tuple = ()) -> list:
        conn = sqlite3.connect(self.directory / STORE_FILE)
        try:
            with conn:
                return conn.execute(statement, params).fetchall()
        finally:
            conn.close()

    def corrupt_page(self, page_id: int) -> None:
        """Flip a bit in the last byte of a stored page's blob (store closed);
        its checksum stays as it was."""
        (data,), = self._sql("SELECT data FROM pages WHERE page_id = ?", (page_id,))
        self._sql("UPDATE pages SET data = ? WHERE page_id = ?",
                  (data[:-1] + bytes([data[-1] ^ 1]), page_id))

    def set_meta(self, name: str, value: Any) -> None:
        """Write a raw meta value (store closed)."""
        self._sql("UPDATE meta SET value = ? WHERE name = ?", (value, name))


class PostgresFactory:
    """``PostgresPageStore`` on the session's real PostgreSQL server (the
    ``pg`` fixture of tests/conftest.py: skipped with the reason when the
    binaries or psycopg are missing, a failure in CI), a fresh namespace per test."""

    name = "postgres"
    commit_hook = "_before_commit"

    def __init__(self, server: Any, namespace: str) -> None:
        self.server, self.namespace = server, namespace

    def open(self, **kw: Any) -> Any:
        from durablekv.stores.postgres import PostgresPageStore
        return PostgresPageStore(self.server.url(), self.namespace, **kw)

    def child_source(self) -> str:
        return textwrap.dedent(f"""
            from durablekv.stores.postgres import PostgresPageStore
            store = PostgresPageStore({self.server.url()!r}, {self.namespace!r})
        """)

    def _sql(self, statement: str, **params: Any) -> list:
        """Run ``statement`` (named parameters; ``%(ns)s`` is this namespace's id)."""
        import psycopg
        with psycopg.connect(self.server.url(), autocommit=True) as conn:
            (ns,), = conn.execute("SELECT ns_id FROM dkv_namespaces WHERE name = %s",
                                  (self.namespace,)).fetchall()
            cur = conn.execute(statement, {"ns": ns, **params})
            return cur.fetchall() if cur.description else []

    def corrupt_page(self, page_id: int) -> None:
        (data,), = self._sql("SELECT data FROM dkv_pages WHERE ns_id = %(ns)s AND "
                             "page_id = %(pid)s", pid=page_id)
        data = bytes(data)
        self._sql("UPDATE dkv_pages SET data = %(data)s WHERE ns_id = %(ns)s AND "
                  "page_id = %(pid)s", data=data[:-1] + bytes([data[-1] ^ 1]), pid=page_id)

    def set_meta(self, name: str, value: Any) -> None:
        self._sql("UPDATE dkv_meta SET value = %(value)s WHERE ns_id = %(ns)s AND "
                  "name = %(name)s", value=str(value), name=name)


STORES = ("sqlite", "postgres")


@pytest.fixture(params=STORES)
def store_factory(request: pytest.FixtureRequest, tmp_path: Path) -> Any:
    """A factory for each PageStore implementation (the conformance suite runs
    once per store). PostgreSQL uses the session's real server, and skips with
    the reason (or fails in CI) exactly as tests/test_postgres_*.py do."""
    if request.param == "postgres":
        return PostgresFactory(request.getfixturevalue("pg"), request.getfixturevalue("pg_ns"))
    return SQLiteFactory(tmp_path)

