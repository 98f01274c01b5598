"""``durablekv check DIR``: verify a cache directory that no process has open.

Checks, without changing anything (no file is written, created or upgraded:
a store written by an older durablekv keeps its schema version):

1. the directory is not open (the ``LOCK`` file is free; check holds it
   shared until it is done, so no cache can open the directory meanwhile);
2. ``pages.sqlite3``: SQLite's ``integrity_check``, the schema version, the
   settings, and that the key index and the pages agree both ways (every
   entry of every page has an index row pointing at that page with the same
   expire_at, and every index row points at a page holding its key), and
   that the stored key count matches;
3. the replay log, read as the next open reads it: every record's length
   and CRC, LSN continuity, torn tails (repaired at the next open, not
   damage), damage and LSN gaps that can hide only records at or below the
   store's checkpoint (the store holds them, the open steps over them: not
   damage either), and records not yet checkpointed (applied again at the
   next open). Damage that can hide later records is damage: the open
   refuses it.
"""

from __future__ import annotations

import fcntl
import itertools
import os
import shlex
import sqlite3
from dataclasses import dataclass, field
from typing import Any

from .dirlock import LOCK_FILE, lock_directory, lock_owner_pid
from .codec import SafeCodec, canonical_key, decode_key
from .errors import CacheLockedError
from .log.control import cut_from_mapped, missing_records, position_problem, read_control
from .log.segments import OP_SET, _record_offset, list_segments, scan_segment_file, start_gap_detail
from .stores.base import meta_problems
from .stores.pageformat import decode_page, page_crc
from .stores.sqlitefile import STORE_FILE, migration_files, read_only_uri

__all__ = ["check_directory", "CheckResult"]


@dataclass
class CheckResult:
    ok: bool = True
    damaged: bool = False  #: damage found (``ok`` is also False when it could not check)
    lines: list[str] = field(default_factory=list)
    serializer: str | None = None  #: the store's value codec, once read from its meta table

    def good(self, msg: str) -> None:
        self.lines.append(f"ok      {msg}")

    def note(self, msg: str) -> None:
        self.lines.append(f"note    {msg}")

    def bad(self, msg: str) -> None:
        self.ok = False
        self.damaged = True
        self.lines.append(f"DAMAGE  {msg}")

    def next(self, msg: str) -> None:
        """What to do about the damage above."""
        self.lines.append(f"next    {msg}")

    def error(self, msg: str) -> None:
        """Could not check (not damage)."""
        self.ok = False
        self.lines.append(f"ERROR   {msg}")


def _check_shards(directory: str, r: CheckResult) -> CheckResult:
    """Check every shard of a :class:`~durablekv.ShardedCache` directory, one
    after another; each line names its shard. ``ok``/``damaged`` are the worst
    over the shards."""
    from .errors import ConfigError
    from .sharded import _read_shard_count, _shard_dir
    try:
        n = _read_shard_count(directory)
    except ConfigError as exc:
        r.bad(str(exc))
        return _finish(r)
    assert n is not None  # the SHARDS file is there
    r.note(f"{directory} is a ShardedCache directory of {n} shards; checking each")
    for i in range(n):
        name = _shard_dir(i)
        sub = check_directory(os.path.join(directory, name))
        r.ok = r.ok and sub.ok
        r.damaged = r.damaged or sub.damaged
        r.lines.extend(f"{line[:8]}{name}: {line[8:]}" for line in sub.lines)
    return _finish(r)


#: Ends the line of a store problem that is a wrong count only (meta's
#: key_count or data_bytes): every entry is intact, so neither ``check``'s
#: advice nor ``salvage --on-corruption rebuild`` throws the store away for it.
COUNT_ONLY = "(a wrong count, not damage to any entry)"


def check_directory(directory: str, *, log: bool = True) -> CheckResult:
    """Verify ``directory``; see the module docstring. Never raises for damage.

    :param log: also read the replay log (False: the page store alone, as
        ``durablekv salvage --on-corruption rebuild`` does before it opens).
    """
    r = CheckResult()
    if not os.fspath(directory):
        # abspath('') is the current directory: checking it would answer a
        # question nobody asked (an unset shell variable, say)
        r.error("the cache directory is an empty path; name a directory "
                "(use '.' for the current one)")
        return _finish(r)
    directory = os.path.abspath(os.path.expanduser(directory))  # ~ as for Cache
    if not os.path.isdir(directory):
        r.error(f"{directory}: " + ("a file, not a cache directory" if os.path.exists(directory)
                                    else "no such directory"))
        return _finish(r)
    if not (os.path.exists(os.path.join(directory, STORE_FILE)) or list_segments(directory)
            or os.path.exists(os.path.join(directory, LOCK_FILE))):
        hint = ""
        if os.path.exists(os.path.join(directory, "SHARDS")):
            return _check_shards(directory, r)
        r.error(f"{directory} is not a durablekv cache directory (no {STORE_FILE}, no log)"
                + hint)
        return _finish(r)
    lock = os.path.join(directory, LOCK_FILE)
    lock_fd = None
    # Held shared until the check is done: a cache opening meanwhile (it
    # takes these exclusively) would change what is being read. The
    # directory's own flock is the ownership lock; LOCK's is an older
    # durablekv's.
    try:
        dir_fd = lock_directory(directory, exclusive=False)
        if os.path.exists(lock):
            lock_fd = os.open(lock, os.O_RDONLY)
            try:
                fcntl.flock(lock_fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                pid = lock_owner_pid(lock_fd)
                os.close(lock_fd)
                os.close(dir_fd)
                raise CacheLockedError(directory, pid) from None
    except CacheLockedError as exc:
        pid = exc.pid
        if pid == os.getpid():
            owner = (f"this process ({pid}), by a Cache that was not closed; close() it "
                     "and check again")
        else:
            owner = (f"process {pid}" if pid is not None else "another process") + \
                "; close the cache there (or let that process exit) and check again"
        r.error(f"{directory} is open in {owner}")
        return _finish(r)
    except OSError as exc:
        r.error(f"{directory}: cannot be locked for the check ({exc.strerror})")
        return _finish(r)
    try:
        _check_contents(directory, r, log)
    finally:
        if lock_fd is not None:
            os.close(lock_fd)
        os.close(dir_fd)
    return _finish(r)


def _check_contents(directory: str, r: CheckResult, log: bool = True) -> None:
    marker = os.path.join(directory, STORE_FILE + ".damaged")
    store = os.path.join(directory, STORE_FILE)
    marked = False
    if os.path.exists(marker) and not os.path.exists(store):
        r.note(f"{marker}: left by a store that is gone (moved aside by a rebuild, or "
               "deleted); the next open removes it")
    elif os.path.exists(marker):
        with open(marker, encoding="utf-8", errors="replace") as f:
            first = f.readline().strip()
        r.bad(f"{marker}: a read found damage while the cache was in use ({first}); the "
              "next open refuses the store (open with on_corruption='rebuild', or run "
              f"`durablekv salvage --on-corruption rebuild {shlex.quote(directory)}`, to "
              "move it aside and start empty, applying the replay log, or delete the "
              "marker if the store checks clean)")
        marked = True
    damage_before = len(r.lines)
    checkpoint = _check_store(directory, r)
    if not marked and any(line.startswith("DAMAGE") and COUNT_ONLY not in line
                          for line in r.lines[damage_before:]):
        r.next(_rebuild_advice(directory))
    if not log:
        return
    _check_log(directory, checkpoint, r, r.serializer)
    for name in sorted(os.listdir(directory)):
        if name.startswith("replay-") and name.endswith(".damaged"):
            r.note(f"{os.path.join(directory, name)}: a log segment salvage moved aside; its "
                   "records from the damage (or LSN gap) on were not recovered (kept for "
                   "inspection)")


def _finish(r: CheckResult) -> CheckResult:
    r.lines.append("result  " + ("healthy" if r.ok else "DAMAGED" if r.damaged
                                 else "NOT CHECKED (see ERROR above; no damage was found)"))
    return r


def _check_store(directory: str, r: CheckResult) -> int:
    path = os.path.join(directory, STORE_FILE)
    if not os.path.exists(path):
        ready = path + ".ready"
        if os.path.exists(ready):
            # a rebuild killed after it moved the damaged store aside: the
            # next open installs this one (SQLitePageStore.__init__)
            conn = sqlite3.connect(read_only_uri(ready, True), uri=True)
            try:
                row = conn.execute(
                    "SELECT value FROM meta WHERE name = 'checkpoint_lsn'").fetchone()
            finally:
                conn.close()
            checkpoint = int(row[0]) if row else 0
            r.note(f"{ready}: the store an interrupted rebuild prepared (checkpoint "
                   f"{checkpoint}); the next open puts it in place")
            return checkpoint
        r.note(f"{path}: no store yet (a cache that was never flushed)")
        if os.path.exists(path + "-wal"):
            r.note(f"{path}-wal: left by a store that is gone; the next open removes it "
                   "before it makes a new store")
        return 0
    wal = path + "-wal"
    # A read-only connection still creates -wal and -shm files beside a WAL
    # store and leaves them there. With no WAL content, everything is in the
    # main file and nothing can change it while check holds the lock, so it
    # is opened as immutable: no file is created or touched. WAL content (a
    # crash left it) must be read, so then SQLite uses the -shm as usual.
    immutable = not os.path.exists(wal) or os.path.getsize(wal) == 0
    try:
        conn = sqlite3.connect(read_only_uri(path, immutable), uri=True)
        rows = [x[0] for x in conn.execute("PRAGMA integrity_check")]
    except sqlite3.OperationalError as exc:
        if "unable to open" not in str(exc):
            r.bad(f"{path}: not a readable SQLite database ({exc})")
        elif not os.access(directory, os.W_OK):
            # WAL mode: even a read-only reader creates pages.sqlite3-shm.
            r.error(f"{path}: cannot be opened ({exc}): SQLite needs to create "
                    f"{STORE_FILE}-shm beside a WAL store and {directory} is not writable; "
                    "check a copy of the directory on writable storage")
        else:
            r.error(f"{path}: cannot be opened ({exc})")
        return 0
    except sqlite3.DatabaseError as exc:
        r.bad(f"{path}: not a readable SQLite database ({exc})")
        return 0
    try:
        if rows != ["ok"]:
            r.bad(f"{path}: SQLite integrity_check: {'; '.join(rows[:5])}")
            return 0
        r.good(f"{path}: SQLite integrity_check")
        version = conn.execute("PRAGMA user_version").fetchone()[0]
        supported = len(migration_files())
        if version > supported:
            r.error(f"{path}: schema version {version} was written by a newer durablekv "
                    f"(this one knows up to {supported}); upgrade durablekv to check it")
            return 0
        if version == 0:
            r.bad(f"{path}: schema version 0 (this durablekv: {supported})")
            return 0
        if version != supported:
            r.note(f"{path}: schema version {version}, written by an older durablekv (this "
                   f"one: {supported}); check leaves it as it is, but opening the cache with "
                   f"this durablekv upgrades it to {supported}, after which the older "
                   "durablekv refuses it (back the directory up first if you may go back)")
        meta = dict(conn.execute("SELECT name, value FROM meta"))
        r.serializer = str(meta.get("serializer", "safe"))
        # (one min() or max() per statement: SQLite reads one B-tree path for
        # it; both in one statement scan the whole table)
        max_pid, min_pid = (conn.execute("SELECT MAX(page_id) FROM pages").fetchone()[0],
                            conn.execute("SELECT MIN(page_id) FROM pages").fetchone()[0])
        problems = meta_problems(meta, max_pid, min_pid, sum(
            os.path.getsize(p) for p in (path, wal) if os.path.exists(p)))
        for problem in problems:
            r.bad(f"{path}: {problem}; the next open refuses the store (CorruptStoreError)")
        if problems:
            return 0
        checkpoint = meta["checkpoint_lsn"]
        r.good(f"settings: page_size={meta.get('page_size')} serializer={meta.get('serializer')} "
               f"checkpoint_lsn={checkpoint}")
        if r.serializer not in ("safe", "json"):
            # what the open says to any other serializer= (SQLitePageStore._settings)
            r.note(f"{path}: stores values with serializer={r.serializer!r}: open it with "
                   f"serializer={r.serializer!r}" + (
                       "" if r.serializer == "pickle" else
                       " (a ValueCodec of that name: durablekv ships 'safe' and 'pickle')"))
        index = {k: (pid, exp) for k, pid, exp in
                 conn.execute("SELECT key, page_id, expire_at FROM keys")}
        # schema version 3 on: every page row carries a checksum (page_crc)
        checksums = "crc" in {c[1] for c in conn.execute("PRAGMA table_info(pages)")}
        problems, pages, entries = index_agreement(
            index, conn.execute("SELECT page_id, n_entries, data, " +
                                ("crc" if checksums else "NULL") + " FROM pages"),
            int(meta.get("key_count", -1)), meta["page_size"], checksums, r.serializer)
        for problem in problems:
            r.bad(problem)
        if r.ok:
            r.good(f"key index agrees with {pages} pages ({entries} entries)")
        if "data_bytes" in meta:  # schema version 4 on (size_limit's account)
            actual = conn.execute("SELECT coalesce(sum(length(data)), 0) FROM pages").fetchone()[0]
            if actual != meta["data_bytes"]:
                r.bad(f"{path}: meta data_bytes={meta['data_bytes']!r}, but the pages hold "
                      f"{actual} bytes; size_limit would evict too much or too little "
                      + COUNT_ONLY)
        return checkpoint
    finally:
        conn.close()


def index_agreement(index: dict[bytes, tuple[int, float | None]], page_rows: Any,
                    key_count: int, page_size: int, checksums: bool,
                    serializer: str | None = None) -> tuple[list[str], int, int]:
    """Check that a store's key index and pages agree both ways.

    :param index: ``{canonical key: (page_id, expire_at)}``, every index row.
    :param page_rows: iterable of ``(page_id, n_entries, blob, crc)``, every
        page (``crc`` as :func:`~durablekv.stores.pageformat.page_crc`; ignored unless
        ``checksums``).
    :param key_count: the store's recorded key count.
    :param page_size: slots per page (a slot past it is damage).
    :param serializer: the store's value codec; for ``"safe"``/``"json"`` and
        ``"pickle"`` each value's first byte is checked against it (a pickle
        starts with the PROTO opcode 0x80, a safe encoding with an ASCII
        tag), without decoding, so that a changed meta ``serializer`` is
        found (a pickle is never loaded: that could run code).
    :returns: ``(problems, pages, entries)``: one line per disagreement
        ([] when they agree), and how many pages and entries were read.
    """
    problems: list[str] = []
    bad = problems.append
    seen = set()
    pages = entries = 0
    # Keys the index places in a page that cannot be read are that page's
    # damage, said on its line, not an "orphaned index row" each.
    unreadable: set[Any] = set()
    keys_in: dict[Any, int] | None = None
    want_pickle = {"pickle": True, "safe": False, "json": False}.get(serializer or "")
    foreign = 0
    first_foreign: str | None = None

    def their_keys(pid: Any) -> str:
        nonlocal keys_in
        if keys_in is None:
            keys_in = {}
            for page, _exp in index.values():
                keys_in[page] = keys_in.get(page, 0) + 1
        unreadable.add(pid)
        k = keys_in.get(pid, 0)
        return (f" (the {k} key{'s' if k != 1 else ''} the index places in it cannot be "
                "read)" if k else "")

    for pid, n, data, crc in page_rows:
        pages += 1
        if checksums and page_crc(pid, n, data) != crc:
            bad(f"page {pid!r}: fails its checksum (stored {crc!r}, computed "
                f"{page_crc(pid, n, data)}): its blob or entry count was changed on disk; "
                f"a read of it raises CorruptStoreError{their_keys(pid)}")
            continue
        try:
            got = list(decode_page(data))
        except ValueError as exc:
            bad(f"page {pid}: cannot be decoded ({exc}){their_keys(pid)}")
            continue
        if len(got) != n:
            bad(f"page {pid}: holds {len(got)} entries, its row says {n}")
        slots = [e[0] for e in got]
        if slots and max(slots) >= page_size:
            bad(f"page {pid}: slot {max(slots)} is past page_size {page_size}")
        if len(set(slots)) != len(slots):
            bad(f"page {pid}: lists a slot twice")
        for slot, kb, vb, exp in got:
            entries += 1
            if want_pickle is not None and vb and (vb[0] == 0x80) != want_pickle:
                foreign += 1
                if first_foreign is None:
                    first_foreign = f"page {pid} slot {slot}, starting {vb[:2]!r}"
            try:
                ck = canonical_key(decode_key(kb))
            except (ValueError, TypeError, IndexError) as exc:
                bad(f"page {pid} slot {slot}: key cannot be decoded ({exc})")
                continue
            seen.add(ck)
            row = index.get(ck)
            if row is None:
                bad(f"page {pid} slot {slot}: key {decode_key(kb)!r} is missing from the index")
            elif row[0] != pid:
                bad(f"page {pid} slot {slot}: the index places key {decode_key(kb)!r} "
                    f"in page {row[0]}")
            elif row[1] != exp:
                bad(f"page {pid} slot {slot}: expire_at {exp} but the index says {row[1]}")
    if foreign:
        bad(f"{foreign} value{'s are' if foreign != 1 else ' is'} not "
            f"{'a pickle' if want_pickle else 'in the safe encoding'} (the first: "
            f"{first_foreign}), although meta serializer={serializer!r} says so: the values "
            "were written with another serializer, and the meta table was changed since")
    orphans = {ck for ck in set(index) - seen if index[ck][0] not in unreadable}
    for ck in list(orphans)[:10]:
        bad(f"index row {decode_key(ck)!r} points at page {index[ck][0]}, which does not hold it")
    if len(orphans) > 10:
        bad(f"... and {len(orphans) - 10} more orphaned index rows")
    if key_count != len(index):
        bad(f"meta key_count={key_count} but the index has {len(index)} keys " + COUNT_ONLY)
    return problems, pages, entries


def _rebuild_advice(directory: str) -> str:
    """What store damage asks of the user. An open reads no more of the store
    than it needs, so it may not see what check found until a read meets it;
    salvage --on-corruption rebuild checks the store first, as check does."""
    return (f"{os.path.join(directory, STORE_FILE)}: to repair the store, run `durablekv "
            f"salvage --on-corruption rebuild {shlex.quote(directory)}`: it checks the store "
            f"as this does, moves a damaged one aside ({STORE_FILE}.corrupt-*, kept for "
            "inspection) and builds a new one from the replay log, so the entries only the "
            "damaged store held are gone from the cache (to be computed again); or restore "
            "the directory from a backup")


#: What a damaged log asks of the user: the next open refuses it.
def _salvage_advice(directory: str) -> str:
    return ("the next open refuses the log (LogCorruptionError). Run `durablekv salvage "
            f"{shlex.quote(directory)}` (or open with salvage_log=True) to keep the records before it and "
            "move this segment and every later one aside, losing the records from there on, "
            "or restore the directory from a backup")


def _undecodable(rec: tuple, values) -> str | None:
    """Why a log record's key or value (``values``: the store's codec, or
    None when unknown) cannot be decoded, or None when it can."""
    try:
        decode_key(rec[2])
        if values is not None and rec[1] == OP_SET:
            values.decode(rec[3])
    except (ValueError, TypeError, IndexError) as exc:
        return str(exc)
    return None


def _check_log(directory: str, checkpoint: int, r: CheckResult,
               serializer: str | None = None) -> None:
    """Read the log as the next open will (:func:`~durablekv.log.segments.scan_segment`):
    damage or an LSN gap that can hide only records at or below the
    checkpoint loses nothing, and recovery steps over it, so it is a note."""
    segments = list_segments(directory)
    control, control_why = read_control(directory)
    if control_why is not None:
        r.bad(f"{control_why}; it says what the log must hold, so {_salvage_advice(directory)}")
    if not segments:
        loss = missing_records(directory, control, segments, checkpoint, None)
        if loss is not None:
            r.bad(f"replay log: {loss.detail}; {_salvage_advice(directory)}")
        else:
            r.good("replay log: empty (cleanly closed)")
        return
    spans: dict[str, tuple[int, int] | None] = {}
    # (pickle values are not loaded: that could run code)
    values = SafeCodec() if serializer in (None, "safe", "json") else None
    expect = None
    pending = 0
    salvageable = None  # records after the checkpoint before the first refused damage
    after_damaged_end = False  # the previous segment's damaged end was stepped over
    first_record = True        # the log's first record is still to come
    for i, path in enumerate(segments):
        last = i == len(segments) - 1
        scan, size = scan_segment_file(path, checkpoint, None if last else segments[i + 1])
        spans[path] = (scan.records[0][0], scan.records[-1][0]) if scan.records else None
        # records that follow damage stepped over: a gap before them is that damage's
        resumed = set(itertools.accumulate(count for _offset, count in scan.runs[:-1]))
        if after_damaged_end:
            resumed.add(0)
        for j, rec in enumerate(scan.records):
            lsn = rec[0]
            if lsn > checkpoint:
                bad = _undecodable(rec, values)
                if bad:
                    r.bad(f"{path}: record LSN {lsn} at offset "
                          f"{_record_offset(scan.records, scan.runs, j)} has a CRC that checks "
                          f"out but cannot be decoded ({bad}); the next open refuses it "
                          "(LogCorruptionError)")
            if expect is None and first_record and lsn > checkpoint + 1:
                r.bad(f"{path}: {start_gap_detail(checkpoint, lsn)}; "
                      f"{_salvage_advice(directory)}")
                if salvageable is None:
                    salvageable = pending
            first_record = False
            if expect is not None and lsn != expect:
                if expect < lsn <= checkpoint + 1:
                    if j not in resumed:
                        r.note(f"{path}: LSN {lsn} follows {expect - 1}; the records between "
                               f"are missing, but they are already in the store (checkpoint "
                               f"{checkpoint}), so nothing is lost")
                else:
                    r.bad(f"{path}: LSN {lsn} follows {expect - 1} (a gap: a segment is "
                          f"missing or out of order); {_salvage_advice(directory)}")
                    if salvageable is None:
                        salvageable = pending
            expect = lsn + 1
            if lsn > checkpoint:
                pending += 1
        after_damaged_end = bool(scan.stepped_over) and scan.stepped_over[-1][1] is None
        damage = scan.damage
        refused = damage is not None and (not last or scan.intact_after)
        cut_by_hand = None if damage is None or refused else \
            cut_from_mapped(control, path, size, damage.detail)
        if cut_by_hand is not None:
            refused = True
            damage.detail += "; " + cut_by_hand
        if scan.stepped_over:
            # What the open does (ReplayLog.recover, then truncate_through at
            # the store's checkpoint): the segment stays only while it holds
            # records the store lacks.
            last_lsn = scan.records[-1][0] if scan.records else 0
            if refused:
                then = ""  # the open refuses this segment anyway: DAMAGE below
            elif last_lsn <= checkpoint:
                then = (": the next open steps over them and deletes this segment (all its "
                        "records are in the store)")
            else:
                then = (": the next open steps over them, and deletes this segment once a "
                        f"checkpoint passes its last record, LSN {last_lsn} (at the first "
                        "write-behind flush after the open, or at close)")
            for skipped, resume, why in scan.stepped_over:
                what = "damaged bytes" if resume is not None else "a damaged end"
                if why.startswith("the records there"):
                    why += f" (at or below checkpoint {checkpoint})"
                r.note(f"{path}: {what} at offset {skipped.offset} ({skipped.detail}); "
                       f"{why}, so nothing is lost{then}")
        if damage is None:
            if not scan.stepped_over:
                r.good(f"{path}: {len(scan.records)} records, CRCs ok")
        elif not refused:  # a torn tail: the last segment, nothing intact behind it
            whole = ""
            if damage.detail.startswith("CRC mismatch"):
                # the bytes its length names are all there: a power loss
                # during the write leaves this, and so does a flipped bit
                whole = ("; the bytes of the record all lie within the file but fail its "
                         "CRC, which a crash or power loss during its write leaves, and a "
                         "flipped bit on disk too: if neither happened since it was "
                         "written, the open drops a write that was acknowledged")
            if scan.torn_unused:
                what = (f"{damage.detail}): a torn record of "
                        f"{size - scan.good_end - scan.torn_unused} bytes, then "
                        f"{scan.torn_unused} bytes of unused preallocated space (zero-filled)")
            else:
                what = f"{damage.detail}, {size - scan.good_end} bytes)"
            r.note(f"{path}: torn tail at offset {damage.offset} ({what}; it is cut off at the "
                   f"next open{whole}")
        else:  # refused
            if salvageable is None:
                salvageable = pending
            r.bad(f"{path}: damaged record at offset {damage.offset} ({damage.detail}); the "
                  f"damage covers records after checkpoint {checkpoint}, which the store "
                  f"does not hold, so {_salvage_advice(directory)}")
            expect = None  # the gap behind the damage is this damage, not another
    if salvageable is None:
        loss = missing_records(directory, control, segments, checkpoint,
                               None if expect is None else expect - 1,
                               position_problem(directory, segments, checkpoint, spans))
        if loss is not None:
            r.bad(f"{loss.path}: {loss.detail}; {_salvage_advice(directory)}")
            salvageable = pending
    if salvageable is not None:
        r.note(f"replay log: the next open refuses the log (see the damage above); with "
               f"salvage_log=True it applies the {salvageable} records after checkpoint "
               f"{checkpoint} that come before the first damage and gives up the rest")
    elif pending:
        r.note(f"replay log: {pending} records after checkpoint {checkpoint} are applied "
               "again at the next open")
