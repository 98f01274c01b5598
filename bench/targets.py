"""Copy the generated target table from docs/performance.md into docs/performance-notes.md.

The notes show the table between ``<!-- bench:targets -->`` and
``<!-- /bench:targets -->``; this keeps it a copy of what the bench measured
rather than hand-typed numbers. Run after ``python -m bench``:

    python -m bench.targets
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    perf = (ROOT / "docs" / "performance.md").read_text(encoding="utf-8")
    machine = re.search(r"## Machine\n\n(.*?)\n\n## ", perf, re.S)
    targets = re.search(r"## Targets\n\n(.*?)\n\n## ", perf, re.S)
    if not (machine and targets):
        raise SystemExit("docs/performance.md has no Machine/Targets section; run python -m bench")
    block = ("<!-- bench:targets -->\n" + targets.group(1).strip() + "\n\nMeasured on:\n\n"
             + machine.group(1).strip() + "\n<!-- /bench:targets -->")
    readme = ROOT / "docs" / "performance-notes.md"
    text = readme.read_text(encoding="utf-8")
    new, n = re.subn(r"<!-- bench:targets -->.*?<!-- /bench:targets -->", lambda _: block,
                     text, flags=re.S)
    if n != 1:
        raise SystemExit("docs/performance-notes.md has no <!-- bench:targets --> block")
    readme.write_text(new, encoding="utf-8")


if __name__ == "__main__":
    main()
