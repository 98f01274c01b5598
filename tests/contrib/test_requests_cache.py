"""The requests-cache backend: a real requests session against a loopback
origin that counts what it receives, and a new process that still hits."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("requests_cache", reason="pip install '.[requests-cache]'")

import requests  # noqa: E402
import requests_cache  # noqa: E402
from freezegun import freeze_time  # noqa: E402

from durablekv.contrib import _shared  # noqa: E402
from durablekv.contrib.requests_cache import DurableKVBackend, DurableKVDict  # noqa: E402
from . import run_doc_example  # noqa: E402

from .http_origin import Origin  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def origin():
    with Origin() as o:
        yield o


@pytest.fixture(autouse=True)
def close_shared():
    yield
    _shared.close_all()


def session(tmp_path, **kwargs):
    return requests_cache.CachedSession(backend=DurableKVBackend(tmp_path / "http"), **kwargs)


def test_second_request_is_served_from_the_cache(tmp_path, origin):
    s = session(tmp_path)
    first = s.get(origin.url("/plain"))
    second = s.get(origin.url("/plain"))
    assert (first.from_cache, second.from_cache) == (False, True)
    assert second.text == first.text and origin.hits["/plain"] == 1
    assert s.cache.responses.directory == tmp_path / "http" / "responses"
    assert len(s.cache.responses) == 1 and s.cache.contains(url=origin.url("/plain"))


def test_revalidation_sends_if_none_match(tmp_path, origin):
    s = session(tmp_path, cache_control=True)
    assert s.get(origin.url("/etag")).from_cache is False
    again = s.get(origin.url("/etag"))
    assert again.from_cache is True and again.text == "etag body"   # a 304 revalidated it
    assert origin.hits["/etag"] == 2 and origin.seen["/etag"][1]["If-None-Match"] == '"v1"'


def test_expiry_refetches_and_stale_if_error_serves_the_old_one(tmp_path, origin):
    with freeze_time("2030-01-01 00:00:00") as clock:
        s = session(tmp_path, expire_after=60, stale_if_error=True)
        first = s.get(origin.url("/flaky")).text
        clock.tick(30)
        assert s.get(origin.url("/flaky")).text == first and origin.hits["/flaky"] == 1
        clock.tick(31)
        refetched = s.get(origin.url("/flaky"))
        assert refetched.from_cache is False and refetched.text != first
        assert origin.hits["/flaky"] == 2
        clock.tick(61)
        origin.fail = True
        stale = s.get(origin.url("/flaky"))
        assert stale.status_code == 200 and stale.text == refetched.text   # the stale copy
        assert stale.from_cache is True and origin.hits["/flaky"] == 3
        # a response kept for an hour past its expiry (ttl_offset), then gone by itself
        clock.tick(3600)
        assert len(s.cache.responses) == 0


def test_filter_fn_and_serializers(tmp_path, origin):
    s = session(tmp_path, filter_fn=lambda r: "/json" not in r.url)
    s.get(origin.url("/json"))
    assert s.get(origin.url("/json")).from_cache is False and origin.hits["/json"] == 2
    j = requests_cache.CachedSession(backend=DurableKVBackend(tmp_path / "j", serializer="json"))
    j.get(origin.url("/json"))
    cached = j.get(origin.url("/json"))
    assert cached.from_cache is True and cached.json() == {"n": 3}
    stored = j.cache.responses.cache.get(next(iter(j.cache.responses)))
    assert isinstance(stored, str) and '"status_code": 200' in stored     # JSON text


def test_redirects_storage(tmp_path, origin):
    s = session(tmp_path)
    s.get(origin.url("/plain"))
    s.cache.redirects["alias"] = "target"
    assert s.cache.redirects["alias"] == "target"
    assert isinstance(s.cache.redirects, DurableKVDict) and s.cache.redirects.serializer is None


def test_install_cache(tmp_path, origin):
    requests_cache.install_cache(backend=DurableKVBackend(tmp_path / "http"))
    try:
        requests.get(origin.url("/plain"))
        assert requests.get(origin.url("/plain")).from_cache is True
    finally:
        requests_cache.uninstall_cache()
    assert origin.hits["/plain"] == 1


def test_a_new_process_still_hits(tmp_path, origin):
    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(REPO)!r})
        import requests_cache
        from durablekv.contrib.requests_cache import DurableKVBackend
        s = requests_cache.CachedSession(backend=DurableKVBackend({str(tmp_path / "http")!r}))
        r = s.get({origin.url("/plain")!r})
        print(r.from_cache, r.text)
    """)
    runs = [subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                           timeout=120) for _ in range(2)]
    for r in runs:
        assert r.returncode == 0 and r.stderr == "", r.stderr
    first, second = (r.stdout.split(" ", 1) for r in runs)
    assert first[0] == "False" and second[0] == "True" and second[1] == first[1]
    assert origin.hits["/plain"] == 1


def test_the_docs_example_runs(tmp_path, origin):
    proc = run_doc_example("requests-cache.md", tmp_path, after="print('ok')",
                           replace=("https://httpbin.org/get", origin.url("/json")))
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, "ok\n", ""), proc.stderr
    assert origin.hits["/json"] == 1
