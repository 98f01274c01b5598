-- durablekv page store, schema version 3: a checksum on every page.
-- crc is CRC-32 (zlib) of the page's id and entry count (<qI, little-endian)
-- followed by its blob (durablekv.store.page_crc). It is verified whenever a
-- page is read (page fault, scan, recovery, `durablekv check`), so a flipped
-- bit in a stored page is found as damage instead of served as another value.
-- durablekv_page_crc is registered on the migrating connection by
-- SQLitePageStore; existing pages get their checksum here, in the migration's
-- transaction. An older durablekv refuses the store from now on.
ALTER TABLE pages ADD COLUMN crc INTEGER NOT NULL DEFAULT -1;
UPDATE pages SET crc = durablekv_page_crc(page_id, n_entries, data);
