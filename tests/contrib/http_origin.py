"""A loopback HTTP origin for the requests-cache tests: it counts what it
receives and answers what each path asks for.

- ``/plain``: 200, a body with a fresh token, no caching headers.
- ``/etag``: 200 with ``ETag`` and ``Cache-Control: no-cache`` (revalidate
  every time); 304 to a matching ``If-None-Match``.
- ``/flaky``: 200 while ``origin.fail`` is False, else 500.
- ``/json``: 200, ``application/json``.
"""

from __future__ import annotations

import json
import threading
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class Origin:
    """``with Origin() as o: requests.get(o.url("/plain"))``; ``o.hits[path]``
    counts requests, ``o.seen[path]`` keeps their headers."""

    def __init__(self) -> None:
        self.hits: dict[str, int] = {}
        self.seen: dict[str, list[dict[str, str]]] = {}
        self.fail = False
        origin = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                path = self.path.split("?", 1)[0]
                origin.hits[path] = origin.hits.get(path, 0) + 1
                origin.seen.setdefault(path, []).append(dict(self.headers))
                if path == "/etag":
                    if self.headers.get("If-None-Match") == '"v1"':
                        return self.answer(304, b"", {"ETag": '"v1"'})
                    return self.answer(200, b"etag body", {"ETag": '"v1"',
                                                           "Cache-Control": "no-cache"})
                if path == "/flaky" and origin.fail:
                    return self.answer(500, b"down", {})
                if path == "/json":
                    return self.answer(200, json.dumps({"n": origin.hits[path]}).encode(),
                                       {"Content-Type": "application/json"})
                self.answer(200, f"{path} {uuid.uuid4().hex}".encode(), {})

            def answer(self, status: int, body: bytes, headers: dict[str, str]) -> None:
                self.send_response(status)
                for k, v in headers.items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}{path}"

    def __enter__(self) -> "Origin":
        self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=10)
