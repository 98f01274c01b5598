"""An engine killed with SIGKILL mid-workload: the next process reuses its prompts' blocks.

Full blocks are written to the durable tier as they fill (BlockPool's
write_through), so after a kill -9 a new engine process recomputes, for
every prompt whose blocks were written, only the partial last block and the
last token; before, blocks reached the store only when evicted, and a
prefix's head died in memory with the process (docs/llm.md, "The durable
tier", states the bound).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from durablekv import Cache
from durablekv.llm.engine import LLMEngine
from durablekv.llm.kvstore import KVBlockStore
from durablekv.llm.scheduler import ContinuousScheduler, Request

from .crash_model import BLOCK_SIZE, make_model, run_then_kill

WORKER = Path(__file__).with_name("engine_crash_worker.py")


@pytest.mark.parametrize("seed", [0, 1])
def test_a_killed_engine_leaves_every_written_prompt_block_to_the_next_process(tmp_path, seed):
    directory = tmp_path / "kv"
    lines = run_then_kill(WORKER, directory, 8, seed, 6)  # killed mid-request
    prompts = [[int(t) for t in prompt.split(",")] for _, _rid, prompt in lines]
    model = make_model()
    with Cache(directory) as cache:
        pool = model.make_pool(256, BLOCK_SIZE, store=KVBlockStore(cache))
        engine = LLMEngine(model, pool, ContinuousScheduler(pool, max_num_seqs=1))
        before = model.tokens_computed
        seqs = engine.generate([Request(i, p, 1) for i, p in enumerate(prompts)])
        full = [(len(p) - 1) // BLOCK_SIZE * BLOCK_SIZE for p in prompts]
        # every full block of every reported prompt came back (from the
        # store, or from memory once an earlier prompt loaded it): only the
        # partial last block (and the last token) was computed again
        assert [s.cached_tokens_memory + s.cached_tokens_durable for s in seqs] == full
        assert sum(s.cached_tokens_durable for s in seqs) >= 5 * BLOCK_SIZE
        assert model.tokens_computed - before == sum(len(p) - f for p, f in zip(prompts, full))
