"""The Flask-Caching backend on a durablekv :class:`~durablekv.Cache`.

::

    app.config.update(CACHE_TYPE="durablekv.contrib.flask_caching.DurableKVCache",
                      CACHE_DIR="var/cache", CACHE_DEFAULT_TIMEOUT=300,
                      CACHE_THRESHOLD=10_000,
                      CACHE_OPTIONS={"durability": "log"})   # durablekv Cache arguments
    cache = Cache(app)

Flask-Caching builds it through :meth:`DurableKVCache.factory` from
``CACHE_DIR`` (required), ``CACHE_THRESHOLD``, ``CACHE_DEFAULT_TIMEOUT``,
``CACHE_IGNORE_ERRORS`` and ``CACHE_OPTIONS``; ``CACHE_SERIALIZER`` is set
on it by Flask-Caching. The cache itself is
:class:`durablekv.contrib.cachelib.DurableKVCache` (see there, and docs/flask.md).
"""

from __future__ import annotations

from typing import Any

from flask_caching.backends.base import BaseCache as FlaskCachingBaseCache

from ..errors import ConfigError
from . import cachelib as _cachelib

__all__ = ["DurableKVCache"]


class DurableKVCache(_cachelib.DurableKVCache, FlaskCachingBaseCache):
    """:class:`durablekv.contrib.cachelib.DurableKVCache` as a Flask-Caching backend."""

    @classmethod
    def factory(cls, app: Any, config: dict[str, Any], args: list[Any],
                kwargs: dict[str, Any]) -> "DurableKVCache":
        """Flask-Caching's constructor hook: ``CACHE_DIR`` and ``CACHE_THRESHOLD``
        from ``config``; ``kwargs`` holds ``default_timeout``,
        ``ignore_delete_many_errors`` and ``CACHE_OPTIONS``.

        :raises ConfigError: no ``CACHE_DIR``.
        """
        directory = config.get("CACHE_DIR")
        if not directory:
            raise ConfigError("CACHE_TYPE durablekv.contrib.flask_caching.DurableKVCache "
                              "needs CACHE_DIR, the cache directory, e.g. "
                              "app.config['CACHE_DIR'] = 'var/cache'")
        kwargs.setdefault("threshold", config.get("CACHE_THRESHOLD", 500))
        return cls(directory, *args, **kwargs)
