"""The parts that own shared state change it only themselves: no module of
the package outside counts.py and storekeys.py assigns to an attribute of
the key counts (``_counts``) or of StoreKeys (``_store_keys``), as their
docstrings promise. Read from the source (ast), so a new write fails here."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "durablekv"
OWNERS = {"_counts": "counts.py", "_store_keys": "storekeys.py"}


def _chain(node: ast.AST) -> list[str]:
    names = []
    while isinstance(node, ast.Attribute):
        names.append(node.attr)
        node = node.value
    return names


def _writes(tree: ast.AST):
    """(owner attribute, line) of every assignment to ``x.<owner>.<field>``,
    and to a local bound from ``x.<owner>`` (``sk = self._store_keys``)."""
    aliases: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, (ast.Assign, ast.NamedExpr)):
            value = node.value
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            owner = next((a for a in _chain(value)[:1] if a in OWNERS), None)
            for t in targets:
                if owner and isinstance(t, ast.Name):
                    aliases[t.id] = owner
    for node in ast.walk(tree):
        targets = (node.targets if isinstance(node, ast.Assign) else
                   [node.target] if isinstance(node, ast.AugAssign) else [])
        for t in targets:
            if not isinstance(t, ast.Attribute):
                continue
            base = t.value
            if isinstance(base, ast.Attribute) and base.attr in OWNERS:
                yield base.attr, t.lineno
            elif isinstance(base, ast.Name) and base.id in aliases:
                yield aliases[base.id], t.lineno


def test_no_module_writes_the_key_counts_or_store_keys_but_their_own():
    found = []
    for path in PACKAGE.rglob("*.py"):
        for owner, line in _writes(ast.parse(path.read_text())):
            if path.name != OWNERS[owner]:
                found.append(f"{path.relative_to(PACKAGE.parent)}:{line} writes {owner}")
    assert found == [], "change them through their methods"


def test_the_check_finds_such_a_write():
    tree = ast.parse("def f(self):\n    self._counts.keys += 1\n"
                     "    sk = self._store_keys\n    sk.absent = None\n")
    assert sorted(_writes(tree)) == [("_counts", 2), ("_store_keys", 4)]
