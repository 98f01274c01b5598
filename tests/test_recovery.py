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
from durablekv.replaylog import HEADER, MAGIC, list_segments, read_segment

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


def test_a_torn_tail_is_cut_for_good_before_the_flush(tmp_path):
    """The tail cut off at recovery is truncated on disk: a crash before the
    flush and a second recovery see a clean end, not damage in the middle."""
    d = tmp_path / "c"
    cache = Cache(d, **NEVER)
    for k in "abc":
        cache[k] = k * 10
    crash(cache)
    (seg,) = list_segments(str(d))
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


def test_salvaged_records_survive_a_crash_right_after_open(tmp_path):
    """Salvage moves the damaged segment aside, good prefix included: those
    records must reach SQLite before open returns."""
    d = tmp_path / "c"
    cache = Cache(d, **NEVER)
    for k in "abc":
        cache[k] = k * 10
    crash(cache)
    (seg,) = list_segments(str(d))
    data = bytearray(Path(seg).read_bytes())
    second = len(MAGIC) + HEADER.size + HEADER.unpack_from(data, len(MAGIC))[0]
    data[second + HEADER.size + 3] ^= 0xFF
    Path(seg).write_bytes(bytes(data))
    cache = Cache(d, salvage_log=True, **NEVER)
    assert dict(cache.items()) == {"a": "a" * 10}
    cache["e"] = "ee"
    crash(cache)
    assert contents(d) == {"a": "a" * 10, "e": "ee"}


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
