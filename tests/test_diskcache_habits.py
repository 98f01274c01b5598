"""What a diskcache or cachetools user reaches for first: each works, or is
refused with a TypeError that says what to do instead.

memoize on a method (``ignore=``, ``key=``), ``cache_clear()``/``cache_key``,
``Cache()`` with no directory, ``volume()``, and ``tag=``/``evict(tag)``
(refused: entries carry no tag; see docs/diskcache.md).
"""

from __future__ import annotations

import os
import threading

import pytest

from durablekv import Cache, ConfigError, ShardedCache

from .conftest import opened, run_threads


class Repo:
    """A class whose instances cannot be part of a key (as most cannot)."""

    def __init__(self, cache: Cache, ident: int) -> None:
        self.ident = ident
        self.calls: list = []
        self.cache = cache


def test_a_memoized_method_without_ignore_or_key_names_the_fix(tmp_path):
    with opened(tmp_path / "c") as cache:
        class Users:
            @cache.memoize
            def load(self, user_id):
                return {"id": user_id}
        with pytest.raises(TypeError) as info:
            Users().load(1)
        msg = str(info.value)
        assert "its 1st positional argument (<" in msg and "cannot be part of a cache key" in msg
        assert "@cache.memoize(ignore={0})" in msg and "key=" in msg
        assert len(cache) == 0


def test_memoize_ignore_leaves_self_out_of_the_key(tmp_path):
    with opened(tmp_path / "c") as cache:
        calls = []

        class Users:
            @cache.memoize(ignore={0, "verbose"})
            def load(self, user_id, verbose=False):
                calls.append(user_id)
                return {"id": user_id}
        a, b = Users(), Users()
        assert a.load(1) == {"id": 1} and a.load(1) == {"id": 1}
        assert b.load(1, verbose=True) == {"id": 1}  # shared by every instance, as documented
        assert calls == [1]
        name = f"{Users.load.__module__}.{Users.load.__qualname__}"
        assert Users.load.cache_key(a, 1, verbose=True) == ("durablekv.memoize", name, (1,), ())
        assert list(cache) == [("durablekv.memoize", name, (1,), ())]


def test_memoize_key_function_names_the_instance(tmp_path):
    with opened(tmp_path / "c") as cache:
        calls = []

        class Users:
            def __init__(self, tenant):
                self.tenant = tenant

            @cache.memoize(key=lambda self, user_id: (self.tenant, user_id))
            def load(self, user_id):
                calls.append((self.tenant, user_id))
                return f"{self.tenant}/{user_id}"
        a, b = Users("a"), Users("b")
        assert [a.load(1), a.load(1), b.load(1)] == ["a/1", "a/1", "b/1"]
        assert calls == [("a", 1), ("b", 1)]
        assert Users.load.cache_key(a, 1)[2] == ("a", 1)
        bad = Users(object())
        with pytest.raises(TypeError, match=r"key= returned \(<object object"):
            bad.load(2)


def test_memoize_refuses_bad_ignore_and_key_with_the_fix(tmp_path):
    with opened(tmp_path / "c") as cache:
        with pytest.raises(TypeError, match=r"ignore=\{0\} for a method's self; got -1"):
            cache.memoize(ignore={-1})
        with pytest.raises(TypeError, match="got 1.5"):
            cache.memoize(ignore=[1.5])
        with pytest.raises(TypeError, match="not both"):
            cache.memoize(ignore={0}, key=lambda *a: a)
        with pytest.raises(TypeError, match="function of the call's arguments"):
            cache.memoize(key="id")
        assert cache.memoize(ignore=0)(lambda self, x: x).cache_key(object(), 3)[2] == (3,)


def test_an_ignored_argument_is_never_blamed(tmp_path):
    with opened(tmp_path / "c") as cache:
        @cache.memoize(ignore={0})
        def f(conn, query):
            return query
        with pytest.raises(TypeError, match=r"its 2nd positional argument \(\[1\]\)"):
            f(object(), [1])


def test_cache_clear_removes_only_that_functions_results(tmp_path):
    with opened(tmp_path / "c", page_size=2, max_pages=2) as cache:
        @cache.memoize
        def square(x):
            return x * x

        @cache.memoize
        def cube(x):
            return x ** 3
        for i in range(10):
            square(i)
            cube(i)
        cache["plain"] = 1
        cache[("durablekv.memoize",)] = 2  # looks a little like a memoize key
        assert square.cache_clear() == 10
        assert square.cache_clear() == 0
        assert len(cache) == 12 and cache["plain"] == 1
        assert all(cache.get(cube.cache_key(i)) == i ** 3 for i in range(10))
        assert cache.get(square.cache_key(3)) is None


def test_memoize_tag_is_refused_with_what_to_do(tmp_path):
    with opened(tmp_path / "c") as cache:
        with pytest.raises(TypeError, match=r"does not store tags.*cache_clear\(\)"):
            cache.memoize(tag="users")


# -- Cache() with no directory -------------------------------------------------------


def test_cache_with_no_directory_is_temporary_and_removed_at_close():
    cache = Cache()
    path = cache.path
    try:
        assert os.path.isdir(path) and os.path.basename(path).startswith("durablekv-")
        assert os.stat(path).st_mode & 0o777 == 0o700
        cache["a"] = b"x" * 1000
        cache.flush()
        assert os.path.exists(os.path.join(path, "pages.sqlite3"))
    finally:
        cache.close()
    assert not os.path.exists(path)
    cache.close()  # still idempotent
    with Cache(None) as other:
        assert other.path != path
    assert not os.path.exists(other.path)


def test_a_named_directory_is_never_removed(tmp_path):
    with Cache(tmp_path / "c") as cache:
        cache["a"] = 1
    assert (tmp_path / "c" / "pages.sqlite3").exists()


def test_a_temporary_cache_that_fails_to_open_leaves_no_directory(tmp_path, monkeypatch):
    import tempfile
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where Cache() makes its own
    with pytest.raises(ConfigError):
        Cache(page_size=0)
    with pytest.raises(ConfigError):
        Cache(max_value_bytes=-1)
    assert list(tmp_path.iterdir()) == []
    with Cache() as cache:  # (and that is where it is made)
        assert os.path.dirname(cache.path) == str(tmp_path)


# -- volume() ------------------------------------------------------------------------


def test_volume_is_the_bytes_on_disk(tmp_path):
    # The write-behind must not flush between volume() and the listing below
    # (2000 entries dirty 125 pages, past the default flush_batch_pages): it
    # runs only when flush() asks.
    with opened(tmp_path / "c", flush_interval=3600.0, flush_batch_pages=10_000) as cache:
        empty = cache.volume()
        for i in range(2000):
            cache[i] = os.urandom(200)
        logged = cache.volume()
        d = tmp_path / "c"

        def on_disk():
            return sum(os.path.getsize(d / n) for n in os.listdir(d)
                       if n == "pages.sqlite3" or n == "pages.sqlite3-wal"
                       or n.startswith("replay-"))
        assert logged == on_disk() and logged > empty + 2000 * 200
        cache.flush()
        assert cache.volume() == on_disk() >= 2000 * 200
    with pytest.raises(Exception, match="closed"):
        cache.volume()


# -- tag= and evict(tag): refused ----------------------------------------------------


def test_tags_are_refused_with_what_to_do_instead(tmp_path):
    with opened(tmp_path / "c") as cache:
        for call in (lambda: cache.set("k", 1, tag="users"),
                     lambda: cache.add("k", 1, tag="users"),
                     lambda: cache.evict("users")):
            with pytest.raises(TypeError) as info:
                call()
            assert "does not store tags" in str(info.value)
            assert "put the group in the key" in str(info.value)
        assert "k" not in cache


# -- what a diskcache or Redis user types first ----------------------------------------
# Each is refused with the durablekv way, never a bare signature error that
# names one of Cache's internal parts (Expiry.expire(), Introspection.stats()).


@pytest.mark.parametrize("make", [lambda d: opened(d), lambda d: ShardedCache(d, shards=2)],
                         ids=["Cache", "ShardedCache"])
def test_expire_with_a_key_and_seconds_says_to_use_touch(tmp_path, make):
    with make(tmp_path / "c") as cache:
        cache["a"] = 1
        with pytest.raises(TypeError) as info:
            cache.expire("a", 5)  # Redis's EXPIRE key seconds
        msg = str(info.value)
        assert "removes every expired entry" in msg and "cache.touch('a', expire=5)" in msg, msg
        assert "Expiry" not in msg
        with pytest.raises(TypeError, match=r"cache\.touch\('a', expire=seconds\)"):
            cache.expire("a")
        with pytest.raises(TypeError, match=r"takes no arguments.*clock="):
            cache.expire(now=5)  # diskcache's expire(now=None, retry=False)
        assert cache.touch("a", expire=60) is True  # the way the message names
        assert cache.expire() == 0 and cache["a"] == 1


@pytest.mark.parametrize("call", [lambda c: c.stats(enable=True), lambda c: c.stats(reset=True),
                                  lambda c: c.stats(True), lambda c: c.stats(enable=False)],
                         ids=["enable", "reset", "positional", "disable"])
@pytest.mark.parametrize("make", [lambda d: opened(d), lambda d: ShardedCache(d, shards=2)],
                         ids=["Cache", "ShardedCache"])
def test_stats_switches_say_that_durablekv_always_counts(tmp_path, make, call):
    with make(tmp_path / "c") as cache:
        cache.get("nope")
        with pytest.raises(TypeError) as info:
            call(cache)
        msg = str(info.value)
        assert "always counts" in msg and "since the cache was opened" in msg, msg
        assert "s.hits, s.misses" in msg and "subtract" in msg
        assert "Introspection" not in msg
        s = cache.stats()
        assert (s.hits, s.misses) == (0, 1)


def test_memoize_with_a_name_first_says_to_pass_name(tmp_path):
    with opened(tmp_path / "c") as cache:
        with pytest.raises(TypeError) as info:
            cache.memoize("users")  # diskcache's first positional is name
        msg = str(info.value)
        assert "memoize('users')" in msg and "name='users'" in msg and "expire" in msg, msg

        @cache.memoize(name="users")
        def load(i):
            return i
        assert load(1) == 1 and list(cache) == [("durablekv.memoize", "users", (1,), ())]


def test_memoize_typed_says_to_put_the_type_in_the_key(tmp_path):
    with opened(tmp_path / "c") as cache:
        with pytest.raises(TypeError) as info:
            cache.memoize(typed=True)
        msg = str(info.value)
        assert "1 == 1.0 == True" in msg and "key=" in msg, msg
        calls = []

        @cache.memoize(typed=False)  # what durablekv does anyway
        def f(x):
            calls.append(x)
            return x
        assert f(1) == 1 and f(1.0) == 1 and calls == [1]

        @cache.memoize(key=lambda x: (type(x).__name__, x))  # the way the message names
        def g(x):
            return x
        assert g(1) == 1 and type(g(1.0)) is float


@pytest.mark.parametrize("make", [Cache, lambda d, **kw: ShardedCache(d, shards=2, **kw)],
                         ids=["Cache", "ShardedCache"])
def test_timeout_points_at_busy_timeout(tmp_path, make):
    with pytest.raises(TypeError) as info:
        make(tmp_path / "c", timeout=1)  # diskcache's SQLite timeout
    msg = str(info.value)
    assert "busy_timeout=1" in msg and "SQLite" in msg, msg
    assert not any((tmp_path / "c").glob("**/LOCK"))  # refused before a lock was taken
    with make(tmp_path / "c", busy_timeout=1):
        pass


def test_directory_is_the_path_read_only(tmp_path):
    with opened(tmp_path / "c") as cache:
        assert cache.directory == cache.path == str(tmp_path / "c")
        with pytest.raises(AttributeError):
            cache.directory = "elsewhere"
    assert cache.directory == str(tmp_path / "c")  # after close too, as path


@pytest.mark.parametrize("name,words", [
    ("transact", ["no transact()", "atomic", "add", "incr", "threading.Lock"]),
    ("check", ["no check()", "durablekv check", "check_directory", "closed"]),
])
def test_transact_and_check_are_not_there_and_say_what_is(tmp_path, name, words):
    with opened(tmp_path / "c") as cache:
        assert not hasattr(cache, name)
        with pytest.raises(AttributeError) as info:
            getattr(cache, name)()
        for w in words:
            assert w in str(info.value), (w, str(info.value))
        with pytest.raises(AttributeError, match="has no attribute 'nonesuch'"):
            cache.nonesuch  # anything else: Python's own error


def test_fanout_cache_says_to_use_sharded_cache():
    import durablekv
    with pytest.raises(AttributeError) as info:
        durablekv.FanoutCache
    msg = str(info.value)
    assert "ShardedCache(directory, shards=8)" in msg and "FanoutCache" in msg, msg
    # probes of the module stay quiet: hasattr and getattr with a default
    assert not hasattr(durablekv, "FanoutCache")
    assert getattr(durablekv, "FanoutCache", None) is None
    with pytest.raises(ImportError, match="FanoutCache"):
        from durablekv import FanoutCache  # noqa: F401
    with pytest.raises(AttributeError, match="has no attribute 'Nonesuch'"):
        durablekv.Nonesuch
    assert "FanoutCache" not in durablekv.__all__


def test_the_diskcache_page_lists_each_habit_with_the_durablekv_way():
    """docs/diskcache.md: each habit a newcomer tried, in the habit column."""
    from .conftest import REPO
    text = (REPO / "docs" / "diskcache.md").read_text(encoding="utf-8")
    habits = [line.split("|")[1] for line in text.splitlines()
              if line.startswith("| `")]
    for habit in ("get(key, read=True)", "expire_time=True", "memoize(typed=True)",
                  "transact()", "check()", "FanoutCache", "expire(key, seconds)",
                  "stats(enable=True)", "memoize(name)", "timeout=", "cache.directory", "~"):
        assert any(habit in h for h in habits), habit


def test_stats_unpacks_as_diskcache_hits_and_misses(tmp_path):
    with opened(tmp_path / "c") as cache:
        cache.get("a")
        cache["a"] = 1
        cache.get("a")
        cache.get("a")
        hits, misses = cache.stats()  # diskcache: cache.stats() -> (hits, misses)
        assert (hits, misses) == (2, 1)
        assert cache.stats().page_faults == 0  # every other field by name


@pytest.mark.parametrize("typo, meant", [("pagesize", "page_size"), ("max_page", "max_pages"),
                                         ("eviction_policy", "policy"),
                                         ("flushinterval", "flush_interval")])
def test_a_misspelled_option_names_the_option_meant(tmp_path, typo, meant):
    for make in (Cache, ShardedCache):
        with pytest.raises(TypeError) as info:
            make(tmp_path / "c", **{typo: 4})
        msg = str(info.value)
        assert f"unexpected keyword argument {typo!r} (did you mean {meant}?)" in msg
        assert "page_size" in msg and "size_limit" in msg  # the options there are
    assert not (tmp_path / "c").exists()  # refused before anything is made


def test_an_unknown_option_lists_the_options(tmp_path):
    with pytest.raises(TypeError) as info:
        Cache(tmp_path / "c", frobnicate=True)
    assert "'frobnicate'; its options are busy_timeout, clock," in str(info.value)


def test_a_max_pages_beyond_memory_is_refused(tmp_path):
    with pytest.raises(ConfigError) as info:
        Cache(tmp_path / "c", max_pages=10**12)
    msg = str(info.value)
    assert "max_pages=1000000000000" in msg and "GiB of memory" in msg
    assert "max_memory_bytes=" in msg
    assert not (tmp_path / "c").exists()
    # bounded in bytes, a large max_pages only means "no bound in pages"
    with opened(tmp_path / "c", max_pages=10**12, max_memory_bytes=1 << 20) as cache:
        cache["a"] = 1


@pytest.mark.parametrize("name, says", [("cull", "size_limit="), ("iterkeys", "cache.keys()"),
                                        ("has_key", "key in cache")])
def test_methods_of_diskcache_point_to_the_durablekv_equivalent(tmp_path, name, says):
    with opened(tmp_path / "c") as cache:
        with pytest.raises(AttributeError) as info:
            getattr(cache, name)()
        assert says in str(info.value) and f"no {name}()" in str(info.value)
        assert not hasattr(cache, name)  # hasattr() and getattr(x, n, None) still work
    with ShardedCache(tmp_path / "s", shards=2) as sharded:
        with pytest.raises(AttributeError, match=says.replace("(", r"\(").replace(")", r"\)")):
            getattr(sharded, name)()


def test_a_numpy_key_or_value_names_the_conversion(tmp_path):
    np = pytest.importorskip("numpy", reason="numpy comes with the llm extra (in .[test]); "
                             "the test passes NumPy scalars")
    with opened(tmp_path / "c") as cache:
        with pytest.raises(TypeError) as info:
            cache[np.int64(3)] = 1
        assert "NumPy scalar" in str(info.value) and "int(x)" in str(info.value)
        with pytest.raises(TypeError) as info:
            cache["a"] = np.float32(1.5)
        assert "x.item()" in str(info.value)
        cache[int(np.int64(3))] = 1
        assert cache[3] == 1
