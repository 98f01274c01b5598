"""The package works from a wheel installed outside the source tree."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

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
