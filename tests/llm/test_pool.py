"""BlockPool: free list, ref counts, prefix sharing, copy-on-write, LRU eviction, spill tier."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from durablekv import Cache, ConfigError
from durablekv.llm.hashing import block_hashes
from durablekv.llm.kvstore import KVBlockCorruptWarning, KVBlockStore, encode_block
from durablekv.llm.pool import BlockPool

BS = 4


def make_pool(num_blocks=8, **kw):
    return BlockPool(num_blocks, BS, num_layers=2, num_kv_heads=1, head_dim=2,
                     dtype=np.float64, **kw)


def fill(pool, seq_id, tokens, start=0):
    """Allocate and write tokens ``start..``; each token's K/V is its id (so
    contents are checkable), then commit the full blocks."""
    assert pool.allocate_slots(seq_id, start, len(tokens) - start)
    blk, off = pool.slots(seq_id, start, len(tokens))
    pool.kv[:, :, blk, off] = np.asarray(tokens[start:], dtype=np.float64)[:, None, None]
    pool.commit(seq_id, tokens, len(tokens))


def contents(pool, seq_id, n):
    blk, off = pool.slots(seq_id, 0, n)
    return pool.kv[0, 0, blk, off, 0, 0].tolist()


def test_layout_and_views():
    pool = make_pool()
    assert pool.kv.shape == (2, 2, 8, BS, 1, 2)
    assert pool.key_cache(1).shape == (8, BS, 1, 2)
    assert np.shares_memory(pool.key_cache(1), pool.kv)
    assert pool.block_shape == (2, 2, BS, 1, 2)


def test_allocate_and_free_keep_ref_counts():
    pool = make_pool(enable_prefix_caching=False)
    pool.add_sequence("a", list(range(10)))
    assert pool.allocate_slots("a", 0, 10)
    assert len(pool.block_tables["a"]) == 3 and pool.num_free_blocks == 5
    assert all(pool.ref_count[b] == 1 for b in pool.block_tables["a"])
    assert not pool.allocate_slots("a", 10, 40)         # all or nothing
    assert len(pool.block_tables["a"]) == 3
    pool.free("a")
    assert pool.num_free_blocks == 8 and sum(pool.ref_count) == 0
    pool.add_sequence("b", [1])
    with pytest.raises(ValueError, match="already has a block table"):
        pool.add_sequence("b", [1])


def test_full_prefix_blocks_are_shared():
    pool = make_pool()
    prompt = list(range(100, 110))                       # 2 full blocks + 2 tokens
    pool.add_sequence("a", prompt)
    fill(pool, "a", prompt)
    m = pool.add_sequence("b", prompt[:8] + [1, 2, 3])
    assert m.num_cached_tokens == 8 and m.memory_tokens == 8 and m.durable_tokens == 0
    ta, tb = pool.block_tables["a"], pool.block_tables["b"]
    assert tb == ta[:2]
    assert [pool.ref_count[b] for b in ta] == [2, 2, 1]
    fill(pool, "b", prompt[:8] + [1, 2, 3], start=8)
    assert contents(pool, "b", 11) == prompt[:8] + [1, 2, 3]
    assert contents(pool, "a", 10) == prompt


def test_last_prompt_token_is_always_computed():
    pool = make_pool()
    prompt = list(range(8))
    pool.add_sequence("a", prompt)
    fill(pool, "a", prompt)
    pool.free("a")
    assert pool.add_sequence("b", prompt).num_cached_tokens == 4   # not 8
    assert pool.add_sequence("c", prompt + [9]).num_cached_tokens == 8


def test_partial_block_is_never_shared_through_the_index():
    pool = make_pool()
    pool.add_sequence("a", list(range(6)))
    fill(pool, "a", list(range(6)))
    assert len(pool.cached_blocks()) == 1


def test_copy_on_write_of_a_shared_partial_block():
    pool = make_pool()
    tokens = [1, 2, 3, 4, 5, 6]
    pool.add_sequence("a", tokens)
    fill(pool, "a", tokens)
    pool.fork("a", "b")
    last = pool.block_tables["a"][1]
    assert pool.ref_count[last] == 2
    fill(pool, "b", tokens + [70], start=6)              # b writes into the shared block
    assert pool.block_tables["b"][1] != last and pool.block_tables["b"][0] == pool.block_tables["a"][0]
    assert pool.ref_count[last] == 1 and pool.stats().cow_copies == 1
    fill(pool, "a", tokens + [80], start=6)              # a now owns it alone: no copy
    assert pool.block_tables["a"][1] == last and pool.stats().cow_copies == 1
    assert contents(pool, "a", 7) == tokens + [80]
    assert contents(pool, "b", 7) == tokens + [70]


def test_eviction_is_lru_and_a_finished_sequence_tail_first():
    pool = make_pool(num_blocks=6)
    seqs = {"old": list(range(0, 8)) + [99], "new": list(range(50, 58)) + [99]}
    for name, toks in seqs.items():                       # 2 full blocks + 1 token each
        pool.add_sequence(name, toks)
        fill(pool, name, toks)
    hashes = {n: block_hashes(t, BS, pool.extra) for n, t in seqs.items()}
    pool.free("old")
    pool.free("new")
    assert pool.num_free_blocks == 6 and len(pool.cached_blocks()) == 4
    order = []
    pool.add_sequence("x", list(range(200, 240)))
    for i in range(6):                                    # 2 free blocks first, then evictions
        before = set(pool.cached_blocks())
        assert pool.allocate_slots("x", 0, (i + 1) * BS)
        order += [h for h in before - set(pool.cached_blocks())]
    assert order == [hashes["old"][1], hashes["old"][0], hashes["new"][1], hashes["new"][0]]
    assert pool.stats().evictions == 4


def test_a_prefix_hit_refreshes_recency():
    pool = make_pool(num_blocks=4)
    a, b = list(range(0, 4)) + [9], list(range(10, 14)) + [9]
    for name, toks in (("a", a), ("b", b)):
        pool.add_sequence(name, toks)
        fill(pool, name, toks)
        pool.free(name)
    pool.add_sequence("a2", a)                            # touches a's block: now the newest
    pool.free("a2")
    pool.add_sequence("x", list(range(100, 116)))
    assert pool.allocate_slots("x", 0, 3 * BS)            # 2 free + 1 eviction
    assert block_hashes(a, BS, pool.extra)[0] in pool.cached_blocks()
    assert block_hashes(b, BS, pool.extra)[0] not in pool.cached_blocks()


def test_prefix_caching_off_shares_nothing():
    pool = make_pool(enable_prefix_caching=False)
    pool.add_sequence("a", list(range(9)))
    fill(pool, "a", list(range(9)))
    pool.free("a")
    assert pool.add_sequence("b", list(range(9))).num_cached_tokens == 0
    assert pool.cached_blocks() == {}


def run_and_evict(pool, tokens):
    pool.add_sequence("a", tokens)
    fill(pool, "a", tokens)
    pool.free("a")
    pool.add_sequence("evictor", list(range(1000, 1000 + pool.num_blocks * BS)))
    assert pool.allocate_slots("evictor", 0, pool.num_blocks * BS)
    pool.free("evictor")


def test_evicted_blocks_spill_and_come_back_from_the_store(tmp_path):
    tokens = list(range(300, 313))                        # 3 full blocks + 1
    with Cache(tmp_path / "kv") as cache:
        store = KVBlockStore(cache)
        pool = make_pool(num_blocks=4, store=store, write_through="evict")
        run_and_evict(pool, tokens)
        assert pool.cached_blocks() == {} or all(
            h not in pool.cached_blocks() for h in block_hashes(tokens, BS, pool.extra))
        assert store.match_prefix(block_hashes(tokens, BS, pool.extra)) == 3
        m = pool.add_sequence("b", tokens)
        assert (m.memory_tokens, m.durable_tokens) == (0, 12)
        assert contents(pool, "b", 12) == tokens[:12]
        s = pool.stats()
        assert s.prefix_hits_durable_tokens == 12 and s.spilled_blocks >= 3


def test_durable_blocks_after_restart_are_bit_exact(tmp_path):
    tokens = list(range(300, 313))
    rng = np.random.default_rng(5)
    with Cache(tmp_path / "kv") as cache:
        pool = make_pool(num_blocks=4, store=KVBlockStore(cache), write_through="evict")
        pool.add_sequence("a", tokens)
        assert pool.allocate_slots("a", 0, 13)
        pool.kv[...] = rng.standard_normal(pool.kv.shape)
        pool.commit("a", tokens, 13)
        before = {h: pool.kv[:, :, b].copy() for h, b in pool.cached_blocks().items()}
        pool.free("a")
        assert pool.spill_cached() == 3                   # graceful shutdown
    with Cache(tmp_path / "kv") as cache:
        store = KVBlockStore(cache)
        fresh = make_pool(num_blocks=4, store=store)
        m = fresh.add_sequence("b", tokens)
        assert m.durable_tokens == 12
        for h, block in fresh.cached_blocks().items():
            assert fresh.kv[:, :, block].tobytes() == before[h].tobytes()


def test_damaged_or_misfit_spilled_block_is_recomputed(tmp_path):
    tokens = list(range(300, 313))
    with Cache(tmp_path / "kv") as cache:
        store = KVBlockStore(cache)
        pool = make_pool(num_blocks=4, store=store, write_through="evict")
        run_and_evict(pool, tokens)
        h = block_hashes(tokens, BS, pool.extra)
        raw = cache.get(h[1])
        cache.set(h[1], raw[:-1] + bytes([raw[-1] ^ 1]))                   # a bit flip
        cache.set(h[2], encode_block(h[2], np.zeros((2, 2, BS, 1, 3))))   # wrong shape
        fresh = make_pool(num_blocks=4, store=store)
        with pytest.warns(KVBlockCorruptWarning):
            m = fresh.add_sequence("b", tokens)
        assert m.durable_tokens == BS                     # stops before the damaged block
        fresh.free("b")
        cache.set(h[1], raw)
        other = make_pool(num_blocks=4, store=store)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a block of another layout is no damage
            m = other.add_sequence("c", tokens)
        assert m.durable_tokens == 2 * BS
        assert other.stats().layout_misses == 1
        assert h[2] in cache                 # kept for the pool whose layout it has


def test_pools_of_two_layouts_with_one_extra_keep_each_others_blocks(tmp_path):
    """Two pools share a store and an extra but not a layout (head_dim 3 and
    4): each one's blocks are misses for the other, never deleted, never
    overwritten, and each finds its own again after a restart."""
    tokens = list(range(500, 513))
    with Cache(tmp_path / "kv") as cache:
        store = KVBlockStore(cache)
        a = BlockPool(4, BS, num_layers=2, num_kv_heads=1, head_dim=3, store=store, extra="m",
                      write_through="sync")
        b = BlockPool(4, BS, num_layers=2, num_kv_heads=1, head_dim=4, store=store, extra="m",
                      write_through="sync")
        run_and_evict(a, tokens)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert b.add_sequence("x", tokens).durable_tokens == 0
        assert b.stats().layout_misses == 1
        b.free("x")
        run_and_evict(b, tokens)     # b computes its own and spills nothing over a's
        a2 = BlockPool(4, BS, num_layers=2, num_kv_heads=1, head_dim=3, store=store, extra="m",
                       write_through="sync")
        assert a2.add_sequence("y", tokens).durable_tokens == 3 * BS
        assert store.corrupt == 0


def test_a_request_extra_separates_every_block(tmp_path):
    """Per-request extra keys (a LoRA id, a cache salt) are folded into every
    block's hash, as block_hashes(tokens, bs, (pool.extra, extra)) gives them."""
    tokens = list(range(600, 613))
    pool = make_pool(num_blocks=12)
    pool.add_sequence("a", tokens)
    fill(pool, "a", tokens)
    assert pool.add_sequence("same", tokens).memory_tokens == 3 * BS
    assert pool.add_sequence("lora", tokens, extra="lora-7").num_cached_tokens == 0
    fill(pool, "lora", tokens)
    assert pool.add_sequence("lora2", tokens, extra="lora-7").memory_tokens == 3 * BS
    want = block_hashes(tokens, BS, (pool.extra, "lora-7"))
    assert [h for h in want if h in pool.cached_blocks()] == want
    assert not set(want) & set(block_hashes(tokens, BS, pool.extra))


def test_bad_configuration():
    with pytest.raises(ConfigError, match="num_blocks must be an int >= 1"):
        make_pool(num_blocks=0)
    with pytest.raises(ConfigError, match="block_size must be an int >= 1"):
        BlockPool(4, 0, num_layers=1, num_kv_heads=1, head_dim=2)
    with pytest.raises(ConfigError, match="float dtype"):
        BlockPool(4, 2, num_layers=1, num_kv_heads=1, head_dim=2, dtype=np.int32)
    with pytest.raises(ValueError, match="KV array must have shape"):
        BlockPool(4, 2, num_layers=1, num_kv_heads=1, head_dim=2, kv=np.zeros((1, 2, 4, 2, 1, 3),
                                                                               np.float32))


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_full_blocks_are_written_as_they_fill(tmp_path, mode):
    """Write-through: each full block reaches the store when its KV is
    complete, with nothing evicted; the partial last block never does."""
    tokens = list(range(700, 713))                        # 3 full blocks + 1
    with Cache(tmp_path / "kv") as cache:
        store = KVBlockStore(cache)
        pool = make_pool(num_blocks=8, store=store, write_through=mode)
        pool.add_sequence("a", tokens)
        fill(pool, "a", tokens)                           # commits the 3 full blocks
        assert pool.flush_writes(timeout=30)
        hashes = block_hashes(tokens, BS, pool.extra)
        assert store.match_prefix(hashes) == 3 and len(hashes) == 3
        s = pool.stats()
        assert s.written_blocks == 3 and s.spilled_blocks == 0 and s.evictions == 0
        assert s.write_queue == 0 and s.write_drops == 0
        assert pool.spill_cached() == 0                   # nothing left to write


def test_a_full_write_queue_drops_and_counts_instead_of_stalling(tmp_path):
    """The async writer is held up (a store whose put waits on an event): the
    engine thread queues write_queue_blocks blocks, drops the rest and counts
    them, and never waits; an eviction writes a dropped block after all."""
    import threading
    gate = threading.Event()

    class Slow(KVBlockStore):
        def put(self, block_hash, kv_array):
            assert gate.wait(30)
            super().put(block_hash, kv_array)

    tokens = list(range(800, 825))                        # 6 full blocks + 1
    with Cache(tmp_path / "kv") as cache:
        store = Slow(cache)
        pool = make_pool(num_blocks=8, store=store, write_queue_blocks=2)
        pool.add_sequence("a", tokens)
        fill(pool, "a", tokens)                           # returns with the writer stuck
        s = pool.stats()
        assert s.write_drops == 4 and s.write_queue == 2 and s.written_blocks == 0
        gate.set()
        assert pool.flush_writes(timeout=30)
        hashes = block_hashes(tokens, BS, pool.extra)
        assert store.match_prefix(hashes) == 2            # the two queued ones
        pool.free("a")
        assert pool.spill_cached() == 4                   # the dropped ones, at shutdown
        assert store.match_prefix(hashes) == 6


def test_a_failed_block_writer_is_reported_not_lost(tmp_path):
    """The writer thread's put fails (a full disk, say): flush_writes and the
    next commit that would queue a block raise RuntimeError with the cause
    chained, instead of the engine going on with writes silently dropped."""
    class Full(KVBlockStore):
        def put(self, block_hash, kv_array):
            raise OSError(28, "No space left on device")

    tokens = list(range(900, 905))                        # one full block: one write
    with Cache(tmp_path / "kv") as cache:
        pool = make_pool(num_blocks=8, store=Full(cache))
        pool.add_sequence("a", tokens)
        fill(pool, "a", tokens)
        with pytest.raises(RuntimeError, match="writer thread failed") as info:
            pool.flush_writes(timeout=30)
        assert isinstance(info.value.__cause__, OSError)
        pool.add_sequence("b", list(range(950, 963)))
        with pytest.raises(RuntimeError, match="writer thread failed"):
            fill(pool, "b", list(range(950, 963)))
