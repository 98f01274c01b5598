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


def replace_private_file(path: str, data: bytes, durable: bool = False) -> None:
    """Replace the file ``path`` with ``data``: written to ``path + ".tmp"``
    (mode :data:`FILE_MODE`, never following a symlink), then renamed over
    ``path``. For the hint files (``resident.list``, ``replay.pos``), without
    an fsync: a killed process leaves the old file or the new one whole;
    after a power loss either may be gone or empty, which their readers
    treat as no hint. ``durable`` (``replay.control``): the file is fsynced
    before the rename and the directory after it, so the new file is on disk
    when this returns.

    :raises OSError: it could not be written (or, ``durable``, fsynced).
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
        if durable:
            os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    if durable:
        dfd = os.open(os.path.dirname(path) or ".", os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)


def read_private_file(path: str, limit: int) -> tuple[bytes | None, str | None]:
    """The bytes of the small file ``path`` (at most ``limit + 1`` read, so a
    caller sees one that is too long): ``(data, None)``, ``(None, None)`` when
    it does not exist, ``(None, why)`` when it cannot be read or is not a
    regular file. Never follows a symbolic link, never blocks on a FIFO."""
    import stat
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return None, None
    except OSError as exc:
        return None, f"cannot read it ({exc.strerror})"
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None, "it is not a regular file"
        return os.read(fd, limit + 1), None
    except OSError as exc:
        return None, f"cannot read it ({exc.strerror})"
    finally:
        os.close(fd)
