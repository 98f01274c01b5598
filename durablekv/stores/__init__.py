"""Page stores other than the SQLite one in :mod:`durablekv.store`."""
