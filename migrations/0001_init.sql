-- durablekv page store, schema version 1.
-- One row per page: the page's entries packed in one blob (format in durablekv/store.py).
CREATE TABLE pages (
    page_id INTEGER PRIMARY KEY,
    n_entries INTEGER NOT NULL,
    data BLOB NOT NULL
);

-- The key index: canonical key bytes -> the page that holds the entry.
-- `orig` is the key as first stored, when it differs from the canonical form
-- (True or 1.0 stored as a key are found as 1 but listed as themselves).
CREATE TABLE keys (
    key BLOB PRIMARY KEY,
    page_id INTEGER NOT NULL,
    expire_at REAL,
    orig BLOB
) WITHOUT ROWID;
CREATE INDEX keys_by_page ON keys (page_id);
CREATE INDEX keys_by_expiry ON keys (expire_at) WHERE expire_at IS NOT NULL;

-- Settings fixed at creation (page_size, serializer) and state updated by every
-- flush transaction (checkpoint_lsn, key_count, ttl_key_count).
CREATE TABLE meta (
    name TEXT PRIMARY KEY,
    value
) WITHOUT ROWID;
INSERT INTO meta (name, value) VALUES
    ('checkpoint_lsn', 0),
    ('key_count', 0),
    ('ttl_key_count', 0);
