"""Recovery at open: replayed records are applied in memory and open returns
without waiting for SQLite; the log keeps them until a checkpoint passes them.

A "crash" in-process is ``_teardown(clean=False)`` (batcher stopped, no
flush, log left as it is); ``test_sigkill_right_after_a_recovering_open``
kills real processes.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from durablekv import Cache
from durablekv.log.segments import HEADER, MAGIC, list_segments, read_segment
from durablekv.log.replaylog import ReplayLog
from durablekv.tier.pages import EMPTY

REPO = Path(__file__).resolve().parents[1]
#: the batcher never runs unless asked (flush()/close() or back-pressure)
NEVER = dict(flush_interval=3600, flush_batch_pages=1_000_000, max_pending_pages=1_000_000)


def crash(cache: Cache) -> None:
    """Stop ``cache`` as a killed process would leave it (no flush, log kept)."""
    cache._teardown(clean=False)


def contents(d, **kw) -> dict:
    with Cache(d, **kw) as cache:
        return dict(cache.items())


def test_open_returns_before_the_flush_and_a_crash_right_after_loses_nothing(tmp_path):
    d = tmp_path / "c"
    cache = Cache(d, page_size=4, **NEVER)
    expected = {f"k{i}": i for i in range(500)}
    for k, v in expected.items():
        cache[k] = v
    crash(cache)

    cache = Cache(d, **NEVER)
    st = cache.stats()
    assert st.recovered_records == 500 and st.flushes == 0
    assert st.checkpoint_lsn == 0 and st.dirty_pages == 500 // 4
    assert dict(cache.items()) == expected
    for i in range(500, 510):  # new records continue the LSNs in a new segment
        cache[f"k{i}"] = i
        expected[f"k{i}"] = i
    assert cache.stats().last_lsn == 510
    crash(cache)

    cache = Cache(d, **NEVER)
    assert cache.stats().recovered_records == 510 and cache.stats().flushes == 0
    assert dict(cache.items()) == expected
    crash(cache)
    assert contents(d) == expected
    assert list_segments(str(d)) == []  # the clean close removed the log


def test_segments_stay_until_the_batcher_checkpoints_past_them(tmp_path):
    d = tmp_path / "c"
    cache = Cache(d, segment_bytes=2048, **NEVER)
    for i in range(200):
        cache[f"k{i}"] = "x" * 20
    crash(cache)
    old = list_segments(str(d))
    assert len(old) > 3
    cache = Cache(d, segment_bytes=2048, **NEVER)
    segs = list_segments(str(d))
    assert segs[:-1] == old  # every recovered segment is kept, then a new one
    new_first = int(os.path.basename(segs[-1])[len("replay-"):-len(".log")])
    assert new_first == 201 and read_segment(segs[-1])[0] == []
    cache.flush()
    assert cache.stats().checkpoint_lsn == 200
    assert list_segments(str(d)) == segs[-1:]  # cut back once the checkpoint passed them
    cache.close()


def test_sigkill_right_after_a_recovering_open(tmp_path):
    """A process writes and is SIGKILLed; the next one recovers, checks that
    nothing reached SQLite, acknowledges a few more sets and is SIGKILLed
    too, before its batcher ever ran; the third open has everything."""
    d = tmp_path / "c"
    env = dict(os.environ, PYTHONPATH=str(REPO))
    write = textwrap.dedent("""
        import os, signal, sys
        from durablekv import Cache
        c = Cache(sys.argv[1], page_size=8, durability="log", flush_interval=3600,
                  flush_batch_pages=10**6, max_pending_pages=10**6)
        st = c.stats()
        print(st.recovered_records, st.flushes, st.checkpoint_lsn, flush=True)
        first, n = int(sys.argv[2]), int(sys.argv[3])
        for i in range(first, first + n):
            c[f"k{i}"] = i
            if i % 7 == 0:
                c.delete(f"k{i - 3}")
        print("ACKED", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    """)

    def run(first: int, n: int) -> list[str]:
        proc = subprocess.run([sys.executable, "-c", write, str(d), str(first), str(n)],
                              env=env, capture_output=True, text=True, timeout=120)
        assert proc.returncode == -signal.SIGKILL, proc.stderr
        return proc.stdout.split("\n")

    def model(upto: int) -> tuple[dict, int]:
        """The acknowledged contents, and how many log records they took."""
        m, records = {}, 0
        for i in range(upto):
            m[f"k{i}"] = i
            records += 1
            if i % 7 == 0 and m.pop(f"k{i - 3}", None) is not None:
                records += 1  # a delete of a missing key writes no record
        return m, records

    out = run(0, 3000)
    assert out[0] == "0 0 0" and out[1] == "ACKED"
    out = run(3000, 50)
    recovered, flushes, checkpoint = map(int, out[0].split())
    assert (recovered, flushes, checkpoint) == (model(3000)[1], 0, 0)
    assert out[1] == "ACKED"
    expected, records = model(3050)
    with Cache(d) as cache:
        assert cache.stats().recovered_records == records
        assert dict(cache.items()) == expected
    assert contents(d) == expected


def _crash_after_abc(d: Path) -> str:
    """Set a, b, c (never flushed), crash; return the one log segment."""
    cache = Cache(d, **NEVER)
    for k in "abc":
        cache[k] = k * 10
    crash(cache)
    (seg,) = list_segments(str(d))
    return seg


def test_a_torn_tail_is_cut_for_good_before_the_flush(tmp_path):
    """The tail cut off at recovery is truncated on disk: a crash before the
    flush and a second recovery see a clean end, not damage in the middle."""
    d = tmp_path / "c"
    seg = _crash_after_abc(d)
    size = os.path.getsize(seg)
    with open(seg, "r+b") as f:
        f.truncate(size - 5)
    cache = Cache(d, **NEVER)
    assert cache.stats().torn_records == 1 and cache.stats().flushes == 0
    cache["d"] = "dd"
    crash(cache)
    data = Path(seg).read_bytes()
    assert read_segment(seg)[2] is None  # the recovered segment now ends cleanly
    assert len(data) < size - 5
    cache = Cache(d, **NEVER)
    assert cache.stats().torn_records == 0
    assert dict(cache.items()) == {"a": "a" * 10, "b": "b" * 10, "d": "dd"}
    cache.close()


def _damage_second_record(seg: str) -> None:
    """Flip a payload byte of the second record in log segment ``seg``."""
    data = bytearray(Path(seg).read_bytes())
    second = len(MAGIC) + HEADER.size + HEADER.unpack_from(data, len(MAGIC))[0]
    data[second + HEADER.size + 3] ^= 0xFF
    Path(seg).write_bytes(bytes(data))


def test_salvaged_records_survive_a_crash_right_after_open(tmp_path):
    """Salvage moves the damaged segment aside, good prefix included: those
    records must reach SQLite before open returns."""
    d = tmp_path / "c"
    _damage_second_record(_crash_after_abc(d))
    cache = Cache(d, salvage_log=True, **NEVER)
    assert dict(cache.items()) == {"a": "a" * 10}
    cache["e"] = "ee"
    crash(cache)
    assert contents(d) == {"a": "a" * 10, "e": "ee"}


def test_salvage_killed_before_its_flush_loses_no_record_it_kept(tmp_path):
    """A process opening with salvage_log=True is SIGKILLed after recovery
    applied the records before the damage but before they reached SQLite.
    The damaged segment is their only copy, so it must still be in place:
    the next salvaging open finds the same damage and keeps them again."""
    d = tmp_path / "c"
    seg = _crash_after_abc(d)
    _damage_second_record(seg)
    data = Path(seg).read_bytes()
    killed_open = textwrap.dedent("""
        import os, signal, sys
        from durablekv import Cache
        from durablekv.batcher import WriteBehindBatcher
        def killed(self, *args, **kwargs):
            os.kill(os.getpid(), signal.SIGKILL)
        WriteBehindBatcher.flush_until = killed
        Cache(sys.argv[1], salvage_log=True)
    """)
    proc = subprocess.run([sys.executable, "-c", killed_open, str(d)], capture_output=True,
                          text=True, timeout=120, env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert Path(seg).read_bytes() == data  # not moved aside yet
    with Cache(d, salvage_log=True, **NEVER) as cache:
        assert dict(cache.items()) == {"a": "a" * 10}
    assert not os.path.exists(seg) and Path(seg + ".damaged").read_bytes() == data
    assert contents(d) == {"a": "a" * 10}


def test_a_second_salvage_keeps_the_first_ones_evidence(tmp_path):
    d = tmp_path / "c"
    seg = _crash_after_abc(d)
    Path(seg + ".damaged").write_bytes(b"from an earlier salvage")
    data = bytearray(Path(seg).read_bytes())
    data[len(MAGIC) + HEADER.size + 3] ^= 0xFF  # the first record: nothing is kept
    Path(seg).write_bytes(bytes(data))
    with Cache(d, salvage_log=True, **NEVER) as cache:
        assert len(cache) == 0
    assert Path(seg + ".damaged").read_bytes() == b"from an earlier salvage"
    assert Path(seg + ".2.damaged").read_bytes() == bytes(data)


@pytest.mark.parametrize("crash_after", [False, True])
def test_durability_none_flushes_recovered_records_before_dropping_the_log(tmp_path,
                                                                          crash_after):
    d = tmp_path / "c"
    cache = Cache(d, durability="log", **NEVER)
    expected = {i: str(i) for i in range(300)}
    for k, v in expected.items():
        cache[k] = v
    crash(cache)
    cache = Cache(d, durability="none", **NEVER)
    assert list_segments(str(d)) == []  # "none" keeps no log ...
    st = cache.stats()
    assert st.recovered_records == 300 and st.checkpoint_lsn == 300  # ... so SQLite has them
    assert dict(cache.items()) == expected
    if crash_after:
        crash(cache)
    else:
        cache.close()
    assert contents(d) == expected


# -- the bulk apply against the one-record-at-a-time replay it replaced ---------------------

import shutil  # noqa: E402
import tempfile  # noqa: E402
from unittest import mock  # noqa: E402

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from durablekv import codec as _codec  # noqa: E402
from durablekv.check import check_directory  # noqa: E402
from durablekv.log.segments import OP_CLEAR, OP_SET  # noqa: E402

from .conftest import Clock  # noqa: E402


def sequential_replay(self, records):
    """The replay that recovery used before the bulk apply, verbatim: every
    record through the live set/delete code, one at a time."""
    decode_key = _codec.decode_key
    from_blob = self._codec.memory_form_from_blob
    table = self._tier.table
    with self._lock:
        for lsn, op, kb, vb, expire_at in records:
            if self._tier.pending >= self.max_pending_pages:
                self._backpressure()
            if op == OP_CLEAR:
                self._apply_clear(lsn)
                table = self._tier.table
                self._last_lsn = lsn
                continue
            key = decode_key(kb)
            ref = table.get(key) or self._locate(key)
            if op == OP_SET:
                self._apply_set(key, from_blob(vb), expire_at, ref, lsn, len(kb) + len(vb))
            elif ref is not None:
                self._apply_delete(key, lsn)
            self._last_lsn = lsn


def open_with(replay, d, **kw) -> Cache:
    real = Cache._replay
    Cache._replay = replay
    try:
        return Cache(d, **kw)
    finally:
        Cache._replay = real


def state(cache: Cache) -> dict:
    """Counters and LSNs recovery must get right (whatever is resident)."""
    with cache._lock:
        # a page handed to a flush in flight has no dirty LSN of its own now
        dirty_lsns = {p.dirty_lsn for p in cache._tier.dirty.values()} - {None}
        return dict(count=cache._counts.keys, ttl_count=cache._counts.ttl_keys,
                    last_lsn=cache._last_lsn, dirty_lsns=dirty_lsns)


def stored_entries(cache: Cache) -> dict:
    """After a flush: every stored entry (key type and object, encoded value,
    expire_at), by canonical key; and the store's counts."""
    from durablekv.stores.pageformat import decode_page
    cache.flush()
    with cache._lock:
        rows = cache._store._r.execute("SELECT data FROM pages").fetchall()
        entries = {}
        for (data,) in rows:
            for _slot, kb, vb, exp in decode_page(data):
                key = _codec.decode_key(kb)
                entries[_codec.canonical_key(key)] = (type(key), key, vb, exp)
        return dict(entries=entries, key_count=cache._store.key_count,
                    ttl_key_count=cache._store.ttl_key_count, count=cache._counts.keys)


def listing(cache: Cache) -> dict:
    """The live contents with each key's type (dict equality ignores 1 vs 1.0)."""
    return {_codec.canonical_key(k): (type(k), k, v) for k, v in cache.items()}


# A small pool, rich in keys that are equal under == but logged as other bytes
# (1, 1.0, True; 0, 0.0, False; tuples of them), so logs overlap the store
# and themselves.
KEY_POOL = [0, 1, 2, 3, 4, 1.0, True, False, 0.0, 2.0, 2.5, "a", "b", b"a", None, (1, "x"),
            (1.0, "x"), (True, "x")]
KEYS = st.sampled_from(KEY_POOL)
VALUES = st.one_of(st.none(), st.integers(), st.text(max_size=3), st.binary(max_size=4),
                   st.lists(st.integers(), max_size=2), st.tuples(st.integers()))
OPS = st.lists(st.one_of(
    st.tuples(st.just("set"), KEYS, VALUES),
    st.tuples(st.just("ttl"), KEYS, VALUES, st.sampled_from([0, 0.5, 1, 5])),
    st.tuples(st.just("del"), KEYS),
    st.tuples(st.just("tick"), st.sampled_from([0.25, 1.0, 3.0])),
    st.tuples(st.just("clear")),
    st.tuples(st.just("flush")),
), max_size=60)


def run_ops(cache: Cache, clock: Clock, ops, model: dict, deadline: dict) -> None:
    def drop_expired():
        for k in [k for k, t in deadline.items() if clock.now >= t]:
            model.pop(k, None)
            del deadline[k]

    for op in ops:
        drop_expired()
        if op[0] == "set":
            cache[op[1]] = op[2]
            model[op[1]] = op[2]
            deadline.pop(op[1], None)
        elif op[0] == "ttl":
            cache.set(op[1], op[2], expire=op[3])
            if op[3] == 0:
                model.pop(op[1], None)
                deadline.pop(op[1], None)
            else:
                model[op[1]] = op[2]
                deadline[op[1]] = clock.now + op[3]
        elif op[0] == "del":
            cache.delete(op[1])
            model.pop(op[1], None)
            deadline.pop(op[1], None)
        elif op[0] == "tick":
            clock.now += op[1]
        elif op[0] == "clear":
            cache.clear()
            model.clear()
            deadline.clear()
        else:
            cache.flush()
    drop_expired()


def check_recovery(stored, logged, page_size, max_pages, max_pending,
                   write_pages: int = 10_000, inspect=None) -> None:
    """Build a store from ``stored`` ops (flushed), log ``logged`` ops, crash;
    recover one copy with the old per-record replay and one with the bulk
    apply, and compare (see the callers). The writer's memory tier holds
    ``write_pages`` pages (a small one flushes under back-pressure, so less
    is left to replay); recovery runs with ``max_pages`` and ``max_pending``.

    The write-behind's expiry sweep is off: whether it meets an expired
    entry's page before that page is faulted in depends on thread timing,
    and this compares the two recoveries' stores entry by entry. (The model
    test runs the sweep with crashes and reopens.)"""
    tmp = Path(tempfile.mkdtemp(prefix="durablekv-recovery-"))
    try:
        with mock.patch.object(Cache, "_sweep_expired", return_value=0):
            clock = Clock()
            opts = dict(page_size=page_size, max_pages=max_pages, clock=clock,
                        flush_interval=3600, flush_batch_pages=1_000_000,
                        max_pending_pages=max_pending)
            model: dict = {}
            deadline: dict = {}
            cache = Cache(tmp / "c", **{**opts, "max_pages": write_pages,
                                        "max_pending_pages": max(max_pending, write_pages)})
            run_ops(cache, clock, stored, model, deadline)
            cache.flush()  # the store holds these (many only there: tiny memory)
            run_ops(cache, clock, logged, model, deadline)
            crash(cache)  # ... the log holds the rest
            shutil.copytree(tmp / "c", tmp / "ref")

            ref = open_with(sequential_replay, tmp / "ref", **opts)
            try:
                want = state(ref)
                want_listing = listing(ref)
                want_stored = stored_entries(ref)
                want_recovered = ref.stats().recovered_records
            finally:
                crash(ref)

            bulk = Cache(tmp / "c", **opts)
            if inspect is not None:
                inspect(bulk)
            got = state(bulk)
            assert bulk.stats().recovered_records == want_recovered
            # Every page the bulk apply changed is dirty since the first LSN
            # replayed (one by one: since its own first change; lower is safe, a
            # partial flush then keeps its checkpoint lower).
            first = got["last_lsn"] - want_recovered + 1
            assert got.pop("dirty_lsns") <= {first}
            assert all(lsn >= first for lsn in want.pop("dirty_lsns"))
            assert got == want
            assert listing(bulk) == want_listing
            assert dict(bulk.items()) == model and len(bulk) == len(model)
            crash(bulk)  # right after open: whatever the batcher did or not
            with Cache(tmp / "c", **opts) as again:
                assert listing(again) == want_listing
                assert stored_entries(again) == want_stored
            with Cache(tmp / "c", **opts) as reopened:
                assert listing(reopened) == want_listing
            assert check_directory(str(tmp / "c")).ok
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(stored=OPS, logged=OPS, page_size=st.sampled_from([1, 2, 4]),
       max_pages=st.integers(1, 4), max_pending=st.sampled_from([1, 2, 64]),
       write_pages=st.sampled_from([1, 3, 10_000]))
def test_bulk_recovery_equals_one_by_one_replay_and_a_dict(stored, logged, page_size,
                                                          max_pages, max_pending, write_pages):
    """The same crashed directory recovered by the old per-record replay and by
    the bulk apply: same counts, LSNs and listing (with the very key objects
    kept for equal keys such as 1 and 1.0), the same store after a flush (values,
    expiry); both equal a dict model; a crash right after the bulk recovery
    and a clean close lose nothing; the store checks out."""
    check_recovery(stored, logged, page_size, max_pages, max_pending, write_pages)


def random_ops(rng, n: int, clear_odds: float = 0.0, flush_odds: float = 0.0) -> list:
    """``n`` random ops; each is a clear or a flush with the given odds."""
    keys = KEY_POOL + [f"s{i}" for i in range(40)]  # and plenty of plain keys
    ops = []
    for i in range(n):
        r = rng.random()
        # now and then a key never seen before: new pages beyond a tiny memory tier
        key = rng.choice(keys) if rng.random() < 0.85 else f"new{rng.random()}"
        if rng.random() < clear_odds:
            ops.append(("clear",))
        elif rng.random() < flush_odds:
            ops.append(("flush",))
        elif r < 0.45:
            ops.append(("set", key, rng.choice([None, rng.randrange(10**6), "x" * rng.randrange(9),
                                                [1, 2], b"\x00" * rng.randrange(30)])))
        elif r < 0.6:
            ops.append(("ttl", key, rng.randrange(100), rng.choice([0, 0.5, 1, 5])))
        elif r < 0.8:
            ops.append(("del", key))
        elif r < 0.9:
            ops.append(("tick", rng.choice([0.25, 1.0, 3.0])))
        else:
            ops.append(("set", key, rng.randrange(9)))
    return ops


@pytest.mark.parametrize("seed", range(24))
def test_bulk_recovery_of_long_random_logs(seed):
    """Same comparison on logs of hundreds of records over a few dozen keys:
    overwrites, deletes of keys only the store holds, TTLs, equal keys of
    other types, a clear now and then, recovery into a tiny memory tier."""
    import random
    rng = random.Random(seed)
    clear_odds = 0.002 if seed % 3 == 0 else 0.0  # one seed in three may log a clear
    check_recovery(random_ops(rng, 300, clear_odds, flush_odds=0.03),
                   random_ops(rng, 400, clear_odds, flush_odds=0.002),
                   page_size=rng.choice([1, 2, 4, 16]), max_pages=rng.choice([1, 2, 3, 8, 64]),
                   max_pending=rng.choice([1, 2, 8, 64]))


@pytest.mark.parametrize("seed", range(6))
def test_bulk_recovery_keeps_pages_within_the_byte_limit(monkeypatch, seed):
    """With a tiny PAGE_BYTES_LIMIT new keys spread over more pages and
    overwrites that no longer fit move to another page, as one by one."""
    import random

    import durablekv.tier.pages as pages
    monkeypatch.setattr(pages, "PAGE_BYTES_LIMIT", 64)
    rng = random.Random(seed)

    def within_limit(cache: Cache) -> None:
        with cache._lock:
            for page in cache._tier.pages.values():
                size = sum(len(_codec.encode_key(k)) + len(cache._codec.to_blob(v))
                           for k, v in zip(page.keys, page.values) if k is not EMPTY)
                assert page.used <= 1 or size <= 64, (page, size)

    check_recovery(random_ops(rng, 200, flush_odds=0.03), random_ops(rng, 300),
                   page_size=16, max_pages=rng.choice([2, 64]), max_pending=8,
                   inspect=within_limit)


def test_equal_keys_keep_the_key_object_a_dict_would(tmp_path):
    """1, 1.0 and True are one key: an update keeps the key first stored; a
    set after a delete stores the new one; both for keys only the store holds
    and for keys only the log has."""
    d = tmp_path / "c"
    cache = Cache(d, **NEVER)
    cache[1] = "stored int"
    cache[(0, "t")] = "stored tuple"
    cache[2.0] = "stored float"
    cache.flush()
    cache[1.0] = "updated"             # store key 1 stays 1
    cache.delete((0.0, "t"))
    cache[(False, "t")] = "reborn"     # deleted, then set: the new key object
    cache[True, "x"] = "log only"      # log only: the first set's key ...
    cache[1.0, "x"] = "overwritten"    # ... is kept by later sets of equal keys
    cache[3] = "a"
    cache.delete(3.0)
    cache[3.0] = "after delete"        # log only, set after a delete: 3.0
    crash(cache)
    with Cache(d) as cache:
        got = {repr(k): (type(k), v) for k, v in cache.items()}
    assert got == {"1": (int, "updated"), "(False, 't')": (tuple, "reborn"),
                   "2.0": (float, "stored float"), "(True, 'x')": (tuple, "overwritten"),
                   "3.0": (float, "after delete")}


def test_recovery_bigger_than_memory_respects_back_pressure(tmp_path, monkeypatch):
    """A log holding more than the memory tier: recovery evicts to the
    write-behind queue and waits for flushes, never queueing more than
    max_pending_pages (+1, as a live set may)."""
    import durablekv.tier.pages as pages
    d = tmp_path / "c"
    cache = Cache(d, page_size=4, **NEVER)
    for i in range(600):
        cache[f"s{i}"] = i
    cache.flush()
    for i in range(0, 1200, 2):  # overwrite stored keys, add new ones
        cache[f"s{i}"] = -i
        cache[f"n{i}"] = i
    crash(cache)
    peak = [0]
    real = pages.MemoryTier.make_resident

    def make_resident(self, page):
        real(self, page)
        peak[0] = max(peak[0], self.pending)

    monkeypatch.setattr(pages.MemoryTier, "make_resident", make_resident)
    with Cache(d, max_pages=5, max_pending_pages=3, flush_interval=3600) as cache:
        assert cache.stats().recovered_records == 1200
        assert 0 < peak[0] <= 3 + 1
        assert cache.stats().flushes > 0  # back-pressure made the batcher write
        expected = {f"s{i}": i for i in range(600)}
        for i in range(0, 1200, 2):
            expected[f"s{i}"] = -i
            expected[f"n{i}"] = i
        assert dict(cache.items()) == expected


@pytest.fixture
def small_filters(monkeypatch):
    """Filters start at 256 keys, so a few thousand keys outgrow them."""
    import durablekv.keyfilter as keyfilter
    monkeypatch.setattr(keyfilter, "MIN_CAPACITY", 256)


def test_recovered_keys_are_in_the_key_filter(tmp_path, small_filters):
    """Keys recovered into a new store: the filter is ready at once, sized for
    them (not overfull), and misses skip SQLite; recovered into a store with
    keys: every key is found while the filter is built, and after it."""
    from .test_keyfilter import count_lookups
    d = tmp_path / "c"
    cache = Cache(d, **NEVER)
    for i in range(3000):
        cache[f"k{i}"] = i
    crash(cache)
    with Cache(d, **NEVER) as cache:
        f = cache._store_keys.filter
        assert f.ready and not f.overfull and f.capacity >= 3000
        calls = count_lookups(cache)
        assert all(cache.get(f"absent{i}") is None for i in range(1000))
        assert len(calls) < 50  # false positives only
        for i in range(3000, 3100):
            cache[f"k{i}"] = i
        crash(cache)  # these 100 and the 3,000 are still only in the log ...
    with Cache(d, **NEVER) as cache:
        cache.flush()  # ... now in the store, which the next recovery finds
        assert cache._store_keys.filter.ready
        for i in range(200):
            cache[f"late{i}"] = i
            cache[f"k{i}"] = -i
        crash(cache)
    with Cache(d, **NEVER) as cache:
        assert not cache._store_keys.filter.ready  # a store with keys: a background scan
        assert cache["late7"] == 7 and cache["k3"] == -3 and cache["k3050"] == 3050
        cache.flush()  # a batcher cycle: the scan runs first
        assert cache._store_keys.filter.ready
        calls = count_lookups(cache)
        assert all(cache.get(f"late{i}") == i for i in range(200))
        assert all(cache.get(f"absent{i}") is None for i in range(1000))
        assert len(calls) < 50
        assert len(cache) == 3100 + 200


def test_many_keys_recovered_into_a_store_with_few(tmp_path, small_filters):
    """The filter being built at open (sized for the store's few keys) is
    replaced by one sized for the recovered keys too; none is missed."""
    from .test_keyfilter import count_lookups
    d = tmp_path / "c"
    cache = Cache(d, **NEVER)
    for i in range(10):
        cache[f"old{i}"] = i
    cache.flush()
    for i in range(5000):
        cache[f"new{i}"] = i
    crash(cache)
    with Cache(d, **NEVER) as cache:
        assert cache._store_keys.building is not None
        assert cache._store_keys.building.capacity >= 5000
        assert not cache._store_keys.building.overfull
        cache.flush()
        assert cache._store_keys.filter.ready and not cache._store_keys.filter.overfull
        calls = count_lookups(cache)
        assert all(cache.get(f"absent{i}") is None for i in range(1000))
        assert len(calls) < 50
        assert all(cache[f"new{i}"] == i for i in range(5000))
        assert all(cache[f"old{i}"] == i for i in range(10))


def test_recovery_runs_no_collection_while_it_reads_and_replays_the_log(tmp_path, monkeypatch):
    """The cyclic GC is paused while the log is read and replayed: reading
    makes a tuple and two bytes objects per record, and collections would
    walk the growing list again and again. The pause ends with the open."""
    import gc
    d = tmp_path / "c"
    cache = Cache(d, **NEVER)
    for i in range(20_000):
        cache[f"k{i}"] = i
    crash(cache)
    starts: list[int] = []

    def count_starts(phase: str, info: dict) -> None:
        if phase == "start":
            starts.append(info["generation"])

    real_recover = ReplayLog.recover

    def recover(self, *args, **kwargs):
        gc.callbacks.append(count_starts)
        try:
            return real_recover(self, *args, **kwargs)
        finally:
            gc.callbacks.remove(count_starts)

    monkeypatch.setattr(ReplayLog, "recover", recover)
    assert gc.isenabled()
    with Cache(d, **NEVER) as cache:
        assert gc.isenabled()
        assert cache.stats().recovered_records == 20_000
        assert starts == []
