"""The parts of Cache, each run alone against small fakes of its collaborators."""

from __future__ import annotations

import math
import threading

import pytest

from durablekv.config import _MISSING
from durablekv.expiry import Expiry
from durablekv.memoize import memoize


class FakeHost:
    """What memoize needs from its host: get/set/delete/_peek and iteration."""

    def __init__(self) -> None:
        self.data: dict = {}
        self.sets = 0

    def get(self, key, default=None):
        return self.data.get(key, default)

    def _peek(self, key):
        return self.data.get(key, _MISSING)

    def set(self, key, value, expire=None):
        self.sets += 1
        self.data[key] = value

    def delete(self, key) -> bool:
        return self.data.pop(key, _MISSING) is not _MISSING

    def __iter__(self):
        return iter(list(self.data))


def test_memoize_runs_on_any_host_and_concurrent_callers_share_one_call():
    host = FakeHost()
    entered, release = threading.Event(), threading.Event()
    calls = []

    @memoize(host, name="f")
    def f(x):
        calls.append(x)
        entered.set()
        assert release.wait(30)
        return x * 2

    results = []
    first = threading.Thread(target=lambda: results.append(f(21)))
    first.start()
    assert entered.wait(30)  # the leader is inside f; the next caller must wait for it
    waiter = threading.Thread(target=lambda: results.append(f(21)))
    waiter.start()
    release.set()
    first.join(30)
    waiter.join(30)
    assert results == [42, 42] and calls == [21] and host.sets == 1
    assert f(21) == 42 and calls == [21]
    host.data["other"] = 1
    assert f.cache_clear() == 1 and list(host.data) == ["other"]


def test_memoize_refuses_tags_and_conflicting_key_options():
    with pytest.raises(TypeError):
        memoize(FakeHost(), tag="t")
    with pytest.raises(TypeError):
        memoize(FakeHost(), key=lambda x: x, ignore={0})


class _Kicks:
    def __init__(self) -> None:
        self.kicks: list[dict] = []

    def kick(self, **kw) -> None:
        self.kicks.append(kw)


class ClockHost(Expiry):
    """The state the TTL clock reads: an injected clock, the offset, the batcher."""

    def __init__(self, times: list[float]) -> None:
        self._clock = lambda: times.pop(0)
        self._clock_offset = 0.0
        self._last_now = -math.inf
        self._ttl_clock = (0.0, -math.inf)
        self._batcher = _Kicks()


def test_the_ttl_clock_never_goes_back_and_asks_for_a_flush_of_its_offset():
    host = ClockHost([100.0, 90.0, 95.0, 120.0])
    assert host._now() == 100.0
    assert host._now() == 100.0  # the wall clock stepped back 10 s: TTL time holds
    assert host._ttl_clock == (10.0, 100.0) and host._batcher.kicks == [{"urgent": True}]
    assert host._now() == 105.0  # then runs on from there, offset kept
    assert host._now() == 130.0 and len(host._batcher.kicks) == 1
