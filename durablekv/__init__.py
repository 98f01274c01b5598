"""durablekv: an embedded Python cache that survives restarts.

Reads come from a bounded memory tier of fixed-size pages; every write is
appended to a replay log before it returns and written behind, in batches,
into a SQLite page store. See README.md and docs/architecture.md.
"""

from .cache import Cache
from .sharded import ShardedCache
from .errors import (CacheClosedError, CacheFailedError, CacheLockedError, CacheNotOpenError,
                     ConfigError, CorruptStoreError, DurableKVError, FlushTimeoutError, HeldKeyError,
                     LogCorruptionError, LogError, LogFileGoneError, LogWriteError,
                     MetricsServeError, NamespaceLockedError,
                     SchemaVersionError, StoreError, TraceFormatError, WriteBehindError)
from .errors import (RemoteAuthError, RemoteError, RemoteTypeError, RemoteValueError,
                     ServerUnavailableError)
from .stats import CacheStats
from ._accel import Acceleration, accelerated

__version__ = "0.1.0"

__all__ = [
    "Cache",
    "ShardedCache",
    "CacheStats",
    "Acceleration",
    "accelerated",
    "DurableKVError",
    "CacheLockedError",
    "NamespaceLockedError",
    "CacheClosedError",
    "CacheNotOpenError",
    "CacheFailedError",
    "ConfigError",
    "StoreError",
    "CorruptStoreError",
    "SchemaVersionError",
    "HeldKeyError",
    "LogError",
    "LogCorruptionError",
    "LogFileGoneError",
    "LogWriteError",
    "WriteBehindError",
    "FlushTimeoutError",
    "TraceFormatError",
    "MetricsServeError",
    "RemoteError",
    "RemoteAuthError",
    "RemoteValueError",
    "RemoteTypeError",
    "ServerUnavailableError",
    "__version__",
]


def __getattr__(name: str) -> object:
    """diskcache's other front doors, which durablekv does not have (see
    docs/diskcache.md): a lookup says what to use instead."""
    if name == "FanoutCache":
        # An AttributeError, so hasattr() and getattr(durablekv, name, None)
        # keep working; ``from durablekv import FanoutCache`` turns it into
        # Python's own "cannot import name" (docs/diskcache.md has the way).
        raise AttributeError(
            "durablekv has no FanoutCache; its ShardedCache is the same idea: "
            "ShardedCache(directory, shards=8) spreads keys over that many Cache shards in "
            "subdirectories, with the Cache API (from durablekv import ShardedCache; "
            "docs/sharding.md)", name=name)
    raise AttributeError(f"module 'durablekv' has no attribute {name!r}", name=name)
