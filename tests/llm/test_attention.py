"""paged_attention equals plain dense softmax attention; bad input is refused clearly."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from durablekv.llm.attention import paged_attention, paged_prefill_attention


def dense_reference(q, keys, values, scale=None):
    """Plain attention of one query token per head over ``keys [T, KV, D]``."""
    num_heads, d = q.shape
    group = num_heads // keys.shape[1]
    scale = d ** -0.5 if scale is None else scale
    out = np.empty_like(q, dtype=np.float64)
    for h in range(num_heads):
        k = keys[:, h // group].astype(np.float64)
        v = values[:, h // group].astype(np.float64)
        s = k @ q[h].astype(np.float64) * scale
        w = np.exp(s - s.max())
        out[h] = (w / w.sum()) @ v
    return out


def random_case(rng, *, num_seqs, num_heads, num_kv_heads, head_dim, block_size, seq_lens,
                dtype=np.float64, pad=2):
    max_blocks = max(-(-n // block_size) for n in seq_lens) + pad
    num_blocks = num_seqs * max_blocks + 3
    kc = rng.standard_normal((num_blocks, block_size, num_kv_heads, head_dim)).astype(dtype)
    vc = rng.standard_normal(kc.shape).astype(dtype)
    # shuffled, non-contiguous physical blocks; padding entries point anywhere (-1 here)
    perm = rng.permutation(num_blocks)
    tables = np.full((num_seqs, max_blocks), -1, dtype=np.int64)
    for i, n in enumerate(seq_lens):
        need = -(-n // block_size)
        tables[i, :need] = perm[i * max_blocks:i * max_blocks + need]
    q = rng.standard_normal((num_seqs, num_heads, head_dim)).astype(dtype)
    return q, kc, vc, tables, np.array(seq_lens, dtype=np.int64)


def gathered(cache, table, n):
    bs = cache.shape[1]
    return np.concatenate([cache[b] for b in table[:-(-n // bs)]])[:n]


def check(q, kc, vc, tables, lens, scale=None, rtol=1e-10):
    out = paged_attention(q, kc, vc, tables, lens, scale=scale)
    assert out.shape == q.shape and out.dtype == q.dtype
    for i, n in enumerate(lens):
        ref = dense_reference(q[i], gathered(kc, tables[i], n), gathered(vc, tables[i], n), scale)
        np.testing.assert_allclose(out[i], ref, rtol=rtol, atol=rtol)


@pytest.mark.parametrize("ratio", [1, 2, 4])
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_matches_dense_attention_gqa(ratio, block_size):
    rng = np.random.default_rng(ratio * 100 + block_size)
    num_kv_heads = 2
    lens = [1, block_size, block_size + 1, 3 * block_size - 1, 37]  # incl. non-multiples
    check(*random_case(rng, num_seqs=len(lens), num_heads=num_kv_heads * ratio,
                       num_kv_heads=num_kv_heads, head_dim=8, block_size=block_size,
                       seq_lens=lens))


def test_one_token_sequences_return_their_value():
    rng = np.random.default_rng(1)
    q, kc, vc, tables, lens = random_case(rng, num_seqs=3, num_heads=4, num_kv_heads=1,
                                          head_dim=4, block_size=8, seq_lens=[1, 1, 1])
    out = paged_attention(q, kc, vc, tables, lens)
    for i in range(3):
        np.testing.assert_allclose(out[i], np.repeat(vc[tables[i, 0], 0], 4, axis=0))


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), num_seqs=st.integers(1, 5),
       num_kv_heads=st.integers(1, 3), ratio=st.sampled_from([1, 2, 4]),
       head_dim=st.integers(1, 9), block_size=st.integers(1, 9), data=st.data())
def test_random_shapes(seed, num_seqs, num_kv_heads, ratio, head_dim, block_size, data):
    lens = data.draw(st.lists(st.integers(1, 50), min_size=num_seqs, max_size=num_seqs))
    rng = np.random.default_rng(seed)
    check(*random_case(rng, num_seqs=num_seqs, num_heads=num_kv_heads * ratio,
                       num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=block_size,
                       seq_lens=lens))


def test_float32_and_explicit_scale():
    rng = np.random.default_rng(2)
    case = random_case(rng, num_seqs=3, num_heads=4, num_kv_heads=2, head_dim=16, block_size=4,
                       seq_lens=[5, 9, 2], dtype=np.float32)
    check(*case, scale=0.3, rtol=2e-5)


def test_block_table_order_is_the_token_order():
    """Swapping two entries of a block table changes which tokens come first;
    with position-free attention the output is the same set, so check the
    gather by giving each block one distinct value and a peaked query."""
    bs, d = 2, 1
    kc = np.zeros((4, bs, 1, d))
    vc = np.arange(8, dtype=np.float64).reshape(4, bs, 1, d)
    kc[2, 1, 0, 0] = 50.0                      # block 2, slot 1 draws all the weight
    q = np.ones((1, 1, d))
    out = paged_attention(q, kc, vc, np.array([[3, 2]]), np.array([4]))
    assert out[0, 0, 0] == pytest.approx(vc[2, 1, 0, 0])
    # a length that stops before that slot never sees it
    out = paged_attention(q, kc, vc, np.array([[3, 2]]), np.array([3]))
    assert out[0, 0, 0] == pytest.approx(np.mean([6, 7, 4]))


def test_prefill_matches_causal_dense_attention():
    rng = np.random.default_rng(3)
    bs, kvh, h, d, total, start = 4, 2, 4, 8, 11, 6
    kc = rng.standard_normal((9, bs, kvh, d))
    vc = rng.standard_normal(kc.shape)
    table = np.array([7, 1, 4])
    q = rng.standard_normal((total - start, h, d))
    out = paged_prefill_attention(q, kc, vc, table, start)
    keys, values = gathered(kc, table, total), gathered(vc, table, total)
    for j in range(total - start):
        n = start + j + 1
        np.testing.assert_allclose(out[j], dense_reference(q[j], keys[:n], values[:n]),
                                   rtol=1e-10, atol=1e-12)


# -- bad input -------------------------------------------------------------

def ok_case():
    return random_case(np.random.default_rng(0), num_seqs=2, num_heads=4, num_kv_heads=2,
                       head_dim=8, block_size=4, seq_lens=[5, 3], pad=0)


def test_bad_shapes():
    q, kc, vc, tables, lens = ok_case()
    with pytest.raises(ValueError, match="query must be 3-d"):
        paged_attention(q[0], kc, vc, tables, lens)
    with pytest.raises(ValueError, match="key_cache must be 4-d"):
        paged_attention(q, kc[0], vc, tables, lens)
    with pytest.raises(ValueError, match="one shape"):
        paged_attention(q, kc, vc[:, :2], tables, lens)
    with pytest.raises(ValueError, match="head_dim 4 does not match"):
        paged_attention(q[..., :4], kc, vc, tables, lens)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        paged_attention(q[:, :3], kc, vc, tables, lens)
    with pytest.raises(ValueError, match="2 sequences but block_tables has 1 rows"):
        paged_attention(q, kc, vc, tables[:1], lens)
    with pytest.raises(ValueError, match="block_tables must be 2-d"):
        paged_attention(q, kc, vc, tables[0], lens)


def test_bad_dtypes():
    q, kc, vc, tables, lens = ok_case()
    with pytest.raises(TypeError, match="query must hold floats"):
        paged_attention(q.astype(np.int64), kc, vc, tables, lens)
    with pytest.raises(TypeError, match="key_cache must be a numpy array"):
        paged_attention(q, kc.tolist(), vc, tables, lens)
    with pytest.raises(TypeError, match="block_tables must hold integers"):
        paged_attention(q, kc, vc, tables.astype(np.float64), lens)
    with pytest.raises(TypeError, match="seq_lens must hold integers"):
        paged_attention(q, kc, vc, tables, lens.astype(np.float32))


def test_block_size_zero():
    q, kc, vc, tables, lens = ok_case()
    with pytest.raises(ValueError, match="block_size .* must be >= 1"):
        paged_attention(q, kc[:, :0], vc[:, :0], tables, lens)


def test_block_table_past_the_pool():
    q, kc, vc, tables, lens = ok_case()
    tables = tables.copy()
    tables[1, 0] = kc.shape[0]
    with pytest.raises(ValueError, match=f"points at block {kc.shape[0]}, outside the pool"):
        paged_attention(q, kc, vc, tables, lens)
    tables[1, 0] = -1
    with pytest.raises(ValueError, match="points at block -1"):
        paged_attention(q, kc, vc, tables, lens)


def test_seq_len_past_capacity_or_zero():
    q, kc, vc, tables, lens = ok_case()
    with pytest.raises(ValueError, match="length is 9, outside 1..8"):
        paged_attention(q, kc, vc, tables, np.array([9, 3]))
    with pytest.raises(ValueError, match="length is 0"):
        paged_attention(q, kc, vc, tables, np.array([0, 3]))


def test_prefill_bad_input():
    q, kc, vc, tables, _ = ok_case()
    with pytest.raises(ValueError, match="need 3 blocks"):
        paged_prefill_attention(q, kc, vc, tables[0], 7)
    with pytest.raises(ValueError, match="start_pos must be an int >= 0"):
        paged_prefill_attention(q, kc, vc, tables[0], -1)


@pytest.mark.parametrize("poison", [np.nan, np.inf, -np.inf])
def test_padding_and_masked_slots_never_reach_the_result(poison):
    """Block 0 (where padding entries point) and the masked tail of each last
    block hold NaN/inf: the outputs equal attention over the clean tokens, for
    every sequence of the batch (no cross-sequence contamination)."""
    rng = np.random.default_rng(7)
    block_size, kv, d = 4, 2, 8
    lens = [5, 9, 3]
    q, kc, vc, tables, seq_lens = random_case(rng, num_seqs=3, num_heads=4, num_kv_heads=kv,
                                              head_dim=d, block_size=block_size,
                                              seq_lens=lens)
    clean_k, clean_v = kc.copy(), vc.copy()
    used = {int(b) for row in tables for b in row if b >= 0}
    free = next(b for b in range(kc.shape[0]) if b not in used)
    # the padding entries point at a block no sequence uses, poisoned whole
    tables = np.where(tables < 0, free, tables)
    for cache in (kc, vc):
        cache[free] = poison
        for row, n in zip(tables, lens):  # the masked tail of each last block
            last = int(row[(n - 1) // block_size])
            cache[last, n % block_size or block_size:] = poison
    out = paged_attention(q, kc, vc, tables, seq_lens)
    assert np.isfinite(out).all()
    for i, n in enumerate(lens):
        ref = dense_reference(q[i], gathered(clean_k, tables[i], n),
                              gathered(clean_v, tables[i], n))
        np.testing.assert_allclose(out[i], ref, rtol=1e-10, atol=1e-10)
