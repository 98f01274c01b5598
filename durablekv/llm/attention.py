"""Paged attention in numpy: attention over KV blocks reached through block tables.

The KV of a sequence lives in fixed-size blocks scattered over one
preallocated cache (vLLM's PagedAttention, Kwon et al., SOSP 2023,
https://arxiv.org/abs/2309.06180). Shapes, as in vLLM::

    key_cache, value_cache  [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables            [num_seqs, max_blocks_per_seq]  (int)
    seq_lens                [num_seqs]                      (int)

Token ``t`` of sequence ``i`` is at ``key_cache[block_tables[i, t // block_size],
t % block_size]``. Grouped-query attention: ``num_heads`` is a multiple of
``num_kv_heads``, and query head ``h`` reads KV head ``h // (num_heads //
num_kv_heads)``.

Entries of a block table past ``ceil(seq_lens[i] / block_size)`` are padding,
and slots of the last block past ``seq_lens[i]`` are masked: neither reaches
the result, whatever they hold (vLLM pads with 0; -1 is fine too). They are
selected out (``np.where``), never multiplied by a zero weight, so a NaN or
inf left in a free block or in another sequence's block cannot turn a row
into NaN (``0 * nan`` is nan).
"""

from __future__ import annotations

import numpy as np

__all__ = ["paged_attention", "paged_prefill_attention"]


def _check_float(name: str, a: object, ndim: int, shape_doc: str) -> np.ndarray:
    if not isinstance(a, np.ndarray):
        raise TypeError(f"{name} must be a numpy array {shape_doc}, not {type(a).__name__}")
    if not np.issubdtype(a.dtype, np.floating):
        raise TypeError(f"{name} must hold floats (float16/32/64), not {a.dtype}; "
                        f"convert it with {name}.astype(np.float32)")
    if a.ndim != ndim:
        raise ValueError(f"{name} must be {ndim}-d {shape_doc}, got shape {a.shape}")
    return a


def _check_int(name: str, a: object, ndim: int, shape_doc: str) -> np.ndarray:
    if not isinstance(a, np.ndarray):
        a = np.asarray(a)
    if not np.issubdtype(a.dtype, np.integer):
        raise TypeError(f"{name} must hold integers {shape_doc}, not {a.dtype}")
    if a.ndim != ndim:
        raise ValueError(f"{name} must be {ndim}-d {shape_doc}, got shape {a.shape}")
    return a


def _check_caches(key_cache: object, value_cache: object) -> tuple[int, int, int, int]:
    doc = "[num_blocks, block_size, num_kv_heads, head_dim]"
    _check_float("key_cache", key_cache, 4, doc)
    _check_float("value_cache", value_cache, 4, doc)
    if key_cache.shape != value_cache.shape:  # type: ignore[union-attr]
        raise ValueError(f"key_cache and value_cache must have one shape {doc}, got "
                         f"{key_cache.shape} and {value_cache.shape}")  # type: ignore[union-attr]
    num_blocks, block_size, num_kv_heads, head_dim = key_cache.shape  # type: ignore[union-attr]
    if block_size <= 0:
        raise ValueError(f"block_size (key_cache.shape[1]) must be >= 1, got {block_size}")
    if num_blocks <= 0 or num_kv_heads <= 0 or head_dim <= 0:
        raise ValueError(f"the KV cache has an empty dimension: shape {key_cache.shape} {doc}")  # type: ignore[union-attr]
    return num_blocks, block_size, num_kv_heads, head_dim


def _gather(cache: np.ndarray, table: np.ndarray) -> np.ndarray:
    """``cache[table]`` flattened to tokens: [..., n_blocks * block_size, kv, d]."""
    g = cache[table]
    return g.reshape(*table.shape[:-1], table.shape[-1] * cache.shape[1], *cache.shape[2:])


def _check_table_entries(name: str, table: np.ndarray, num_blocks: int) -> None:
    if table.size and (table.min() < 0 or table.max() >= num_blocks):
        bad = table[(table < 0) | (table >= num_blocks)].flat[0]
        raise ValueError(f"{name} points at block {int(bad)}, outside the pool's "
                         f"{num_blocks} blocks (valid ids are 0..{num_blocks - 1}); "
                         "a block table must hold ids the pool allocated")


def _masked_softmax(scores: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Softmax over the last axis with ``mask`` (True = not attended) at -inf.
    Every row keeps at least one position (lengths are >= 1)."""
    scores = np.where(mask, -np.inf, scores)
    scores -= scores.max(axis=-1, keepdims=True)
    np.exp(scores, out=scores)
    scores /= scores.sum(axis=-1, keepdims=True)
    return scores


def paged_attention(query: np.ndarray, key_cache: np.ndarray, value_cache: np.ndarray,
                    block_tables: np.ndarray, seq_lens: np.ndarray,
                    scale: float | None = None) -> np.ndarray:
    """One decode step of attention for a batch of sequences over paged KV.

    :param query: ``[num_seqs, num_heads, head_dim]`` floats, one query token per
        sequence (the newest; its own K/V must already be in the cache).
    :param key_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``.
    :param value_cache: same shape as ``key_cache``.
    :param block_tables: ``[num_seqs, max_blocks_per_seq]`` ints, physical block
        ids in logical order.
    :param seq_lens: ``[num_seqs]`` ints >= 1: tokens of context per sequence
        (the query attends to positions ``0 .. seq_lens[i] - 1``).
    :param scale: multiplies ``q . k``; default ``head_dim ** -0.5``.
    :returns: ``[num_seqs, num_heads, head_dim]`` in the query's dtype (math in
        float64 when any input is float64, else float32): softmax attention
        over each sequence's tokens gathered in block-table order.
    :raises TypeError: an input is not an array of the right kind (float
        caches and query, integer tables and lengths).
    :raises ValueError: a shape does not match the others, ``block_size`` <= 0,
        ``num_heads`` not a multiple of ``num_kv_heads``, a length < 1 or more
        than the block table holds, a used block id outside the pool.
    """
    num_blocks, block_size, num_kv_heads, head_dim = _check_caches(key_cache, value_cache)
    _check_float("query", query, 3, "[num_seqs, num_heads, head_dim]")
    num_seqs, num_heads, q_dim = query.shape
    if q_dim != head_dim:
        raise ValueError(f"query head_dim {q_dim} does not match the KV cache's {head_dim}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads "
                         f"({num_kv_heads}) for grouped-query attention")
    block_tables = _check_int("block_tables", block_tables, 2, "[num_seqs, max_blocks_per_seq]")
    seq_lens = _check_int("seq_lens", seq_lens, 1, "[num_seqs]")
    if block_tables.shape[0] != num_seqs or seq_lens.shape[0] != num_seqs:
        raise ValueError(f"query has {num_seqs} sequences but block_tables has "
                         f"{block_tables.shape[0]} rows and seq_lens {seq_lens.shape[0]}")
    if num_seqs == 0:
        return np.zeros(query.shape, dtype=query.dtype)
    max_blocks = block_tables.shape[1]
    capacity = max_blocks * block_size
    if seq_lens.min() < 1 or seq_lens.max() > capacity:
        bad = int(seq_lens[(seq_lens < 1) | (seq_lens > capacity)][0])
        raise ValueError(f"a sequence length is {bad}, outside 1..{capacity} (the block "
                         f"table holds {max_blocks} blocks of {block_size} tokens)")
    needed = (seq_lens + block_size - 1) // block_size            # [S]
    used = np.arange(max_blocks)[None, :] < needed[:, None]       # [S, MB]
    _check_table_entries("block_tables", block_tables[used], num_blocks)
    table = np.where(used, block_tables, 0)

    ctype = np.result_type(query.dtype, key_cache.dtype, np.float32)
    group = num_heads // num_kv_heads
    scale = head_dim ** -0.5 if scale is None else float(scale)
    mask = np.arange(capacity)[None, :] >= seq_lens[:, None]      # [S, T]
    # padding and masked slots are selected out before any arithmetic
    # (a weight of 0 times a NaN there would still be NaN)
    hidden = mask[:, :, None, None]
    k = np.where(hidden, 0, _gather(key_cache, table)).astype(ctype, copy=False)  # [S, T, KV, D]
    v = np.where(hidden, 0, _gather(value_cache, table)).astype(ctype, copy=False)
    q = query.astype(ctype, copy=False).reshape(num_seqs, num_kv_heads, group, head_dim)
    scores = np.einsum("skgd,stkd->skgt", q, k) * scale           # [S, KV, G, T]
    scores = _masked_softmax(scores, mask[:, None, None, :])
    out = np.einsum("skgt,stkd->skgd", scores, v)
    return out.reshape(num_seqs, num_heads, head_dim).astype(query.dtype, copy=False)


def paged_prefill_attention(query: np.ndarray, key_cache: np.ndarray, value_cache: np.ndarray,
                            block_table: np.ndarray, start_pos: int,
                            scale: float | None = None) -> np.ndarray:
    """Causal attention for a chunk of one sequence's tokens (prefill).

    The chunk's tokens are at positions ``start_pos .. start_pos + n - 1``;
    their K/V (and those of every earlier position) must already be in the
    cache. Token ``start_pos + j`` attends to positions ``0 .. start_pos + j``.
    Positions below ``start_pos`` are the cached prefix: read, not recomputed.

    :param query: ``[n, num_heads, head_dim]``.
    :param block_table: ``[num_blocks_of_seq]`` ints (at least
        ``ceil((start_pos + n) / block_size)`` of them).
    :param start_pos: int >= 0, the position of the chunk's first token.
    :returns: ``[n, num_heads, head_dim]``.
    :raises TypeError, ValueError: as :func:`paged_attention`.
    """
    num_blocks, block_size, num_kv_heads, head_dim = _check_caches(key_cache, value_cache)
    _check_float("query", query, 3, "[n, num_heads, head_dim]")
    n, num_heads, q_dim = query.shape
    if q_dim != head_dim or num_heads % num_kv_heads:
        raise ValueError(f"query shape {query.shape} does not fit the KV cache "
                         f"{key_cache.shape} (head_dim must match; num_heads a multiple "
                         "of num_kv_heads)")
    block_table = _check_int("block_table", block_table, 1, "[num_blocks_of_seq]")
    if isinstance(start_pos, bool) or not isinstance(start_pos, (int, np.integer)) \
            or start_pos < 0:
        raise ValueError(f"start_pos must be an int >= 0, not {start_pos!r}")
    total = int(start_pos) + n
    needed = -(-total // block_size)
    if needed > block_table.shape[0]:
        raise ValueError(f"{total} tokens need {needed} blocks of {block_size}, but the "
                         f"block table holds {block_table.shape[0]}")
    table = block_table[:needed]
    _check_table_entries("block_table", table, num_blocks)
    ctype = np.result_type(query.dtype, key_cache.dtype, np.float32)
    group = num_heads // num_kv_heads
    scale = head_dim ** -0.5 if scale is None else float(scale)
    k = _gather(key_cache, table)[:total].astype(ctype, copy=False)   # [T, KV, D]
    v = _gather(value_cache, table)[:total].astype(ctype, copy=False)
    q = query.astype(ctype, copy=False).reshape(n, num_kv_heads, group, head_dim)
    scores = np.einsum("nkgd,tkd->kgnt", q, k) * scale               # [KV, G, n, T]
    pos = start_pos + np.arange(n)
    mask = np.arange(total)[None, :] > pos[:, None]                   # [n, T]
    scores = _masked_softmax(scores, mask)
    out = np.einsum("kgnt,tkd->nkgd", scores, v)
    return out.reshape(n, num_heads, head_dim).astype(query.dtype, copy=False)
