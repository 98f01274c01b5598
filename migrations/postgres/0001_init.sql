-- durablekv PostgreSQL page store, schema version 1.
-- Every table is keyed by namespace: many caches share one database, each
-- owning its namespace (a session advisory lock on (classid, ns_id)).
-- The page blobs are the same bytes as in the SQLite store (format in
-- durablekv/store.py), opaque here (bytea).

CREATE TABLE dkv_namespaces (
    ns_id serial PRIMARY KEY,
    name text NOT NULL UNIQUE
);

-- One row per non-empty page; crc as durablekv.store.page_crc (CRC-32 of
-- page id, entry count and blob), checked when the page is read.
CREATE TABLE dkv_pages (
    ns_id integer NOT NULL REFERENCES dkv_namespaces,
    page_id bigint NOT NULL,
    n_entries integer NOT NULL,
    data bytea NOT NULL,
    crc bigint NOT NULL,
    PRIMARY KEY (ns_id, page_id)
);

-- The key index: canonical key bytes -> the page that holds the entry;
-- `orig` is the key as first stored when it differs from the canonical form.
CREATE TABLE dkv_keys (
    ns_id integer NOT NULL REFERENCES dkv_namespaces,
    key bytea NOT NULL,
    page_id bigint NOT NULL,
    expire_at double precision,
    orig bytea,
    PRIMARY KEY (ns_id, key)
);
CREATE INDEX dkv_keys_by_page ON dkv_keys (ns_id, page_id);
CREATE INDEX dkv_keys_by_expiry ON dkv_keys (ns_id, expire_at) WHERE expire_at IS NOT NULL;

-- Settings fixed at creation (page_size, serializer) and state set by every
-- flush transaction (checkpoint_lsn, key_count, ttl_key_count, flush_seq).
CREATE TABLE dkv_meta (
    ns_id integer NOT NULL REFERENCES dkv_namespaces,
    name text NOT NULL,
    value text NOT NULL,
    PRIMARY KEY (ns_id, name)
);

-- durability="sync": the replay log's records, committed before a write
-- returns; rows at or below the checkpoint are deleted by later flushes.
CREATE TABLE dkv_log (
    ns_id integer NOT NULL REFERENCES dkv_namespaces,
    lsn bigint NOT NULL,
    record bytea NOT NULL,
    PRIMARY KEY (ns_id, lsn)
);
