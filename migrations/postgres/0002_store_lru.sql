-- durablekv PostgreSQL page store, schema version 2: what Cache(size_limit=)
-- needs (as migrations/0004_store_lru.sql for SQLite). last_use orders a
-- namespace's pages for eviction from the store, least recently used first:
-- the checkpoint LSN of the flush that last wrote the page or recorded that
-- it left the memory tier. data_bytes (in dkv_meta) is the sum of the page
-- blobs' lengths, kept by every flush.
ALTER TABLE dkv_pages ADD COLUMN last_use bigint NOT NULL DEFAULT 0;
CREATE INDEX dkv_pages_by_last_use ON dkv_pages (ns_id, last_use, page_id);
INSERT INTO dkv_meta (ns_id, name, value)
    SELECT ns_id, 'data_bytes', COALESCE(SUM(octet_length(data)), 0)::text
    FROM dkv_pages GROUP BY ns_id
    ON CONFLICT (ns_id, name) DO NOTHING;
