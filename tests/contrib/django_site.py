"""A small Django site for the backend's tests: settings, views and URLs.

``configure(location)`` sets Django up once per process with two cache
aliases on durablekv (``default`` at ``location``, ``other`` beside it) and
the per-site cache middleware; the views are in :mod:`.django_urls`.
"""

from __future__ import annotations

import os

BACKEND = "durablekv.contrib.django.DurableKVCache"


def caches(location: str, **default: object) -> dict:
    return {
        "default": {"BACKEND": BACKEND, "LOCATION": location, "TIMEOUT": 300, **default},
        "other": {"BACKEND": BACKEND, "LOCATION": os.path.join(location, "..", "other")},
    }


def configure(location: str) -> None:
    import django
    from django.conf import settings

    if settings.configured:
        return
    settings.configure(
        DEBUG=False, SECRET_KEY="durablekv-tests", ALLOWED_HOSTS=["testserver"],
        ROOT_URLCONF="tests.contrib.django_urls", USE_TZ=True, INSTALLED_APPS=[],
        CACHES=caches(location),
        MIDDLEWARE=["django.middleware.cache.UpdateCacheMiddleware",
                    "django.middleware.common.CommonMiddleware",
                    "django.middleware.cache.FetchFromCacheMiddleware"],
        CACHE_MIDDLEWARE_SECONDS=60, CACHE_MIDDLEWARE_KEY_PREFIX="site",
    )
    django.setup()
