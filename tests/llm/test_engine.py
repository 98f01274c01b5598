"""Model + pool + schedulers: identical greedy tokens with and without the caches,
cached prefixes skip compute, preemption by recompute, static vs continuous."""

from __future__ import annotations

import numpy as np
import pytest

from durablekv import Cache, ConfigError
from durablekv.llm.engine import LLMEngine
from durablekv.llm.kvstore import KVBlockStore
from durablekv.llm.model import TinyTransformer
from durablekv.llm.scheduler import ContinuousScheduler, Request, StaticScheduler

BS = 4
SYSTEM = list(range(40, 72))                      # a shared 32-token system prompt


def requests(seed=0, n=6, shared=True, new_tokens=(3, 12)):
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        user = rng.integers(0, 256, int(rng.integers(3, 14))).tolist()
        out.append(Request(f"r{i}", (SYSTEM if shared else []) + user,
                           int(rng.integers(*new_tokens))))
    return out


def run(reqs, *, num_blocks=200, prefix=True, store=None, scheduler=ContinuousScheduler,
        batched=True, max_num_seqs=4, max_num_batched_tokens=64, model=None):
    model = model or TinyTransformer(vocab_size=256, num_layers=2, num_heads=4, num_kv_heads=2,
                                     head_dim=8, seed=3, batched=batched)
    pool = model.make_pool(num_blocks, BS, enable_prefix_caching=prefix, store=store)
    sched = scheduler(pool, max_num_seqs=max_num_seqs,
                      max_num_batched_tokens=max_num_batched_tokens)
    engine = LLMEngine(model, pool, sched)
    seqs = engine.generate(reqs)
    return [s.output_token_ids for s in seqs], engine, seqs


BASELINE = None


def baseline():
    global BASELINE
    if BASELINE is None:
        BASELINE = run(requests(), prefix=False)[0]
    return BASELINE


def test_outputs_are_varied_and_exact_length():
    outs = baseline()
    assert [len(o) for o in outs] == [r.max_new_tokens for r in requests()]
    assert len({t for o in outs for t in o}) > 10      # the model is not a constant


def test_prefix_cache_gives_identical_tokens_and_skips_compute():
    outs, engine, seqs = run(requests(), prefix=True, max_num_seqs=1)
    assert outs == baseline()
    _, off_engine, _ = run(requests(), prefix=False, max_num_seqs=1)
    # with one sequence at a time, every request after the first finds the
    # system prompt's 8 blocks in memory, and those 32 tokens are not run again
    hits = [s.cached_tokens_memory for s in seqs]
    assert hits == [0] + [len(SYSTEM)] * 5
    assert off_engine.model.tokens_computed - engine.model.tokens_computed == sum(hits)
    stats = engine.pool.stats()
    assert stats.prefix_hits_memory_tokens == sum(hits)
    assert stats.prefix_queries_tokens == sum(len(r.prompt_token_ids) for r in requests())


def test_a_repeated_request_computes_only_its_last_prompt_token():
    req = requests(n=1)[0]
    model = TinyTransformer(vocab_size=256, num_heads=4, num_kv_heads=2, head_dim=8, seed=3)
    pool = model.make_pool(100, BS)
    engine = LLMEngine(model, pool, ContinuousScheduler(pool))
    first = engine.generate([req])[0]
    computed = model.tokens_computed
    again = engine.generate([Request("again", first.token_ids[:-1], 1)])[0]
    n = len(first.token_ids) - 1                       # prompt + all but the last output
    assert again.cached_tokens_memory == (n - 1) // BS * BS
    assert model.tokens_computed - computed == n - again.cached_tokens_memory
    assert again.output_token_ids == first.token_ids[-1:]


def test_durable_tier_after_restart_gives_identical_tokens(tmp_path):
    reqs = requests()
    with Cache(tmp_path / "kv") as cache:
        store = KVBlockStore(cache)
        outs, engine, _ = run(reqs, num_blocks=24, store=store)
        assert outs == baseline()
        engine.pool.spill_cached()
        assert engine.pool.stats().evictions > 0       # the pool was too small to keep all
    with Cache(tmp_path / "kv") as cache:
        outs, engine, seqs = run(requests(), num_blocks=24, store=KVBlockStore(cache))
        assert outs == baseline()
        assert seqs[0].cached_tokens_durable >= len(SYSTEM)
        assert engine.pool.stats().prefix_hits_durable_tokens > 0


def test_batched_and_per_sequence_matmuls_give_identical_tokens():
    assert run(requests(), prefix=False, batched=False)[0] == baseline()


def test_preemption_by_recompute_keeps_tokens_identical():
    reqs = requests(seed=1, n=8, shared=False, new_tokens=(10, 30))
    want = run(reqs, prefix=False)[0]
    for prefix in (False, True):
        outs, engine, seqs = run(requests(seed=1, n=8, shared=False, new_tokens=(10, 30)),
                                 num_blocks=14, prefix=prefix, max_num_seqs=8)
        assert engine.scheduler.num_preemptions > 0
        assert engine.pool.stats().preemptions == engine.scheduler.num_preemptions
        assert any(s.num_preemptions for s in seqs)
        assert outs == want
        assert engine.pool.num_free_blocks == engine.pool.num_blocks   # all freed


class RecordingScheduler(ContinuousScheduler):
    def schedule(self):
        batch = super().schedule()
        self.log.append((len(self.running), sum(n for _, n in batch)))
        return batch


def test_limits_hold_every_step():
    _, engine, _ = run(requests(n=8), max_num_seqs=3, max_num_batched_tokens=10,
                       scheduler=lambda pool, **kw: _recording(pool, **kw))
    log = engine.scheduler.log
    assert log and max(r for r, _ in log) == 3 and max(t for _, t in log) == 10
    assert all(r <= 3 and t <= 10 for r, t in log)


def _recording(pool, **kw):
    sched = RecordingScheduler(pool, **kw)
    sched.log = []
    return sched


def test_continuous_admits_as_soon_as_a_seat_frees_static_waits_for_the_batch():
    def reqs():
        return [Request("long", [1, 2, 3], 20), Request("short", [4, 5, 6], 2),
                Request("next", [7, 8, 9], 2)]

    _, cont, cs = run(reqs(), max_num_seqs=2)
    _, stat, ss = run(reqs(), max_num_seqs=2, scheduler=StaticScheduler)
    long_c, short_c, next_c = cs
    long_s, short_s, next_s = ss
    assert next_c.first_token_time < long_c.finish_time       # took short's seat at once
    assert next_s.first_token_time > long_s.finish_time       # waited for the whole batch
    assert [s.output_token_ids for s in cs] == [s.output_token_ids for s in ss]
    assert cont.num_steps < stat.num_steps


def test_bad_requests_and_limits():
    model = TinyTransformer(vocab_size=16, num_heads=2, num_kv_heads=1, head_dim=4)
    pool = model.make_pool(4, BS)
    sched = ContinuousScheduler(pool)
    with pytest.raises(ValueError, match="empty prompt"):
        sched.add(Request("x", [], 3))
    with pytest.raises(ValueError, match="max_new_tokens must be an int >= 1"):
        sched.add(Request("x", [1], 0))
    with pytest.raises(ConfigError, match="max_num_seqs"):
        ContinuousScheduler(pool, max_num_seqs=0)
    engine = LLMEngine(model, pool, sched)
    engine.add_request(Request("big", list(range(16)) * 2, 3))
    with pytest.raises(RuntimeError, match="needs 8 blocks and the pool has 4"):
        engine.step()
    with pytest.raises(ConfigError, match="multiple of num_kv_heads"):
        TinyTransformer(num_heads=3, num_kv_heads=2)
