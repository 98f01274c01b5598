"""Rewrite docs/llm.md's benchmark tables and findings from docs/bench/llm.json.

The text between ``<!-- llm-bench: begin -->`` and ``<!-- llm-bench: end -->``
is :func:`durablekv.llm.bench.render_docs` of the JSON, so every number and
every "higher", "lower" or "within noise" in it comes from the run
(tests/llm/test_bench.py checks that they agree).

    python -m bench.llm_docs [--json docs/bench/llm.json] [--docs docs/llm.md]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from durablekv.llm.bench import render_docs

BEGIN, END = "<!-- llm-bench: begin -->\n", "<!-- llm-bench: end -->\n"
ROOT = Path(__file__).resolve().parents[1]


def generated(doc: str) -> str:
    """The generated part of ``doc`` (between the markers)."""
    return doc.split(BEGIN, 1)[1].split(END, 1)[0]


def rewrite(doc: str, report: dict) -> str:
    head, rest = doc.split(BEGIN, 1)
    return head + BEGIN + render_docs(report) + END + rest.split(END, 1)[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path, default=ROOT / "docs" / "bench" / "llm.json")
    ap.add_argument("--docs", type=Path, default=ROOT / "docs" / "llm.md")
    args = ap.parse_args()
    report = json.loads(args.json.read_text(encoding="utf-8"))
    args.docs.write_text(rewrite(args.docs.read_text(encoding="utf-8"), report), encoding="utf-8")


if __name__ == "__main__":
    main()
