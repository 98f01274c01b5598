"""``policy="midpoint"``: residency per entry inside pages (durablekv/tier/midpoint.py).

The tier must count exactly what ``bench.sim.page_midpoint`` counts (the
simulator the policy bench and the README's table are built on), be an exact
entry LRU at ``page_size=1``, never hold more than ``max_pages * page_size``
entries, and lose nothing: pages in memory in part are read back whole
before they change, iteration and ``len`` see their unloaded entries, a
restart (clean or ``kill -9``) brings every acknowledged write back.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from bench import sim
from bench.policy import tier_replay
from durablekv import Cache
from durablekv.codec import canonical_key
from durablekv.errors import ConfigError, CorruptStoreError
from durablekv.tier.midpoint import DOOMED, OLD, OUT, YOUNG, MidpointTier
from durablekv.tier.pages import UNLOADED

from .conftest import Clock, trace_path


def check_tier(cache: Cache) -> None:
    """The tier's own bookkeeping agrees with its pages (under the cache's
    lock: the write-behind thread changes the tier when a flush commits)."""
    with cache._lock:
        _check_tier(cache)


def _check_tier(cache: Cache) -> None:
    tier = cache._tier
    assert isinstance(tier, MidpointTier)
    assert tier.entries <= tier.budget
    young = old = doomed = unloaded = resident = 0
    for pid, page in tier.pages.items():
        assert page.page_id == pid
        w = page.where
        young += w.count(YOUNG)
        old += w.count(OLD)
        doomed += w.count(DOOMED)
        n_unloaded = sum(k is UNLOADED for k in page.keys)
        assert n_unloaded == page.unloaded
        unloaded += n_unloaded
        if page.unloaded:
            # only a clean page is in memory in part: a flush writes whole pages
            assert pid not in tier.dirty, page
        for slot, key in enumerate(page.keys):
            if key is UNLOADED:
                assert w[slot] == OUT
            elif w[slot] != OUT:
                assert tuple(tier.table[key][:2]) == (page, slot)
        live = w.count(YOUNG) + w.count(OLD)
        assert live == page.live
        resident += live > 0
    assert (young, old) == (tier.policy.young_n, tier.policy.old_n)
    assert resident == tier.resident


# -- the same counts as the simulator ----------------------------------------------------

SLICES = [("arc_OLTP.lis", 40_000, 16, 40), ("cache2k_orm-busy.i32be", 40_000, 16, 12),
          ("scarab_recs.i64be", 40_000, 16, 60), ("cloudPhysicsIO.csv", 40_000, 16, 30),
          ("arc_OLTP.lis", 20_000, 4, 100)]


@pytest.mark.parametrize("name,n,page_size,max_pages", SLICES)
def test_tier_counts_what_the_simulator_counts(name, n, page_size, max_pages):
    """Request for request, the tier's memory hits, store hits, misses and page
    faults are the simulator's (cloudPhysics has sets: a set of a key whose
    page is not in memory faults it in, as in the simulator)."""
    req = sim.load(trace_path(name), n)
    got = tier_replay(req, page_size, max_pages, "midpoint")
    want = sim.page_midpoint(req, page_size, max_pages)
    assert got == {k: want[k] for k in got}
    # and it is not the page LRU: on these slices the counts differ
    assert got["memory_hits"] != sim.page_lru(req, page_size, max_pages)["memory_hits"]


def test_page_size_1_is_an_exact_entry_lru():
    req = sim.load(trace_path("arc_OLTP.lis"), 30_000)
    got = tier_replay(req, 1, 300, "midpoint")
    assert got["memory_hits"] == sim.lru(req, 300)
    assert got["memory_hits"] == tier_replay(req, 1, 300, "lru")["memory_hits"]


def test_oltp_slice_beats_entry_lru_where_page_lru_loses():
    """The point of the policy (issue: page granularity must not cost hit
    ratio): on arc_OLTP, page-LRU at page_size=16 falls below an entry LRU of
    the same entries; the midpoint tier does not."""
    req = sim.load(trace_path("arc_OLTP.lis"), 120_000)
    slots = 1_872
    entry_lru = sim.lru(req, slots)
    page_lru = tier_replay(req, 16, slots // 16, "lru")["memory_hits"]
    midpoint = tier_replay(req, 16, slots // 16, "midpoint")["memory_hits"]
    assert page_lru < entry_lru <= midpoint, (page_lru, entry_lru, midpoint)


def test_flush_timing_does_not_change_the_counts(tmp_path):
    """An entry chosen to leave while its page is dirty stays until the flush
    (doomed); an access to it is a page fault, as in the simulator, so the
    counts do not depend on when the write-behind runs."""
    req = sim.load(trace_path("arc_OLTP.lis"), 20_000)
    want = sim.page_midpoint(req, 16, 20)["memory_hits"]
    with Cache(tmp_path / "idle", page_size=16, max_pages=20, policy="midpoint",
               flush_interval=3600, flush_batch_pages=10**6, max_pending_pages=10**6) as c:
        for k in req.keys:
            if c.get(k) is None:
                c.set(k, b"v")
        assert c.stats().memory_hits == want
        assert c._tier.pending > 0  # doomed entries were waiting for a flush
        check_tier(c)
    with Cache(tmp_path / "busy", page_size=16, max_pages=20, policy="midpoint",
               flush_batch_pages=1) as c:
        for i, k in enumerate(req.keys):
            if c.get(k) is None:
                c.set(k, b"v")
            if i % 997 == 0:
                c.flush()
                check_tier(c)
        assert c.stats().memory_hits == want


# -- nothing lost, nothing over budget ----------------------------------------------------

def _partial(cache: Cache):
    """The pages in memory in part (some entries loaded, some not), with
    their unloaded count."""
    return {pid: p.unloaded for pid, p in cache._tier.pages.items()
            if 0 < p.unloaded < p.used}


def make_partial(tmp_path, **kw) -> tuple[Cache, dict]:
    """A cache of 64 keys in 16 pages of 4, 3 pages of memory (12 entries),
    flushed, then read so that pages are in memory in part."""
    c = Cache(tmp_path / "c", page_size=4, max_pages=3, policy="midpoint", **kw)
    model = {f"k{i}": f"v{i}" for i in range(64)}
    c.update(model)
    c.flush()
    for i in (0, 5, 10, 15, 20, 25, 30, 35, 0, 5, 40, 45):
        assert c[f"k{i}"] == f"v{i}"
    c.flush()
    assert _partial(c), "the reads must leave pages in memory in part"
    return c, model


def test_iteration_len_and_items_see_unloaded_entries(tmp_path):
    c, model = make_partial(tmp_path)
    with c:
        assert sorted(c) == sorted(model)
        assert dict(c.items()) == model
        assert len(c) == 64
        assert sorted(c.values()) == sorted(model.values())
        # a scan does not fault anything in
        assert c._tier.entries <= 12
        check_tier(c)


@pytest.mark.parametrize("op", ["set", "delete", "pop", "incr", "add", "touch", "setdefault"])
def test_changing_a_page_in_memory_in_part_writes_it_whole(tmp_path, op):
    """A change to a page with unloaded entries reads them back first, so the
    flush that stores the change stores the whole page: every other entry of
    it survives a reopen."""
    c, model = make_partial(tmp_path)
    with c:
        pid, _ = next(iter(_partial(c).items()))
        page = c._tier.pages[pid]
        key = next(k for k in page.keys if k is not UNLOADED and isinstance(k, str))
        if op == "set":
            c[key] = "new"
            model[key] = "new"
        elif op == "delete":
            del c[key]
            del model[key]
        elif op == "pop":
            assert c.pop(key) == model.pop(key)
        elif op == "incr":
            c["n0"] = 1
            model["n0"] = 6
            c.flush()
            c.incr("n0", 5)
        elif op == "add":
            assert not c.add(key, "other")
        elif op == "touch":
            assert c.touch(key, 3600)
        elif op == "setdefault":
            assert c.setdefault(key, "x") == model[key]
        check_tier(c)
        c.flush()
        check_tier(c)
        assert c._tier.entries <= 12
    with Cache(tmp_path / "c", page_size=4, max_pages=3, policy="midpoint") as c:
        assert dict(c.items()) == model
    with Cache(tmp_path / "c", page_size=4, max_pages=64) as c:  # and under lru
        assert dict(c.items()) == model


def test_ttl_on_pages_in_memory_in_part(tmp_path):
    """Expired entries leave (get, len, expire()) also when their page is in
    memory in part, and the rest of the page stays."""
    clock = Clock()
    c = Cache(tmp_path / "c", page_size=4, max_pages=2, policy="midpoint", clock=clock)
    with c:
        for i in range(32):
            c.set(f"k{i}", i, expire=10 if i % 2 else None)
        c.flush()
        for i in (0, 8, 16, 24, 0, 8):
            c.get(f"k{i}")
        c.flush()
        assert _partial(c)
        clock.now += 11
        assert len(c) == 16
        assert c.get("k1") is None
        c.expire()  # (len() already removed those in memory)
        assert len(c) == 16
        assert c._counts.ttl_keys == 0  # every entry with a TTL has gone
        assert sorted(c) == sorted(f"k{i}" for i in range(0, 32, 2))
        c.flush()
        check_tier(c)
    with Cache(tmp_path / "c", page_size=4, max_pages=2, policy="midpoint", clock=clock) as c:
        assert dict(c.items()) == {f"k{i}": i for i in range(0, 32, 2)}


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(st.tuples(st.sampled_from("sgdfrpi"), st.integers(0, 40), st.integers(0, 9)),
                    min_size=1, max_size=120),
       page_size=st.sampled_from([1, 2, 4]), max_pages=st.integers(1, 4))
def test_random_operations_match_a_dict(tmp_path_factory, ops, page_size, max_pages):
    """Sets, gets, deletes, flushes, reopens, iteration and incr against a dict,
    with a tier of 1 to 16 entries; the budget and bookkeeping hold after
    every step."""
    d = tmp_path_factory.mktemp("m") / "c"
    opts = dict(page_size=page_size, max_pages=max_pages, policy="midpoint",
                flush_interval=3600, flush_batch_pages=10**6)
    model: dict = {}
    c = Cache(d, **opts)
    try:
        for op, k, v in ops:
            key = f"k{k}"
            if op == "s":
                c[key] = v
                model[key] = v
            elif op == "g":
                assert c.get(key) == model.get(key)
            elif op == "d":
                assert c.delete(key) == (key in model)
                model.pop(key, None)
            elif op == "f":
                c.flush()
            elif op == "r":
                c.close()
                c = Cache(d, **opts)
                assert len(c) == len(model)
            elif op == "p":
                assert dict(c.items()) == model
            elif op == "i":
                if isinstance(model.get(key, 0), int):
                    model[key] = c.incr(key, v)
                    assert model[key] == c[key]
            check_tier(c)
        assert dict(c.items()) == model
    finally:
        c.close()
    with Cache(d, page_size=page_size, max_pages=max_pages) as c:
        assert dict(c.items()) == model


def test_warm_restart_brings_entries_back(tmp_path):
    """resident.list names the pages holding entries in the budget; after a
    reopen the preload puts them back (at the old sublist's LRU end), within
    the budget, and reading them is a memory hit."""
    c, model = make_partial(tmp_path)
    hot = ["k0", "k5"]
    with c:
        for k in hot:
            c[k]
    with Cache(tmp_path / "c", page_size=4, max_pages=3, policy="midpoint") as c:
        assert c.wait_warm(30)
        assert c.stats().warmed_pages >= 1
        assert 0 < c._tier.entries <= 12
        check_tier(c)
        before = c.stats().memory_hits
        for k in hot:
            assert c[k] == model[k]
        assert c.stats().memory_hits == before + len(hot)
        assert dict(c.items()) == model


def test_damaged_store_copy_of_a_page_in_memory_in_part(tmp_path):
    """The stored copy of a page in memory in part must agree with its loaded
    slots: another page's entries read under its id (a page written to the
    wrong row, its checksum good) are reported, never served or merged."""
    c, model = make_partial(tmp_path)
    with c:
        pid = next(iter(_partial(c)))
        page = c._tier.pages[pid]
        unloaded = [k for k in model if k not in c._tier.table
                    and c._store.find(canonical_key(k))[0] == pid]
        assert unloaded
        other = next(p for p in range(1, 17) if p != pid and p not in c._tier.pages)
        wrong = c._store.read_page(other)
        with c._lock, pytest.raises(CorruptStoreError, match=f"page {pid}"):
            c._fill(page, wrong, want=unloaded[0])
        assert page.unloaded == len(unloaded)  # nothing of the other page was taken in
        assert all(k not in c._tier.table for k in unloaded)


def test_refused_settings(tmp_path):
    with pytest.raises(ConfigError, match="'midpoint'"):
        Cache(tmp_path / "b", policy="mid")


def test_a_byte_bound_evicts_entries_not_pages(tmp_path):
    """max_memory_bytes under midpoint: the entries in the budget stay under
    it, each counted by its own bytes; a big entry pushes out small ones,
    the rest of their pages staying; an entry bigger than the bound is kept
    alone until the next one comes."""
    with Cache(tmp_path / "c", page_size=4, max_pages=100, policy="midpoint",
               max_memory_bytes=64 * 1024) as c:
        for i in range(40):
            c[f"s{i}"] = b"s" * 1000          # 40 KB of small entries
        assert c.stats().memory_bytes > 40_000 and c._tier.evictions == 0
        c["big"] = b"B" * 30_000               # over 64 KiB: the oldest small ones leave
        st_ = c.stats()
        assert 30_000 < st_.memory_bytes <= 64 * 1024
        assert c._tier.evictions == 5     # 5 x 1,012 bytes make room for 30,013
        assert c._tier.table["s39"][0].where[c._tier.table["s39"][1]] == YOUNG
        c["huge"] = b"H" * 100_000             # bigger than the bound: alone
        assert c._tier.entries == 1
        assert c.stats().memory_bytes > 64 * 1024
        c["after"] = b"a"                       # and gone at the next entry
        assert c.stats().memory_bytes <= 64 * 1024
        assert c["huge"] == b"H" * 100_000     # read back (a page fault), alone again
        assert c._tier.entries == 1
        c.flush()
        check_tier(c)
        assert all(c[f"s{i}"] == b"s" * 1000 for i in range(40))
    with Cache(tmp_path / "c", page_size=4, max_pages=100, policy="midpoint",
               max_memory_bytes=64 * 1024) as c:
        assert len(c) == 43 and c["big"] == b"B" * 30_000


def test_resident_entries_never_pass_the_budget_on_a_trace(tmp_path):
    """Checked every 500 requests of a real trace slice with sets of growing
    values and deletes: the budget in entries holds, the bookkeeping agrees."""
    rng = random.Random(5)
    req = sim.load(trace_path("cloudPhysicsIO.csv"), 15_000)
    with Cache(tmp_path / "c", page_size=16, max_pages=8, policy="midpoint",
               flush_batch_pages=4) as c:
        seen_partial = 0
        for i, k in enumerate(req.keys):
            r = rng.random()
            if r < 0.05:
                c.delete(k)
            elif c.get(k) is None or r < 0.2:
                c.set(k, b"x" * rng.randrange(1, 2000))
            if i % 500 == 0:
                check_tier(c)
                seen_partial += bool(_partial(c))
        check_tier(c)
        assert c._tier.evictions > 0 and seen_partial


_EXIT_WRITER = """
import os, random, sys
from durablekv import Cache
n = int(sys.argv[2])
c = Cache(sys.argv[1], page_size=4, max_pages=2, policy="midpoint", flush_interval=3600,
          flush_batch_pages=10**6, max_pending_pages=10**6)
rnd = random.Random(7)
for i in range(n):
    if i == n // 2:
        c.flush()  # the first half in the store, the rest only in the log
    c[f"w{i}"] = i
    for _ in range(3):
        c.get(f"w{rnd.randrange(i + 1)}")
    if i > 5 and i % 3 == 0:
        c[f"w{rnd.randrange(i)}"] = -1
    if i > 5 and i % 5 == 0:
        c.pop(f"w{rnd.randrange(i)}", None)
os._exit(0)  # no close: the log holds what the store does not
"""


def _exit_model(n: int) -> dict:
    rnd = random.Random(7)
    model: dict = {}
    for i in range(n):
        model[f"w{i}"] = i
        for _ in range(3):
            rnd.randrange(i + 1)
        if i > 5 and i % 3 == 0:
            model[f"w{rnd.randrange(i)}"] = -1
        if i > 5 and i % 5 == 0:
            model.pop(f"w{rnd.randrange(i)}", None)
    return model


def test_recovery_into_a_tiny_tier_with_reads_between_writes(tmp_path):
    """Regression: recovery faulted a page in, and the page's own entries left
    memory (clean: unloaded) before the first replayed change dirtied it, so
    reopening failed (seen with 2 pages of 4 and reads between the writes).
    A real process exits without close; the reopen under midpoint brings
    back exactly what it wrote."""
    import subprocess
    import sys
    d = tmp_path / "c"
    subprocess.run([sys.executable, "-c", _EXIT_WRITER, str(d), "1000"], check=True,
                   timeout=120)
    with Cache(d, page_size=4, max_pages=2, policy="midpoint") as c:
        assert dict(c.items()) == _exit_model(1000)
        assert c.stats().recovered_records > 0
        check_tier(c)


@pytest.mark.parametrize("policy", ["lru", "tinylfu", "midpoint"])
def test_deleting_a_key_only_in_the_store_evicts_nothing(tmp_path, policy):
    """delete and pop read the page of a key that is only in the store to
    remove it, outside the LRU order: what is resident stays resident."""
    with Cache(tmp_path / "c", page_size=1, max_pages=1, policy=policy,
               flush_interval=3600) as c:
        c["a"] = 1
        c["b"] = 2
        c["x"] = 3
        c.flush()               # a, b, x in the store; x resident
        assert c["b"] == 2      # a page fault: b resident, x evicted
        before = c.stats()
        assert c.delete("a")
        assert c.pop("x") == 3
        after = c.stats()
        assert after.evictions == before.evictions
        assert c["b"] == 2
        assert c.stats().memory_hits == before.memory_hits + 1
        c.flush()
        assert c.stats().pending_pages == 0
    with Cache(tmp_path / "c", page_size=1, max_pages=1, policy=policy) as c:
        assert dict(c.items()) == {"b": 2}


@pytest.mark.parametrize("policy", ["lru", "midpoint"])
@pytest.mark.parametrize("seed", range(4))
def test_page_size_1_is_an_exact_lru_with_deletes(tmp_path, policy, seed):
    """Look-aside gets and deletes at page_size=1 against an OrderedDict LRU
    (a delete removes the key from the LRU and never inserts one), with
    flushes at random: memory hits are the model's exactly."""
    from collections import OrderedDict
    rng = random.Random(seed)
    cap = 1 + seed
    lru: OrderedDict = OrderedDict()
    hits = 0
    with Cache(tmp_path / "c", page_size=1, max_pages=cap, policy=policy,
               flush_interval=3600, flush_batch_pages=10**6) as c:
        for _ in range(400):
            k = rng.randrange(12)
            r = rng.random()
            if r < 0.2:
                c.delete(k)
                lru.pop(k, None)
            elif r < 0.25:
                c.flush()
            else:
                if k in lru:
                    lru.move_to_end(k)
                    hits += 1
                else:
                    lru[k] = None
                    if len(lru) > cap:
                        lru.popitem(last=False)
                if c.get(k) is None:
                    c.set(k, b"v")
        assert c.stats().memory_hits == hits
