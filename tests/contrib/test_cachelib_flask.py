"""The cachelib and Flask-Caching backends: cachelib's semantics, a real Flask
app through its test client, and a new process that finds the cached response."""

from __future__ import annotations

import datetime as dt
import subprocess
import sys
import threading
from pathlib import Path

import pytest

pytest.importorskip("cachelib", reason="pip install '.[flask]'")
pytest.importorskip("flask_caching", reason="pip install '.[flask]'")

from cachelib.serializers import JSONSerializer  # noqa: E402
from freezegun import freeze_time  # noqa: E402

from durablekv import CacheLockedError, ConfigError  # noqa: E402
from durablekv.contrib import _shared  # noqa: E402
from durablekv.contrib.cachelib import DurableKVCache  # noqa: E402
from . import run_doc_example  # noqa: E402

from . import flask_app  # noqa: E402

APP = Path(__file__).with_name("flask_app.py")


@pytest.fixture(autouse=True)
def close_shared():
    yield
    _shared.close_all()


def test_cachelib_semantics(tmp_path):
    c = DurableKVCache(str(tmp_path / "c"))
    assert c.set("a", {"x": [1, 2]}) is True and c.get("a") == {"x": [1, 2]}
    assert c.get("missing") is None and c.has("a") and not c.has("missing")
    assert c.add("a", 2) is False and c.add("b", 2) is True
    assert c.inc("n") == 1 and c.inc("n", 5) == 6 and c.dec("n", 10) == -4
    assert c.dec("m", 3) == -3
    c.set("t", True)
    assert c.get("t") is True
    c.set("bytes", b"\x00raw")
    assert c.get("bytes") == b"\x00raw"
    assert c.set_many({"k1": 1, "k2": "two"}) == ["k1", "k2"]
    assert c.get_many("k1", "k2", "k3") == [1, "two", None]
    assert c.get_dict("k1", "k2") == {"k1": 1, "k2": "two"}
    assert c.delete_many("k1", "nope") == ["k1", "nope"]
    assert c.delete("k2") is True and c.delete("k2") is False
    assert c.clear() is True and c.get("a") is None
    c.serializer = JSONSerializer()                 # injected per instance, as in cachelib
    c.set("j", {"a": 1})
    assert c.get("j") == {"a": 1} and c._cache.get("j") == b'{"a": 1}'


def test_timeouts(tmp_path):
    c = DurableKVCache(str(tmp_path / "c"), default_timeout=10)
    with freeze_time("2030-01-01") as clock:
        c.set("default", 1)
        c.set("never", 1, timeout=0)
        c.set("td", 1, timeout=dt.timedelta(seconds=20))
        c.set("gone", 1, timeout=-1)
        assert c.get("gone") is None and c.add("gone2", 1, timeout=-1) is True
        assert c.get("gone2") is None
        clock.tick(11)
        assert c.get("default") is None and c.get("td") == 1
        clock.tick(10)
        assert c.get("td") is None and c.get("never") == 1
        c.set("n", 1, timeout=5)
        assert c.inc("n") == 2                       # keeps its timeout
        clock.tick(6)
        assert c.get("n") is None


def test_inc_is_atomic_across_threads(tmp_path):
    c = DurableKVCache(str(tmp_path / "c"))

    def work():
        for _ in range(300):
            c.inc("n")

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert c.get("n") == 1200


def test_threshold_is_filesystemcaches_rule(tmp_path):
    c = DurableKVCache(str(tmp_path / "c"), threshold=10)
    for i in range(30):
        c.set(f"k{i}", i)
        assert len(c._cache) <= 11                 # pruned back to 10 before each store
    assert c.get("k29") == 29
    with freeze_time("2030-01-01") as clock:
        c.clear()
        for i in range(10):
            c.set(f"short{i}", i, timeout=1)
        c.set("long", 1, timeout=100)
        clock.tick(2)
        c.set("new", 1)                            # expired entries go first
        assert c.get("long") == 1 and c.get("new") == 1
    with pytest.raises(ConfigError, match="threshold"):
        DurableKVCache(str(tmp_path / "d"), threshold=-1)


def test_instances_on_one_directory_share_one_cache(tmp_path):
    a = DurableKVCache(str(tmp_path / "c"))
    b = DurableKVCache(str(tmp_path / "c"), threshold=3)
    a.set("k", 1)
    assert b.get("k") == 1 and a._cache is b._cache
    with pytest.raises(ConfigError, match="same options"):
        DurableKVCache(str(tmp_path / "c"), durability="none")
    proc = subprocess.run(
        [sys.executable, "-c", "import sys; from durablekv.contrib.cachelib import "
         "DurableKVCache; DurableKVCache(sys.argv[1])", str(tmp_path / "c")],
        capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and f"{CacheLockedError.__name__}:" in proc.stderr
    assert "its own cache directory" in proc.stderr


def test_flask_cached_view_and_memoize(tmp_path):
    app, cache = flask_app.make_app(str(tmp_path / "c"), CACHE_THRESHOLD=1000,
                                    CACHE_OPTIONS={"page_size": 4})
    backend = app.extensions["cache"][cache]
    assert backend._threshold == 1000 and backend.default_timeout == 60
    assert backend._cache.page_size == 4
    client = app.test_client()
    flask_app.CALLS.update(stamp=0, square=0)
    with freeze_time("2030-01-01") as clock:
        first = client.get("/stamp").get_data()
        assert client.get("/stamp").get_data() == first and flask_app.CALLS["stamp"] == 1
        with app.app_context():
            assert app.square(7) == 49 and app.square(7) == 49
            assert flask_app.CALLS["square"] == 1
            cache.delete_memoized(app.square, 7)
            assert app.square(7) == 49 and flask_app.CALLS["square"] == 2
        clock.tick(31)
        assert client.get("/stamp").get_data() != first and flask_app.CALLS["stamp"] == 2


def test_flask_needs_cache_dir():
    from flask import Flask
    from flask_caching import Cache

    app = Flask("x")
    app.config.update(CACHE_TYPE="durablekv.contrib.flask_caching.DurableKVCache")
    with pytest.raises(ConfigError, match="CACHE_DIR"):
        Cache(app)


def test_a_restarted_flask_app_serves_the_cached_response(tmp_path):
    runs = [subprocess.run([sys.executable, str(APP), str(tmp_path / "c")],
                           capture_output=True, text=True, timeout=120) for _ in range(2)]
    for r in runs:
        assert r.returncode == 0 and r.stderr == "", r.stderr
    assert runs[0].stdout.startswith("stamp ") and runs[1].stdout == runs[0].stdout


def test_the_docs_examples_run(tmp_path):
    for index in (0, 1):                        # Flask, then cachelib alone
        proc = run_doc_example("flask.md", tmp_path, index=index, after="print('ok')")
        assert (proc.returncode, proc.stdout, proc.stderr) == (0, "ok\n", ""), proc.stderr
