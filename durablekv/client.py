"""HTTP clients for ``durablekv serve``: :class:`Client` and :class:`AsyncClient`.

::

    from durablekv.client import Client
    with Client("http://127.0.0.1:8470", token=None) as kv:
        kv["user:1"] = {"name": "Ada"}      # JSON
        kv.set("blob", b"\\x00\\x01", expire=30)
        kv["user:1"], "blob" in kv, kv.incr("hits")
        del kv["blob"]
        kv.stats().hits                     # a CacheStats, as Cache.stats()

Both keep one pooled httpx connection pool (keep-alive) for their lifetime;
close them (or use ``with`` / ``async with``). Values: ``bytes`` go over the
wire as ``application/octet-stream`` and come back as ``bytes``; anything else
is sent as JSON and comes back as its JSON value (a tuple comes back a list).
No pickle, ever.

Errors: a missing key is a ``KeyError`` for ``client[key]`` and ``del``, and
``default`` for :meth:`Client.get`; the server's error answers become
:class:`~durablekv.errors.RemoteError` subclasses (``RemoteAuthError`` for 401,
``RemoteValueError`` for 400/413/414/422, ``RemoteTypeError`` for 409), and a
server that does not answer is a ``ServerUnavailableError``.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import typing
from typing import Any, Callable, Iterable
from urllib.parse import quote

try:
    import httpx
except ImportError as exc:  # the client is in the server extra
    raise ImportError(f"durablekv.client needs httpx ({exc}); install the server extra: "
                      "pip install 'durablekv[server]' (or '.[server]' from a checkout)") from exc

from .errors import (RemoteAuthError, RemoteError, RemoteTypeError, RemoteValueError,
                     ServerUnavailableError)
from .stats import CacheStats

__all__ = ["Client", "AsyncClient"]

_MISSING: Any = object()
_OCTET = "application/octet-stream"
_JSON = "application/json"
_ERROR_CLASSES = {401: RemoteAuthError, 400: RemoteValueError, 413: RemoteValueError,
                  414: RemoteValueError, 422: RemoteValueError, 409: RemoteTypeError}


def _path(key: str) -> str:
    if not isinstance(key, str):
        raise TypeError(f"keys over HTTP are str, got {type(key).__name__} {key!r}")
    if not key:
        raise ValueError("the key is empty; HTTP keys are non-empty str")
    for suffix in ("/incr", "/touch"):
        if key.endswith(suffix):
            raise ValueError(f"key {key!r} ends in {suffix!r}, which the HTTP API keeps "
                             f"for POST /v1/keys/KEY{suffix}; choose a key that does not "
                             "end so")
    return "/v1/keys/" + quote(key, safe="")


def _body(value: Any) -> tuple[bytes, str]:
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value), _OCTET
    try:
        return json.dumps(value, allow_nan=False, separators=(",", ":")).encode(), _JSON
    except (TypeError, ValueError) as exc:
        raise TypeError(f"a value sent to the server is bytes or JSON-serializable; "
                        f"{type(value).__name__} {value!r:.60} is not ({exc})") from None


def _ttl(expire: float | None) -> dict[str, str]:
    return {} if expire is None else {"ttl": repr(float(expire))}


def _raise_for(resp: httpx.Response) -> None:
    """Turn an error answer into the matching :class:`RemoteError`."""
    try:
        body = resp.json()
        error, detail = str(body["error"]), str(body["detail"])
    except Exception:  # noqa: BLE001 - not our JSON (a proxy's page): keep the text
        error, detail = resp.reason_phrase or "error", resp.text[:200]
    cls = _ERROR_CLASSES.get(resp.status_code, RemoteError)
    raise cls(resp.status_code, error, detail, str(resp.request.url))


def _value_of(resp: httpx.Response) -> Any:
    ctype = resp.headers.get("content-type", "")
    if ctype.split(";", 1)[0].strip() == _JSON:
        return resp.json()
    return resp.content


# Each operation: the request it sends, and what it makes of the answer. The
# sync and async clients share these, differing only in how they send.

def _op_get(key: str, default: Any) -> tuple[tuple, Callable[[httpx.Response], Any]]:
    def done(resp: httpx.Response) -> Any:
        if resp.status_code == 200:
            return _value_of(resp)
        if resp.status_code == 404:
            return default
        _raise_for(resp)
    return ("GET", _path(key), None, None, None), done


def _op_set(key: str, value: Any, expire: float | None, only_new: bool = False
            ) -> tuple[tuple, Callable[[httpx.Response], Any]]:
    content, ctype = _body(value)
    headers = {"content-type": ctype}
    if only_new:
        headers["if-none-match"] = "*"

    def done(resp: httpx.Response) -> Any:
        if resp.status_code == 204:
            return True
        if only_new and resp.status_code == 412:
            return False
        _raise_for(resp)
    return ("PUT", _path(key), _ttl(expire), headers, content), done


def _op_delete(key: str) -> tuple[tuple, Callable[[httpx.Response], Any]]:
    def done(resp: httpx.Response) -> bool:
        if resp.status_code in (204, 404):
            return resp.status_code == 204
        _raise_for(resp)
        return False
    return ("DELETE", _path(key), None, None, None), done


def _op_contains(key: str) -> tuple[tuple, Callable[[httpx.Response], Any]]:
    def done(resp: httpx.Response) -> bool:
        if resp.status_code in (200, 404):
            return resp.status_code == 200
        _raise_for(resp)
        return False
    return ("HEAD", _path(key), None, None, None), done


def _op_incr(key: str, delta: int) -> tuple[tuple, Callable[[httpx.Response], Any]]:
    if type(delta) is not int:
        raise TypeError(f"incr() delta must be an int, got {type(delta).__qualname__} "
                        f"{delta!r}")

    def done(resp: httpx.Response) -> int:
        if resp.status_code == 200:
            return int(resp.json())
        _raise_for(resp)
        return 0
    return ("POST", _path(key) + "/incr", {"delta": str(delta)}, None, None), done


def _op_touch(key: str, expire: float | None) -> tuple[tuple, Callable[[httpx.Response], Any]]:
    def done(resp: httpx.Response) -> bool:
        if resp.status_code in (204, 404):
            return resp.status_code == 204
        _raise_for(resp)
        return False
    params = None if expire is None else {"ttl": repr(float(expire))}
    return ("POST", _path(key) + "/touch", params, None, None), done


def _op_batch(ops: Iterable[dict[str, Any]]) -> tuple[tuple, Callable[[httpx.Response], Any]]:
    wire = []
    for op in ops:
        op = dict(op)
        if op.get("op") == "set" and isinstance(op.get("value"), (bytes, bytearray)):
            op["base64"] = base64.b64encode(op.pop("value")).decode()
        if op.get("ttl") is None:
            op.pop("ttl", None)
        wire.append(op)
    content = json.dumps({"ops": wire}, allow_nan=False).encode()

    def done(resp: httpx.Response) -> list[dict[str, Any]]:
        if resp.status_code != 200:
            _raise_for(resp)
        results = resp.json()["results"]
        for r in results:
            if r.get("base64") is not None:
                r["value"] = base64.b64decode(r.pop("base64"))
        return results
    return ("POST", "/v1/batch", None, {"content-type": _JSON}, content), done


#: CacheStats field -> its type (int, int | None, float or str), in field order.
_STATS_KINDS: dict[str, Any] = {f.name: typing.get_type_hints(CacheStats)[f.name]
                                for f in dataclasses.fields(CacheStats)}


def _stats_of(body: Any, url: str) -> CacheStats:
    """A :class:`CacheStats` from a ``GET /v1/stats`` body. Fields this client
    does not know (a newer server's) are ignored; a field it needs and does
    not find, or of the wrong type, is a :class:`RemoteError`. A null float
    (the server's form of a value that is not finite) becomes NaN."""
    if not isinstance(body, dict):
        raise RemoteError(200, "bad stats", f"/v1/stats answered {type(body).__name__} "
                          f"{body!r:.60}, not a JSON object; is this a durablekv server?", url)
    missing = [name for name in _STATS_KINDS if name not in body]
    if missing:
        raise RemoteError(200, "incomplete stats", f"the server's /v1/stats lacks "
                          f"{', '.join(missing)}, which this client's CacheStats needs; the "
                          "server is older than the client: upgrade the server, or use a "
                          "client as old as it", url)
    values: dict[str, Any] = {}
    wrong = []
    for name, kind in _STATS_KINDS.items():
        v = body[name]
        if kind is float:
            if v is None:
                v = float("nan")
            elif type(v) in (int, float):
                v = float(v)
            else:
                wrong.append(f"{name}={v!r:.30} (expected a number or null)")
        elif kind is str:
            if type(v) is not str:
                wrong.append(f"{name}={v!r:.30} (expected a string)")
        elif not (type(v) is int or (v is None and kind != int)):
            wrong.append(f"{name}={v!r:.30} (expected an integer"
                         f"{'' if kind is int else ' or null'})")
        values[name] = v
    if wrong:
        raise RemoteError(200, "bad stats", f"the server's /v1/stats has values of the "
                          f"wrong type: {'; '.join(wrong)}; is this a durablekv server of "
                          "a compatible version?", url)
    return CacheStats(**values)


def _op_stats() -> tuple[tuple, Callable[[httpx.Response], Any]]:
    def done(resp: httpx.Response) -> CacheStats:
        if resp.status_code != 200:
            _raise_for(resp)
        url = str(resp.request.url)
        try:
            body = resp.json()
        except ValueError:
            raise RemoteError(200, "bad stats", f"/v1/stats answered something that is not "
                              f"JSON ({resp.text[:60]!r}); is this a durablekv server?",
                              url) from None
        return _stats_of(body, url)
    return ("GET", "/v1/stats", None, None, None), done


def _op_plain(path: str) -> tuple[tuple, Callable[[httpx.Response], Any]]:
    def done(resp: httpx.Response) -> str:
        if resp.status_code != 200:
            _raise_for(resp)
        return resp.text
    return ("GET", path, None, None, None), done


class _Base:
    def __init__(self, url: str, token: str | None) -> None:
        self.url = url.rstrip("/")
        self._headers = {"authorization": f"Bearer {token}"} if token else {}

    def _unavailable(self, exc: httpx.TransportError, path: str) -> ServerUnavailableError:
        return ServerUnavailableError(0, "no answer from the server",
                                      f"{type(exc).__name__}: {exc}; is `durablekv serve` "
                                      "running at this URL?", self.url + path)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.url}>"


class Client(_Base):
    """A blocking client with a keep-alive connection pool.

    :param url: the server's base URL (``http://127.0.0.1:8470``).
    :param token: the bearer token, if the server has one.
    :param timeout: seconds for connecting and for each read (httpx's timeout).
    :param max_connections: most pooled connections.
    :param transport: an httpx transport (tests).

    Thread-safe (httpx's Client is). Every method raises
    :class:`~durablekv.errors.RemoteError` subclasses for error answers and
    :class:`~durablekv.errors.ServerUnavailableError` when nothing answers.
    """

    def __init__(self, url: str, token: str | None = None, *, timeout: float = 10.0,
                 max_connections: int = 16, transport: Any = None) -> None:
        super().__init__(url, token)
        self._http = httpx.Client(base_url=self.url, headers=self._headers, timeout=timeout,
                                  limits=httpx.Limits(max_connections=max_connections,
                                                      max_keepalive_connections=max_connections),
                                  transport=transport)

    def _do(self, op: tuple[tuple, Callable[[httpx.Response], Any]]) -> Any:
        (method, path, params, headers, content), done = op
        try:
            resp = self._http.request(method, path, params=params, headers=headers,
                                      content=content)
        except httpx.TransportError as exc:
            raise self._unavailable(exc, path) from exc
        return done(resp)

    def get(self, key: str, default: Any = None) -> Any:
        """The value under ``key`` (bytes, or the JSON value), or ``default``."""
        return self._do(_op_get(key, default))

    def set(self, key: str, value: Any, expire: float | None = None) -> None:
        """Store ``value`` (bytes, or anything JSON can carry) under ``key``;
        ``expire``: seconds from now. Returns once the server acknowledged it
        (with its durability mode's meaning).

        :raises RemoteValueError: a bad ttl, key or a value over the limit.
        """
        self._do(_op_set(key, value, expire))

    def add(self, key: str, value: Any, expire: float | None = None) -> bool:
        """Store only if ``key`` is absent (``If-None-Match: *``); True if stored."""
        return self._do(_op_set(key, value, expire, only_new=True))

    def delete(self, key: str) -> bool:
        """Remove ``key``; True if it was there."""
        return self._do(_op_delete(key))

    def incr(self, key: str, delta: int = 1) -> int:
        """Add ``delta`` to the int under ``key`` (missing: from 0); the new value.

        :raises RemoteTypeError: the value is not an int.
        """
        return self._do(_op_incr(key, delta))

    def touch(self, key: str, expire: float | None = None) -> bool:
        """Give the live entry under ``key`` a new TTL: ``expire`` seconds from
        now, or none (``POST /v1/keys/KEY/touch``); ``expire=0`` removes it.
        True if the key was there.

        :raises RemoteValueError: a bad ttl or key.
        """
        return self._do(_op_touch(key, expire))

    def batch(self, ops: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
        """``POST /v1/batch``: ``ops`` like ``{"op": "set", "key": k, "value": v,
        "ttl": s}``; one result dict per op (``status``, ``value``)."""
        return self._do(_op_batch(ops))

    def healthy(self) -> bool:
        """True when ``/healthz`` answers 200."""
        try:
            return self._do(_op_plain("/healthz")) is not None
        except RemoteError:
            return False

    def metrics(self) -> str:
        """The ``/metrics`` text."""
        return self._do(_op_plain("/metrics"))

    def stats(self) -> CacheStats:
        """The served cache's statistics (``GET /v1/stats``): the same
        :class:`~durablekv.stats.CacheStats` as :meth:`Cache.stats` gives in
        the server's process. A float the server sent as null (not finite)
        is NaN; fields a newer server adds are ignored.

        :raises RemoteError: the answer lacks a field this client's
            CacheStats has (an older server), or is not a stats object.
        :raises RemoteAuthError: missing or wrong token.
        """
        return self._do(_op_stats())

    def __iter__(self) -> Any:
        # Without this, iter() would fall back to __getitem__(0), (1), ...
        raise TypeError("a durablekv Client is not iterable: the HTTP API does not list "
                        "keys (iterate over a Cache in the server's process instead)")

    def __getitem__(self, key: str) -> Any:
        value = self.get(key, _MISSING)
        if value is _MISSING:
            raise KeyError(key)
        return value

    def __setitem__(self, key: str, value: Any) -> None:
        self.set(key, value)

    def __delitem__(self, key: str) -> None:
        if not self.delete(key):
            raise KeyError(key)

    def __contains__(self, key: str) -> bool:
        return self._do(_op_contains(key))

    def close(self) -> None:
        """Close the pooled connections. Idempotent."""
        self._http.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class AsyncClient(_Base):
    """The asyncio client: :class:`Client`'s methods as coroutines
    (``await kv.get(k)``, ``await kv.contains(k)``), same parameters, errors
    and pooling; ``async with AsyncClient(url) as kv``."""

    def __init__(self, url: str, token: str | None = None, *, timeout: float = 10.0,
                 max_connections: int = 16, transport: Any = None) -> None:
        super().__init__(url, token)
        self._http = httpx.AsyncClient(
            base_url=self.url, headers=self._headers, timeout=timeout,
            limits=httpx.Limits(max_connections=max_connections,
                                max_keepalive_connections=max_connections),
            transport=transport)

    async def _do(self, op: tuple[tuple, Callable[[httpx.Response], Any]]) -> Any:
        (method, path, params, headers, content), done = op
        try:
            resp = await self._http.request(method, path, params=params, headers=headers,
                                            content=content)
        except httpx.TransportError as exc:
            raise self._unavailable(exc, path) from exc
        return done(resp)

    async def get(self, key: str, default: Any = None) -> Any:
        """:meth:`Client.get`."""
        return await self._do(_op_get(key, default))

    async def set(self, key: str, value: Any, expire: float | None = None) -> None:
        """:meth:`Client.set`."""
        await self._do(_op_set(key, value, expire))

    async def add(self, key: str, value: Any, expire: float | None = None) -> bool:
        """:meth:`Client.add`."""
        return await self._do(_op_set(key, value, expire, only_new=True))

    async def delete(self, key: str) -> bool:
        """:meth:`Client.delete`."""
        return await self._do(_op_delete(key))

    async def contains(self, key: str) -> bool:
        """``key in client``."""
        return await self._do(_op_contains(key))

    async def incr(self, key: str, delta: int = 1) -> int:
        """:meth:`Client.incr`."""
        return await self._do(_op_incr(key, delta))

    async def touch(self, key: str, expire: float | None = None) -> bool:
        """:meth:`Client.touch`."""
        return await self._do(_op_touch(key, expire))

    async def batch(self, ops: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
        """:meth:`Client.batch`."""
        return await self._do(_op_batch(ops))

    async def metrics(self) -> str:
        """:meth:`Client.metrics`."""
        return await self._do(_op_plain("/metrics"))

    async def stats(self) -> CacheStats:
        """:meth:`Client.stats`."""
        return await self._do(_op_stats())

    async def getitem(self, key: str) -> Any:
        """``client[key]``: the value, KeyError when missing."""
        value = await self.get(key, _MISSING)
        if value is _MISSING:
            raise KeyError(key)
        return value

    async def close(self) -> None:
        """Close the pooled connections. Idempotent."""
        await self._http.aclose()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()
