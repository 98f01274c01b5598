"""The modes a cache creates its directory and files with.

A cache holds application data, so what it creates is private to its
owner: the directory 0700, every file in it 0600 (``pages.sqlite3``, its
``-wal``/``-shm``, ``replay-*.log`` segments, ``LOCK``, damage markers),
further narrowed by the process umask. A directory that already exists is
never chmodded: its owner chose its mode (e.g. 0750 to share with a group),
and the cache keeps it. See docs/files.md.
"""

import os

DIR_MODE = 0o700
FILE_MODE = 0o600


def replace_private_file(path: str, data: bytes) -> None:
    """Replace the file ``path`` with ``data``: written to ``path + ".tmp"``
    (mode :data:`FILE_MODE`, never following a symlink), then renamed over
    ``path``, without an fsync. For the hint files (``resident.list``,
    ``replay.pos``): a killed process leaves the old file or the new one
    whole; after a power loss either may be gone or empty, which their
    readers treat as no hint.

    :raises OSError: it could not be written.
    """
    tmp = path + ".tmp"
    try:
        os.unlink(tmp)  # left by a killed save, or put there by someone else
    except FileNotFoundError:
        pass
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, FILE_MODE)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
    finally:
        os.close(fd)
    os.replace(tmp, path)
