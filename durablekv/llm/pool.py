"""BlockPool: the paged KV cache's memory: blocks, free list, ref counts, prefix index.

Layout. One preallocated array holds every physical block of every layer::

    kv  [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
         layer       K/V  block id   slot in block

``pool.key_cache(layer)`` and ``pool.value_cache(layer)`` are the views
``kv[layer, 0]`` and ``kv[layer, 1]``, exactly the ``[num_blocks, block_size,
num_kv_heads, head_dim]`` caches :func:`~durablekv.llm.attention.paged_attention`
takes. One block id names the same slots in every layer, so a sequence has
one block table for the whole model, and one block (all layers, K and V,
``kv[:, :, block_id]``) is the unit that is shared, evicted and spilled.

Bookkeeping (after vLLM's block manager, Kwon et al. 2023, and its automatic
prefix caching): a ref count per block; a block table per sequence (logical
block i -> physical block id); a prefix index ``block hash -> block id`` for
full blocks whose KV is complete. A block with ref count 0 is either on the
free list (it holds nothing worth keeping) or *cached* (it is in the prefix
index): cached blocks wait in LRU order and are reused by a later prefix
match, or evicted when the free list is empty.

Eviction order (vLLM's): least recently used first, where a block's time is
when its ref count dropped to 0; a finished sequence's blocks enter the LRU
list tail first, so among them the tail (the least shared, longest suffix)
is evicted before the head (the shared system prompt).

Durable tier. With a :class:`~durablekv.llm.kvstore.KVBlockStore`, each full
block is written there (key = its hash) as soon as its KV is complete
(:meth:`BlockPool.commit`), as LMCache and SGLang's HiCache store blocks as
they are computed: a prefix's head is in the store before a crash can take
it, where writing on eviction only left the heads in memory (eviction frees a
finished sequence's tail first). ``write_through="async"`` (the default)
hands a copy of the block to a writer thread through a bounded queue of
``write_queue_blocks`` blocks, off the decode step's critical path; when the
store falls that far behind, new blocks are dropped and counted
(``stats().write_drops``) instead of stalling decode, and are written on
eviction if still cached. ``"sync"`` writes in :meth:`commit`;
``"evict"`` writes on eviction only. Bound at a kill -9: the next process
recomputes only each sequence's partial last block plus the full blocks
still in the queue (at most ``write_queue_blocks``) or dropped;
:meth:`BlockPool.flush_writes` waits until the queue is written.
A prefix match that runs out of memory hits goes on in the store: each hit
is copied into a fresh block and put into the prefix index again.
:meth:`BlockPool.spill_cached` writes the cached blocks still in memory too
(for a graceful shutdown).

Copy-on-write: :meth:`BlockPool.fork` shares every block of a sequence,
including a partial last block; the first write into a shared partial block
copies it into a new block first, so the sequences never see each other's
tokens. Full blocks are never written again, so they are shared freely.

Not thread-safe: one engine thread owns a pool. The invariants (ref counts
>= 0, a free or cached block is held by no sequence) are asserted.
"""

from __future__ import annotations

import threading
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Any, Hashable, Sequence

import numpy as np

from ..errors import ConfigError
from .hashing import NO_PARENT, encode_extra, hash_block
from .kvstore import KVBlockStore

__all__ = ["BlockPool", "PoolStats", "PrefixMatch"]


@dataclass
class PoolStats:
    """Counters since the pool was made (ints) and gauges (now)."""

    num_blocks: int = 0
    free_blocks: int = 0            # now: on the free list
    cached_free_blocks: int = 0     # now: ref count 0, in the prefix index (evictable)
    prefix_queries_tokens: int = 0  # prompt tokens looked up in the prefix cache
    prefix_hits_memory_tokens: int = 0
    prefix_hits_durable_tokens: int = 0
    evictions: int = 0              # cached blocks evicted from memory
    spilled_blocks: int = 0         # blocks written to the durable tier on eviction or spill_cached
    cow_copies: int = 0
    preemptions: int = 0            # counted by the scheduler (note_preemption)
    layout_misses: int = 0          # stored blocks of another shape or dtype (kept, not used)
    written_blocks: int = 0         # full blocks written to the durable tier as they filled
    write_drops: int = 0            # full blocks not queued: the writer was write_queue_blocks behind
    write_queue: int = 0            # now: full blocks waiting for the writer

    @property
    def usage(self) -> float:
        """Share of blocks in use (held by a sequence), in [0, 1], as vLLM's
        ``kv_cache_usage_perc`` (free and evictable cached blocks are not in use)."""
        if not self.num_blocks:
            return 0.0
        return 1.0 - (self.free_blocks + self.cached_free_blocks) / self.num_blocks


@dataclass(frozen=True)
class PrefixMatch:
    """What :meth:`BlockPool.add_sequence` found: tokens whose KV is already there."""

    num_cached_tokens: int
    memory_tokens: int
    durable_tokens: int


def _positive(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ConfigError(f"{name} must be an int >= 1, not {value!r}")
    return int(value)


class BlockPool:
    """A fixed number of KV blocks in one preallocated array (layout in the module doc).

    :param num_blocks: physical blocks (int >= 1).
    :param block_size: tokens per block (int >= 1).
    :param num_layers, num_kv_heads, head_dim: the model's KV shape (ints >= 1).
    :param dtype: the KV dtype (a float dtype; default float32).
    :param enable_prefix_caching: share full blocks through the prefix index
        (off: every sequence computes its whole prompt; nothing is spilled).
    :param store: a :class:`KVBlockStore` for the durable tier, or None.
    :param extra: folded into every block hash (see :func:`~durablekv.llm.hashing.block_hashes`);
        give the model's identity, so a store shared by two models never
        mixes their blocks.
    :param kv: an existing array to use as the pool (shape and dtype must match).
    :param write_through: when full blocks reach ``store``: ``"async"`` (default:
        as they fill, by a writer thread, through a bounded queue),
        ``"sync"`` (as they fill, in :meth:`commit`) or ``"evict"`` (on
        eviction only). See the module docstring for the bound at a crash.
    :param write_queue_blocks: the async writer's queue bound, in blocks (int >= 1;
        each queued block is a copy of ``block_shape``).
    :raises ConfigError: a size < 1, a non-float dtype, an unknown ``write_through``.
    :raises ValueError: ``kv`` has the wrong shape or dtype.
    """

    def __init__(self, num_blocks: int, block_size: int, *, num_layers: int,
                 num_kv_heads: int, head_dim: int, dtype: Any = np.float32,
                 enable_prefix_caching: bool = True, store: KVBlockStore | None = None,
                 extra: Any = None, kv: np.ndarray | None = None,
                 write_through: str = "async", write_queue_blocks: int = 256) -> None:
        self.num_blocks = _positive("num_blocks", num_blocks)
        self.block_size = _positive("block_size", block_size)
        self.num_layers = _positive("num_layers", num_layers)
        self.num_kv_heads = _positive("num_kv_heads", num_kv_heads)
        self.head_dim = _positive("head_dim", head_dim)
        self.dtype = np.dtype(dtype)
        if self.dtype.kind != "f":
            raise ConfigError(f"the KV dtype must be a float dtype, not {self.dtype}")
        shape = (self.num_layers, 2, self.num_blocks, self.block_size, self.num_kv_heads,
                 self.head_dim)
        if kv is None:
            kv = np.zeros(shape, dtype=self.dtype)
        elif not isinstance(kv, np.ndarray) or kv.shape != shape or kv.dtype != self.dtype:
            got = (kv.shape, kv.dtype) if isinstance(kv, np.ndarray) else type(kv).__name__
            raise ValueError(f"the KV array must have shape {shape} [num_layers, 2, "
                             f"num_blocks, block_size, num_kv_heads, head_dim] and dtype "
                             f"{self.dtype}, got {got}")
        self.kv = kv
        self.block_shape = (self.num_layers, 2, self.block_size, self.num_kv_heads,
                            self.head_dim)
        self.enable_prefix_caching = bool(enable_prefix_caching)
        self.store = store
        self.extra = extra
        self._extra_bytes = encode_extra(extra)
        self.ref_count = [0] * self.num_blocks
        self.block_hash: list[bytes | None] = [None] * self.num_blocks
        self._free: deque[int] = deque(range(self.num_blocks))
        self._cached_free: OrderedDict[int, None] = OrderedDict()  # LRU first
        self.prefix_index: dict[bytes, int] = {}
        self.block_tables: dict[Hashable, list[int]] = {}
        self._seq_hashes: dict[Hashable, list[bytes]] = {}
        self._seq_extra: dict[Hashable, bytes] = {}  # a sequence's hash extra bytes
        self._stats = PoolStats(num_blocks=self.num_blocks)
        if write_through not in ("async", "sync", "evict"):
            raise ConfigError(f"write_through must be 'async', 'sync' or 'evict', not "
                              f"{write_through!r}")
        self.write_through = write_through
        self.write_queue_blocks = _positive("write_queue_blocks", write_queue_blocks)
        # the async writer: (hash, block copy) in, written by _writer_loop
        self._queue: deque[tuple[bytes, np.ndarray]] = deque()
        self._queued: set[bytes] = set()   # hashes queued or being written
        self._cond = threading.Condition()
        self._writer: threading.Thread | None = None
        self._writer_error: BaseException | None = None

    # -- views -------------------------------------------------------------
    def key_cache(self, layer: int) -> np.ndarray:
        """``[num_blocks, block_size, num_kv_heads, head_dim]`` keys of ``layer`` (a view)."""
        return self.kv[layer, 0]

    def value_cache(self, layer: int) -> np.ndarray:
        """``[num_blocks, block_size, num_kv_heads, head_dim]`` values of ``layer`` (a view)."""
        return self.kv[layer, 1]

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take now: free plus evictable cached blocks."""
        return len(self._free) + len(self._cached_free)

    def stats(self) -> PoolStats:
        """A snapshot of the counters and gauges."""
        s = PoolStats(**{k: getattr(self._stats, k) for k in PoolStats.__dataclass_fields__})
        s.free_blocks = len(self._free)
        s.cached_free_blocks = len(self._cached_free)
        return s

    def note_preemption(self) -> None:
        """Count one preemption (the scheduler calls this)."""
        self._stats.preemptions += 1

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks that hold ``num_tokens`` tokens."""
        return -(-num_tokens // self.block_size)

    # -- allocation ----------------------------------------------------------
    def _take_block(self) -> int:
        if self._free:
            block = self._free.popleft()
        else:
            block, _ = self._cached_free.popitem(last=False)   # least recently used
            self._evict(block)
        assert self.ref_count[block] == 0 and self.block_hash[block] is None, block
        self.ref_count[block] = 1
        return block

    def _evict(self, block: int) -> None:
        h = self.block_hash[block]
        assert h is not None and self.prefix_index.get(h) == block
        self._spill(h, block)
        del self.prefix_index[h]
        self.block_hash[block] = None
        self._stats.evictions += 1

    def _spill(self, h: bytes, block: int) -> None:
        if self.store is not None and h not in self._queued and h not in self.store:
            self.store.put(h, self.kv[:, :, block])
            self._stats.spilled_blocks += 1

    # -- writing full blocks as they fill --------------------------------------
    def _write_full(self, h: bytes, block: int) -> None:
        """A full block's KV is complete: write it (``"sync"``) or queue a copy
        for the writer thread (``"async"``), dropping it when the queue is full."""
        if self.write_through == "sync":
            if h not in self.store:
                self.store.put(h, self.kv[:, :, block])
                self._stats.written_blocks += 1
            return
        with self._cond:
            if self._writer_error is not None:
                raise RuntimeError("the KV block writer thread failed; durable writes stopped"
                                   ) from self._writer_error
            if h in self._queued:
                return
            if len(self._queue) >= self.write_queue_blocks:
                self._stats.write_drops += 1
                return
            self._queue.append((h, self.kv[:, :, block].copy()))
            self._queued.add(h)
            self._stats.write_queue = len(self._queue)
            if self._writer is None:
                self._writer = threading.Thread(target=self._writer_loop, daemon=True,
                                                name="durablekv-kv-writer")
                self._writer.start()
            self._cond.notify()

    #: Seconds the writer thread waits for more blocks before it exits (a
    #: burst of blocks starts it again): a pool left idle holds no thread.
    writer_idle_seconds = 1.0

    def _writer_loop(self) -> None:
        while True:
            with self._cond:
                while not self._queue:
                    if not self._cond.wait(self.writer_idle_seconds) and not self._queue:
                        self._writer = None
                        return
                h, kv = self._queue[0]
            try:
                if h not in self.store:
                    self.store.put(h, kv)
            except BaseException as exc:  # noqa: BLE001 - reported to the engine thread
                with self._cond:
                    self._writer_error = exc
                    self._queue.clear()
                    self._queued.clear()
                    self._stats.write_queue = 0
                    self._writer = None
                    self._cond.notify_all()
                return
            with self._cond:
                self._queue.popleft()
                self._queued.discard(h)
                self._stats.written_blocks += 1
                self._stats.write_queue = len(self._queue)
                self._cond.notify_all()

    def flush_writes(self, timeout: float | None = None) -> bool:
        """Wait until every queued full block is written (``"async"``); True
        when the queue is empty, False on ``timeout`` (seconds).

        :raises RuntimeError: the writer thread failed (its error chained).
        """
        with self._cond:
            done = self._cond.wait_for(lambda: not self._queue or self._writer_error is not None,
                                       timeout)
            if self._writer_error is not None:
                raise RuntimeError("the KV block writer thread failed; durable writes "
                                   "stopped") from self._writer_error
            return done

    def _release(self, block: int) -> None:
        self.ref_count[block] -= 1
        assert self.ref_count[block] >= 0, f"block {block} freed twice"
        if self.ref_count[block] == 0:
            if self.block_hash[block] is not None:
                self._cached_free[block] = None       # most recently used end
            else:
                self._free.append(block)

    def _hold(self, block: int) -> None:
        if self.ref_count[block] == 0:
            del self._cached_free[block]
        self.ref_count[block] += 1

    def _load_durable(self, h: bytes) -> int | None:
        """Copy the stored block ``h`` into a fresh block; None on a miss.

        A stored block of another layout (shape or dtype: another model, or
        another pool shape, whose blocks hash alike because they share an
        ``extra``) is a miss, counted in ``layout_misses``; it is neither
        deleted nor overwritten (:meth:`_spill` writes only absent hashes),
        so the pool it belongs to keeps it. Only bytes that do not decode
        are damage (:meth:`KVBlockStore.get`)."""
        assert self.store is not None
        kv = self.store.get(h)
        if kv is None:
            return None
        if kv.shape != self.block_shape or kv.dtype != self.dtype:
            self._stats.layout_misses += 1
            return None
        block = self._take_block()
        self.kv[:, :, block] = kv
        self.block_hash[block] = h
        self.prefix_index[h] = block
        return block

    def _request_extra(self, extra: Any) -> bytes:
        """The hash ``extra`` bytes of a request: the pool's, or ``(pool extra,
        request extra)`` when the request has its own (see :meth:`add_sequence`)."""
        return self._extra_bytes if extra is None else encode_extra((self.extra, extra))

    def add_sequence(self, seq_id: Hashable, token_ids: Sequence[int],
                     extra: Any = None) -> PrefixMatch:
        """Start a block table for ``seq_id`` holding the longest cached prefix
        of ``token_ids`` (memory first, then the durable tier).

        ``extra``: the request's own hash key (a LoRA adapter id, the hashes
        of its images, a cache salt: vLLM's extra keys), the same types as
        the pool's ``extra``. It is folded into EVERY block's hash, as
        ``block_hashes(token_ids, block_size, (pool.extra, extra))`` gives
        them, so requests with different extras share no block, and equal
        ones share as usual (vLLM folds a cache salt into the first block
        only; with chained hashes both separate every block).

        At most ``len(token_ids) - 1`` tokens are taken from the cache, so the
        last prompt token is always computed (its logits give the next
        token). Blocks taken from the durable tier need free blocks; the match
        stops when there are none.

        :returns: the number of cached tokens (a multiple of ``block_size``)
            and how many came from memory and from the durable tier.
        :raises ValueError: ``seq_id`` already has a block table.
        """
        if seq_id in self.block_tables:
            raise ValueError(f"sequence {seq_id!r} already has a block table; free() it first")
        extra_bytes = self._request_extra(extra)
        table: list[int] = []
        hashes: list[bytes] = []
        memory = durable = 0
        if self.enable_prefix_caching and len(token_ids) > 1:
            self._stats.prefix_queries_tokens += len(token_ids)
            bs = self.block_size
            parent = NO_PARENT
            for i in range((len(token_ids) - 1) // bs):
                h = hash_block(parent, token_ids[i * bs:(i + 1) * bs], bs, extra_bytes)
                block = self.prefix_index.get(h)
                if block is not None:
                    self._hold(block)
                    memory += bs
                elif self.store is not None and self.num_free_blocks and \
                        (block := self._load_durable(h)) is not None:
                    durable += bs
                else:
                    break
                table.append(block)
                hashes.append(h)
                parent = h
            self._stats.prefix_hits_memory_tokens += memory
            self._stats.prefix_hits_durable_tokens += durable
        self.block_tables[seq_id] = table
        self._seq_hashes[seq_id] = hashes
        self._seq_extra[seq_id] = extra_bytes
        return PrefixMatch(len(table) * self.block_size, memory, durable)

    def can_allocate(self, seq_id: Hashable, num_tokens: int) -> bool:
        """Whether :meth:`allocate_slots` for ``num_tokens`` tokens would succeed."""
        return self._new_blocks_for(seq_id, num_tokens) <= self.num_free_blocks

    def _new_blocks_for(self, seq_id: Hashable, num_tokens: int, start: int | None = None) -> int:
        table = self.block_tables[seq_id]
        need = max(0, self.blocks_needed(num_tokens) - len(table))
        if start is not None and start % self.block_size and start // self.block_size < len(table):
            if self.ref_count[table[start // self.block_size]] > 1:
                need += 1          # copy-on-write of a shared partial block
        return need

    def allocate_slots(self, seq_id: Hashable, num_computed: int, num_new: int) -> bool:
        """Make room to write tokens ``num_computed .. num_computed + num_new - 1``.

        Adds blocks to the table, and copies a shared partial block that the
        write would touch (copy-on-write). All or nothing: False (and no
        change) when there are not enough free or evictable blocks.
        """
        total = num_computed + num_new
        if self._new_blocks_for(seq_id, total, num_computed) > self.num_free_blocks:
            return False
        table = self.block_tables[seq_id]
        i = num_computed // self.block_size
        if num_computed % self.block_size and i < len(table) and self.ref_count[table[i]] > 1:
            old = table[i]
            new = self._take_block()
            self.kv[:, :, new] = self.kv[:, :, old]
            self._release(old)
            table[i] = new
            self._stats.cow_copies += 1
        while len(table) < self.blocks_needed(total):
            table.append(self._take_block())
        return True

    def slots(self, seq_id: Hashable, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        """``(block_ids, offsets)`` of positions ``start .. stop - 1`` of a sequence:
        where to write their K/V (``kv[layer, 0, block_ids, offsets] = k``)."""
        table = np.asarray(self.block_tables[seq_id], dtype=np.int64)
        pos = np.arange(start, stop)
        return table[pos // self.block_size], pos % self.block_size

    def commit(self, seq_id: Hashable, token_ids: Sequence[int], num_computed: int) -> None:
        """Put the sequence's full blocks whose KV is now complete (the first
        ``num_computed`` tokens, of ids ``token_ids``) into the prefix index.

        A block whose hash is already indexed (another sequence computed the
        same prefix meanwhile) stays private to this sequence.
        """
        if not self.enable_prefix_caching:
            return
        hashes = self._seq_hashes[seq_id]
        table = self.block_tables[seq_id]
        bs = self.block_size
        for i in range(len(hashes), min(num_computed // bs, len(table))):
            parent = hashes[-1] if hashes else NO_PARENT
            h = hash_block(parent, token_ids[i * bs:(i + 1) * bs], bs,
                           self._seq_extra.get(seq_id, self._extra_bytes))
            hashes.append(h)
            block = table[i]
            if h not in self.prefix_index and self.block_hash[block] is None:
                self.block_hash[block] = h
                self.prefix_index[h] = block
                if self.store is not None and self.write_through != "evict":
                    self._write_full(h, block)

    def fork(self, parent_id: Hashable, child_id: Hashable) -> None:
        """Give ``child_id`` the same blocks as ``parent_id`` (ref counts + 1),
        including a partial last block, copied on its first write."""
        if child_id in self.block_tables:
            raise ValueError(f"sequence {child_id!r} already has a block table")
        table = list(self.block_tables[parent_id])
        for block in table:
            self._hold(block)
        self.block_tables[child_id] = table
        self._seq_hashes[child_id] = list(self._seq_hashes[parent_id])
        self._seq_extra[child_id] = self._seq_extra.get(parent_id, self._extra_bytes)

    def free(self, seq_id: Hashable) -> None:
        """Release a sequence's blocks (finished or preempted), tail first, so
        its tail is evicted before its head. Unknown ids are ignored."""
        table = self.block_tables.pop(seq_id, None)
        self._seq_hashes.pop(seq_id, None)
        self._seq_extra.pop(seq_id, None)
        for block in reversed(table or ()):
            self._release(block)

    def spill_cached(self) -> int:
        """Write every cached block still in memory to the durable tier (for a
        graceful shutdown): waits for the writer's queue, then writes what it
        did not (blocks dropped from a full queue, or every cached block with
        ``write_through="evict"``). Returns how many this call wrote; 0
        without a store."""
        if self.store is None:
            return 0
        self.flush_writes()
        before = self._stats.spilled_blocks
        for h, block in list(self.prefix_index.items()):
            self._spill(h, block)
        return self._stats.spilled_blocks - before

    def cached_blocks(self) -> dict[bytes, int]:
        """The prefix index now (a copy): hash -> block id."""
        return dict(self.prefix_index)
