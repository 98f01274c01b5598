"""Large KV blocks: KVBlockStore put/get of 2 and 8 MiB blocks beside one file per block.

A Llama-3-8B-sized KV page (all layers, K and V, 16 tokens, bf16) is several
MiB. This writes the same blocks (random float32 bytes) through

* ``durablekv``: ``KVBlockStore(Cache(dir, durability=...)).put`` of each
  block, then ``cache.flush()``, and reads them back after a reopen. Blocks of
  1 MiB or more go to a file each, written once, with a 25-byte reference in
  the Cache (the default, ``file_block_bytes="auto"``);
* ``in_cache``: the same with ``file_block_bytes=None``, every block a Cache
  value (every byte to the replay log, then to SQLite's WAL and main file):
  the path before block files, measured in the same run;
* ``file``: one file per block (``open``/``write`` of the array's own
  buffer/``close``; with
  ``durability="fsync"`` also an ``fsync`` per file and one of the
  directory), read back with ``open``/``read`` (the physical floor here: the
  page cache and the disk, no format, no index);

alternating, round by round (the machine is shared: ratios from one run),
and reports MB/s median (min..max) and the put ratio durablekv / file.

    python -m bench.llm_blocks [--rounds 5] [--json OUT] [--markdown OUT]
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from durablekv import Cache
from durablekv.llm.hashing import block_hashes
from durablekv.llm.kvstore import KVBlockStore

from .util import rounds_main, span, summarize

MIB = 1 << 20
#: (block bytes, blocks per round): 64 MiB a round either way
CASES = ((2 * MIB, 32), (8 * MIB, 8))


def _blocks(size: int, count: int, seed: int) -> list[tuple[bytes, np.ndarray]]:
    rng = np.random.default_rng(seed)
    hashes = block_hashes(list(range(count * 16)), 16, f"bench-{size}")
    return [(h, rng.standard_normal(size // 4).astype(np.float32)) for h in hashes]


def _durablekv(root: Path, blocks: list, durability: str,
               file_block_bytes: Any = "auto") -> tuple[float, float, int]:
    d = root / "kv"
    with Cache(d, durability=durability, max_value_bytes=64 * MIB, warm=False) as cache:
        store = KVBlockStore(cache, file_block_bytes=file_block_bytes)
        t0 = time.perf_counter()    # the puts and the flush; not the open (once a process)
        for h, kv in blocks:
            store.put(h, kv)
        cache.flush()
        put = time.perf_counter() - t0
    size = sum(f.stat().st_size for f in d.rglob("*") if f.is_file())
    with Cache(d, durability=durability, max_value_bytes=64 * MIB, warm=False) as cache:
        store = KVBlockStore(cache, file_block_bytes=file_block_bytes)
        t0 = time.perf_counter()
        for h, kv in blocks:
            got = store.get(h)
            assert got is not None and got.nbytes == kv.nbytes
        get = time.perf_counter() - t0
    shutil.rmtree(d)
    return put, get, size


def _files(root: Path, blocks: list, durability: str) -> tuple[float, float, int]:
    d = root / "files"
    d.mkdir()
    t0 = time.perf_counter()
    for h, kv in blocks:
        fd = os.open(d / h.hex(), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            view = memoryview(kv).cast("B")    # no copy: the floor at its fastest
            while view:
                view = view[os.write(fd, view):]
            if durability == "fsync":
                os.fsync(fd)
        finally:
            os.close(fd)
    if durability == "fsync":
        dfd = os.open(d, os.O_RDONLY)
        os.fsync(dfd)
        os.close(dfd)
    put = time.perf_counter() - t0
    size = sum(f.stat().st_size for f in d.iterdir())
    t0 = time.perf_counter()
    for h, kv in blocks:
        with open(d / h.hex(), "rb") as f:
            got = np.frombuffer(f.read(), dtype=np.float32)
        assert got.nbytes == kv.nbytes
    get = time.perf_counter() - t0
    shutil.rmtree(d)
    return put, get, size


IMPLS = ("durablekv", "in_cache", "file")


def run(rounds: int, durabilities: tuple[str, ...] = ("log", "fsync"),
        tmpdir: str | None = None) -> list[dict[str, Any]]:
    rows = []
    fns = {"durablekv": _durablekv, "file": _files,
           "in_cache": lambda root, blocks, d: _durablekv(root, blocks, d, None)}
    for size, count in CASES:
        blocks = _blocks(size, count, size)
        total = size * count
        for durability in durabilities:
            samples: dict[str, dict[str, list[float]]] = {
                impl: {"put": [], "get": [], "ratio": []} for impl in IMPLS}
            disk: dict[str, int] = {}
            for r in range(rounds):
                order = IMPLS[r % 3:] + IMPLS[:r % 3]      # each goes first in turn
                got = {}
                for impl in order:
                    root = Path(tempfile.mkdtemp(prefix="llm-blocks-", dir=tmpdir))
                    try:
                        got[impl] = fns[impl](root, blocks, durability)
                    finally:
                        shutil.rmtree(root, ignore_errors=True)
                for impl, (put, get, nbytes) in got.items():
                    samples[impl]["put"].append(total / MIB / put)
                    samples[impl]["get"].append(total / MIB / get)
                    samples[impl]["ratio"].append(got["file"][0] / put)
                    disk[impl] = nbytes
                print(f"[llm_blocks] {_size(size)} x {count} {durability} round {r + 1}: put MB/s "
                      + ", ".join(f"{i} {samples[i]['put'][-1]:.0f}" for i in IMPLS),
                      file=sys.stderr, flush=True)
            row: dict[str, Any] = {"block_bytes": size, "blocks": count, "durability": durability}
            for impl in IMPLS:
                row[f"{impl}_put_mb_s"] = summarize(samples[impl]["put"])
                row[f"{impl}_get_mb_s"] = summarize(samples[impl]["get"])
                row[f"{impl}_disk_bytes"] = disk[impl]
                if impl != "file":
                    row[f"{impl}_put_ratio"] = summarize(samples[impl]["ratio"])
            rows.append(row)
    return rows


def _size(n: int) -> str:
    return f"{n // MIB} MiB" if n % MIB == 0 else f"{n >> 10} KiB"


def markdown(rows: list[dict[str, Any]], rounds: int) -> str:
    out = [f"`python -m bench.llm_blocks --rounds {rounds}`: MB/s, median (min..max) of "
           f"{rounds} rounds, each implementation first in turn; put includes the flush "
           "to SQLite (durablekv; not the Cache's open) or the fsyncs (file, `fsync` rows); "
           "get is after a reopen. `durablekv`: block files (the default for blocks of 1 MiB and more); "
           "`in cache`: every block a Cache value, as before block files.", "",
           "| block | durability | durablekv put | in cache put | file put | "
           "put ratio durablekv / file (goal >= 0.5) | in cache / file | durablekv get | "
           "in cache get | file get | bytes on disk / file's |",
           "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        out.append(
            f"| {_size(r['block_bytes'])} x {r['blocks']} | {r['durability']} | "
            f"{span(r['durablekv_put_mb_s'])} | {span(r['in_cache_put_mb_s'])} | "
            f"{span(r['file_put_mb_s'])} | {span(r['durablekv_put_ratio'], 2)} | "
            f"{span(r['in_cache_put_ratio'], 2)} | {span(r['durablekv_get_mb_s'])} | "
            f"{span(r['in_cache_get_mb_s'])} | {span(r['file_get_mb_s'])} | "
            f"{r['durablekv_disk_bytes'] / r['file_disk_bytes']:.2f}x / "
            f"{r['in_cache_disk_bytes'] / r['file_disk_bytes']:.2f}x |")
    return "\n".join(out) + "\n"


def _durability_option(ap):
    ap.add_argument("--durability", action="append", choices=("log", "fsync"))
    return lambda args: {"durabilities": tuple(args.durability or ("log", "fsync"))}


def main() -> None:
    rounds_main(__doc__, run, markdown, _durability_option)


if __name__ == "__main__":
    main()
