"""Every relative link in README.md and docs/*.md leads somewhere: the file
exists, and a ``#fragment`` names a heading (or an ``<a name>``/``id``) of
the file it points into, the same file or another one.

Headings become anchors as GitHub makes them: the heading's text without
Markdown (backticks, link syntax, HTML tags), lower case, every character
that is not a letter, digit, ``_``, ``-`` or space dropped, spaces turned
into ``-``; a repeated heading gets ``-1``, ``-2``, ... Headings and links
inside fenced code blocks and inline code do not count.
"""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

_FENCE = re.compile(r"^\s*(```|~~~)")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
_LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_REFERENCE = re.compile(r"^\s*\[[^\]]+\]:\s*(\S+)")
_HTML_ANCHOR = re.compile(r"<a\s+(?:name|id)=\"([^\"]+)\"")
_SCHEME = re.compile(r"^[a-z][a-z0-9+.-]*:", re.I)


def slug(heading: str) -> str:
    """The anchor GitHub gives a heading's text."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = re.sub(r"<[^>]+>", "", text).replace("`", "").strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors_and_links(path: Path) -> tuple[set[str], list[tuple[int, str]]]:
    """A Markdown file's anchors, and its links as ``(line number, target)``."""
    anchors: set[str] = set()
    seen: dict[str, int] = {}
    links: list[tuple[int, str]] = []
    fenced = False
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if _FENCE.match(line):
            fenced = not fenced
            continue
        if fenced:
            continue
        m = _HEADING.match(line)
        if m:
            s = slug(m.group(2))
            k = seen.get(s, 0)
            seen[s] = k + 1
            anchors.add(s if k == 0 else f"{s}-{k}")
        anchors.update(_HTML_ANCHOR.findall(line))
        prose = re.sub(r"`[^`]*`", "", line)
        links += [(n, t) for t in _LINK.findall(prose) + _REFERENCE.findall(prose)]
    return anchors, links


def broken_links(files: list[Path], root: Path) -> list[str]:
    """One line per relative link in ``files`` whose file or anchor is missing."""
    parsed: dict[Path, tuple[set[str], list[tuple[int, str]]]] = {}

    def parse(p: Path) -> tuple[set[str], list[tuple[int, str]]]:
        if p not in parsed:
            parsed[p] = anchors_and_links(p)
        return parsed[p]

    bad = []
    for f in files:
        for n, target in parse(f)[1]:
            if _SCHEME.match(target):
                continue  # https:, mailto: ...: not checked here
            name, _, fragment = target.partition("#")
            dest = (f.parent / name).resolve() if name else f
            where = f"{f.relative_to(root)}:{n}: ({target})"
            if not dest.exists():
                bad.append(f"{where}: no file {dest}")
            elif fragment and dest.suffix == ".md" and fragment not in parse(dest)[0]:
                bad.append(f"{where}: {dest.name} has no heading with the anchor #{fragment}")
    return bad


def test_readme_and_docs_links_resolve():
    files = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    assert broken_links(files, REPO) == []


def test_an_anchor_that_is_in_another_file_is_caught(tmp_path):
    """docs/cli.md linked [Upgrading](#upgrading-durablekv), a heading of
    docs/operations.md: an anchor is looked up in the file the link points
    into, never in every file."""
    (tmp_path / "operations.md").write_text("# Operations\n\n## Upgrading durablekv\n")
    (tmp_path / "cli.md").write_text(
        "# CLI\n\nSee [Upgrading](#upgrading-durablekv).\n"
        "Fine: [Upgrading](operations.md#upgrading-durablekv), [top](#cli).\n"
        "```\n[not a link](#nowhere)\n```\n"
        "Also `[code](#nowhere)`, and [gone](missing.md), [bad](operations.md#upgrading).\n")
    bad = broken_links([tmp_path / "cli.md", tmp_path / "operations.md"], tmp_path)
    assert len(bad) == 3, bad
    assert bad[0].startswith("cli.md:3: (#upgrading-durablekv): cli.md has no heading")
    assert "no file" in bad[1] and "missing.md" in bad[1]
    assert "operations.md has no heading with the anchor #upgrading" in bad[2]


def test_slugs_follow_github():
    assert slug("Byte limits: `max_memory_bytes` and `size_limit`") == \
        "byte-limits-max_memory_bytes-and-size_limit"
    assert slug("Open after a crash: the checkpoint position") == \
        "open-after-a-crash-the-checkpoint-position"
    assert slug("How a record reaches the log: a mapped segment, or one `write` each") == \
        "how-a-record-reaches-the-log-a-mapped-segment-or-one-write-each"
