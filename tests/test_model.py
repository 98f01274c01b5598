"""Model-based test: the cache and a plain dict agree after every step.

A hypothesis state machine drives set / get / delete / pop / expire (the
injected clock moves; ``Cache.expire()``) / flush / close-and-reopen / simulated crash on a
cache with a tiny memory tier, so pages are evicted, queued for write-behind
and faulted back all the time.
"""

from __future__ import annotations

import shutil
import tempfile

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from durablekv import Cache
from .conftest import Clock, check_table

_ABSENT = object()
#: every key KEYS can draw
ALL_KEYS = list(range(-3, 13)) + ["a", "b", "1", b"a", (1, "x"), 2.5, True, None, (1.0, "x")]

KEYS = st.one_of(st.integers(-3, 12), st.sampled_from(["a", "b", "1", b"a", (1, "x"), 2.5,
                                                       True, None, (1.0, "x")]))
VALUES = st.one_of(st.none(), st.integers(), st.text(max_size=5), st.binary(max_size=5),
                   st.lists(st.integers(), max_size=3), st.tuples(st.integers(), st.text(max_size=2)),
                   st.dictionaries(st.text(max_size=2), st.integers(), max_size=2))


class CacheVsDict(RuleBasedStateMachine):
    @initialize(page_size=st.sampled_from([1, 2, 4]), max_pages=st.integers(1, 3),
                durability=st.sampled_from(["log", "fsync", "none"]))
    def open_cache(self, page_size, max_pages, durability):
        self.dir = tempfile.mkdtemp(prefix="durablekv-model-")
        self.clock = Clock()
        self.opts = dict(page_size=page_size, max_pages=max_pages, durability=durability,
                         clock=self.clock, flush_interval=3600, flush_batch_pages=2)
        self.cache = Cache(self.dir, **self.opts)
        self.model: dict = {}      # key -> value
        self.deadline: dict = {}   # key -> expire_at

    def teardown(self):
        if hasattr(self, "cache"):
            self.cache.close()
            shutil.rmtree(self.dir, ignore_errors=True)

    def _drop_expired(self):
        for k in [k for k, t in self.deadline.items() if self.clock.now >= t]:
            self.model.pop(k, None)
            del self.deadline[k]

    @rule(key=KEYS, value=VALUES)
    def set(self, key, value):
        self.cache[key] = value
        self._drop_expired()
        self.model[key] = value
        self.deadline.pop(key, None)

    @rule(key=KEYS, value=VALUES, ttl=st.sampled_from([0, 0.5, 1, 5]))
    def set_with_ttl(self, key, value, ttl):
        self.cache.set(key, value, expire=ttl)
        self._drop_expired()
        if ttl == 0:
            self.model.pop(key, None)
            self.deadline.pop(key, None)
        else:
            self.model[key] = value
            self.deadline[key] = self.clock.now + ttl

    @rule(key=KEYS, ttl=st.sampled_from([None, 0, 1, 5]))
    def touch(self, key, ttl):
        self._drop_expired()
        live = key in self.model
        assert self.cache.touch(key, expire=ttl) is live
        if not live:
            return
        if ttl == 0:
            del self.model[key]
            self.deadline.pop(key, None)
        elif ttl is None:
            self.deadline.pop(key, None)
        else:
            self.deadline[key] = self.clock.now + ttl

    @rule(key=KEYS)
    def get(self, key):
        self._drop_expired()
        assert self.cache.get(key, "MISSING") == self.model.get(key, "MISSING")

    @rule(key=KEYS)
    def delete(self, key):
        self._drop_expired()
        assert self.cache.delete(key) == (key in self.model)
        self.model.pop(key, None)
        self.deadline.pop(key, None)

    @rule(key=KEYS)
    def pop(self, key):
        self._drop_expired()
        assert self.cache.pop(key, "MISSING") == self.model.pop(key, "MISSING")
        self.deadline.pop(key, None)

    @rule(dt=st.sampled_from([0.25, 0.5, 1.0, 3.0]))
    def clock_moves(self, dt):
        self.clock.now += dt

    @rule(dt=st.sampled_from([0.5, 1.0, 3.0]))
    def clock_moves_then_get_every_key(self, dt):
        """get() right after the clock moves, before anything else (len()
        in the invariant) purges what expired: entries past their TTL are
        still on their pages, and a memory hit must not serve them (it reads
        the page-table entry, which holds HAS_TTL for them, not the expiry)."""
        self.clock.now += dt
        self._drop_expired()
        for key in ALL_KEYS:
            assert self.cache.get(key, _ABSENT) == self.model.get(key, _ABSENT)

    @rule(dt=st.sampled_from([0, 0.5, 1.0, 3.0]))
    def clock_moves_then_expire(self, dt):
        """expire() removes every expired entry, in memory and in SQLite,
        and faults nothing in (what it removes the model dropped already)."""
        self.clock.now += dt
        self._drop_expired()
        faults = self.cache.stats().page_faults
        self.cache.expire()
        assert self.cache.stats().page_faults == faults
        tier, now = self.cache._tier, self.clock.now
        assert not [k for k, (p, s, _) in tier.table.items()
                    if p.expires[s] is not None and now >= p.expires[s]]
        if not self.cache._store_keys.clear_pending:
            assert self.cache._store.expired_pages(now, tier.pages, 1) == []
        assert self.cache.expire() == 0

    @rule()
    def flush(self):
        self.cache.flush()

    @rule()
    def reopen(self):
        self.cache.close()
        self.cache = Cache(self.dir, **self.opts)

    @precondition(lambda self: self.opts["durability"] != "none")
    @rule()
    def crash(self):
        """Stop without flushing or closing; recovery replays the log."""
        self.cache._teardown(clean=False)
        self.cache = Cache(self.dir, **self.opts)

    @rule()
    def clear(self):
        self.cache.clear()
        self.model.clear()
        self.deadline.clear()

    @invariant()
    def agree(self):
        if not hasattr(self, "cache"):
            return
        self._drop_expired()
        assert len(self.cache) == len(self.model)
        assert dict(self.cache.items()) == self.model
        st_ = self.cache.stats()
        assert st_.resident_pages <= self.opts["max_pages"]
        with self.cache._lock:   # the batcher drops flushed pending pages meanwhile
            check_table(self.cache._tier)


TestCacheVsDict = CacheVsDict.TestCase
TestCacheVsDict.settings = settings(max_examples=200, stateful_step_count=50, deadline=None,
                                    suppress_health_check=[HealthCheck.too_slow])
