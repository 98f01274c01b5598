"""KVBlockStore: bit-exact blocks in a durablekv Cache; damaged blocks are never served."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pytest

from durablekv import Cache, ConfigError, DurableKVError
from durablekv.llm.hashing import block_hashes
from durablekv.llm.kvstore import (KVBlockCorruptError, KVBlockCorruptWarning, KVBlockStore,
                                   decode_block, encode_block)

HASHES = block_hashes(range(64), 8, "test")


@pytest.fixture
def cache(tmp_path):
    with Cache(tmp_path / "kv") as c:
        yield c


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64, ">f4", np.int8])
def test_roundtrip_bit_exact(cache, dtype):
    store = KVBlockStore(cache)
    kv = (np.random.default_rng(0).standard_normal((2, 2, 4, 3, 5)) * 100).astype(dtype)
    kv.flat[0] = -0.0 if kv.dtype.kind == "f" else 0
    store.put(HASHES[0], kv)
    got = store.get(HASHES[0])
    assert got.shape == kv.shape and got.dtype.newbyteorder("=") == kv.dtype.newbyteorder("=")
    assert np.array_equal(got, kv) and got.tobytes() == kv.astype(got.dtype).tobytes()
    assert store.get(HASHES[1]) is None
    assert (store.hits, store.misses, store.puts) == (1, 1, 1)


def test_survives_a_restart(tmp_path):
    kv = np.arange(2 * 3 * 4, dtype=np.float32).reshape(2, 3, 4)
    with Cache(tmp_path / "kv") as c:
        KVBlockStore(c).put(HASHES[0], kv)
    with Cache(tmp_path / "kv") as c:
        assert np.array_equal(KVBlockStore(c).get(HASHES[0]), kv)


def test_match_prefix_stops_at_first_missing(cache):
    store = KVBlockStore(cache)
    for h in HASHES[:3] + HASHES[4:6]:
        store.put(h, np.zeros(2))
    assert store.match_prefix(HASHES) == 3
    assert store.match_prefix(HASHES[4:]) == 2
    assert store.match_prefix([]) == 0
    assert HASHES[0] in store and HASHES[3] not in store


def damage(value: bytes, where: str) -> bytes:
    if where == "flip_payload":
        return value[:-3] + bytes([value[-3] ^ 0x10]) + value[-2:]
    if where == "flip_header":
        return value[:9] + bytes([value[9] ^ 1]) + value[10:]
    if where == "truncate":
        return value[:-1]
    if where == "extend":
        return value + b"\0"
    if where == "magic":
        return b"XXXX" + value[4:]
    if where == "version":
        return value[:4] + b"\x09" + value[5:]
    if where == "short":
        return value[:5]
    raise AssertionError(where)


@pytest.mark.parametrize("where", ["flip_payload", "flip_header", "truncate", "extend", "magic",
                                   "version", "short"])
def test_damaged_block_is_a_miss_with_a_warning(cache, where):
    store = KVBlockStore(cache)
    store.put(HASHES[0], np.ones((2, 4), dtype=np.float32))
    cache.set(HASHES[0], damage(cache.get(HASHES[0]), where))
    with pytest.warns(KVBlockCorruptWarning, match="is damaged"):
        assert store.get(HASHES[0]) is None
    assert store.corrupt == 1
    assert HASHES[0] not in cache            # deleted: recomputed and stored again later
    with pytest.raises(KVBlockCorruptError):
        decode_block(HASHES[0], damage(encode_block(HASHES[0], np.ones(3)), where))


def test_value_under_another_hash_is_damaged(cache):
    store = KVBlockStore(cache, on_corrupt="raise")
    cache.set(HASHES[1], encode_block(HASHES[0], np.ones(3)))
    with pytest.raises(KVBlockCorruptError, match="checksum mismatch") as info:
        store.get(HASHES[1])
    assert isinstance(info.value, DurableKVError) and isinstance(info.value, ValueError)
    assert info.value.block_hash == HASHES[1]
    assert HASHES[1] in cache                # raise mode leaves the evidence


def test_not_bytes_is_damaged(cache):
    store = KVBlockStore(cache)
    cache.set(HASHES[0], "a string")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert store.get(HASHES[0]) is None
    assert "not bytes" in str(caught[0].message)


def test_bad_arguments(cache):
    with pytest.raises(ConfigError, match="on_corrupt"):
        KVBlockStore(cache, on_corrupt="ignore")
    store = KVBlockStore(cache)
    with pytest.raises(TypeError, match="block hash is 32 bytes"):
        store.put(b"short", np.ones(2))
    with pytest.raises(TypeError, match="must be a numpy array"):
        store.put(HASHES[0], [1.0, 2.0])
    with pytest.raises(TypeError, match="must hold numbers"):
        store.put(HASHES[0], np.array(["a"], dtype=object))


@pytest.mark.parametrize("wrong", ["var/kv", Path("var/kv"), b"var/kv", {}, None, 3])
def test_a_path_or_other_non_cache_is_refused_at_construction(wrong):
    """KVBlockStore("var/kv") used to be accepted and failed at the first
    spill with AttributeError; it is a TypeError now, naming what to pass."""
    with pytest.raises(TypeError) as info:
        KVBlockStore(wrong)
    msg = str(info.value)
    assert "durablekv Cache" in msg and type(wrong).__name__ in msg
    if isinstance(wrong, (str, Path)):
        assert f"KVBlockStore(Cache({str(wrong)!r}))" in msg


def test_a_mapping_with_the_cache_api_is_accepted(cache):
    """Anything with the Cache's set/get/delete and `in` will do (the docstring
    promises that), such as a ShardedCache."""
    class Mini(dict):
        def set(self, key, value):
            self[key] = value

        def delete(self, key):
            return self.pop(key, None) is not None
    store = KVBlockStore(Mini())
    store.put(HASHES[0], np.ones(3))
    assert np.array_equal(store.get(HASHES[0]), np.ones(3))
