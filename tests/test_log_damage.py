"""Replay log damage: torn tails are cut, corruption before the tail is an error.

A "crash" here stops the cache without a flush or a clean close
(``_teardown(clean=False)``): the batcher is stopped, the log is left as it
is. The real-process kills are in test_crash.py.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

import pytest

from durablekv import Cache, CorruptStoreError, LogCorruptionError
from durablekv.check import check_directory
from durablekv.cli import main
from durablekv.log.segments import HEADER, MAGIC, list_segments, read_segment
from .conftest import simulate_restart

NEVER = dict(flush_interval=3600, flush_batch_pages=1_000_000, max_pending_pages=1_000_000)


def crash(cache: Cache) -> None:
    """Stop ``cache`` as a killed process would leave it (no flush, log kept)."""
    cache._teardown(clean=False)


def write_abc(directory: Path) -> tuple[str, list[int]]:
    """Set a, b, c; crash before any flush. Return the segment and record offsets."""
    cache = Cache(directory, **NEVER)
    for k in "abc":
        cache[k] = k.upper() * 10
    crash(cache)
    (seg,) = list_segments(str(directory))
    data = Path(seg).read_bytes()
    offsets, pos = [], len(MAGIC)
    while pos < len(data):
        offsets.append(pos)
        pos += HEADER.size + HEADER.unpack_from(data, pos)[0]
    assert len(offsets) == 3
    return seg, offsets


def contents(directory: Path, **kw) -> dict:
    with Cache(directory, **kw) as cache:
        return dict(cache.items())


def test_nothing_flushed_everything_recovered(tmp_path):
    write_abc(tmp_path / "c")
    with Cache(tmp_path / "c") as cache:
        assert dict(cache.items()) == {"a": "A" * 10, "b": "B" * 10, "c": "C" * 10}
        assert cache.stats().recovered_records == 3


def test_br022_cut_at_every_offset_of_the_last_record(tmp_path):
    """br022 step 2, for every byte: a, b stay; c goes; startup succeeds; later writes survive."""
    master = tmp_path / "master"
    seg, offsets = write_abc(master)
    size = os.path.getsize(seg)
    for cut in range(offsets[2], size):
        d = tmp_path / f"cut{cut}"
        shutil.copytree(master, d)
        with open(d / os.path.basename(seg), "r+b") as f:
            f.truncate(cut)
        with Cache(d) as cache:
            assert dict(cache.items()) == {"a": "A" * 10, "b": "B" * 10}, cut
            assert cache.stats().torn_records == (1 if cut > offsets[2] else 0)
            cache["d"] = "D"
        assert contents(d) == {"a": "A" * 10, "b": "B" * 10, "d": "D"}
        shutil.rmtree(d)


def test_br022_zero_filled_tail_is_a_torn_tail(tmp_path):
    """br022 step 4: 4096 zero bytes after the last good record."""
    seg, _ = write_abc(tmp_path / "c")
    with open(seg, "ab") as f:
        f.write(b"\0" * 4096)
    with Cache(tmp_path / "c") as cache:
        assert dict(cache.items()) == {"a": "A" * 10, "b": "B" * 10, "c": "C" * 10}
        assert cache.stats().torn_records == 1
        assert cache.stats().salvaged_bytes == 0  # a torn tail is cut, not salvaged


def test_garbage_over_the_last_record_is_a_torn_tail(tmp_path, capsys):
    seg, offsets = write_abc(tmp_path / "c")
    data = bytearray(Path(seg).read_bytes())
    for i in range(offsets[2] + 20, len(data)):
        data[i] ^= 0x5A
    Path(seg).write_bytes(bytes(data))
    # check says so, and that a whole record failing its CRC may have been acknowledged
    rc, lines = check_out(tmp_path / "c", capsys)
    assert rc == 0, lines
    (torn,) = [line for line in lines if "torn tail" in line]
    assert torn.startswith(f"note    {seg}: torn tail at offset {offsets[2]} (CRC mismatch")
    assert torn.endswith("if neither happened since it was written, the open drops a write "
                         "that was acknowledged"), torn
    assert contents(tmp_path / "c") == {"a": "A" * 10, "b": "B" * 10}


def test_a_record_cut_short_is_a_torn_tail_with_no_word_of_acknowledgement(tmp_path, capsys):
    seg, offsets = write_abc(tmp_path / "c")
    with open(seg, "r+b") as f:
        f.truncate(offsets[2] + 20)
    rc, lines = check_out(tmp_path / "c", capsys)
    (torn,) = [line for line in lines if "torn tail" in line]
    assert rc == 0 and "cut short" in torn and "acknowledged" not in torn, lines



def torn_in_a_mapped_segment(directory: Path, written: int) -> tuple[str, int, int, int]:
    """Set a, b, c, crash; then leave the segment as a SIGKILL during the
    store of c into a mapped segment does: only the first ``written`` bytes of
    c's record stored, zeros after them to the end of a preallocated file (a
    multiple of 4096 bytes, with room to spare). Returns the segment, c's
    offset, its record's length and the file size."""
    seg, offsets = write_abc(directory)
    data = Path(seg).read_bytes()
    record = data[offsets[2]:]
    assert written < len(record)
    size = (len(data) // 4096 + 3) * 4096
    shaped = data[:offsets[2]] + record[:written]
    Path(seg).write_bytes(shaped + bytes(size - len(shaped)))
    return seg, offsets[2], len(record), size


@pytest.mark.parametrize("written", [6, 20, 40])
def test_a_torn_record_and_the_unused_end_after_it_are_reported_apart(tmp_path, caplog, capsys,
                                                                      written):
    """A process killed while it stored a record into a mapped segment leaves
    the record torn and the preallocated rest of the file zero-filled. The
    open cut both, but said "a torn tail of <both> bytes", which read as a big
    loss; it names the record's bytes and the unused bytes apart, and counts
    one torn record, as ever."""
    d = tmp_path / "c"
    seg, offset, record, size = torn_in_a_mapped_segment(d, written)
    unused = size - offset - record
    rc, lines = check_out(d, capsys)
    (torn,) = [line for line in lines if "torn tail" in line]
    lsn = 3 if written >= HEADER.size else 0  # (a header cut short has zeros for its LSN)
    assert rc == 0 and torn.startswith(f"note    {seg}: torn tail at offset {offset} (CRC "
                                       f"mismatch in record LSN {lsn}"), torn
    assert (f"a torn record of {record} bytes, then {unused} bytes of unused preallocated "
            "space (zero-filled)") in torn, torn
    with caplog.at_level(logging.WARNING, logger="durablekv.replaylog"):
        with Cache(d) as cache:
            assert dict(cache.items()) == {"a": "A" * 10, "b": "B" * 10}
            assert cache.stats().torn_records == 1 and cache.stats().salvaged_bytes == 0
    (warning,) = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert warning == (f"replay log {seg}: cut a torn record of {record} bytes at offset "
                       f"{offset} (CRC mismatch in record LSN {lsn}), and the {unused} bytes of "
                       "unused preallocated space after it (zero-filled)"), warning


def test_the_recovery_result_keeps_torn_bytes_whole_and_names_the_unused_part(tmp_path):
    """RecoveryResult.torn_bytes still counts every byte cut with the torn
    record (its meaning is unchanged); torn_unused_bytes says how many of them
    were the unused preallocated end."""
    from durablekv.log.replaylog import ReplayLog
    seg, offset, record, size = torn_in_a_mapped_segment(tmp_path / "c", 20)
    log = ReplayLog(str(tmp_path / "c"), durability="log")
    try:
        result = log.recover(0)
    finally:
        log.close()
    assert [r[0] for r in result.records] == [1, 2]
    assert (result.torn_records, result.torn_bytes, result.torn_unused_bytes) == \
        (1, size - offset, size - offset - record)


def test_split_torn_tail_finds_where_the_torn_record_ends():
    from durablekv.log.segments import encode_record, split_torn_tail
    rec = encode_record(7, 1, b"key", b"value" * 10, None)
    torn = rec[:30] + bytes(len(rec) - 30)            # the rest of the record not stored
    assert split_torn_tail(torn + bytes(8192 - len(rec)), 0) == (len(rec), 8192 - len(rec))
    # garbage past the record's end: torn up to the last nonzero byte
    garbage = torn + b"\x01\x02" + bytes(8192 - len(rec) - 2)
    assert split_torn_tail(garbage, 0) == (len(rec) + 2, 8192 - len(rec) - 2)
    # a length field that names no record (too short, or past the end of the file)
    for head in (b"\x05\x00\x00\x00", b"\xff\xff\xff\x00"):
        bad = head + b"\x09" * 10 + bytes(4096 - 14)
        assert split_torn_tail(bad, 0) == (14, 4096 - 14)
    # not a preallocated file's size: all of it is the torn tail
    assert split_torn_tail(torn + bytes(5000), 0) == (len(torn) + 5000, 0)
    # at an offset inside the file
    assert split_torn_tail(b"x" * 100 + torn + bytes(4096 - 100 - len(rec)), 100) == \
        (len(rec), 4096 - 100 - len(rec))

def test_a_zero_filled_tail_not_from_a_mapped_segment_stays_one_torn_tail(tmp_path, caplog):
    """Zeros after a torn record in a file whose size is no multiple of 4096
    are what a power loss leaves behind write(2) appends: no unused space is
    claimed there (docs/durability.md), the message is as before."""
    seg, offsets = write_abc(tmp_path / "c")
    data = Path(seg).read_bytes()
    torn = data[:offsets[2] + 20] + bytes(len(data) - offsets[2] - 20 + 5000)
    assert len(torn) % 4096
    Path(seg).write_bytes(torn)
    with caplog.at_level(logging.WARNING, logger="durablekv.replaylog"):
        assert contents(tmp_path / "c") == {"a": "A" * 10, "b": "B" * 10}
    assert (f"cut a torn tail of {len(torn) - offsets[2]} bytes at offset {offsets[2]} "
            "(CRC mismatch in record LSN 3)") in caplog.text

@pytest.mark.parametrize("where", ["header", "payload"])
def test_br022_flipped_byte_before_the_tail_is_corruption(tmp_path, where):
    """br022 step 5: the CRC catches a flipped byte in record b; c behind it is
    intact, so this is not a torn tail and the cache refuses to start."""
    seg, offsets = write_abc(tmp_path / "c")
    data = bytearray(Path(seg).read_bytes())
    pos = offsets[1] + (5 if where == "header" else HEADER.size + 15)
    data[pos] ^= 0xFF
    Path(seg).write_bytes(bytes(data))
    with pytest.raises(LogCorruptionError) as exc:
        Cache(tmp_path / "c")
    assert exc.value.path == seg
    assert exc.value.offset == offsets[1]
    assert seg in str(exc.value) and str(offsets[1]) in str(exc.value)
    assert "salvage_log=True" in str(exc.value)
    assert f"`durablekv salvage {tmp_path / 'c'}`" in str(exc.value)
    # the refused open left everything as it was and released the directory
    assert Path(seg).read_bytes() == bytes(data)
    with pytest.raises(LogCorruptionError):
        Cache(tmp_path / "c")


def test_salvage_keeps_the_good_prefix_and_moves_the_file_aside(tmp_path, caplog):
    seg, offsets = write_abc(tmp_path / "c")
    data = bytearray(Path(seg).read_bytes())
    data[offsets[1] + HEADER.size + 15] ^= 0xFF
    Path(seg).write_bytes(bytes(data))
    lost = len(data) - offsets[1]  # records b and c: how many is unknowable, the bytes are not
    with caplog.at_level(logging.WARNING, logger="durablekv"):
        cache = Cache(tmp_path / "c", salvage_log=True)
    with cache:
        assert dict(cache.items()) == {"a": "A" * 10}
        st = cache.stats()
        assert (st.salvaged_bytes, st.torn_records) == (lost, 0)
        cache["e"] = "E"
    (warning,) = [r.getMessage() for r in caplog.records if "salvage" in r.getMessage()
                  and r.levelno >= logging.ERROR]
    assert f"{lost} bytes" in warning and "salvaged_bytes" in warning and seg in warning
    assert Path(seg + ".damaged").read_bytes() == bytes(data)
    assert contents(tmp_path / "c") == {"a": "A" * 10, "e": "E"}
    result = check_directory(str(tmp_path / "c"))
    assert result.ok, result.lines     # the store is healthy ...
    assert any("salvage moved aside" in line for line in result.lines)  # ... and says so


def test_a_missing_segment_is_corruption_and_salvage_sets_the_rest_aside(tmp_path):
    """A segment deleted from the middle of the log leaves an LSN gap. Open
    refuses it (naming the first record after the gap); salvage keeps what
    lies before the gap and moves every segment after it aside, so later
    writes can never meet those LSNs again."""
    d = tmp_path / "c"
    cache = Cache(d, segment_bytes=2048, **NEVER)
    for i in range(300):
        cache[f"k{i}"] = i
    crash(cache)
    segs = list_segments(str(d))
    assert len(segs) > 4
    os.unlink(segs[2])
    kept = read_segment(segs[1])[0][-1].lsn
    with pytest.raises(LogCorruptionError) as exc:
        Cache(d)
    assert exc.value.path == segs[3] and exc.value.offset == len(MAGIC)
    with Cache(d, salvage_log=True, **NEVER) as cache:
        assert dict(cache.items()) == {f"k{i}": i for i in range(kept)}
        cache["after"] = "salvage"
    assert list_segments(str(d)) == []
    assert all(os.path.exists(s + ".damaged") for s in segs[3:])
    assert cache.stats().salvaged_bytes == sum(
        os.path.getsize(s + ".damaged") for s in segs[3:]) - len(MAGIC)
    expected = {f"k{i}": i for i in range(kept)} | {"after": "salvage"}
    assert contents(d) == expected
    cache = Cache(d, segment_bytes=2048, **NEVER)  # new LSNs run past the old ones
    for i in range(300):
        cache[f"n{i}"] = i
    crash(cache)
    assert contents(d) == expected | {f"n{i}": i for i in range(300)}


def test_damaged_magic_loses_no_record(tmp_path):
    """Only the segment header is damaged: every record behind it is intact."""
    seg, _ = write_abc(tmp_path / "c")
    data = bytearray(Path(seg).read_bytes())
    data[0:8] = b"NOTALOG!"
    Path(seg).write_bytes(bytes(data))
    assert contents(tmp_path / "c") == {"a": "A" * 10, "b": "B" * 10, "c": "C" * 10}


def test_a_last_segment_of_nothing_but_garbage_is_a_torn_tail(tmp_path, caplog):
    """As the README says: a power loss can leave garbage in blocks never
    written back, so a last segment with nothing intact, not even its
    header, is cut off as a torn tail (counted, logged, deleted); what the
    store holds is untouched."""
    d = tmp_path / "c"
    cache = Cache(d, segment_bytes=2048, **NEVER)
    for i in range(60):
        cache[f"k{i}"] = i
    cache.flush()   # in the store now
    crash(cache)
    segs = list_segments(str(d))
    last = segs[-1]
    Path(last).write_bytes(bytes((i * 37 + 11) % 251 for i in range(800)))
    simulate_restart(d)  # (on the same boot, a segment of garbage is damage)
    with caplog.at_level(logging.WARNING, logger="durablekv.replaylog"):
        with Cache(d, **NEVER) as cache:
            assert cache.stats().torn_records == 1
            assert dict(cache.items()) == {f"k{i}": i for i in range(60)}
    assert "cut a torn tail of 800 bytes at offset 0" in caplog.text
    assert "bad magic" in caplog.text


def write_checkpointed_then_more(d: Path, segment_bytes: int = 1 << 30) -> tuple[list[str], int]:
    """300 sets flushed (checkpointed), then 20 more that only the log has."""
    cache = Cache(d, segment_bytes=segment_bytes, **NEVER)
    for i in range(300):
        cache[f"k{i}"] = i
    cache.flush()
    checkpoint = cache._store.checkpoint_lsn
    for i in range(300, 320):
        cache[f"k{i}"] = i
    crash(cache)
    return list_segments(str(d)), checkpoint


def record_offsets(seg: str) -> list[tuple[int, int]]:
    data = Path(seg).read_bytes()
    out, pos = [], len(MAGIC)
    while pos < len(data):
        n, _, lsn = HEADER.unpack_from(data, pos)
        out.append((pos, lsn))
        pos += HEADER.size + n
    return out


def test_damage_below_the_checkpoint_loses_nothing(tmp_path):
    """A flipped byte in a record the store already has: recovery steps over it
    and keeps every record after it (no salvage needed, nothing lost)."""
    d = tmp_path / "c"
    segs, checkpoint = write_checkpointed_then_more(d)
    for seg in segs:  # the log may hold several segments, some already cut back
        offsets = [o for o, lsn in record_offsets(seg) if lsn < checkpoint - 5]
        if offsets:
            data = bytearray(Path(seg).read_bytes())
            data[offsets[len(offsets) // 2] + HEADER.size + 3] ^= 0xFF
            Path(seg).write_bytes(bytes(data))
    with Cache(d) as cache:
        assert dict(cache.items()) == {f"k{i}": i for i in range(320)}


def test_damaged_end_of_an_older_segment_below_the_checkpoint(tmp_path):
    d = tmp_path / "c"
    cache = Cache(d, segment_bytes=2048, **NEVER)
    for i in range(200):
        cache[f"k{i}"] = i
    # the batcher is idle, so nothing is cut back yet: keep copies of the sealed
    # segments that the checkpoint below deletes, and put them back cut short
    sealed_before = list_segments(str(d))[:-1]
    saved = {s: Path(s).read_bytes() for s in sealed_before}
    assert len(saved) > 2
    crash_lsn = cache._last_lsn
    cache.flush()
    for i in range(200, 220):
        cache[f"k{i}"] = i
    crash(cache)
    for s, data in saved.items():
        Path(s).write_bytes(data[: len(data) - 7])  # cut an old segment mid-record
    assert crash_lsn == 200
    with Cache(d) as cache:
        assert dict(cache.items()) == {f"k{i}": i for i in range(220)}


def test_damage_above_the_checkpoint_is_still_an_error(tmp_path):
    d = tmp_path / "c"
    segs, checkpoint = write_checkpointed_then_more(d)
    last = segs[-1]
    offsets = [o for o, lsn in record_offsets(last) if lsn > checkpoint + 2]
    data = bytearray(Path(last).read_bytes())
    data[offsets[0] + HEADER.size + 3] ^= 0xFF
    Path(last).write_bytes(bytes(data))
    with pytest.raises(LogCorruptionError):
        Cache(d)


def write_with_old_segments(d: Path) -> tuple[list[str], int]:
    """200 sets in small segments, flushed, then 20 more; crash. The sealed
    segments the checkpoint deleted are put back: the log then starts with
    segments that lie wholly below the checkpoint, as a crash between the
    checkpoint's commit and their deletion leaves them. Return those and the
    checkpoint."""
    cache = Cache(d, segment_bytes=2048, **NEVER)
    for i in range(200):
        cache[f"k{i}"] = i
    saved = {s: Path(s).read_bytes() for s in list_segments(str(d))[:-1]}
    cache.flush()
    checkpoint = cache._store.checkpoint_lsn
    for i in range(200, 220):
        cache[f"k{i}"] = i
    crash(cache)
    for s, data in saved.items():
        Path(s).write_bytes(data)
    old = sorted(saved)
    assert len(old) > 2 and record_offsets(old[-1])[-1][1] <= checkpoint
    return old, checkpoint


def flip_record(seg: str, index: int) -> int:
    """Flip a payload byte of the index-th record of ``seg``; return its LSN."""
    offset, lsn = record_offsets(seg)[index]
    data = bytearray(Path(seg).read_bytes())
    data[offset + HEADER.size + 3] ^= 0xFF
    Path(seg).write_bytes(bytes(data))
    return lsn


def check_out(d: Path, capsys) -> tuple[int, list[str]]:
    rc = main(["check", str(d)])
    return rc, capsys.readouterr().out.splitlines()


def test_check_calls_damage_in_a_segment_below_the_checkpoint_harmless(tmp_path, capsys,
                                                                        caplog):
    """The open steps over it and loses nothing, so check says so in a note
    and exits 0, instead of DAMAGED and exit 1 with no way forward."""
    d = tmp_path / "c"
    old, checkpoint = write_with_old_segments(d)
    lsn = flip_record(old[1], 3)
    rc, lines = check_out(d, capsys)
    assert rc == 0, lines
    (note,) = [line for line in lines if old[1] in line]
    assert note.startswith("note ") and f"CRC mismatch in record LSN {lsn}" in note
    assert f"already in the store (at or below checkpoint {checkpoint})" in note
    assert "nothing is lost" in note
    assert "the next open steps over them and deletes this segment" in note
    assert lines[-1] == "result  healthy" and not any("DAMAGE" in x for x in lines)
    assert "note    replay log: 20 records after checkpoint" in "\n".join(lines)
    # ... which is what the open does
    with caplog.at_level(logging.WARNING, logger="durablekv"):
        cache = Cache(d, **NEVER)
    with cache:
        assert old[1] not in list_segments(str(d))  # deleted by the open, as the note says
        assert dict(cache.items()) == {f"k{i}": i for i in range(220)}
    assert any("already in the store" in r.getMessage() for r in caplog.records)


def test_check_calls_a_damaged_end_below_the_checkpoint_harmless(tmp_path, capsys):
    """The next segment's first record follows the damage: no gap is reported either."""
    d = tmp_path / "c"
    old, _checkpoint = write_with_old_segments(d)
    Path(old[0]).write_bytes(Path(old[0]).read_bytes()[:-7])
    rc, lines = check_out(d, capsys)
    assert rc == 0, lines
    (note,) = [line for line in lines if old[0] in line]
    assert note.startswith("note ") and "a damaged end at offset" in note
    assert "nothing is lost" in note and "deletes this segment" in note
    assert not any("follows" in x for x in lines)  # no separate gap line
    assert contents(d) == {f"k{i}": i for i in range(220)}


def test_check_notes_damage_below_the_checkpoint_in_a_segment_with_later_records(tmp_path,
                                                                                 capsys):
    """A segment that also holds records after the checkpoint: they are read
    past the damage (and counted as pending); the segment goes once a
    checkpoint passes its last record."""
    d = tmp_path / "c"
    segs, checkpoint = write_checkpointed_then_more(d, segment_bytes=2048)
    first = record_offsets(segs[0])
    assert first[0][1] < checkpoint - 5 and first[-1][1] > checkpoint
    flip_record(segs[0], 2)
    rc, lines = check_out(d, capsys)
    assert rc == 0, lines
    (note,) = [line for line in lines if segs[0] in line]
    assert note.startswith("note ") and "nothing is lost" in note
    assert f"once a checkpoint passes its last record, LSN {first[-1][1]}" in note
    assert (f"note    replay log: 20 records after checkpoint {checkpoint} are applied again "
            "at the next open") in lines  # 10 of them lie behind the damage
    with Cache(d, **NEVER) as cache:
        assert segs[0] in list_segments(str(d))  # it holds records only the log has
        cache.flush()
        assert segs[0] not in list_segments(str(d))
        assert dict(cache.items()) == {f"k{i}": i for i in range(320)}


def test_check_notes_a_missing_segment_below_the_checkpoint(tmp_path, capsys):
    d = tmp_path / "c"
    old, checkpoint = write_with_old_segments(d)
    os.unlink(old[1])
    rc, lines = check_out(d, capsys)
    assert rc == 0, lines
    (note,) = [line for line in lines if "follows" in line]
    assert note.startswith("note ") and old[2] in note and "nothing is lost" in note
    assert contents(d) == {f"k{i}": i for i in range(220)}


def test_check_calls_damage_above_the_checkpoint_damage_and_says_what_to_do(tmp_path, capsys):
    d = tmp_path / "c"
    segs, checkpoint = write_checkpointed_then_more(d)
    index = [lsn for _o, lsn in record_offsets(segs[-1])].index(checkpoint + 3)
    flip_record(segs[-1], index)
    rc, lines = check_out(d, capsys)
    assert rc == 1, lines
    (damage,) = [line for line in lines if segs[-1] in line]
    assert damage.startswith("DAMAGE ") and f"CRC mismatch in record LSN {checkpoint + 3}" in damage
    assert f"covers records after checkpoint {checkpoint}" in damage
    assert f"`durablekv salvage {d}`" in damage and "salvage_log=True" in damage
    assert lines[-1] == "result  DAMAGED"
    # what the open does instead of replaying: refuse, or salvage the 2 before the damage
    assert (f"note    replay log: the next open refuses the log (see the damage above); with "
            f"salvage_log=True it applies the 2 records after checkpoint {checkpoint} that "
            "come before the first damage and gives up the rest") in lines, lines
    with pytest.raises(LogCorruptionError):  # as check says
        Cache(d)
    with Cache(d, salvage_log=True, **NEVER) as cache:
        assert cache.stats().recovered_records == 2


def test_log_is_cut_back_after_checkpoints_and_removed_at_close(tmp_path):
    d = tmp_path / "c"
    cache = Cache(d, segment_bytes=4096, **NEVER)
    for i in range(2000):
        cache[f"k{i}"] = "x" * 50
    before = list_segments(str(d))
    assert len(before) > 10  # the log rolled over into many segments
    cache.flush()
    after = list_segments(str(d))
    assert len(after) == 1  # sealed segments behind the checkpoint are gone
    cache.close()
    assert list_segments(str(d)) == []
    assert len(contents(d)) == 2000


def test_recovered_records_are_read_in_lsn_order_across_segments(tmp_path):
    d = tmp_path / "c"
    cache = Cache(d, segment_bytes=2048, **NEVER)
    for i in range(300):
        cache["hot"] = i
        cache[f"k{i % 7}"] = i
    crash(cache)
    segs = list_segments(str(d))
    assert len(segs) > 3
    lsns = [r.lsn for s in segs for r in read_segment(s)[0]]
    assert lsns == list(range(1, 601))
    got = contents(d)
    assert got["hot"] == 299 and got["k6"] == 293 and len(got) == 8


def _reference_parse(data: bytes):
    """The straightforward parser the fast one must agree with, record for record."""
    import zlib

    from durablekv.log.segments import PAYLOAD, _LEN_LSN
    if len(data) < len(MAGIC):
        if data == MAGIC[:len(data)]:
            return [], 0, (0 if data else None)
        return [], 0, 0
    if data[:len(MAGIC)] != MAGIC:
        return [], 0, 0
    pos, out = len(MAGIC), []
    while pos < len(data):
        if pos + HEADER.size > len(data):
            return out, pos, pos
        n, crc, lsn = HEADER.unpack_from(data, pos)
        if n < PAYLOAD.size or n > 1 << 31 or pos + HEADER.size + n > len(data):
            return out, pos, pos
        payload = data[pos + HEADER.size:pos + HEADER.size + n]
        if zlib.crc32(payload, zlib.crc32(_LEN_LSN.pack(n, lsn))) != crc:
            return out, pos, pos
        op, exp, klen = PAYLOAD.unpack_from(payload, 0)
        if op not in (1, 2, 3) or PAYLOAD.size + klen > n:
            return out, pos, pos
        out.append((lsn, op, payload[PAYLOAD.size:PAYLOAD.size + klen],
                    payload[PAYLOAD.size + klen:], None if exp != exp else exp))
        pos += HEADER.size + n
    return out, pos, None


def test_parser_agrees_with_a_reference_at_every_flipped_byte_and_cut(tmp_path):
    """The record parser is tuned for speed (one struct call a record inside a
    run of records of one shape); every damage it can meet (a flipped byte
    anywhere, a cut anywhere, inside or outside such runs) must still give
    exactly the records, the good end and the damage offset of a plain
    reference parser."""
    import zlib

    from durablekv.log.segments import PAYLOAD, _LEN_LSN, _parse_segment, encode_record
    d = tmp_path / "c"
    cache = Cache(d, **NEVER)
    cache["a"] = "A" * 10
    cache.set(("t", 1), b"x" * 40, expire=30)
    cache.delete("a")
    cache[2.5] = [1, 2]
    for i in range(5):  # runs of records of one shape take the parser's fast path
        cache[f"r{i}"] = b"v" * 8
    cache.clear()
    cache["b"] = None
    for i in range(6):  # ... also at the very end of the file
        cache[f"s{i}"] = i + 10**9
    crash(cache)
    (seg,) = list_segments(str(d))
    data = Path(seg).read_bytes()
    assert len(_reference_parse(data)[0]) == 17
    variants = [data[:cut] for cut in range(len(data) + 1)]
    for i in range(len(data)):
        for mask in (0x01, 0xFF):
            b = bytearray(data)
            b[i] ^= mask
            variants.append(bytes(b))
    # records with a valid CRC but an unknown op or a key longer than the
    # payload (no single flip makes one), put in place of each record
    pos = len(MAGIC)
    while pos < len(data):
        n, _, lsn = HEADER.unpack_from(data, pos)
        end = pos + HEADER.size + n
        op, exp, klen = PAYLOAD.unpack_from(data, pos + HEADER.size)
        body = data[pos + HEADER.size + PAYLOAD.size:end]
        bad_op = encode_record(lsn, 7, body[:klen], body[klen:], None if exp != exp else exp)
        long_key = bytearray(data[pos:end])
        long_key[HEADER.size + 9:HEADER.size + 13] = (n + 1).to_bytes(4, "little")
        crc = zlib.crc32(bytes(long_key[HEADER.size:]), zlib.crc32(_LEN_LSN.pack(n, lsn)))
        long_key[4:8] = crc.to_bytes(4, "little")
        for rec in (bad_op, bytes(long_key)):
            assert len(rec) == end - pos
            variants.append(data[:pos] + rec + data[end:])
        pos = end
    for v in variants:
        recs, good_end, damage = _parse_segment(v)
        ref, ref_end, ref_damage = _reference_parse(v)
        assert (recs, good_end) == (ref, ref_end)
        assert (None if damage is None else damage.offset) == ref_damage


def test_cli_salvage_keeps_the_good_prefix_and_writes_nothing_else(tmp_path, capsys):
    """``durablekv salvage DIR``, which check and LogCorruptionError point to:
    the records before the damage are kept, the segment is moved aside, and
    no key of the command's own is written (``replay --salvage-log`` replays
    a workload into the directory afterwards)."""
    d = tmp_path / "c"
    seg, offsets = write_abc(d)
    data = bytearray(Path(seg).read_bytes())
    data[offsets[1] + HEADER.size + 15] ^= 0xFF
    Path(seg).write_bytes(bytes(data))
    check_out(d, capsys)
    assert main(["salvage", str(d)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "ok      replay log: 1 records after the store's checkpoint applied and stored"
    assert out[1] == (f"salvage gave up the {len(data) - offsets[1]} bytes of log from the first "
                      "damage to its end: the writes recorded there are lost")
    assert out[2] == f"moved   {seg}.damaged"
    assert out[-1].startswith("result  SALVAGED")
    assert contents(d) == {"a": "A" * 10}
    rc, lines = check_out(d, capsys)
    assert rc == 0, lines
    # a second salvage finds nothing to do and changes nothing
    assert main(["salvage", str(d)]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == (
        "result  NOTHING TO SALVAGE: the log had no damage that stops an open")
    assert contents(d) == {"a": "A" * 10}
    assert sorted(p.name for p in d.iterdir() if p.name.endswith(".damaged")) == [
        Path(seg).name + ".damaged"]


@pytest.mark.parametrize("name", ["c", "run#1", "a?b"])
def test_cli_salvage_adopts_the_stored_serializer(tmp_path, capsys, name):
    """Read from the store's meta table; a ``#`` or ``?`` in the path must
    not cut the SQLite URI short (that read another file, and made it)."""
    d = tmp_path / name
    cache = Cache(d, serializer="pickle", **NEVER)
    cache["a"] = {1, 2}
    crash(cache)
    assert main(["salvage", str(d)]) == 0
    assert capsys.readouterr().out.splitlines()[-1].startswith("result  NOTHING TO SALVAGE")
    with Cache(d, serializer="pickle") as cache:
        assert cache["a"] == {1, 2}
    assert sorted(p.name for p in tmp_path.iterdir()) == [name]  # no stray file


def test_cli_salvage_of_a_log_without_a_store_needs_the_serializer(tmp_path, capsys):
    d = tmp_path / "c"
    cache = Cache(d, serializer="pickle", **NEVER)
    cache["a"] = {1, 2}
    crash(cache)
    os.unlink(d / "pages.sqlite3")
    before = sorted(p.name for p in d.iterdir())
    assert main(["salvage", str(d)]) == 2
    assert "pass --serializer safe" in capsys.readouterr().err
    assert sorted(p.name for p in d.iterdir()) == before  # nothing written
    assert main(["salvage", "--serializer", "pickle", str(d)]) == 0
    with Cache(d, serializer="pickle") as cache:
        assert cache["a"] == {1, 2}


def test_cli_salvage_of_a_missing_or_open_directory_fails_cleanly(tmp_path, capsys):
    assert main(["salvage", str(tmp_path / "nope")]) == 2
    assert "no such directory" in capsys.readouterr().err
    (tmp_path / "file").write_text("x")
    assert main(["salvage", str(tmp_path / "file")]) == 2
    assert "is a file, not a cache directory" in capsys.readouterr().err
    # a directory that holds no cache is refused, not made into a new cache
    (tmp_path / "proj").mkdir()
    (tmp_path / "proj" / "notes.txt").write_text("x")
    assert main(["salvage", str(tmp_path / "proj")]) == 2
    assert "is not a durablekv cache directory" in capsys.readouterr().err
    assert [p.name for p in (tmp_path / "proj").iterdir()] == ["notes.txt"]
    (tmp_path / "proj" / "pages.sqlite3").write_bytes(b"")  # all SQLite leaves for a bad path
    assert main(["salvage", str(tmp_path / "proj")]) == 2
    assert "pages.sqlite3 is empty, no replay log" in capsys.readouterr().err
    assert sorted(p.name for p in (tmp_path / "proj").iterdir()) == ["notes.txt", "pages.sqlite3"]
    assert (tmp_path / "proj" / "pages.sqlite3").stat().st_size == 0
    with Cache(tmp_path / "c"):
        assert main(["salvage", str(tmp_path / "c")]) == 1
        err = capsys.readouterr().err
        assert err.startswith("durablekv: cache directory") and "already open" in err


@pytest.mark.parametrize("name", ["run#1", "a?b"])
def test_check_reads_a_store_whose_path_has_uri_characters(tmp_path, capsys, name):
    d = tmp_path / name
    with Cache(d) as cache:
        cache["x"] = 1
    rc, lines = check_out(d, capsys)
    assert rc == 0 and lines[-1] == "result  healthy", lines
    assert sorted(p.name for p in tmp_path.iterdir()) == [name]


def write_segments(d: Path, n: int = 300) -> list[str]:
    """``n`` sets in 2 KiB segments, none flushed (checkpoint 0); crash."""
    cache = Cache(d, segment_bytes=2048, **NEVER)
    for i in range(n):
        cache[f"k{i}"] = i
    crash(cache)
    segs = list_segments(str(d))
    assert len(segs) > 4
    return segs


def test_a_damaged_header_of_a_later_segment_loses_nothing(tmp_path, caplog, capsys):
    """Only the 8-byte header of a segment above the checkpoint is damaged:
    its first record follows the previous segment's last with no LSN in
    between, so the damage hides no record. The open steps over it and says
    why; check calls it harmless; nothing is salvaged away."""
    d = tmp_path / "c"
    segs = write_segments(d)
    data = bytearray(Path(segs[2]).read_bytes())
    data[0:8] = b"NOTALOG!"
    Path(segs[2]).write_bytes(bytes(data))
    first = int(os.path.basename(segs[2])[len("replay-"):-len(".log")])
    rc, out = check_out(d, capsys)
    assert rc == 0, out
    assert any(f"it holds no record: LSN {first} follows {first - 1}" in line
               for line in out), out
    with caplog.at_level(logging.WARNING, logger="durablekv.replaylog"):
        with Cache(d, **NEVER) as cache:
            assert dict(cache.items()) == {f"k{i}": i for i in range(300)}
            assert cache.stats().salvaged_bytes == 0
    assert f"it holds no record: LSN {first} follows {first - 1}" in caplog.text
    assert not any(n.endswith(".damaged") for n in os.listdir(d))
    assert contents(d) == {f"k{i}": i for i in range(300)}


def test_garbage_between_two_intact_records_hides_no_record(tmp_path, caplog):
    """Bytes that are no record, between two records whose LSNs follow each
    other, are stepped over in any segment, the last one included (an
    intact record behind them: not a torn tail)."""
    d = tmp_path / "c"
    segs = write_segments(d)
    for seg in (segs[1], segs[-1]):
        offsets = record_offsets(seg)
        at = offsets[len(offsets) // 2][0]
        data = Path(seg).read_bytes()
        Path(seg).write_bytes(data[:at] + bytes(range(7, 107)) + data[at:])
    with caplog.at_level(logging.WARNING, logger="durablekv.replaylog"):
        assert contents(d) == {f"k{i}": i for i in range(300)}
    assert caplog.text.count("it holds no record") == 2


def test_stepping_over_damage_never_drops_a_record(tmp_path):
    """For every flipped byte of a segment in the middle of the log (no
    checkpoint), the scan either stops at the damage or, when it steps over
    it, still returns every record of the segment, unchanged."""
    from durablekv.log.segments import _first_lsn_of, scan_segment
    segs = write_segments(tmp_path / "c")
    data = Path(segs[2]).read_bytes()
    first = _first_lsn_of(segs[2])
    whole = scan_segment(data, 0, segs[3], first)
    assert whole.damage is None and not whole.stepped_over
    stepped = 0
    for i in range(len(data)):
        b = bytearray(data)
        b[i] ^= 0x5A
        scan = scan_segment(bytes(b), 0, segs[3], first)
        if scan.damage is None:
            assert scan.records == whole.records, i
            stepped += 1
    assert stepped == len(MAGIC)  # the header's bytes, and no others


@pytest.mark.parametrize("how", ["older store put back", "store deleted", "wal deleted"])
def test_a_store_older_than_the_log_is_a_gap_not_a_silent_loss(tmp_path, capsys, how):
    """The log must continue the store's checkpoint. When pages.sqlite3 is
    older than the log (a backup put back, its -wal deleted, or the file
    deleted), the records between are missing: the open refused nothing and
    served the older values, and check said healthy. Now it is an LSN gap:
    LogCorruptionError, check reports DAMAGE, and salvage keeps the store as
    it is and moves the log aside."""
    d = tmp_path / "c"
    with Cache(d) as cache:
        for i in range(100):
            cache[f"a{i}"] = "old"
    shutil.copy(d / "pages.sqlite3", tmp_path / "backup")
    cache = Cache(d, segment_bytes=2048, max_pages=1000, **NEVER)
    for i in range(100):
        cache[f"a{i}"] = "new"
    cache.flush()                       # checkpointed: the log's first segments go
    for i in range(100):
        cache[f"b{i}"] = i
    if how == "wal deleted":
        # the main file alone, as a killed process leaves it: the flush is
        # in the -wal (a clean close would copy it into the main file)
        shutil.copy(d / "pages.sqlite3", tmp_path / "backup")
    crash(cache)
    for name in ("pages.sqlite3", "pages.sqlite3-wal", "pages.sqlite3-shm"):
        (d / name).unlink(missing_ok=True)
    if how != "store deleted":
        shutil.copy(tmp_path / "backup", d / "pages.sqlite3")
    with pytest.raises(LogCorruptionError) as exc:
        Cache(d)
    assert "older than the log" in str(exc.value)
    rc, out = check_out(d, capsys)
    assert rc == 1 and any("older than the log" in line for line in out), out
    assert main(["salvage", str(d)]) == 0
    capsys.readouterr()
    assert check_directory(str(d)).ok
    expected = {f"a{i}": "old" for i in range(100)} if how != "store deleted" else {}
    assert contents(d) == expected


def test_a_store_rebuilt_empty_continues_the_log(tmp_path):
    """on_corruption='rebuild' starts an empty store, which cannot continue
    the log's LSNs; the log is applied anyway, and the new store continues
    it, so a crash before its first flush is no gap at the next open."""
    d = tmp_path / "c"
    cache = Cache(d, segment_bytes=2048, max_pages=1000, **NEVER)
    for i in range(100):
        cache[f"a{i}"] = i
    cache.flush()
    for i in range(50):
        cache[f"b{i}"] = i
    crash(cache)
    with open(d / "pages.sqlite3", "r+b") as f:
        f.write(b"\0" * 100)            # the SQLite header
    cache = Cache(d, on_corruption="rebuild", **NEVER)
    assert cache.store_rebuilds == 1
    assert {f"b{i}" for i in range(50)} <= set(cache)
    crash(cache)
    with Cache(d) as cache:
        assert {f"b{i}" for i in range(50)} <= set(cache)


@pytest.mark.parametrize("killed_in", ["moving the damaged store aside", "the replay"])
def test_a_rebuild_killed_anywhere_loses_nothing_the_log_holds(tmp_path, monkeypatch, killed_in):
    """The new store is built whole, starting where the log does, before the
    damaged one moves aside. A rebuild killed before the move leaves the
    damaged store (the next rebuild starts over); killed after it, the next
    open installs the new store, which continues the log. Before, a rebuild
    killed in its replay left an empty store at checkpoint 0 and a log at
    LSN 101: every later open called that a gap, and salvage dropped the
    acknowledged writes."""
    import durablekv.stores.factory as factory
    from durablekv.log.replaylog import ReplayLog

    d = tmp_path / "c"
    with Cache(d) as cache:
        for i in range(100):
            cache[f"old{i}"] = i
    cache = Cache(d, **NEVER)
    for i in range(50):
        cache[f"new{i}"] = i
    crash(cache)
    (d / "pages.sqlite3.damaged").write_text("page 3 cannot be decoded\n")

    def killed(*args, **kwargs):
        raise KeyboardInterrupt

    if killed_in == "the replay":
        monkeypatch.setattr(ReplayLog, "recover", killed)
    else:
        monkeypatch.setattr(factory, "move_aside", killed)
    with pytest.raises(KeyboardInterrupt):
        Cache(d, on_corruption="rebuild")
    monkeypatch.undo()
    if killed_in == "the replay":
        opened_again = Cache(d)                 # the new store is in place
    else:
        with pytest.raises(CorruptStoreError):  # still the damaged store
            Cache(d)
        opened_again = Cache(d, on_corruption="rebuild")
    with opened_again as cache:
        assert dict(cache.items()) == {f"new{i}": i for i in range(50)}
    assert not (d / "pages.sqlite3.ready").exists()


def test_a_rebuild_killed_as_it_moves_the_damaged_store_never_mixes_the_two(tmp_path,
                                                                           monkeypatch):
    """The damaged store's -wal goes aside before its main file, and its
    damage marker after it; installing the prepared store removes anything
    the damaged one left. Before, a kill between the main file's move and
    its -wal's let SQLite apply the damaged store's WAL to the new store (a
    malformed store, or the old contents, with check saying healthy)."""
    import durablekv.cache as cache_mod

    d = tmp_path / "c"
    with Cache(d) as cache:
        cache["old"] = 0                # checkpoint 1: the log starts at LSN 2
    cache = Cache(d, **NEVER)
    for i in range(50):
        cache[f"k{i}"] = i
    crash(cache)
    (d / "pages.sqlite3.damaged").write_text("page 3 cannot be decoded\n")
    (d / "pages.sqlite3-wal").write_bytes(b"the damaged store's WAL" * 100)
    real_replace = os.replace

    def killed_after_the_main_file(src, dst):
        real_replace(src, dst)
        if src.endswith("pages.sqlite3"):
            raise KeyboardInterrupt

    monkeypatch.setattr(cache_mod.os, "replace", killed_after_the_main_file)
    with pytest.raises(KeyboardInterrupt):
        Cache(d, on_corruption="rebuild")
    monkeypatch.undo()
    names = set(os.listdir(d))
    assert "pages.sqlite3-wal" not in names           # moved aside first
    assert "pages.sqlite3.damaged" in names           # still to move: the kill came first
    assert any(n.endswith(".corrupt-" + n.split(".corrupt-")[-1]) and n.endswith("-wal")
               for n in names)
    # check reads the prepared store's checkpoint, as the next open will
    result = check_directory(str(d))
    assert result.ok and any("interrupted rebuild prepared (checkpoint 1)" in line
                             for line in result.lines), result.lines
    with Cache(d) as cache:                           # installs the prepared store
        assert dict(cache.items()) == {f"k{i}": i for i in range(50)}
    assert check_directory(str(d)).ok
    assert not (d / "pages.sqlite3.damaged").exists()


STRAY_NAMES = ["replay-abc.log", "replay-1.log", "replay-000000000000000000001.log",
               "replay-+0000000000000000001.log", "replay-00000000000000000001.log.bak",
               "replay-00000000000000000001.LOG"]


def test_files_that_are_not_segments_are_left_alone(tmp_path, capsys):
    """Only ``replay-<20 digits>.log`` (segment_name's form) is a segment. A
    stray ``replay-abc.log`` sorted after the real segment, so recovery took
    it for the last one, called its contents a torn tail and deleted it.
    Open, check and salvage now all ignore such files and keep them."""
    d = tmp_path / "c"
    seg, _offsets = write_abc(d)
    junk = b"not a durablekv log segment\n" * 3
    for name in STRAY_NAMES:
        (d / name).write_bytes(junk)
    assert list_segments(str(d)) == [seg]
    rc, lines = check_out(d, capsys)
    assert rc == 0, lines
    assert not any(name in line for line in lines for name in STRAY_NAMES), lines
    assert main(["salvage", str(d)]) == 0
    assert capsys.readouterr().out.splitlines()[-1].startswith("result  NOTHING TO SALVAGE")
    with Cache(d) as cache:
        assert dict(cache.items()) == {"a": "A" * 10, "b": "B" * 10, "c": "C" * 10}
        assert cache.stats().torn_records == 0
    for name in STRAY_NAMES:
        assert (d / name).read_bytes() == junk, name
    # a cleanly closed directory holding only the strays: nothing to recover
    assert list_segments(str(d)) == []
    with Cache(d) as cache:
        assert cache.stats().torn_records == 0 and len(cache) == 3
    assert all((d / name).read_bytes() == junk for name in STRAY_NAMES)
