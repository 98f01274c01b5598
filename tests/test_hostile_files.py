"""Damaged, tampered-with and hostile files: what is on disk is checked
before it is trusted, and damage is a ``durablekv.errors`` exception (or
``durablekv check`` output), never a wrong value or a raw exception."""

from __future__ import annotations

import random
import shutil
import sqlite3

import pytest

from durablekv import Cache, CorruptStoreError
from durablekv.check import check_directory

STORE = "pages.sqlite3"


def _filled(d, n=200):
    values = {f"k{i}": (b"v%d-" % i) * (1 + i % 7) for i in range(n)}
    values.update({i: [i, str(i), {"x": i}] for i in range(n)})
    with Cache(d, page_size=8, max_pages=4) as cache:
        for k, v in values.items():
            cache[k] = v
    return values


def _flip_bit(path, rng) -> int:
    """Flip one random bit at a random offset of one random stored page blob
    (the checksum is left as it was); returns the page id."""
    conn = sqlite3.connect(path)
    try:
        pids = [r[0] for r in conn.execute("SELECT page_id FROM pages")]
        pid = rng.choice(pids)
        data = bytearray(conn.execute("SELECT data FROM pages WHERE page_id = ?",
                                      (pid,)).fetchone()[0])
        data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        conn.execute("UPDATE pages SET data = ? WHERE page_id = ?", (bytes(data), pid))
        conn.commit()
    finally:
        conn.close()
    return pid


def test_flipped_bits_in_stored_pages_never_give_a_wrong_value(tmp_path):
    """A single flipped bit anywhere in a stored page blob: every read of a
    key is its stored value or CorruptStoreError (zero wrong values, zero
    other exceptions), and `durablekv check` reports the page."""
    clean = tmp_path / "clean"
    values = _filled(clean)
    rng = random.Random(16)
    detected = 0
    for trial in range(40):
        d = tmp_path / f"t{trial}"
        shutil.copytree(clean, d)
        pid = _flip_bit(d / STORE, rng)
        res = check_directory(str(d))
        assert not res.ok and any(f"page {pid}: fails its checksum" in line
                                  for line in res.lines), res.lines
        wrong = []
        with Cache(d, max_pages=4) as cache:
            for k, v in values.items():
                try:
                    got = cache.get(k)
                except CorruptStoreError as exc:
                    assert f"page {pid} fails its checksum" in str(exc)
                    detected += 1
                    break  # the store is marked damaged now
                if got != v:
                    wrong.append((k, got))
        assert wrong == [], trial
    assert detected == 40


def test_a_store_from_before_page_checksums_gets_them_when_opened(tmp_path):
    """Migration 0003: a schema-2 store (no checksums) opens, every page is
    given its checksum, and a flipped bit afterwards is found."""
    d = tmp_path / "c"
    values = _filled(d, 50)
    conn = sqlite3.connect(d / STORE)
    conn.execute("ALTER TABLE pages DROP COLUMN crc")
    conn.execute("PRAGMA user_version = 2")
    conn.commit()
    conn.close()
    assert check_directory(str(d)).ok
    with Cache(d) as cache:
        assert {k: cache[k] for k in values} == values
    conn = sqlite3.connect(d / STORE)
    assert conn.execute("PRAGMA user_version").fetchone()[0] == 3
    assert conn.execute("SELECT COUNT(*) FROM pages WHERE crc < 0").fetchone()[0] == 0
    conn.close()
    assert check_directory(str(d)).ok
    pid = _flip_bit(d / STORE, random.Random(3))
    with Cache(d) as cache:
        with pytest.raises(CorruptStoreError, match=f"page {pid} fails its checksum"):
            for k in values:
                cache.get(k)
