"""durablekv: an embedded Python cache that survives restarts.

Reads come from a bounded memory tier of fixed-size pages; every write is
appended to a replay log before it returns and written behind, in batches,
into a SQLite page store. See README.md and docs/architecture.md.
"""

from .cache import Cache
from .sharded import ShardedCache
from .errors import (CacheClosedError, CacheFailedError, CacheLockedError, ConfigError,
                     CorruptStoreError, DurableKVError, FlushTimeoutError, HeldKeyError,
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
