"""Spilled KV blocks survive kill -9 of a real process, bit-exact."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest

from durablekv import Cache
from durablekv.llm.hashing import block_hashes
from durablekv.llm.kvstore import KVBlockStore

from .crash_model import BLOCK_SIZE, make_model, run_then_kill

WORKER = Path(__file__).with_name("kv_crash_worker.py")


def spill_then_kill(directory: Path, min_spills: int, seed: int) -> dict[bytes, str]:
    """Start the worker, SIGKILL it at a random moment after ``min_spills``
    acknowledged spills; return {block hash: sha256 of its bytes}."""
    lines = run_then_kill(WORKER, directory, min_spills, seed, 20)
    return {bytes.fromhex(h): digest for _, h, digest in lines}


@pytest.mark.parametrize("seed", [0, 1])
def test_spilled_blocks_survive_sigkill(tmp_path, seed):
    directory = tmp_path / "kv"
    acked = spill_then_kill(directory, 12, seed)
    with Cache(directory) as cache:                     # recovery replays the log
        store = KVBlockStore(cache, on_corrupt="raise")
        for h, digest in acked.items():
            kv = store.get(h)
            assert kv is not None, h.hex()
            assert hashlib.sha256(kv.tobytes()).hexdigest() == digest
        # and a fresh pool finds them through a prefix match
        model = make_model()
        pool = model.make_pool(12, BLOCK_SIZE, store=store)
        matched = 0
        for system in range(4):
            tokens = [system] * 8 + [1]                  # the worker's system prompts
            hashes = block_hashes(tokens, BLOCK_SIZE, model.fingerprint)
            n = store.match_prefix(hashes)
            leading = 0
            while leading < len(hashes) and hashes[leading] in acked:
                leading += 1
            assert n >= leading                          # every acknowledged spill is there
            m = pool.add_sequence(("probe", system), tokens)
            assert m.durable_tokens == n * BLOCK_SIZE
            for i in range(n):
                block = pool.block_tables[("probe", system)][i]
                got = hashlib.sha256(np.ascontiguousarray(pool.kv[:, :, block]).tobytes())
                assert got.hexdigest() == hashlib.sha256(store.get(hashes[i]).tobytes()).hexdigest()
                if hashes[i] in acked:
                    assert got.hexdigest() == acked[hashes[i]]
            matched += m.durable_tokens
        assert matched > 0
