"""A separate process using the Django backend: ``python django_worker.py LOCATION set|get``.

``set`` stores a few values through ``caches["default"]`` and exits (Django
never closes its caches: the backend's exit handler flushes); ``get`` prints
what it finds as JSON.
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from tests.contrib.django_site import configure  # noqa: E402


def main() -> None:
    location, what = sys.argv[1], sys.argv[2]
    configure(location)
    from django.core.cache import caches

    cache = caches["default"]
    if what == "set":
        cache.set("greeting", {"text": "hello", "n": [1, 2]}, None)
        cache.set("hits", 41, None)
        cache.incr("hits")
        cache.set("short", "gone soon", 0)
        if len(sys.argv) > 3 and sys.argv[3] == "kill":
            os.kill(os.getpid(), 9)      # no exit handler: the replay log keeps the writes
    else:
        print(json.dumps({"greeting": cache.get("greeting"), "hits": cache.get("hits"),
                          "short": cache.get("short", "missing")}))


if __name__ == "__main__":
    main()
