"""Worker for the block-file crash test (run as a script, killed with SIGKILL).

Usage: python kv_file_crash_worker.py DIR

Puts 256 KiB blocks (random float32, seeded by their number) through a
KVBlockStore whose ``file_block_bytes`` sends them to files, forever, over a
Cache at DIR (durability "log"). After each put returns it prints, unbuffered,
``P <block number>``; the parent kills it at a random moment.
"""

from __future__ import annotations

import os
import sys

import numpy as np

from durablekv import Cache
from durablekv.llm.hashing import block_hashes
from durablekv.llm.kvstore import KVBlockStore

BLOCK_FLOATS = 1 << 16          # 256 KiB of float32
HASHES = block_hashes(range(4096), 1, "file-crash")


def block(i: int) -> np.ndarray:
    return np.random.default_rng(i).standard_normal(BLOCK_FLOATS).astype(np.float32)


def main() -> None:
    store = KVBlockStore(Cache(sys.argv[1], durability="log"), file_block_bytes=1 << 16)
    i = 0
    while True:
        store.put(HASHES[i % len(HASHES)], block(i % len(HASHES)))
        os.write(1, f"P {i % len(HASHES)}\n".encode())
        i += 1


if __name__ == "__main__":
    main()
