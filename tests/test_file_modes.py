"""What a cache creates is private to its owner: the directory 0700, its
files 0600 (docs/files.md); a directory that already exists keeps its mode."""

from __future__ import annotations

import os
import stat

import pytest

from .conftest import opened


@pytest.fixture
def umask_022():
    old = os.umask(0o022)  # the common default, which left everything world-readable
    yield
    os.umask(old)


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_a_new_cache_directory_and_every_file_in_it_are_private(tmp_path, umask_022):
    d = tmp_path / "cache"
    with opened(d, segment_bytes=4096) as c:
        for i in range(200):
            c[i] = "x" * 100  # rolls over log segments
        c.flush()
        names = sorted(os.listdir(d))
        assert "LOCK" in names and "pages.sqlite3" in names
        assert "pages.sqlite3-wal" in names and "pages.sqlite3-shm" in names
        assert any(n.startswith("replay-") for n in names), names
        assert mode(d) == 0o700
        assert {n: mode(d / n) for n in names} == {n: 0o600 for n in names}


def test_a_rebuilt_store_and_its_damage_marker_are_private(tmp_path, umask_022):
    d = tmp_path / "cache"
    with opened(d) as c:
        c["a"] = 1
    (d / "pages.sqlite3").write_bytes(b"not a database" * 100)
    os.chmod(d / "pages.sqlite3", 0o600)
    with opened(d, on_corruption="rebuild") as c:
        c["b"] = 2
        c.flush()
        names = sorted(os.listdir(d))
        assert any(".corrupt-" in n for n in names), names
        assert {n: mode(d / n) for n in names} == {n: 0o600 for n in names}


def test_an_existing_directory_keeps_the_mode_its_owner_gave_it(tmp_path, umask_022):
    d = tmp_path / "shared"
    d.mkdir()
    os.chmod(d, 0o750)
    with opened(d) as c:
        c["a"] = 1
        c.flush()
    assert mode(d) == 0o750
    assert mode(d / "pages.sqlite3") == 0o600  # files it creates are still private


def test_a_file_the_owner_loosened_stays_loosened(tmp_path, umask_022):
    d = tmp_path / "cache"
    with opened(d) as c:
        c["a"] = 1
        c.flush()
    os.chmod(d / "pages.sqlite3", 0o640)
    with opened(d) as c:
        assert c["a"] == 1
    assert mode(d / "pages.sqlite3") == 0o640
