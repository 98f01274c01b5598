"""A damaged, truncated, foreign or newer page store is detected at open."""

from __future__ import annotations

import logging
import os
import random
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from durablekv import (Cache, CacheLockedError, ConfigError, CorruptStoreError,
                       SchemaVersionError)
from durablekv.cli import main

STORE = "pages.sqlite3"
REPO = Path(__file__).resolve().parents[1]


def make_store(d: Path, n: int = 300) -> None:
    with Cache(d, page_size=4, max_pages=4) as cache:
        for i in range(n):
            cache[f"k{i}"] = "v" * 100


def test_br021_random_bytes_over_the_header(tmp_path):
    d = tmp_path / "c"
    make_store(d)
    with open(d / STORE, "r+b") as f:
        f.write(random.Random(1).randbytes(100))
    t0 = time.monotonic()
    with pytest.raises(CorruptStoreError) as exc:
        Cache(d)
    assert time.monotonic() - t0 < 2
    assert str(d / STORE) in str(exc.value) and "rebuild" in str(exc.value)
    # strict mode left the file alone; rebuild moves it aside and starts empty
    with Cache(d, on_corruption="rebuild") as cache:
        assert len(cache) == 0 and cache.get("k1") is None
        assert cache.store_rebuilds == 1
        cache["new"] = 1
    asides = [p for p in os.listdir(d) if p.startswith(STORE + ".corrupt-")]
    assert len(asides) == 1
    with Cache(d) as cache:
        assert dict(cache.items()) == {"new": 1}


def test_truncated_store_is_detected_at_open(tmp_path):
    d = tmp_path / "c"
    make_store(d)
    size = os.path.getsize(d / STORE)
    with open(d / STORE, "r+b") as f:
        f.truncate(size // 2)
    with pytest.raises(CorruptStoreError) as exc:
        Cache(d)
    assert "truncated" in str(exc.value)


def test_an_empty_store_file_is_damage_not_a_new_cache(tmp_path, capsys):
    """A store truncated to 0 bytes after a clean close (the log is gone, so
    nothing else says data was there) opened as a new, empty cache, and the
    next check said healthy. A store is created whole under another name
    and renamed into place, so an empty file is damage."""
    d = tmp_path / "c"
    make_store(d)
    os.truncate(d / STORE, 0)
    with pytest.raises(CorruptStoreError) as exc:
        Cache(d)
    assert "empty (0 bytes)" in str(exc.value)
    assert main(["check", str(d)]) == 1
    capsys.readouterr()
    with Cache(d, on_corruption="rebuild") as cache:
        assert len(cache) == 0 and cache.store_rebuilds == 1


def test_a_store_is_never_left_half_made(tmp_path, monkeypatch):
    """A process killed while it creates the store leaves only the temporary
    file, which the next open replaces; pages.sqlite3 appears only whole."""
    d = tmp_path / "c"
    real_replace = os.replace

    def killed(src, dst):
        raise KeyboardInterrupt  # the kill, just before the rename

    monkeypatch.setattr(os, "replace", killed)
    with pytest.raises(KeyboardInterrupt):
        Cache(d)
    assert not (d / STORE).exists() and (d / (STORE + ".new")).exists()
    monkeypatch.setattr(os, "replace", real_replace)
    with Cache(d, page_size=4) as cache:
        cache["a"] = 1
    # resident.list: the warm restart's list, written at close
    assert sorted(os.listdir(d)) == ["LOCK", STORE, "resident.list"]
    with Cache(d) as cache:
        assert cache["a"] == 1 and cache.page_size == 4


def reset_by_hand(d: Path) -> None:
    """What a user does to reset a cache: delete the store and the log."""
    for name in os.listdir(d):
        if name == STORE or name.startswith("replay-"):
            os.unlink(d / name)


def test_a_new_store_never_takes_the_wal_of_a_store_that_is_gone(tmp_path, capsys, caplog):
    """A killed process leaves pages.sqlite3-wal; the user then deletes the
    store and the log to reset the cache. SQLite applied that old WAL to the
    new store: the reset cache served old keys, or counted keys it did not
    have, and check said healthy."""
    d = tmp_path / "c"
    cache = Cache(d, flush_interval=3600)
    for i in range(300):
        cache[f"old{i}"] = i
    cache.flush()
    wal = (d / (STORE + "-wal")).read_bytes()
    assert wal                              # the flush is in the WAL
    cache._teardown(clean=False)
    reset_by_hand(d)
    (d / (STORE + "-wal")).write_bytes(wal)  # what the killed process left
    assert main(["check", str(d)]) == 0
    assert "-wal: left by a store that is gone" in capsys.readouterr().out
    with caplog.at_level(logging.WARNING, logger="durablekv.store"):
        with Cache(d) as cache:
            assert len(cache) == 0 and list(cache) == []
            cache["new"] = 1
    assert "removed what it left (pages.sqlite3-wal)" in caplog.text
    assert main(["check", str(d)]) == 0
    capsys.readouterr()
    with Cache(d) as cache:
        assert dict(cache.items()) == {"new": 1}


def test_a_damage_marker_of_a_store_that_is_gone_does_not_refuse_the_next_one(tmp_path,
                                                                              capsys):
    """A marker left beside a store deleted to reset the cache was ignored
    while no store existed, then refused the new, healthy store at its
    second open (and a rebuild then dropped its acknowledged writes)."""
    d = tmp_path / "c"
    with Cache(d) as cache:
        cache["a"] = 1
    (d / (STORE + ".damaged")).write_text("page 3 cannot be decoded\n")
    reset_by_hand(d)
    assert main(["check", str(d)]) == 0
    assert "left by a store that is gone" in capsys.readouterr().out
    with Cache(d) as cache:
        cache["fresh"] = "ack"
    with Cache(d) as cache:
        assert dict(cache.items()) == {"fresh": "ack"}


def test_rebuild_still_applies_the_replay_log(tmp_path):
    d = tmp_path / "c"
    cache = Cache(d, flush_interval=3600, flush_batch_pages=10**6)
    cache["logged"] = "yes"
    cache._teardown(clean=False)  # crash before any flush
    with open(d / STORE, "r+b") as f:
        f.write(b"\xff" * 100)
    with Cache(d, on_corruption="rebuild") as cache:
        assert cache["logged"] == "yes"


def test_foreign_sqlite_database_is_refused(tmp_path):
    d = tmp_path / "c"
    d.mkdir()
    conn = sqlite3.connect(d / STORE)
    conn.execute("CREATE TABLE users (id INTEGER)")
    conn.commit()
    conn.close()
    with pytest.raises(CorruptStoreError) as exc:
        Cache(d)
    assert "not a durablekv store" in str(exc.value)


def test_newer_schema_version_is_refused(tmp_path, capsys):
    """Open refuses a store from a newer durablekv; check calls it unchecked,
    not damaged (a false DAMAGED could lead to a needless rebuild)."""
    d = tmp_path / "c"
    make_store(d, 5)
    conn = sqlite3.connect(d / STORE)
    conn.execute("PRAGMA user_version = 99")
    conn.commit()
    conn.close()
    with pytest.raises(SchemaVersionError) as exc:
        Cache(d)
    assert exc.value.found == 99 and "upgrade durablekv" in str(exc.value)
    assert main(["check", str(d)]) == 2
    out = capsys.readouterr().out
    assert "newer durablekv" in out and "upgrade durablekv" in out and "DAMAGE" not in out


def test_page_size_is_adopted_or_conflicts(tmp_path):
    d = tmp_path / "c"
    make_store(d, 5)
    with Cache(d) as cache:
        assert cache.page_size == 4
    with Cache(d, page_size=4) as cache:
        assert cache["k1"] == "v" * 100
    with pytest.raises(ConfigError) as exc:
        Cache(d, page_size=16)
    assert "page_size=4" in str(exc.value)


def test_check_reports_health_and_damage(tmp_path, capsys):
    d = tmp_path / "c"
    make_store(d)
    assert main(["check", str(d)]) == 0
    assert "healthy" in capsys.readouterr().out
    # break the index: point one key at a page that does not hold it
    conn = sqlite3.connect(d / STORE)
    key = conn.execute("SELECT key FROM keys LIMIT 1").fetchone()[0]
    conn.execute("UPDATE keys SET page_id = -5 WHERE key = ?", (key,))
    conn.commit()
    conn.close()
    assert main(["check", str(d)]) == 1
    out = capsys.readouterr().out
    assert "DAMAGE" in out and "page -5" in out



def flip_a_page(d: Path) -> tuple[int, list[str]]:
    """Flip a bit in one stored page blob (its checksum left as it was):
    SQLite's own checks pass, only the page checksum finds it. Returns the
    page id and the keys the index places in it."""
    conn = sqlite3.connect(d / STORE)
    pid = conn.execute("SELECT page_id FROM pages ORDER BY page_id LIMIT 1 OFFSET 3"
                       ).fetchone()[0]
    data = bytearray(conn.execute("SELECT data FROM pages WHERE page_id = ?",
                                  (pid,)).fetchone()[0])
    data[len(data) // 2] ^= 0x10
    conn.execute("UPDATE pages SET data = ? WHERE page_id = ?", (bytes(data), pid))
    keys = [r[0] for r in conn.execute("SELECT key FROM keys WHERE page_id = ?", (pid,))]
    conn.commit()
    conn.close()
    return pid, keys


def test_check_names_the_next_step_for_a_damaged_page_and_that_step_repairs_it(tmp_path,
                                                                              capsys):
    """check said "DAMAGE page 6: fails its checksum" and "result DAMAGED"
    with no next step, where log damage names `durablekv salvage DIR`. It
    names one for the store, and following it leaves a store that checks
    healthy, with what the replay log held still there."""
    d = tmp_path / "c"
    make_store(d, 40)
    pid, keys = flip_a_page(d)
    cache = Cache(d, page_size=4, flush_interval=3600, flush_batch_pages=10**6)
    cache["only-in-the-log"] = 1        # a write the store has not got, only the log
    cache._teardown(clean=False)        # as if killed
    assert main(["check", str(d)]) == 1
    lines = capsys.readouterr().out.splitlines()
    (page,) = [x for x in lines if x.startswith(f"DAMAGE  page {pid}: fails its checksum")]
    assert f"the {len(keys)} keys the index places in it cannot be read" in page, page
    # its keys are that page's damage, not lines of their own
    assert not [x for x in lines if "which does not hold it" in x], lines
    (step,) = [x for x in lines if x.startswith("next    ")]
    assert lines.index(step) == lines.index(page) + 1 and lines[-1] == "result  DAMAGED"
    assert f"`durablekv salvage --on-corruption rebuild {d}`" in step, step
    assert "restore the directory from a backup" in step, step

    assert main(["salvage", "--on-corruption", "rebuild", str(d)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert any(f"page {pid}: fails its checksum" in x and "rebuilds it" in x for x in out), out
    assert out[-1].startswith("result  REBUILT"), out
    assert any(p.name.startswith(STORE + ".corrupt-") for p in d.iterdir())
    assert main(["check", str(d)]) == 0, capsys.readouterr().out
    capsys.readouterr()
    # the application opens it as before: the new store keeps the old one's page_size
    with Cache(d, page_size=4) as cache:
        assert dict(cache.items()) == {"only-in-the-log": 1}


def test_salvage_rebuild_of_a_healthy_store_changes_nothing(tmp_path, capsys):
    """The store check salvage --on-corruption rebuild runs first marks only
    damage: a healthy store opens as it is."""
    d = tmp_path / "c"
    make_store(d, 40)
    assert main(["salvage", "--on-corruption", "rebuild", str(d)]) == 0
    assert capsys.readouterr().out.splitlines()[-1].startswith("result  NOTHING TO SALVAGE")
    assert not [p for p in d.iterdir() if "corrupt" in p.name or "damaged" in p.name]
    with Cache(d) as cache:
        assert len(cache) == 40

@pytest.mark.parametrize("count", ["data_bytes", "key_count"])
def test_a_wrong_count_alone_is_no_reason_to_rebuild(tmp_path, capsys, count):
    """meta's key_count and data_bytes are counts: check reports a wrong one,
    but neither advises nor does a rebuild, which would drop every entry."""
    d = tmp_path / "c"
    make_store(d, 40)
    with sqlite3.connect(d / STORE) as conn:
        conn.execute("UPDATE meta SET value = value + 1 WHERE name = ?", (count,))
    conn.close()
    assert main(["check", str(d)]) == 1
    out = capsys.readouterr().out
    assert f"meta {count}=" in out and "not damage to any entry" in out, out
    assert "\nnext " not in out, out
    assert main(["salvage", "--on-corruption", "rebuild", str(d)]) == 0
    out = capsys.readouterr().out
    assert "REBUILT" not in out and "marked damaged" not in out, out
    assert not [p for p in d.iterdir() if "corrupt" in p.name or "damaged" in p.name]
    with Cache(d, page_size=4) as cache:
        assert sorted(cache) == sorted(f"k{i}" for i in range(40))


def test_check_refuses_an_open_cache_and_reports_the_log(tmp_path, capsys):
    d = tmp_path / "c"
    cache = Cache(d, flush_interval=3600, flush_batch_pages=10**6)
    cache["a"] = 1
    assert main(["check", str(d)]) == 2  # could not check: not damage
    out = capsys.readouterr().out
    assert f"open in this process ({os.getpid()}), by a Cache that was not closed" in out
    assert "NOT CHECKED" in out and "DAMAGE" not in out
    cache._teardown(clean=False)
    assert main(["check", str(d)]) == 0
    out = capsys.readouterr().out
    assert "applied again at the next open" in out


def test_check_changes_nothing_in_a_closed_cache(tmp_path, capsys):
    """check reads: after a clean close it writes, creates and deletes no file
    (a read-only SQLite connection would leave -wal and -shm files behind)."""
    d = tmp_path / "c"
    make_store(d)
    before = {p.name: p.read_bytes() for p in d.iterdir()}
    assert main(["check", str(d)]) == 0
    assert "healthy" in capsys.readouterr().out
    assert {p.name: p.read_bytes() for p in d.iterdir()} == before


def test_check_reads_what_a_crash_left_in_the_wal_and_changes_no_data(tmp_path, capsys):
    """After a SIGKILL the last flush may live only in pages.sqlite3-wal: check
    must read it there. It changes no data file; only SQLite's shared-memory
    index (-shm), which every reader rebuilds, may be rewritten."""
    d = tmp_path / "c"
    writer = textwrap.dedent("""
        import os, signal, sys
        from durablekv import Cache
        c = Cache(sys.argv[1], flush_interval=3600, flush_batch_pages=10**6)
        for i in range(100):
            c[i] = i
        c.flush()
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    proc = subprocess.run([sys.executable, "-c", writer, str(d)], capture_output=True, text=True,
                          timeout=120, env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert os.path.getsize(d / (STORE + "-wal")) > 0
    data = {p.name: p.read_bytes() for p in d.iterdir() if not p.name.endswith("-shm")}
    assert main(["check", str(d)]) == 0
    out = capsys.readouterr().out
    assert "checkpoint_lsn=100" in out and "100 entries" in out  # only in the WAL
    assert {p.name: p.read_bytes() for p in d.iterdir() if not p.name.endswith("-shm")} == data


def test_no_cache_opens_the_directory_while_check_reads_it(tmp_path, monkeypatch):
    import durablekv.check as check

    d = tmp_path / "c"
    make_store(d, 5)
    refused = []
    real = check._check_store

    def open_meanwhile(directory, r):
        with pytest.raises(CacheLockedError) as exc:
            Cache(directory)
        refused.append(exc.value)
        return real(directory, r)
    monkeypatch.setattr(check, "_check_store", open_meanwhile)
    assert main(["check", str(d)]) == 0
    assert refused
    with Cache(d) as cache:  # and the lock is released afterwards
        assert len(cache) == 5


def damage_the_middle(d: Path) -> None:
    size = os.path.getsize(d / STORE)
    with open(d / STORE, "r+b") as f:
        f.seek(size // 2)
        f.write(random.Random(2).randbytes(8192))


def test_damage_in_the_middle_found_in_use_is_remembered(tmp_path):
    """The O(1) checks at open cannot see it; the first read that meets it raises
    CorruptStoreError, and the next open refuses the store (or rebuilds it)."""
    d = tmp_path / "c"
    make_store(d, 3000)
    damage_the_middle(d)
    errors = 0
    with Cache(d, page_size=4, max_pages=4) as cache:
        for i in range(3000):
            try:
                cache.get(f"k{i}")
            except CorruptStoreError:
                errors += 1
    assert errors > 0
    with pytest.raises(CorruptStoreError) as exc:
        Cache(d)
    assert "while it was in use" in str(exc.value)
    assert main(["check", str(d)]) == 1  # check agrees with the open that refuses
    with Cache(d, on_corruption="rebuild") as cache:
        assert cache.store_rebuilds == 1 and len(cache) == 0
        cache["fresh"] = 1
    with Cache(d) as cache:
        assert dict(cache.items()) == {"fresh": 1}


def test_rebuild_mode_checks_the_whole_file_at_open(tmp_path):
    d = tmp_path / "c"
    make_store(d, 3000)
    damage_the_middle(d)
    with Cache(d, on_corruption="rebuild") as cache:  # quick_check finds it at once
        assert cache.store_rebuilds == 1 and len(cache) == 0


def test_check_on_a_read_only_file_system_is_not_checked(tmp_path, capsys, monkeypatch):
    """A WAL store on a read-only mount cannot be opened even read-only (no
    -shm file can be made): check says so, exit 2, and calls nothing damaged."""
    d = tmp_path / "c"
    make_store(d, 5)
    import durablekv.check as check

    def no_shm(*args, **kwargs):
        raise sqlite3.OperationalError("unable to open database file")
    monkeypatch.setattr(check.sqlite3, "connect", no_shm)
    monkeypatch.setattr(check.os, "access", lambda path, mode: False)
    assert main(["check", str(d)]) == 2
    out = capsys.readouterr().out
    assert "check a copy" in out and "NOT CHECKED" in out and "DAMAGE" not in out


def test_a_store_sqlite_cannot_open_says_the_likely_causes_and_the_fix(tmp_path):
    """SQLite's bare "unable to open database file" (an unwritable or
    immutable directory, a full disk...) came with no way forward. Here the
    store's name is a symlink pointing nowhere: the directory itself is fine
    (LOCK is made), but SQLite cannot create the file."""
    from durablekv import StoreError

    d = tmp_path / "c"
    d.mkdir()
    os.symlink(tmp_path / "gone" / "pages.sqlite3", d / STORE)
    with pytest.raises(StoreError) as info:
        Cache(d)
    msg = str(info.value)
    assert "unable to open database file" in msg, msg
    for words in ("permissions", "read-only or immutable", "disk", "Fix that"):
        assert words in msg, (words, msg)
    os.unlink(d / STORE)
    with Cache(d) as cache:  # the directory was left usable
        cache["k"] = 1
