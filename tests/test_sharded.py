"""ShardedCache keeps the Cache contract: the Cache API tests run on it unchanged.

Every test of ``test_cache_api`` that speaks only the public mapping API is
collected here again with the ``cache`` fixture swapped for a ShardedCache of
three shards; the rest of this file tests what is the sharded cache's own
(routing, the shard count on disk, summed stats, locking of every shard).
"""

from __future__ import annotations

import inspect
import os
import re
import subprocess
import sys
import textwrap

import pytest

from durablekv import Cache
from durablekv.errors import CacheLockedError, ConfigError
from durablekv.sharded import ShardedCache, shard_of

from . import test_cache_api as api
from .conftest import Clock

# Every API test that takes the ``cache`` fixture runs again here, on a
# ShardedCache; the others open a Cache of their own and would only repeat.
for _name, _test in vars(api).items():
    if _name.startswith("test_") and "cache" in inspect.signature(_test).parameters:
        globals()[_name] = _test
SHAPES = api.SHAPES


class ShardedVsDict(api.CacheVsDict):
    """The whole mapping API against a dict, across flush/close/reopen."""

    def open(self, **kw):
        return ShardedCache(self.path, shards=3, flush_interval=30.0, **kw)


ShardedVsDict.TestCase.settings = api.CacheVsDict.TestCase.settings
TestShardedVsDict = ShardedVsDict.TestCase


@pytest.fixture(params=sorted(SHAPES))
def shape(request):
    return SHAPES[request.param]


@pytest.fixture
def cache(tmp_path, shape):
    c = ShardedCache(tmp_path / "c", shards=3, flush_interval=30.0, **shape)
    yield c
    c.close()


# -- routing -------------------------------------------------------------------------


def test_equal_keys_route_to_one_shard_and_are_one_key(tmp_path):
    import enum

    class I(enum.IntEnum):
        ONE = 1

    for n in (1, 2, 3, 8, 256):
        assert shard_of(1, n) == shard_of(1.0, n) == shard_of(True, n) == shard_of(I.ONE, n)
        assert shard_of((1, "a"), n) == shard_of((1.0, "a"), n) == shard_of((True, "a"), n)
        assert shard_of(0, n) == shard_of(-0.0, n) == shard_of(False, n)
    with ShardedCache(tmp_path / "c", shards=8) as c:
        c[1] = "one"
        c[True] = "true"
        assert c[1.0] == "true" and c[I.ONE] == "true" and len(c) == 1
        assert list(c) == [1]  # the first-stored key object, as a dict keeps it


def test_routing_is_fixed_and_does_not_depend_on_pythons_hash():
    keys = ["user:1", b"user:1", 42, 2 ** 70, -1.5, None, ("a", 1), ""]
    here = [shard_of(k, 8) for k in keys]
    # The values themselves are part of the on-disk contract: a change would
    # send every stored key to a shard that does not hold it.
    assert here == [0, 3, 6, 6, 6, 2, 0, 2], here
    code = textwrap.dedent(f"""
        from durablekv.sharded import shard_of
        print([shard_of(k, 8) for k in {keys!r}])
    """)
    for seed in ("0", "1", "12345"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                             text=True, check=True).stdout
        assert out.strip() == repr(here)


def test_keys_spread_over_the_shards_and_live_only_in_their_own(tmp_path):
    with ShardedCache(tmp_path / "c", shards=8, flush_interval=30.0) as c:
        for i in range(4000):
            c[f"k{i}"] = i
        counts = [len(s) for s in c.shards]
        assert sum(counts) == len(c) == 4000
        assert min(counts) > 400 and max(counts) < 600, counts
        for i in range(0, 4000, 97):
            k = f"k{i}"
            owner = c.shard_for(k)
            assert [k in s for s in c.shards].count(True) == 1 and k in owner


def test_unsupported_keys_raise_as_cache_does(tmp_path):
    with ShardedCache(tmp_path / "c", shards=2) as c:
        for bad, exc in (([1], TypeError), (object(), TypeError), (float("nan"), ValueError)):
            for op in (lambda: c.get(bad), lambda: bad in c, lambda: c.set(bad, 1)):
                with pytest.raises(exc):
                    op()


# -- the shard count on disk -----------------------------------------------------------


def test_shard_count_is_fixed_at_creation(tmp_path):
    d = tmp_path / "c"
    with ShardedCache(d, shards=4) as c:
        c.update({i: i for i in range(50)})
    assert sorted(os.listdir(d)) == ["SHARDS", "shard-00", "shard-01", "shard-02", "shard-03"]
    with ShardedCache(d) as c:  # None adopts the stored count
        assert c.shard_count == 4 and dict(c.items()) == {i: i for i in range(50)}
    with pytest.raises(ConfigError, match="created with shards=4, not 5"):
        ShardedCache(d, shards=5)
    with ShardedCache(tmp_path / "new") as c:
        assert c.shard_count == 8


def test_a_leading_tilde_is_the_home_directory_as_for_cache(home):
    with ShardedCache("~/c", shards=2) as c:
        c["k"] = 1
        assert c.path == str(home / "c") and c.directory == c.path
        assert [s.path for s in c.shards] == [str(home / "c" / f"shard-0{i}") for i in (0, 1)]
    assert os.listdir(".") == []
    with ShardedCache("~/c") as c:
        assert c["k"] == 1


def test_a_file_among_the_parents_is_named_as_a_file(tmp_path):
    (tmp_path / "afile").write_text("x")
    with pytest.raises(ConfigError, match=re.escape(f"{str(tmp_path / 'afile')!r} is a file, "
                                                    "not a directory")):
        ShardedCache(tmp_path / "afile" / "sub")


@pytest.mark.parametrize("bad", [0, -1, 257, "8", 2.0, True])
def test_bad_shard_count_is_a_config_error(tmp_path, bad):
    with pytest.raises(ConfigError, match=r"shards must be an int in \[1, 256\]"):
        ShardedCache(tmp_path / "c", shards=bad)
    assert not (tmp_path / "c").exists()


@pytest.mark.parametrize("text", ["", "{", '{"shards": 0}', '{"shards": "x"}', "[]"])
def test_damaged_shards_file_is_corruption(tmp_path, text):
    d = tmp_path / "c"
    ShardedCache(d, shards=2).close()
    (d / "SHARDS").write_text(text)
    with pytest.raises(ConfigError, match="SHARDS"):
        ShardedCache(d)


def test_shard_directories_without_a_count_are_refused(tmp_path):
    d = tmp_path / "c"
    ShardedCache(d, shards=2).close()
    (d / "SHARDS").unlink()
    with pytest.raises(ConfigError, match="no SHARDS file"):
        ShardedCache(d, shards=2)


def test_parent_directory_is_private(tmp_path):
    with ShardedCache(tmp_path / "c", shards=2):
        pass
    assert (tmp_path / "c").stat().st_mode & 0o777 == 0o700
    assert (tmp_path / "c" / "SHARDS").stat().st_mode & 0o777 == 0o600


# -- ownership, lifecycle, stats -------------------------------------------------------


def test_second_open_is_refused_and_leaves_no_shard_open(tmp_path):
    d = tmp_path / "c"
    with ShardedCache(d, shards=3) as c:
        c["a"] = 1
        # Take shard 2 away from a second opener in another process's place:
        # a plain Cache on one shard's directory.
        with pytest.raises(CacheLockedError):
            ShardedCache(d)
        assert c["a"] == 1
    other = Cache(d / "shard-02")
    try:
        with pytest.raises(CacheLockedError):
            ShardedCache(d)
    finally:
        other.close()
    with ShardedCache(d) as c:  # shards 0 and 1 were released by the failed open
        assert c["a"] == 1


def test_stats_are_the_sum_of_the_shards(tmp_path):
    clock = Clock()
    with ShardedCache(tmp_path / "c", shards=4, clock=clock, flush_interval=30.0) as c:
        for i in range(100):
            c[i] = i
        for i in range(150):
            c.get(i)
        c.delete(0)
        parts = c.shard_stats()
        total = c.stats()
        assert len(parts) == 4
        assert total.sets == 100 == sum(p.sets for p in parts)
        assert total.hits == 100 and total.misses == 50 and total.deletes == 1
        assert total.max_pages == 4 * c.max_pages and total.page_size == c.page_size
        assert total.last_lsn == sum(p.last_lsn for p in parts) == 101
        c.flush()
        assert c.stats().checkpoint_lsn == 101


def test_flush_with_timeout_and_close_cover_every_shard(tmp_path):
    d = tmp_path / "c"
    c = ShardedCache(d, shards=4, flush_interval=30.0)
    c.update({i: i for i in range(40)})
    c.flush(timeout=10.0)
    assert all(s.stats().dirty_pages == 0 for s in c.shards)
    c.close()
    c.close()  # idempotent
    assert c.closed
    assert not any(f.startswith("replay") for s in range(4) for f in os.listdir(d / f"shard-0{s}"))


def test_concurrent_increments_are_never_lost(tmp_path):
    with ShardedCache(tmp_path / "c", shards=4) as c:
        def work(_):
            for i in range(300):
                c.incr(f"n{i % 7}")
        api.run_threads(work, 4)
        assert sum(c[f"n{j}"] for j in range(7)) == 1200


CRASH_WRITER = textwrap.dedent("""
    import os, sys
    from durablekv.sharded import ShardedCache
    c = ShardedCache(sys.argv[1], shards=4, durability="log", max_pages=4, page_size=4)
    for i in range(10 ** 6):
        c.set(f"k{i}", i)
        os.write(1, b"%d\\n" % i)
""")


def test_every_acknowledged_write_survives_kill_9(tmp_path):
    import select
    import signal
    import time

    d = tmp_path / "c"
    for cycle in range(3):
        proc = subprocess.Popen([sys.executable, "-c", CRASH_WRITER, str(d)],
                                stdout=subprocess.PIPE)
        acked, buf = [], b""
        deadline = time.monotonic() + 60
        try:
            while len(acked) < 500 + 300 * cycle and time.monotonic() < deadline:
                ready, _, _ = select.select([proc.stdout], [], [], 1.0)
                if ready:
                    chunk = os.read(proc.stdout.fileno(), 65536)
                    if not chunk:
                        break
                    buf += chunk
                    *lines, buf = buf.split(b"\n")
                    acked += [int(x) for x in lines]
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
        assert len(acked) >= 500, f"writer acknowledged only {len(acked)} writes"
        with ShardedCache(d) as c:
            lost = [i for i in acked if c.get(f"k{i}") != i]
            assert lost == [], f"{len(lost)} acknowledged writes lost, e.g. {lost[:5]}"


def test_no_directory_is_a_temporary_cache_removed_at_close():
    c = ShardedCache(shards=2)
    path = c.path
    c["a"] = b"x" * 1000
    assert os.path.isdir(path) and c.volume() > 1000
    assert c.volume() == sum(s.volume() for s in c.shards)
    c.close()
    assert not os.path.exists(path)


def test_a_temporary_sharded_cache_that_fails_to_open_leaves_nothing(tmp_path, monkeypatch):
    """A refused shard setting, or Ctrl-C landing as the directory is made,
    left a durablekv-* directory in the temporary directory (mkdtemp ran
    before the try that cleans up)."""
    import tempfile
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with pytest.raises(ConfigError):
        ShardedCache(shards=2, page_size=0)
    assert list(tmp_path.iterdir()) == []
    mkdir = os.mkdir

    def interrupted(path, *args, **kwargs):
        mkdir(path, *args, **kwargs)
        raise KeyboardInterrupt  # lands as mkdir returns

    with monkeypatch.context() as m:
        m.setattr(os, "mkdir", interrupted)
        with pytest.raises(KeyboardInterrupt):
            ShardedCache(shards=2)
    assert list(tmp_path.iterdir()) == []


# -- metrics -----------------------------------------------------------------------


def test_metrics_carry_a_shard_label_and_sum_to_the_stats(tmp_path):
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from durablekv.metrics import register, unregister

    registry = CollectorRegistry()
    with ShardedCache(tmp_path / "s", shards=3) as s, Cache(tmp_path / "plain") as plain:
        for i in range(60):
            s[i] = i
            s.get(i)
        plain["x"] = 1
        register(registry, s)
        register(registry, plain)
        families = {f.name: f for f in
                    text_string_to_metric_families(generate_latest(registry).decode())}
        hits = [x for x in families["durablekv_hits"].samples if x.name.endswith("_total")]
        by_shard = {x.labels["shard"]: x.value for x in hits
                    if x.labels["cache"] == "s" and x.labels["tier"] == "memory"}
        assert sorted(by_shard) == ["0", "1", "2"]
        assert sum(by_shard.values()) == s.stats().memory_hits == 60
        assert [x.value for x in hits if x.labels["cache"] == "plain"] == [0, 0]
        assert all(x.labels["shard"] == "" for x in hits if x.labels["cache"] == "plain")
        unregister(registry, s)
        text = generate_latest(registry).decode()
        assert 'cache="s"' not in text and 'cache="plain"' in text
        assert "shard=" not in text  # with no shard left, the label goes too


def test_thread_scaling_bench_runs(tmp_path, capsys):
    from bench import sharded as bench

    out = tmp_path / "r.json"
    assert bench.main(["--quick", "--threads", "1,2", "--shards", "2", "--out", str(out)]) == 0
    rows = __import__("json").loads(out.read_text())["rows"]
    assert [(r["durability"], r["threads"]) for r in rows] == [
        ("log", 1), ("log", 2), ("fsync", 1), ("fsync", 2)]
    assert all(r["ratio"] > 0 for r in rows)
    assert "| log | 2 |" in capsys.readouterr().out


def test_a_plain_cache_directory_is_refused_and_check_walks_the_shards(tmp_path, capsys):
    with Cache(tmp_path / "plain") as c:
        c["a"] = 1
    with pytest.raises(ConfigError, match="holds a plain Cache"):
        ShardedCache(tmp_path / "plain")
    assert "SHARDS" not in os.listdir(tmp_path / "plain")  # nothing was written
    with ShardedCache(tmp_path / "s", shards=3) as s:
        s.update({i: i for i in range(200)})

    def check() -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "durablekv", "check", str(tmp_path / "s")],
                              capture_output=True, text=True)
    out = check()
    assert out.returncode == 0, out.stdout + out.stderr
    assert "ShardedCache directory of 3 shards" in out.stdout
    for i in range(3):
        assert f"shard-0{i}: " in out.stdout
    assert out.stdout.splitlines()[-1] == "result  healthy"
    # a flipped bit in one shard's page makes the whole directory DAMAGED (exit 1)
    import sqlite3
    conn = sqlite3.connect(tmp_path / "s" / "shard-01" / "pages.sqlite3")
    with conn:
        page_id, data = conn.execute("SELECT page_id, data FROM pages LIMIT 1").fetchone()
        data = bytearray(data)
        data[len(data) // 2] ^= 0x10
        conn.execute("UPDATE pages SET data = ? WHERE page_id = ?", (bytes(data), page_id))
    conn.close()
    out = check()
    assert out.returncode == 1, out.stdout
    assert "DAMAGE  shard-01: " in out.stdout and out.stdout.splitlines()[-1] == "result  DAMAGED"


def test_a_plain_cache_refuses_a_sharded_directory(tmp_path):
    with ShardedCache(tmp_path / "s", shards=2) as s:
        s["a"] = 1
    with pytest.raises(ConfigError, match="is a ShardedCache directory"):
        Cache(tmp_path / "s")
    assert not (tmp_path / "s" / "pages.sqlite3").exists()
    with ShardedCache(tmp_path / "s") as s:
        assert s["a"] == 1
