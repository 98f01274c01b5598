"""A small Flask app on the durablekv Flask-Caching backend, for the tests.

``python flask_app.py DIR`` (a separate process) requests ``/stamp`` once
through the test client and prints the body: a response cached by an
earlier process comes back unchanged.
"""

from __future__ import annotations

import os
import sys
import uuid

from flask import Flask
from flask_caching import Cache

CALLS = {"stamp": 0, "square": 0}


def make_app(directory: str, **config: object) -> tuple[Flask, Cache]:
    app = Flask(__name__)
    app.config.update(CACHE_TYPE="durablekv.contrib.flask_caching.DurableKVCache",
                      CACHE_DIR=directory, CACHE_DEFAULT_TIMEOUT=60, **config)
    cache = Cache(app)

    @app.route("/stamp")
    @cache.cached(timeout=30)
    def stamp():
        CALLS["stamp"] += 1
        return f"stamp {uuid.uuid4().hex}"

    @cache.memoize(timeout=30)
    def square(n: int) -> int:
        CALLS["square"] += 1
        return n * n

    app.square = square          # for the tests
    return app, cache


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__)))))
    app, _ = make_app(sys.argv[1])
    print(app.test_client().get("/stamp").get_data(as_text=True))
