"""A tiny deterministic transformer in numpy that runs through the block pool.

Decoder-only, pre-norm (RMSNorm), rotary position embeddings, grouped-query
attention, a ReLU MLP, separate input and output embeddings; weights drawn from a
seeded generator, so the same arguments give the same model in every
process. It is not trained: its greedy continuations are arbitrary but
deterministic, which is all the KV cache needs to be tested and measured.

Every forward step writes the new tokens' K/V into the pool's blocks and
reads attention context only through block tables
(:func:`~durablekv.llm.attention.paged_attention` for decode tokens,
:func:`~durablekv.llm.attention.paged_prefill_attention` for prefill chunks).
Tokens whose KV came from the prefix cache are not fed through the model at
all; :attr:`TinyTransformer.tokens_computed` counts the tokens that were.

``batched=True`` (default) runs each linear layer as one matmul over every
token in the step and the decode tokens' attention as one batched call;
``batched=False`` loops over the sequences (one matmul each), the baseline
for the batching gain.

Numbers are float64 by default, so that a different split of the same work
(cached prefix vs full prefill, batched vs not) cannot flip a greedy argmax
through rounding; the KV pool takes the model's dtype.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Hashable, Sequence

import numpy as np

from ..errors import ConfigError
from .attention import paged_attention, paged_prefill_attention
from .pool import BlockPool

__all__ = ["TinyTransformer", "Segment"]


@dataclass(frozen=True)
class Segment:
    """Tokens of one sequence to run in a step: positions ``start .. start + len(tokens) - 1``."""

    seq_id: Hashable
    tokens: Sequence[int]
    start: int


def _positive(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name} must be an int >= 1, not {value!r}")
    return value


class TinyTransformer:
    """Seeded random weights; prefill and decode through a :class:`BlockPool`.

    :param vocab_size, num_layers, num_heads, num_kv_heads, head_dim: sizes
        (ints >= 1; ``num_heads`` a multiple of ``num_kv_heads``).
    :param mlp_dim: hidden size of the MLP (default ``4 * num_heads * head_dim``).
    :param seed: weight seed.
    :param dtype: float dtype of weights, activations and KV (default float64).
    :param batched: one matmul per step for all sequences (True) or one per sequence.
    :raises ConfigError: a bad size.
    """

    def __init__(self, *, vocab_size: int = 512, num_layers: int = 2, num_heads: int = 4,
                 num_kv_heads: int = 2, head_dim: int = 16, mlp_dim: int | None = None,
                 seed: int = 0, dtype: Any = np.float64, batched: bool = True) -> None:
        for name, v in (("vocab_size", vocab_size), ("num_layers", num_layers),
                        ("num_heads", num_heads), ("num_kv_heads", num_kv_heads),
                        ("head_dim", head_dim)):
            _positive(name, v)
        if num_heads % num_kv_heads:
            raise ConfigError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads "
                              f"({num_kv_heads})")
        if head_dim % 2:
            raise ConfigError(f"head_dim must be even for rotary embeddings, not {head_dim}")
        self.vocab_size, self.num_layers = vocab_size, num_layers
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.d_model = d = num_heads * head_dim
        self.mlp_dim = mlp_dim = _positive("mlp_dim", mlp_dim or 4 * d)
        self.seed = seed
        self.dtype = np.dtype(dtype)
        self.batched = batched
        rng = np.random.default_rng(seed)

        def w(*shape: int, fan_in: int) -> np.ndarray:
            return (rng.standard_normal(shape) / np.sqrt(fan_in)).astype(self.dtype)

        kvd = num_kv_heads * head_dim
        self.embed = w(vocab_size, d, fan_in=1)
        self.unembed = w(d, vocab_size, fan_in=d)
        self.layers = [
            {"wq": w(d, d, fan_in=d), "wk": w(d, kvd, fan_in=d), "wv": w(d, kvd, fan_in=d),
             "wo": w(d, d, fan_in=d), "w1": w(d, mlp_dim, fan_in=d),
             "w2": w(mlp_dim, d, fan_in=mlp_dim)}
            for _ in range(num_layers)]
        half = head_dim // 2
        self._inv_freq = 1.0 / (10000.0 ** (np.arange(half, dtype=np.float64) / half))
        #: tokens run through the model (cached prefix tokens are not)
        self.tokens_computed = 0
        self.steps = 0

    @property
    def fingerprint(self) -> str:
        """Identity of the weights and KV layout: the block hash ``extra`` key."""
        return (f"tiny-v1:v{self.vocab_size}:l{self.num_layers}:h{self.num_heads}:"
                f"kv{self.num_kv_heads}:d{self.head_dim}:m{self.mlp_dim}:s{self.seed}:"
                f"{self.dtype.str}")

    def make_pool(self, num_blocks: int, block_size: int, **kwargs: Any) -> BlockPool:
        """A :class:`BlockPool` shaped for this model (``extra`` = :attr:`fingerprint`)."""
        kwargs.setdefault("extra", self.fingerprint)
        return BlockPool(num_blocks, block_size, num_layers=self.num_layers,
                         num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
                         dtype=self.dtype, **kwargs)

    def _rope(self, x: np.ndarray, pos: np.ndarray) -> np.ndarray:
        """Rotate ``x [n, heads, head_dim]`` by positions ``pos [n]``."""
        ang = pos[:, None].astype(np.float64) * self._inv_freq[None, :]
        cos = np.cos(ang).astype(self.dtype)[:, None, :]
        sin = np.sin(ang).astype(self.dtype)[:, None, :]
        half = self.head_dim // 2
        x1, x2 = x[..., :half], x[..., half:]
        return np.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)

    @staticmethod
    def _norm(x: np.ndarray) -> np.ndarray:
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + 1e-6)

    def _linear(self, x: np.ndarray, weight: np.ndarray, bounds: list[int]) -> np.ndarray:
        if self.batched or len(bounds) <= 2:
            return x @ weight
        return np.concatenate([x[a:b] @ weight for a, b in zip(bounds, bounds[1:])])

    def forward(self, pool: BlockPool, segments: Sequence[Segment]) -> np.ndarray:
        """Run one step: every segment's tokens, writing their K/V into ``pool``.

        Each segment's block table must already cover its positions
        (:meth:`BlockPool.allocate_slots`), and positions before ``start``
        must hold KV (computed earlier or from the prefix cache).

        :returns: ``[len(segments), vocab_size]`` logits of each segment's last token.
        :raises ValueError: an empty segment, or a token id outside the vocabulary.
        """
        if not segments:
            return np.zeros((0, self.vocab_size), dtype=self.dtype)
        tokens = np.concatenate([np.asarray(s.tokens, dtype=np.int64) for s in segments])
        lens = [len(s.tokens) for s in segments]
        if min(lens) < 1:
            raise ValueError("a segment has no tokens; schedule at least one token per sequence")
        if tokens.min() < 0 or tokens.max() >= self.vocab_size:
            raise ValueError(f"token ids must be in [0, {self.vocab_size}), got "
                             f"{int(tokens.min())}..{int(tokens.max())}")
        bounds = [0, *np.cumsum(lens).tolist()]
        pos = np.concatenate([np.arange(s.start, s.start + n) for s, n in zip(segments, lens)])
        slots = [pool.slots(s.seq_id, s.start, s.start + n) for s, n in zip(segments, lens)]
        blk = np.concatenate([b for b, _ in slots])
        off = np.concatenate([o for _, o in slots])
        decode = [i for i, n in enumerate(lens) if n == 1]
        prefill = [i for i, n in enumerate(lens) if n > 1]
        if decode:
            width = max(len(pool.block_tables[segments[i].seq_id]) for i in decode)
            tables = np.zeros((len(decode), width), dtype=np.int64)
            for row, i in enumerate(decode):
                t = pool.block_tables[segments[i].seq_id]
                tables[row, :len(t)] = t
            seq_lens = np.array([segments[i].start + 1 for i in decode], dtype=np.int64)
            dec_rows = np.array([bounds[i] for i in decode])
        H, KV, D = self.num_heads, self.num_kv_heads, self.head_dim
        x = self.embed[tokens]
        for layer, p in enumerate(self.layers):
            h = self._norm(x)
            q = self._rope(self._linear(h, p["wq"], bounds).reshape(-1, H, D), pos)
            k = self._rope(self._linear(h, p["wk"], bounds).reshape(-1, KV, D), pos)
            v = self._linear(h, p["wv"], bounds).reshape(-1, KV, D)
            kc, vc = pool.key_cache(layer), pool.value_cache(layer)
            kc[blk, off] = k
            vc[blk, off] = v
            attn = np.empty_like(q)
            if decode:
                if self.batched:
                    attn[dec_rows] = paged_attention(q[dec_rows], kc, vc, tables, seq_lens)
                else:
                    for row, r in enumerate(dec_rows):
                        attn[r:r + 1] = paged_attention(q[r:r + 1], kc, vc, tables[row:row + 1],
                                                        seq_lens[row:row + 1])
            for i in prefill:
                a, b = bounds[i], bounds[i + 1]
                table = np.asarray(pool.block_tables[segments[i].seq_id], dtype=np.int64)
                attn[a:b] = paged_prefill_attention(q[a:b], kc, vc, table, segments[i].start)
            x = x + self._linear(attn.reshape(-1, H * D), p["wo"], bounds)
            h = self._norm(x)
            x = x + self._linear(np.maximum(self._linear(h, p["w1"], bounds), 0), p["w2"], bounds)
        last = np.array(bounds[1:]) - 1
        logits = self._norm(x[last]) @ self.unembed
        self.tokens_computed += len(tokens)
        self.steps += 1
        return logits
