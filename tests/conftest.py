"""Shared fixtures: where the real traces live, and small helpers."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
#: ../shared/traces beside the repository (read-only; never copied into it).
TRACES = REPO.parent / "shared" / "traces"


def trace_path(name: str) -> Path:
    """Path of a real trace, or skip the test (with the reason) when absent."""
    p = TRACES / name
    if not p.exists():
        pytest.skip(f"real trace {p} is not available (expected ../shared/traces beside the repo)")
    return p


@pytest.fixture
def cache_dir(tmp_path: Path) -> Path:
    return tmp_path / "cache"
