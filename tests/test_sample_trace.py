"""The trace shipped in the package: reproducible, small, and replayed by the CLI."""

from __future__ import annotations

import json
import subprocess
import sys

from durablekv.samples import WEB_SAMPLE
from durablekv.traces import open_trace

from .conftest import REPO


def test_sample_is_what_its_generator_writes():
    sys.path.insert(0, str(REPO))
    try:
        from bench.make_sample_trace import generate
    finally:
        sys.path.remove(str(REPO))
    assert WEB_SAMPLE.read_text(encoding="ascii") == generate()
    assert WEB_SAMPLE.stat().st_size < 300_000


def test_sample_has_gets_sets_deletes_and_ttls():
    ops = list(open_trace(WEB_SAMPLE))
    assert len(ops) == 10_000
    kinds = {r.op for r in ops}
    assert kinds == {"get", "set", "delete"}, kinds
    assert any(r.ttl for r in ops if r.op == "set")


def test_readme_replay_example_runs(tmp_path):
    # the README's second replay example, from the repository root
    out = tmp_path / "report.json"
    proc = subprocess.run(
        [sys.executable, "-m", "durablekv", "replay", "durablekv/samples/web-sample.csv",
         "--page-size", "1", "--max-pages", "200", "--no-progress", "--json", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out.read_text())
    assert report["requests"] == 10_000
    assert "web-sample.csv --page-size 1 --max-pages 200" in (REPO / "README.md").read_text()
