"""``python aiocache_worker.py DIR set|get``: the aiocache backend in a process of its own."""

from __future__ import annotations

import asyncio
import json
import sys

from aiocache import Cache

from durablekv.contrib.aiocache import DurableKVCache


async def main(directory: str, what: str) -> None:
    cache = Cache(DurableKVCache, directory=directory, namespace="w:")
    if what == "set":
        await cache.set("user", {"name": "Ada"})
        await cache.increment("hits", 41)
        await cache.increment("hits")
    else:
        print(json.dumps({"user": await cache.get("user"), "hits": await cache.get("hits")}))


asyncio.run(main(sys.argv[1], sys.argv[2]))
