"""The package works from a wheel installed outside the source tree."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def test_wheel_ships_migrations_and_works_outside_the_tree(tmp_path):
    wheels = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps",
                    "-q", "-w", str(wheels), str(REPO)], check=True, capture_output=True,
                   timeout=300)
    (wheel,) = wheels.glob("durablekv-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "durablekv/migrations/0001_init.sql" in names
    assert "durablekv/migrations/postgres/0001_init.sql" in names
    assert "durablekv/samples/web-sample.csv" in names
    assert "durablekv/stores/postgres.py" in names
    assert "durablekv/llm/pool.py" in names
    assert not any(n.startswith("tests/") for n in names)

    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target",
                    str(target), str(wheel)], check=True, capture_output=True, timeout=300)
    script = (
        "import durablekv, sys\n"
        f"assert durablekv.__file__.startswith({str(target)!r}), durablekv.__file__\n"
        "from durablekv import Cache\n"
        "with Cache('c') as c:\n"
        "    c['a'] = 1\n"
        "with Cache('c') as c:\n"
        "    assert c['a'] == 1\n"
        "from durablekv.stores.postgres import migration_files\n"
        "assert [m[1] for m in migration_files()][:1] == ['0001_init.sql']\n"
        "print('ok')\n"
    )
    env = dict(os.environ, PYTHONPATH=str(target))
    work = tmp_path / "elsewhere"
    work.mkdir()
    proc = subprocess.run([sys.executable, "-c", script], cwd=work, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ok"
    schema = subprocess.run([sys.executable, "-c",
                             "import sqlite3; print([r[0] for r in sqlite3.connect("
                             "'c/pages.sqlite3').execute('select name from sqlite_master')])"],
                            cwd=work, capture_output=True, text=True, timeout=60)
    assert "pages" in schema.stdout and "keys" in schema.stdout


def _build_wheel(tmp_path, env=None) -> Path:
    """A wheel built from a clean copy of the source tree (no extension left
    in place by an editable install)."""
    src = tmp_path / "src"
    shutil.copytree(REPO, src, ignore=shutil.ignore_patterns(
        ".git", ".venv", "build", "*.egg-info", "*.so", "__pycache__", ".hypothesis",
        ".pytest_cache", "docs", "bench", "tests"))
    wheels = tmp_path / "wheels"
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", str(wheels),
                           str(src)], capture_output=True, text=True, timeout=600,
                          env=None if env is None else dict(os.environ, **env))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (wheel,) = wheels.glob("durablekv-*.whl")
    return wheel


def _outside_path(target: Path) -> str:
    """PYTHONPATH for ``python -S``: the installed wheel, then the
    dependencies' site-packages, without the ``.pth`` hooks of an editable
    install (which would find this tree's own ``durablekv._native``)."""
    import site
    return os.pathsep.join([str(target), *site.getsitepackages()])


def test_install_without_a_compiler_gives_the_pure_python_package(tmp_path):
    """``pip install`` on a machine with no working C compiler: the build of
    the C kernels fails, the install goes on without them, and the package
    runs its pure-Python code and says so."""
    env = {"CC": "/bin/false", "CXX": "/bin/false", "LDSHARED": "/bin/false",
           "DURABLEKV_REQUIRE_NATIVE": ""}
    wheel = _build_wheel(tmp_path, env)
    names = zipfile.ZipFile(wheel).namelist()
    assert not any(n.endswith((".so", ".pyd")) for n in names), names
    assert "durablekv/_accel.py" in names
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target",
                    str(target), str(wheel)], check=True, capture_output=True, timeout=300)
    script = (
        "import durablekv\n"
        f"assert durablekv.__file__.startswith({str(target)!r}), durablekv.__file__\n"
        "assert not durablekv.accelerated and durablekv.accelerated.kernels == ()\n"
        "assert 'it was not built' in durablekv.accelerated.reason, durablekv.accelerated.reason\n"
        "with durablekv.Cache('c') as c:\n"
        "    c['a'] = b'x' * 100\n"
        "with durablekv.Cache('c') as c:\n"
        "    assert c['a'] == b'x' * 100\n"
        "print('ok')\n")
    work = tmp_path / "elsewhere"
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "DURABLEKV_PURE"}
    proc = subprocess.run([sys.executable, "-S", "-c", script], cwd=work,
                          env=dict(env, PYTHONPATH=_outside_path(target)),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ok"


def test_install_with_a_compiler_ships_the_c_kernels(tmp_path):
    """With the compiler this machine has, the wheel holds durablekv._native
    and an install runs it (a missing compiler here fails, it does not skip)."""
    wheel = _build_wheel(tmp_path)
    names = zipfile.ZipFile(wheel).namelist()
    assert any(n.startswith("durablekv/_native") and n.endswith(".so") for n in names), names
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target",
                    str(target), str(wheel)], check=True, capture_output=True, timeout=300)
    env = {k: v for k, v in os.environ.items() if k != "DURABLEKV_PURE"}
    proc = subprocess.run([sys.executable, "-S", "-c", "import durablekv; print(bool("
                           "durablekv.accelerated))"], cwd=tmp_path,
                          env=dict(env, PYTHONPATH=_outside_path(target)),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "True"


def test_both_stores_find_their_migrations_from_a_source_tree(monkeypatch):
    """Run from a checkout whose package has no durablekv.migrations (a plain
    `pip install .` beside the source), both stores read the repository's
    migrations/ folder: the same files as the packaged ones."""
    import importlib.resources
    pytest.importorskip("psycopg")
    from durablekv.stores import postgres, sqlitefile
    packaged = (sqlitefile.migration_files(), postgres.migration_files())

    def missing(name):
        raise ModuleNotFoundError(f"No module named {name!r}")
    monkeypatch.setattr(importlib.resources, "files", missing)
    assert (sqlitefile.migration_files(), postgres.migration_files()) == packaged
    assert [v for v, _, _ in packaged[1]] == [1, 2]
