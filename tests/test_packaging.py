"""The package list in pyproject.toml names every subpackage, so a wheel (or
an installed copy) holds all of the code that a source tree runs."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_subpackage_is_listed_in_pyproject():
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
                 ["packages"])
    found = {".".join(p.parent.relative_to(ROOT).parts)
             for p in (ROOT / "durablekv").rglob("__init__.py")
             if "__pycache__" not in p.parts}
    assert found - listed == set(), "add these to [tool.setuptools] packages in pyproject.toml"
