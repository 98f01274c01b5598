"""docs/llm.md's example (Cache + KVBlockStore + BlockPool, then a restart)
runs as written: the code blocks are read from the doc, so it cannot drift."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("numpy")

REPO = Path(__file__).resolve().parents[2]
HEADING = "#### Example: a prefix that survives a restart"


def example_blocks() -> list[str]:
    doc = (REPO / "docs" / "llm.md").read_text(encoding="utf-8")
    start = doc.index(HEADING) + len(HEADING)
    end = re.compile(r"^#{1,4} ", re.M).search(doc, start)
    section = doc[start:end.start() if end else len(doc)]
    return re.findall(r"^```python\n(.*?)^```$", section, re.M | re.S)


def run(code: str, cwd: Path) -> str:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]))
    out = subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_the_doc_example_runs_and_finds_the_prefix_after_a_restart(tmp_path):
    first, after_restart = example_blocks()
    assert "Cache(" in first and "KVBlockStore(cache)" in first and ".commit(" in first
    assert run(first, tmp_path) == "2 blocks written\n"
    assert (tmp_path / "var" / "kv").is_dir()
    # a second process: what the first one spilled is found on disk
    out = run(after_restart, tmp_path)
    said = re.search(r"print\(match\)\s+# (.*)", after_restart).group(1)
    assert out == said + "\n"
