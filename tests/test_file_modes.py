"""What a cache creates is private to its owner: the directory 0700, its
files 0600 (docs/files.md); a directory that already exists keeps its mode."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import tempfile
from pathlib import Path

import pytest

from .conftest import REPO, opened


@pytest.fixture
def umask_022():
    old = os.umask(0o022)  # the common default, which left everything world-readable
    yield
    os.umask(old)


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_a_new_cache_directory_and_every_file_in_it_are_private(tmp_path, umask_022):
    d = tmp_path / "cache"
    with opened(d, segment_bytes=4096) as c:
        for i in range(200):
            c[i] = "x" * 100  # rolls over log segments
        c.flush()
        names = sorted(os.listdir(d))
        assert "LOCK" in names and "pages.sqlite3" in names
        assert "pages.sqlite3-wal" in names and "pages.sqlite3-shm" in names
        assert any(n.startswith("replay-") for n in names), names
        assert mode(d) == 0o700
        assert {n: mode(d / n) for n in names} == {n: 0o600 for n in names}


def test_a_rebuilt_store_and_its_damage_marker_are_private(tmp_path, umask_022):
    d = tmp_path / "cache"
    with opened(d) as c:
        c["a"] = 1
    (d / "pages.sqlite3").write_bytes(b"not a database" * 100)
    os.chmod(d / "pages.sqlite3", 0o600)
    with opened(d, on_corruption="rebuild") as c:
        c["b"] = 2
        c.flush()
        names = sorted(os.listdir(d))
        assert any(".corrupt-" in n for n in names), names
        assert {n: mode(d / n) for n in names} == {n: 0o600 for n in names}


def test_an_existing_directory_keeps_the_mode_its_owner_gave_it(tmp_path, umask_022):
    d = tmp_path / "shared"
    d.mkdir()
    os.chmod(d, 0o750)
    with opened(d) as c:
        c["a"] = 1
        c.flush()
    assert mode(d) == 0o750
    assert mode(d / "pages.sqlite3") == 0o600  # files it creates are still private


def test_a_file_the_owner_loosened_stays_loosened(tmp_path, umask_022):
    d = tmp_path / "cache"
    with opened(d) as c:
        c["a"] = 1
        c.flush()
    os.chmod(d / "pages.sqlite3", 0o640)
    with opened(d) as c:
        assert c["a"] == 1
    assert mode(d / "pages.sqlite3") == 0o640


def _as_nobody(top: Path, code: str, *args: str) -> subprocess.CompletedProcess:
    """Run ``code`` as the user nobody, with a copy of the package in ``top``
    (the system Python, the pure kernels: the test's own interpreter and the
    checkout may sit in directories only root can enter)."""
    setpriv, python = shutil.which("setpriv"), "/usr/bin/python3"
    if os.geteuid() != 0 or setpriv is None or not os.access(python, os.X_OK):
        reason = "needs root, setpriv and /usr/bin/python3 to run a process as nobody"
        if os.environ.get("DURABLEKV_REQUIRE_SETPRIV") == "1":  # .ci/run: a failure there
            pytest.fail(reason + "; DURABLEKV_REQUIRE_SETPRIV=1 makes this a failure",
                        pytrace=False)
        pytest.skip(reason)
    src = top / "src"
    shutil.copytree(REPO / "durablekv", src / "durablekv",
                    ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    shutil.copytree(REPO / "migrations", src / "migrations")  # (as a source tree has them)
    for path in [src, *src.rglob("*")]:
        os.chmod(path, 0o755 if path.is_dir() else 0o644)
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(src), "DURABLEKV_PURE": "1"}
    return subprocess.run([setpriv, "--reuid=nobody", "--regid=nogroup", "--clear-groups",
                           python, "-c", code, *args], capture_output=True, text=True,
                          env=env, cwd="/", timeout=60)


@pytest.mark.parametrize("dir_mode", [0o700, 0o755], ids=["private", "readable"])
def test_another_users_cache_directory_is_a_config_error_naming_its_owner(dir_mode):
    # (not under tmp_path: pytest's base directory is one nobody cannot enter)
    top = Path(tempfile.mkdtemp(prefix="durablekv-owner-"))
    try:
        os.chmod(top, 0o755)
        _refused_to_nobody(top / "cache", dir_mode)
    finally:
        shutil.rmtree(top)


def _refused_to_nobody(d: Path, dir_mode: int) -> None:
    with opened(d) as c:
        c["k"] = "v"
    os.chmod(d, dir_mode)
    r = _as_nobody(d.parent, "import sys\nfrom durablekv import Cache, ConfigError\n"
                   "try:\n    Cache(sys.argv[1])\nexcept ConfigError as e:\n"
                   "    print(type(e).__name__, e)\nelse:\n    print('opened')\n", str(d))
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("ConfigError "), r.stdout
    assert "it belongs to root" in r.stdout and f"mode {dir_mode:04o}" in r.stdout
    assert "open it as root" in r.stdout
    with opened(d) as c:  # the owner's cache is untouched
        assert c["k"] == "v"


def test_store_files_this_user_may_not_write_are_refused_at_open():
    """A read-only ``pages.sqlite3`` (or ``-wal``/``-shm``) in a writable
    directory opened, then every write-behind flush failed and close()
    raised WriteBehindError. Now the open is refused, as for a read-only
    directory, naming the file and the fix. Run as nobody: root may write
    a 0444 file, and is not refused (the next test)."""
    top = Path(tempfile.mkdtemp(prefix="durablekv-rostore-"))
    try:
        os.chmod(top, 0o755)
        d = top / "cache"
        with opened(d) as c:
            c["k"] = "v"
        import pwd
        nobody = pwd.getpwnam("nobody")
        for path in [d, *d.iterdir()]:
            os.chown(path, nobody.pw_uid, nobody.pw_gid)
        r = _as_nobody(top, _READ_ONLY_STORE_SCRIPT, str(d))
        assert r.returncode == 0, r.stderr
        import json
        out = json.loads(r.stdout)
    finally:
        shutil.rmtree(top)
    for name in ("pages.sqlite3", "pages.sqlite3-wal", "pages.sqlite3-shm"):
        kind, msg = out[name]
        assert kind == "ConfigError", (name, kind, msg)
        assert f"may not read and write {name} (mode 0444, owner nobody)" in msg, msg
        assert "a cache needs a directory this user may read and write" in msg
        assert f"chmod u+rw {d / name}" in msg, msg
    assert out["fixed"] == ["opened", "v"]  # nothing was lost, nothing was left locked


_READ_ONLY_STORE_SCRIPT = """
import json, os, sys
from durablekv import Cache
d = sys.argv[1]
store = os.path.join(d, "pages.sqlite3")
out = {}
def attempt(label):
    try:
        with Cache(d, flush_interval=0.01) as c:
            out[label] = ["opened", c["k"]]
            c["k2"] = "w"
    except Exception as e:
        out[label] = [type(e).__name__, str(e)]
os.chmod(store, 0o444)
attempt("pages.sqlite3")
os.chmod(store, 0o600)
for suffix in ("-wal", "-shm"):
    for left in (store + "-wal", store + "-shm"):  # (an open that was let in leaves them)
        if os.path.exists(left):
            os.unlink(left)
    open(store + suffix, "wb").close()
    os.chmod(store + suffix, 0o444)
    attempt("pages.sqlite3" + suffix)
    os.unlink(store + suffix)
attempt("fixed")
print(json.dumps(out))
"""


def test_a_read_only_store_file_is_not_refused_to_a_user_who_may_write_it(tmp_path):
    """os.access decides, not the mode bits: root writes a 0444 file."""
    if os.geteuid() != 0:
        pytest.skip("only root may write a file whose mode says read-only; the refusal "
                    "of the same file to another user is the test above")
    d = tmp_path / "c"
    with opened(d) as c:
        c["a"] = 1
    os.chmod(d / "pages.sqlite3", 0o444)
    with opened(d) as c:
        c["b"] = 2
        c.flush(timeout=30)
    with opened(d) as c:
        assert dict(c.items()) == {"a": 1, "b": 2}
