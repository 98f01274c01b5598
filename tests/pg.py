"""Real PostgreSQL servers for the tests, from Debian's binaries.

:class:`PgServer` runs ``initdb`` in a temporary directory owned by an
unprivileged user (PostgreSQL refuses to run as root), starts ``postgres``
on 127.0.0.1 on a free port with its unix socket in that directory, waits
for it with a deadline and stops it (fast shutdown, then SIGKILL) however
the test ends. Password authentication is on for TCP, so that tests can put
a password in the connection string and check that no message prints it.

Without the binaries the tests skip with the reason; ``.ci/run`` installs
``postgresql`` and sets ``DURABLEKV_REQUIRE_POSTGRES=1``, which turns that
skip into a failure.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import signal
import sys
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from durablekv.errors import CacheLockedError

REPO = Path(__file__).resolve().parents[1]

def _newest_pg_bin() -> Path:
    """Debian's newest installed PostgreSQL (``/usr/lib/postgresql/<major>/bin``)."""
    found = sorted(Path("/usr/lib/postgresql").glob("*/bin/postgres"),
                   key=lambda p: int(p.parent.parent.name) if p.parent.parent.name.isdigit() else 0)
    return found[-1].parent if found else Path("/usr/lib/postgresql/15/bin")


PG_BIN = Path(os.environ.get("DURABLEKV_PG_BIN") or _newest_pg_bin())
REQUIRE_POSTGRES = os.environ.get("DURABLEKV_REQUIRE_POSTGRES") == "1"
#: the superuser's password (TCP connections must give it)
PASSWORD = "pw-Zq7-secret"
START_DEADLINE = 60.0


def no_postgres(reason: str) -> None:
    """Skip (locally) or fail (CI) a test that needs PostgreSQL."""
    if REQUIRE_POSTGRES:
        pytest.fail(reason + "; DURABLEKV_REQUIRE_POSTGRES=1 makes this a failure", pytrace=False)
    pytest.skip(reason)


def _missing() -> str | None:
    for tool in ("initdb", "postgres", "pg_ctl"):
        if not (PG_BIN / tool).exists():
            return f"PostgreSQL server binaries not found ({PG_BIN / tool}); install postgresql"
    try:
        import psycopg
    except ImportError:
        return "psycopg is not installed; pip install 'durablekv[postgres]'"
    del psycopg
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_as() -> dict:
    """Popen arguments that run a server tool as an unprivileged user (never
    root); the server is then this process's own child, reaped by ``wait``."""
    if os.geteuid() != 0:
        return {}
    user = pwd.getpwnam("postgres")
    return dict(user=user.pw_uid, group=user.pw_gid, extra_groups=[])


class PgServer:
    """One PostgreSQL server in a temporary directory.

    :ivar port: its TCP port on 127.0.0.1.
    :ivar root: the temporary directory (data directory ``root/data``).
    """

    def __init__(self, root: Path | None = None, data: Path | None = None,
                 port: int | None = None) -> None:
        self.as_user = _run_as()
        self.root = Path(root or tempfile.mkdtemp(prefix="dkv-pg-"))
        self.data = data or self.root / "data"
        if self.as_user:
            os.chown(self.root, self.as_user["user"], self.as_user["group"])
        self.port = port or _free_port()
        self.proc: subprocess.Popen | None = None

    def _tool(self, name: str, *args: str, **kw) -> subprocess.CompletedProcess:
        return subprocess.run([str(PG_BIN / name), *args], check=True, capture_output=True,
                              text=True, cwd=self.root, **self.as_user, **kw)

    def initdb(self) -> None:
        pwfile = self.root / "pwfile"
        pwfile.write_text(PASSWORD + "\n")
        if self.as_user:
            os.chown(pwfile, self.as_user["user"], self.as_user["group"])
        self._tool("initdb", "-D", str(self.data), "-U", "postgres", "--pwfile", str(pwfile),
                   "--auth-local=trust", "--auth-host=scram-sha-256", "-E", "UTF8",
                   "--no-sync", timeout=START_DEADLINE)
        with open(self.data / "pg_hba.conf", "a") as f:
            f.write("host replication all 127.0.0.1/32 scram-sha-256\n")

    def start(self, *settings: str) -> None:
        """Start ``postgres`` (``settings``: extra ``name=value``) and wait until
        it accepts connections, at most :data:`START_DEADLINE` seconds."""
        opts = ["-c", "listen_addresses=127.0.0.1", "-c", f"unix_socket_directories={self.root}",
                "-c", "fsync=off", "-c", "shared_buffers=16MB", "-c", "max_connections=60",
                "-c", "wal_level=replica", "-c", "max_wal_senders=4"]
        for s in settings:
            opts += ["-c", s]
        log = open(self.root / "server.log", "ab")
        self.proc = subprocess.Popen([str(PG_BIN / "postgres"), "-D", str(self.data),
                                      "-p", str(self.port), *opts], cwd=self.root,
                                     stdout=log, stderr=subprocess.STDOUT,
                                     start_new_session=True, **self.as_user)
        log.close()
        deadline = time.monotonic() + START_DEADLINE
        import psycopg
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"postgres exited with {self.proc.returncode}: "
                                   + (self.root / "server.log").read_text()[-2000:])
            try:
                psycopg.connect(self.url(), connect_timeout=2).close()
                return
            except psycopg.OperationalError as exc:
                if "starting up" not in str(exc) and "refused" not in str(exc) \
                        and "No such file" not in str(exc) and "recovery" not in str(exc):
                    raise
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"postgres on port {self.port} not ready in {START_DEADLINE} s")
            time.sleep(0.05)

    def url(self, dbname: str = "postgres") -> str:
        return f"postgresql://postgres:{PASSWORD}@127.0.0.1:{self.port}/{dbname}"

    def kill(self) -> None:
        """SIGKILL the postmaster and its backends (its whole process group)."""
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        if self.proc is not None:
            # backends are reparented, not our children: wait until they are
            # gone so that a restart finds no live process on the data dir
            deadline = time.monotonic() + 10
            while _group_alive(self.proc.pid) and time.monotonic() < deadline:
                time.sleep(0.02)

    def stop(self) -> None:
        """Fast shutdown; SIGKILL after 20 s. Idempotent."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.kill()
        self.proc = None

    def remove(self) -> None:
        self.stop()
        shutil.rmtree(self.root, ignore_errors=True)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


@contextlib.contextmanager
def pg_server(*settings: str):
    """A started :class:`PgServer`, stopped and removed on exit."""
    missing = _missing()
    if missing:
        no_postgres(missing)
    server = PgServer()
    try:
        server.initdb()
        server.start(*settings)
        yield server
    finally:
        server.remove()


@contextlib.contextmanager
def pg_pair():
    """``(primary, standby)``: a primary and a synchronous streaming standby
    (``pg_basebackup`` of the primary, ``application_name=standby1``, listed
    in the primary's ``synchronous_standby_names``), both stopped and removed
    on exit. Returns once the standby's ``sync_state`` is ``sync``."""
    with pg_server() as primary:
        standby = PgServer()
        try:
            standby._tool("pg_basebackup", "-D", str(standby.data), "-d", primary.url(),
                          "-X", "stream", "-c", "fast", "--no-sync", timeout=START_DEADLINE)
            (standby.data / "standby.signal").touch()
            if standby.as_user:
                os.chown(standby.data / "standby.signal", standby.as_user["user"],
                         standby.as_user["group"])
            standby.start(f"primary_conninfo=host=127.0.0.1 port={primary.port} user=postgres "
                          f"password={PASSWORD} application_name=standby1")
            import psycopg
            with psycopg.connect(primary.url(), autocommit=True) as conn:
                conn.execute("ALTER SYSTEM SET synchronous_standby_names = 'standby1'")
                conn.execute("SELECT pg_reload_conf()")
                deadline = time.monotonic() + START_DEADLINE
                while sync_state(conn) != "sync":
                    if time.monotonic() > deadline:
                        raise RuntimeError("the standby did not become synchronous in "
                                           f"{START_DEADLINE} s")
                    time.sleep(0.05)
            yield primary, standby
        finally:
            standby.remove()


def sync_state(conn) -> str | None:
    """The ``sync_state`` of standby1 as the primary on ``conn`` sees it."""
    row = conn.execute("SELECT sync_state FROM pg_stat_replication "
                       "WHERE application_name = 'standby1'").fetchone()
    return None if row is None else row[0]


def promote(standby: PgServer) -> None:
    """Promote ``standby`` (``pg_ctl promote``, waiting until it accepts writes)."""
    standby._tool("pg_ctl", "promote", "-w", "-t", str(int(START_DEADLINE)), "-D",
                  str(standby.data), timeout=START_DEADLINE + 5)


def fence(server: PgServer) -> None:
    """Make sure a killed old primary cannot come back: its data directory
    is moved aside, so no start can serve (and diverge from) the old data."""
    server.kill()
    server.proc = None
    if server.data.exists():
        server.data.rename(server.data.with_name("data.fenced"))


# -- helpers for tests of caches on these servers ---------------------------------------

#: seconds a test waits for a writer process or a dead owner's session
DEADLINE = 30.0


def pg_cache(path, pg, ns, **kw):
    """A Cache on ``pg``'s namespace ``ns`` whose batcher flushes only when asked."""
    from .conftest import open_cache
    return open_cache(path, store=pg.url(), namespace=ns, **kw)


def store_rows(pg, ns: str) -> tuple[dict[str, str], dict[str, str]]:
    """``(meta, {key repr: page_id})`` of namespace ``ns`` as committed."""
    with _psycopg().connect(pg.url(), autocommit=True) as conn:
        ns_id = conn.execute("SELECT ns_id FROM dkv_namespaces WHERE name = %s", (ns,)).fetchone()[0]
        meta = dict(conn.execute("SELECT name, value FROM dkv_meta WHERE ns_id = %s", (ns_id,)))
        keys = dict(conn.execute("SELECT key, page_id FROM dkv_keys WHERE ns_id = %s", (ns_id,)))
    return meta, keys


def writer(directory, pg, ns, durability, mode) -> subprocess.Popen:
    """Start tests/pg_writer.py (its docstring: the modes and what it prints)."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.Popen([sys.executable, str(REPO / "tests" / "pg_writer.py"), str(directory),
                             pg.url(), ns, durability, mode], stdout=subprocess.PIPE, text=True,
                            env=env)


def read_until(proc, marker: str, acked: list[int]) -> None:
    """Read the writer's lines into ``acked`` up to the line ``marker``."""
    deadline = time.monotonic() + DEADLINE
    for line in proc.stdout:
        if line.startswith("A "):
            acked.append(int(line.split()[1]))
        elif line.strip() == marker:
            return
        assert time.monotonic() < deadline, f"no {marker!r} from the writer in {DEADLINE} s"
    raise AssertionError(f"the writer ended (rc {proc.wait()}) before {marker!r}")


def kill_at(proc, marker: str) -> list[int]:
    """SIGKILL the writer ``proc`` when it prints ``marker``; the indices it
    had acknowledged by then."""
    acked: list[int] = []
    try:
        read_until(proc, marker, acked)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    finally:
        proc.kill()
    return acked


def open_with_deadline(path, pg, ns, **kw):
    """Open once the dead owner's session is gone (PostgreSQL ends it when
    it reads the closed socket), at most DEADLINE seconds."""
    deadline = time.monotonic() + DEADLINE
    while True:
        try:
            return pg_cache(path, pg, ns, **kw)
        except CacheLockedError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)

def _psycopg():
    import psycopg
    return psycopg
