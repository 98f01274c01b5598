"""Adds durablekv to aiocache's acceptance `cache` fixture (tests/acceptance/conftest.py)."""

import sys
from pathlib import Path

path = Path(sys.argv[1])
text = path.read_text()
fixture = '''@pytest.fixture
async def durablekv_cache(tmp_path):
    from durablekv.contrib.aiocache import DurableKVCache
    async with Cache(DurableKVCache, directory=str(tmp_path / "dkv"), namespace="test") as cache:
        yield cache
        await asyncio.gather(*(cache.delete(k) for k in (*Keys, KEY_LOCK)))


'''
old = '''        "memory_cache",
        pytest.param("memcached_cache"'''
assert old in text, "aiocache's acceptance conftest changed: update this patch"
text = text.replace(old, '''        "durablekv_cache",
        pytest.param("memcached_cache"''')
text = text.replace("@pytest.fixture(\n    params=(", fixture + "@pytest.fixture(\n    params=(", 1)
path.write_text(text)
