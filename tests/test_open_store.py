"""open_store (durablekv/stores/factory.py), the one place a cache's store and
replay log are chosen, with no Cache: what each location opens, the checks
of store= and namespace=, and the rebuild of a damaged SQLite store."""

from __future__ import annotations

import os

import pytest

from durablekv.errors import ConfigError, CorruptStoreError
from durablekv.log import OP_SET, ReplayLog
from durablekv.stores import open_store
from durablekv.stores.sqlite import SQLitePageStore


def _close(store, log) -> None:
    log.close()
    store.close()


def test_a_directory_opens_its_sqlite_store_and_replay_log(tmp_path):
    store, log = open_store(str(tmp_path), page_size=4, segment_bytes=1 << 20)
    try:
        assert type(store) is SQLitePageStore and type(log) is ReplayLog
        assert store.page_size == 4 and store.checkpoint_lsn == 0
        assert store.rebuilt_from is None and log.segment_bytes == 1 << 20
        assert os.path.exists(tmp_path / "pages.sqlite3")
        assert log.recover(store.checkpoint_lsn).records == []
    finally:
        _close(store, log)
    # reopened: the stored page size wins over none given
    store, log = open_store(str(tmp_path))
    try:
        assert store.page_size == 4
    finally:
        _close(store, log)


@pytest.mark.parametrize("url, namespace, durability, says", [
    ("redis://localhost", "n", "log", "postgresql://"),
    ("postgresql://u:hunter2@db/x", None, "log", "namespace="),
    (None, "n", "log", "no store= was given"),
    (None, None, "sync", "needs a PostgreSQL store"),
])
def test_a_bad_location_is_refused_with_the_fix(tmp_path, url, namespace, durability, says):
    with pytest.raises(ConfigError, match=says) as err:
        open_store(str(tmp_path), url, namespace=namespace, durability=durability)
    assert "hunter2" not in str(err.value)  # a password is never shown
    assert not os.path.exists(tmp_path / "pages.sqlite3")  # nothing was made


def _damaged(directory) -> None:
    """A store with a committed checkpoint, a log past it, then a damage marker."""
    store, log = open_store(str(directory), page_size=4)
    log.recover(0)
    log.start(1)
    for lsn in range(1, 6):
        log.append(lsn, OP_SET, b"s\x01\x00\x00\x00k", b"b\x01\x00\x00\x00v", None)
    log.sync()
    log.close()
    store.close()
    (directory / "pages.sqlite3.damaged").write_text("page 3 cannot be decoded\n")


def test_a_damaged_store_is_refused_unless_rebuild_is_asked(tmp_path):
    _damaged(tmp_path)
    with pytest.raises(CorruptStoreError, match="page 3"):
        open_store(str(tmp_path))
    store, log = open_store(str(tmp_path), on_corruption="rebuild")
    try:
        assert store.rebuilt_from is not None and ".corrupt-" in store.rebuilt_from
        assert os.path.exists(store.rebuilt_from)
        assert not os.path.exists(tmp_path / "pages.sqlite3.damaged")
        # the new store starts where the log does, so the log replays whole
        assert store.checkpoint_lsn == 0
        assert [r[0] for r in log.recover(store.checkpoint_lsn).records] == [1, 2, 3, 4, 5]
    finally:
        _close(store, log)


def test_a_postgresql_url_opens_its_namespace_with_the_log_in_the_directory(tmp_path, pg):
    from durablekv.stores.pglog import PgReplayLog
    from durablekv.stores.postgres import PostgresPageStore

    store, log = open_store(str(tmp_path), pg.url(), namespace="factory", page_size=8)
    try:
        assert type(store) is PostgresPageStore and type(log) is ReplayLog
        assert store.page_size == 8 and store.rebuilt_from is None
        assert (tmp_path / "STORE").read_text().split()[2] == "factory"
    finally:
        _close(store, log)
    store, log = open_store(str(tmp_path), pg.url(), namespace="factory", durability="sync")
    try:
        assert type(log) is PgReplayLog  # durability="sync": the log is the database's
    finally:
        _close(store, log)
    # the directory's log belongs to "factory": another namespace is refused
    other = tmp_path / "other"
    other.mkdir()
    store, log = open_store(str(other), pg.url(), namespace="factory")
    log.recover(0)
    log.start(1)
    log.append(1, OP_SET, b"s\x01\x00\x00\x00k", b"b\x01\x00\x00\x00v", None)
    _close(store, log)
    with pytest.raises(ConfigError, match="belongs to namespace 'factory'"):
        open_store(str(other), pg.url(), namespace="another")


def test_a_log_that_cannot_be_opened_leaves_no_store_open(tmp_path, monkeypatch):
    import durablekv.stores.factory as factory

    closed = []
    real_close = SQLitePageStore.close
    monkeypatch.setattr(SQLitePageStore, "close",
                        lambda self: (closed.append(self), real_close(self))[1])

    def refused(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(factory, "ReplayLog", refused)
    with pytest.raises(OSError, match="No space"):
        open_store(str(tmp_path))
    assert len(closed) == 1
