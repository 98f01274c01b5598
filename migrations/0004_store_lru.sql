-- durablekv page store, schema version 4: what Cache(size_limit=) needs.
-- last_use orders pages for eviction from the store, least recently used
-- first: the checkpoint LSN of the flush that last wrote the page or
-- recorded that it left the memory tier (pages in memory are never evicted,
-- so among the others the one that left memory first is the least recently
-- used). Existing pages start at 0, oldest. data_bytes is the sum of the
-- page blobs' lengths, kept by every flush (stats().store_data_bytes).
ALTER TABLE pages ADD COLUMN last_use INTEGER NOT NULL DEFAULT 0;
CREATE INDEX pages_by_last_use ON pages (last_use, page_id);
INSERT INTO meta (name, value) SELECT 'data_bytes', coalesce(sum(length(data)), 0) FROM pages;
