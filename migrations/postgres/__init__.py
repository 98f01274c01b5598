"""Schema migrations of the PostgreSQL page store, applied in order (table dkv_schema)."""
