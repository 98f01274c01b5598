"""Key and value encoding: exact types, canonical keys, safe by default.

Unit tests of :mod:`durablekv.codec` (hypothesis round trips; canonical key
bytes equal exactly when the keys are ``==``), then the same promises through a
Cache: values come back with exactly their types from memory, after a spill to
SQLite and after a restart; what you stored or got back can be mutated
without changing the cache; unsupported values are refused at ``set`` time
with nothing logged; ``serializer="pickle"`` is opt-in and fixed per store;
``max_value_bytes`` is checked before anything is written.
"""

from __future__ import annotations

import enum
import math
import pickle
import tempfile
from collections import OrderedDict

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from durablekv import Cache
from durablekv import codec
from durablekv.errors import ConfigError


def same(a, b) -> bool:
    """Equal AND of exactly the same types, all the way down (1 != 1.0 != True)."""
    if type(a) is not type(b):
        return False
    if type(a) is float:
        return (math.isnan(a) and math.isnan(b)) or (a == b and math.copysign(1, a) == math.copysign(1, b))
    if type(a) in (tuple, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if type(a) is dict:
        if len(a) != len(b):
            return False
        return all(same(ka, kb) and same(va, vb)
                   for (ka, va), (kb, vb) in zip(a.items(), b.items()))
    return a == b


SCALAR_KEYS = st.one_of(
    st.none(), st.booleans(),
    st.integers(), st.integers(min_value=-(2**200), max_value=2**200),
    st.sampled_from([2**63 - 1, 2**63, -(2**63), -(2**63) - 1, 2**53, 2**53 + 1]),
    st.floats(allow_nan=False),
    st.sampled_from([0.0, -0.0, 1.0, float(2**53), float(2**63), 1e300, 0.5]),
    st.text(max_size=8), st.binary(max_size=8),
    st.sampled_from(["\U0001F439", "\u00e9", "e\u0301", "\ud800", "", "1", "x"]),
)
KEYS = st.recursive(SCALAR_KEYS, lambda inner: st.lists(inner, max_size=3).map(tuple),
                    max_leaves=8)
SCALAR_VALUES = st.one_of(SCALAR_KEYS, st.floats())  # NaN allowed as a value
VALUES = st.recursive(
    SCALAR_VALUES,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.lists(inner, max_size=4).map(tuple),
        st.dictionaries(KEYS, inner, max_size=4),
    ),
    max_leaves=12,
)


# -- the codec module ----------------------------------------------------------------


@given(VALUES)
@settings(max_examples=300, deadline=None)
def test_safe_codec_round_trips_values_exactly(value):
    c = codec.SafeCodec()
    blob = c.encode(value)
    assert same(c.decode(blob), value)
    assert same(c.from_memory(c.memory_form(value, blob)), value)
    assert same(c.from_memory(c.memory_form_from_blob(blob)), value)


@given(KEYS)
@settings(max_examples=300, deadline=None)
def test_keys_round_trip_exactly(key):
    assert same(codec.decode_key(codec.encode_key(key)), key)
    assert codec.decode_key(codec.canonical_key(key)) == key


@given(KEYS, KEYS)
@settings(max_examples=500, deadline=None)
def test_canonical_key_equal_exactly_when_keys_equal(a, b):
    assert (codec.canonical_key(a) == codec.canonical_key(b)) == (a == b)


EQUAL_PAIRS = [(1, 1.0), (1, True), (0, False), (0, -0.0), (0.0, -0.0), ((1, "a"), (1.0, "a")),
               ((True, (0,)), (1, (False,))), (2**63, float(2**63)), (10**20, 1e20),
               (-(2**70), -float(2**70))]
UNEQUAL_PAIRS = [("1", 1), (b"x", "x"), ("\u00e9", "e\u0301"), (2**53 + 1, float(2**53)),
                 ((1,), 1), ((), None), (0.5, 0), (b"", ""), (2**63, 2**63 - 1)]


@pytest.mark.parametrize("a,b", EQUAL_PAIRS, ids=repr)
def test_equal_keys_share_canonical_bytes(a, b):
    assert a == b
    assert codec.canonical_key(a) == codec.canonical_key(b)
    assert codec.encode_key(a) != codec.encode_key(b) or type(a) is type(b)


@pytest.mark.parametrize("a,b", UNEQUAL_PAIRS, ids=repr)
def test_unequal_keys_have_distinct_canonical_bytes(a, b):
    assert a != b
    assert codec.canonical_key(a) != codec.canonical_key(b)


def test_equal_tuples_with_different_pickles_share_canonical_bytes():
    s = "".join(["x"] * 100)
    t1 = (s, s)
    t2 = ("".join(["x"] * 100), "".join(["x"] * 100))
    assert t1 == t2 and pickle.dumps(t1) != pickle.dumps(t2)
    assert codec.canonical_key(t1) == codec.canonical_key(t2)
    assert codec.encode_key(t1) == codec.encode_key(t2)


@pytest.mark.parametrize("n", [2**63 - 1, 2**63, -(2**63), -(2**63) - 1, 2**64, -(2**64),
                               10**100, -(10**100), 10**5000, -(10**5000) + 7, 2**100_000],
                         ids=lambda n: f"{'-' if n < 0 else ''}{abs(n).bit_length()}bits")
def test_big_ints_round_trip_as_values_and_keys(n):
    c = codec.SafeCodec()
    assert same(c.decode(c.encode(n)), n)
    assert same(codec.decode_key(codec.encode_key(n)), n)
    assert same(codec.decode_key(codec.encode_key((n, "x"))), (n, "x"))


def test_float_keys_that_are_integers_canonicalise_to_int_and_nan_is_refused():
    assert codec.canonical_key(1e300) == codec.canonical_key(int(1e300))
    assert codec.canonical_key(float("inf")) != codec.canonical_key(float("-inf"))
    for bad in (float("nan"), (1, float("nan")), ((float("nan"),),)):
        with pytest.raises(ValueError, match="NaN"):
            codec.encode_key(bad)
        with pytest.raises(ValueError):
            codec.canonical_key(bad)


@pytest.mark.parametrize("bad", [[1], {"a": 1}, {1}, frozenset(), object(), bytearray(b"x"),
                                 OrderedDict(), (1, [1])],
                         ids=lambda v: type(v).__name__)
def test_unsupported_keys_are_typeerrors_naming_the_type(bad):
    name = type(bad[1] if type(bad) is tuple else bad).__qualname__
    with pytest.raises(TypeError, match=name):
        codec.encode_key(bad)


class Color(enum.IntEnum):
    RED = 1


class Text(str):
    pass


@pytest.mark.parametrize("bad", [object(), {1, 2}, frozenset([1]), bytearray(b"x"), Color.RED,
                                 Text("t"), lambda: 1, [1, object()], {"a": {1}},
                                 OrderedDict(a=1), 1j, range(3)],
                         ids=lambda v: type(v).__name__)
def test_unsupported_values_are_typeerrors_naming_the_type(bad):
    with pytest.raises(TypeError) as info:
        codec.SafeCodec().encode(bad)
    inner = bad
    if type(bad) is list:
        inner = bad[1]
    elif type(bad) is dict:
        inner = bad["a"]
    assert type(inner).__qualname__ in str(info.value)
    assert "pickle" in str(info.value)


def test_mutable_values_are_held_encoded_and_immutable_ones_shared():
    c = codec.SafeCodec()
    lst = [1, [2]]
    held = c.memory_form(lst, c.encode(lst))
    assert type(held) is codec.Frozen
    out = c.from_memory(held)
    assert out == lst and out is not lst
    t = (1, "a", (2.0, None))
    assert c.memory_form(t, c.encode(t)) is t
    assert type(c.memory_form((1, [2]), c.encode((1, [2])))) is codec.Frozen


def test_codec_by_name():
    assert codec.codec_by_name("safe").name == "safe"
    assert codec.codec_by_name("json").name == "safe"
    assert codec.codec_by_name("pickle").name == "pickle"
    with pytest.raises(ConfigError, match="'yaml'"):
        codec.codec_by_name("yaml")


@pytest.mark.parametrize("blob", [b"", b"q\x01", b"d", b"t\x02\x00\x00\x00", b"s\xff\xff\xff\xff",
                                  b"s\x05\x00\x00\x00ab", b"m\x01\x00\x00\x00N",
                                  b"m\x01\x00\x00\x00l\x00\x00\x00\x00N", b"I\x05\x00\x00\x00ab",
                                  b"Z", b"s\x01\x00\x00\x00\xff"], ids=repr)
def test_damaged_blobs_are_valueerrors(blob):
    with pytest.raises(ValueError):
        codec.SafeCodec().decode(blob)
    with pytest.raises(ValueError):
        codec.decode_key(blob)


@given(st.binary(max_size=40))
@settings(max_examples=300, deadline=None)
def test_random_bytes_decode_or_raise_valueerror(blob):
    try:
        codec.SafeCodec().decode(blob)
    except ValueError:
        pass


def test_damaged_blob_is_a_valueerror_not_a_wrong_value():
    c = codec.SafeCodec()
    blob = c.encode(("a", 1))
    with pytest.raises(ValueError):
        c.decode(blob + b"N")
    with pytest.raises(ValueError):
        c.decode(b"Z")


# -- values through a Cache ------------------------------------------------------------

ROUND_TRIP_VALUES = [
    None, True, False, 0, 1, -1, 1.0, -0.0, 0.1, float("inf"), 2**63, -(2**63) - 1, 10**40,
    10**5000, "", "text", "\U0001F439", "\ud800x", "e\u0301", b"", b"\x00\xff",
    (), (1,), (1, "a"), (1.0, (2, [3])), [], [1, 2.0, "3"], [[1], (2,)], {}, {"a": 1},
    {1: "int", 1.5: "float", "s": [1, {"n": None}], (1, 2): (3, 4), b"b": b"b", None: True},
    {"big": list(range(200))},
]


def spill(c: Cache) -> None:
    """Push every page of a ``page_size=1, max_pages=1`` cache out to SQLite."""
    c.set("__spill__", 0)
    c.delete("__spill__")
    c.flush()


@pytest.mark.parametrize("where", ["memory", "spill", "restart"])
def test_values_come_back_with_exact_types(tmp_path, where):
    kw = dict(page_size=1, max_pages=1) if where == "spill" else {}
    c = Cache(tmp_path / "c", flush_interval=30, **kw)
    try:
        for i, v in enumerate(ROUND_TRIP_VALUES):
            c[i] = v
        if where == "spill":
            spill(c)
        elif where == "restart":
            c.close()
            # warm=False: the values are decoded by page faults, counted below
            c = Cache(tmp_path / "c", flush_interval=30, warm=False)
        store_hits = c.stats().store_hits
        for i, v in enumerate(ROUND_TRIP_VALUES):
            got = c[i]
            assert same(got, v), (i, v, got)
        if where == "spill":    # one entry per page, each read back from SQLite
            assert c.stats().store_hits - store_hits == len(ROUND_TRIP_VALUES)
        elif where == "restart":  # 16 entries per page: one fault per page
            assert c.stats().store_hits - store_hits == 2
        assert same(sorted(c.items())[1][1], ROUND_TRIP_VALUES[1])
    finally:
        c.close()


@given(VALUES)
@settings(max_examples=40, deadline=None)
def test_any_supported_value_round_trips_through_restart(value):
    with tempfile.TemporaryDirectory() as d:
        with Cache(d, flush_interval=30) as c:
            c["v"] = value
            assert same(c["v"], value)
        with Cache(d) as c:
            assert same(c["v"], value)


@pytest.mark.parametrize("where", ["memory", "spill"])
def test_mutating_stored_or_returned_values_does_not_change_the_cache(tmp_path, where):
    kw = dict(page_size=1, max_pages=1) if where == "spill" else {}
    with Cache(tmp_path / "c", flush_interval=30, **kw) as c:
        lst = [1, [2, 3]]
        dct = {"a": [1]}
        tup = (1, [2])
        c["l"], c["d"], c["t"] = lst, dct, tup
        lst.append(4)
        lst[1].append(5)
        dct["b"] = 2
        dct["a"].append(9)
        tup[1].append(3)
        if where == "spill":
            spill(c)
        got = c["l"]
        assert got == [1, [2, 3]]
        got.append("x")
        got[1].clear()
        g2 = c["d"]
        g2["z"] = 0
        c["t"][1].append(7)
        assert c["l"] == [1, [2, 3]]
        assert c["d"] == {"a": [1]}
        assert c["t"] == (1, [2])
        assert c.pop("l") == [1, [2, 3]]


@pytest.mark.parametrize("bad", [object(), lambda: 1, {1, 2}, [object()], Color.RED],
                         ids=["object", "lambda", "set", "list-of-object", "IntEnum"])
def test_unsupported_value_is_refused_at_set_time_with_nothing_logged(tmp_path, bad):
    with Cache(tmp_path / "c", flush_interval=30) as c:
        c["k"] = "old"
        before = c.stats()
        for op in (lambda: c.set("k", bad), lambda: c.__setitem__("new", bad),
                   lambda: c.set("t", bad, expire=5), lambda: c.update({"u": bad}),
                   lambda: c.setdefault("s", bad)):
            with pytest.raises(TypeError) as info:
                op()
            inner = bad[0] if type(bad) is list else bad
            assert type(inner).__qualname__ in str(info.value)
        after = c.stats()
        assert len(c) == 1 and c["k"] == "old" and "new" not in c
        assert after.sets == before.sets
        assert after.last_lsn == before.last_lsn
        assert after.log_bytes == before.log_bytes
        assert after.dirty_pages == before.dirty_pages
    with Cache(tmp_path / "c") as c:
        assert dict(c.items()) == {"k": "old"}


class Point:
    """A picklable class (module level)."""

    def __init__(self, x, y):
        self.x, self.y = x, y

    def __eq__(self, other):
        return type(other) is Point and (self.x, self.y) == (other.x, other.y)


def test_pickle_serializer_is_opt_in_and_fixed_per_store(tmp_path):
    d = tmp_path / "p"
    values = {"pt": Point(1, 2), "set": {1, 2}, "od": OrderedDict(a=1), "c": 1j,
              "nested": [Point(0, 0), {"s": frozenset([3])}]}
    with Cache(d, serializer="pickle", flush_interval=30) as c:
        c.update(values)
        got = c["pt"]
        assert got == Point(1, 2) and got is not values["pt"]
        got.x = 99
        assert c["pt"] == Point(1, 2)
        with pytest.raises(TypeError):
            c["bad"] = lambda: 1     # not picklable
        assert "bad" not in c
    with pytest.raises(ConfigError, match="pickle"):
        Cache(d)
    with pytest.raises(ConfigError):
        Cache(d, serializer="safe")
    with Cache(d, serializer="pickle") as c:
        assert dict(c.items()) == values
        assert type(c["od"]) is OrderedDict and type(c["set"]) is set
    with Cache(tmp_path / "s") as c:
        c["a"] = 1
    with pytest.raises(ConfigError, match="safe"):
        Cache(tmp_path / "s", serializer="pickle")
    with Cache(tmp_path / "s", serializer="json") as c:   # the alias of "safe"
        assert c["a"] == 1


def test_max_value_bytes_counts_the_value_not_the_framing(tmp_path):
    with Cache(tmp_path / "c", max_value_bytes=100, flush_interval=30) as c:
        c["b"] = b"x" * 100
        c["s"] = "\u00e9" * 50          # 100 bytes of UTF-8
        before = c.stats()
        for big in (b"x" * 101, "\u00e9" * 51, [b"x" * 100], list(range(100))):
            with pytest.raises(ValueError, match="max_value_bytes"):
                c["big"] = big
        after = c.stats()
        assert (after.sets, after.last_lsn, after.log_bytes) == \
            (before.sets, before.last_lsn, before.log_bytes)
        assert len(c) == 2 and "big" not in c
    with Cache(tmp_path / "c") as c:
        assert c["b"] == b"x" * 100 and c["s"] == "\u00e9" * 50
