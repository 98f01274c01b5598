"""The file under the SQLite page store: its name, the damage marker, the header
check, the packaged migrations, and the one place ``sqlite3.Error`` becomes a
:mod:`durablekv.errors` exception (:func:`_translate`).

:mod:`durablekv.check` and the command line use these without opening a store.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pwd
import shlex
import sqlite3
import stat
import time
from pathlib import Path
from typing import Any, Iterator

from .._perms import FILE_MODE
from ..errors import ConfigError, CorruptStoreError, StoreError
from ..log.replaylog import _fsync_dir
from .base import ordered_migrations

log = logging.getLogger("durablekv.store")

__all__ = ["STORE_FILE", "DAMAGE_MARKER", "check_store_files", "mark_damaged", "migration_files",
           "read_only_uri", "move_aside", "stored_meta", "stored_serializer"]


STORE_FILE = "pages.sqlite3"
#: Left beside the store when damage is found while the cache runs, so the
#: next open refuses the store (or rebuilds it) instead of trusting it.
DAMAGE_MARKER = STORE_FILE + ".damaged"


def migration_files() -> list[tuple[int, str, str]]:
    """The packaged migrations as ``(version, name, sql)``, in order."""
    try:
        from importlib.resources import files
        root: Any = files("durablekv.migrations")
        items = [p for p in root.iterdir() if p.name.endswith(".sql")]
    except ModuleNotFoundError:  # pragma: no cover - running from a source tree
        root = Path(__file__).resolve().parents[2] / "migrations"
        items = list(root.glob("*.sql"))
    return ordered_migrations(items)


def check_store_files(directory: str) -> None:
    """Refuse, before SQLite opens it, a store a cache could open but not use:
    ``pages.sqlite3`` that is not a file (a directory in its place), or that
    file or an existing ``-wal``/``-shm`` that this user may not read and
    write. SQLite opens a file it may not write read-only without a word;
    the cache would then fail at every write-behind flush, and at close.
    Whether this user may is :func:`os.access`'s answer (root may write a
    0444 file, and is let through), not the mode bits.

    :raises ConfigError: naming the file(s) and the fix.
    """
    path = os.path.join(directory, STORE_FILE)
    if os.path.exists(path) and not os.path.isfile(path):
        what = "a directory" if os.path.isdir(path) else "not a regular file"
        raise ConfigError(f"cannot use cache directory {directory!r}: {path!r} is {what}, where "
                          f"the cache keeps its SQLite store; move it away (the cache then "
                          "starts a new store), or name another cache directory")
    names = [n for n in (STORE_FILE, STORE_FILE + "-wal", STORE_FILE + "-shm")
             if os.path.exists(os.path.join(directory, n))
             and not _may_read_and_write(os.path.join(directory, n))]
    if not names:
        return
    listed, owners = [], set()
    for n in names:
        st = os.stat(os.path.join(directory, n))
        owner = _user_name(st.st_uid)
        owners.add(owner)
        listed.append(f"{n} (mode {stat.S_IMODE(st.st_mode):04o}, owner {owner})")
    me = _user_name(os.geteuid())
    paths = " ".join(shlex.quote(os.path.join(directory, n)) for n in names)
    them = "it" if len(names) == 1 else "them"
    others = " or ".join(sorted(owners - {me}))
    if others:
        fix = (f"As {others}, give {them} to this user (chown {shlex.quote(me)} {paths}), "
               f"or open the cache as {others}")
    else:
        fix = f"Make {them} readable and writable: chmod u+rw {paths}"
    raise ConfigError(f"cannot use cache directory {directory!r}: this user ({me}) may not read "
                      f"and write {' and '.join(listed)}; a cache needs a directory this user "
                      "may read and write, and the files in it too (SQLite would open the "
                      f"store read-only, and every write-behind flush would fail). {fix}")


def _may_read_and_write(path: str) -> bool:
    effective = os.access in os.supports_effective_ids
    return os.access(path, os.R_OK | os.W_OK, effective_ids=effective)


def _user_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)  # (no name: the number, which chown takes too)


def _cannot_open_hint(path: str, msg: str) -> str:
    """The likely causes and fix for SQLite errors that say a file cannot
    be opened or written (empty for any other message)."""
    low = msg.lower()
    if "unable to open database file" not in low and "readonly database" not in low:
        return ""
    directory = os.path.dirname(path) or "."
    return (f"; SQLite could not open or create {os.path.basename(path)} (or its -wal or "
            f"-shm file) in {directory!r} for writing. Likely causes: permissions (the owner "
            "and mode of the directory and of those files), a read-only or immutable "
            "directory or file system (a read-only mount, chattr +i), a symlink pointing "
            "nowhere, or a full or failing disk. Fix that and open the cache again, or "
            "open a cache in a writable directory")


@contextlib.contextmanager
def _translate(path: str, what: str) -> Iterator[None]:
    try:
        yield
    except sqlite3.DatabaseError as exc:
        msg = str(exc)
        if isinstance(exc, sqlite3.OperationalError) and not _looks_corrupt(msg):
            raise StoreError(f"{what} on page store {path!r} failed: {msg}"
                             f"{_cannot_open_hint(path, msg)}", path) from exc
        if isinstance(exc, sqlite3.DatabaseError) and _looks_corrupt(msg):
            mark_damaged(path, msg)
            raise CorruptStoreError(path, msg) from exc
        raise StoreError(f"{what} on page store {path!r} failed: {msg}", path) from exc


def _fsync_parent(path: str) -> None:
    """fsync the directory holding ``path`` (a new name in it), where the
    file system can (some cannot fsync a directory)."""
    _fsync_dir(os.path.dirname(path) or ".")


def _remove_orphans(path: str) -> None:
    """Before a new store is made at ``path``: remove what a store that is
    gone left beside it (deleted to reset a cache, say). SQLite would apply
    an old ``-wal`` to the new file, and an old damage marker would refuse
    the new store at its next open."""
    gone = [path + s for s in ("-wal", "-shm", ".damaged") if os.path.exists(path + s)]
    for leftover in gone:
        os.unlink(leftover)
    if gone:
        log.warning("%s is gone; removed what it left (%s) before making a new store",
                    path, ", ".join(map(os.path.basename, gone)))


def _nonempty(path: str) -> bool:
    try:
        return os.path.getsize(path) > 0
    except OSError:
        return False


def mark_damaged(path: str, detail: str) -> None:
    """Record that the store at ``path`` was found damaged (best effort)."""
    try:
        with open(path + ".damaged", "a", encoding="utf-8",
                  opener=lambda p, flags: os.open(p, flags, FILE_MODE)) as f:
            f.write(detail.replace("\n", " ") + "\n")
    except OSError:
        log.error("could not write the damage marker beside %s", path)


def _looks_corrupt(msg: str) -> bool:
    m = msg.lower()
    return ("malformed" in m or "not a database" in m or "file is encrypted" in m
            or "corrupt" in m)


def _check_header(path: str) -> None:
    """O(1) checks of a store file before SQLite opens it: the magic string,
    and (when no WAL is pending) a file shorter than its header says, which
    is what a truncated copy or a torn file-system write leaves."""
    with open(path, "rb") as f:
        head = f.read(100)
        size = os.fstat(f.fileno()).st_size
    if head[:16] != b"SQLite format 3\x00":
        raise CorruptStoreError(path, "the file does not start with the SQLite header")
    if len(head) < 100:
        raise CorruptStoreError(path, f"the file is only {size} bytes long")
    page = int.from_bytes(head[16:18], "big")
    page = 65536 if page == 1 else page
    n_pages = int.from_bytes(head[28:32], "big")
    valid_for = int.from_bytes(head[92:96], "big")
    change = int.from_bytes(head[24:28], "big")
    wal = path + "-wal"
    wal_pending = os.path.exists(wal) and os.path.getsize(wal) > 0
    if page < 512 or page & (page - 1):
        raise CorruptStoreError(path, f"the header names an impossible page size {page}")
    if not wal_pending and valid_for == change and n_pages and size < n_pages * page:
        raise CorruptStoreError(path, f"the file is {size} bytes but its header says "
                                f"{n_pages} pages of {page} bytes (truncated)")


def read_only_uri(path: str, immutable: bool = False) -> str:
    """An SQLite URI that opens ``path`` read-only. The path is
    percent-encoded: a ``#`` or ``?`` in a directory name would otherwise
    end the path, and SQLite would open (and create) a different file."""
    import pathlib
    uri = pathlib.Path(os.path.abspath(path)).as_uri() + "?mode=ro"
    return uri + "&immutable=1" if immutable else uri


def _norm_codec(name: str) -> str:
    return "safe" if name in ("safe", "json") else name


def _statements(sql: str) -> Iterator[str]:
    buf = ""
    for line in sql.splitlines(keepends=True):
        if line.lstrip().startswith("--"):
            continue
        buf += line
        if sqlite3.complete_statement(buf):
            if buf.strip():
                yield buf.strip()
            buf = ""
    if buf.strip():
        raise RuntimeError(f"incomplete SQL statement in migration: {buf.strip()[:60]!r}")


def move_aside(path: str) -> str:
    """Move the damaged store ``path`` (with its WAL, shared memory and damage
    marker) to ``<path>.corrupt-<time>``, a name no store has; return it."""
    stamp = time.strftime("%Y%m%dT%H%M%S")
    aside = f"{path}.corrupt-{stamp}"
    n = 1
    while os.path.exists(aside):
        n += 1
        aside = f"{path}.corrupt-{stamp}-{n}"
    # The WAL first, the damage marker last: a kill in between must not
    # leave the damaged store's WAL for the new store to apply, and must
    # leave the damaged store marked while it is still in place.
    for suffix in ("-wal", "-shm"):
        if os.path.exists(path + suffix):
            os.replace(path + suffix, aside + suffix)
    os.replace(path, aside)
    if os.path.exists(path + ".damaged"):
        os.replace(path + ".damaged", aside + ".damaged")
    return aside


def stored_serializer(directory: str) -> str | None:
    """The serializer a store was created with (its meta table), read
    without opening the cache; None when there is no store to read it from.
    A store that cannot be read is left for the open to report."""
    if not os.path.isfile(os.path.join(directory, STORE_FILE)):
        return None
    value = stored_meta(directory, "serializer")
    return "safe" if value is None else str(value)


def stored_meta(directory: str, name: str) -> Any:
    """A setting from a store's meta table, read without opening the cache;
    None when there is no store, no such row, or the store cannot be read."""
    path = os.path.join(directory, STORE_FILE)
    if not os.path.isfile(path):
        return None
    try:
        conn = sqlite3.connect(read_only_uri(path), uri=True)
        try:
            row = conn.execute("SELECT value FROM meta WHERE name = ?", (name,)).fetchone()
        finally:
            conn.close()
    except sqlite3.DatabaseError:
        return None
    return row[0] if row else None
