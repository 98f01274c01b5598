-- durablekv page store, schema version 2: no table changes.
-- Pages are now written in the columnar version-2 blob format (see
-- durablekv/store.py); version-1 pages stay readable. The version bump makes
-- an older durablekv refuse a store that may hold version-2 pages (it would
-- misread them) instead of reporting it as damaged.
SELECT 1;
