"""Worker for the KV crash test (run as a script, killed with SIGKILL).

Usage: python kv_crash_worker.py DIR

Runs chats through a small block pool over a KVBlockStore in a Cache at DIR
(durability "log"), forever, so cached blocks are evicted and spilled all
the time. After each spill's put() returns it prints, unbuffered,

    S <block hash hex> <sha256 hex of the block's bytes>

and the parent kills it at a random moment.
"""

from __future__ import annotations

import hashlib
import os
import sys

import numpy as np

from durablekv import Cache
from durablekv.llm.engine import LLMEngine
from durablekv.llm.kvstore import KVBlockStore
from durablekv.llm.scheduler import ContinuousScheduler, Request

sys.path.insert(0, os.path.dirname(__file__))
from crash_model import BLOCK_SIZE, make_model  # noqa: E402


class Announcing(KVBlockStore):
    def put(self, block_hash, kv_array):
        super().put(block_hash, kv_array)
        digest = hashlib.sha256(np.ascontiguousarray(kv_array).tobytes()).hexdigest()
        os.write(1, f"S {block_hash.hex()} {digest}\n".encode())


def main() -> None:
    cache = Cache(sys.argv[1], durability="log")
    model = make_model()
    pool = model.make_pool(12, BLOCK_SIZE, store=Announcing(cache))
    engine = LLMEngine(model, pool, ContinuousScheduler(pool, max_num_seqs=3))
    rng = np.random.default_rng(0)
    i = 0
    while True:
        system = [int(rng.integers(0, 4))] * 8          # four shared 8-token system prompts
        engine.generate([Request(i, system + rng.integers(0, 64, 6).tolist(), 6)])
        i += 1


if __name__ == "__main__":
    main()
