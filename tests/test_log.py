"""The replay log on its own (durablekv/log/), with no Cache: records appended
through :class:`ReplayLog`, the files cut and damaged the ways a crash or a
disk does, recovered into a plain dict, and the recovered records applied to
a memory tier by :class:`LogReplay`.

The LSN rules checked: recovery returns exactly the records after the
checkpoint, in LSN order, with LSNs one apart; a torn last record is cut off
and its LSN is the next one written; a gap (a segment missing) or damage
before the tail is an error that names the file and offset, unless salvage
keeps the good prefix.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from durablekv import LogCorruptionError, codec
from durablekv.counts import KeyCounts
from durablekv.log import OP_CLEAR, OP_DELETE, OP_SET, ReplayLog
from durablekv.log.recovery import LogReplay
from durablekv.log.segments import MAGIC, encode_record, list_segments
from durablekv.storekeys import StoreKeys
from durablekv.stores.sqlite import SQLitePageStore
from durablekv.tier import make_tier

SAFE = codec.codec_by_name("safe")


def _ops(n: int) -> list[tuple[int, object, object, float | None]]:
    """A deterministic mix of sets (some with an expiry), deletes and one
    clear: (op, key, value, expire_at)."""
    ops: list[tuple[int, object, object, float | None]] = []
    for i in range(n):
        key = f"k{i % 7}" if i % 3 else i % 5
        if i == n // 2:
            ops.append((OP_CLEAR, None, None, None))
        elif i % 5 == 4:
            ops.append((OP_DELETE, key, None, None))
        else:
            ops.append((OP_SET, key, f"v{i}".encode() * (i % 4 + 1),
                        1e12 + i if i % 6 == 1 else None))
    return ops


def _write(directory: Path, ops, *, first_lsn: int = 1, segment_bytes: int = 64 << 20,
           append: str = "write") -> ReplayLog:
    """A log in ``directory`` holding ``ops`` from ``first_lsn`` on, synced
    and left open, as a process that crashed right after them leaves it."""
    directory.mkdir(exist_ok=True)
    log = ReplayLog(str(directory), segment_bytes=segment_bytes, append=append)
    log.recover(first_lsn - 1)
    log.start(first_lsn)
    for lsn, (op, key, value, expire_at) in enumerate(ops, first_lsn):
        kb = b"" if op == OP_CLEAR else codec.encode_key(key)
        vb = SAFE.encode(value) if op == OP_SET else b""
        log.append(lsn, op, kb, vb, expire_at)
    log.sync()
    return log


def _crash_image(src: Path, dst: Path) -> Path:
    """The files of ``src`` as they are now, as a new directory (the process
    that wrote them is gone: nothing closes them)."""
    shutil.copytree(src, dst)
    return dst


def _model(records) -> dict:
    """The records applied one at a time to a dict: key -> (value, expire_at)."""
    out: dict = {}
    for _lsn, op, kb, vb, expire_at in records:
        if op == OP_CLEAR:
            out.clear()
        elif op == OP_DELETE:
            out.pop(codec.decode_key(kb), None)
        else:
            out[codec.decode_key(kb)] = (SAFE.decode(vb), expire_at)
    return out


def _expected(ops, after: int = 0) -> dict:
    return _model([(lsn, op, b"" if op == OP_CLEAR else codec.encode_key(k),
                    SAFE.encode(v) if op == OP_SET else b"", e)
                   for lsn, (op, k, v, e) in enumerate(ops, 1) if lsn > after])


def _recover(directory: Path, after: int = 0, **kw):
    log = ReplayLog(str(directory))
    try:
        return log.recover(after, **kw)
    finally:
        log.close()


def test_recovery_returns_every_record_after_the_checkpoint_in_lsn_order(tmp_path):
    ops = _ops(60)
    _write(tmp_path / "w", ops, segment_bytes=300)  # many segments
    assert len(list_segments(str(tmp_path / "w"))) > 3
    for after in (0, 1, 17, 30, 59, 60):
        img = _crash_image(tmp_path / "w", tmp_path / f"a{after}")
        result = _recover(img, after)
        lsns = [r[0] for r in result.records]
        assert lsns == list(range(after + 1, 61))
        assert result.torn_records == 0 and result.salvaged == []
        if after < 30:  # the clear (LSN 31) is among them: the dict model holds
            assert _model(result.records) == _expected(ops)


def test_a_cut_anywhere_in_the_last_record_loses_that_record_only(tmp_path):
    ops = _ops(12)
    _write(tmp_path / "w", ops)
    [seg] = list_segments(str(tmp_path / "w"))
    data = Path(seg).read_bytes()
    last = encode_record(12, *_encoded(ops[-1]))
    assert data.endswith(last)
    start = len(data) - len(last)
    for cut in range(start, len(data)):
        img = _crash_image(tmp_path / "w", tmp_path / f"cut{cut}")
        img_seg = img / Path(seg).name
        with open(img_seg, "r+b") as f:
            f.truncate(cut)
        result = _recover(img)
        assert [r[0] for r in result.records] == list(range(1, 12)), cut
        assert _model(result.records) == _expected(ops[:11])
        # a cut at the record's first byte leaves a whole log, not a torn one
        assert (result.torn_records, result.torn_bytes) == \
            ((0, 0) if cut == start else (1, cut - start))
        assert img_seg.stat().st_size == start  # the torn bytes are gone from the file
        # the next record written takes the torn one's LSN, and survives
        log = ReplayLog(str(img))
        log.recover(0)
        log.start(12)
        log.append(12, OP_SET, codec.encode_key("after"), SAFE.encode(b"x"), None)
        log.sync()
        again = _recover(_crash_image(img, tmp_path / f"again{cut}"))
        log.close()
        assert [r[0] for r in again.records] == list(range(1, 13))
        assert _model(again.records)["after"] == (b"x", None)


def _encoded(op_entry):
    op, key, value, expire_at = op_entry
    kb = b"" if op == OP_CLEAR else codec.encode_key(key)
    vb = SAFE.encode(value) if op == OP_SET else b""
    return op, kb, vb, expire_at


def test_a_zero_filled_tail_is_torn_and_cut(tmp_path):
    _write(tmp_path / "w", _ops(5))
    img = _crash_image(tmp_path / "w", tmp_path / "z")
    [seg] = list_segments(str(img))
    size = os.path.getsize(seg)
    with open(seg, "ab") as f:
        f.write(bytes(100))
    result = _recover(img)
    assert [r[0] for r in result.records] == [1, 2, 3, 4, 5]
    assert result.torn_records == 1 and os.path.getsize(seg) == size


def test_a_bad_crc_on_the_final_record_is_a_torn_write(tmp_path):
    _write(tmp_path / "w", _ops(5))
    img = _crash_image(tmp_path / "w", tmp_path / "crc")
    [seg] = list_segments(str(img))
    data = bytearray(Path(seg).read_bytes())
    data[-1] ^= 0x40  # the last byte of the last record's value
    Path(seg).write_bytes(bytes(data))
    result = _recover(img)
    assert [r[0] for r in result.records] == [1, 2, 3, 4]
    assert result.torn_records == 1


def test_damage_before_the_tail_is_an_error_naming_file_and_offset(tmp_path):
    _write(tmp_path / "w", _ops(20))
    img = _crash_image(tmp_path / "w", tmp_path / "flip")
    [seg] = list_segments(str(img))
    data = bytearray(Path(seg).read_bytes())
    rec1 = len(encode_record(1, *_encoded(_ops(20)[0])))
    offset = len(MAGIC) + rec1 + 20  # inside record 2's payload
    data[offset] ^= 0x01
    Path(seg).write_bytes(bytes(data))
    with pytest.raises(LogCorruptionError) as err:
        _recover(img)
    assert err.value.path == seg and err.value.offset == len(MAGIC) + rec1
    # salvage keeps the good prefix and says what it gave up
    result = _recover(img, salvage=True)
    assert [r[0] for r in result.records] == [1]
    assert result.salvaged == [seg] and result.salvaged_bytes > 0


def test_damage_that_hides_only_checkpointed_records_is_stepped_over(tmp_path):
    ops = _ops(20)
    _write(tmp_path / "w", ops)
    img = _crash_image(tmp_path / "w", tmp_path / "old")
    [seg] = list_segments(str(img))
    data = bytearray(Path(seg).read_bytes())
    rec1 = len(encode_record(1, *_encoded(ops[0])))
    data[len(MAGIC) + rec1 + 20] ^= 0x01  # record 2, below the checkpoint
    Path(seg).write_bytes(bytes(data))
    result = _recover(img, after=10)
    assert [r[0] for r in result.records] == list(range(11, 21))


def test_a_missing_segment_is_an_lsn_gap(tmp_path):
    _write(tmp_path / "w", _ops(40), segment_bytes=300)
    img = _crash_image(tmp_path / "w", tmp_path / "gap")
    segs = list_segments(str(img))
    assert len(segs) >= 3
    os.remove(segs[1])
    with pytest.raises(LogCorruptionError) as err:
        _recover(img)
    assert "LSN" in str(err.value)
    result = _recover(img, salvage=True)
    lsns = [r[0] for r in result.records]
    assert lsns == list(range(1, len(lsns) + 1)) and lsns  # the prefix before the gap


def test_a_log_that_starts_after_the_checkpoint_is_a_gap(tmp_path):
    """Records 1-9 are neither in the store (checkpoint 0) nor in the log."""
    _write(tmp_path / "w", _ops(5), first_lsn=10)
    with pytest.raises(LogCorruptionError):
        _recover(_crash_image(tmp_path / "w", tmp_path / "late"), after=0)
    assert [r[0] for r in _recover(_crash_image(tmp_path / "w", tmp_path / "ok"),
                                   after=9).records] == [10, 11, 12, 13, 14]


# -- LogReplay: the records into a memory tier, with no Cache ----------------------------


class _Host:
    """What a cache hands LogReplay, as plain state (an empty store: every
    key is new)."""

    def __init__(self, tier) -> None:
        self.tier = tier
        self.counts = KeyCounts()
        self.store_keys = StoreKeys(0, empty=True)  # a new store: every key is new
        self.cleared_at: list[int] = []
        self.waits = 0

    def clear(self, lsn: int) -> None:
        self.tier.clear()
        self.counts.cleared()
        self.store_keys.cleared(lsn)
        self.cleared_at.append(lsn)

    def backpressure(self) -> None:
        self.waits += 1
        raise AssertionError("no page is pending with an empty store")


@pytest.mark.parametrize("policy", ["lru", "tinylfu", "midpoint"])
@pytest.mark.parametrize("page_size", [1, 4])
def test_log_replay_into_a_tier_gives_what_one_at_a_time_replay_gives(tmp_path, policy,
                                                                       page_size):
    ops = _ops(80)
    _write(tmp_path / "w", ops)
    records = _recover(_crash_image(tmp_path / "w", tmp_path / "r")).records
    tier = make_tier(page_size, 1000, policy)
    host = _Host(tier)
    (tmp_path / "store").mkdir()
    store = SQLitePageStore(str(tmp_path / "store"), page_size=page_size)
    try:
        replay = LogReplay(tier, store, SAFE, host.counts, host.store_keys,
                           directory=str(tmp_path / "r"), max_pending_pages=1 << 20,
                           clear=host.clear, fault_in=None, whole=None,
                           backpressure=host.backpressure)
        assert replay.apply(records) == 80  # the last LSN applied
    finally:
        store.close()
    want = _expected(ops)
    got = {key: (SAFE.from_memory(page.values[slot]), page.expires[slot])
           for key, (page, slot, _) in tier.table.items()}
    assert got == want
    assert host.cleared_at == [41]  # the clear, LSN n // 2 + 1
    assert (host.counts.keys, host.counts.ttl_keys) == \
        (len(want), sum(e is not None for _, e in want.values()))
    # every page the records changed is dirty, since the first LSN replayed
    assert {id(page) for page, _, _ in tier.table.values()} <= \
        {id(p) for p in tier.dirty.values()}


def test_a_record_that_does_not_decode_names_its_lsn_and_offset(tmp_path):
    directory = tmp_path / "bad"
    directory.mkdir()
    log = ReplayLog(str(directory), append="write")
    log.recover(0)
    log.start(1)
    log.append(1, OP_SET, codec.encode_key("a"), SAFE.encode(b"1"), None)
    log.append(2, OP_SET, b"\xffnot a key", SAFE.encode(b"2"), None)  # CRC fine, key not
    log.sync()
    records = _recover(_crash_image(directory, tmp_path / "img")).records
    log.close()
    tier = make_tier(4, 100, "lru")
    host = _Host(tier)
    replay = LogReplay(tier, None, SAFE, host.counts, host.store_keys,
                       directory=str(directory), max_pending_pages=1 << 20,
                       clear=host.clear, fault_in=None, whole=None,
                       backpressure=host.backpressure)
    with pytest.raises(LogCorruptionError, match="LSN 2"):
        replay.apply(records)


def test_a_deleted_newest_segment_is_found_missing_through_the_control_file(tmp_path):
    """The control file names the newest segment a writer opened; a log
    whose last segment is gone is not mistaken for a shorter whole one."""
    _write(tmp_path / "w", _ops(40), segment_bytes=300)
    img = _crash_image(tmp_path / "w", tmp_path / "lost")
    segs = list_segments(str(img))
    os.remove(segs[-1])
    with pytest.raises(LogCorruptionError, match="replay.control|missing|deleted"):
        _recover(img)
    result = _recover(img, salvage=True)
    assert result.lost  # what salvage could not recover, in words
    lsns = [r[0] for r in result.records]
    assert lsns == list(range(1, len(lsns) + 1))


def test_a_damaged_segment_header_before_intact_records_is_stepped_over(tmp_path, caplog):
    """The bytes hide no record: the next intact one follows the record
    before the damage with no LSN in between. Recovery says so and goes on."""
    _write(tmp_path / "w", _ops(40), segment_bytes=300)
    img = _crash_image(tmp_path / "w", tmp_path / "magic")
    segs = list_segments(str(img))
    with open(segs[1], "r+b") as f:
        f.write(b"NOTALOG!")  # the 8-byte magic
    with caplog.at_level("WARNING", logger="durablekv.replaylog"):
        result = _recover(img)
    assert [r[0] for r in result.records] == list(range(1, 41))
    assert "bad magic" in caplog.text and os.path.basename(segs[1]) in caplog.text
