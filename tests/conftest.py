"""Shared fixtures: where the real traces live, and small helpers."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from durablekv import Cache
from durablekv.tier.pages import EMPTY, HAS_TTL, MemoryTier

REPO = Path(__file__).resolve().parents[1]
#: ../shared/traces beside the repository (read-only; never copied into it).
TRACES = REPO.parent / "shared" / "traces"


#: ``.ci/run`` sets this: there a missing trace is a failure, not a skip, so
#: the real-trace tests can never pass by not running.
REQUIRE_TRACES = os.environ.get("DURABLEKV_REQUIRE_TRACES") == "1"


#: ``.ci/run`` sets this too: there a missing prometheus/promtool binary fails
#: the tests that need it instead of skipping them.
REQUIRE_PROMETHEUS = os.environ.get("DURABLEKV_REQUIRE_PROMETHEUS") == "1"


def need_binaries(*names: str) -> None:
    """Skip (locally) or fail (in CI) a test whose binaries are not on PATH."""
    import shutil
    missing = [n for n in names if shutil.which(n) is None]
    if not missing:
        return
    reason = (f"needs {' and '.join(missing)} on PATH (Debian: apt-get install -y "
              "--no-install-recommends prometheus)")
    if REQUIRE_PROMETHEUS:
        pytest.fail(reason + "; DURABLEKV_REQUIRE_PROMETHEUS=1 makes this a failure",
                    pytrace=False)
    pytest.skip(reason)


def no_traces(what: Path) -> None:
    """Skip (locally) or fail (in CI) a test whose real trace is missing."""
    reason = f"real trace {what} is not available (expected ../shared/traces beside the repo)"
    if REQUIRE_TRACES:
        pytest.fail(reason + "; DURABLEKV_REQUIRE_TRACES=1 makes this a failure", pytrace=False)
    pytest.skip(reason)


def trace_path(name: str) -> Path:
    """Path of a real trace; see :func:`no_traces` when it is missing."""
    p = TRACES / name
    if not p.exists():
        no_traces(p)
    return p


@pytest.fixture
def cache_dir(tmp_path: Path) -> Path:
    return tmp_path / "cache"


@pytest.fixture
def home(tmp_path, monkeypatch):
    """$HOME is ``tmp_path/home``; the working directory ``tmp_path/cwd``
    (where a literal ``~`` directory would appear)."""
    (tmp_path / "home").mkdir()
    (tmp_path / "cwd").mkdir()
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path / "cwd")
    return tmp_path / "home"


class Clock:
    """A settable clock for ``Cache(clock=...)`` (epoch seconds)."""

    def __init__(self, now: float = 1_000.0) -> None:
        self.now = float(now)

    def __call__(self) -> float:
        return self.now


def run_with_timeout(fn, seconds: float = 10.0):
    """Run ``fn`` in a thread; fail (not hang) when it takes longer than ``seconds``."""
    box: dict = {}

    def target():
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller
            box["error"] = exc

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"{fn} did not return within {seconds} s"
    if "error" in box:
        raise box["error"]
    return box.get("value")


def open_cache(path, **kw) -> Cache:
    """A Cache whose batcher flushes only when asked (flush_interval 30 s) and
    whose memory tier starts cold (warm=False: no preload thread races the
    test's counts of page faults and store hits; tests/test_warm.py tests the
    warm restart)."""
    kw.setdefault("flush_interval", 30.0)
    kw.setdefault("warm", False)
    return Cache(path, **kw)


@contextlib.contextmanager
def opened(path, **kw):
    """``with opened(...) as c``: like ``with Cache(...)``, but a close() that
    hangs fails the test instead of hanging the run."""
    c = open_cache(path, **kw)
    try:
        yield c
    finally:
        run_with_timeout(c.close, 10.0)


def owner_process(directory, close: bool = True) -> subprocess.Popen:
    """Start another process that opens a cache at ``directory``, sets
    ``x = 1`` and holds it open until a line arrives on its stdin (then it
    closes the cache when ``close``, else just exits). Returns once the cache
    is open."""
    code = ("import sys\nfrom durablekv import Cache\n"
            "c = Cache(sys.argv[1]); c['x'] = 1\nprint('open', flush=True)\n"
            "sys.stdin.readline()\n" + ("c.close()\n" if close else ""))
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.Popen([sys.executable, "-c", code, str(directory)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    if proc.stdout.readline().strip() != "open":
        proc.kill()
        raise AssertionError("the owner process did not open the cache")
    return proc


def interrupt_first_removal(m: pytest.MonkeyPatch, interrupt) -> list:
    """Patch ``shutil.rmtree`` and ``os.unlink`` on ``m`` so that ``interrupt()``
    runs as the first removal's first unlink returns: where a signal
    handler's exception (Ctrl-C, SIGTERM) lands in the removal of a
    temporary directory. Returns a list that holds ``"cut"`` once it has."""
    import shutil
    real_unlink, real_rmtree = os.unlink, shutil.rmtree
    removing: list = []

    def rmtree(path, *args, **kwargs):
        removing.append(path)
        return real_rmtree(path, *args, **kwargs)

    def unlink(path, *args, **kwargs):
        real_unlink(path, *args, **kwargs)
        if len(removing) == 1:
            removing.append("cut")
            interrupt()

    m.setattr(shutil, "rmtree", rmtree)
    m.setattr(os, "unlink", unlink)
    return removing


def run_threads(target, n: int) -> None:
    """Run ``target(i)`` in ``n`` threads at once and wait for them all."""
    threads = [threading.Thread(target=target, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def check_table(tier: MemoryTier) -> None:
    """The page table agrees with the pages: each entry ``(page, slot,
    value)`` names its key's slot, and its value is the slot's value, or
    HAS_TTL when the slot has an expiry; and every key on a page in memory
    has an entry there."""
    for key, (page, slot, value) in tier.table.items():
        assert page.keys[slot] is not EMPTY and page.keys[slot] == key, (key, page)
        assert tier.pages.get(page.page_id) is page, (key, page)
        if page.expires[slot] is None:
            assert value is page.values[slot], (key, value, page.values[slot])
        else:
            assert value is HAS_TTL, (key, value)
    for page in tier.pages.values():
        for slot, key in enumerate(page.keys):
            if key is not EMPTY:
                assert tuple(tier.table[key][:2]) == (page, slot), (key, page)


def tier_layout(tier: MemoryTier, times: bool = True) -> dict:
    """Everything about a memory tier's layout that a hit ratio or a test
    could see, as plain data: each page (id, slots, values, expiries, free
    slots, counts, versions, dirty LSN and time, bytes, recency stamps,
    state), the page table in its order (key, page, slot, entry kind), the
    LRU heap, the dirty order, the free list, the open page, the next page
    id and the LRU clock. Values and keys carry their type (``1`` and
    ``1.0`` differ here); a value kept encoded compares by its bytes.
    ``times=False``: a page's ``dirty_since`` (a reading of the real
    monotonic clock) only says whether it is set."""
    from durablekv.codec import Frozen

    def val(v):
        return ("Frozen", v.blob) if type(v) is Frozen else (type(v).__name__, repr(v))

    def key(k):
        return "EMPTY" if k is EMPTY else (type(k).__name__, repr(k))

    pages = {pid: dict(keys=[key(k) for k in p.keys], values=[val(v) for v in p.values],
                       expires=list(p.expires), free_slots=list(p.free_slots), used=p.used,
                       version=p.version, keys_version=p.keys_version, state=p.state,
                       dirty_since=p.dirty_since if times else p.dirty_since is not None,
                       dirty_lsn=p.dirty_lsn, nbytes=p.nbytes,
                       stamp=p.stamp, heap_stamp=p.heap_stamp, stored_n=p.stored_n,
                       stored_ttl_n=p.stored_ttl_n)
             for pid, p in sorted(tier.pages.items())}
    table = [(key(k), e[0].page_id, e[1], "HAS_TTL" if e[2] is HAS_TTL else val(e[2]),
              type(e).__name__) for k, e in tier.table.items()]
    return dict(pages=pages, table=table,
                heap=[(stamp, p.page_id) for stamp, p in getattr(tier.policy, "heap", [])],
                dirty=list(tier.dirty), free=list(tier.free),
                open_page=tier.open_page and tier.open_page.page_id,
                next_page_id=tier.next_page_id, resident=tier.resident,
                resident_bytes=tier.resident_bytes, pending=tier.pending,
                evictions=tier.evictions, page_faults=tier.page_faults,
                ticks=int(repr(tier.ticks)[6:-1]), locked_ticks=tier.locked_ticks)


def reseal_pages(conn) -> None:
    """Give every page row of an open sqlite3 ``conn`` to a store the
    checksum of its current contents: for tests that damage a page's blob on
    purpose to reach the checks behind the checksum (decoding, the key index)."""
    from durablekv.stores.pageformat import page_crc
    conn.create_function("durablekv_page_crc", 3, page_crc)
    conn.execute("UPDATE pages SET crc = durablekv_page_crc(page_id, n_entries, data)")


@pytest.fixture(scope="session")
def pg():
    """One real PostgreSQL server for the session (tests/pg.py); skipped
    (locally) or failed (CI) without the binaries."""
    from .pg import pg_server
    with pg_server() as server:
        yield server


@pytest.fixture
def pg_ns(request) -> str:
    """A namespace of the session's server no other test uses."""
    _NS_COUNTER[0] += 1
    return f"{request.node.name[:40]}-{_NS_COUNTER[0]}"


_NS_COUNTER = [0]


def simulate_restart(directory) -> None:
    """Make ``directory``'s replay log look as if the machine restarted since it
    was written (``replay.control`` gets another boot id): what a test that
    fakes a power loss's damage must do, since after a mere crash the log's
    checks know that nothing the OS held can be missing."""
    from durablekv.log.control import read_control, write_control
    control, why = read_control(str(directory))
    assert why is None, why
    if control is not None:  # (none: a clean close, or everything was checkpointed)
        write_control(str(directory), control._replace(boot_id="boot-before-the-power-loss"))


def as_write_appended(directory) -> None:
    """Make ``directory``'s replay log look as if its records went through
    write(2), not a mapping: for a test that cuts a mapped segment back to
    its last record by hand, so that a cut tail then reads as a torn write
    (on a mapped segment, a file shorter than its preallocated size is a cut,
    which recovery refuses)."""
    from durablekv.log.control import read_control, write_control
    control, why = read_control(str(directory))
    assert why is None, why
    if control is not None:
        write_control(str(directory), control._replace(append="write"))
