"""Flask-Caching's GenericCacheTests (tests/test_backend_cache.py of its source)
against durablekv's backend; real sleeps, as for its Redis and Memcached backends."""

import pytest

from durablekv.contrib.flask_caching import DurableKVCache
from test_backend_cache import GenericCacheTests


class TestDurableKVCache(GenericCacheTests):
    _can_use_fast_sleep = False

    @pytest.fixture
    def make_cache(self, tmpdir):
        return lambda **kw: DurableKVCache(cache_dir=str(tmpdir), **kw)
