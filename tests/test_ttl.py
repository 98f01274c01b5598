"""TTL: the deadline counts as expired, expire=0 stores nothing, deadlines persist.

BR-001 (TTL boundary and zero TTL) and BR-003 (time mocking must not hang the
batcher; a clock stepping back never lengthens a TTL), driven three ways: an
injected ``clock=``, freezegun with the default clock, and the real default
clock. Nothing sleeps to let TTL time pass: it moves only when a test moves it.
"""

from __future__ import annotations

import math
from decimal import Decimal
from fractions import Fraction
import sqlite3
import subprocess
import sys
import tempfile
import textwrap
import threading
import time

import freezegun
import pytest
from freezegun import freeze_time
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from durablekv import Cache, ConfigError

from .conftest import Clock, open_cache, opened, run_with_timeout

# freezegun hands the REAL time to any caller whose stack passes through the
# threading module (its default ignore list), and so to the write-behind
# thread, whose expiry sweep reads the TTL clock. A cache whose threads read
# two different clocks sees time jump back and forth, and its TTL clock
# (which never runs backwards) then moves by real seconds as well as by the
# test's ticks. Frozen time here is frozen for every thread, as a real clock
# is the same for every thread.
freezegun.configure(default_ignore_list=[
    m for m in freezegun.config.DEFAULT_IGNORE_LIST if m not in ("threading", "queue")])


def test_br001_boundary_with_injected_clock(tmp_path):
    clock = Clock(100)
    with opened(tmp_path / "c", clock=clock) as c:
        c.set("a", 1, expire=1)
        clock.now = 100.5
        assert c.get("a") == 1
        assert "a" in c and len(c) == 1 and list(c) == ["a"]
        clock.now = 101.0                     # exactly the deadline: gone
        assert list(c) == []
        assert c.get("a", default="D") == "D"
        assert "a" not in c
        assert len(c) == 0
        with pytest.raises(KeyError):
            c["a"]
        assert c.delete("a") is False


def test_br001_zero_ttl_stores_nothing(tmp_path):
    clock = Clock(100)
    with opened(tmp_path / "c", clock=clock) as c:
        sets = c.stats().sets
        c.set("b", 2, expire=0)
        assert c.get("b", "D") == "D"
        assert "b" not in c and len(c) == 0 and list(c) == []
        assert c.stats().sets == sets + 1
        # expire=0 over an existing value removes it (0 never means "forever")
        c.set("b", 2)
        c.set("b", 3, expire=0)
        assert c.get("b", "D") == "D" and len(c) == 0
    with opened(tmp_path / "c", clock=clock) as c:
        assert c.get("b", "D") == "D" and len(c) == 0


def test_br001_no_expiry_survives_far_future(tmp_path):
    clock = Clock(100)
    with opened(tmp_path / "c", clock=clock) as c:
        c.set("c", 3, expire=None)
        c.set("c2", 3)
        clock.now = 10**9
        assert c.get("c") == 3 and c["c2"] == 3 and len(c) == 2
    with opened(tmp_path / "c", clock=Clock(10**10)) as c:
        assert c.get("c") == 3 and len(c) == 2


@pytest.mark.parametrize("bad", [-1, -0.001, float("nan"), float("inf"), -float("inf"), 10**400,
                                 Decimal("NaN"), Decimal("-1")])
def test_br001_bad_expire_is_a_valueerror_and_stores_nothing(tmp_path, bad):
    with opened(tmp_path / "c", clock=Clock(100)) as c:
        c.set("d", "old")
        with pytest.raises(ValueError, match="expire"):
            c.set("d", 4, expire=bad)
        assert c.get("d") == "old" and len(c) == 1 and c.stats().sets == 1
        with pytest.raises(ValueError):
            c.memoize(expire=bad)


@pytest.mark.parametrize("bad", ["1", True, [1], 1j])
def test_expire_of_wrong_type_is_a_typeerror(tmp_path, bad):
    with opened(tmp_path / "c") as c:
        with pytest.raises(TypeError):
            c.set("d", 4, expire=bad)
        assert len(c) == 0


@pytest.mark.parametrize("ttl", [Decimal("1.5"), Fraction(3, 2)])
def test_expire_takes_any_real_number(tmp_path, ttl):
    clock = Clock(100)
    with opened(tmp_path / "c", clock=clock) as c:
        c.set("d", 4, expire=ttl)
        clock.now = 101.49
        assert c.get("d") == 4
        clock.now = 101.5
        assert c.get("d") is None


@pytest.mark.parametrize("check_at", [100.5, 101.0, 100.999])
def test_br001_deadline_persists_across_restart(tmp_path, check_at):
    clock = Clock(100)
    with opened(tmp_path / "c", clock=clock) as c:
        c.set("a", 1, expire=1)
    clock.now = check_at
    with opened(tmp_path / "c", clock=clock) as c:
        alive = check_at < 101.0
        assert (c.get("a", "D") == 1) is alive
        assert ("a" in c) is alive
        assert len(c) == int(alive)
        assert list(c) == (["a"] if alive else [])


def test_br001_restart_without_close_replays_the_deadline(tmp_path):
    # the set reaches only the replay log (no flush, no close) before the reopen
    d = tmp_path / "c"
    code = textwrap.dedent(f"""
        import os
        from durablekv import Cache
        c = Cache({str(d)!r}, flush_interval=30, clock=lambda: 100.0)
        c.set("a", 1, expire=1)
        c.set("n", 2)
        os._exit(0)
    """)
    subprocess.run([sys.executable, "-c", code], check=True, timeout=30)
    clock = Clock(100.5)
    with opened(d, clock=clock) as c:
        assert c.stats().recovered_records == 2
        assert c.get("a") == 1
        clock.now = 101.0
        assert c.get("a", "D") == "D" and len(c) == 1 and list(c) == ["n"]


def test_stored_deadline_is_absolute_epoch_seconds(tmp_path):
    # default clock: time.time() looked up at call time
    with opened(tmp_path / "c") as c:
        t0 = time.time()
        c.set("a", 1, expire=100)
        t1 = time.time()
        c.set("b", 1, expire=0)
        assert "b" not in c and c.get("a") == 1
        c.flush()
        con = sqlite3.connect(f"file:{tmp_path / 'c' / 'pages.sqlite3'}?mode=ro", uri=True)
        try:
            (exp,) = con.execute("SELECT expire_at FROM keys").fetchone()
        finally:
            con.close()
        assert t0 + 100 <= exp <= t1 + 100


def test_default_clock_is_looked_up_at_call_time(tmp_path, monkeypatch):
    now = [1_000_000.0]
    monkeypatch.setattr(time, "time", lambda: now[0])
    with opened(tmp_path / "c") as c:
        c.set("a", 1, expire=10)
        now[0] += 9.99
        assert c.get("a") == 1
        now[0] = 1_000_010.0
        assert c.get("a") is None


# -- freezegun with the default clock ----------------------------------------------------


def test_br001_with_freezegun_tick(tmp_path):
    with freeze_time("2024-01-01 00:00:00") as frozen:
        c = open_cache(tmp_path / "c")
        try:
            c.set("a", 1, expire=1)
            c.set("c", 3, expire=None)
            c.set("b", 2, expire=0)
            assert c.get("b", "D") == "D"
            frozen.tick(0.5)
            assert c.get("a") == 1 and len(c) == 2
            frozen.tick(0.5)                          # exactly the deadline
            assert c.get("a", "D") == "D"
            assert "a" not in c and len(c) == 1 and list(c) == ["c"]
            frozen.move_to("2055-01-01")
            assert c.get("c") == 3
        finally:
            run_with_timeout(c.close)


def test_br001_with_freezegun_across_restart(tmp_path):
    with freeze_time("2024-01-01 00:00:00") as frozen:
        c = open_cache(tmp_path / "c")
        c.set("a", 1, expire=1)
        run_with_timeout(c.close)
        frozen.tick(0.5)
        c = open_cache(tmp_path / "c")
        assert c.get("a") == 1
        run_with_timeout(c.close)
        frozen.move_to("2024-01-01 00:00:01")
        c = open_cache(tmp_path / "c")
        try:
            assert c.get("a", "D") == "D" and len(c) == 0 and "a" not in c
        finally:
            run_with_timeout(c.close)


def test_expirations_are_counted(tmp_path):
    clock = Clock(0)
    with opened(tmp_path / "c", clock=clock) as c:
        for i in range(6):
            c.set(i, i, expire=10)
        c.set("forever", 1)
        clock.now = 10
        assert c.stats().expirations == 0
        assert c.get(0) is None               # via get
        assert 1 not in c                     # via contains
        s = c.stats()
        assert s.expirations == 2 and s.misses == 1
        assert len(c) == 1                    # len purges the other four
        assert c.stats().expirations == 6
        assert c.stats().hits == 0


# -- len / in / get / iteration agree, in memory and for evicted pages ------------------


@pytest.mark.parametrize("shape", [dict(), dict(page_size=1, max_pages=2),
                                   dict(page_size=3, max_pages=1)], ids=["roomy", "lru2", "p3"])
@pytest.mark.parametrize("restart", [False, True], ids=["live", "restart"])
@pytest.mark.parametrize("order", ["iter-first", "len-first", "get-first", "in-first"])
def test_len_in_get_iter_agree_about_expired(tmp_path, shape, restart, order):
    clock = Clock(1000)
    c = open_cache(tmp_path / "c", clock=clock, **shape)
    try:
        ttl = {}
        for i in range(24):
            exp = None if i % 4 == 0 else float(i % 7)  # 0..6 s, some already 0
            c.set(i, i, expire=exp)
            ttl[i] = exp
        c.flush()
        for i in range(100, 104):     # push older pages out of memory
            c.set(i, i)
            c.delete(i)
        c.flush()
        if restart:
            c.close()
            c = open_cache(tmp_path / "c", clock=clock)
        clock.now = 1003
        live = sorted(k for k, e in ttl.items() if e is None or 1000 + e > 1003)
        checks = {
            "iter": lambda: sorted(c),
            "len": lambda: len(c),
            "get": lambda: sorted(k for k in ttl if c.get(k, "D") != "D"),
            "in": lambda: sorted(k for k in ttl if k in c),
        }
        first = order.split("-")[0]
        names = [first] + [n for n in checks if n != first]
        for n in names:
            got = checks[n]()
            assert got == (len(live) if n == "len" else live), (n, order)
        assert sorted(c.keys()) == live
        assert sorted(v for v in c.values()) == live
        assert dict(c.items()) == {k: k for k in live}
        assert c.stats().resident_pages <= c.max_pages
    finally:
        run_with_timeout(c.close, 10.0)


def test_values_view_contains_survives_an_entry_expiring_mid_scan(tmp_path):
    # a clock that moves one second at every read: the key snapshot sees "a"
    # alive, the lookup that follows finds it expired
    t = [0.0]

    def clock():
        t[0] += 1.0
        return t[0]

    with opened(tmp_path / "c", clock=clock) as c:
        c.set("a", 1, expire=1.5)
        assert (1 in c.values()) in (True, False)
        assert list(c.values()) == []


@pytest.mark.parametrize("spilled", [False, True], ids=["memory", "spilled"])
def test_setting_an_expired_key_stores_the_new_key_object(tmp_path, spilled):
    # dict semantics: the expired entry is gone, so this is a fresh key
    clock = Clock(0)
    kw = dict(page_size=1, max_pages=1) if spilled else {}
    with opened(tmp_path / "c", clock=clock, **kw) as c:
        c.set(1.0, "old", expire=1)
        c.set((True, "t"), "old", expire=1)
        if spilled:
            c.set("__spill__", 0)
            c.delete("__spill__")
            c.flush()
        clock.now = 1
        c.set(1, "new")
        c.set((1, "t"), "new")
        keys = [k for k in iter(c)]
        assert sorted(map(repr, keys)) == ["(1, 't')", "1"]
        assert c.stats().expirations == 2
    with opened(tmp_path / "c", clock=clock) as c:
        assert sorted(map(repr, c)) == ["(1, 't')", "1"]
        assert c[1.0] == "new" and len(c) == 2


@pytest.mark.parametrize("spilled", [False, True], ids=["memory", "spilled"])
def test_popitem_skips_expired_entries(tmp_path, spilled):
    clock = Clock(0)
    kw = dict(page_size=1, max_pages=1) if spilled else {}
    with opened(tmp_path / "c", clock=clock, **kw) as c:
        c.set(0, 0, expire=1)
        c.set(1, 1)
        c.set(2, 2, expire=1)
        if spilled:
            c.set("__spill__", 0)
            c.delete("__spill__")
            c.flush()
        clock.now = 1
        assert c.popitem() == (1, 1)
        with pytest.raises(KeyError):
            c.popitem()
        assert len(c) == 0


def test_overwrite_changes_and_removes_ttl(tmp_path):
    clock = Clock(0)
    with opened(tmp_path / "c", clock=clock, page_size=1, max_pages=1) as c:
        c.set("a", 1, expire=5)
        c.set("a", 2)                 # no expiry any more
        c.set("b", 1)
        c.set("b", 2, expire=5)       # now expires
        c.flush()
    clock.now = 10
    with opened(tmp_path / "c", clock=clock) as c:
        assert c.get("a") == 2 and c.get("b") is None and len(c) == 1


# -- BR-003: freezegun and the background batcher ----------------------------------------


def test_br003_flush_and_close_do_not_hang_under_frozen_time(tmp_path):
    with freeze_time("2024-01-01"):
        c = open_cache(tmp_path / "c", flush_interval=0.2)
        c.set("a", 1)
        run_with_timeout(c.flush, 5.0)  # fails the test if it takes 5 s of real time
        assert c.stats().checkpoint_lsn == 1
        c.set("b", 2)
        run_with_timeout(lambda: c.flush(timeout=2.0), 5.0)
        run_with_timeout(c.close, 5.0)
    with opened(tmp_path / "c") as c:
        assert dict(c.items()) == {"a": 1, "b": 2}


def test_br003_background_flush_runs_under_frozen_time(tmp_path):
    with freeze_time("2024-01-01"):
        c = open_cache(tmp_path / "c", flush_interval=0.01)
        try:
            c.set("a", 1)
            # the batcher's interval wait follows real time: a flush shows up
            deadline = time.perf_counter() + 5
            while c.stats().checkpoint_lsn < 1 and time.perf_counter() < deadline:
                threading.Event().wait(0.01)
            assert c.stats().checkpoint_lsn == 1
        finally:
            run_with_timeout(c.close)


def test_br003_clock_stepping_back_never_lengthens_a_ttl(tmp_path):
    """The TTL clock never runs backwards: after the wall clock steps back a
    year, TTL time resumes from the latest reading the cache has seen and
    advances with every later reading. (The cache learns of time only when it
    reads the clock, so the unobserved time between the jump and the first
    reading after it, here the first 1 s step, is not counted.)"""
    with freeze_time("2024-01-01") as frozen:
        c = open_cache(tmp_path / "c")
        try:
            c.set("b", 1, expire=60)
            c.set("keep", 1)
            frozen.move_to("2023-01-01")
            for step in range(1, 62):
                frozen.tick(1)
                c.get("keep")               # the cache reads the clock at every step
                if step < 59:
                    assert "b" in c, step   # the step back does not expire it early...
            assert c.get("b") is None       # ...nor keep it past its 60 s (BR-003 step 3)
            assert "b" not in c and len(c) == 1
            # new TTLs after the jump are still measured as elapsed seconds
            c.set("n", 1, expire=2)
            frozen.tick(1)
            assert c.get("n") == 1
            frozen.tick(1)
            assert c.get("n") is None
        finally:
            run_with_timeout(c.close)


def test_br003_injected_clock_stepping_back(tmp_path):
    clock = Clock(1_000_000)
    with opened(tmp_path / "c", clock=clock) as c:
        c.set("b", 1, expire=60)
        clock.now -= 365 * 86400
        assert c.get("b") == 1          # the step back is seen here: not expired early
        for _ in range(59):
            clock.now += 1
        assert c.get("b") == 1 and len(c) == 1
        clock.now += 1                  # 60 s of clock progress since the set
        assert c.get("b") is None and len(c) == 0
        clock.now += 365 * 86400 + 30   # back to "real" time: still gone, new TTLs work
        c.set("n", 1, expire=1)
        assert c.get("n") == 1
        clock.now += 1
        assert c.get("n") is None


@pytest.mark.parametrize("how", ["close", "crash after the flush"])
def test_br003_a_step_back_is_remembered_across_a_reopen(tmp_path, how):
    """TTL time after a step back is the wall clock plus an offset. The offset
    goes to the store with the next flush (a step back asks for one) and the
    next open starts from it: an entry set after the step still lives exactly
    its TTL, instead of until the wall clock reaches the shifted deadline
    (110 s for a 10 s TTL here, before)."""
    clock = Clock(1000)
    d = tmp_path / "c"
    c = open_cache(d, clock=clock)
    c.set("a", 0, expire=5)
    clock.now = 900                    # the wall clock steps back 100 s
    c.set("k", "v", expire=10)         # TTL time 1000: gone at wall clock 910
    clock.now = 905
    if how == "close":
        run_with_timeout(c.close)
    else:
        c.flush()
        c._teardown(clean=False)
    with opened(d, clock=clock) as c:
        assert c.get("k") == "v"
        clock.now = 909.9
        assert c.get("k") == "v"
        clock.now = 910
        assert c.get("k") is None and "a" not in c
        c.set("n", 1, expire=1)        # TTLs set now are measured from here
        clock.now = 910.9
        assert c.get("n") == 1
    clock.now = 911                    # ... and still after another open
    with opened(d, clock=clock) as c:
        assert c.get("n") is None and len(c) == 0


def test_a_step_back_asks_for_an_urgent_cycle_which_stores_the_offset(tmp_path, monkeypatch):
    """As the README says, a step back asks the write-behind for a flush at
    once (an urgent kick, which the duty-cycle pause does not hold back);
    that cycle stores the offset although no entry is dirty."""
    clock = Clock(1000)
    with opened(tmp_path / "c", clock=clock) as c:
        c.set("k", "v", expire=100)
        c.flush()
        kicks = []
        monkeypatch.setattr(c._batcher, "kick", lambda *a, **kw: kicks.append(kw))
        clock.now = 0
        c.get("k")
        assert kicks == [{"urgent": True}]
        assert c._store.ttl_clock == (0.0, -math.inf)
        c._batcher.stop()          # run the cycle the kick asked for here
        c._batcher.run_cycle()
        assert c._store.ttl_clock == (1000.0, 1000.0)


def test_a_clean_close_stores_the_offset_no_flush_has_stored(tmp_path, monkeypatch):
    """The step back asks for a flush, but the close may come first (here the
    batcher never gets the request): the close stores the offset itself."""
    clock = Clock(1000)
    d = tmp_path / "c"
    c = open_cache(d, clock=clock)
    c.set("k", "v", expire=100)
    c.flush()
    monkeypatch.setattr(c._batcher, "kick", lambda *a, **kw: None)
    clock.now = 0                      # back 1000 s, seen by the get
    assert c.get("k") == "v"
    assert c._store.ttl_clock != c._ttl_clock
    run_with_timeout(c.close)
    clock.now = 200                    # 200 s later: past the 100 s TTL
    with opened(d, clock=clock) as c:
        assert c.get("k") is None


def test_a_clock_that_never_went_back_writes_no_ttl_clock(tmp_path):
    clock = Clock(1000)
    with opened(tmp_path / "c", clock=clock) as c:
        c.set("a", 1, expire=5)
        clock.now += 1
        c.get("a")
    conn = sqlite3.connect(tmp_path / "c" / "pages.sqlite3")
    names = {r[0] for r in conn.execute("SELECT name FROM meta")}
    conn.close()
    assert not names & {"ttl_clock_offset", "ttl_clock_now"}


def test_ttl_expiry_of_many_spilled_pages_keeps_len_exact(tmp_path):
    clock = Clock(0)
    with opened(tmp_path / "c", clock=clock, page_size=1, max_pages=2) as c:
        for i in range(30):
            c.set(i, i, expire=5 if i % 3 else None)
        c.flush()
        clock.now = 5
        before = c.stats()
        assert len(c) == 10
        assert len(list(c)) == 10
        # counted in SQLite, not faulted in: nothing was read in or evicted
        after = c.stats()
        assert (after.page_faults, after.evictions) == (before.page_faults, before.evictions)
        assert [c.get(i) for i in range(30)] == [i if i % 3 == 0 else None for i in range(30)]
        assert c.stats().expirations == 20 and len(c) == 10
        assert c.stats().resident_pages <= 2
        # expiry-only changes must not make flush() or close() wait forever
        run_with_timeout(c.flush, 5.0)
    with opened(tmp_path / "c", clock=clock) as c:
        assert len(c) == 10 and sorted(c) == list(range(0, 30, 3))


def test_flush_after_lazy_expiry_returns(tmp_path):
    clock = Clock(100)
    c = open_cache(tmp_path / "c", clock=clock)
    try:
        c.set("a", 1, expire=1)
        c.flush()
        clock.now = 102
        assert c.get("a") is None       # lazy expiry dirties the page, no new LSN
        run_with_timeout(c.flush, 5.0)
        run_with_timeout(lambda: c.flush(timeout=1.0), 5.0)
    finally:
        run_with_timeout(c.close, 5.0)
    assert math.isfinite(c.stats().recovery_seconds)


# -- TTL against a model dict (hypothesis state machine) ----------------------------------

TTL_KEYS = st.sampled_from([1, 1.0, True, 0, -0.0, "a", b"a", (1, "x"), (1.0, "x"), 2, 3, 4])


class TTLVsModel(RuleBasedStateMachine):
    """A dict of (value, deadline) purged at every step, as a user sees it:
    an expired entry is gone, so setting its key again stores the new key
    object (dict semantics for a fresh key)."""

    def __init__(self):
        super().__init__()
        self.tmp = tempfile.TemporaryDirectory()
        self.path = self.tmp.name
        self.clock = Clock(1000)
        self.cache = open_cache(self.path, clock=self.clock, page_size=2, max_pages=2)
        self.model: dict = {}

    def live(self):
        now = self.clock.now
        for k in [k for k, (_, dl) in self.model.items() if dl is not None and now >= dl]:
            del self.model[k]
        return self.model

    @rule(k=TTL_KEYS, v=st.integers(), expire=st.sampled_from([None, 0, 0.5, 1, 3]))
    def set(self, k, v, expire):
        self.live()
        self.cache.set(k, v, expire=expire)
        if expire == 0:
            self.model.pop(k, None)
        elif k in self.model:
            # dict semantics: the key object stays, the value and deadline change
            self.model[k] = (v, None if expire is None else self.clock.now + expire)
        else:
            self.model[k] = (v, None if expire is None else self.clock.now + expire)

    @rule(k=TTL_KEYS)
    def get(self, k):
        m = self.live()
        assert self.cache.get(k, "D") == (m[k][0] if k in m else "D")

    @rule(k=TTL_KEYS)
    def contains(self, k):
        assert (k in self.cache) == (k in self.live())

    @rule(k=TTL_KEYS)
    def delete(self, k):
        m = self.live()
        assert self.cache.delete(k) == (k in m)
        m.pop(k, None)

    @rule(k=TTL_KEYS)
    def pop(self, k):
        m = self.live()
        assert self.cache.pop(k, "D") == (m.pop(k)[0] if k in m else "D")

    @rule()
    def popitem(self):
        m = self.live()
        if not m:
            with pytest.raises(KeyError):
                self.cache.popitem()
            return
        k, v = self.cache.popitem()
        assert m.pop(k)[0] == v

    @rule()
    def clear(self):
        self.cache.clear()
        self.model.clear()

    @rule(dt=st.sampled_from([0.25, 0.5, 1, 2]))
    def tick(self, dt):
        self.clock.now += dt

    @rule()
    def flush(self):
        self.cache.flush()

    @rule()
    def reopen(self):
        self.cache.close()
        self.cache = open_cache(self.path, clock=self.clock, max_pages=2)

    @rule()
    def length(self):
        assert len(self.cache) == len(self.live())   # len purges expired entries

    @invariant()
    def agrees(self):
        # iterating does not purge (list() would: it calls len() for a size
        # hint), so expired entries stay behind for the rules
        m = self.live()
        keys = [k for k in iter(self.cache)]
        assert sorted(map(repr, keys)) == sorted(map(repr, m))

    def teardown(self):
        try:
            self.cache.close()
        finally:
            self.tmp.cleanup()


TTLVsModel.TestCase.settings = settings(max_examples=100, stateful_step_count=30, deadline=None,
                                        suppress_health_check=[HealthCheck.too_slow])
TestTTLVsModel = TTLVsModel.TestCase


@pytest.mark.parametrize("returns, shown", [
    ("soon", "'soon' (str)"), (None, "None (NoneType)"), (float("nan"), "nan (float)"),
    (float("inf"), "inf (float)"), (-float("inf"), "-inf (float)"), (True, "True (bool)"),
    ((1.0,), "(1.0,) (tuple)"),
])
def test_a_clock_that_does_not_return_finite_seconds_is_refused_at_open(tmp_path, returns,
                                                                      shown):
    """A str or None failed at the first TTL with a bare arithmetic
    TypeError; NaN or infinity was accepted and entries then never expired.
    The clock is called once at open and checked there (not on every call:
    that is the hot path)."""
    with pytest.raises(ConfigError) as info:
        Cache(tmp_path / "c", clock=lambda: returns)
    msg = str(info.value)
    assert f"returned {shown}" in msg, msg
    assert "epoch seconds" in msg and "time.time" in msg
    with opened(tmp_path / "c") as c:  # the failed open holds nothing
        assert len(c) == 0


def test_a_clock_that_raises_or_is_not_callable_is_refused_at_open(tmp_path):
    def broken() -> float:
        raise RuntimeError("no time source")

    with pytest.raises(ConfigError, match="raised RuntimeError"):
        Cache(tmp_path / "c", clock=broken)
    with pytest.raises(ConfigError, match="not callable"):
        Cache(tmp_path / "c", clock=12.0)
    for fine in (lambda: 0, lambda: 1_700_000_000, lambda: 1.5e9):
        with opened(tmp_path / "c", clock=fine) as c:
            c.set("k", 1, expire=10)
            assert c["k"] == 1


def test_a_session_on_another_clock_leaves_no_offset_for_the_next(tmp_path):
    """A session whose clock is far behind (a replay on a trace's own
    timestamps) must not push TTL time ahead for the sessions after it:
    only a step back seen while the cache is open moves TTL time off the
    clock."""
    d = tmp_path / "c"
    wall = Clock(1_700_000_000)
    with opened(d, clock=wall) as c:
        c.set("session", b"s", expire=3600)
    with opened(d, clock=Clock(50)) as c:   # e.g. durablekv replay --dir d
        c.set("t", b"x", expire=30)
        assert c.get("session") == b"s"     # deadlines are read against this clock
    with opened(d, clock=wall) as c:
        assert c.get("session") == b"s" and c.get("t") is None
        assert c._now() == wall.now
