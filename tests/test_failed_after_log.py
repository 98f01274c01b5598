"""A write whose record is in the log but which memory did not take fails the cache.

Memory exhaustion (or an exception from a signal handler) can strike after a
set's record is appended and before the memory tier has the new value. The
log then holds a write that memory does not: the cache must stop (every later
call raises CacheFailedError), never log that LSN again, and a reopen must
apply the record. Injected here as a MemoryError from the batcher's kick,
which a set calls when the page it dirties fills a flush batch (and, for a
delete, from the memory tier's removal): in the C set path
(durablekv._native's hot setter) and in the pure-Python path.
"""

from __future__ import annotations

import contextlib

import pytest

import durablekv
from durablekv import Cache, CacheFailedError, _accel
from durablekv.check import check_directory

PATHS = ["c", "python"]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("op", ["overwrite", "new key", "delete"])
def test_a_memory_error_after_the_log_append_fails_the_cache(tmp_path, path, op):
    if path == "c" and not durablekv.accelerated:
        pytest.skip(f"the C kernels are not loaded ({durablekv.accelerated.reason})")
    d = tmp_path / "c"
    with (_accel.pure_kernels() if path == "python" else contextlib.nullcontext()):
        cache = Cache(d, page_size=1, flush_interval=3600, flush_batch_pages=1, warm=False)
        try:
            cache["k"] = b"old"
            cache.flush()  # every page clean: the set below dirties one, and kicks
            if path == "c" and op == "overwrite":
                assert "set" in vars(cache), "the C hot setter is not installed"
            else:
                assert path == "python" or op != "overwrite"
            last = cache.stats().last_lsn

            def out_of_memory(*args, **kwargs):
                raise MemoryError

            if op == "delete":
                cache._tier.remove = out_of_memory  # (a delete kicks no batch)
            else:
                cache._batcher.kick = out_of_memory
            with pytest.raises(MemoryError):
                if op == "overwrite":
                    cache["k"] = b"new"       # a resident entry: the hot path
                elif op == "new key":
                    cache["n"] = b"new"
                else:
                    del cache["k"]
            with pytest.raises(CacheFailedError, match="MemoryError"):
                cache["other"] = b"x"
            with pytest.raises(CacheFailedError):
                cache.delete("k")
            assert cache.stats().last_lsn == last + 1  # the logged record's LSN, used once
        finally:
            with contextlib.suppress(Exception):
                cache.close()
    # The log holds the write: a reopen applies it, and the log's LSNs run on.
    assert check_directory(str(d)).ok
    with Cache(d, warm=False) as cache:
        expected = {"overwrite": {"k": b"new"}, "new key": {"k": b"old", "n": b"new"},
                    "delete": {}}[op]
        assert dict(cache.items()) == expected
        cache["after"] = b"1"
    with Cache(d, warm=False) as cache:
        assert cache["after"] == b"1"
