"""durablekv as SGLang's HiCache storage: one contract suite run against
SGLang's own reference file backend and against ours, then what only ours
promises (restart, kill -9, damage found on read)."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

REQUIRE = os.environ.get("DURABLEKV_REQUIRE_SGLANG") == "1"
try:
    import torch
    import sglang.srt.mem_cache.hicache_storage  # noqa: F401
except ImportError as exc:      # CI's sglang step installs both; a user's clone may not
    if REQUIRE:
        raise
    pytest.skip(f"needs torch and SGLang ({exc}); .ci/sglang/run installs the CPU builds",
                allow_module_level=True)

from durablekv import ConfigError  # noqa: E402
from durablekv.llm.sglang import DurableKVHiCacheStorage  # noqa: E402

from .sglang_pages import PAGE_ELEMS, env_for_children, keys_and_pages, make_backend  # noqa: E402

WORKER = Path(__file__).with_name("sglang_worker.py")
KINDS = ["file", "durablekv"]


@pytest.fixture(params=KINDS)
def backend(request, tmp_path, monkeypatch):
    monkeypatch.delenv("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR", raising=False)
    b = make_backend(request.param, tmp_path / request.param)
    yield b
    if hasattr(b, "close"):
        b.close()


# -- the contract: both backends ---------------------------------------------------

def test_set_get_exists(backend):
    keys, pages = keys_and_pages(4)
    assert not backend.exists(keys[0])
    assert backend.set(keys[0], pages[0]) is True
    assert backend.exists(keys[0]) and not backend.exists(keys[1])
    target = torch.empty_like(pages[0])
    got = backend.get(keys[0], target)
    assert got is not None and torch.equal(got.view(torch.int16), pages[0].view(torch.int16))


def test_batch_set_get_and_longest_prefix(backend):
    keys, pages = keys_and_pages(6)
    assert backend.batch_set(keys[:3], pages[:3]) is True
    assert backend.batch_set(keys[4:5], pages[4:5]) is True       # a hole at 3
    assert backend.batch_exists(keys) == 3
    targets = [torch.empty_like(p) for p in pages[:4]]
    got = backend.batch_get(keys[:4], targets)
    assert [g is None for g in got] == [False, False, False, True]
    for g, p in zip(got[:3], pages[:3]):
        assert torch.equal(g.view(torch.int16), p.view(torch.int16))


def test_a_miss_is_none(backend):
    keys, pages = keys_and_pages(2)
    assert backend.get(keys[1], torch.empty_like(pages[1])) is None


def test_setting_a_stored_page_again_keeps_it(backend):
    keys, pages = keys_and_pages(1)
    assert backend.set(keys[0], pages[0]) and backend.set(keys[0], pages[0])
    target = torch.empty_like(pages[0])
    assert torch.equal(backend.get(keys[0], target).view(torch.int16),
                       pages[0].view(torch.int16))


# -- what only durablekv promises ----------------------------------------------------

@pytest.fixture
def ours(tmp_path):
    b = make_backend("durablekv", tmp_path / "kv")
    yield b
    b.close()


def test_a_target_of_another_size_is_a_miss_not_wrong_bytes(ours):
    keys, pages = keys_and_pages(1)
    ours.set(keys[0], pages[0])
    for wrong in (torch.empty(PAGE_ELEMS // 2, dtype=torch.bfloat16),
                  torch.empty(PAGE_ELEMS * 2, dtype=torch.bfloat16)):
        assert ours.get(keys[0], wrong) is None
    assert ours.get(keys[0], torch.empty_like(pages[0])) is not None     # still stored


def test_keys_carry_the_rank_and_the_pools_dtype_and_layout(tmp_path):
    keys, pages = keys_and_pages(1)
    a = make_backend("durablekv", tmp_path / "kv")
    a.register_mem_pool_host(SimpleNamespace(dtype=torch.bfloat16, layout="page_first"))
    a.set(keys[0], pages[0])
    assert a.exists(keys[0])
    a.register_mem_pool_host(SimpleNamespace(dtype=torch.float16, layout="page_first"))
    assert not a.exists(keys[0])                   # another dtype: another page
    a.register_mem_pool_host(SimpleNamespace(dtype=torch.bfloat16, layout="layer_first"))
    assert not a.exists(keys[0])                   # another layout too
    a.close()
    from .sglang_pages import storage_config
    b = DurableKVHiCacheStorage(storage_config({"durablekv_path": str(tmp_path / "kv")},
                                               tp_rank=1, tp_size=2), {})
    assert b.directory.endswith("Llama-3.1-8B-Instruct_tp1_2")    # a rank's own directory
    assert not b.exists(keys[0])
    b.close()


@pytest.mark.parametrize("page_bytes", [PAGE_ELEMS * 2, 4 << 20])    # a value; a file
def test_a_flipped_byte_is_a_miss_for_that_page_only(tmp_path, page_bytes):
    elems = page_bytes // 2
    b = make_backend("durablekv", tmp_path / "kv")
    keys, pages = keys_and_pages(3, elems=elems)
    assert b.batch_set(keys, pages)
    b.cache.flush()
    files = sorted((Path(b.directory) / "kvblocks").glob("*.kvb"))
    if files:                                      # big pages: files of their own
        victim = files[0]
        data = bytearray(victim.read_bytes())
        data[len(data) // 2] ^= 0x01
        victim.write_bytes(bytes(data))
    else:                                          # small pages: values in the Cache
        h = b._hash(keys[1])
        stored = bytearray(b.cache.get(h))
        stored[-5] ^= 0x01
        b.cache.set(h, bytes(stored))
    targets = [torch.empty_like(p) for p in pages]
    with pytest.warns(Warning, match="damaged"):
        got = b.batch_get(keys, targets)
    assert sum(g is None for g in got) == 1        # only the damaged page misses
    for g, p in zip(got, pages):
        if g is not None:
            assert torch.equal(g.view(torch.int16), p.view(torch.int16))
    assert b.get_stats()["corrupt"] == 1
    b.close()


def test_configuration_errors_name_the_fix(tmp_path):
    from .sglang_pages import storage_config
    with pytest.raises(ConfigError, match="durablekv_path"):
        DurableKVHiCacheStorage(storage_config({}), {})
    with pytest.raises(ConfigError, match="durablekv_sise_limit"):
        DurableKVHiCacheStorage(storage_config({"durablekv_path": str(tmp_path),
                                                "durablekv_sise_limit": 1}), {})
    with pytest.raises(ConfigError, match="interface_v1"):
        DurableKVHiCacheStorage(storage_config({"durablekv_path": str(tmp_path),
                                                "interface_v1": 1}), {})


def _worker(directory, what, n):
    return subprocess.Popen([sys.executable, str(WORKER), str(directory), what, str(n)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=env_for_children())


def _read_pages(directory, n):
    proc = _worker(directory, "get", n)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err.decode()[-2000:]
    return [line.split()[2] for line in out.decode().splitlines()]


def _expected(n):
    keys, pages = keys_and_pages(n)
    return [hashlib.sha256(p.view(torch.uint8).numpy()).hexdigest() for p in pages]


def test_pages_survive_a_restart(tmp_path):
    proc = _worker(tmp_path / "kv", "set", 8)
    out, err = proc.communicate(b"", timeout=120)         # stdin closed: exits cleanly
    assert proc.returncode == 0, err.decode()[-2000:]
    assert _read_pages(tmp_path / "kv", 8) == _expected(8)


@pytest.mark.parametrize("seed", [0, 1])
def test_acknowledged_pages_survive_sigkill(tmp_path, seed):
    import random
    n = 24
    stop_after = 4 + random.Random(seed).randrange(12)
    proc = _worker(tmp_path / "kv", "set", n)
    acked = 0
    try:
        while acked < stop_after:
            line = proc.stdout.readline()
            assert line, proc.stderr.read().decode()[-2000:]
            acked += 1
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    got = _read_pages(tmp_path / "kv", n)
    assert got[:acked] == _expected(n)[:acked]        # every acknowledged page, bit-exact
    assert all(g in ("miss", e) for g, e in zip(got[acked:], _expected(n)[acked:]))


def test_size_limit_evicts_the_least_recently_used_pages(tmp_path):
    page_bytes = 2 << 20                                    # files of their own
    b = make_backend("durablekv", tmp_path / "kv", durablekv_size_limit=5 * page_bytes + 4096)
    keys, pages = keys_and_pages(8, elems=page_bytes // 2)
    for k, p in zip(keys, pages):
        assert b.set(k, p)
    assert b.store.file_bytes <= 5 * page_bytes + 4096
    found = [b.get(k, torch.empty_like(p)) is not None for k, p in zip(keys, pages)]
    assert found == [False] * 3 + [True] * 5                # the oldest three went
    assert b.batch_exists(keys[3:]) == 5 and b.batch_exists(keys) == 0
    b.close()
