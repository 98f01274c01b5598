"""Django's own cache tests (tests/cache/tests.py of Django's source) against
durablekv's backend: BaseCacheTests, as every built-in backend runs them, with
FileBasedCacheTests' setup (a fresh LOCATION per test, deleted after it) and
its directory tests."""

import shutil
import tempfile

from django.conf import settings
from django.core.signals import setting_changed
from django.test import TestCase, override_settings

from . import tests as django_cache_tests
from .tests import BaseCacheTests, caches_setting_for_tests


@override_settings(CACHES=caches_setting_for_tests(
    BACKEND="durablekv.contrib.django.DurableKVCache"))
class DurableKVCacheTests(BaseCacheTests, TestCase):
    def setUp(self):
        super().setUp()
        self.dirname = tempfile.mkdtemp()
        for cache_params in settings.CACHES.values():
            cache_params["LOCATION"] = self.dirname
        setting_changed.send(self.__class__, setting="CACHES", enter=False)

    def tearDown(self):
        super().tearDown()
        shutil.rmtree(self.dirname)

    # FileBasedCacheTests' directory tests (the class itself is not named
    # here: a TestCase in this module's namespace would run too)
    _file = vars(django_cache_tests)["FileBasedCacheTests"]
    test_ignores_non_cache_files = _file.test_ignores_non_cache_files
    test_clear_does_not_remove_cache_dir = _file.test_clear_does_not_remove_cache_dir
    test_creates_cache_dir_if_nonexistent = _file.test_creates_cache_dir_if_nonexistent
    test_cache_dir_permissions = _file.test_cache_dir_permissions
    del _file
