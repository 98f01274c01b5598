"""LLMEngine: the loop that joins a scheduler, the block pool and the model.

One :meth:`LLMEngine.step`: ask the scheduler for the step's sequences and
token counts, run them through the model in one forward pass, commit the
now complete full blocks to the prefix index, take a greedy token for every
sequence whose tokens are all computed, and finish (free at once) the ones
that reached ``max_new_tokens``.

Times (TTFT, time per output token) come from the injected ``clock``
(seconds, float; default :func:`time.perf_counter`), so tests drive it.
"""

from __future__ import annotations

import time
from typing import Callable

import numpy as np

from .model import Segment, TinyTransformer
from .pool import BlockPool
from .scheduler import ContinuousScheduler, Request, Sequence

__all__ = ["LLMEngine"]


class LLMEngine:
    """Greedy generation for many requests at once.

    :param model: the :class:`TinyTransformer`.
    :param pool: a :class:`BlockPool` shaped for it (:meth:`TinyTransformer.make_pool`).
    :param scheduler: a :class:`ContinuousScheduler` or :class:`StaticScheduler` over ``pool``.
    :param clock: seconds (float) for request times.
    """

    def __init__(self, model: TinyTransformer, pool: BlockPool, scheduler: ContinuousScheduler,
                 *, clock: Callable[[], float] = time.perf_counter) -> None:
        if scheduler.pool is not pool:
            raise ValueError("the scheduler must schedule over the engine's pool")
        self.model, self.pool, self.scheduler, self.clock = model, pool, scheduler, clock
        self.num_steps = 0
        self.batch_sizes: list[int] = []

    def add_request(self, request: Request) -> Sequence:
        """Queue ``request``; see :meth:`ContinuousScheduler.add`."""
        return self.scheduler.add(request)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[Sequence]:
        """Run one iteration; returns the sequences that finished in it.

        :raises RuntimeError: requests wait but none can run (a request needs
            more blocks than the whole pool has).
        """
        batch = self.scheduler.schedule()
        if not batch:
            if self.scheduler.has_unfinished():
                seq = self.scheduler.waiting[0] if self.scheduler.waiting else None
                need = self.pool.blocks_needed(len(seq.token_ids)) if seq else 0
                raise RuntimeError(f"no request can run: the next one needs {need} blocks and "
                                   f"the pool has {self.pool.num_blocks}; give the pool more "
                                   "blocks or send shorter requests")
            return []
        segments = [Segment(s.seq_id, s.token_ids[s.num_computed_tokens:s.num_computed_tokens + n],
                            s.num_computed_tokens) for s, n in batch]
        logits = self.model.forward(self.pool, segments)
        now = self.clock()
        self.num_steps += 1
        self.batch_sizes.append(len(batch))
        finished = []
        for (seq, n), row in zip(batch, logits):
            seq.num_computed_tokens += n
            self.pool.commit(seq.seq_id, seq.token_ids, seq.num_computed_tokens)
            if seq.num_computed_tokens < len(seq.token_ids):
                continue                            # a prefill chunk; more to come
            seq.token_ids.append(int(np.argmax(row)))
            if seq.first_token_time is None:
                seq.first_token_time = now
            if seq.done:
                seq.finish_time = now
                self.scheduler.finish(seq)
                finished.append(seq)
        return finished

    def generate(self, requests: list[Request]) -> list[Sequence]:
        """Run ``requests`` (all queued now) to completion; their sequences in order."""
        seqs = [self.add_request(r) for r in requests]
        while self.has_unfinished():
            self.step()
        return seqs
