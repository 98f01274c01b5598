"""The directory lock: one process owns a cache directory at a time.

``LOCK`` holds an ``fcntl`` lock (and the owner's pid, for error messages);
the directory itself is locked too, so a directory renamed or replaced while
open is noticed. :mod:`durablekv.check` takes the same lock shared.
"""

from __future__ import annotations

import fcntl
import os

from ._perms import FILE_MODE
from .errors import CacheLockedError


LOCK_FILE = "LOCK"


def _acquire_dir_lock(path: str) -> tuple[int, int]:
    """Take the ownership lock of cache directory ``path``: ``(dir_fd, lock_fd)``.

    The lock is an exclusive ``flock`` on the directory itself (an open
    descriptor of it), which no file deletion can take away: deleting
    ``LOCK`` under a live owner no longer lets a second process in. ``LOCK``
    only names the owner's pid (and is flocked too, so that a durablekv from
    before this lock still sees the directory as taken).

    :raises CacheLockedError: another open file description holds it (a
        process, or another Cache in this one).
    """
    lock_path = os.path.join(path, LOCK_FILE)
    dir_fd = lock_directory(path, exclusive=True)
    fd = None
    # Everything after the lock is taken is undone on any exception, one
    # from a signal handler (Ctrl-C) too: else the lock stayed held.
    try:
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, FILE_MODE)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise CacheLockedError(path, lock_owner_pid(fd)) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    except BaseException:
        try:
            if fd is not None:
                os.close(fd)
        finally:
            _unlock_directory(dir_fd)
        raise
    return dir_fd, fd


def lock_directory(path: str, *, exclusive: bool) -> int:
    """``flock`` the directory ``path`` itself (exclusive: an owner; shared:
    ``durablekv check``), without waiting; returns the descriptor to keep.

    :raises CacheLockedError: it is held in a conflicting mode; names the
        pid in ``LOCK`` when there is one.
    """
    dir_fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(dir_fd, (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(dir_fd)
        raise CacheLockedError(path, _lock_file_pid(path)) from None
    except BaseException:
        os.close(dir_fd)
        raise
    return dir_fd


def _unlock_directory(dir_fd: int) -> None:
    try:
        fcntl.flock(dir_fd, fcntl.LOCK_UN)
    finally:
        os.close(dir_fd)


def _lock_file_pid(path: str) -> int | None:
    """The pid in directory ``path``'s ``LOCK`` file, or None."""
    try:
        fd = os.open(os.path.join(path, LOCK_FILE), os.O_RDONLY)
    except OSError:
        return None
    try:
        return lock_owner_pid(fd)
    finally:
        os.close(fd)


def lock_owner_pid(fd: int) -> int | None:
    """The pid the owner of a cache directory wrote into its ``LOCK`` file
    (open as ``fd``), or None when there is none to read (the file is empty:
    the owner is between taking the lock and writing its pid)."""
    try:
        return int(os.pread(fd, 32, 0).split()[0])
    except (ValueError, IndexError, OSError):
        return None


def _release_dir_lock(fds: tuple[int, int]) -> None:
    dir_fd, fd = fds
    try:
        try:
            os.ftruncate(fd, 0)
            fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)
    finally:
        _unlock_directory(dir_fd)

