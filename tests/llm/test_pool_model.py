"""Random operation sequences keep the block pool's bookkeeping consistent and
the KV a sequence reads equal to what it wrote (hypothesis)."""

from __future__ import annotations

from collections import Counter

import numpy as np
from hypothesis import given, settings, strategies as st

from durablekv.llm.pool import BlockPool

BS = 2


def check_invariants(pool: BlockPool) -> None:
    held = Counter(b for table in pool.block_tables.values() for b in table)
    free = list(pool._free)
    cached = list(pool._cached_free)
    for block in range(pool.num_blocks):
        assert pool.ref_count[block] == held[block], block
    assert len(set(free)) == len(free) and len(set(cached)) == len(cached)
    assert not set(free) & set(cached)
    assert not (set(free) | set(cached)) & set(held)
    assert len(free) + len(cached) + len(held) == pool.num_blocks
    for h, block in pool.prefix_index.items():
        assert pool.block_hash[block] == h
    for block in cached:
        assert pool.block_hash[block] is not None
    for block in free:
        assert pool.block_hash[block] is None


@settings(max_examples=60, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["add", "grow", "free", "fork"]),
                              st.integers(0, 11), st.integers(1, 9), st.integers(0, 2)),
                    max_size=60))
def test_random_operations(ops):
    run_ops(ops)


def test_the_operations_reach_copy_on_write_and_eviction():
    import random

    rng = random.Random(0)
    totals = Counter()
    for _ in range(200):
        ops = [(rng.choice(["add", "grow", "free", "fork"]), rng.randrange(12),
                rng.randrange(1, 10), rng.randrange(3)) for _ in range(40)]
        stats = run_ops(ops).stats()
        totals.update(cow=stats.cow_copies, evictions=stats.evictions,
                      hits=stats.prefix_hits_memory_tokens)
    assert totals["cow"] and totals["evictions"] and totals["hits"]


def run_ops(ops) -> BlockPool:
    pool = BlockPool(10, BS, num_layers=1, num_kv_heads=1, head_dim=1, dtype=np.float64)
    tokens: dict[int, list[int]] = {}
    computed: dict[int, int] = {}

    def write(sid: int, start: int, stop: int) -> None:
        blk, off = pool.slots(sid, start, stop)
        pool.kv[0, 0, blk, off, 0, 0] = tokens[sid][start:stop]
        pool.commit(sid, tokens[sid], stop)
        computed[sid] = stop

    for op, sid, n, vocab in ops:
        if op == "add" and sid not in tokens:
            toks = [(sid * 7 + i) % (vocab + 2) for i in range(n)]   # small vocab: shared prefixes
            m = pool.add_sequence(sid, toks)
            tokens[sid] = toks
            if pool.allocate_slots(sid, m.num_cached_tokens, n - m.num_cached_tokens):
                write(sid, m.num_cached_tokens, n)
            else:
                pool.free(sid)
                del tokens[sid]
        elif op == "grow" and sid in tokens:
            start = computed[sid]
            tokens[sid] += [(start + i) % (vocab + 2) for i in range(n)]
            if pool.allocate_slots(sid, start, n):
                write(sid, start, start + n)
            else:
                del tokens[sid][start:]
        elif op == "free" and sid in tokens:
            pool.free(sid)
            del tokens[sid], computed[sid]
        elif op == "fork" and sid in tokens:
            child = (sid + 6) % 12
            if child not in tokens:
                pool.fork(sid, child)
                tokens[child] = list(tokens[sid])
                computed[child] = computed[sid]
        check_invariants(pool)
        for s, toks in tokens.items():        # every sequence reads back its own tokens
            blk, off = pool.slots(s, 0, computed[s])
            assert pool.kv[0, 0, blk, off, 0, 0].tolist() == toks[:computed[s]], s
    return pool
