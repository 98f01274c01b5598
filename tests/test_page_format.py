"""The page blob format: version 2 round trips, version-1 stores still open."""

from __future__ import annotations

import logging
import sqlite3
import struct

import pytest
from hypothesis import given, strategies as st

from durablekv import Cache, CorruptStoreError, codec
from durablekv.check import check_directory
from durablekv.cli import main
from durablekv.stores.pageformat import (ASCII_KEYS, INT_KEYS, NO_TTL, RAW_BYTES, decode_page,
                                         encode_page, page_columns, page_layout, split_page)
from durablekv.stores.sqlitefile import migration_files

from .conftest import reseal_pages

STORE = "pages.sqlite3"
LATEST = len(migration_files())
SAFE = codec.SafeCodec()

keys = st.one_of(st.text(max_size=12), st.integers(), st.binary(max_size=8),
                 st.tuples(st.integers(), st.text(max_size=3)))
values = st.one_of(st.binary(max_size=40), st.text(max_size=10), st.integers(),
                   st.lists(st.integers(), max_size=3))
expires = st.one_of(st.none(), st.floats(min_value=0, max_value=4e9))


@given(st.dictionaries(keys, st.tuples(values, expires), max_size=20), st.randoms())
def test_any_page_round_trips(entries, rnd):
    slots = rnd.sample(range(64), len(entries))
    page = [(slot, codec.encode_key(k), SAFE.encode(v), e)
            for slot, (k, (v, e)) in zip(slots, entries.items())]
    assert list(decode_page(encode_page(page))) == page


def test_common_pages_take_the_compact_forms():
    page = [(i, codec.encode_key(f"key:{i}"), SAFE.encode(bytes([i]) * 10), None)
            for i in range(16)]
    data = encode_page(page)
    slots, exps, flags, kpos, vpos = page_layout(data)
    assert flags == ASCII_KEYS | RAW_BYTES | NO_TTL
    assert list(slots) == list(range(16)) and exps == [None] * 16
    assert vpos[-1] == len(data) and data[vpos[3]:vpos[4]] == bytes([3]) * 10
    ints = [(i, codec.encode_key(i * 1000 - 5), SAFE.encode(b"x"), None) for i in range(16)]
    assert page_layout(encode_page(ints))[2] == INT_KEYS | RAW_BYTES | NO_TTL
    assert list(decode_page(encode_page(ints))) == ints
    # one non-ASCII key, one str value, one TTL: each compact form is dropped
    page[5] = (5, codec.encode_key("clé"), SAFE.encode("text"), 9.5)
    data = encode_page(page)
    assert page_layout(data)[2] == 0
    assert list(decode_page(data)) == page


def _as_encoded(flags, keys_col, values_col):
    """page_columns' keys and values back in their encoded forms."""
    if flags & ASCII_KEYS or flags & INT_KEYS:
        keys_col = [codec.encode_key(k) for k in keys_col]
    if flags & RAW_BYTES:
        values_col = [SAFE.encode(v) for v in values_col]
    return keys_col, values_col


# fixed-width keys and fixed-size values take the one-struct-call path
fixed_pages = st.integers(1, 40).flatmap(lambda n: st.tuples(
    st.lists(st.one_of(st.text(alphabet="abcxyz09", min_size=6, max_size=6),
                       st.integers(-2**63, 2**63 - 1)), min_size=n, max_size=n, unique=True),
    st.lists(st.binary(min_size=5, max_size=5), min_size=n, max_size=n),
    st.lists(st.one_of(st.none(), st.floats(0, 4e9)), min_size=n, max_size=n)))


@given(st.one_of(fixed_pages, st.tuples(st.lists(keys, max_size=20, unique_by=repr),
                                        st.lists(values, max_size=20),
                                        st.lists(expires, max_size=20))), st.randoms())
def test_page_columns_agrees_with_split_page(cols, rnd):
    ks, vs, es = cols
    n = min(len(ks), len(vs), len(es))
    ks = list(dict.fromkeys(ks[:n], None))
    n = len(ks)
    slots = rnd.sample(range(64), n)
    page = [(slot, codec.encode_key(k), SAFE.encode(v), e)
            for slot, k, v, e in zip(slots, ks, vs[:n], es[:n])]
    data = encode_page(page)
    want_slots, want_exps, want_kbs, want_vbs = split_page(data)
    got_slots, got_exps, flags, got_keys, got_values = page_columns(data)
    assert list(got_slots) == list(want_slots) and got_exps == want_exps
    assert _as_encoded(flags, got_keys, got_values) == (want_kbs, want_vbs)


@pytest.mark.parametrize("ks", [[""], [b""], ["", "a"], ["ab", "cd"]])
def test_page_columns_with_empty_keys_and_values(ks):
    page = [(i, codec.encode_key(k), SAFE.encode(b""), None) for i, k in enumerate(ks)]
    data = encode_page(page)
    flags, got_keys, got_values = page_columns(data)[2:]
    assert _as_encoded(flags, got_keys, got_values) == tuple(split_page(data)[2:])


@pytest.mark.parametrize("cut", [1, 4, 10, 100])
@pytest.mark.parametrize("width", ["fixed", "varying"])
def test_a_cut_page_is_damage(cut, width):
    page = [(i, codec.encode_key(f"k{i:02d}" if width == "fixed" else f"k{i}"),
             SAFE.encode(b"v" * (20 if width == "fixed" else 20 + i)), None) for i in range(12)]
    data = encode_page(page)
    with pytest.raises(ValueError):
        list(decode_page(data[:-cut]))
    with pytest.raises(ValueError):
        page_columns(data[:-cut])
    with pytest.raises(ValueError):
        page_columns(data + b"x" * cut)


def _encode_v1(entries):
    out = []
    for slot, kb, vb, exp in entries:
        out.append(struct.pack("<HdII", slot, float("nan") if exp is None else exp,
                               len(kb), len(vb)))
        out += [kb, vb]
    return b"".join(out)


def make_version_1_store(d) -> None:
    """A closed cache as a schema-1 durablekv left it: version-1 page blobs."""
    with Cache(d, page_size=4, max_pages=2) as cache:
        for i in range(40):
            cache[f"k{i}"] = b"v%d" % i
            cache[i] = i
        cache[("tuple", 1)] = [1, 2]
        cache.set("ttl", "x", expire=3600)
    conn = sqlite3.connect(d / STORE)
    for pid, data in conn.execute("SELECT page_id, data FROM pages").fetchall():
        conn.execute("UPDATE pages SET data = ? WHERE page_id = ?",
                     (_encode_v1(list(decode_page(data))), pid))
    conn.execute("DROP INDEX pages_by_last_use")  # added by schema version 4, with:
    conn.execute("ALTER TABLE pages DROP COLUMN last_use")
    conn.execute("DELETE FROM meta WHERE name = 'data_bytes'")
    conn.execute("ALTER TABLE pages DROP COLUMN crc")  # added by schema version 3
    conn.execute("PRAGMA user_version = 1")
    conn.commit()
    v1_blobs = conn.execute("SELECT count(*) FROM pages WHERE substr(data, 1, 2) != x'ffff'"
                            ).fetchone()[0]
    conn.close()
    assert v1_blobs > 10


def schema_version(d) -> int:
    conn = sqlite3.connect(f"file:{d / STORE}?mode=ro", uri=True)
    try:
        return conn.execute("PRAGMA user_version").fetchone()[0]
    finally:
        conn.close()


def test_a_store_written_with_version_1_pages_opens_and_upgrades(tmp_path):
    """A schema-1 store (version-1 page blobs) opens, reads every entry and
    migrates to schema 2; pages written afterwards use version 2."""
    d = tmp_path / "c"
    make_version_1_store(d)
    with Cache(d, max_pages=2) as cache:
        assert [cache[f"k{i}"] for i in range(40)] == [b"v%d" % i for i in range(40)]
        assert [cache[i] for i in range(40)] == list(range(40))
        assert cache[("tuple", 1)] == [1, 2] and cache["ttl"] == "x"
        cache["k0"] = b"new"
    conn = sqlite3.connect(d / STORE)
    assert conn.execute("PRAGMA user_version").fetchone()[0] == LATEST
    page_of_k0 = conn.execute("SELECT data FROM pages WHERE page_id = "
                              "(SELECT page_id FROM keys WHERE key = ?)",
                              (codec.canonical_key("k0"),)).fetchone()[0]
    conn.close()
    assert page_of_k0[:2] == b"\xff\xff"
    with Cache(d) as cache:
        assert cache["k0"] == b"new" and cache["k39"] == b"v39"


def test_opening_a_version_1_store_says_it_upgrades_it(tmp_path, caplog):
    """The upgrade is one way (an older durablekv then refuses the store), so
    the open that does it says so; opens that upgrade nothing stay quiet."""
    d = tmp_path / "c"
    make_version_1_store(d)
    with caplog.at_level(logging.INFO, logger="durablekv"):
        with Cache(d) as cache:  # only reads
            assert cache["k3"] == b"v3"
    assert schema_version(d) == LATEST
    (upgrade,) = [r for r in caplog.records if "upgraded" in r.getMessage()]
    assert upgrade.levelno == logging.WARNING and upgrade.name == "durablekv.store"
    msg = upgrade.getMessage()
    assert str(d / STORE) in msg and f"schema version 1 to {LATEST}" in msg
    assert "0002_page_format_v2.sql" in msg and "can no longer open it" in msg
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="durablekv"):
        Cache(d).close()                    # already at the latest version
        Cache(tmp_path / "new").close()     # a new store is created at the latest version
    assert not [r for r in caplog.records if "upgraded" in r.getMessage()]
    assert schema_version(tmp_path / "new") == LATEST


def test_check_does_not_upgrade_a_version_1_store(tmp_path, capsys):
    d = tmp_path / "c"
    make_version_1_store(d)
    before = {p.name: p.read_bytes() for p in d.iterdir()}
    assert main(["check", str(d)]) == 0
    out = capsys.readouterr().out
    assert "schema version 1" in out and f"upgrades it to {LATEST}" in out and "healthy" in out
    assert {p.name: p.read_bytes() for p in d.iterdir()} == before  # nothing written or added
    assert schema_version(d) == 1


@pytest.mark.parametrize("make_key", [lambda i: f"k{i}", lambda i: i, lambda i: ("t", i)])
def test_a_garbled_version_2_page_is_reported_as_damage(tmp_path, make_key):
    d = tmp_path / "c"
    with Cache(d, page_size=4, max_pages=1) as cache:
        for i in range(8):
            cache[make_key(i)] = b"x" * 30
    conn = sqlite3.connect(d / STORE)
    pid, data = conn.execute("SELECT page_id, data FROM pages LIMIT 1").fetchone()
    conn.execute("UPDATE pages SET data = ? WHERE page_id = ?", (data[:-7], pid))
    reseal_pages(conn)  # past the checksum, to the blob's own checks
    conn.commit()
    conn.close()
    with Cache(d, max_pages=1) as cache:
        with pytest.raises(CorruptStoreError) as exc:
            for i in range(8):
                cache.get(make_key(i))
        assert f"page {pid} cannot be decoded" in str(exc.value)


def _page_of(entries, flags_or=0):
    """A version-2 blob of ``(slot, key, value)`` entries, with extra flag bits."""
    data = bytearray(encode_page([(slot, codec.encode_key(k), SAFE.encode(v), None)
                                  for slot, k, v in entries]))
    data[4] |= flags_or
    return bytes(data)


def _int_page_with_key_lengths(lens):
    """An INT_KEYS page whose key column has these lengths (summing to 8 each)."""
    page = bytearray(_page_of([(0, 1, b"a"), (1, 2, b"b")]))
    n, flags = struct.unpack_from("<HB", page, 2)
    assert flags & INT_KEYS and flags & NO_TTL and n == 2
    head = struct.Struct(f"<HHB{n}H{n}I{n}I")  # magic, n, flags, slots, key and value lengths
    cols = list(head.unpack_from(page))
    cols[3 + n:3 + 2 * n] = lens
    head.pack_into(page, 0, *cols)
    return bytes(page)


@pytest.mark.parametrize("case, blob, n, message", [
    ("slot twice", _page_of([(1, "a", b"A"), (1, "b", b"B")]), 2, "lists a slot twice"),
    ("slot past page_size", _page_of([(0, "a", b"A"), (9, "b", b"B")]), 2, "past page_size 4"),
    ("key twice", _page_of([(0, "a", b"A"), (1, "a", b"B")]), 2, "holds a key twice"),
    ("row count", _page_of([(0, "a", b"A"), (1, "b", b"B")]), 3, "row says 3 entries"),
    ("unknown flag", _page_of([(0, "a", b"A")], flags_or=0x40), 1, "not a valid combination"),
    ("ascii and int", _page_of([(0, 5, b"A")], flags_or=ASCII_KEYS), 1,
     "not a valid combination"),
    ("int keys not 8 bytes", _int_page_with_key_lengths([4, 12]), 2, "not 8 bytes"),
])
def test_a_page_that_decodes_but_cannot_be_right_is_damage(tmp_path, case, blob, n, message):
    """Damage that leaves a blob parseable (a repeated or out-of-range slot, a
    repeated key, a count that disagrees with the row, impossible flags,
    int keys of the wrong width) is reported, never served as wrong data."""
    d = tmp_path / "c"
    with Cache(d, page_size=4, max_pages=1) as cache:
        cache["a"] = b"A"
        cache["b"] = b"B"
    conn = sqlite3.connect(d / STORE)
    conn.execute("UPDATE pages SET data = ?, n_entries = ?", (blob, n))
    reseal_pages(conn)  # past the checksum, to the blob's own checks
    conn.commit()
    conn.close()
    with Cache(d, max_pages=1) as cache:
        with pytest.raises(CorruptStoreError) as exc:
            cache.get("a")
            cache.get(1)
        assert "cannot be decoded" in str(exc.value) and message in str(exc.value), case
    if case in ("slot twice", "slot past page_size", "row count"):
        (d / (STORE + ".damaged")).unlink()   # what check finds in the store itself
        out = check_directory(str(d)).lines
        assert any(line.startswith("DAMAGE") and message.replace("row says 3 entries",
                                                                "its row says 3") in line
                   for line in out), out


def test_value_blobs_that_only_look_like_bytes_round_trip():
    """RAW_BYTES drops the tag and length only when they are exactly the
    safe codec's; any other blob starting with b'b' is kept whole."""
    blobs = [b"bogus", b"b", b"b\x03\x00\x00\x00abc", b"b\x09\x00\x00\x00abc"]
    for vb in blobs:
        page = [(0, codec.encode_key("k"), vb, None)]
        assert list(decode_page(encode_page(page))) == page, vb


class _TextAsBytesLike(codec.ValueCodec):
    """A user codec whose blobs look exactly like the safe codec's bytes."""

    name = "text-b"

    def encode(self, value):
        b = value.encode()
        return b"b" + struct.pack("<I", len(b)) + b

    def decode(self, data):
        return data[5:].decode()


def test_a_custom_codec_gets_its_own_values_back_after_a_page_fault(tmp_path):
    d = tmp_path / "c"
    with Cache(d, serializer=_TextAsBytesLike(), page_size=2, max_pages=1) as cache:
        for i in range(6):
            cache[f"k{i}"] = f"v{i}"
    with Cache(d, serializer=_TextAsBytesLike(), max_pages=1) as cache:
        assert [cache[f"k{i}"] for i in range(6)] == [f"v{i}" for i in range(6)]
