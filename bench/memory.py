"""Memory: bytes per resident entry, measured with tracemalloc.

Each implementation runs in its own subprocess (``python -m bench.memory
IMPL N``). The keys (16-byte ``str``) and the values (distinct 100-byte
``bytes`` objects) are created *before* tracing starts and are held by the
caller, so what is counted is the structure's own overhead per entry: hash
table slots, per-entry tuples or nodes, pages, LRU links. For durablekv the
empty cache is opened before the baseline (its fixed cost is not per entry),
every key is resident (``max_pages`` large enough), and the count is taken
after ``flush()`` (no dirty page snapshots alive). ``durablekv-ps16-overwritten``
then overwrites every key once more (values of the same size): an entry's
first overwrite turns its page-table entry from a tuple into a list, which
costs more, so both states are reported. tracemalloc sees Python's
allocator only: SQLite's own page cache (C malloc, at most a few MiB) is
not counted, which is why the peak RSS of the sustained case is reported too.
"""

from __future__ import annotations

import gc
import importlib.util
import json
import math
import os
import subprocess
import sys
import tempfile
import tracemalloc
from typing import Any

from .util import REPO, Settings, note, summarize

IMPLS = ("dict", "odict-lru", "cachetools", "durablekv-ps16", "durablekv-ps16-overwritten",
         "durablekv-ps1")
NAMES = {"dict": "dict", "odict-lru": "OrderedDict LRU", "cachetools": "cachetools.LRUCache",
         "durablekv-ps16": "durablekv (page_size=16)",
         "durablekv-ps16-overwritten": "durablekv (page_size=16, every key overwritten once)",
         "durablekv-ps1": "durablekv (page_size=1)"}


def measure(impl: str, n: int) -> dict[str, Any]:
    keys = [f"m:{i:014d}" for i in range(n)]
    values = [os.urandom(100) for _ in range(n)]
    # the overwrite's values exist before tracing too, and replace equal-sized ones
    again = [os.urandom(100) for _ in range(n)] if impl.endswith("-overwritten") else None
    tmp = None
    holder: Any = None
    if impl.startswith("durablekv"):
        from durablekv import Cache
        ps = int(impl.split("-")[1][2:])
        tmp = tempfile.mkdtemp(prefix="durablekv-mem-")
        holder = Cache(tmp, page_size=ps, max_pages=math.ceil(n / ps) + 4)
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    if impl == "dict":
        holder = d = {}
        for k, v in zip(keys, values):
            d[k] = v
    elif impl == "odict-lru":
        from .impls import _ODLRU
        holder = _ODLRU(n)
        s = holder.set
        for k, v in zip(keys, values):
            s(k, v)
    elif impl == "cachetools":
        import cachetools
        holder = c = cachetools.LRUCache(maxsize=n)
        for k, v in zip(keys, values):
            c[k] = v
    else:
        s = holder.set
        for k, v in zip(keys, values):
            s(k, v)
        if again is not None:
            for k, v in zip(keys, again):
                s(k, v)
            values = again  # the caller still holds every value the cache holds
        holder.flush()
    gc.collect()
    current, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    out = {"impl": impl, "entries": n, "bytes": current - base, "peak_bytes": peak - base,
           "bytes_per_entry": (current - base) / n}
    if tmp is not None:
        st = holder.stats()
        out["resident_pages"] = st.resident_pages
        holder.close()
        import shutil
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def run(cfg: Settings) -> list[dict[str, Any]]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    rows = []
    for impl in IMPLS:
        if impl == "cachetools" and importlib.util.find_spec("cachetools") is None:
            note("memory: cachetools is not installed; skipped")
            continue
        samples = []
        for _r in range(min(cfg.slow_repeat, 2)):
            proc = subprocess.run([sys.executable, "-m", "bench.memory", impl,
                                   str(cfg.memory_entries)], capture_output=True, text=True,
                                  env=env, cwd=str(REPO), timeout=600)
            if proc.returncode != 0:
                raise RuntimeError(f"memory {impl} failed:\n{proc.stderr[-2000:]}")
            samples.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        per = [s["bytes_per_entry"] for s in samples]
        rows.append({"case": "bytes_per_entry", "impl": impl, "name": NAMES[impl],
                     "entries": cfg.memory_entries, "unit": "bytes/entry", **summarize(per),
                     "runs": samples})
        note(f"memory: {NAMES[impl]}: {per[0]:.0f} bytes per entry")
    return rows


if __name__ == "__main__":
    print(json.dumps(measure(sys.argv[1], int(sys.argv[2]))))
