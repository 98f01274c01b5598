"""Tests of the framework backends (durablekv.contrib)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def run_doc_example(doc: str, tmp_path: Path, *, index: int = 0, after: str = "",
                    replace: tuple[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run the ``index``-th ```python block of ``docs/<doc>`` as a user would
    paste it, in a new process in ``tmp_path``, with ``after`` appended (and
    one string replaced, e.g. a public URL by a loopback one)."""
    text = (REPO / "docs" / doc).read_text(encoding="utf-8")
    example = text.split("```python\n")[index + 1].split("```", 1)[0]
    if replace:
        example = example.replace(*replace)
    script = tmp_path / f"example{index}.py"
    script.write_text(example + "\n" + after + "\n", encoding="utf-8")
    return subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path)
