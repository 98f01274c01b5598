"""Damaged, tampered-with and hostile files: what is on disk is checked
before it is trusted, and damage is a ``durablekv.errors`` exception (or
``durablekv check`` output), never a wrong value or a raw exception."""

from __future__ import annotations

import contextlib
import random
import shutil
import sqlite3

import pytest

from durablekv import CacheLockedError, Cache, ConfigError, CorruptStoreError
from durablekv.check import check_directory
from durablekv.cli import main

from .conftest import owner_process

STORE = "pages.sqlite3"
NEVER = dict(flush_interval=3600, flush_batch_pages=1_000_000, max_pending_pages=1_000_000)


def _edit_store(d, sql: str, args: tuple = ()) -> None:
    """Run one statement on the closed cache's pages.sqlite3 (a hand edit)."""
    conn = sqlite3.connect(d / STORE)
    try:
        conn.execute(sql, args)
        conn.commit()
    finally:
        conn.close()


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
    # what migration 0004 (size_limit) added goes first: a schema-2 store had none of it
    conn.execute("DROP INDEX pages_by_last_use")
    conn.execute("ALTER TABLE pages DROP COLUMN last_use")
    conn.execute("DELETE FROM meta WHERE name = 'data_bytes'")
    conn.execute("ALTER TABLE pages DROP COLUMN crc")
    conn.execute("PRAGMA user_version = 2")
    conn.commit()
    conn.close()
    assert check_directory(str(d)).ok
    with Cache(d) as cache:
        assert {k: cache[k] for k in values} == values
    conn = sqlite3.connect(d / STORE)
    assert conn.execute("PRAGMA user_version").fetchone()[0] == 4
    assert conn.execute("SELECT COUNT(*) FROM pages WHERE crc < 0").fetchone()[0] == 0
    conn.close()
    assert check_directory(str(d)).ok
    pid = _flip_bit(d / STORE, random.Random(3))
    with Cache(d) as cache:
        with pytest.raises(CorruptStoreError, match=f"page {pid} fails its checksum"):
            for k in values:
                cache.get(k)


def _segments(d):
    return sorted(p for p in d.iterdir() if p.name.startswith("replay-") and p.suffix == ".log")


def test_a_64_mib_zero_filled_log_tail_is_cut_in_bounded_work(tmp_path, caplog):
    """A power loss can leave a zero-filled tail; a huge one is skipped in
    blocks (a few candidate offsets, not one Python step per byte), cut off,
    and the open says how many bytes it cut."""
    from durablekv.log import segments as logsegments
    d = tmp_path / "c"
    cache = Cache(d, durability="fsync", **NEVER)
    for i in range(100):
        cache[f"k{i}"] = i
    cache._teardown(clean=False)  # as if killed: the records are only in the log
    (seg,) = _segments(d)
    with open(seg, "ab") as f:
        f.truncate(seg.stat().st_size + (64 << 20))
    assert check_directory(str(d)).lines[-1].endswith("healthy")  # a torn tail is no damage
    before = logsegments.resync_probes
    with Cache(d) as cache:
        assert [cache[f"k{i}"] for i in range(100)] == list(range(100))
    assert logsegments.resync_probes - before < 100  # (one per byte: 67 million)
    assert any("cut a torn tail of 67108864 bytes" in r.getMessage() for r in caplog.records)


def test_a_resync_search_through_garbage_gives_up_and_says_so(tmp_path, monkeypatch):
    """Garbage (not zeros) behind a damaged record: the search for the next
    intact record stops after RESYNC_LIMIT offsets, and the damage is
    refused (intact records may lie behind it), naming what was not searched."""
    from durablekv import LogCorruptionError
    from durablekv.log import segments as logsegments
    monkeypatch.setattr(logsegments, "RESYNC_LIMIT", 10_000)
    d2 = tmp_path / "d"
    cache = Cache(d2, durability="fsync", **NEVER)
    cache["a"] = 1
    cache._teardown(clean=False)
    (seg,) = _segments(d2)
    with open(seg, "ab") as f:
        f.write(b"\x01" + random.Random(1).randbytes(50_000))
    res = check_directory(str(d2))
    assert not res.ok and any("were not searched" in line for line in res.lines), res.lines
    with pytest.raises(LogCorruptionError, match="were not searched"):
        Cache(d2)


def test_deleting_lock_under_a_live_owner_admits_no_second_owner(tmp_path):
    """LOCK only names the owner's pid: the ownership lock is a flock on the
    directory itself, which deleting (or replacing) LOCK cannot take away."""
    d = tmp_path / "c"
    owner = owner_process(d)
    try:
        (d / "LOCK").unlink()
        with pytest.raises(CacheLockedError, match="already open in another process"):
            Cache(d)
        (d / "LOCK").write_text("12345\n")   # a hand-made pidfile is no lock either
        with pytest.raises(CacheLockedError, match="process 12345"):
            Cache(d)
        res = check_directory(str(d))
        assert not res.ok and "is open in process 12345" in res.lines[0]
    finally:
        owner.stdin.write("\n")
        owner.stdin.close()
        assert owner.wait(30) == 0
    with Cache(d) as cache:   # free once the owner closed
        assert cache["x"] == 1


def _deep(levels: int, tag: bytes = b"t") -> bytes:
    """The safe codec's encoding of ``levels`` one-item containers around None."""
    return (tag + b"\x01\x00\x00\x00") * levels + b"N"


def test_set_refuses_keys_and_values_nested_past_max_nesting(tmp_path):
    from durablekv.codec import MAX_NESTING

    def nest(levels, kind=tuple):
        obj = None
        for _ in range(levels):
            obj = kind([obj])
        return obj
    with Cache(tmp_path / "c") as cache:
        cache[nest(MAX_NESTING)] = nest(MAX_NESTING, list)   # at the limit: fine
        assert cache[nest(MAX_NESTING)] == nest(MAX_NESTING, list)
        for key, value in [(nest(MAX_NESTING + 1), 1), (nest(5000), 1), ("v", nest(5000)),
                           ("l", nest(5000, list)), ("t", nest(MAX_NESTING + 1))]:
            with pytest.raises(TypeError, match=f"MAX_NESTING={MAX_NESTING}"):
                cache[key] = value
        assert len(cache) == 1
        # the reads and deletes of such a key say the same, not RecursionError
        for call in (cache.get, cache.__contains__, cache.delete, cache.pop):
            with pytest.raises(TypeError, match=f"MAX_NESTING={MAX_NESTING}"):
                call(nest(5000))


@pytest.mark.parametrize("where", ["key", "value"])
def test_a_deeply_nested_log_record_is_damage_not_a_recursion_error(tmp_path, where):
    """A record nested far past MAX_NESTING (hand-made: set() refuses it) with
    a good CRC: open, check and salvage report it as damage, never with a
    RecursionError."""
    from durablekv import DurableKVError
    from durablekv.cli import main
    from durablekv.log.segments import OP_SET, encode_record
    d = tmp_path / "c"
    cache = Cache(d, durability="fsync", **NEVER)
    cache["a"] = 1
    cache._teardown(clean=False)
    (seg,) = _segments(d)
    deep = _deep(5000)
    key, value = (deep, b"N") if where == "key" else (b"s\x01\x00\x00\x00k", deep)
    with open(seg, "ab") as f:
        f.write(encode_record(2, OP_SET, key, value, None))
    with pytest.raises(DurableKVError, match="MAX_NESTING"):
        Cache(d)
    res = check_directory(str(d))
    assert res.damaged and any("MAX_NESTING" in line for line in res.lines), res.lines
    assert main(["salvage", str(d)]) in (0, 1)


@pytest.mark.parametrize("name, value", [
    ("page_size", 100_000_000), ("page_size", 0), ("page_size", "16"), ("serializer", 7),
    ("key_count", 10_000_000_000), ("key_count", -1), ("ttl_key_count", 10 ** 6),
    ("checkpoint_lsn", "abc"), ("checkpoint_lsn", -5), ("checkpoint_lsn", 1 << 62),
    ("checkpoint_lsn", 2.5), ("ttl_clock_offset", float("nan")),
])
def test_a_meta_value_out_of_bounds_is_corrupt_store_error_naming_it(tmp_path, name, value):
    """Every value read from meta is checked against the constructor's
    bounds: a CorruptStoreError naming the field (never a raw ValueError,
    OverflowError, MemoryError or a 26 s open), and check reports it."""
    d = tmp_path / "c"
    _filled(d, 20)
    _edit_store(d, "INSERT OR REPLACE INTO meta (name, value) VALUES (?, ?)", (name, value))
    with pytest.raises(CorruptStoreError, match=f"meta {name}="):
        Cache(d)
    res = check_directory(str(d))
    assert res.damaged and any(f"meta {name}=" in line for line in res.lines), res.lines


@pytest.mark.parametrize("name", ["page_size", "checkpoint_lsn", "key_count"])
def test_a_deleted_meta_row_is_reported_by_open_and_check_alike(tmp_path, name):
    """A meta row deleted by hand: the open refuses the store naming the row
    (never a UNIQUE constraint error from re-creating it), and check reports
    the same words as DAMAGE (never a KeyError traceback)."""
    d = tmp_path / "c"
    _filled(d, 20)
    _edit_store(d, "DELETE FROM meta WHERE name = ?", (name,))
    with pytest.raises(CorruptStoreError, match=f"meta {name}") as info:
        Cache(d)
    words = str(info.value).split("(", 1)[1][:40]  # the problem, as the open names it
    res = check_directory(str(d))
    assert res.damaged and any(words in line for line in res.lines), (words, res.lines)
    assert main(["check", str(d)]) == 1


def test_a_serializer_changed_in_meta_is_damage_to_check(tmp_path):
    """meta serializer changed from 'safe' to 'pickle': the open refuses it as
    it refuses any other serializer (naming the one to pass), and check finds
    that the values are not pickles, without loading any."""
    d = tmp_path / "c"
    _filled(d, 20)
    _edit_store(d, "UPDATE meta SET value = 'pickle' WHERE name = 'serializer'")
    with pytest.raises(ConfigError, match="open it with serializer='pickle'"):
        Cache(d)
    res = check_directory(str(d))
    text = "\n".join(res.lines)
    assert res.damaged and "40 values are not a pickle" in text, text  # 20 str + 20 int keys
    assert "open it with serializer='pickle'" in text
    # a store really written with pickle checks healthy, with the same note
    with Cache(tmp_path / "p", serializer="pickle") as c:
        c["a"] = {1, 2}
    res = check_directory(str(tmp_path / "p"))
    assert res.ok and any("open it with serializer='pickle'" in line for line in res.lines)


def test_page_ids_out_of_range_are_corrupt_store_error(tmp_path):
    d = tmp_path / "c"
    _filled(d, 20)
    _edit_store(d, "UPDATE pages SET page_id = -3 WHERE page_id = (SELECT MIN(page_id) FROM pages)")
    with pytest.raises(CorruptStoreError, match="page ids run from -3"):
        Cache(d)
    assert any("page ids run from -3" in line for line in check_directory(str(d)).lines)


def test_deleting_the_store_while_open_keeps_the_log_and_fails_loudly(tmp_path):
    """pages.sqlite3 deleted under an open cache: flush and close fail with
    durablekv errors and the replay log is kept, so the next open gets every
    acknowledged write back from it (before, close deleted the log and the
    next open started empty)."""
    from durablekv import DurableKVError
    d = tmp_path / "c"
    cache = Cache(d, **NEVER)
    for i in range(50):
        cache[f"k{i}"] = i
    cache.flush()
    (d / STORE).unlink()
    for i in range(50, 60):
        cache[f"k{i}"] = i
    with pytest.raises(DurableKVError, match="was deleted while the cache was open"):
        cache.flush()
    with pytest.raises(DurableKVError, match="was deleted while the cache was open"):
        cache.close()
    assert _segments(d)   # the log was not deleted
    with Cache(d) as cache:
        assert {k: cache[k] for k in cache} == {f"k{i}": i for i in range(60)}


def test_a_log_cut_back_behind_a_deleted_store_is_refused_not_started_empty(tmp_path):
    """Segments a checkpoint in the deleted store covered were deleted: the
    next open meets a new empty store and a log starting past LSN 1, and
    refuses the gap (check reports it) instead of starting empty."""
    from durablekv import DurableKVError, LogCorruptionError
    from durablekv.config import MIN_SEGMENT_BYTES
    d = tmp_path / "c"
    cache = Cache(d, segment_bytes=MIN_SEGMENT_BYTES, **NEVER)
    for i in range(400):
        cache[f"k{i}"] = b"x" * 100
    cache.flush()
    assert len(_segments(d)) == 1  # the rolled segments were checkpointed and deleted
    (d / STORE).unlink()
    cache["late"] = 1
    with pytest.raises(DurableKVError, match="was deleted while the cache was open"):
        cache.close()
    res = check_directory(str(d))
    assert res.damaged and any("never stored" in line for line in res.lines), res.lines
    with pytest.raises(LogCorruptionError, match="never stored"):
        Cache(d)


@pytest.mark.parametrize("durability", ["log", "fsync"])
def test_deleting_the_active_log_segment_while_open_fails_loudly(tmp_path, durability):
    """The active segment deleted under an open cache: the next fsync of the
    log (each set in fsync mode, the write-behind's in log mode) finds it and
    raises, naming the segment; before, the loss was silent and the next
    roll raised a raw FileNotFoundError."""
    from durablekv import DurableKVError
    d = tmp_path / "c"
    cache = Cache(d, durability=durability, **NEVER)
    cache["a"] = 1
    (seg,) = _segments(d)
    seg.unlink()
    with pytest.raises(DurableKVError, match="replay-0+1.log' was deleted while the cache"):
        cache["b"] = 2    # fsync mode: this set's fsync finds it
        cache.flush()     # log mode: the write-behind's fsync, then flush() says so
    with contextlib.suppress(DurableKVError):
        cache.close()
    with Cache(d) as cache:  # the commits stored what memory held
        assert cache["a"] == 1


def test_the_sqlite_wal_is_cut_back_while_the_cache_runs(tmp_path, monkeypatch):
    """Many flushes of a store several times the WAL limit: the -wal file
    stays near the limit while open instead of growing with the load."""
    from durablekv.stores.sqlite import SQLitePageStore
    limit = 256 << 10
    monkeypatch.setattr(SQLitePageStore, "wal_size_limit", limit)
    d = tmp_path / "c"
    largest = 0
    with Cache(d, page_size=16, max_pages=64, **NEVER) as cache:
        for round_ in range(30):
            for i in range(400):
                cache[f"k{i % 200}"] = bytes([round_]) * 500   # rewritten pages
                cache[f"r{round_}-{i}"] = b"x" * 500         # and a growing store
            cache.flush()
            largest = max(largest, (d / (STORE + "-wal")).stat().st_size)
        store_size = (d / STORE).stat().st_size
    assert store_size > 8 * limit
    # one flush's transaction (about 800 * 500 bytes of pages) may pass the limit
    assert largest < limit + (1 << 20), (largest, store_size)


def test_a_segment_the_directory_refuses_is_log_write_error_not_permission_error(
        tmp_path, monkeypatch):
    """A read-only or immutable directory (here: creating a segment is
    refused, as chattr +i does even for root): the set that rolls to a new
    segment raises LogWriteError, and an open says no write was attempted."""
    import errno
    import os as _os
    from durablekv import LogWriteError
    from durablekv.config import MIN_SEGMENT_BYTES
    d = tmp_path / "c"
    cache = Cache(d, segment_bytes=MIN_SEGMENT_BYTES, **NEVER)
    real_open = _os.open

    def refuse(path, flags, *args, **kwargs):
        if "replay-" in str(path) and flags & _os.O_CREAT:
            raise PermissionError(errno.EPERM, "Operation not permitted", str(path))
        return real_open(path, flags, *args, **kwargs)
    monkeypatch.setattr(_os, "open", refuse)
    with pytest.raises(LogWriteError, match="the write was NOT stored"):
        for i in range(100):
            cache[f"k{i}"] = b"x" * 100
    monkeypatch.setattr(_os, "open", real_open)
    cache.close()

    def full(self, fd, data):
        raise OSError(errno.ENOSPC, "No space left on device")
    from durablekv.log.replaylog import ReplayLog
    monkeypatch.setattr(ReplayLog, "_write", full)
    with pytest.raises(LogWriteError) as exc:
        Cache(d)
    assert "no write was attempted" in str(exc.value) and "NOT stored" not in str(exc.value)


def test_the_over_limit_message_does_not_advise_raising_a_limit_at_its_maximum(tmp_path):
    from durablekv.config import MAX_VALUE_BYTES_LIMIT
    with Cache(tmp_path / "a", max_value_bytes=10) as cache:
        with pytest.raises(ValueError, match="raise max_value_bytes"):
            cache["k"] = b"x" * 11
    with Cache(tmp_path / "b", max_value_bytes=MAX_VALUE_BYTES_LIMIT) as cache:
        with pytest.raises(ValueError) as exc:
            raise cache._value_too_big("k", MAX_VALUE_BYTES_LIMIT + 1)
        assert "raise max_value_bytes" not in str(exc.value)
        assert "at its largest" in str(exc.value)


def _one_page_resealed(d, value, tamper) -> None:
    """A cache at ``d`` holding ``"k": value`` in one page, then ``tamper(conn)``
    on its store and the page's checksum made to match (hand-made damage)."""
    from .conftest import reseal_pages
    with Cache(d, page_size=4) as cache:
        cache["k"] = value
    conn = sqlite3.connect(d / STORE)
    tamper(conn)
    reseal_pages(conn)
    conn.commit()
    conn.close()


def test_a_stored_list_with_a_bad_count_is_corrupt_store_error(tmp_path):
    """Hand-made (checksum made to match): a list value whose count is more
    than its bytes can hold is damage found at the page fault, before
    anything is allocated, never a bare ValueError at a later get."""
    d = tmp_path / "c"

    def bad_count(conn):
        (data,) = conn.execute("SELECT data FROM pages").fetchone()
        at = data.index(b"l\x03\x00\x00\x00")
        conn.execute("UPDATE pages SET data = ?",
                     (data[:at] + b"l\xff\xff\xff\x7f" + data[at + 5:],))
    _one_page_resealed(d, [1, 2, 3], bad_count)
    with Cache(d) as cache:
        with pytest.raises(CorruptStoreError, match="more than the"):
            cache.get("k")


def test_a_200_mb_zero_blob_fails_fast(tmp_path):
    """A page row of 200 MB of zeros (with a checksum made to match) is
    refused from its entry count before the blob is walked."""
    d = tmp_path / "c"
    _one_page_resealed(d, 1, lambda conn: conn.execute(
        "UPDATE pages SET data = zeroblob(200000000), n_entries = 11111111"))
    with Cache(d) as cache:
        with pytest.raises(CorruptStoreError, match="11111111 entries"):
            cache.get("k")


def _warm_dir(d):
    """A closed cache of 200 keys whose residency list names 8 pages."""
    with Cache(d, page_size=4, max_pages=8, flush_interval=30.0) as cache:
        for i in range(200):
            cache[f"k{i}"] = b"v%d" % i
        for i in range(0, 200, 9):
            cache.get(f"k{i}")
    return (d / "resident.list").read_bytes()


def _damage_list(d, how, good):
    import os
    path = d / "resident.list"
    path.unlink()
    if how == "truncated":
        path.write_bytes(good[:-5])
    elif how == "header only":
        path.write_bytes(good[:10])
    elif how == "empty":
        path.write_bytes(b"")
    elif how == "flipped":
        bad = bytearray(good)
        bad[30] ^= 0x10
        path.write_bytes(bytes(bad))
    elif how == "foreign page_size":
        import struct, zlib
        body = good[24:]
        path.write_bytes(struct.pack("<8sIIII", b"DKVRES01", 1, 16, len(body) // 8,
                                     zlib.crc32(body)) + body)
    elif how == "count lies":
        import struct
        path.write_bytes(good[:16] + struct.pack("<I", 1 << 19) + good[20:])
    elif how == "ids out of range":
        import struct, zlib
        body = struct.pack("<2Q", 0, 1 << 63)
        path.write_bytes(struct.pack("<8sIIII", b"DKVRES01", 1, 4, 2, zlib.crc32(body)) + body)
    elif how == "garbage":
        path.write_bytes(random.Random(4).randbytes(4000))
    elif how == "huge":
        with open(path, "wb") as f:
            f.truncate(64 << 20)  # sparse: must be refused by its size, not read
    elif how == "directory":
        path.mkdir()
    elif how == "fifo":
        os.mkfifo(path)
    elif how == "symlink":
        target = d / "elsewhere"
        target.write_bytes(good)
        path.symlink_to(target)


@pytest.mark.parametrize("how", ["truncated", "header only", "empty", "flipped",
                                 "foreign page_size", "count lies", "ids out of range",
                                 "garbage", "huge", "directory", "fifo", "symlink"])
def test_a_damaged_residency_list_is_a_cold_start_said_and_counted(tmp_path, how, caplog):
    """The warm restart's list is a hint: damaged, truncated or foreign, it
    never fails open nor changes a value; it is ignored with a warning and
    counted in stats().residency_errors, and a clean close replaces it."""
    d = tmp_path / "c"
    good = _warm_dir(d)
    _damage_list(d, how, good)
    with caplog.at_level("WARNING", logger="durablekv"):
        with Cache(d, max_pages=8, flush_interval=30.0) as cache:
            assert cache.wait_warm(30)
            s = cache.stats()
            assert (s.warmed_pages, s.residency_errors) == (0, 1)
            assert all(cache[f"k{i}"] == b"v%d" % i for i in range(200))
    assert any("residency list" in r.getMessage() and "ignored" in r.getMessage()
               for r in caplog.records)
    if how != "directory":  # a directory is not replaced by a file (the save is refused)
        with Cache(d, max_pages=8, flush_interval=30.0) as cache:
            assert cache.wait_warm(30)
            assert cache.stats().warmed_pages == 8 and cache.stats().residency_errors == 0
