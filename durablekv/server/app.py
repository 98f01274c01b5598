"""The FastAPI app: HTTP routes over an :class:`~durablekv.aio.AsyncCache`.

A thin layer: each route turns a request into one cache call and the
outcome into a status code; library errors become statuses in one table
(:data:`LIBRARY_ERRORS`). Every error body is JSON
``{"error": "<short name>", "detail": "<what happened and what to do>"}``,
never a traceback.

One pure-ASGI middleware, :class:`Gate`, sits in front of the routes: the
bearer token check (every route but ``/healthz``), the request metrics
(count and latency by route template and status) and the optional access log.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import hmac
import json
import logging
import math
import re
import time
import typing
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Literal
from urllib.parse import unquote_to_bytes

from fastapi import FastAPI, Path, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import Response
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model
from starlette.convertors import Convertor, register_url_convertor
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..aio import AsyncCache
from ..cache import Cache
from ..errors import (CacheClosedError, CacheFailedError, DurableKVError, FlushTimeoutError,
                      LogWriteError, WriteBehindError)
from ..stats import CacheStats

__all__ = ["create_app", "ApiError", "LIBRARY_ERRORS", "MAX_TTL_SECONDS", "DEFAULT_MAX_KEY_CHARS",
           "MAX_BATCH_OPS"]

#: Longest ``?ttl=`` accepted: 10 years in seconds. Longer is a 422 (a TTL
#: beyond that is almost surely a unit mistake; omit ttl for no expiry).
MAX_TTL_SECONDS = 10 * 365 * 86400
#: Longest key (characters) by default; longer is a 414.
DEFAULT_MAX_KEY_CHARS = 1024
#: Most operations in one ``POST /v1/batch``.
MAX_BATCH_OPS = 1000
_MISSING: Any = object()
_OCTET = "application/octet-stream"
_JSON = "application/json"
_access_logger = logging.getLogger("durablekv.server.access")
#: ``asyncio.timeout`` (3.11+) bounds a body read without a task of its own.
_timeout = getattr(asyncio, "timeout", None)


class ApiError(Exception):
    """An HTTP error answer: ``status``, ``error`` (a short name), ``detail``."""

    def __init__(self, status: int, error: str, detail: str,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(detail)
        self.status = status
        self.error = error
        self.detail = detail
        self.headers = headers


#: Library error -> (status, error name). The first class that matches wins.
LIBRARY_ERRORS: tuple[tuple[type[BaseException], int, str], ...] = (
    (CacheClosedError, 503, "cache closed"),
    (CacheFailedError, 503, "cache failed"),
    (LogWriteError, 507, "log write failed"),
    (FlushTimeoutError, 504, "flush timeout"),
    (WriteBehindError, 503, "write-behind failing"),
    (DurableKVError, 500, "cache error"),
)


class ErrorBody(BaseModel):
    """Every error answer."""
    error: str = Field(description="short name of the error")
    detail: str = Field(description="what happened and what to do")


#: the action routes under a key (POST only): a key cannot end in these
_ACTION_SUFFIXES = ("/incr", "/touch")


class BatchOp(BaseModel):
    """One operation of a batch."""
    model_config = ConfigDict(extra="forbid", strict=True)
    op: Literal["get", "set", "delete"]
    key: str = Field(min_length=1, description="a key over the server's limit gets "
                     "status 414 in its result")
    value: Any = Field(None, description="set: the JSON value to store (null stores null); "
                       "a set gives value or base64, exactly one")
    base64: str | None = Field(None, description="set: bytes to store, base64 "
                               "(instead of value)")
    ttl: float | None = Field(None, ge=0, le=MAX_TTL_SECONDS, allow_inf_nan=False,
                              description="set: seconds until the entry expires")


class BatchRequest(BaseModel):
    """``POST /v1/batch`` body: operations applied in order (each one atomic,
    the batch as a whole is not a transaction)."""
    model_config = ConfigDict(extra="forbid")
    ops: list[BatchOp] = Field(max_length=MAX_BATCH_OPS)


class BatchResult(BaseModel):
    """One operation's outcome: ``status`` as the single-key route would
    answer; a found get has ``value`` (JSON) or ``base64`` (bytes)."""
    status: int
    value: Any = None
    base64: str | None = None
    error: str | None = None


class BatchResponse(BaseModel):
    results: list[BatchResult]


def _stats_model() -> type[BaseModel]:
    """The ``GET /v1/stats`` body: one property per :class:`CacheStats` field,
    all required, described by the field's ``:ivar:`` line. Built from the
    dataclass so the two cannot drift apart. A ``float`` field is
    ``number | null``: null stands for a value that is not finite (JSON has
    no inf or NaN)."""
    doc = CacheStats.__doc__ or ""
    described = {m.group(1): " ".join(m.group(2).split())
                 for m in re.finditer(r":ivar (\w+): (.*?)(?=\n\s*:ivar |\Z)", doc, re.S)}
    hints = typing.get_type_hints(CacheStats)
    fields: dict[str, Any] = {}
    for f in dataclasses.fields(CacheStats):
        kind = hints[f.name]
        text = described.get(f.name, f.name).replace("None", "null")
        if kind is float:
            kind = float | None
            text = text.rstrip(".") + " (null when not finite)."
        fields[f.name] = (kind, Field(description=text))
    model = create_model("CacheStatsBody", **fields)
    model.__doc__ = ("What the cache has done since it was opened, and its state now: the "
                     "fields of durablekv.stats.CacheStats (Cache.stats()). A float that is "
                     "not finite is null.")
    return model


CacheStatsBody = _stats_model()


def _stats_body(stats: CacheStats) -> bytes:
    """``stats`` as the JSON of :data:`CacheStatsBody`: every field, a float
    that is not finite (inf, NaN) as null, never a bare ``Infinity``/``NaN``
    token (which is not JSON)."""
    body = {}
    for f in dataclasses.fields(stats):
        v = getattr(stats, f.name)
        if type(v) is float and not math.isfinite(v):
            v = None
        body[f.name] = v
    return json.dumps(body, allow_nan=False, separators=(",", ":")).encode()


def _error_response(status: int, error: str, detail: str,
                    headers: dict[str, str] | None = None) -> Response:
    body = json.dumps({"error": error, "detail": detail}).encode()
    return Response(body, status_code=status, media_type=_JSON, headers=headers)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON (RFC 8259 has no NaN or Infinity)")


#: What to do about a JSON body that does not parse, by route: a PUT may
#: store any other body as bytes; a batch is JSON or a 415.
PUT_JSON_ADVICE = ("send a JSON value with Content-Type: application/json (null stores "
                   "None), or another Content-Type to store the bytes as they are")
BATCH_JSON_ADVICE = ('send the batch as a JSON object, {"ops": [{"op": "get", "key": "k"}, '
                     '...]}, with Content-Type: application/json')


def decode_json(body: bytes, advice: str = PUT_JSON_ADVICE) -> Any:
    """Strict JSON: no NaN/Infinity. ``advice``: what the 400 tells the
    client to do instead (the route's own choices).

    :raises ApiError: 400 malformed JSON (an empty body included: it is no
        JSON value, not a null)."""
    if not body.strip():
        raise ApiError(400, "malformed JSON", f"the body is empty, which is no JSON value; "
                       f"{advice}")
    try:
        return json.loads(body, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as exc:
        detail = exc.args[0] if isinstance(exc, ValueError) and exc.args else repr(exc)
        raise ApiError(400, "malformed JSON", f"the body is not valid JSON ({detail}); "
                       f"{advice}") from None


def encode_json(value: Any) -> bytes:
    """A stored value as JSON. A tuple becomes an array, and a dict key that
    is an int, float, bool or None becomes a string (``json.dumps``'s rules).
    :raises ApiError: 406 when it has no JSON form (bytes inside a list, a
    NaN, a bytes or tuple dict key, stored by a library user)."""
    try:
        return json.dumps(value, ensure_ascii=False, allow_nan=False,
                          separators=(",", ":")).encode("utf-8", "surrogatepass")
    except (TypeError, ValueError, RecursionError) as exc:
        raise ApiError(406, "no JSON form", f"the stored value has no JSON form ({exc}); "
                       "read it with the Python library") from None


def _value_response(value: Any) -> Response:
    if type(value) is bytes:
        return Response(value, media_type=_OCTET)
    return Response(encode_json(value), media_type=_JSON)


def _is_json(content_type: str | None) -> bool:
    if not content_type:
        return False
    return content_type.split(";", 1)[0].strip().lower() == _JSON


def _error_docs(*statuses: int) -> dict[int | str, dict[str, Any]]:
    text = {400: "bad request (malformed JSON, bad key)", 401: "missing or wrong token",
            404: "missing or expired key", 405: "method not allowed (a key cannot end in /incr or /touch)",
            406: "the stored value has no JSON form",
            408: "the body did not arrive in time", 409: "the stored value is not an int",
            412: "If-None-Match: * and the key is present", 413: "value over the limit",
            414: "key too long", 415: "wrong Content-Type", 422: "invalid parameter",
            500: "cache error", 503: "cache closed or failing", 504: "flush timeout",
            507: "replay log write failed"}
    return {s: {"model": ErrorBody, "description": text[s]} for s in statuses}


_SERVER_ERRORS = (500, 503, 507)
_KEY_DOC = {"description": "the key (percent-encoded UTF-8)", "minLength": 1}


def _path_is_utf8(scope: dict) -> bool:
    """Whether the request's raw path percent-decodes to valid UTF-8."""
    raw = scope.get("raw_path")
    if raw is None:
        return True
    try:
        unquote_to_bytes(raw.split(b"?", 1)[0]).decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


class Gate:
    """Pure ASGI middleware: a path that is not UTF-8 (400), auth, request
    metrics, access log.

    :param token: the bearer token, or None for no auth.
    :param registry: where the request metrics go.
    :param log_access: emit one JSON access-log line per request on the
        ``durablekv.server.access`` logger.
    """

    OPEN_PATHS = frozenset({"/healthz"})

    def __init__(self, app: Any, token: str | None, registry: CollectorRegistry,
                 log_access: bool = False) -> None:
        self.app = app
        self.expected = None if token is None else ("Bearer " + token).encode()
        self.log_access = log_access
        self.requests = Counter("durablekv_http_requests", "HTTP requests answered",
                                ("method", "route", "status"), registry=registry)
        self.latency = Histogram("durablekv_http_request_duration_seconds",
                                 "HTTP request latency, from the request's start to the "
                                 "end of its answer", ("method", "route"), registry=registry,
                                 buckets=(.0001, .00025, .0005, .001, .0025, .005, .01, .025,
                                          .05, .1, .25, .5, 1.0, 2.5, 5.0, 10.0))
        self._children: dict[tuple, Any] = {}

    def _authorized(self, scope: dict) -> bool:
        if self.expected is None or scope["path"] in self.OPEN_PATHS:
            return True
        got = b""
        for name, value in scope["headers"]:
            if name == b"authorization":
                got = value
                break
        return hmac.compare_digest(got, self.expected)

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0 = time.perf_counter()
        status = [500]

        async def send_wrapper(message: dict) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            if "\ufffd" in scope["path"] and not _path_is_utf8(scope):
                # The server decodes a path's %XX escapes with errors='replace',
                # so %FF, %FE and a real U+FFFD would all name one key.
                resp = _error_response(
                    400, "bad key", "the path is not percent-encoded UTF-8 (an escape "
                    "such as %FF is not a UTF-8 byte sequence); encode the key as UTF-8 "
                    "before percent-encoding it, or send bytes keys through the Python library")
                await resp(scope, receive, send_wrapper)
            elif self._authorized(scope):
                await self.app(scope, receive, send_wrapper)
            else:
                resp = _error_response(
                    401, "unauthorized", "this server needs 'Authorization: Bearer TOKEN' "
                    "with the token it was started with (--token-file or DURABLEKV_TOKEN)",
                    {"WWW-Authenticate": "Bearer"})
                await resp(scope, receive, send_wrapper)
        finally:
            self._observe(scope, status[0], time.perf_counter() - t0)

    def _observe(self, scope: dict, status: int, seconds: float) -> None:
        route = scope.get("route")
        template = route.path_format if route is not None else "unmatched"
        method = scope["method"]
        k = (method, template, status)
        children = self._children.get(k)
        if children is None:
            children = self._children[k] = (self.requests.labels(method, template, str(status)),
                                            self.latency.labels(method, template))
        children[0].inc()
        children[1].observe(seconds)
        if self.log_access:
            client = scope.get("client")
            _access_logger.info(json.dumps({
                "ts": round(time.time(), 6), "method": method, "route": template,
                "path": scope["path"], "status": status,
                "duration_ms": round(seconds * 1000, 3),
                "client": f"{client[0]}:{client[1]}" if client else None}))


def create_app(cache: Cache | AsyncCache | Any, token: str | None = None, *,
               max_key_chars: int = DEFAULT_MAX_KEY_CHARS,
               max_body_bytes: int | None = None, request_timeout: float = 30.0,
               access_log: bool = False, close_cache: bool = True) -> FastAPI:
    """The HTTP API over ``cache``.

    :param cache: an open :class:`~durablekv.Cache`, an :class:`AsyncCache`,
        or any object with AsyncCache's ``get/set/add/delete/incr/touch/contains``
        coroutines (the benchmark's dict-backed baseline).
    :param token: bearer token every route but ``/healthz`` requires; None:
        no auth (loopback only: :func:`durablekv.server.serve` refuses
        otherwise).
    :param max_key_chars: longer keys are answered 414.
    :param max_body_bytes: bigger bodies are answered 413 before they are read
        whole (by ``Content-Length``, and by counting a chunked body as it
        arrives); default the cache's ``max_value_bytes``.
    :param request_timeout: seconds a request body may take to arrive (408 after).
    :param access_log: one JSON line per request on the
        ``durablekv.server.access`` logger.
    :param close_cache: flush and close the cache when the app shuts down
        (the lifespan's end: after uvicorn has drained in-flight requests).
    :returns: the FastAPI app; ``app.state.registry`` holds its metrics.
    """
    if isinstance(cache, Cache):
        backend: Any = AsyncCache.wrap(cache)
        raw: Cache | None = cache
    else:
        backend = cache
        raw = getattr(cache, "_cache", None)
    if max_body_bytes is None:
        max_body_bytes = raw.max_value_bytes if raw is not None else 64 << 20
    registry = CollectorRegistry(auto_describe=True)
    if raw is not None:
        from ..metrics import CacheCollector
        registry.register(CacheCollector(raw))

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        if close_cache:
            if raw is not None:
                await backend.run(raw.close)
            close = getattr(backend, "close", None)
            if close is not None:
                await close()

    app = FastAPI(title="durablekv", version=_version(), lifespan=lifespan,
                  redirect_slashes=False, docs_url=None, redoc_url=None,
                  description="A durable key/value cache over HTTP. Keys are URL path "
                  "segments; a JSON body is stored as JSON, any other body as bytes.")
    app.state.registry = registry
    app.state.backend = backend

    def check_key(key: str, method: str = "") -> None:
        if method and key.endswith(_ACTION_SUFFIXES):
            # the path of POST /v1/keys/{key}/incr or /touch: no other method there
            raise ApiError(405, "method not allowed", f"{method} is not allowed on "
                           f"/v1/keys/{key}; allowed: POST (a key cannot end in '/incr' "
                           "or '/touch')", {"Allow": "POST"})
        if not key:
            raise ApiError(400, "empty key", "the key is empty; name one: /v1/keys/KEY")
        if len(key) > max_key_chars:
            raise ApiError(414, "key too long", f"the key is {len(key)} characters, over "
                           f"the server's limit of {max_key_chars}; use a shorter key "
                           "(or a hash of it)")

    async def read_body(request: Request) -> bytes:
        declared = request.headers.get("content-length")
        if declared is not None:
            try:
                n = int(declared)
            except ValueError:
                raise ApiError(400, "bad Content-Length",
                               f"Content-Length {declared!r} is not a number") from None
            if n > max_body_bytes:
                raise ApiError(413, "value too big", f"the body is {n} bytes, over the "
                               f"server's limit of {max_body_bytes} bytes "
                               "(--max-value-bytes); store it elsewhere")
        chunks: list[bytes] = []
        size = 0

        async def take() -> None:
            nonlocal size
            async for chunk in request.stream():
                size += len(chunk)
                if size > max_body_bytes:
                    raise ApiError(413, "value too big", f"the body passed the server's "
                                   f"limit of {max_body_bytes} bytes (--max-value-bytes) "
                                   "while it arrived; store it elsewhere")
                chunks.append(chunk)
        try:
            if _timeout is not None:
                async with _timeout(request_timeout):
                    await take()
            else:
                await asyncio.wait_for(take(), request_timeout)
        except asyncio.TimeoutError:
            raise ApiError(408, "request timeout", f"the body did not arrive within "
                           f"{request_timeout} s; send it faster or in smaller pieces") from None
        return b"".join(chunks)

    async def call(coro: Any) -> Any:
        try:
            return await coro
        except DurableKVError as exc:
            for cls, status, name in LIBRARY_ERRORS:
                if isinstance(exc, cls):
                    raise ApiError(status, name, str(exc)) from None
            raise

    def value_error(exc: ValueError) -> ApiError:
        if "max_value_bytes" in str(exc):
            return ApiError(413, "value too big", str(exc))
        return ApiError(400, "bad value", str(exc))

    key_path = Path(json_schema_extra=dict(_KEY_DOC, maxLength=max_key_chars))
    ttl_query = Query(None, ge=0, le=MAX_TTL_SECONDS, allow_inf_nan=False,
                      description="seconds until the entry expires (finite, >= 0); "
                      "omit for no expiry")

    put_links = {link: {"operationId": op, "parameters": {"key": "$request.path.key"}}
                 for link, op in (("GetKey", "get_key"), ("HeadKey", "head_key"),
                                  ("DeleteKey", "delete_key"))}

    @app.post("/v1/keys/{key:anykey}/incr", operation_id="incr_key",
              responses={200: {"content": {_JSON: {"schema": {"type": "integer"}}},
                               "description": "the new value"},
                         **_error_docs(400, 409, 414, 422, *_SERVER_ERRORS)})
    async def incr_key(key: str = key_path,
                       delta: int = Query(1, description="int to add (negative subtracts); "
                                          "any size, as the answer: Python ints (a JSON "
                                          "number past 2**53 loses precision in "
                                          "JavaScript: read it as a string there)")) -> Response:
        """Add ``delta`` to the int under ``key`` (a missing key counts from 0)."""
        check_key(key)
        try:
            value = await call(backend.incr(key, delta))
        except TypeError as exc:
            raise ApiError(409, "not an int", str(exc)) from None
        return Response(encode_json(value), media_type=_JSON)

    @app.post("/v1/keys/{key:anykey}/touch", status_code=204, operation_id="touch_key",
              responses={204: {"description": "the entry has its new TTL"},
                         **_error_docs(400, 404, 414, 422, *_SERVER_ERRORS)})
    async def touch_key(key: str = key_path, ttl: float | None = ttl_query) -> Response:
        """Give the live entry under ``key`` a new TTL: ``ttl`` seconds from now,
        or no expiry when ``ttl`` is omitted; ``ttl=0`` removes it. 404 when
        there is no live entry (Redis's ``EXPIRE``/``PERSIST``)."""
        check_key(key)
        try:
            found = await call(backend.touch(key, ttl))
        except ValueError as exc:
            raise ApiError(400, "bad ttl", str(exc)) from None
        if not found:
            raise ApiError(404, "not found", f"no live entry under key {key!r}")
        return Response(status_code=204)

    @app.put("/v1/keys/{key:anykey}", status_code=204, operation_id="put_key",
             responses={204: {"description": "stored", "links": put_links},
                        **_error_docs(400, 405, 408, 412, 413, 414, 422, *_SERVER_ERRORS)},
             openapi_extra={"requestBody": {"required": False, "content": {
                 _JSON: {"schema": {}}, _OCTET: {"schema": {"type": "string",
                                                            "format": "binary"}}}}})
    async def put_key(request: Request, key: str = key_path,
                      ttl: float | None = ttl_query) -> Response:
        """Store the body under ``key``: JSON (``Content-Type: application/json``)
        as its decoded value, anything else as bytes. ``If-None-Match: *``
        stores only when the key is absent (412 otherwise)."""
        check_key(key, "PUT")
        inm = request.headers.get("if-none-match")
        if inm is not None and inm.strip() != "*":
            raise ApiError(400, "bad If-None-Match", f"If-None-Match {inm!r} is not "
                           "supported; send 'If-None-Match: *' to store only when absent")
        body = await read_body(request)
        value = decode_json(body) if _is_json(request.headers.get("content-type")) else body
        try:
            if inm is not None:
                if ttl == 0:
                    raise ApiError(400, "bad ttl", "ttl=0 with If-None-Match: * would "
                                   "store an entry that is already expired")
                if not await call(backend.add(key, value, ttl)):
                    raise ApiError(412, "key exists", f"key {key!r} is present and "
                                   "If-None-Match: * asks to store only when absent")
            else:
                await call(backend.set(key, value, ttl))
        except ValueError as exc:
            raise value_error(exc) from None
        except TypeError as exc:
            raise ApiError(400, "bad value", str(exc)) from None
        return Response(status_code=204)

    @app.get("/v1/keys/{key:anykey}", operation_id="get_key",
             responses={200: {"description": "the value: JSON if it was stored as JSON, "
                              "else the bytes", "content": {
                                  _JSON: {"schema": {}},
                                  _OCTET: {"schema": {"type": "string", "format": "binary"}}}},
                        **_error_docs(400, 404, 405, 406, 414, *_SERVER_ERRORS)})
    async def get_key(key: str = key_path) -> Response:
        """The value under ``key``; 404 when missing or expired."""
        value = await call(backend.get(key, _MISSING))
        if value is _MISSING:
            check_key(key, "GET")
            raise ApiError(404, "not found", f"no live entry under key {key!r}")
        return _value_response(value)

    @app.head("/v1/keys/{key:anykey}", operation_id="head_key", response_class=Response,
              responses={200: {"description": "present"}, 404: {"description": "missing"},
                         400: {"description": "empty key"},
                         405: {"description": "a key ending in /incr or /touch"},
                         414: {"description": "key too long"},
                         **{s: {"description": "cache error"} for s in _SERVER_ERRORS}})
    async def head_key(key: str = key_path) -> Response:
        """200 when a live entry is under ``key``, 404 otherwise (no body)."""
        check_key(key, "HEAD")
        if await call(backend.contains(key)):
            return Response(status_code=200)
        return Response(status_code=404)

    @app.delete("/v1/keys/{key:anykey}", status_code=204, operation_id="delete_key",
                responses={204: {"description": "deleted"},
                           **_error_docs(400, 404, 405, 414, *_SERVER_ERRORS)})
    async def delete_key(key: str = key_path) -> Response:
        """Remove ``key``; 404 when there was no live entry."""
        check_key(key, "DELETE")
        if not await call(backend.delete(key)):
            raise ApiError(404, "not found", f"no live entry under key {key!r}")
        return Response(status_code=204)

    batch_schema = BatchRequest.model_json_schema(ref_template="#/components/schemas/{model}")
    batch_defs = batch_schema.pop("$defs", {})

    @app.post("/v1/batch", operation_id="batch", response_model=BatchResponse,
              responses=_error_docs(400, 408, 413, 415, 422, *_SERVER_ERRORS),
              openapi_extra={"requestBody": {"required": True, "content": {
                  _JSON: {"schema": {"$ref": "#/components/schemas/BatchRequest"}}}}})
    async def batch(request: Request) -> Response:
        """Apply gets, sets and deletes in order; one result per operation
        (``status`` as the single-key route would answer)."""
        if not _is_json(request.headers.get("content-type")):
            raise ApiError(415, "wrong Content-Type", "a batch is JSON: send it with "
                           "Content-Type: application/json")
        try:
            req = BatchRequest.model_validate(decode_json(await read_body(request),
                                                          BATCH_JSON_ADVICE))
        except ValidationError as exc:
            raise ApiError(422, "invalid batch", _validation_detail(exc.errors())) from None
        results = []
        for op in req.ops:
            results.append(await batch_op(op))
        return Response(json.dumps({"results": results}, ensure_ascii=False,
                                   separators=(",", ":")).encode("utf-8", "surrogatepass"),
                        media_type=_JSON)

    async def batch_op(op: BatchOp) -> dict[str, Any]:
        try:
            check_key(op.key)
            if op.op == "get":
                value = await call(backend.get(op.key, _MISSING))
                if value is _MISSING:
                    return {"status": 404}
                if type(value) is bytes:
                    return {"status": 200, "base64": base64.b64encode(value).decode()}
                return {"status": 200, "value": json.loads(encode_json(value))}
            if op.op == "delete":
                return {"status": 204 if await call(backend.delete(op.key)) else 404}
            # An explicit "value": null stores None (JSON null, as a PUT of
            # null does); a set that names no value at all is a mistake, not a
            # request to store null. "base64": null names no bytes.
            has_value = "value" in op.model_fields_set
            if has_value and op.base64 is not None:
                raise ApiError(400, "bad set", "give value or base64, not both")
            if not has_value and op.base64 is None:
                raise ApiError(400, "bad set", 'a set needs "value" (the JSON value to store; '
                               '"value": null stores null) or "base64" (bytes to store); '
                               "this one has neither")
            if op.base64 is not None:
                try:
                    value = base64.b64decode(op.base64, validate=True)
                except ValueError:
                    raise ApiError(400, "bad base64", "base64 is not valid base64") from None
            else:
                value = op.value
            try:
                await call(backend.set(op.key, value, op.ttl))
            except ValueError as exc:
                raise value_error(exc) from None
            except TypeError as exc:
                raise ApiError(400, "bad value", str(exc)) from None
            return {"status": 204}
        except ApiError as exc:
            return {"status": exc.status, "error": f"{exc.error}: {exc.detail}"}

    if callable(getattr(backend, "stats", None)):
        # (a backend without stats(), the benchmark's dict, has no such route)
        @app.get("/v1/stats", operation_id="stats", response_model=CacheStatsBody,
                 responses={200: {"description": "the statistics (Cache.stats())"},
                            **_error_docs(500, 503)})
        async def stats() -> Response:
            """The cache's statistics as JSON (``Cache.stats()``): counters
            since the cache was opened and gauges of its state now. Taken on a
            worker thread; a float that is not finite is null."""
            return Response(_stats_body(await call(backend.stats())), media_type=_JSON)

    @app.get("/metrics", operation_id="metrics",
             responses={200: {"content": {CONTENT_TYPE_LATEST.split(";")[0]: {
                 "schema": {"type": "string"}}}, "description": "Prometheus text format"}})
    async def metrics() -> Response:
        """The cache's metrics and the request metrics, Prometheus text format."""
        run = getattr(backend, "run", None)
        text = await run(generate_latest, registry) if run else generate_latest(registry)
        return Response(text, media_type=CONTENT_TYPE_LATEST)

    @app.get("/healthz", operation_id="healthz",
             responses={200: {"content": {_JSON: {"schema": {
                 "type": "object", "properties": {"status": {"type": "string"}}}}},
                 "description": "alive"}})
    async def healthz() -> Response:
        """Liveness; needs no token."""
        return Response(b'{"status":"ok"}', media_type=_JSON)

    _install_error_handlers(app)
    _install_openapi(app, token is not None, batch_defs)
    app.add_middleware(Gate, token=token, registry=registry, log_access=access_log)
    return app


def _version() -> str:
    from .. import __version__
    return __version__


def _validation_detail(errors: list[dict[str, Any]]) -> str:
    parts = []
    for e in errors[:5]:
        where = ".".join(str(p) for p in e.get("loc", ()))
        parts.append(f"{where}: {e.get('msg')}")
    return "; ".join(parts) or "invalid request"


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> Response:
        return _error_response(exc.status, exc.error, exc.detail, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> Response:
        return _error_response(422, "invalid request", _validation_detail(exc.errors()))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        if exc.status_code == 404:
            return _error_response(404, "no such route", f"{request.url.path!r} is not a "
                                   "route of this server; see /openapi.json")
        if exc.status_code == 405:
            allowed = _allowed_methods(app, request.url.path)
            return _error_response(405, "method not allowed", f"{request.method} is not "
                                   f"allowed on {request.url.path!r}; allowed: "
                                   f"{', '.join(allowed)}", {"Allow": ", ".join(allowed)})
        return _error_response(exc.status_code, "http error", str(exc.detail), exc.headers)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> Response:
        logging.getLogger("durablekv.server").exception("unexpected error on %s %s",
                                                        request.method, request.url.path)
        return _error_response(500, "internal error", f"{type(exc).__name__}; the server "
                               "log has the details")


def _allowed_methods(app: FastAPI, path: str) -> list[str]:
    """The methods of the routes whose path matches (the incr or touch route
    alone when it matches: a key cannot end in /incr or /touch)."""
    routes = [r for r in app.router.routes if getattr(r, "methods", None)
              and getattr(r, "path_regex", None) is not None and r.path_regex.match(path)]
    action = [r for r in routes if r.path_format.endswith(_ACTION_SUFFIXES)]
    return sorted({m for r in (action or routes) for m in r.methods})


class _KeyConvertor(Convertor):
    """A key path parameter: any characters, '/' and newlines included
    (Starlette's ``path`` convertor stops at a newline)."""
    regex = r"[\s\S]*"

    def convert(self, value: str) -> str:
        return value

    def to_string(self, value: str) -> str:
        return value


register_url_convertor("anykey", _KeyConvertor())


def _install_openapi(app: FastAPI, with_token: bool, defs: dict[str, Any]) -> None:
    def openapi() -> dict[str, Any]:
        if app.openapi_schema:
            return app.openapi_schema
        schema = get_openapi(title=app.title, version=app.version,
                             description=app.description, routes=app.routes)
        comps = schema.setdefault("components", {})
        schemas = comps.setdefault("schemas", {})
        schemas.update(defs)
        schemas["BatchRequest"] = BatchRequest.model_json_schema(
            ref_template="#/components/schemas/{model}")
        schemas["BatchRequest"].pop("$defs", None)
        schemas.setdefault("ErrorBody", ErrorBody.model_json_schema())
        if with_token:
            comps["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        for path, item in schema["paths"].items():
            for method, op in item.items():
                if with_token and path != "/healthz":
                    op["security"] = [{"bearer": []}]
                    op["responses"].setdefault("401", {
                        "description": "missing or wrong token",
                        "content": {_JSON: {"schema": {"$ref":
                                                        "#/components/schemas/ErrorBody"}}}})
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
