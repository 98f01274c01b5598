"""cachelib's generic cache tests (tests/ of its source) against durablekv's backend."""

import pytest
from clear import ClearTests
from common import CommonTests
from has import HasTests
from serializer import SerializerTests

from durablekv.contrib.cachelib import DurableKVCache


@pytest.fixture(autouse=True)
def cache_factory(request, tmpdir):
    def _factory(self, *args, **kwargs):
        return DurableKVCache(str(tmpdir), *args, **kwargs)

    request.cls.cache_factory = _factory


class TestDurableKVCache(CommonTests, ClearTests, HasTests, SerializerTests):
    pass
