"""Large KV blocks go to files of their own, written once; the Cache holds a
checked reference, and what a put acknowledged survives kill -9."""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

from durablekv import Cache, ConfigError
from durablekv.llm.hashing import block_hashes
from durablekv.llm.kvstore import KVBlockCorruptWarning, KVBlockStore

from .crash_model import run_then_kill

HASHES = block_hashes(range(64), 1, "files")
MIB = 1 << 20
WORKER = Path(__file__).with_name("kv_file_crash_worker.py")


def big(seed: int, nbytes: int = MIB) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(nbytes // 4).astype(np.float32).reshape(
        2, 2, -1, 8)


def files(directory: Path) -> list[str]:
    return sorted(p.name for p in (directory / "kvblocks").iterdir())


def test_large_block_goes_to_a_file_and_survives_a_reopen(tmp_path):
    kv = big(0)
    with Cache(tmp_path / "kv") as cache:
        store = KVBlockStore(cache)
        store.put(HASHES[0], kv)
        small = np.ones((2, 2, 4, 8), dtype=np.float32)
        store.put(HASHES[1], small)                       # below 1 MiB: in the Cache
        assert len(cache.get(HASHES[0])) == 25            # the reference, not the block
        assert len(cache.get(HASHES[1])) > small.nbytes
        assert files(tmp_path / "kv") == [HASHES[0].hex() + ".kvb"]
        assert os.path.getsize(tmp_path / "kv" / "kvblocks" / files(tmp_path / "kv")[0]) \
            < kv.nbytes + 64
        assert (store.file_puts, store.file_bytes > kv.nbytes) == (1, True)
    with Cache(tmp_path / "kv") as cache:
        store = KVBlockStore(cache)
        got = store.get(HASHES[0])
        assert got.dtype == kv.dtype and got.shape == kv.shape and got.tobytes() == kv.tobytes()
        assert np.array_equal(store.get(HASHES[1]), small)
        assert store.delete(HASHES[0]) and files(tmp_path / "kv") == []
        assert store.get(HASHES[0]) is None


@pytest.mark.parametrize("durability", ["fsync", "none"])
def test_every_durability(tmp_path, durability):
    with Cache(tmp_path / "kv", durability=durability) as cache:
        store = KVBlockStore(cache, file_block_bytes=1024)
        store.put(HASHES[0], big(1, 64 << 10))
        assert store.get(HASHES[0]).tobytes() == big(1, 64 << 10).tobytes()


def test_a_file_with_no_reference_is_deleted_at_open(tmp_path):
    """A crash between a file's rename and its reference leaves the file; a
    crash mid-write leaves a temporary. The next store deletes both."""
    with Cache(tmp_path / "kv") as cache:
        store = KVBlockStore(cache, file_block_bytes=1024)
        store.put(HASHES[0], big(0, 4096))
        blocks = tmp_path / "kv" / "kvblocks"
        (blocks / (HASHES[5].hex() + ".kvb")).write_bytes(b"orphan")
        (blocks / (HASHES[6].hex() + ".kvb.123.456.tmp")).write_bytes(b"half")
        (blocks / "README").write_text("not ours")
        store = KVBlockStore(cache, file_block_bytes=1024)
        assert files(tmp_path / "kv") == sorted([HASHES[0].hex() + ".kvb", "README"])
        assert store.get(HASHES[0]) is not None
        assert store.file_bytes == (blocks / (HASHES[0].hex() + ".kvb")).stat().st_size


@pytest.mark.parametrize("read", ["get", "get_into"])
@pytest.mark.parametrize("damage", ["missing", "truncated", "extended", "other version",
                                    "bit flip"])
def test_a_damaged_file_is_a_miss_never_data(tmp_path, damage, read):
    with Cache(tmp_path / "kv") as cache:
        store = KVBlockStore(cache, file_block_bytes=1024)
        kv = big(0, 8192)
        store.put(HASHES[0], kv)
        path = tmp_path / "kv" / "kvblocks" / (HASHES[0].hex() + ".kvb")
        if damage == "missing":
            path.unlink()
        elif damage == "truncated":
            path.write_bytes(path.read_bytes()[:-10])
        elif damage == "extended":
            path.write_bytes(path.read_bytes() + b"\0")
        elif damage == "other version":   # a valid block file, not the one referenced
            ref = cache.get(HASHES[0])
            store.put(HASHES[0], big(1, 8192))
            cache.set(HASHES[0], ref)
        else:
            data = bytearray(path.read_bytes())
            data[-100] ^= 1
            path.write_bytes(bytes(data))
        with pytest.warns(KVBlockCorruptWarning, match=HASHES[0].hex()[:16]):
            if read == "get":
                assert store.get(HASHES[0]) is None
            else:
                assert store.get_into(HASHES[0], np.empty_like(kv)) is False
        assert HASHES[0] not in cache and not path.exists()
        assert store.corrupt == 1
    with Cache(tmp_path / "kv") as cache:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert KVBlockStore(cache, file_block_bytes=1024).get(HASHES[0]) is None


def test_max_file_bytes_evicts_the_least_recently_used(tmp_path):
    with Cache(tmp_path / "kv") as cache:
        store = KVBlockStore(cache, file_block_bytes=1024, max_file_bytes=3 * 8300)
        for i in range(3):
            store.put(HASHES[i], big(i, 8192))
        assert store.get(HASHES[0]) is not None           # 0 is now the most recent
        store.put(HASHES[3], big(3, 8192))                # over the bound: 1 goes
        assert HASHES[1] not in cache and store.get(HASHES[1]) is None
        assert all(store.get(HASHES[i]) is not None for i in (0, 2, 3))
        assert len(files(tmp_path / "kv")) == 3 and store.file_bytes <= 3 * 8300
    with Cache(tmp_path / "kv") as cache:                 # the bound holds across a reopen
        store = KVBlockStore(cache, file_block_bytes=1024, max_file_bytes=3 * 8300)
        assert store.file_bytes <= 3 * 8300 and len(store._files) == 3


def test_a_small_block_replacing_a_large_one_removes_its_file(tmp_path):
    with Cache(tmp_path / "kv") as cache:
        store = KVBlockStore(cache, file_block_bytes=1024)
        store.put(HASHES[0], big(0, 4096))
        store.put(HASHES[0], np.zeros(4, dtype=np.float32))
        assert files(tmp_path / "kv") == [] and store.file_bytes == 0
        assert np.array_equal(store.get(HASHES[0]), np.zeros(4, dtype=np.float32))


def test_files_need_a_local_directory():
    class Mapping(dict):     # a cache with the mapping API and no directory
        def set(self, k, v):
            self[k] = v

        def delete(self, k):
            return self.pop(k, None) is not None

    store = KVBlockStore(Mapping())                       # "auto": every block in the cache
    store.put(HASHES[0], big(0))
    assert store.block_dir is None and store.get(HASHES[0]).nbytes == MIB
    with pytest.raises(ConfigError, match="block_dir="):
        KVBlockStore(Mapping(), file_block_bytes=1024)
    with pytest.raises(ConfigError, match="positive int"):
        KVBlockStore(Mapping(), file_block_bytes=0)


@pytest.mark.skipif(sys.platform == "win32", reason="SIGKILL")
@pytest.mark.parametrize("seed", [0, 1])
def test_acknowledged_block_files_survive_sigkill(tmp_path, seed):
    sys.path.insert(0, str(WORKER.parent))
    from kv_file_crash_worker import HASHES as WORKER_HASHES, block

    lines = run_then_kill(WORKER, tmp_path / "kv", 6, seed, 10)
    acked = {int(n) for _, n in lines}
    with Cache(tmp_path / "kv") as cache:
        store = KVBlockStore(cache, file_block_bytes=1 << 16, on_corrupt="raise")
        for i in acked:
            got = store.get(WORKER_HASHES[i])
            assert got is not None and got.tobytes() == block(i).tobytes(), i
        # no temporary or unreferenced file is left behind
        for name in files(tmp_path / "kv"):
            assert name.endswith(".kvb") and bytes.fromhex(name[:-4]) in cache


def test_block_files_need_xxhash_and_say_so(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "xxhash", None)
    with Cache(tmp_path / "kv") as cache:
        with pytest.raises(ConfigError, match=r"durablekv\[llm\].*file_block_bytes=None"):
            KVBlockStore(cache)
        store = KVBlockStore(cache, file_block_bytes=None)   # every block in the Cache
        store.put(HASHES[0], big(0))
        assert store.get(HASHES[0]).nbytes == MIB


@pytest.mark.parametrize("file_block_bytes", [1024, None])     # a block file; a value
def test_get_into_fills_the_callers_array(tmp_path, file_block_bytes):
    with Cache(tmp_path / "kv") as cache:
        store = KVBlockStore(cache, file_block_bytes=file_block_bytes)
        kv = big(0, 8192)
        store.put(HASHES[0], kv)
        out = np.empty_like(kv)
        assert store.get_into(HASHES[0], out) is True and out.tobytes() == kv.tobytes()
        assert store.get_into(HASHES[1], out) is False                  # a miss
        other = np.empty(kv.size, dtype=np.float32)                      # another shape
        assert store.get_into(HASHES[0], other) is False and HASHES[0] in cache
        assert store.get_into(HASHES[0], np.empty(kv.nbytes, dtype=np.uint8)) is False
        with pytest.raises(ValueError, match="C-contiguous"):
            store.get_into(HASHES[0], np.empty((8, 8), dtype=np.float32)[:, ::2])
        if file_block_bytes:                                             # damage: a miss
            path = tmp_path / "kv" / "kvblocks" / (HASHES[0].hex() + ".kvb")
            data = bytearray(path.read_bytes())
            data[-7] ^= 0x10
            path.write_bytes(bytes(data))
            with pytest.warns(KVBlockCorruptWarning):
                assert store.get_into(HASHES[0], out) is False
            assert HASHES[0] not in cache


def test_fsync_mode_syncs_the_file_and_its_directory_before_the_reference(tmp_path, monkeypatch):
    """docs: under durability="fsync" a block file, then its directory, are
    fsynced before the reference that names it is set."""
    events = []
    real_fsync = os.fsync

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    with Cache(tmp_path / "kv", durability="fsync") as cache:
        store = KVBlockStore(cache, file_block_bytes=1024)
        real_set = cache.set
        monkeypatch.setattr(cache, "set", lambda *a, **k: (events.append(("set", a[0])),
                                                            real_set(*a, **k))[1])
        monkeypatch.setattr(os, "fsync", fsync)
        store.put(HASHES[0], big(0, 8192))
        monkeypatch.undo()
    blocks = str(tmp_path / "kv" / "kvblocks")
    order = [e for e in events if e[0] == "set" or e[1].startswith(blocks)]
    assert order[0][0] == "fsync" and order[0][1].endswith(".tmp")      # the file
    assert order[1] == ("fsync", blocks)                                  # its directory
    assert order[2] == ("set", HASHES[0])                                 # then the reference
