"""The Django backend through a real Django: settings, ``caches``, views under
``cache_page`` and the per-site middleware through the test client, the async
API, and a second process that finds what the first wrote."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import pickle
import stat
import subprocess
import sys
import tempfile
import threading
import warnings
from pathlib import Path

import pytest

pytest.importorskip("django", reason="the Django backend needs Django: pip install '.[django]'")

from freezegun import freeze_time  # noqa: E402

from . import django_site  # noqa: E402

SESSION_DIR = tempfile.mkdtemp(prefix="durablekv-django-")
django_site.configure(os.path.join(SESSION_DIR, "default"))

from django.core.cache import CacheKeyWarning, cache, caches  # noqa: E402
from django.core.exceptions import ImproperlyConfigured  # noqa: E402
from django.test import Client, override_settings  # noqa: E402

from durablekv import CacheLockedError  # noqa: E402
from durablekv.contrib import django as backend  # noqa: E402
from . import run_doc_example  # noqa: E402

from . import django_urls  # noqa: E402

WORKER = Path(__file__).with_name("django_worker.py")


@pytest.fixture
def site(tmp_path):
    """Fresh locations for this test (the aliases are rebuilt by override_settings)."""
    with override_settings(CACHES=django_site.caches(str(tmp_path / "default"))):
        yield tmp_path
        backend.close_caches()


@pytest.fixture
def no_warnings():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        yield


def test_basic_api_with_django_semantics(site, no_warnings):
    assert cache.get("missing") is None and cache.get("missing", "dflt") == "dflt"
    cache.set("none", None)
    assert cache.get("none", "dflt") is None                 # a stored None is a value
    assert cache.add("a", 1) is True and cache.add("a", 2) is False and cache.get("a") == 1
    assert cache.incr("a") == 2 and cache.decr("a", 5) == -3
    assert cache.incr("big", 1) if cache.add("big", 10 ** 20) else False
    assert cache.get("big") == 10 ** 20 + 1
    with pytest.raises(ValueError, match="not found"):
        cache.incr("nope")
    cache.set("text", "abc")
    with pytest.raises(TypeError):
        cache.incr("text")
    assert cache.delete("a") is True and cache.delete("a") is False
    assert cache.touch("text", 10) is True and cache.touch("nope") is False
    assert cache.set_many({"x": 1, "y": [2]}) == [] and cache.set_many({}) == []
    assert cache.get_many(["x", "y", "zz"]) == {"x": 1, "y": [2]}
    assert cache.delete_many(["x", "y"]) is None and cache.get_many(["x", "y"]) == {}
    assert cache.has_key("text") and "text" in cache and not cache.has_key("x")
    assert cache.get_or_set("lazy", lambda: "computed") == "computed"
    assert cache.get_or_set("lazy", lambda: "again") == "computed"
    cache.set("v", "one", version=1)
    cache.set("v", "two", version=2)
    assert cache.get("v", version=1) == "one" and cache.get("v", version=2) == "two"
    assert cache.incr_version("v", version=2) == 3 and cache.get("v", version=3) == "two"
    cache.clear()
    assert cache.get("text") is None and cache.get("lazy") is None


def test_timeouts(site, no_warnings):
    cache.set("zero", 1, 0)                   # 0: not cached at all
    assert cache.get("zero") is None
    cache.set("old", 1)
    cache.set("old", 2, -1)                   # negative: deleted
    assert cache.get("old") is None
    assert cache.add("add0", 1, 0) is True and cache.get("add0") is None
    with freeze_time("2030-01-01 00:00:00") as clock:
        cache.set("default", 1)               # TIMEOUT 300
        cache.set("forever", 1, None)
        cache.set("float", 1, 10.5)
        cache.set("touched", 1, 5)
        assert cache.touch("touched", None) is True
        clock.tick(10)
        assert cache.get("float") == 1
        clock.tick(1)
        assert cache.get("float") is None and cache.get("touched") == 1
        clock.tick(300)
        assert cache.get("default") is None and cache.get("forever") == 1
        cache.set("gone", 1, 5)
        clock.tick(6)
        assert cache.add("gone", 2) is True and cache.get("gone") == 2   # over an expired key
        with pytest.raises(ValueError):
            cache.incr("float")               # expired: missing, Django's rule
        assert cache.touch("forever", 0) is True and cache.get("forever") is None


def test_ints_incr_atomically_across_threads(site):
    cache.set("n", 0)

    def work():
        for _ in range(200):
            caches["default"].incr("n")      # each thread has its own backend instance

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert cache.get("n") == 800


def test_values_are_pickled_and_pickle_errors_propagate(site):
    class Unpicklable:
        def __getstate__(self):
            raise pickle.PickleError("no")

    obj = {"when": [1, 2.5, "x"], "set": {1, 2}, "bytes": b"\x00\xff", "bool": True}
    cache.set("obj", obj)
    assert cache.get("obj") == obj and cache.get("obj") is not obj
    with pytest.raises(pickle.PickleError):
        cache.set("bad", Unpicklable())
    with pytest.raises(pickle.PickleError):
        cache.add("bad", Unpicklable())


def test_key_warnings_once_per_operation_after_the_key_function(site):
    key = "with space"
    for op, args in [("add", [key, 1]), ("get", [key]), ("set", [key, 1]), ("incr", [key]),
                     ("decr", [key]), ("touch", [key]), ("delete", [key]),
                     ("get_many", [[key, "b"]]), ("set_many", [{key: 1, "b": 2}]),
                     ("delete_many", [[key, "b"]]), ("has_key", [key])]:
        with warnings.catch_warnings(record=True) as got:
            warnings.simplefilter("always")
            getattr(cache, op)(*args)
        assert [w.category for w in got] == [CacheKeyWarning], (op, got)
        assert ":1:with space" in str(got[0].message)          # the made key (prefix:version:key)


def test_cull_is_djangos_rule(tmp_path):
    caches_setting = django_site.caches(str(tmp_path / "c"), OPTIONS={"MAX_ENTRIES": 30})
    caches_setting["zero"] = {"BACKEND": django_site.BACKEND, "LOCATION": str(tmp_path / "z"),
                              "OPTIONS": {"MAX_ENTRIES": 30, "CULL_FREQUENCY": 0}}
    with override_settings(CACHES=caches_setting):
        for name, left in (("default", 29), ("zero", 19)):
            c = caches[name]
            for i in range(1, 50):
                c.set(f"cull{i}", "value", 1000)
            assert sum(c.has_key(f"cull{i}") for i in range(1, 50)) == left, name
            assert "cull49" in c                         # the one just stored stays
        assert backend._location(str(tmp_path / "c"), {"warm": False}).options == {
            "warm": False}                               # MAX_ENTRIES never reached Cache
        backend.close_caches()


def test_two_aliases_on_two_directories_and_shared_locations(site):
    caches["default"].set("k", "default")
    caches["other"].set("k", "other")
    assert caches["default"].get("k") == "default" and caches["other"].get("k") == "other"
    # another alias (and another thread's instance) on the same LOCATION sees the writes
    setting = django_site.caches(str(site / "default"))
    setting["prefixed"] = {**setting["default"], "KEY_PREFIX": "p"}
    with override_settings(CACHES=setting):
        caches["prefixed"].set("k", "prefixed")
        seen = []
        t = threading.Thread(target=lambda: seen.append(caches["default"].get("k")))
        t.start()
        t.join()
        assert seen == ["default"] and caches["prefixed"].get("k") == "prefixed"
        assert caches["default"]._cache is caches["prefixed"]._cache


def test_close_keeps_the_backend_usable(site):
    cache.set("k", 1)
    cache.close()                              # Django calls this after every request
    assert cache.get("k") == 1
    cache.set("k", 2)
    assert cache.get("k") == 2


def test_a_deleted_location_is_met_quietly(site, caplog):
    import shutil

    cache.set("k", 1)
    with caplog.at_level(logging.DEBUG, logger="durablekv"):
        shutil.rmtree(site / "default")
        assert cache.get("k") is None          # a new, empty cache in a new directory
        cache.set("k", 2)
        assert cache.get("k") == 2 and (site / "default").is_dir()
        backend.close_caches()
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []


def test_directories_are_private(tmp_path):
    location = tmp_path / "nested" / "deeper" / "cache"
    with override_settings(CACHES=django_site.caches(str(location))):
        cache.set("k", 1)
        for d in (location, location.parent, location.parent.parent):
            assert stat.S_IMODE(d.stat().st_mode) == 0o700, d
        backend.close_caches()


def test_options_reach_the_cache_and_bad_ones_are_named(tmp_path):
    opts = {"page_size": 4, "max_pages": 8, "durability": "fsync", "MAX_ENTRIES": 5}
    with override_settings(CACHES=django_site.caches(str(tmp_path / "a"), OPTIONS=opts)):
        cache.set("k", 1)
        dkv = cache._cache
        assert (dkv.page_size, dkv.durability) == (4, "fsync") and cache._max_entries == 5
        backend.close_caches()
    with override_settings(CACHES=django_site.caches(str(tmp_path / "b"),
                                                     OPTIONS={"page_sise": 4})):
        with pytest.raises(ImproperlyConfigured, match="page_size"):
            cache.get("k")
    setting = django_site.caches(str(tmp_path / "c"))
    setting["fast"] = {**setting["default"], "OPTIONS": {"durability": "none"}}
    with override_settings(CACHES=setting):
        caches["default"].set("k", 1)
        with pytest.raises(ImproperlyConfigured, match="different durablekv OPTIONS"):
            caches["fast"].get("k")
        backend.close_caches()


@override_settings(MIDDLEWARE=[])          # cache_page alone
def test_cache_page_and_vary_through_the_test_client(site):
    client = Client()
    django_urls.CALLS.update(page=0, vary=0)
    with freeze_time("2030-01-01 00:00:00") as clock:
        assert client.get("/page/").content == b"page 1"
        assert client.get("/page/").content == b"page 1"          # a hit: the view did not run
        assert django_urls.CALLS["page"] == 1
        a = client.get("/vary/", HTTP_X_TENANT="a").content
        b = client.get("/vary/", HTTP_X_TENANT="b").content
        assert (a, b) == (b"a 1", b"b 2")                         # Vary: one entry per tenant
        assert client.get("/vary/", HTTP_X_TENANT="a").content == b"a 1"
        clock.tick(31)                                             # cache_page(30) expired
        assert client.get("/page/").content == b"page 2"


def test_per_site_middleware_through_the_test_client(site):
    client = Client()
    django_urls.CALLS["site"] = 0
    with freeze_time("2030-01-01 00:00:00") as clock:
        first = client.get("/site/")
        assert first.content == b"site 1" and "max-age=60" in first["Cache-Control"]
        assert client.get("/site/").content == b"site 1"
        clock.tick(61)
        assert client.get("/site/").content == b"site 2"
    assert django_urls.CALLS["site"] == 2


def test_async_api(site):
    async def main():
        await cache.aset("a", {"x": 1})
        assert await cache.aget("a") == {"x": 1}
        assert await cache.aget("missing", "dflt") == "dflt"
        assert await cache.aadd("a", 2) is False
        assert await cache.aget_or_set("b", lambda: 7) == 7
        assert await cache.aincr("b", 3) == 10
        assert await cache.ahas_key("b") is True
        await cache.aset_many({"c": 1, "d": 2})
        assert await cache.aget_many(["c", "d"]) == {"c": 1, "d": 2}
        assert await cache.adelete("c") is True
        assert await cache.atouch("d", 0) is True and await cache.aget("d") is None
        await cache.aset("zero", 1, 0)
        assert await cache.aget("zero") is None
        results = await asyncio.gather(*(cache.aincr("b") for _ in range(20)))
        assert sorted(results) == list(range(11, 31))
        await cache.aclear()
        assert await cache.aget("a") is None

    asyncio.run(main())


def run_worker(location, *args):
    env = dict(os.environ)
    return subprocess.run([sys.executable, str(WORKER), str(location), *args],
                          capture_output=True, text=True, timeout=120, env=env)


@pytest.mark.parametrize("how", ["exit", "kill"])
def test_a_second_process_finds_what_the_first_wrote(tmp_path, how):
    location = tmp_path / "shared"
    first = run_worker(location, "set", *(["kill"] if how == "kill" else []))
    assert first.returncode == (-9 if how == "kill" else 0), first.stderr
    assert first.stderr == "" or how == "kill", first.stderr
    second = run_worker(location, "get")
    assert second.returncode == 0, second.stderr
    assert json.loads(second.stdout) == {"greeting": {"text": "hello", "n": [1, 2]},
                                         "hits": 42, "short": "missing"}


def test_a_location_held_by_another_process_says_what_to_do(site):
    cache.set("k", 1)                                  # this process owns the directory
    proc = run_worker(site / "default", "get")
    assert proc.returncode != 0
    assert f"{CacheLockedError.__name__}:" in proc.stderr
    assert "one worker process per LOCATION" in proc.stderr


def test_the_docs_example_runs(tmp_path):
    """docs/django.md's first example, as a user would paste it, in a new process."""
    proc = run_doc_example("django.md", tmp_path, after="print('ok', cache.get('hits'))")
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, "ok 42\n", ""), proc.stderr


def test_a_warning_about_a_live_location_is_still_said(site, caplog, monkeypatch):
    """The filter holds a warning that names a shared directory for a moment
    (it may be being deleted) and then says it, if the directory is still there."""
    import time

    from durablekv.contrib import _shared

    monkeypatch.setattr(_shared, "RECHECK_SECONDS", 0.01)
    cache.set("k", 1)
    where = str(site / "default")
    with caplog.at_level(logging.WARNING, logger="durablekv"):
        logging.getLogger("durablekv.batcher").warning("flush of %s failed: disk full", where)
        deadline = time.monotonic() + 10
        while not caplog.records and time.monotonic() < deadline:
            time.sleep(0.05)
    assert [r.getMessage() for r in caplog.records] == [f"flush of {where} failed: disk full"]
