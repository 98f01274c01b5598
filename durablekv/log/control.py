"""The replay log's control file (``replay.control``): what the log must hold at the next open.

The segments alone cannot show that some are gone: a log whose newest
segments were deleted, or all of whose segments were, reads as a shorter log
(or as a cleanly closed one), and recovery would serve the older values the
store holds. The control file says what a reader must find (as PostgreSQL's
``pg_control`` says where the redo must start, and an XLOG_SWITCH record that a
WAL segment has a successor):

* ``state``: ``"open"`` from the moment a cache's log starts until a clean
  close has checkpointed every record; the close then deletes the file
  (durably, before the segments). ``"open"`` at the next open means a crash:
  the records after the store's checkpoint are in the segments, which must
  exist. (``"closed"`` is read as no file.)
* ``newest``: the first LSN of the newest segment created. It is written
  after the segment is created and before any record goes into it, so that
  segment exists whenever the control file names it (a segment is deleted
  only once sealed, and the newest one never is).
* ``boot_id``: the kernel's boot id when written (Linux:
  ``/proc/sys/kernel/random/boot_id``). While it is unchanged, the machine
  has not restarted, so every record written before a crash is in the files
  (a killed process loses nothing the OS holds). After a restart, records the
  last ``flush_interval`` did not fsync may be gone legitimately (``log``
  mode), so the checks that rely on them are not made.
* ``append``: ``"mmap"`` or ``"write"``, how records reached the newest
  segment. A mapped segment is preallocated in whole steps, so a killed
  process leaves it at a multiple of 4096 bytes: one that is shorter and ends
  in a cut-short record was cut by someone, not torn by a crash.

The file is small JSON (readable with ``cat``), written to a temporary file,
fsynced, renamed over the old one, and the directory fsynced: at open and
at each new segment; a clean close deletes it. A directory without it (made by an
older durablekv) is read as before, without these checks.

:func:`missing_records` is the one place the checks are made: recovery
raises :class:`~durablekv.errors.LogCorruptionError` for what it returns, and
``durablekv check`` reports it as damage.
"""

from __future__ import annotations

import json
import os
from typing import NamedTuple, Sequence

from .._perms import read_private_file, replace_private_file
from .segments import (PREALLOC_ALIGN, _first_lsn_of, map_segment, position_refusal,
                          read_position, segment_name, unmap_segment)

__all__ = ["CONTROL_FILE", "LogControl", "LogLoss", "boot_id", "cut_from_mapped",
           "missing_records", "position_problem", "read_control", "write_control"]

CONTROL_FILE = "replay.control"
_BOOT_ID_PATH = "/proc/sys/kernel/random/boot_id"
_MAX_SIZE = 4096


def boot_id() -> str | None:
    """The running kernel's boot id (changes at every restart), or None where
    the system does not provide one."""
    try:
        with open(_BOOT_ID_PATH, encoding="ascii") as f:
            return f.read().strip() or None
    except OSError:
        return None


class LogControl(NamedTuple):
    """The contents of ``replay.control`` (see the module docstring).

    :ivar state: ``"open"`` or ``"closed"``.
    :ivar newest: first LSN of the newest segment created (its name is
        ``segment_name(newest)``); 0 when none was.
    :ivar append: ``"mmap"`` or ``"write"``: how records reach that segment.
    :ivar durability: the log's durability (``"log"`` or ``"fsync"``).
    :ivar boot_id: the kernel's boot id when written, or None.
    :ivar pid: the process that wrote it.
    """

    state: str
    newest: int
    append: str
    durability: str
    boot_id: str | None
    pid: int

    def same_boot(self) -> bool:
        """Whether the machine has not restarted since this was written (known
        only where the kernel has a boot id)."""
        return self.boot_id is not None and self.boot_id == boot_id()


def write_control(directory: str, control: LogControl) -> None:
    """Replace ``replay.control`` in ``directory`` durably: temporary file,
    fsync, rename, directory fsync.

    :raises OSError: it could not be written (the caller names the file).
    """
    data = json.dumps(control._asdict(), sort_keys=True).encode() + b"\n"
    replace_private_file(os.path.join(directory, CONTROL_FILE), data, durable=True)


def read_control(directory: str) -> tuple[LogControl | None, str | None]:
    """``(control, None)``; ``(None, None)`` when there is no control file;
    ``(None, why)`` when it cannot be read or is not a control file (the
    caller reports ``why``: a damaged control file is damage, since a crash
    never leaves one half-written)."""
    path = os.path.join(directory, CONTROL_FILE)
    raw, why = read_private_file(path, _MAX_SIZE)
    if raw is None:
        return None, why and f"{path}: {why}"
    try:
        d = json.loads(raw.decode("utf-8"))
        control = LogControl(state=d["state"], newest=d["newest"], append=d["append"],
                             durability=d["durability"], boot_id=d["boot_id"], pid=d["pid"])
    except (ValueError, KeyError, TypeError, UnicodeDecodeError):
        return None, (f"{path}: not a replay log control file ({len(raw)} bytes that are not "
                      "the JSON object it holds)")
    if control.state not in ("open", "closed") or type(control.newest) is not int or \
            control.newest < 0 or control.append not in ("mmap", "write") or \
            control.durability not in ("log", "fsync", "sync") or \
            not isinstance(control.boot_id, (str, type(None))) or type(control.pid) is not int:
        return None, f"{path}: holds values no durablekv writes ({raw[:200]!r})"
    return control, None


class LogLoss(NamedTuple):
    """Records the log should hold and does not (see :func:`missing_records`).

    :ivar path: the file where they should be (a segment, possibly missing).
    :ivar offset: byte offset in it (0 for a missing file).
    :ivar detail: what is missing, which LSNs, and why it must have been there.
    """

    path: str
    offset: int
    detail: str


def position_problem(directory: str, segments: Sequence[str], checkpoint: int,
                     spans: dict[str, tuple[int, int] | None]) -> tuple[str, str] | None:
    """``(segment path, why)`` when ``replay.pos`` names a record the
    checkpoint covers and the log does not hold it: its segment is missing,
    or holds no such record (emptied or replaced). None when the position
    checks out, says nothing (missing, damaged, for a checkpoint the store
    does not have, or naming a segment older than the log's first, which a
    checkpoint deleted), or is itself wrong (the log holds that record
    elsewhere: the position is only a hint).

    :param spans: for each segment path, the first and last LSN parsed in
        it (None: no record), as recovery or ``check`` read it.
    """
    pos, _why = read_position(directory)
    if pos is None or pos.lsn > checkpoint:
        return None
    firsts = [_first_lsn_of(p) for p in segments]
    if not firsts or pos.segment_lsn < firsts[0]:
        return None

    def holds(path: str) -> bool:
        span = spans.get(path)
        return span is not None and span[0] <= pos.lsn <= span[1]

    path = os.path.join(directory, segment_name(pos.segment_lsn))
    if pos.segment_lsn not in firsts:
        if any(holds(p) for p in segments):
            return None
        return path, f"that segment is missing (it held LSN {pos.lsn})"
    try:
        data = map_segment(path)
    except FileNotFoundError:  # a segment of nothing but a torn tail, cut as such
        data = b""
    try:
        refusal = position_refusal(data, pos, checkpoint)
    finally:
        unmap_segment(data)
    if refusal is None or any(holds(p) for p in segments):
        return None
    return path, refusal + f", and no segment holds LSN {pos.lsn}"


def missing_records(directory: str, control: LogControl | None, segments: Sequence[str],
                    checkpoint: int, last_lsn: int | None,
                    position_check: tuple[str, str] | None = None) -> LogLoss | None:
    """What the log lacks that ``control`` says it must hold, or None.

    :param segments: the segment paths, oldest first (``list_segments``).
    :param checkpoint: the store's checkpoint LSN.
    :param last_lsn: the LSN of the log's last intact record, or None when
        it holds none.
    :param position_check: ``(segment path, why)`` when ``replay.pos`` names
        a record that is not where it says (``why``), else None.

    Made only when ``control`` says the cache was not closed cleanly. Missing
    files are damage after any crash; a checkpoint past the log's end and a
    position that does not check out only when the machine has not restarted
    since (see :meth:`LogControl.same_boot`).
    """
    if control is None or control.state != "open":
        return None
    firsts = [_first_lsn_of(p) for p in segments]
    newest_name = os.path.join(directory, segment_name(control.newest))
    why_open = (f"{CONTROL_FILE} says the cache was not closed cleanly (opened by process "
                f"{control.pid})")
    if not segments:
        return LogLoss(newest_name, 0, (
            f"no replay log segment is left, but {why_open}, so its segments held every "
            f"record after the store's checkpoint LSN {checkpoint}: the records from LSN "
            f"{checkpoint + 1} on are lost (the newest segment was "
            f"{os.path.basename(newest_name)}); the segments were deleted"))
    if control.newest and control.newest not in firsts:
        later = [f for f in firsts if f > control.newest]
        until = f"to {later[0] - 1}" if later else "on"
        if not later or later[0] - 1 > checkpoint:
            return LogLoss(newest_name, 0, (
                f"the segment {os.path.basename(newest_name)} is missing: {CONTROL_FILE} "
                f"names it as the newest segment created, {why_open}; the records from LSN "
                f"{max(control.newest, checkpoint + 1)} {until}, if any were written, are lost"
                + ("" if later else f" (the log now ends at LSN {last_lsn or firsts[-1] - 1})")))
    end = max(last_lsn or 0, firsts[-1] - 1, control.newest - 1)
    if not control.same_boot():
        return None
    if position_check is not None:
        path, why = position_check
        return LogLoss(path, 0, (
            f"replay.pos says the record the checkpoint covers lies in this segment, but {why}; "
            "the machine has not restarted since the crash, so the segment was emptied, cut "
            f"or replaced: the records after the store's checkpoint LSN {checkpoint} it held "
            "are lost"))
    if checkpoint > end:
        return LogLoss(segments[-1], 0, (
            f"the store's checkpoint is LSN {checkpoint}, past the end of the replay log "
            f"(LSN {end}), and the machine has not restarted since the crash, so no record "
            "can have been lost to it: the log's newest records were removed, or the "
            "checkpoint in pages.sqlite3 was changed (recovery would skip every record up "
            f"to LSN {checkpoint} without applying it)"))
    return None


def cut_from_mapped(control: LogControl | None, path: str, size: int, detail: str) -> str | None:
    """Why damage at the end of the last segment ``path`` (``size`` bytes;
    ``detail`` the parser's words for it) is a cut, not a crash's torn write,
    or None when it may be torn: the control file says records were stored
    into a mapping of this segment (preallocated in
    :data:`~durablekv.log.segments.PREALLOC_ALIGN` steps, so a crash leaves
    it at a multiple of that), yet the file ends off a step boundary, inside
    a record. Recovery and ``durablekv check`` add the words to the damage."""
    if (control is not None and control.state == "open" and control.append == "mmap"
            and _first_lsn_of(path) == control.newest and size % PREALLOC_ALIGN != 0
            and "cut short" in detail):
        return (f"the segment is {size} bytes, but records were stored into a mapping of it "
                f"({CONTROL_FILE}), preallocated in steps of {PREALLOC_ALIGN} bytes, so a "
                "crash leaves it at a multiple of that: the file was cut shorter, and the "
                "records that followed are lost")
    return None
