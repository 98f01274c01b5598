"""An engine killed with SIGKILL mid-workload: the next process reuses its prompts' blocks.

Full blocks are written to the durable tier as they fill (BlockPool's
write_through), so after a kill -9 a new engine process recomputes, for
every prompt whose blocks were written, only the partial last block and the
last token; before, blocks reached the store only when evicted, and a
prefix's head died in memory with the process (docs/llm.md, "The durable
tier", states the bound).
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from durablekv import Cache
from durablekv.llm.engine import LLMEngine
from durablekv.llm.kvstore import KVBlockStore
from durablekv.llm.scheduler import ContinuousScheduler, Request

from .crash_model import BLOCK_SIZE, make_model

WORKER = Path(__file__).with_name("engine_crash_worker.py")
REPO = Path(__file__).resolve().parents[2]


def run_then_kill(directory: Path, min_done: int, seed: int) -> list[list[int]]:
    """Start the worker, SIGKILL it at a random moment after ``min_done``
    requests are reported written; return their prompts."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.Popen([sys.executable, str(WORKER), str(directory)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    done: list[list[int]] = []
    extra = random.Random(seed).randrange(0, 6)
    deadline = time.monotonic() + 60
    watchdog = threading.Timer(90, proc.kill)        # a silent worker cannot hang the test
    watchdog.start()
    try:
        while len(done) < min_done + extra:
            assert time.monotonic() < deadline, "the worker finished too few requests in 60 s"
            line = proc.stdout.readline().decode()
            if not line:
                pytest.fail(f"the worker exited early: {proc.stderr.read().decode()[-2000:]}")
            _, _rid, prompt = line.split()
            done.append([int(t) for t in prompt.split(",")])
    finally:
        watchdog.cancel()
        proc.send_signal(signal.SIGKILL)             # mid-workload: the next request runs
        proc.wait(timeout=30)
        proc.stdout.close()
        proc.stderr.close()
    assert proc.returncode == -signal.SIGKILL
    return done


@pytest.mark.parametrize("seed", [0, 1])
def test_a_killed_engine_leaves_every_written_prompt_block_to_the_next_process(tmp_path, seed):
    directory = tmp_path / "kv"
    prompts = run_then_kill(directory, 8, seed)
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
