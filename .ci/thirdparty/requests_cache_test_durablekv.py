"""requests-cache's BaseStorageTest and BaseCacheTest (tests/integration of its
source) against durablekv's backend."""

from durablekv.contrib.requests_cache import DurableKVBackend, DurableKVDict
from tests.integration.base_cache_test import BaseCacheTest
from tests.integration.base_storage_test import BaseStorageTest


class TestDurableKVDict(BaseStorageTest):
    storage_class = DurableKVDict
    picklable = True
    init_kwargs = {"use_temp": True}


class TestDurableKVBackend(BaseCacheTest):
    backend_class = DurableKVBackend
    init_kwargs = {"use_temp": True}
