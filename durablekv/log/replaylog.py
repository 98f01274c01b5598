"""The replay log: every set and delete, appended before the call returns.

This is a redo log in the sense of a database WAL (PostgreSQL's WAL, InnoDB's
redo log): the memory tier and the SQLite store are rebuilt from it after a
crash. Records carry a log sequence number (LSN); the store keeps the LSN of
its last checkpoint, and recovery re-applies every record after it, in LSN
order. Applying a record whose change already reached SQLite is harmless
(last writer wins).

On-disk format: :mod:`durablekv.log.segments` (its module docstring is the
format spec); this module is the stateful log over those segments.

Recovery (:meth:`ReplayLog.recover`) reads the segments in order. A damaged
record at the very end of the last segment (cut short, zero-filled, or a bad
CRC on the final record) is a torn write from a crash: it is cut off (the
file is truncated and fsynced), logged and counted. A damaged record
anywhere else, or an LSN gap (a segment missing or out of order), raises :class:`~durablekv.errors.LogCorruptionError` with the
path and offset, unless recovery runs with ``salvage=True``, which keeps the
good prefix and gives up on the rest: the damaged segment and every later
one are moved aside (``*.damaged``) by :meth:`ReplayLog.set_aside`, which the
caller runs only once the kept records are in the store (the damaged segment
holds the only copy of them until then). Damage that can hide no record
the store lacks is stepped over: the record behind it is at or below the
checkpoint, or it follows the record before the damage with no LSN in
between (a damaged segment header in front of intact records). The segments holding records to
replay are fsynced before recovery returns; all segments stay until a
checkpoint passes them, so the caller need not store the replayed records
before it goes on.

Durability: each append is one ``os.write`` of the whole record on an
``O_APPEND`` descriptor, so a killed process leaves either the whole record
in the OS or a torn tail. ``fsync`` mode then fsyncs before the call returns;
concurrent writers share one fsync (group commit, as in PostgreSQL's
``commit_delay`` and InnoDB's group commit). ``log`` mode leaves the fsync to
the batcher, once per ``flush_interval``. Segments are deleted only once a
checkpoint at or beyond their last LSN is durably committed in SQLite.

Mapped segments: on file systems that overwrite preallocated blocks in
place (:data:`MAPPED_FS_TYPES`: ext4, xfs, tmpfs) each record is instead
stored into a shared mapping of the active segment, preallocated with
``posix_fallocate`` ahead of the stores, so a full disk is a
:class:`~durablekv.errors.LogWriteError` from that call and never a SIGBUS
from a store. The record is in the OS (the page cache) when the store
returns, as after a ``write``; fsync works as above. A sealed segment and
a closed log are cut back to their last record; after a crash, recovery
cuts the unused zero-filled end (:func:`~durablekv.log.segments.is_unused_end`).
Elsewhere (copy-on-write file systems, network, FUSE, unidentified ones)
every record is one ``write``. See docs/durability.md.

The checkpoint position: records at or below the store's checkpoint stay in
the active segment until it is sealed. After each checkpoint the log saves
where the last record it covers ends (``replay.pos``,
:class:`~durablekv.log.segments.Position`), and recovery parses the active
segment from there, so an open after a crash reads only the records the
store lacks. The file is a hint: when it does not check out against the
segment, recovery parses everything, as without it.

Fault-injection seams: :meth:`ReplayLog._write` and :meth:`ReplayLog._fsync`. (replacing
``_write`` also turns the mapping off: a record then goes through the seam).
"""

from __future__ import annotations

import logging
import mmap
import os
import struct
import threading
from dataclasses import dataclass
from typing import Sequence

from .._accel import native as _native
from .._perms import FILE_MODE, replace_private_file
from ..errors import LogCorruptionError, LogError, LogFileGoneError, LogWriteError
from .control import (CONTROL_FILE, LogControl, boot_id, cut_from_mapped, missing_records,
                         position_problem, read_control, write_control)
from .segments import (MAGIC, POSITION_FILE, PREALLOC_ALIGN, _HEADER_PACK, _LEN_LSN_PACK,
                          _NAN, _PAYLOAD_PACK, _crc32, _first_lsn_of, _record_offset,
                          join_records, list_segments, lsns_step_by_one, read_position,
                          read_segment, scan_segment_file, segment_name, start_gap_detail,
                          Position)

__all__ = ["ReplayLog", "RecoveryResult", "MAPPED_FS_TYPES", "mapped_append_refusal"]

log = logging.getLogger("durablekv.replaylog")  # (the name it has always had)

#: Bytes a mapped segment is preallocated by at a time (``posix_fallocate``).
PREALLOC_BYTES = 1 << 20

#: File systems where the log stores records into a mapping of a
#: preallocated segment: ``posix_fallocate`` allocates the blocks in place
#: there, so a store into them cannot need space later (it cannot fault with
#: SIGBUS on a full disk). Copy-on-write file systems (btrfs, zfs, bcachefs)
#: allocate a new block at every write, preallocated or not, and network,
#: FUSE and overlay file systems promise nothing: on those, and on any file
#: system not listed, each record is one write(2), which reports a full disk
#: as an error.
MAPPED_FS_TYPES = frozenset({"ext4", "xfs", "tmpfs"})


def _fs_type(directory: str) -> str | None:
    """The type of the file system holding ``directory`` (as
    ``/proc/self/mountinfo`` names it: ``ext4``, ``btrfs``...), or None
    when it cannot be told (not Linux, or no mount entry matches)."""
    try:
        st = os.stat(directory)
        real = os.path.realpath(directory)
        with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    dev = f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"
    best: tuple[int, int, str] | None = None  # (device matches, mount point length, type)
    for line in lines:
        left, sep, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if not sep or len(fields) < 5 or not tail:
            continue
        point = fields[4].encode().decode("unicode_escape")  # \040 for a space
        if not (real == point or real.startswith(point.rstrip("/") + "/")):
            continue
        rank = (fields[2] == dev, len(point), tail[0])
        if best is None or rank[:2] >= best[:2]:
            best = rank  # the last of equal mounts: the one mounted on top
    return best[2] if best else None


def mapped_append_refusal(directory: str, fstype: str | None = None) -> str | None:
    """Why records may NOT be stored into a mapping of a preallocated segment
    in ``directory`` (a sentence for logs and docs), or None when they may.

    :param fstype: the file system's type; None detects it
        (``/proc/self/mountinfo``). Tests pass one to take the refusal path.
    """
    if not hasattr(os, "posix_fallocate"):
        return "this platform has no posix_fallocate, so a mapped segment cannot be preallocated"
    if fstype is None:
        fstype = _fs_type(directory)
        if fstype is None:
            return (f"the file system holding {directory!r} could not be identified "
                    "(/proc/self/mountinfo), so a mapped segment is not known to be safe")
    if fstype not in MAPPED_FS_TYPES:
        return (f"{directory!r} is on {fstype}, where a store into a mapped segment could "
                "still fault after posix_fallocate (copy-on-write, or allocation not "
                f"promised); mapped appends are used only on {', '.join(sorted(MAPPED_FS_TYPES))}")
    return None


@dataclass
class RecoveryResult:
    """What :meth:`ReplayLog.recover` found.

    :ivar records: every intact record with LSN > the checkpoint, in LSN
        order, as plain ``(lsn, op, key, value, expire_at)`` tuples
        (:class:`LogRecord`'s field order): a list, or with the C kernels
        usually a ``_native.Records`` that makes each tuple when it is read
        (see :func:`~durablekv.log.segments.join_records`).
    :ivar torn_records: torn tails cut off (0 or 1).
    :ivar torn_bytes: bytes cut off with them: the torn record, and the
        unused end of a preallocated segment after it when there is one.
    :ivar torn_unused_bytes: how many of ``torn_bytes`` were that unused,
        zero-filled end (no record was ever in them; see
        :func:`~durablekv.log.segments.split_torn_tail`).
    :ivar salvaged: segments that salvage gave up on (``salvage=True``
        only): the damaged one and every later one. They are still in place;
        :meth:`ReplayLog.set_aside` moves them aside once the records kept
        from before the damage are in the store.
    :ivar salvaged_bytes: bytes of the log salvage gave up on: from the
        damage (or the first record after an LSN gap) to the end of the log.
        Their records are lost; how many there were cannot be known.
    :ivar lost: with ``salvage=True``: which records the control file says
        the log should hold and it does not (deleted segments), or None.
    """

    records: Sequence[tuple]
    torn_records: int
    torn_bytes: int
    salvaged: list[str]
    salvaged_bytes: int = 0
    torn_unused_bytes: int = 0
    #: what salvage found missing from the log and could not recover
    #: (``salvage=True`` only; see :func:`~durablekv.log.control.missing_records`)
    lost: str | None = None


class ReplayLog:
    """Append-only log of sets and deletes, in segments.

    :param directory: the cache directory.
    :param durability: ``"fsync"`` (every append is fsynced before
        :meth:`sync_to` returns) or ``"log"`` (the batcher calls :meth:`sync`
        once per interval).
    :param segment_bytes: a segment is sealed and a new one started once it
        grows past this many bytes.

    Thread-safety: :meth:`append` is called under the cache's lock (one
    writer at a time, so file order is LSN order); :meth:`sync`,
    :meth:`sync_to` and :meth:`truncate_through` may run from any thread.
    """

    def __init__(self, directory: str, *, durability: str = "log",
                 segment_bytes: int = 64 << 20, append: str = "auto",
                 fstype: str | None = None, prealloc_bytes: int = PREALLOC_BYTES) -> None:
        if append not in ("auto", "write"):
            raise ValueError(f"append must be 'auto' or 'write', not {append!r}")
        self.directory = directory
        self.durability = durability
        self.segment_bytes = segment_bytes
        self.prealloc_bytes = max(PREALLOC_ALIGN, _round_up(prealloc_bytes, PREALLOC_ALIGN))
        #: How records reach the active segment: ``"mmap"`` (stored into a
        #: mapping of a preallocated segment) or ``"write"`` (one write(2)
        #: each); :attr:`append_reason` says why.
        self.append_mode = "write"
        self.append_reason = "append='write' was asked for"
        if append == "auto" and durability != "none":
            refusal = mapped_append_refusal(directory, fstype)
            if refusal is None:
                self.append_mode = "mmap"
                self.append_reason = (f"the file system ({fstype or _fs_type(directory)}) "
                                      "allocates preallocated blocks in place")
            else:
                self.append_reason = refusal
        elif durability == "none":
            self.append_reason = "durability='none' appends no records"
        self._mm: mmap.mmap | None = None  # the active segment's mapping (mmap mode)
        self._cap = 0  # bytes preallocated and mapped in the active segment
        self._fd: int | None = None
        self._path: str | None = None
        self._size = 0
        # An interrupted write(2) append whose cut-back has not succeeded:
        # the segment may hold a record past _size (see _cut_back)
        self._cut_pending = False
        self._last_start = -1  # offset of record _last_lsn in the active segment; -1: not there
        self._last_lsn = 0
        self._synced_lsn = 0
        # (lsn, segment path, start, end) of the last record at each snapshot
        # (mark), oldest first; truncate_through saves the newest it covers
        self._marks: list[tuple[int, str, int, int]] = []
        self._saved_position = 0  # LSN of the position last saved
        # (path, last_lsn) of sealed segments, oldest first
        self._sealed: list[tuple[str, int]] = []
        self._lock = threading.Lock()       # guards _fd/_path swap, _sealed, byte counts
        self._sync_lock = threading.Lock()  # one fsync at a time (group commit)
        self._sealed_bytes = 0
        self._dir_unsynced = False  # a segment was created since the last directory fsync
        self._gone: LogFileGoneError | None = None  # the active segment was found deleted
        # (state, first LSN of the newest segment) last written to replay.control
        self._control: tuple[str, int] | None = None
        # The segment a control file found at recovery names (an earlier
        # process's newest): kept by truncate_through until start() names
        # this process's own, so that a crash in between never leaves a
        # control file naming a segment this process deleted.
        self._pinned: int | None = None

    # -- seams for fault injection ---------------------------------------------------

    def _write(self, fd: int, data: bytes) -> int:
        return os.write(fd, data)

    def _fsync(self, fd: int) -> None:
        os.fsync(fd)

    # -- recovery ----------------------------------------------------------------------

    def recover(self, after_lsn: int, *, salvage: bool = False) -> RecoveryResult:
        """Read every segment; return records with LSN > ``after_lsn``.

        Cuts a torn tail off the last segment (the file is truncated and
        fsynced). Every segment is remembered as sealed, so that
        :meth:`truncate_through` deletes it only once a checkpoint passes its
        last record: the caller may apply the records in memory and let the
        write-behind store them later, and a crash meanwhile replays them
        again.

        Unless ``durability`` is ``"none"``, each segment holding records
        after ``after_lsn`` is fsynced (and then the directory) before this
        returns. Those records may have reached only the OS before the crash
        (``log`` mode); new records go to a new segment, and a power loss
        must not keep those while losing the older ones (that would leave an
        LSN gap, which the next recovery refuses).

        With ``salvage``, damage before the tail or an LSN gap ends the
        recovery there instead of raising: the records before it are
        returned, and the segment holding it and every later one are listed
        in ``salvaged`` (and ``salvaged_bytes``) but left in place and not
        sealed. The caller stores the records, then calls :meth:`set_aside`.

        The log must continue the store: the first record after
        ``after_lsn`` must be ``after_lsn + 1``. A later one means records
        the store never got are missing, as when ``pages.sqlite3`` is older
        than the log (put back from a backup, or its ``-wal`` file deleted):
        an LSN gap like any other. (A store rebuilt empty starts where the
        log does: see ``SQLitePageStore.prepare_rebuild``.)

        :raises LogCorruptionError: a damaged record before the tail, or an
            LSN gap (and ``salvage`` is False).
        :raises LogError: a segment holding records to replay could not be
            fsynced.
        """
        segments = list_segments(self.directory)
        control, control_why = read_control(self.directory)
        if control_why is not None and not salvage:
            # written whole or not at all (renamed into place): not a crash's doing
            raise LogCorruptionError(os.path.join(self.directory, CONTROL_FILE), 0,
                                     f"{control_why}; it says what the log must hold, so the "
                                     "log cannot be checked against it")
        spans: dict[str, tuple[int, int] | None] = {}  # path -> first, last LSN parsed
        self._pinned = control.newest if control is not None and control.state == "open" \
            else None
        out: list[Sequence[tuple]] = []  # the records kept, a chunk per segment
        torn = torn_bytes = torn_unused = 0
        salvaged: list[str] = []
        lost: tuple[int, str] = (0, "")  # where salvage gives up in salvaged[0], and why
        salvaged_bytes = 0
        self.skipped_damage = 0
        expect = None
        resumed_lsn = 0
        synced = False
        position = self._position_for(segments)
        for i, path in enumerate(segments):
            last = i == len(segments) - 1
            # Damage that can hide no record the store lacks (the record
            # behind it is at or below the checkpoint, or follows the record
            # before it with no LSN in between, as behind a damaged segment
            # header) loses nothing: the scan steps over it.
            # compact: with the C kernels, records are read in place, not made
            # into tuples (see join_records)
            scan, size = scan_segment_file(path, after_lsn, None if last else segments[i + 1],
                                           position if i == 0 else None, compact=True)
            records, runs = scan.records, scan.runs
            spans[path] = (records[0][0], records[-1][0]) if len(records) else None
            if scan.resumed is not None:
                resumed_lsn = scan.resumed.lsn  # the log holds records up to it
                self._saved_position = scan.resumed.lsn  # saves go on from there
                log.info("replay log %s: parsed from offset %d, after LSN %d (the checkpoint "
                         "position in %s)", path, scan.resumed.end, scan.resumed.lsn,
                         POSITION_FILE)
            elif scan.resume_refused is not None:
                log.info("replay log %s: parsed whole, the checkpoint position in %s is not "
                         "usable: %s", path, POSITION_FILE, scan.resume_refused)
            for skipped, resume, why in scan.stepped_over:
                self.skipped_damage += 1
                log.warning("replay log %s: skipped %s at offset %d (%s); %s", path,
                            "a damaged end" if resume is None else "damaged bytes",
                            skipped.offset, skipped.detail, why)
            damage, good_end = scan.damage, scan.good_end
            cut = False
            if scan.unused_end:
                # the zero-filled, preallocated end of a mapped segment after a
                # crash (a clean close cuts it): no record is in it
                log.info("replay log %s: cut the unused preallocated end of %d bytes at "
                         "offset %d", path, size - good_end, good_end)
                os.truncate(path, good_end)
                size = good_end
                cut = True  # fsynced below, with the records (one fsync, not two)
            cut_by_hand = None if damage is None or not last or scan.intact_after else \
                cut_from_mapped(control, path, size, damage.detail)
            if cut_by_hand is not None:
                damage.detail += "; " + cut_by_hand
                if not salvage:
                    raise LogCorruptionError(path, damage.offset, damage.detail)
                salvaged = segments[i:]
                lost = (damage.offset, damage.detail)
            elif damage is not None and last and not scan.intact_after:
                # a torn tail (see scan_segment): a crash cut the last append short
                torn += 1
                torn_bytes += size - good_end
                torn_unused += scan.torn_unused
                if scan.torn_unused:
                    # killed while it stored a record into a mapped segment:
                    # the preallocated rest of the file was never used
                    log.warning("replay log %s: cut a torn record of %d bytes at offset %d "
                                "(%s), and the %d bytes of unused preallocated space after "
                                "it (zero-filled)", path, size - good_end - scan.torn_unused,
                                damage.offset, damage.detail, scan.torn_unused)
                else:
                    log.warning("replay log %s: cut a torn tail of %d bytes at offset %d (%s)",
                                path, size - good_end, damage.offset, damage.detail)
                if good_end == 0:
                    os.unlink(path)
                    if self._pinned == _first_lsn_of(path):
                        # (the control file's newest, cut whole as a torn tail:
                        # this recovery found the log whole without it)
                        self._remove_control()
                        self._pinned = None
                else:
                    os.truncate(path, good_end)
                    cut = True
                size = good_end
            elif damage is not None and not salvage:
                raise LogCorruptionError(path, damage.offset, damage.detail)
            elif damage is not None:
                # Later segments cannot be applied without the records lost
                # here. Nothing moves yet: until the records kept from before
                # the damage are in the store, this file is their only copy
                # (see set_aside).
                salvaged = segments[i:]
                lost = (damage.offset, damage.detail)
            first = records[0][0] if records else None
            # (the log's first record: at or below the store's next LSN)
            if records and (first == expect if expect is not None else
                            first <= after_lsn + 1) and lsns_step_by_one(records):
                # The usual case, checked in C: this segment continues the
                # previous one and its LSNs step by one.
                expect = first + len(records)
                out.append(records[max(0, after_lsn + 1 - first):])
            else:
                records = list(records)  # (cut short below on a gap)
                kept: list[tuple] = []
                out.append(kept)
                for j, r in enumerate(records):
                    lsn = r[0]
                    detail = None
                    if expect is not None and lsn != expect and not (
                            lsn > expect and lsn <= after_lsn + 1):
                        detail = f"LSN {lsn} follows {expect - 1}: a segment is missing or out of order"
                    elif expect is None and lsn > after_lsn + 1:
                        detail = start_gap_detail(after_lsn, lsn)
                    if detail is not None:
                        offset = _record_offset(records, runs, j)
                        if not salvage:
                            raise LogCorruptionError(path, offset, detail)
                        # The records from the gap on cannot be applied:
                        # salvage gives up on them as on damage.
                        del records[j:]
                        salvaged = segments[i:]
                        lost = (offset, detail)
                        break
                    expect = lsn + 1
                    if lsn > after_lsn:
                        kept.append(r)
            if salvaged:
                # Not sealed: truncate_through must not delete it once the
                # records kept from it are checkpointed; set_aside moves it.
                if cut or records and records[-1][0] > after_lsn and self.durability != "none":
                    self._sync_segment(path)
                    synced = True
                # How many records lie behind the damage cannot be known;
                # how many bytes can.
                salvaged_bytes = size - lost[0] + sum(map(os.path.getsize, segments[i + 1:]))
                log.error("replay log %s is damaged at offset %d (%s): salvage applies the %d "
                          "records before it and gives up on the %d bytes from there to the "
                          "end of the log (stats().salvaged_bytes), moving %s aside",
                          path, lost[0], lost[1], sum(map(len, out)), salvaged_bytes,
                          ", ".join(map(os.path.basename, salvaged)))
                break
            if os.path.exists(path):
                self._sealed.append((path, records[-1][0] if records else
                                     scan.resumed.lsn if scan.resumed is not None else 0))
                self._sealed_bytes += size
                if cut or records and records[-1][0] > after_lsn and self.durability != "none":
                    self._sync_segment(path)
                    synced = True
        gone = None
        if not salvaged and control is not None and control.state == "open":
            gone = missing_records(self.directory, control, segments, after_lsn,
                                   max(resumed_lsn, (expect or 1) - 1),
                                   position_problem(self.directory, segments, after_lsn, spans))
            if gone is not None and not salvage:
                raise LogCorruptionError(gone.path, gone.offset, gone.detail)
            if gone is not None:
                log.error("replay log %s: %s (salvage opens with what the store and the "
                          "log hold)", gone.path, gone.detail)
        if synced or torn:
            _fsync_dir(self.directory)
        self._last_lsn = self._synced_lsn = max(after_lsn, (expect or 1) - 1)
        return RecoveryResult(join_records(out), torn, torn_bytes, salvaged, salvaged_bytes,
                              torn_unused, None if gone is None else gone.detail)

    def _position_for(self, segments: list[str]) -> Position | None:
        """The saved checkpoint position when it names the first segment of
        ``segments`` (where the records below the checkpoint are), else None
        (with the reason logged); the scan checks it against the file."""
        pos, why = read_position(self.directory)
        if pos is not None and (not segments or _first_lsn_of(segments[0]) != pos.segment_lsn):
            pos, why = None, (f"it names the segment {segment_name(pos.segment_lsn)}, not the "
                              "log's first")
        if why is not None and segments:
            log.info("replay log %s: the checkpoint position in %s is not usable: %s; the log "
                     "is parsed whole", self.directory, POSITION_FILE, why)
        return pos

    def set_aside(self, result: RecoveryResult) -> list[str]:
        """Move the segments salvage gave up on aside; return their new paths.

        Each ``replay-<LSN>.log`` becomes ``replay-<LSN>.log.damaged`` (an
        existing file of that name, from an earlier salvage, is kept: the new
        one is ``replay-<LSN>.log.<n>.damaged``), then the directory is
        fsynced. Call only once every record :meth:`recover` kept from before
        the damage is durably in the store, and before :meth:`start`: the new
        segment may take the damaged one's name.
        """
        moved = []
        for path in result.salvaged:
            aside, n = path + ".damaged", 1
            while os.path.exists(aside):
                n += 1
                aside = f"{path}.{n}.damaged"
            os.replace(path, aside)
            moved.append(aside)
        if moved:
            # the position, and the control file, may name a segment moved
            # aside: salvage gave up on it, and what is left is whole
            for name in (POSITION_FILE, CONTROL_FILE):
                try:
                    os.unlink(os.path.join(self.directory, name))
                except FileNotFoundError:
                    pass
            self._pinned = None
            _fsync_dir(self.directory)
            log.warning("replay log: moved the segments salvage gave up on aside: %s",
                        ", ".join(f"{p} -> {os.path.basename(a)}"
                                  for p, a in zip(result.salvaged, moved)))
        return moved

    def _sync_segment(self, path: str) -> None:
        """fsync a segment found at recovery (through the :meth:`_fsync` seam)."""
        try:
            fd = os.open(path, os.O_RDONLY)
            try:
                self._fsync(fd)
            finally:
                os.close(fd)
        except OSError as exc:
            raise LogError(f"could not fsync replay log segment {path!r} at recovery: "
                           f"{exc.strerror or exc}; its records might not survive a power "
                           "loss, so the cache does not open. Fix the file system and "
                           "open it again (the log still holds every record)") from exc

    # -- appending -------------------------------------------------------------------

    @property
    def gone(self) -> LogFileGoneError | None:
        """The error naming the active segment, once an fsync or a roll found
        it deleted or replaced while open; else None."""
        return self._gone

    @property
    def last_lsn(self) -> int:
        return self._last_lsn

    def start(self, next_lsn: int) -> None:
        """Open a new segment whose first record will have LSN ``next_lsn``."""
        with self._lock:
            self._open_segment(next_lsn, during_write=False)
            try:
                self._write_control("open", next_lsn)
            except OSError as exc:
                raise LogWriteError(os.path.join(self.directory, CONTROL_FILE), exc,
                                    during_write=False) from exc
            self._pinned = None  # the control file names this process's segment now

    def _open_segment(self, first_lsn: int, during_write: bool = True) -> None:
        """Create the segment for ``first_lsn`` and make it the active one.

        :raises LogWriteError: it could not be created (``during_write``:
            for a set whose record was then not stored; else at open).
        """
        try:
            self._create_segment(first_lsn)
        except LogWriteError as exc:
            if during_write:
                raise
            raise LogWriteError(exc.path, exc.cause, during_write=False) from exc.cause
        except OSError as exc:
            path = os.path.join(self.directory, segment_name(first_lsn))
            raise LogWriteError(path, exc, during_write=during_write) from exc

    def _create_segment(self, first_lsn: int) -> None:
        path = os.path.join(self.directory, segment_name(first_lsn))
        # A sealed segment of the same name can only hold no records (its
        # first LSN is not yet used): it is replaced, not kept as sealed.
        # Anything else would mean an LSN is reused: refuse, never overwrite.
        if os.path.exists(path) and read_segment(path)[0]:
            raise LogError(f"replay log segment {path!r} already holds records; refusing to "
                           f"reuse LSN {first_lsn} (this is a bug: please report it)")
        self._sealed = [s for s in self._sealed if s[0] != path]
        mapped = self.append_mode == "mmap" and type(self)._write is _WRITE_SEAM
        fd = os.open(path, (os.O_RDWR if mapped else os.O_WRONLY) | os.O_CREAT | os.O_APPEND |
                     os.O_TRUNC, FILE_MODE)
        mm = None
        try:
            self._write_all(fd, MAGIC, path)
            if mapped:
                cap = self.segment_bytes_hint()
                mm = _preallocate_and_map(fd, path, cap, None)
            if self.durability == "fsync":
                self._fsync(fd)
                _fsync_dir(self.directory)
            else:
                # the next sync() makes the new name durable with the records:
                # a power loss must not keep a later segment and lose this one
                self._dir_unsynced = True
        except BaseException:
            if mm is not None:
                mm.close()
            os.close(fd)
            os.unlink(path)
            raise
        if mapped:
            log.info("replay log segment %s: records are stored into a mapping of it, "
                     "preallocated %d bytes at a time (%s)", path, self.prealloc_bytes,
                     self.append_reason)
        self._mm, self._cap = mm, (mm.size() if mm is not None else 0)
        self._fd, self._path, self._size = fd, path, len(MAGIC)
        self._last_start = -1

    def _write_control(self, state: str, newest: int) -> None:
        """Write ``replay.control`` (see :mod:`durablekv.log.control`).

        :raises OSError: it could not be written.
        """
        if self.durability == "none":
            return
        write_control(self.directory, LogControl(
            state=state, newest=newest, append="mmap" if self._mm is not None else "write",
            durability=self.durability, boot_id=boot_id(), pid=os.getpid()))
        self._control = (state, newest)

    def forget_control(self) -> None:
        """Delete ``replay.control`` after :meth:`close` (without ``remove``),
        when the store's checkpoint covers every record appended: the next
        open then has nothing to look for in the segments that are left. A
        failure is logged: the control file then makes the next open check
        the log, which can only refuse what salvage opens. Only a log this
        process started (:meth:`start`) has a control file to forget: a
        recovery that failed leaves the one it found."""
        if self._control is None:
            return
        try:
            self._remove_control()
        except OSError as exc:
            log.warning("replay log: cannot remove %s in %s (%s)", CONTROL_FILE,
                        self.directory, exc)

    def _remove_control(self) -> None:
        """Delete ``replay.control`` durably (then the directory is fsynced).

        :raises OSError: it could not be deleted.
        """
        try:
            os.unlink(os.path.join(self.directory, CONTROL_FILE))
        except FileNotFoundError:
            pass
        else:
            _fsync_dir(self.directory)
        self._control = None

    def _control_unmapped(self) -> None:
        """The active segment left its mapping for write(2) appends: say so
        in ``replay.control``, whose ``"mmap"`` would make a torn write(2)
        tail read as a segment cut short. A failure is logged: it can only
        make that check refuse a torn tail that salvage then cuts."""
        if self._control is None or self._control[0] != "open":
            return
        try:
            self._write_control("open", self._control[1])
        except OSError as exc:
            log.warning("replay log: cannot rewrite %s in %s (%s)", CONTROL_FILE,
                        self.directory, exc)

    def segment_bytes_hint(self) -> int:
        """Bytes preallocated when a segment is created (a multiple of 4096);
        the room then doubles up to ``prealloc_bytes`` at a time."""
        return min(64 << 10, self.prealloc_bytes, _round_up(self.segment_bytes, PREALLOC_ALIGN))

    def _grow(self, record_size: int) -> None:
        """Preallocate and map room for a record of ``record_size`` bytes.

        :raises LogWriteError: the file system has no room (ENOSPC comes
            here, from ``posix_fallocate``, never as a fault on a store
            into the mapping); nothing was appended.
        """
        need = _round_up(self._size + record_size, PREALLOC_ALIGN)
        # twice the room up to one prealloc_bytes step, then a step at a time
        cap = max(need, min(2 * self._cap, self._cap + self.prealloc_bytes))
        try:
            mm = _preallocate_and_map(self._fd, self._path, cap, self._cap)
        except LogWriteError:
            if cap == need:
                raise
            # short of room for a whole step: as much as this record needs
            mm = _preallocate_and_map(self._fd, self._path, need, self._cap)
            cap = need
        old, self._mm, self._cap = self._mm, mm, cap
        old.close()

    def _leave_mapping(self) -> None:
        """Unmap the active segment and cut its unused preallocated end, so
        that the file ends at its last record (a sealed segment, a closed
        log, or a write(2) append from here on).

        :raises LogWriteError: the file could not be cut.
        """
        if self._mm is None:
            return
        try:
            # cut first: on failure the mapping stays and nothing changed
            os.ftruncate(self._fd, self._size)
        except OSError as exc:
            raise LogWriteError(self._path, exc) from exc
        mm, self._mm, self._cap = self._mm, None, 0
        mm.close()

    def _store(self, lsn: int, op: int, key: bytes, value: bytes,
               expire_at: float | None, raw: bool) -> int:
        """Store one record into the mapping (mmap mode); ``raw``: ``value``
        is a bytes value's raw data (as :meth:`append_bytes`)."""
        kernel = _STORE_BYTES_RECORD if raw else _STORE_RECORD
        if kernel is not None:
            try:
                size = kernel(self._mm, self._size, lsn, op, key, value, expire_at)
            except (TypeError, ValueError, OverflowError):
                pass  # arguments the Python code must judge: it raises as it always has
            else:
                if size < 0:
                    self._grow(-size)
                    size = kernel(self._mm, self._size, lsn, op, key, value, expire_at)
                self._last_start = self._size
                self._size += size
                self._last_lsn = lsn
                return size
        if raw:
            value = b"b" + _U32_PACK(len(value)) + value
        payload = _PAYLOAD_PACK(op, _NAN if expire_at is None else expire_at, len(key)) + key + value
        n = len(payload)
        record = _HEADER_PACK(n, _crc32(payload, _crc32(_LEN_LSN_PACK(n, lsn))), lsn) + payload
        start = self._size
        end = start + len(record)
        if end > self._cap:
            self._grow(len(record))
        self._mm[start:end] = record
        self._last_start = start
        self._size = end
        self._last_lsn = lsn
        return len(record)

    def _write_all(self, fd: int, data: bytes, path: str) -> None:
        try:
            n = self._write(fd, data)
        except OSError as exc:
            raise LogWriteError(path, exc) from exc
        if n != len(data):
            # A short write leaves a torn record: cut it off again so that the
            # next append does not land behind garbage.
            try:
                os.ftruncate(fd, os.fstat(fd).st_size - n)
            except OSError:
                pass
            raise LogWriteError(path, OSError(28, f"short write ({n} of {len(data)} bytes)"))

    def append(self, lsn: int, op: int, key: bytes, value: bytes, expire_at: float | None) -> int:
        """Write one record (LSN must be ``last_lsn + 1``); return its size in bytes.

        The record is in the OS when this returns; call :meth:`sync_to` for
        fsync durability. One ``write`` system call (this is the hot path of
        every set: the record is built and written without helper calls).

        :raises LogWriteError: the write failed; nothing was appended.
        """
        if self._cut_pending:
            self._finish_cut()
        if self._size >= self.segment_bytes:
            self._roll(lsn)
        if self._mm is not None:
            if type(self)._write is _WRITE_SEAM:
                return self._store(lsn, op, key, value, expire_at, False)
            self._leave_mapping()  # the write seam was replaced: write(2) from here on
            self._control_unmapped()
        if _WRITE_RECORD is not None and type(self)._write is _WRITE_SEAM:
            # The C kernel builds the record and writes it (one write(2),
            # the GIL released as os.write releases it); the Python path
            # below stays for the fault-injection seam and the fallback.
            try:
                written, size = _WRITE_RECORD(self._fd, lsn, op, key, value, expire_at)
            except OSError as exc:
                raise LogWriteError(self._path, exc) from exc
            except (TypeError, ValueError, OverflowError):
                pass  # arguments the Python code must judge: it raises as it always has
            except BaseException:
                self._cut_back()
                raise
            else:
                if written != size:
                    self._cut_short_write(written, size)
                self._last_start = self._size
                self._size += size
                self._last_lsn = lsn
                return size
        payload = _PAYLOAD_PACK(op, _NAN if expire_at is None else expire_at, len(key)) + key + value
        n = len(payload)
        record = _HEADER_PACK(n, _crc32(payload, _crc32(_LEN_LSN_PACK(n, lsn))), lsn) + payload
        size = len(record)  # (no call between the write and the state below: see
        try:                # _cut_back)
            written = self._write(self._fd, record)
        except OSError as exc:
            raise LogWriteError(self._path, exc) from exc
        except BaseException:
            self._cut_back()
            raise
        if written != size:
            self._cut_short_write(written, size)
        self._last_start = self._size
        self._size += size
        self._last_lsn = lsn
        return size

    def append_bytes(self, lsn: int, op: int, key: bytes, raw: bytes,
                     expire_at: float | None) -> int:
        """:meth:`append` of the value ``b"b" + u32(len(raw)) + raw`` (the safe
        codec's encoding of the bytes value ``raw``), without building that
        encoding first: the set of a bytes value copies it once, into the
        record. Same record bytes, same errors.
        """
        if self._cut_pending:
            self._finish_cut()
        if self._size >= self.segment_bytes:
            self._roll(lsn)
        if self._mm is not None and type(self)._write is _WRITE_SEAM:
            return self._store(lsn, op, key, raw, expire_at, True)
        if _WRITE_BYTES_RECORD is not None and type(self)._write is _WRITE_SEAM:
            try:
                written, size = _WRITE_BYTES_RECORD(self._fd, lsn, op, key, raw, expire_at)
            except OSError as exc:
                raise LogWriteError(self._path, exc) from exc
            except (TypeError, ValueError, OverflowError):
                pass  # arguments the Python code must judge
            except BaseException:
                self._cut_back()
                raise
            else:
                if written != size:
                    self._cut_short_write(written, size)
                self._last_start = self._size
                self._size += size
                self._last_lsn = lsn
                return size
        return self.append(lsn, op, key, b"b" + _U32_PACK(len(raw)) + raw, expire_at)

    def _cut_short_write(self, written: int, size: int) -> None:
        # A short write leaves a torn record: cut it off again (see _cut_back)
        # so that the next append does not land behind garbage.
        self._cut_back()
        raise LogWriteError(self._path, OSError(28, f"short write ({written} of {size} bytes)"))

    def _cut_back(self) -> None:
        """An exception from a signal handler (Ctrl-C; SIGTERM in ``durablekv
        replay``) cut an append short, maybe as its write returned, so the
        record may be in the file. The append raises, so its set was not
        acknowledged and its LSN is not taken: the next record gets the same
        LSN, and with this one left in front of it the log would not open
        ("LSN n follows n"). Cut the file back to the last record appended.
        (A mapped segment needs nothing: the next record is stored over it.)
        A short write (:meth:`_cut_short_write`) is cut back the same way.

        Until the cut has succeeded, every append tries it first and raises
        :class:`LogWriteError` rather than write behind the stray record
        (:meth:`_finish_cut`). On Python 3.11 and later no signal handler
        runs between the write and the append's bookkeeping; on 3.10 one can,
        which this narrows but cannot close.
        """
        self._cut_pending = True
        try:
            os.ftruncate(self._fd, self._size)
        except OSError as exc:
            log.error("replay log %s: cannot cut a failed append off the segment (%s); "
                      "the next append tries again and refuses to write until it can",
                      self._path, exc)
        else:
            self._cut_pending = False

    def _finish_cut(self) -> None:
        """The cut of :meth:`_cut_back`, again, before an append.

        :raises LogWriteError: the segment still cannot be cut back; nothing
            is appended behind a record whose LSN the next one would repeat.
        """
        try:
            os.ftruncate(self._fd, self._size)
        except OSError as exc:
            raise LogWriteError(self._path, exc) from exc
        self._cut_pending = False

    def _roll(self, next_lsn: int) -> None:
        with self._lock:
            old_fd, old_path = self._fd, self._path
            self._leave_mapping()  # a sealed segment ends at its last record
            if self.durability != "none":
                try:
                    self._fsync(old_fd)
                except OSError as exc:
                    raise LogWriteError(old_path, exc) from exc
            gone = _gone(old_fd, old_path)
            if gone:
                self._gone = _segment_gone(old_path, gone)
                raise self._gone
            old = (self._fd, self._path, self._size, self._last_start)
            self._open_segment(next_lsn)
            try:
                # named before any record goes into it (see log/control.py)
                self._write_control("open", next_lsn)
            except OSError as exc:
                # back to the old segment, unmapped: the next append rolls again
                new_fd, new_path = self._fd, self._path
                if self._mm is not None:
                    self._mm.close()
                self._mm, self._cap = None, 0
                self._fd, self._path, self._size, self._last_start = old
                os.close(new_fd)
                try:
                    os.unlink(new_path)
                except OSError:
                    pass
                raise LogWriteError(os.path.join(self.directory, CONTROL_FILE), exc) from exc
            os.close(old_fd)
            self._sealed.append((old_path, self._last_lsn))
            self._sealed_bytes += os.path.getsize(old_path)

    def sync(self) -> None:
        """fsync everything appended so far (``log`` mode: the batcher, once per interval)."""
        self.sync_to(self._last_lsn)

    def sync_to(self, lsn: int) -> None:
        """Return once every record up to ``lsn`` is fsynced; one fsync serves all waiters.

        :raises LogWriteError: fsync failed (the cache then fails stop).
        """
        if self._gone is not None:
            raise self._gone  # every later sync says so again
        if self._synced_lsn >= lsn:
            return
        with self._sync_lock:
            if self._synced_lsn >= lsn:
                return
            with self._lock:
                if self._fd is None:
                    return
                target = self._last_lsn
                fd = os.dup(self._fd)
                path = self._path
            try:
                self._fsync(fd)
                if self._dir_unsynced:
                    self._dir_unsynced = False
                    _fsync_dir(self.directory)
                gone = _gone(fd, path)
            except OSError as exc:
                self._dir_unsynced = True
                raise LogWriteError(path, exc) from exc
            finally:
                os.close(fd)
            if gone:
                self._gone = _segment_gone(path, gone)
                raise self._gone
            self._synced_lsn = max(self._synced_lsn, target)

    def mark(self) -> None:
        """Remember where the last record appended lies, for the checkpoint
        that a snapshot taken now makes (call under the cache's lock, with
        the snapshot: no append runs meanwhile). :meth:`truncate_through`
        saves the newest mark its checkpoint covers as ``replay.pos``."""
        if self._last_start < 0:
            return  # no record in the active segment yet
        with self._lock:  # _save_position may run on another thread
            marks = self._marks
            if marks and marks[-1][0] == self._last_lsn:
                return
            marks.append((self._last_lsn, self._path, self._last_start, self._size))
            if len(marks) > 8:  # commits keep failing: the newest marks are the useful ones
                del marks[0]

    def _save_position(self, lsn: int) -> None:
        """Save the newest mark at or below the checkpoint ``lsn`` whose
        segment is still live. A failure is logged, never raised: the
        position is a hint, and the checkpoint it follows is committed."""
        with self._lock:
            covered = [m for m in self._marks if m[0] <= lsn]
            if not covered:
                return
            self._marks = [m for m in self._marks if m[0] > lsn]
            mark_lsn, path, start, end = covered[-1]
            live = path == self._path or any(p == path for p, _ in self._sealed)
        if not live or mark_lsn <= self._saved_position:
            return
        pos = Position(mark_lsn, _first_lsn_of(path), start, end)
        try:
            replace_private_file(os.path.join(self.directory, POSITION_FILE), pos.encode())
        except OSError as exc:
            log.warning("replay log: cannot save the checkpoint position in %s (%s); the "
                        "next open after a crash parses the whole log", self.directory, exc)
            return
        self._saved_position = mark_lsn

    def truncate_through(self, lsn: int) -> int:
        """Delete sealed segments whose records all have LSN <= ``lsn``; return how many.

        Call only with a checkpoint LSN that is durably committed in the store.
        A segment that cannot be deleted (an ``OSError`` other than a missing
        file) stays listed and is tried again at the next checkpoint; the
        error is logged, not raised, because the commit it follows has
        already succeeded (raising here made the batcher commit the same
        pages again).
        """
        with self._lock:
            pinned = self._pinned
            doomed = [s for s in self._sealed if s[1] <= lsn and
                      (pinned is None or _first_lsn_of(s[0]) != pinned)]
            self._sealed = [s for s in self._sealed if s not in doomed]
        kept = []
        for path, last in doomed:
            try:
                size = os.path.getsize(path)
                os.unlink(path)
            except FileNotFoundError:
                size = 0
            except OSError as exc:
                log.error("replay log %s: cannot delete this segment, which checkpoint %d "
                          "covers (%s); it is tried again at the next checkpoint",
                          path, lsn, exc)
                kept.append((path, last))
                continue
            with self._lock:
                self._sealed_bytes -= size
        if kept:
            with self._lock:
                self._sealed = kept + self._sealed  # older than every segment left
        if self._marks:
            self._save_position(lsn)
        return len(doomed) - len(kept)

    def size_bytes(self) -> int:
        """Bytes all live segments take on disk: their records, and the
        preallocated room of a mapped active segment (up to 1 MiB, see
        ``prealloc_bytes``; a sealed segment is cut back to its records)."""
        return self._sealed_bytes + max(self._size, self._cap)

    def close(self, *, remove: bool = False) -> None:
        """Close the current segment; ``remove`` deletes every segment (after a
        final checkpoint that covers the whole log)."""
        with self._lock:
            fd, path = self._fd, self._path
            try:
                if self._mm is not None:
                    self._leave_mapping()
                    if not remove:
                        self._control_unmapped()  # the segment now ends at its last record
            except LogWriteError as exc:
                # the unused zero-filled end stays; the next open cuts it
                log.warning("replay log %s: %s", path, exc)
                self._mm.close()
                self._mm, self._cap = None, 0
            self._fd = None
        if fd is not None:
            os.close(fd)
        if remove:
            # Every record is checkpointed: the next open must not look for
            # them, so the control file goes first, durably (a crash before
            # the segments go leaves records the store already holds, which
            # is harmless; the other order could leave "open" and no log).
            try:
                self._remove_control()
            except OSError as exc:
                raise LogWriteError(os.path.join(self.directory, CONTROL_FILE), exc,
                                    during_write=False) from exc
            for p, _ in self._sealed:
                if os.path.exists(p):
                    os.unlink(p)
            if path and os.path.exists(path):
                os.unlink(path)
            self._sealed.clear()
            self._sealed_bytes = 0
            self._size = 0
            self._marks.clear()
            try:
                os.unlink(os.path.join(self.directory, POSITION_FILE))
            except FileNotFoundError:
                pass
            except OSError as exc:  # a hint: never fails a close
                log.warning("replay log: cannot remove %s in %s (%s); the next open after "
                            "a crash ignores it", POSITION_FILE, self.directory, exc)
            _fsync_dir(self.directory)


#: The original write seam: the C kernel writes records only while no test
#: (or fault injector) has replaced :meth:`ReplayLog._write`.
_WRITE_SEAM = ReplayLog._write
_WRITE_RECORD = None if _native is None else _native.write_record
_WRITE_BYTES_RECORD = None if _native is None else _native.write_bytes_record
_U32_PACK = struct.Struct("<I").pack
_STORE_RECORD = None if _native is None else _native.store_record
_STORE_BYTES_RECORD = None if _native is None else _native.store_bytes_record


def _round_up(n: int, step: int) -> int:
    return -(-n // step) * step


def _preallocate_and_map(fd: int, path: str, cap: int, old_cap: int | None) -> mmap.mmap:
    """``posix_fallocate`` the first ``cap`` bytes of the segment open as
    ``fd``, then map them (shared, read-write).

    :raises LogWriteError: the blocks could not be allocated (ENOSPC) or
        mapped; during a write when ``old_cap`` is not None.
    """
    try:
        os.posix_fallocate(fd, 0, cap)
        return mmap.mmap(fd, cap)
    except OSError as exc:
        what = (f"could not preallocate {cap} bytes of the segment"
                if old_cap is None else
                f"could not preallocate room for the record (growing the segment from "
                f"{old_cap} to {cap} bytes)")
        raise LogWriteError(path, OSError(exc.errno, f"{what}: {exc.strerror or exc}")) from exc


def _gone(fd: int, path: str) -> str | None:
    """How the file open as ``fd`` is no longer the one named ``path``
    (deleted, or replaced by another file), or None when it still is."""
    st = os.fstat(fd)
    try:
        now = os.stat(path)
    except FileNotFoundError:
        return "was deleted"
    if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
        return "was replaced by another file"
    return None


def _segment_gone(path: str, how: str) -> LogFileGoneError:
    return LogFileGoneError(path,
        f"the active replay log segment {path!r} {how} while the cache was open: the "
        "records written to it since the last checkpoint are no longer in the log, so a "
        "crash now would lose acknowledged writes. Close the cache (the final flush stores "
        "what memory holds) and do not delete files in a cache directory while it is open")


def _fsync_dir(directory: str) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
