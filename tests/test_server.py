"""``durablekv serve`` against a real server process: routes, errors, auth,
limits, metrics, stats, the OpenAPI description, and the clients.

One server (with a token) serves the whole module; a few tests start their
own for options that differ (no token, access log, short timeouts).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import os
import socket
import stat
import subprocess
import sys
from urllib.parse import quote, urlsplit

import pytest

from tests.server_util import REPO, running_server

import httpx  # noqa: E402 (server_util skips the module without it)

from durablekv.client import AsyncClient, Client  # noqa: E402
from durablekv.errors import (RemoteAuthError, RemoteError, RemoteTypeError,  # noqa: E402
                              RemoteValueError, ServerUnavailableError)
from durablekv.stats import CacheStats  # noqa: E402

TOKEN = "s3cret-token_1"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
MAX_VALUE = 4096


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    base = tmp_path_factory.mktemp("srv")
    token_file = base / "token"
    token_file.write_text(f"  {TOKEN}\n\n")  # whitespace around it is stripped
    with running_server(base / "cache", "--token-file", str(token_file),
                        "--max-value-bytes", str(MAX_VALUE), "--max-key-chars", "64") as srv:
        yield srv


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=30) as c:
        yield c


@pytest.fixture
def key(request):
    return "t-" + request.node.name


def error_of(resp: httpx.Response) -> dict:
    assert resp.headers["content-type"].startswith("application/json"), resp.headers
    body = resp.json()
    assert set(body) == {"error", "detail"}, body
    assert "Traceback" not in body["detail"]
    return body


# -- routes ---------------------------------------------------------------------------

def test_json_and_bytes_round_trip(http, key):
    r = http.put(f"/v1/keys/{key}", json={"name": "Ada", "n": [1, 2.5, None, True]})
    assert r.status_code == 204
    r = http.get(f"/v1/keys/{key}")
    assert r.status_code == 200
    assert r.headers["content-type"] == "application/json"
    assert r.json() == {"name": "Ada", "n": [1, 2.5, None, True]}
    raw = bytes(range(256))
    r = http.put(f"/v1/keys/{key}", content=raw, headers={"content-type": "image/png"})
    assert r.status_code == 204
    r = http.get(f"/v1/keys/{key}")
    assert r.headers["content-type"] == "application/octet-stream"
    assert r.content == raw
    # a JSON string and the same bytes stay distinct
    http.put(f"/v1/keys/{key}", json="abc")
    assert http.get(f"/v1/keys/{key}").json() == "abc"


def test_head_delete_and_missing(http, key):
    assert http.head(f"/v1/keys/{key}").status_code == 404
    assert http.delete(f"/v1/keys/{key}").status_code == 404
    assert error_of(http.get(f"/v1/keys/{key}"))["error"] == "not found"
    http.put(f"/v1/keys/{key}", content=b"x")
    assert http.head(f"/v1/keys/{key}").status_code == 200
    assert http.delete(f"/v1/keys/{key}").status_code == 204
    assert http.get(f"/v1/keys/{key}").status_code == 404


def test_keys_are_percent_encoded_utf8_and_may_hold_slashes(http):
    for k in ("a/b", "sp ace", "ünï/cödé", "new\nline", "%2F", "?q=1#h"):
        r = http.put("/v1/keys/" + quote(k, safe=""), json=k)
        assert r.status_code == 204, (k, r.text)
        assert http.get("/v1/keys/" + quote(k, safe="")).json() == k


def test_incr(http, key):
    r = http.post(f"/v1/keys/{key}/incr", params={"delta": 5})
    assert (r.status_code, r.json()) == (200, 5)
    assert http.post(f"/v1/keys/{key}/incr").json() == 6
    assert http.post(f"/v1/keys/{key}/incr", params={"delta": -10}).json() == -4
    http.put(f"/v1/keys/{key}", json="text")
    r = http.post(f"/v1/keys/{key}/incr")
    assert r.status_code == 409 and error_of(r)["error"] == "not an int"
    assert http.get(f"/v1/keys/{key}").json() == "text"  # unchanged
    assert http.post(f"/v1/keys/{key}/incr", params={"delta": "x"}).status_code == 422


def test_incr_takes_ints_of_any_size(http, key):
    """JSON carries any int, and Cache.incr adds any two: so does the route."""
    r = http.post(f"/v1/keys/{key}/incr", params={"delta": 10 ** 20})
    assert (r.status_code, r.json(), r.text) == (200, 10 ** 20, str(10 ** 20))
    assert http.post(f"/v1/keys/{key}/incr", params={"delta": -(10 ** 30)}).json() == \
        10 ** 20 - 10 ** 30
    assert http.get(f"/v1/keys/{key}").json() == 10 ** 20 - 10 ** 30
    r = http.post(f"/v1/keys/{key}/incr", params={"delta": "1" * 5000})   # past int() limits
    assert r.status_code == 422 and error_of(r)


def test_touch(http, key):
    http.put(f"/v1/keys/{key}", json="v", params={"ttl": 3600})
    assert http.post(f"/v1/keys/{key}/touch", params={"ttl": 60}).status_code == 204
    assert http.post(f"/v1/keys/{key}/touch").status_code == 204          # no expiry now
    assert http.get(f"/v1/keys/{key}").json() == "v"
    assert http.post(f"/v1/keys/{key}/touch", params={"ttl": 0}).status_code == 204
    r = http.post(f"/v1/keys/{key}/touch")
    assert r.status_code == 404 and error_of(r)["error"] == "not found"   # ttl=0 removed it
    for bad in (-1, "x", "inf"):
        r = http.post(f"/v1/keys/{key}/touch", params={"ttl": bad})
        assert r.status_code == 422 and error_of(r), bad
    r = http.get(f"/v1/keys/{key}/touch")
    assert r.status_code == 405 and r.headers["allow"] == "POST"


def test_touch_moves_the_ttl(tmp_path):
    """In-process, on the cache's injected clock: touch gives a live entry a
    new TTL, or none."""
    from durablekv import Cache
    from durablekv.server.app import create_app

    now = [1_900_000_000.0]
    cache = Cache(tmp_path / "c", clock=lambda: now[0])

    async def main():
        transport = httpx.ASGITransport(app=create_app(cache))
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            await c.put("/v1/keys/a", json=1, params={"ttl": 10})
            await c.put("/v1/keys/b", json=2, params={"ttl": 10})
            assert (await c.post("/v1/keys/a/touch", params={"ttl": 100})).status_code == 204
            assert (await c.post("/v1/keys/b/touch")).status_code == 204
            now[0] += 50
            assert (await c.get("/v1/keys/a")).json() == 1
            assert (await c.get("/v1/keys/b")).json() == 2
            now[0] += 51
            assert (await c.get("/v1/keys/a")).status_code == 404
            assert (await c.get("/v1/keys/b")).json() == 2

    try:
        asyncio.run(main())
    finally:
        cache.close()


def test_if_none_match_is_add(http, key):
    h = {"If-None-Match": "*"}
    assert http.put(f"/v1/keys/{key}", json=1, headers=h).status_code == 204
    r = http.put(f"/v1/keys/{key}", json=2, headers=h)
    assert r.status_code == 412 and error_of(r)["error"] == "key exists"
    assert http.get(f"/v1/keys/{key}").json() == 1
    assert http.put(f"/v1/keys/{key}", json=3, headers={"If-None-Match": '"etag"'}
                    ).status_code == 400


def test_ttl(http, key):
    assert http.put(f"/v1/keys/{key}", json=1, params={"ttl": "3600"}).status_code == 204
    assert http.get(f"/v1/keys/{key}").json() == 1
    # ttl=0: stored already expired, i.e. gone (as Cache.set(expire=0))
    assert http.put(f"/v1/keys/{key}", json=1, params={"ttl": "0"}).status_code == 204
    assert http.get(f"/v1/keys/{key}").status_code == 404


@pytest.mark.parametrize("ttl", ["-1", "nan", "NaN", "inf", "-inf", "1e300", "abc", ""])
def test_bad_ttl_is_4xx_json_and_changes_nothing(http, key, ttl):
    http.put(f"/v1/keys/{key}", json="before")
    r = http.put(f"/v1/keys/{key}", json="after", params={"ttl": ttl})
    assert r.status_code == 422, (ttl, r.text)
    error_of(r)
    assert http.get(f"/v1/keys/{key}").json() == "before"


def test_batch(http, key):
    r = http.post("/v1/batch", json={"ops": [
        {"op": "set", "key": key, "value": {"a": 1}},
        {"op": "set", "key": key + "b", "base64": "AAE=", "ttl": 60},
        {"op": "get", "key": key}, {"op": "get", "key": key + "b"},
        {"op": "get", "key": key + "none"}, {"op": "delete", "key": key},
        {"op": "delete", "key": key}]})
    assert r.status_code == 200
    st = [x["status"] for x in r.json()["results"]]
    assert st == [204, 204, 200, 200, 404, 204, 404]
    assert r.json()["results"][2]["value"] == {"a": 1}
    assert r.json()["results"][3]["base64"] == "AAE="
    assert http.get(f"/v1/keys/{key}b").content == b"\x00\x01"
    bad = [({"ops": [{"op": "nope", "key": "k"}]}, 422), ({"ops": "x"}, 422),
           ({"ops": [{"op": "set", "key": "", "value": 1}]}, 422),
           ({"ops": [{"op": "set", "key": "k", "ttl": -1}]}, 422)]
    for body, status in bad:
        assert http.post("/v1/batch", json=body).status_code == status, body
    r = http.post("/v1/batch", content=b"{}", headers={"content-type": "text/plain"})
    assert r.status_code == 415 and error_of(r)



def test_a_batch_set_needs_value_or_base64(http, key):
    """A set that names neither is refused as one that names both is; an
    explicit "value": null stores None (JSON null), as a PUT of null does."""
    r = http.post("/v1/batch", json={"ops": [
        {"op": "set", "key": key},
        {"op": "set", "key": key + "n", "value": None},
        {"op": "set", "key": key + "b", "value": None, "base64": "AAE="},
        {"op": "set", "key": key + "v", "value": 1, "base64": None},
        {"op": "get", "key": key}]})
    assert r.status_code == 200
    res = r.json()["results"]
    assert [x["status"] for x in res] == [400, 204, 400, 204, 404], res
    assert res[0]["error"].startswith("bad set: ")
    assert '"value"' in res[0]["error"] and '"base64"' in res[0]["error"]
    assert "null" in res[0]["error"]                  # how to store None on purpose
    assert "not both" in res[2]["error"]
    assert http.get(f"/v1/keys/{key}").status_code == 404  # nothing stored
    got = http.get(f"/v1/keys/{key}n")
    assert (got.status_code, got.headers["content-type"], got.json()) == \
        (200, "application/json", None)
    assert http.get(f"/v1/keys/{key}b").status_code == 404
    assert http.get(f"/v1/keys/{key}v").json() == 1


def test_a_put_of_an_empty_json_body_says_what_to_send(http, key):
    """The PUT route's form of a missing value: Content-Type: application/json
    and no body. A 400 that says so and how to store None; a body-less PUT
    without a JSON Content-Type stores empty bytes, as documented."""
    http.put(f"/v1/keys/{key}", json="before")
    for body in (b"", b"  \n"):
        r = http.put(f"/v1/keys/{key}", content=body,
                     headers={"content-type": "application/json"})
        assert r.status_code == 400
        detail = error_of(r)["detail"]
        assert "the body is empty" in detail and "null" in detail, detail
    assert http.get(f"/v1/keys/{key}").json() == "before"
    assert http.put(f"/v1/keys/{key}", content=b"null",
                    headers={"content-type": "application/json"}).status_code == 204
    assert http.get(f"/v1/keys/{key}").json() is None
    assert http.put(f"/v1/keys/{key}").status_code == 204
    got = http.get(f"/v1/keys/{key}")
    assert (got.headers["content-type"], got.content) == ("application/octet-stream", b"")


def test_malformed_batch_json_gets_the_batch_routes_advice(http):
    """Any Content-Type but JSON is a 415 on /v1/batch, so its 400 must not
    suggest one (the PUT route's advice)."""
    for body in (b"{", b"", b"[NaN]"):
        r = http.post("/v1/batch", content=body, headers={"content-type": "application/json"})
        assert r.status_code == 400
        detail = error_of(r)["detail"]
        assert "another Content-Type" not in detail and "as they are" not in detail, detail
        assert '{"ops": [' in detail and "Content-Type: application/json" in detail, detail


def test_types_json_lacks_come_back_as_json_has_them(tmp_path):
    """What docs/server.md says of values over JSON: the library keeps a tuple
    a tuple and an int dict key an int; over HTTP they are an array and a
    string key."""
    from durablekv import Cache
    with Cache(tmp_path / "c") as cache:
        cache["t"] = (1, (2.0, "x"))
        cache["d"] = {1: "a", None: (3,)}
    with Cache(tmp_path / "c") as cache:
        assert cache["t"] == (1, (2.0, "x")) and type(cache["t"]) is tuple
    with running_server(tmp_path / "c") as srv, Client(srv.url) as kv:
        assert kv["t"] == [1, [2.0, "x"]] and type(kv["t"][1][0]) is float
        assert kv["d"] == {"1": "a", "null": [3]}

def test_healthz_needs_no_token_and_metrics_does(server, http):
    assert httpx.get(server.url + "/healthz").status_code == 200
    assert httpx.get(server.url + "/metrics").status_code == 401
    http.get("/v1/keys/metrics-probe")
    text = http.get("/metrics").text
    assert 'durablekv_hits_total{cache="cache",tier="memory"}' in text
    assert ('durablekv_http_requests_total{method="GET",route="/v1/keys/{key}",'
            'status="404"}') in text
    assert 'durablekv_http_request_duration_seconds_count{method="GET",route="/v1/keys/{key}"}' \
        in text


def _gauges(text: str) -> dict[str, float]:
    """``{sample name with labels: value}`` from Prometheus text."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def test_metrics_report_no_byte_bounds_by_default(http):
    g = _gauges(http.get("/metrics").text)
    assert g['durablekv_max_memory_bytes{cache="cache"}'] == float("inf")
    assert g['durablekv_size_limit_bytes{cache="cache"}'] == float("inf")


def test_byte_limits_reach_the_cache(tmp_path):
    """--max-memory-bytes and --size-limit (with units, as replay takes them)
    bound the served cache: /metrics reports both bounds, and writes past the
    memory bound evict pages from memory while every key stays readable."""
    with running_server(tmp_path / "c", "--max-memory-bytes", "64KiB",
                        "--size-limit", "1MiB", "--policy", "tinylfu") as srv, \
            httpx.Client(base_url=srv.url, timeout=30) as h:
        g = _gauges(h.get("/metrics").text)
        assert g['durablekv_max_memory_bytes{cache="c"}'] == 64 << 10
        assert g['durablekv_size_limit_bytes{cache="c"}'] == 1 << 20
        value = bytes(1000)
        for i in range(200):  # about 200 KB of values: three times the memory bound
            assert h.put(f"/v1/keys/k{i}", content=value).status_code == 204
        g = _gauges(h.get("/metrics").text)
        assert 0 < g['durablekv_memory_bytes{cache="c"}'] <= 64 << 10
        assert g['durablekv_evictions_total{cache="c",tier="memory"}'] > 0
        for i in range(200):
            assert h.get(f"/v1/keys/k{i}").content == value


# -- stats ---------------------------------------------------------------------------

STATS_FIELDS = [f.name for f in dataclasses.fields(CacheStats)]
#: What only requests change (the batcher's flushes, sizes and the age of the
#: oldest unflushed write move on their own between two reads).
REQUEST_COUNTERS = ("hits", "memory_hits", "store_hits", "misses", "sets", "deletes",
                    "evictions", "page_faults", "last_lsn")


def _strict_json(resp: httpx.Response):
    def refuse(name):
        raise AssertionError(f"{name} in a JSON answer")
    return json.loads(resp.content, parse_constant=refuse)


def test_stats_count_what_was_done(http, key):
    before = http.get("/v1/stats")
    assert before.status_code == 200
    assert before.headers["content-type"] == "application/json"
    before = _strict_json(before)
    assert list(before) == STATS_FIELDS  # every CacheStats field, in its order
    n_sets, n_hits, n_misses = 7, 5, 3
    for i in range(n_sets):
        assert http.put(f"/v1/keys/{key}-{i}", json=i).status_code == 204
    for i in range(n_hits):
        assert http.get(f"/v1/keys/{key}-{i}").json() == i
    for i in range(n_misses):
        assert http.get(f"/v1/keys/{key}-absent-{i}").status_code == 404
    assert http.delete(f"/v1/keys/{key}-0").status_code == 204
    after = _strict_json(http.get("/v1/stats"))
    delta = {k: after[k] - before[k] for k in REQUEST_COUNTERS}
    assert delta["sets"] == n_sets
    assert delta["hits"] == n_hits
    assert delta["misses"] == n_misses
    assert delta["deletes"] == 1
    assert delta["last_lsn"] == n_sets + 1  # one logged change per set and delete
    assert after["hits"] == after["memory_hits"] + after["store_hits"]
    # the served cache's settings and bounds (no byte bounds: null, not inf)
    assert (after["page_size"], after["policy"]) == (16, "lru")
    assert after["max_memory_bytes"] is None and after["size_limit"] is None
    assert after["resident_pages"] >= 1 and after["log_bytes"] > 0


def test_stats_needs_the_token(server):
    url = server.url + "/v1/stats"
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}):
        r = httpx.get(url, headers=headers)
        assert r.status_code == 401, headers
        assert r.headers["www-authenticate"] == "Bearer"
        assert error_of(r)["error"] == "unauthorized"
        assert "hits" not in r.text
    assert httpx.get(url, headers=AUTH).status_code == 200


def test_stats_of_a_fresh_server_start_at_zero(tmp_path):
    with running_server(tmp_path / "c", "--policy", "tinylfu") as srv, \
            Client(srv.url) as kv:
        s = kv.stats()
        assert (s.hits, s.misses, s.sets, s.deletes, s.last_lsn) == (0, 0, 0, 0, 0)
        assert s.policy == "tinylfu"
        for i in range(4):
            kv.set(f"k{i}", i)
        assert [kv.get(f"k{i}", None) for i in range(6)] == [0, 1, 2, 3, None, None]
        s = kv.stats()
        assert (s.sets, s.hits, s.misses, s.hit_ratio) == (4, 4, 2, 4 / 6)


def test_client_stats_is_the_servers_cache_stats(server, http, key):
    http.put(f"/v1/keys/{key}", json=1)
    http.get(f"/v1/keys/{key}")
    with Client(server.url, token=TOKEN) as kv:
        raw = _strict_json(http.get("/v1/stats"))
        s = kv.stats()
    assert type(s) is CacheStats
    assert {k: getattr(s, k) for k in REQUEST_COUNTERS} == {k: raw[k] for k in REQUEST_COUNTERS}
    assert s.sets >= 1 and s.hits >= 1
    assert (s.page_size, s.policy, s.max_pages) == (raw["page_size"], raw["policy"],
                                                    raw["max_pages"])

    async def main():
        async with AsyncClient(server.url, token=TOKEN) as akv:
            raw = _strict_json(http.get("/v1/stats"))
            return raw, await akv.stats()
    raw, s = asyncio.run(main())
    assert type(s) is CacheStats
    assert {k: getattr(s, k) for k in REQUEST_COUNTERS} == {k: raw[k] for k in REQUEST_COUNTERS}
    with Client(server.url) as anon, pytest.raises(RemoteAuthError):
        anon.stats()


def _stats_client(body: bytes, status: int = 200) -> Client:
    def answer(request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/v1/stats"
        return httpx.Response(status, content=body, headers={"content-type": "application/json"})
    return Client("http://stats.invalid", transport=httpx.MockTransport(answer))


def test_client_stats_ignores_new_fields_and_names_missing_ones():
    full = dataclasses.asdict(CacheStats(hits=3, misses=1, sets=2, policy="tinylfu",
                                         size_limit=1 << 20, recovery_seconds=0.25))
    with _stats_client(json.dumps({**full, "from_a_newer_server": [1]}).encode()) as kv:
        assert kv.stats() == CacheStats(**full)
    short = {k: v for k, v in full.items() if k not in ("hits", "warmed_pages")}
    with _stats_client(json.dumps(short).encode()) as kv, pytest.raises(RemoteError) as ei:
        kv.stats()
    assert ei.value.error == "incomplete stats"
    assert "hits, warmed_pages" in str(ei.value) and "upgrade the server" in str(ei.value)
    for bad in ({**full, "hits": "3"}, {**full, "sets": True}, {**full, "hits": None},
                {**full, "policy": 1}, {**full, "recovery_seconds": "0.1"}):
        with _stats_client(json.dumps(bad).encode()) as kv, pytest.raises(RemoteError) as ei:
            kv.stats()
        assert ei.value.error == "bad stats" and "wrong type" in str(ei.value)
    for body in (b"[1, 2]", b"<html>"):
        with _stats_client(body) as kv, pytest.raises(RemoteError, match="bad stats"):
            kv.stats()
    with _stats_client(b'{"error": "unauthorized", "detail": "d"}', 401) as kv, \
            pytest.raises(RemoteAuthError):
        kv.stats()


def test_stats_that_are_not_finite_are_null_and_come_back_nan():
    """JSON has no inf or NaN: the server sends a float that is not finite
    as null (the schema says number | null); the client makes it NaN."""
    from durablekv.server.app import CacheStatsBody, _stats_body
    body = _stats_body(CacheStats(recovery_seconds=float("inf"),
                                  oldest_unflushed_seconds=float("nan"), hits=2))
    decoded = json.loads(body, parse_constant=lambda name: pytest.fail(name))
    assert decoded["recovery_seconds"] is None and decoded["oldest_unflushed_seconds"] is None
    assert decoded["hits"] == 2
    CacheStatsBody.model_validate(decoded)  # the answer fits its own schema
    with _stats_client(body) as kv:
        s = kv.stats()
    assert math.isnan(s.recovery_seconds) and math.isnan(s.oldest_unflushed_seconds)
    assert s.hits == 2


def test_a_backend_without_stats_has_no_stats_route():
    """The benchmark's dict backend has no stats(): no /v1/stats route (404)
    rather than a 500."""
    from durablekv.server.app import create_app

    class Bare:
        async def get(self, key, default=None):
            return default
    paths = {getattr(r, "path", None) for r in create_app(Bare()).routes}
    assert "/v1/stats" not in paths and "/metrics" in paths


# -- bad input: a clear JSON 4xx, nothing changed ------------------------------------

def test_auth(server, key):
    url = f"{server.url}/v1/keys/{key}"
    with httpx.Client() as c:
        c.put(url, json="kept", headers=AUTH)
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN},
                        {"Authorization": f"bearer {TOKEN}x"}, {"Authorization": "Basic eA=="}):
            for method in ("GET", "PUT", "DELETE", "HEAD"):
                r = c.request(method, url, headers=headers, content=b"changed")
                assert r.status_code == 401, (headers, method)
                assert r.headers["www-authenticate"] == "Bearer"
                if method != "HEAD":
                    assert error_of(r)["error"] == "unauthorized"
        assert c.get(server.url + "/nope").status_code == 401  # no route map for strangers
        assert c.get(url, headers=AUTH).json() == "kept"


def test_unknown_routes_and_methods(http):
    r = http.get("/v2/whatever")
    assert r.status_code == 404 and error_of(r)["error"] == "no such route"
    r = http.patch("/v1/keys/k", content=b"x")
    assert r.status_code == 405 and error_of(r)
    assert r.headers["allow"] == "DELETE, GET, HEAD, PUT"
    r = http.get("/v1/keys/k/incr")
    assert r.status_code == 405 and r.headers["allow"] == "POST"
    assert http.get("/v1/batch").status_code == 405


def test_malformed_json_and_empty_or_long_key(http, key):
    http.put(f"/v1/keys/{key}", json="before")
    for body in (b"{", b"NaN", b"[Infinity]", b"\xff\xfe\x00", b"1" * 5000, b"[" * 5000):
        r = http.put(f"/v1/keys/{key}", content=body, headers={"content-type": "application/json"})
        assert r.status_code in (400, 413), (body[:10], r.status_code)
        error_of(r)
    assert http.get(f"/v1/keys/{key}").json() == "before"
    r = http.put("/v1/keys/", json=1)
    assert r.status_code == 400 and error_of(r)["error"] == "empty key"
    r = http.put("/v1/keys/" + "k" * 65, json=1)
    assert r.status_code == 414 and error_of(r)["error"] == "key too long"
    assert http.get("/v1/keys/" + "k" * 65).status_code == 414
    assert http.put("/v1/keys/" + "k" * 64, json=1).status_code == 204


def _raw_request(url: str, head: bytes, body_parts: list[bytes] = ()) -> bytes:
    u = urlsplit(url)
    with socket.create_connection((u.hostname, u.port), timeout=30) as s:
        s.sendall(head)
        for part in body_parts:
            try:
                s.sendall(part)
            except (BrokenPipeError, ConnectionResetError):
                break
        s.shutdown(socket.SHUT_WR) if not body_parts else None
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
        return data


def test_value_over_the_limit_is_413_before_the_body_is_read(server, http, key):
    http.put(f"/v1/keys/{key}", json="before")
    # Content-Length over the limit: answered on the headers alone, no body sent
    head = (f"PUT /v1/keys/{key} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
            f"Content-Type: application/octet-stream\r\nContent-Length: {10 ** 9}\r\n\r\n")
    resp = _raw_request(server.url, head.encode())
    assert resp.startswith(b"HTTP/1.1 413"), resp[:200]
    # chunked: answered once the count passes the limit, long before the end
    head = (f"PUT /v1/keys/{key} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
            "Transfer-Encoding: chunked\r\n\r\n")
    chunk = b"400\r\n" + b"x" * 1024 + b"\r\n"
    resp = _raw_request(server.url, head.encode(), [chunk] * 8)
    assert resp.startswith(b"HTTP/1.1 413"), resp[:200]
    # a JSON value whose stored form outgrows the limit
    r = http.put(f"/v1/keys/{key}", content=b"[" + b"1," * 2000 + b"1]",
                 headers={"content-type": "application/json"})
    assert r.status_code == 413 and error_of(r)
    assert http.get(f"/v1/keys/{key}").json() == "before"
    assert http.put(f"/v1/keys/{key}", content=b"y" * MAX_VALUE).status_code == 204


def test_openapi_describes_every_route_with_its_errors(http):
    schema = http.get("/openapi.json").json()
    ops = {(p, m): op for p, item in schema["paths"].items() for m, op in item.items()}
    assert set(ops) == {("/v1/keys/{key}", m) for m in ("put", "get", "head", "delete")} | {
        ("/v1/keys/{key}/incr", "post"), ("/v1/keys/{key}/touch", "post"),
        ("/v1/batch", "post"), ("/v1/stats", "get"),
        ("/metrics", "get"), ("/healthz", "get")}
    assert "414" in ops["/v1/keys/{key}", "put"]["responses"]
    assert {"412", "413", "422", "401"} <= set(ops["/v1/keys/{key}", "put"]["responses"])
    assert "409" in ops["/v1/keys/{key}/incr", "post"]["responses"]
    assert "404" in ops["/v1/keys/{key}", "get"]["responses"]
    assert "security" not in ops["/healthz", "get"]
    stats = ops["/v1/stats", "get"]
    assert stats["operationId"] == "stats" and stats["security"] == [{"bearer": []}]
    assert "401" in stats["responses"]
    ref = stats["responses"]["200"]["content"]["application/json"]["schema"]["$ref"]
    body = schema["components"]["schemas"][ref.rsplit("/", 1)[1]]
    assert list(body["properties"]) == STATS_FIELDS and body["required"] == STATS_FIELDS
    assert body["properties"]["hits"]["type"] == "integer"
    assert {"type": "null"} in body["properties"]["recovery_seconds"]["anyOf"]
    assert "gets that found a live entry" in body["properties"]["hits"]["description"]
    assert schema["components"]["securitySchemes"]["bearer"]["scheme"] == "bearer"


# -- the clients ---------------------------------------------------------------------

def test_client_mapping_and_errors(server, key):
    with Client(server.url, token=TOKEN) as kv:
        kv[key] = {"a": [1, 2]}
        assert kv[key] == {"a": [1, 2]} and key in kv
        kv.set(key + "b", b"\x00raw", expire=60)
        assert kv.get(key + "b") == b"\x00raw"
        assert kv.add(key, 1) is False and kv.add(key + "c", 1) is True
        assert kv.incr(key + "n", 3) == 3 and kv.incr(key + "n") == 4
        assert kv.incr(key + "n", 10 ** 20) == 10 ** 20 + 4
        assert kv.touch(key + "n", 60) is True and kv.touch(key + "n") is True
        assert kv.touch(key + "absent") is False
        del kv[key]
        assert key not in kv and kv.get(key, "dflt") == "dflt"
        with pytest.raises(KeyError):
            kv[key]
        with pytest.raises(KeyError):
            del kv[key]
        with pytest.raises(RemoteTypeError) as ei:
            kv.incr(key + "b")
        assert isinstance(ei.value, TypeError) and ei.value.status == 409
        with pytest.raises(RemoteValueError):
            kv.set(key, 1, expire=-1)
        with pytest.raises(RemoteValueError):
            kv.set(key, b"z" * (MAX_VALUE + 1))
        res = kv.batch([{"op": "set", "key": key, "value": b"\x01"}, {"op": "get", "key": key}])
        assert res[1] == {"status": 200, "value": b"\x01"}
        assert "durablekv_http_requests_total" in kv.metrics()
        with pytest.raises(TypeError, match="not iterable"):
            list(kv)
        for bad in ("", key + "/incr", key + "/touch"):
            with pytest.raises(ValueError, match="empty|ends in '/(incr|touch)'"):
                kv.set(bad, 1)
            with pytest.raises(ValueError, match="empty|ends in '/(incr|touch)'"):
                kv.get(bad)
    with Client(server.url) as anon, pytest.raises(RemoteAuthError) as ei:
        anon.get(key)
    assert isinstance(ei.value, PermissionError) and ei.value.status == 401
    with Client(server.url, token="wrong") as bad, pytest.raises(RemoteAuthError):
        bad[key] = 1


def test_async_client(server, key):
    async def main():
        async with AsyncClient(server.url, token=TOKEN) as kv:
            await kv.set(key, [1, "x"])
            assert await kv.get(key) == [1, "x"]
            assert await kv.contains(key)
            assert await kv.add(key, 2) is False
            assert await kv.incr(key + "n", 2) == 2
            assert await kv.incr(key + "n", -(10 ** 20)) == 2 - 10 ** 20
            assert await kv.touch(key + "n", 5) is True
            assert await kv.touch(key + "n", 0) is True and not await kv.contains(key + "n")
            assert await kv.delete(key) and not await kv.delete(key)
            with pytest.raises(KeyError):
                await kv.getitem(key)
            await asyncio.gather(*(kv.incr(key + "c") for _ in range(50)))
            assert await kv.get(key + "c") == 50
    asyncio.run(main())


def test_client_server_gone(tmp_path):
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    with Client(f"http://127.0.0.1:{port}", timeout=5) as kv, \
            pytest.raises(ServerUnavailableError) as ei:
        kv.get("k")
    assert isinstance(ei.value, ConnectionError)


# -- the command line: secure defaults -------------------------------------------------

def _serve(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    e = dict(os.environ)
    e.pop("DURABLEKV_TOKEN", None)
    e.update(env or {})
    return subprocess.run([sys.executable, "-m", "durablekv", "serve", *args],
                          capture_output=True, text=True, timeout=60, env=e, cwd=str(REPO))


def test_refuses_non_loopback_host_without_token(tmp_path):
    r = _serve(str(tmp_path / "c"), "--host", "0.0.0.0", "--port", "0")
    assert r.returncode == 2
    assert "refusing to serve on '0.0.0.0' without a token" in r.stderr
    assert "--token-file" in r.stderr
    assert not (tmp_path / "c").exists()  # refused before anything was created
    r = _serve(str(tmp_path / "c"), "--token-file", str(tmp_path / "missing"))
    assert r.returncode == 2 and "cannot read --token-file" in r.stderr
    (tmp_path / "empty").write_text(" \n")
    r = _serve(str(tmp_path / "c"), "--token-file", str(tmp_path / "empty"))
    assert r.returncode == 2 and "is empty" in r.stderr


def test_token_from_environment_directory_0700_access_log_and_body_timeout(tmp_path):
    d = tmp_path / "new" / "cache"
    old = os.umask(0o002)  # a permissive umask must not loosen the new directory
    try:
        srv_cm = running_server(d, "--access-log", "--request-timeout", "0.5",
                                env={"DURABLEKV_TOKEN": " envtok "})
        with srv_cm as srv:
            assert stat.S_IMODE(os.stat(d).st_mode) == 0o700
            h = {"Authorization": "Bearer envtok"}
            assert httpx.put(srv.url + "/v1/keys/a", json=1, headers=h).status_code == 204
            assert httpx.get(srv.url + "/v1/keys/a").status_code == 401
            # a body that stops arriving: 408 after --request-timeout
            head = ("PUT /v1/keys/slow HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer envtok\r\n"
                    "Content-Length: 10\r\n\r\nabc").encode()
            u = urlsplit(srv.url)
            with socket.create_connection((u.hostname, u.port), timeout=30) as s:
                s.sendall(head)
                resp = s.recv(65536)
            assert resp.startswith(b"HTTP/1.1 408"), resp[:100]
            assert httpx.get(srv.url + "/v1/keys/slow", headers=h).status_code == 404
    finally:
        os.umask(old)
    lines = [json.loads(x) for x in srv.stderr().splitlines() if x.startswith("{")]
    put = [x for x in lines if x["method"] == "PUT" and x["path"] == "/v1/keys/a"]
    assert put and put[0]["status"] == 204 and put[0]["route"] == "/v1/keys/{key}"
    assert {"ts", "duration_ms", "client"} <= set(put[0])


def test_access_log_is_off_by_default(server, http):
    http.get("/v1/keys/quiet")
    assert '"method"' not in server.stderr()


def test_readme_curl_lines(http):
    """README: `curl -X PUT .../v1/keys/greeting -d hello` then `curl .../greeting`
    prints hello (curl's -d sends a form content type: stored as bytes)."""
    r = http.put("/v1/keys/greeting", content=b"hello",
                 headers={"content-type": "application/x-www-form-urlencoded"})
    assert r.status_code == 204
    assert http.get("/v1/keys/greeting").content == b"hello"


def test_refuses_a_pickle_cache(tmp_path):
    """No pickle over the wire, ever: a directory made with serializer='pickle'
    is refused at start (exit 2), not served."""
    from durablekv import Cache
    with Cache(tmp_path / "p", serializer="pickle") as c:
        c["k"] = {1, 2}  # a set: only pickle stores it
    r = _serve(str(tmp_path / "p"), "--port", "0")
    assert r.returncode == 2
    assert "serializer='pickle'" in r.stderr and "never unpickles" in r.stderr


def test_loopback_and_token_rules():
    from durablekv.errors import ConfigError
    from durablekv.server.command import TOKEN_ENV, is_loopback, read_token
    assert all(map(is_loopback, ("127.0.0.1", "127.1.2.3", "::1", "[::1]", "localhost")))
    assert not any(map(is_loopback, ("0.0.0.0", "::", "10.0.0.1", "example.com", "")))
    assert read_token(None, {}) is None
    assert read_token(None, {TOKEN_ENV: "  t0k\n"}) == "t0k"
    for bad in ("", "  ", "two words", "ctl\x01"):
        with pytest.raises(ConfigError):
            read_token(None, {TOKEN_ENV: bad})


def test_serve_on_a_file_says_it_is_a_file(tmp_path):
    f = tmp_path / "afile"
    f.write_text("x")
    out = subprocess.run([sys.executable, "-m", "durablekv", "serve", str(f)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert "is a file, not a directory" in out.stderr and "Traceback" not in out.stderr


def test_serve_takes_a_leading_tilde_as_the_home_directory(tmp_path):
    """``durablekv serve '~/c'`` (quoted, or from a unit file: no shell to
    expand it) serves ``$HOME/c`` as ``Cache('~/c')`` does, not ``./~/c``."""
    import signal
    import threading
    from tests.server_util import START_LINE, START_TIMEOUT
    home, cwd = tmp_path / "home", tmp_path / "cwd"
    home.mkdir()
    cwd.mkdir()
    env = dict(os.environ, HOME=str(home),
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    env.pop("DURABLEKV_TOKEN", None)
    proc = subprocess.Popen([sys.executable, "-m", "durablekv", "serve", "~/c", "--port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=str(cwd), env=env)
    timer = threading.Timer(START_TIMEOUT, proc.kill)
    timer.start()
    try:
        line = proc.stdout.readline().rstrip("\n")
        m = START_LINE.match(line)
        assert m, (line, proc.stderr.read() if proc.poll() is not None else "")
        assert m.group(1) == str(home / "c")
        assert httpx.put(m.group(2) + "/v1/keys/a", content=b"1").status_code == 204
    finally:
        timer.cancel()
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    assert proc.returncode == 0
    assert os.listdir(cwd) == []
    from durablekv import Cache
    with Cache(home / "c") as cache:
        assert cache["a"] == b"1"


def test_a_path_that_is_not_utf8_is_a_400_not_another_key(http):
    # %FF, %FE and a real U+FFFD must not all name the key '\ufffd'
    real = "/v1/keys/" + quote("\ufffd", safe="")
    assert http.put(real, content=b"the real U+FFFD").status_code == 204
    for bad in ("/v1/keys/%FF", "/v1/keys/%FE", "/v1/keys/a%C3", "/v1/keys/%FF/incr"):
        for method in ("GET", "PUT", "HEAD", "DELETE", "POST"):
            r = http.request(method, bad, content=b"x")
            assert r.status_code == 400, (method, bad, r.status_code)
            if method != "HEAD":
                assert error_of(r)["error"] == "bad key"
                assert "UTF-8" in error_of(r)["detail"]
    assert http.get(real).content == b"the real U+FFFD"


@pytest.mark.parametrize("args, message", [
    (["--port", "99999"], "a port is 0..65535"),
    (["--port", "-1"], "expected a whole number >= 0"),
    (["--port", "http"], "expected a whole number, got 'http'"),
    (["--shutdown-timeout", "-1"], "expected 0 or more seconds"),
    (["--request-timeout", "nan"], "expected a positive number"),
    (["--policy", "fifo"], "invalid choice: 'fifo'"),
    (["--max-memory-bytes", "0"], "'0' must be a whole number of bytes >= 1"),
    (["--max-memory-bytes", "1.5"], "'1.5' must be a whole number of bytes >= 1"),
    (["--size-limit", "-1"], "'-1' must be a whole number of bytes >= 1"),
    (["--size-limit", "lots"], "'lots' is not a size in bytes"),
    (["--max-memory-bytes", "64XB"], "'64XB' is not a size in bytes"),
])
def test_serve_refuses_bad_options_in_one_line(tmp_path, args, message):
    out = subprocess.run([sys.executable, "-m", "durablekv", "serve", str(tmp_path / "c"), *args],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out
    assert message in out.stderr and "Traceback" not in out.stderr
    assert not (tmp_path / "c").exists()
