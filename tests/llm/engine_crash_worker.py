"""Worker for the engine kill test (run as a script, killed with SIGKILL).

Usage: python engine_crash_worker.py DIR

Serves chats forever with the TinyTransformer engine over a block pool whose
durable tier is a KVBlockStore in a Cache at DIR (durability "log"; the
pool's default write_through="async"). Four shared 8-token system prompts,
a 14-token user part each: 22-token prompts, 5 full blocks of 4. After each
request finishes and the writer's queue is written (flush_writes), it
prints, unbuffered,

    D <request id> <prompt token ids, comma-separated>

and the parent kills it at a random moment. With write_through="evict" (the
old behaviour) the same test fails: the blocks of the latest prompts are
still in memory, unevicted, when the process dies.
"""

from __future__ import annotations

import os
import sys

import numpy as np

from durablekv import Cache
from durablekv.llm.engine import LLMEngine
from durablekv.llm.kvstore import KVBlockStore
from durablekv.llm.scheduler import ContinuousScheduler, Request

sys.path.insert(0, os.path.dirname(__file__))
from crash_model import BLOCK_SIZE, make_model  # noqa: E402


def main() -> None:
    cache = Cache(sys.argv[1], durability="log")
    model = make_model()
    pool = model.make_pool(64, BLOCK_SIZE, store=KVBlockStore(cache))
    engine = LLMEngine(model, pool, ContinuousScheduler(pool, max_num_seqs=3))
    rng = np.random.default_rng(0)
    i = 0
    while True:
        prompt = [int(rng.integers(0, 4))] * 8 + rng.integers(0, 64, 14).tolist()
        engine.generate([Request(i, prompt, 3)])
        pool.flush_writes()
        os.write(1, f"D {i} {','.join(map(str, prompt))}\n".encode())
        i += 1


if __name__ == "__main__":
    main()
