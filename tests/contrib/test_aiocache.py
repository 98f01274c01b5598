"""The aiocache backend: aiocache's API and decorators on durablekv, the loop's
thread kept free of disk waits, and a new process that finds what was cached."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest

pytest.importorskip("aiocache", reason="pip install '.[aiocache]'")

from aiocache import Cache, cached, multi_cached  # noqa: E402
from aiocache.serializers import PickleSerializer, StringSerializer  # noqa: E402

from durablekv import CacheLockedError, ConfigError  # noqa: E402
from durablekv.contrib import _shared  # noqa: E402
from durablekv.contrib.aiocache import DurableKVCache  # noqa: E402
from . import run_doc_example  # noqa: E402

WORKER = Path(__file__).with_name("aiocache_worker.py")


@pytest.fixture(autouse=True)
def close_shared():
    yield
    _shared.close_all()


def run(coro):
    return asyncio.run(coro)


def test_api_with_aiocaches_semantics(tmp_path):
    async def main():
        c = Cache(DurableKVCache, directory=str(tmp_path / "c"), namespace="ns:")
        assert await c.get("missing") is None and await c.get("missing", default=1) == 1
        assert await c.set("a", {"x": [1, 2]}) is True and await c.get("a") == {"x": [1, 2]}
        assert await c.add("b", "v") is True
        with pytest.raises(ValueError, match="already exists"):
            await c.add("b", "w")
        assert await c.multi_set([("m1", 1), ("m2", "two")]) is True
        assert await c.multi_get(["m1", "m2", "m3"]) == [1, "two", None]
        assert await c.exists("a") is True and await c.exists("zz") is False
        assert await c.delete("a") == 1 and await c.delete("a") == 0
        assert await c.increment("n", 2) == 2 and await c.increment("n", -5) == -3
        await c.set("i", 40)                       # JSON "40": stored as the int
        assert await c.increment("i", 2) == 42 and await c.get("i") == 42
        await c.set("s", "text")
        with pytest.raises(TypeError):
            await c.increment("s")
        assert await c.raw("get", "ns:b") == '"v"'  # the serialized form, in the Cache
        await c.set("other", 1, namespace="else:")
        assert await c.clear(namespace="ns:") is True
        assert await c.get("b") is None and await c.get("other", namespace="else:") == 1
        await c.clear()
        assert await c.get("other", namespace="else:") is None
        await c.close()
    run(main())


def test_serializers(tmp_path):
    async def main():
        c = Cache(DurableKVCache, directory=str(tmp_path / "c"), serializer=StringSerializer())
        await c.set("k", 1)
        assert await c.get("k") == "1"             # StringSerializer's rule, as in aiocache
        assert await c.increment("k") == 2 and await c.get("k") == "2"
        p = Cache(DurableKVCache, directory=str(tmp_path / "c"), serializer=PickleSerializer())
        await p.set("obj", {1, 2, 3})
        assert await p.get("obj") == {1, 2, 3}
    run(main())


def test_ttls_on_an_injected_clock(tmp_path):
    now = [1_900_000_000.0]

    async def main():
        c = Cache(DurableKVCache, directory=str(tmp_path / "c"), clock=lambda: now[0], ttl=100)
        await c.set("default", 1)                  # the instance's ttl
        await c.set("forever", 1, ttl=0)
        await c.set("short", 1, ttl=1.5)
        await c.set("counter", 1, ttl=10)
        assert await c.increment("counter") == 2   # keeps its TTL, as Redis's INCRBY
        await c.set("persist", 1, ttl=5)
        assert await c.expire("persist", 0) is True and await c.expire("nope", 5) is False
        await c.set("gone", 1, ttl=-1)
        assert await c.get("gone") is None
        now[0] += 2
        assert await c.get("short") is None and await c.get("counter") == 2
        now[0] += 9
        assert await c.get("counter") is None and await c.get("persist") == 1
        now[0] += 90
        assert await c.get("default") is None and await c.get("forever") == 1
    run(main())


def test_concurrent_increments_are_atomic(tmp_path):
    async def main():
        c = Cache(DurableKVCache, directory=str(tmp_path / "c"))
        results = await asyncio.gather(*(c.increment("n") for _ in range(200)))
        assert sorted(results) == list(range(1, 201)) and await c.get("n") == 200
    run(main())


def test_decorators_share_one_cache_per_directory(tmp_path):
    calls = []
    directory = str(tmp_path / "c")

    @cached(cache=DurableKVCache, directory=directory, serializer=PickleSerializer(), ttl=60)
    async def square(n):
        calls.append(n)
        return n * n

    @multi_cached("ids", cache=DurableKVCache, directory=directory, namespace="multi:")
    async def names(ids=None):
        calls.append(tuple(ids))
        return {i: f"name {i}" for i in ids}

    async def main():
        assert await square(4) == 16 and await square(4) == 16
        assert await names(ids=[1, 2]) == {1: "name 1", 2: "name 2"}
        assert await names(ids=[2, 3]) == {2: "name 2", 3: "name 3"}
        assert calls == [4, (1, 2), (3,)]
        assert square.cache._loc.cache is names.cache._loc.cache
    run(main())


def test_a_memory_hit_stays_on_the_loops_thread_and_a_fault_leaves_it(tmp_path):
    async def main():
        c = Cache(DurableKVCache, directory=str(tmp_path / "c"), page_size=1, max_pages=2)
        for i in range(8):
            await c.set(f"k{i}", i)
        aio = c._loc.aio()
        handed = []
        real = aio._run

        async def counting(fn, *args):
            handed.append(fn)
            return await real(fn, *args)

        aio._run = counting
        for _ in range(10):
            assert await c.get("k7") == 7              # resident: a memory hit
        assert handed == []                            # no hand-off to a worker thread
        aio._run = real
        await c.raw("flush")
        dkv = c._loc.cache
        loop_thread, ran_on = threading.get_ident(), []
        real_get = dkv.get

        def spy(*a):
            ran_on.append(threading.get_ident())
            return real_get(*a)

        dkv.get = spy
        try:
            assert await c.get("k0") == 0              # evicted long ago: a page fault
        finally:
            dkv.get = real_get
        assert ran_on and loop_thread not in ran_on    # it ran on a worker thread
    run(main())


def test_bad_arguments_are_named_when_the_cache_is_made(tmp_path):
    with pytest.raises(TypeError, match="page_size"):
        DurableKVCache(directory=str(tmp_path), page_sise=4)
    with pytest.raises(ConfigError, match="directory="):
        DurableKVCache()


def test_a_new_process_finds_what_was_cached_and_a_second_one_is_refused(tmp_path):
    def worker(*args):
        return subprocess.run([sys.executable, str(WORKER), str(tmp_path / "c"), *args],
                              capture_output=True, text=True, timeout=120)

    first = worker("set")
    assert first.returncode == 0 and first.stderr == "", first.stderr
    second = worker("get")
    assert second.returncode == 0, second.stderr
    assert json.loads(second.stdout) == {"user": {"name": "Ada"}, "hits": 42}

    async def hold():
        c = Cache(DurableKVCache, directory=str(tmp_path / "c"), namespace="w:")
        assert await c.get("hits") == 42
        third = worker("get")                       # this process owns the directory now
        assert third.returncode != 0 and f"{CacheLockedError.__name__}:" in third.stderr
    run(hold())


def test_the_docs_example_runs(tmp_path):
    proc = run_doc_example("aiocache.md", tmp_path, after="print('ok')")
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, "ok\n", ""), proc.stderr


def test_concurrent_first_calls_share_one_open(tmp_path, monkeypatch):
    """Calls arriving while the directory opens wait for that one open and go on
    together (as on a backend open already): aiocache's cached_stampede counts
    on both first gets missing."""
    from durablekv.contrib import aiocache as backend

    opens = []
    real = backend.open_shared

    def counting(*a, **k):
        opens.append(a[0])
        return real(*a, **k)

    monkeypatch.setattr(backend, "open_shared", counting)

    async def main():
        c = DurableKVCache(directory=str(tmp_path / "c"))
        first = await asyncio.gather(*(c.get("k") for _ in range(5)))
        assert first == [None] * 5 and len(opens) == 1
    run(main())
