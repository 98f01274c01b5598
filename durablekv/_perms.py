"""The modes a cache creates its directory and files with.

A cache holds application data, so what it creates is private to its
owner: the directory 0700, every file in it 0600 (``pages.sqlite3``, its
``-wal``/``-shm``, ``replay-*.log`` segments, ``LOCK``, damage markers),
further narrowed by the process umask. A directory that already exists is
never chmodded: its owner chose its mode (e.g. 0750 to share with a group),
and the cache keeps it. See docs/files.md.
"""

DIR_MODE = 0o700
FILE_MODE = 0o600
