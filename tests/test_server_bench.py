"""`python -m bench server` runs end to end (tiny sizes): every server
answers every request as expected, and the table lands in the doc."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.server_util import REPO


def test_bench_server_smoke(tmp_path):
    out = tmp_path / "server.json"
    # 8 connections and 1000 requests: the get hits read every key the fill
    # set, so a fill that skips keys (it once did, ~1 % of them) shows as errors
    r = subprocess.run([sys.executable, "-m", "bench", "server", "--ops", "get_hit,get_miss,put",
                        "--connections", "8", "--requests", "1000", "--repeat", "1",
                        "--no-redis", "--seconds", "20", "--out", str(out)],
                       capture_output=True, text=True, cwd=str(REPO), timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert set(res["cells"]) == {"get_hit@8", "get_miss@8", "put@8"}
    for cell in res["cells"].values():
        for name in ("durablekv", "dict"):
            assert cell[name]["errors"] == 0, cell
            assert cell[name]["requests"] == [1000]
        assert cell["ratio_vs_dict"] > 0
    doc = tmp_path / "doc.md"
    doc.write_text("x\n<!-- bench:server -->\nold\n<!-- /bench:server -->\ny\n")
    r = subprocess.run([sys.executable, "-m", "bench", "server", "--from-json", str(out),
                        "--doc", str(doc)], capture_output=True, text=True, cwd=str(REPO),
                       timeout=60)
    assert r.returncode == 0, r.stderr
    text = doc.read_text()
    assert "old" not in text and "| get hit, 8 conn |" in text and text.endswith("y\n")
