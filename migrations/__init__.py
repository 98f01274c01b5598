"""Schema migrations of the SQLite page store, applied in order (PRAGMA user_version)."""
