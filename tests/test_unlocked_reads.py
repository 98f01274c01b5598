"""A memory hit takes no lock (Cache.get's one-load read).

The page table maps a key to an entry ``(page, slot, value)`` that writers
keep in step with the slot: a new tuple on placement, a list from the first
overwrite on, stored into in place. A reader's one load of the value sees
it before a write or after it; an entry that leaves the table keeps the
value it had then (``HAS_TTL`` in place of the value sends the read to the
locked path, which checks the expiry). These tests force the interleavings
a writer can make right after the lookup, count hits made from many threads
at once, and race reads against writes and evictions with a tiny switch
interval so that threads change places between any two steps.
"""
from __future__ import annotations

import subprocess
import sys
import threading
from heapq import heappush
from itertools import count

import pytest

from durablekv.tier.pages import HAS_TTL, RESIDENT, MemoryTier, Page

from .conftest import REPO, Clock, check_table, opened, run_threads, run_with_timeout


class _RacingTable:
    """Stands in for the cache's page table on get()'s path: the first lookup
    of ``key`` returns its tuple and then runs ``race`` before get() goes
    on, as another thread switching in right there would."""

    def __init__(self, table: dict, key, race) -> None:
        self.table, self.key, self.race = table, key, race

    def get(self, key, default=None):
        ref = self.table.get(key, default)
        if key == self.key and self.race is not None:
            race, self.race = self.race, None
            race()
        return ref

    def __setitem__(self, key, entry) -> None:  # set's overwrite reads the same table
        self.table[key] = entry


def _python_get(c) -> None:
    """Run ``c.get`` as the Python ``Cache.get``, whose steps these tests
    interleave (through ``c._fast.table`` and ``c._fast.ticks``). The C memory hit
    that an open cache installs when the extension runs takes the same
    steps with no Python code between them, so no other thread can run
    there under the GIL: tests/test_hot_paths.py checks it against this
    path."""
    c.__dict__.pop("get", None)


def test_a_slot_reused_after_the_lookup_never_gives_the_new_keys_value(cache_dir):
    with opened(cache_dir, page_size=1, max_pages=8) as c:
        _python_get(c)
        c.set("a", b"value of a")
        tier = c._tier
        page, slot, _ = tier.table["a"]

        def race() -> None:
            # delete a, and let b take its page and slot
            c.delete("a")
            c.set("b", b"value of b")
            assert tier.table["b"][:2] == (page, slot) and page.state == RESIDENT

        c._fast.table = _RacingTable(tier.table, "a", race)
        # the value a had when the lookup found it: the read came first
        assert c.get("a", "missing") == b"value of a"
        assert c.get("a", "missing") == "missing"
        assert c["b"] == b"value of b"
        check_table(tier)


def test_an_overwrite_after_the_lookup_gives_the_old_value_or_the_new(cache_dir):
    with opened(cache_dir, page_size=4, max_pages=8) as c:
        _python_get(c)
        c.set("a", b"old")
        assert type(c._tier.table["a"]) is tuple
        c._fast.table = _RacingTable(c._tier.table, "a", lambda: c.set("a", b"new"))
        # the first overwrite replaces the tuple the lookup found with a list
        assert c.get("a") == b"old"
        entry = c._tier.table["a"]
        assert type(entry) is list
        c._fast.table = _RacingTable(c._tier.table, "a", lambda: c.set("a", b"newer"))
        # later ones store into that list, which the read loads from after them
        assert c.get("a") == b"newer"
        assert c._tier.table["a"] is entry
        assert c.stats().memory_hits == 2
        check_table(c._tier)


def test_an_eviction_after_the_lookup_serves_the_value_and_keeps_the_lru_sound(cache_dir):
    with opened(cache_dir, page_size=1, max_pages=2) as c:
        _python_get(c)
        c.set("a", b"value of a")
        c.flush()

        def race() -> None:
            c.set("b", b"1")
            c.set("c", b"2")   # a is the LRU page: evicted, and clean, so dropped
            assert "a" not in c._tier.table

        c._fast.table = _RacingTable(c._tier.table, "a", race)
        assert c.get("a") == b"value of a"   # live when the lookup found it
        _check_lru_heap(c._tier)             # the stray touch of a dropped page
        c._fast.table = c._tier.table
        assert c.get("a") == b"value of a"   # now through the store
        assert c.stats().store_hits == 1
        _check_lru_heap(c._tier)


class _RacingTicks:
    """Stands in for the LRU tick counter: the next tick drawn runs ``race``
    first. get() draws it after the lookup, before returning the value."""

    def __init__(self, ticks, race) -> None:
        self.ticks, self.race = ticks, race

    def __next__(self) -> int:
        if self.race is not None:
            race, self.race = self.race, None
            race()
        return next(self.ticks)


def test_an_overwrite_with_an_expiry_is_never_served_from_the_lookup_alone(cache_dir):
    # At 1.7e9 s a TTL of 1e-7 s rounds away (expire_at == now): the entry
    # is expired as it is stored, so its value is never live.
    clock = Clock(1.7e9)
    with opened(cache_dir, page_size=4, max_pages=8, clock=clock) as c:
        _python_get(c)
        c.set("b", b"old")
        c.set("b", b"never live", expire=1e-7)
        assert c._tier.table["b"][2] is HAS_TTL
        assert c.get("b") is None
        c.set("a", b"old")
        c._fast.ticks = _RacingTicks(c._tier.ticks,
                                lambda: c.set("a", b"never live", expire=1e-7))
        assert c.get("a") == b"old"   # found before the overwrite
        assert c.get("a") is None
        check_table(c._tier)


def test_an_entry_that_loses_its_expiry_is_read_without_the_lock_again(cache_dir):
    with opened(cache_dir, page_size=4, max_pages=8) as c:
        c.set("a", b"1", expire=60)
        assert c._tier.table["a"][2] is HAS_TTL
        c.set("a", b"2")
        assert c._tier.table["a"][2] == b"2"
        with c._lock:
            assert run_with_timeout(lambda: c.get("a"), 5.0) == b"2"
        check_table(c._tier)


def test_in_answers_for_the_instant_of_its_lookup(cache_dir):
    with opened(cache_dir, page_size=1, max_pages=8) as c:
        c.set("a", b"1")
        c._fast.table = _RacingTable(c._tier.table, "a", lambda: (c.delete("a"), c.set("b", b"2")))
        assert "a" in c   # it was there when the lookup found it
        assert "a" not in c
        assert "b" in c


def test_in_never_finds_an_expired_entry_whose_slot_was_reused(cache_dir):
    # An expired entry "a" stays in its slot until something purges it. Its
    # tuple says HAS_TTL, so `in` checks the expiry under the lock, even
    # when the slot goes to a key without a TTL after the lookup.
    clock = Clock(1000)
    with opened(cache_dir, page_size=1, max_pages=8, clock=clock) as c:
        c.set("a", b"1", expire=1)
        clock.now = 1002

        def race() -> None:
            c.get("a")            # purges the expired entry, freeing its slot
            c.set("b", b"2")      # which "b" takes, with no TTL
            assert c._tier.table["b"][2] == b"2"

        c._fast.table = _RacingTable(c._tier.table, "a", race)
        assert "a" not in c
        c._fast.table = c._tier.table
        assert "a" not in c and "b" in c
        assert c.stats().misses == 1   # the race's get; `in` counts nothing


def test_a_memory_hit_and_in_answer_while_a_writer_holds_the_lock(cache_dir):
    """The README's promise: readers of an entry in memory with no TTL do
    not queue behind the lock (held here as a writer holds it for its log
    write); anything else waits for it."""
    with opened(cache_dir, page_size=4, max_pages=8) as c:
        c.set("a", b"1")
        c.set("t", b"2", expire=60)
        with c._lock:
            assert run_with_timeout(lambda: c.get("a"), 5.0) == b"1"
            assert run_with_timeout(lambda: "a" in c, 5.0) is True
            waiting = threading.Thread(target=c.get, args=("t",), daemon=True)
            waiting.start()
            waiting.join(0.2)
            assert waiting.is_alive()   # a TTL entry takes the locked path
        waiting.join(5.0)
        assert not waiting.is_alive()


def test_hits_from_many_threads_are_all_counted(cache_dir):
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        with opened(cache_dir, page_size=16, max_pages=64) as c:
            keys = [f"k{i}" for i in range(200)]
            for k in keys:
                c.set(k, k.encode())
            before = c.stats().memory_hits

            def reader(_i: int) -> None:
                for _ in range(25):
                    for k in keys:
                        assert c.get(k) == k.encode()

            run_threads(reader, 4)
            assert c.stats().memory_hits - before == 4 * 25 * len(keys)
    finally:
        sys.setswitchinterval(old)


@pytest.mark.parametrize("seed", range(12))
def test_hits_are_counted_exactly_whatever_else_draws_lru_ticks(cache_dir, seed):
    """Lock-free hits are counted as the LRU ticks not drawn under the lock,
    so every locked tick (locked hits, overwrites, faults, inserts, touches)
    must be counted too: predicted before each get from a model of the
    deadlines and the page's residency, hit by hit."""
    import random
    rng = random.Random(seed)
    clock = Clock(1000)
    deadline: dict = {}   # live keys -> expire_at or None
    want = {"memory_hits": 0, "store_hits": 0, "misses": 0}

    def live(k):
        return k in deadline and (deadline[k] is None or clock.now < deadline[k])

    with opened(cache_dir, page_size=4, max_pages=3, clock=clock) as c:
        keys = [f"k{i}" for i in range(60)]
        for _ in range(3000):
            k = rng.choice(keys)
            op = rng.random()
            if op < 0.5:
                ref = c._tier.table.get(k)
                if not live(k):
                    want["misses"] += 1
                elif ref is not None and ref[0].state == RESIDENT:
                    want["memory_hits"] += 1
                else:
                    want["store_hits"] += 1
                c.get(k)
            elif op < 0.8:
                ttl = rng.choice([None, None, 1, 5])
                c.set(k, rng.randbytes(8), expire=ttl)
                deadline[k] = None if ttl is None else clock.now + ttl
            elif op < 0.85:
                ttl = rng.choice([None, 2])
                if c.touch(k, ttl):
                    deadline[k] = None if ttl is None else clock.now + ttl
            elif op < 0.9:
                c.delete(k)
                deadline.pop(k, None)
            elif op < 0.95:
                clock.now += 0.5
            else:
                c.flush()
            st = c.stats()
            assert {f: getattr(st, f) for f in want} == want
        assert want["memory_hits"] > 50 and want["store_hits"] > 50


def _check_lru_heap(tier: MemoryTier) -> None:
    """Every resident page has exactly the heap entry its heap_stamp names."""
    live = {}
    for filed, page in tier.policy.heap:
        if page.heap_stamp == filed:
            assert page.page_id not in live, "two live heap entries for one page"
            live[page.page_id] = page
    resident = [p for p in tier.pages.values() if p.state == RESIDENT]
    assert sorted(p.page_id for p in resident) == sorted(live)
    assert len(resident) == tier.resident <= tier.max_pages


def test_gets_racing_sets_deletes_and_evictions_never_see_another_keys_value(cache_dir):
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        with opened(cache_dir, page_size=2, max_pages=6, flush_batch_pages=2) as c:
            keys = [f"key{i}" for i in range(40)]
            wrong: list = []

            def worker(i: int) -> None:
                if i == 0:  # the writer: overwrite, delete, set anew; evicts pages
                    for n in range(3_000):
                        k = keys[n % len(keys)]
                        if n % 7 == 3:
                            c.delete(k)
                        else:
                            c.set(k, f"{k}={n}".encode())
                    return
                for n in range(6_000):
                    k = keys[(n * 7 + i) % len(keys)]
                    v = c.get(k)
                    if v is not None and not v.startswith(f"{k}=".encode()):
                        wrong.append((k, v))

            run_threads(worker, 3)
            assert wrong == []
            _check_lru_heap(c._tier)
            check_table(c._tier)
            for n in range(3_000 - len(keys), 3_000):  # the writer's last change to each key
                k = keys[n % len(keys)]
                assert c.get(k) == (None if n % 7 == 3 else f"{k}={n}".encode())
    finally:
        sys.setswitchinterval(old)


class _TouchedPage(Page):
    """A page that another thread touches right after the second read of its
    stamp (the interleaving that made the heap entry and heap_stamp differ
    when re-filing read the stamp twice)."""

    __slots__ = ("_stamp", "reads")

    @property
    def stamp(self) -> int:
        self.reads += 1
        value = self._stamp
        if self.reads == 2:
            self._stamp += 1
        return value

    @stamp.setter
    def stamp(self, value: int) -> None:
        self._stamp = value


def test_a_page_touched_while_it_is_re_filed_keeps_one_live_heap_entry():
    tier = MemoryTier(page_size=1, max_pages=1)
    tier.ticks = count(100)
    page = _TouchedPage(1, 1)
    page.reads = 0
    page.stamp = 9            # touched since it was filed under 5
    page.heap_stamp = 5
    tier.pages[1] = page
    heappush(tier.policy.heap, (5, page))
    tier.resident = 1
    other = Page(2, 1)
    tier.pages[2] = other
    tier.make_resident(other)   # over max_pages: re-files `page`, then evicts one
    assert page.reads >= 2
    _check_lru_heap(tier)


@pytest.mark.parametrize("key", [["unhashable"], {"a": 1}])
def test_an_unhashable_key_still_gets_the_type_error_set_gives(cache_dir, key):
    with opened(cache_dir) as c:
        with pytest.raises(TypeError) as got:
            c.get(key)
        with pytest.raises(TypeError) as want:
            c.set(key, b"v")
        assert str(got.value) == str(want.value)


def test_on_a_free_threaded_build_every_get_takes_the_lock(tmp_path):
    code = (
        "import sys, sysconfig\n"
        "real = sysconfig.get_config_var\n"
        "sysconfig.get_config_var = lambda name: 1 if name == 'Py_GIL_DISABLED' else real(name)\n"
        "from durablekv import Cache\n"
        "assert Cache.get.__name__ == '_get_with_lock', Cache.get\n"
        "with Cache(sys.argv[1]) as c:\n"
        "    c.set('a', b'1')\n"
        "    class LockedOnly:\n"
        "        def get(self, key, default=None):\n"
        "            assert c._lock.locked(), 'a page-table read without the lock'\n"
        "            return c._tier.table.get(key, default)\n"
        "    c._fast.table = LockedOnly()\n"
        "    assert c.get('a') == b'1' and c['a'] == b'1' and c.get('b', 2) == 2\n"
        "    assert 'a' in c and 'b' not in c\n"
        "    assert c.stats().memory_hits == 2\n"
        "print('ok')\n")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "c")], capture_output=True,
                         text=True, cwd=REPO, timeout=60)
    assert out.returncode == 0 and out.stdout == "ok\n", out.stderr


def test_get_inlines_the_memory_hit_that_aio_calls():
    """Cache.get writes its lock-free memory hit out (a call per hit would
    cost a pure-Python hit about a fifth); AsyncCache calls the same steps as
    Cache._memory_hit. The two must not drift apart."""
    import inspect

    from durablekv import Cache

    def hit_block(fn):
        src = inspect.getsource(fn)
        start = src.index("        if self._state is _OPEN:")
        end = src.index("\n        return", start)
        return src[start:end]

    assert hit_block(Cache.get) == hit_block(Cache._memory_hit)
