"""The benchmark suite still runs: every case with tiny sizes (``--quick``).

Runs ``python -m bench --quick`` in a subprocess (its own interpreter, as a
user would) with every output in a temp dir, then checks that each case
produced results, that durablekv's replayed memory hits equal the simulated
page-LRU, and that the documents were written. Competitors that are not
installed (the ``bench`` extra) and Redis (no ``redis-server`` on PATH) are
skipped by the bench itself, so this test needs only ``.[test]``; with
``.[bench]`` installed it covers every adapter too.
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _has(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("bench")
    cmd = [sys.executable, "-m", "bench", "--quick", "--out", str(out / "res.json"),
           "--table", str(out / "res.md"), "--doc", str(out / "performance.md"),
           "--plots-dir", str(out / "plots"), "--tmpdir", str(out)]
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    t0 = time.monotonic()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=180)
    elapsed = time.monotonic() - t0
    assert proc.returncode == 0, f"bench failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    res = json.loads((out / "res.json").read_text())
    return {"res": res, "dir": out, "elapsed": elapsed, "stderr": proc.stderr}


def test_quick_run_is_quick(quick_run: dict) -> None:
    assert quick_run["elapsed"] < 60, f"--quick took {quick_run['elapsed']:.0f} s"
    assert quick_run["res"]["errors"] == []


def test_every_micro_case_ran(quick_run: dict) -> None:
    from bench.micro import CASES
    rows = quick_run["res"]["micro"]
    for case in CASES:
        for vb in (100, 4096):
            impls = {r["impl"] for r in rows if r["case"] == case and r["value_bytes"] == vb}
            assert impls, (case, vb)
            assert any(i.startswith("durablekv") for i in impls), (case, vb, impls)
            if _has("cachetools") and case != "get_hit_store":
                assert {"cachetools", "cachetools-locked"} <= impls, (case, impls)
            if _has("diskcache"):
                assert "diskcache" in impls, (case, impls)
    for r in rows:
        assert r["n"] == quick_run["res"]["settings"]["repeat"]
        assert r["min"] <= r["median"] <= r["max"] and r["median"] > 0
    faults = [r for r in rows if r["case"] == "get_hit_store" and r["impl"].startswith("durablekv")]
    # the memory tier holds 64 of 2,000 keys and no window is warmed up first
    assert faults and all(r["page_fault_rate"] > 0.9 for r in faults), faults


def test_redis_rows_iff_redis_server(quick_run: dict) -> None:
    impls = {r["impl"] for r in quick_run["res"]["micro"]}
    if shutil.which("redis-server") and _has("redis"):
        assert {"redis", "redis-pipe"} <= impls
    else:
        assert not impls & {"redis", "redis-pipe"}
        assert any("Redis" in s for s in quick_run["res"]["skipped"])


def test_sustained_restart_memory(quick_run: dict) -> None:
    res = quick_run["res"]
    assert {r["impl"] for r in res["sustained"]} == {"durablekv", "sqlite"}
    assert all(r["median"] > 0 and r["peak_rss_mib"]["median"] > 0 for r in res["sustained"])
    reopen = [r for r in res["restart"] if r["case"] == "reopen"]
    assert {r["entries"] for r in reopen} == set(res["settings"]["restart_sizes"])
    rec = next(r for r in res["restart"] if r["case"] == "recovery")
    assert rec["recovered_records"] == [rec["records"]] * len(rec["recovered_records"])
    impls = {r["impl"] for r in res["memory"]}
    assert {"dict", "durablekv-ps16", "durablekv-ps1"} <= impls


def test_replays_match_the_simulator(quick_run: dict) -> None:
    from .conftest import trace_path
    trace_path("arc_OLTP.lis"), trace_path("cache2k_orm-busy.i32be")  # skip (or fail in CI)
    rows = quick_run["res"]["macro"]
    assert {r["trace"] for r in rows} >= {"cache2k_orm-busy.i32be", "arc_OLTP.lis"}
    checked = [r for r in rows if "exact" in r]
    assert checked and all(r["exact"] for r in checked), [
        (r["trace"], r["impl"], r["fraction"]) for r in checked if not r["exact"]]


def test_targets_and_documents(quick_run: dict) -> None:
    res, out = quick_run["res"], quick_run["dir"]
    ids = {t["id"] for t in res["targets"]}
    assert {"sustained", "recovery", "reopen-hot", "memory-durablekv-ps16"} <= ids
    for t in res["targets"]:
        if t["ratio"] is not None:
            assert t["met"] in (True, False)
    table = (out / "res.md").read_text()
    assert "## Targets" in table and "## Micro" in table
    # the macro replays need the real traces; without them (a user's clone)
    # the rest of the documents must still be written
    from .conftest import REQUIRE_TRACES, TRACES
    traces = REQUIRE_TRACES or (TRACES / "arc_OLTP.lis").exists()
    assert ("## Macro" in table) == traces
    doc = (out / "performance.md").read_text()
    assert "python -m bench" in doc and res["machine"]["cpu_model"] in doc
    if _has("matplotlib"):
        pngs = sorted(p.name for p in (out / "plots").glob("*.png"))
        assert "throughput_micro.png" in pngs
        assert ("hit_ratio_arc_OLTP.png" in pngs) == traces
        for name in pngs:
            assert f"plots/{name}" in doc


def test_help() -> None:
    proc = subprocess.run([sys.executable, "-m", "bench", "--help"], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "--quick" in proc.stdout and "--cases" in proc.stdout


def test_opt_matches_exhaustive_search() -> None:
    from functools import lru_cache

    from bench import sim

    def best(keys: tuple, slots: int) -> int:
        @lru_cache(None)
        def f(i: int, res: frozenset) -> int:
            if i == len(keys):
                return 0
            k = keys[i]
            if k in res:
                return 1 + f(i + 1, res)
            if len(res) < slots:
                return f(i + 1, res | {k})
            return max(f(i + 1, (res - {v}) | {k}) for v in res)
        return f(0, frozenset())

    rng = random.Random(5)
    for _ in range(200):
        n, u, slots = rng.randrange(1, 12), rng.randrange(1, 6), rng.randrange(1, 4)
        keys = [rng.randrange(u) for _ in range(n)]
        req = sim.Requests("t", [sim.GET] * n, keys, [0] * n, len(set(keys)), n, True)
        assert sim.opt(req, slots) == best(tuple(keys), slots), (keys, slots)
        assert sim.page_lru(req, 1, slots)["memory_hits"] == sim.lru(req, slots)
        assert sim.page_midpoint(req, 1, slots)["memory_hits"] == sim.lru(req, slots)


def _midpoint_model(keys: list, page_size: int, max_pages: int, old_fraction: float) -> int:
    """Partial pages with midpoint insertion, on plain lists (MRU first)."""
    budget = max_pages * page_size
    young_cap = max(1, budget - int(old_fraction * budget))
    young: list = []
    old: list = []
    page_of: dict = {}
    members: dict = {}
    hits = 0
    for k in keys:
        if k in young or k in old:
            hits += 1
            (young if k in young else old).remove(k)
            young.insert(0, k)
        else:
            young.insert(0, k)
            if k in page_of:
                for m in members[page_of[k]]:
                    if m not in young and m not in old:
                        old.insert(0, m)
            else:
                pid = len(page_of) // page_size
                page_of[k] = pid
                members.setdefault(pid, []).append(k)
        while len(young) > young_cap:
            old.insert(0, young.pop())
        while len(young) + len(old) > budget:
            (old or young).pop()
    return hits


def test_page_midpoint() -> None:
    """bench.sim.page_midpoint: a hand-worked trace, and random traces against
    a list model of the same rules."""
    from bench import sim

    # page_size 2, 4 pages: a budget of 8 entries, 3 of them old. After ten
    # new keys (pages ab cd ef gh ij) young is j i h g f and old e d c; a get
    # of a faults page 0 in: a goes young, its neighbour b to the midpoint,
    # f moves down to old, c and d leave; b and e are then memory hits, c is
    # not (it left), and its fault brings d back as a neighbour.
    keys = list("abcdefghij") + list("abec")
    req = sim.Requests("t", [sim.GET] * len(keys), keys, [0] * len(keys), 10, len(keys), True)
    assert sim.page_midpoint(req, 2, 4) == {
        "memory_hits": 2, "store_hits": 2, "misses": 10, "page_faults": 2,
        "prefetched": 2, "prefetch_hits": 1}
    rng = random.Random(7)
    for _ in range(300):
        n, u = rng.randrange(1, 60), rng.randrange(1, 30)
        ps, mp, of = rng.choice((1, 2, 4)), rng.randrange(1, 5), rng.choice((0.25, 3 / 8, 0.5))
        keys = [rng.randrange(u) for _ in range(n)]
        req = sim.Requests("t", [sim.GET] * n, keys, [0] * n, len(set(keys)), n, True)
        assert sim.page_midpoint(req, ps, mp, of)["memory_hits"] == \
            _midpoint_model(keys, ps, mp, of), (keys, ps, mp, of)


def test_policy_table_from_one_run(tmp_path):
    """bench.policy: the simulators' curves become the docs/policy.md table
    between its markers (a 20,000-request prefix of scarab, page_size 4)."""
    from bench import policy, sim

    from .conftest import trace_path
    req = sim.load(trace_path("scarab_recs.i64be"), 20_000)
    c = sim.curves(req, (0.01, 0.10), (4,), (4,), (4,))
    c.update(requests=len(req.ops), gets=req.gets, unique_keys=req.unique, whole_trace=False)
    # W-TinyLFU at entries is never below LRU by more than a point here, and
    # page_size=1 of the tier's simulator is the entry-level LRU
    assert all(t >= l - 0.01 for t, l in zip(c["tinylfu"], c["lru"]))
    assert sim.page_lru(req, 1, c["slots"][0])["memory_hits"] / req.gets == c["lru"][0]
    assert len(c["page_midpoint"]["4"]) == len(c["faults_midpoint"]["4"]) == 2
    doc = tmp_path / "policy.md"
    doc.write_text(f"intro\n{policy.MARK_BEGIN}\nold\n{policy.MARK_END}\nafter\n")
    policy.write_doc({"scarab_recs.i64be": c}, doc)
    text = doc.read_text()
    assert "old" not in text and text.startswith("intro") and text.endswith("after\n")
    rows = [ln for ln in text.splitlines() if ln.startswith("| scarab")]
    assert len(rows) == 4 and "| 1% |" in rows[0] and "| 10% |" in rows[3]
    # the page rows carry the three item-1 verdicts (page-LRU / re-homing / midpoint)
    assert rows[1].rstrip(" |").split("| ")[-1].count("/") == 2


def test_readme_policy_table_is_the_committed_run():
    """The README's hit-ratio table is rebuilt from docs/bench/policy.json (the
    one run that also drew the plots and docs/policy.md's table), never typed."""
    import json
    import re
    from bench import policy
    from bench.util import REPO
    curves = json.loads((REPO / "docs" / "bench" / "policy.json").read_text())
    readme = (REPO / "README.md").read_text()
    block = re.search(re.escape(policy.README_BEGIN) + "\n(.*?)\n" + re.escape(policy.README_END),
                      readme, re.S)
    assert block is not None
    assert block.group(1) == policy.readme_table(curves)
    assert len(block.group(1).splitlines()) == 2 + 2 * len(curves)
    doc = (REPO / "docs" / "policy.md").read_text()
    assert policy.table(curves) in doc
