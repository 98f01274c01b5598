"""Schedulers: which sequences run in the next step, with how many tokens.

:class:`ContinuousScheduler` batches at the iteration level (Orca, Yu et al.,
OSDI 2022; vLLM): every step it first gives each running sequence its next
tokens (one for decode, a chunk for an unfinished prefill), then admits
waiting requests while ``max_num_seqs``, the ``max_num_batched_tokens``
budget and free blocks allow. A finished sequence leaves (and frees its
blocks) at once, so its seat is taken in the next step. When a running
sequence needs a block and none is free, the most recently admitted running
sequence is preempted by recompute (vLLM's default): its blocks are freed,
and it goes back to the head of the waiting queue with its tokens so far; on
re-admission it is prefilled again (its own blocks, if still cached, are a
prefix hit) and continues with identical greedy tokens.

:class:`StaticScheduler` is request-level batching, the baseline: a batch is
admitted only when the previous one has finished completely, so it runs
until its longest member ends, and admission reserves blocks for every
member's whole prompt and output.
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Hashable

from ..errors import ConfigError
from .pool import BlockPool

__all__ = ["Request", "Sequence", "SeqStatus", "ContinuousScheduler", "StaticScheduler"]


@dataclass
class Request:
    """One generation request.

    :ivar request_id: unique id (hashable).
    :ivar prompt_token_ids: the prompt (at least one token).
    :ivar max_new_tokens: tokens to generate (>= 1; no stop token: exactly this many).
    :ivar arrival_time: seconds on the engine's clock when it arrived (for TTFT).
    :ivar extra: the request's own block-hash key (a LoRA id, image hashes, a
        cache salt), or None (see :meth:`BlockPool.add_sequence`).
    """

    request_id: Hashable
    prompt_token_ids: list[int]
    max_new_tokens: int
    arrival_time: float = 0.0
    extra: Any = None


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Sequence:
    """A request's state: its tokens so far and how many of them have KV in the pool."""

    request: Request
    token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: SeqStatus = SeqStatus.WAITING
    first_token_time: float | None = None
    finish_time: float | None = None
    num_preemptions: int = 0
    cached_tokens_memory: int = 0      # at first admission
    cached_tokens_durable: int = 0
    _admitted: bool = False

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.request.prompt_token_ids)

    @property
    def seq_id(self) -> Hashable:
        return self.request.request_id

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.request.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def done(self) -> bool:
        return len(self.token_ids) - self.num_prompt_tokens >= self.request.max_new_tokens


def _check_request(req: Request) -> None:
    if not req.prompt_token_ids:
        raise ValueError(f"request {req.request_id!r} has an empty prompt; give at least one token")
    if isinstance(req.max_new_tokens, bool) or not isinstance(req.max_new_tokens, int) \
            or req.max_new_tokens < 1:
        raise ValueError(f"request {req.request_id!r}: max_new_tokens must be an int >= 1, "
                         f"not {req.max_new_tokens!r}")


class ContinuousScheduler:
    """Iteration-level scheduling over a :class:`BlockPool` (see module doc).

    :param pool: the block pool.
    :param max_num_seqs: most sequences running at once (int >= 1).
    :param max_num_batched_tokens: most tokens computed in one step (int >= 1);
        a longer prefill is split into chunks.
    :raises ConfigError: a limit < 1.
    """

    def __init__(self, pool: BlockPool, *, max_num_seqs: int = 16,
                 max_num_batched_tokens: int = 512) -> None:
        for name, v in (("max_num_seqs", max_num_seqs),
                        ("max_num_batched_tokens", max_num_batched_tokens)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"{name} must be an int >= 1, not {v!r}")
        self.pool = pool
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, request: Request) -> Sequence:
        """Queue a request; returns its :class:`Sequence`.

        :raises ValueError: an empty prompt or ``max_new_tokens`` < 1.
        """
        _check_request(request)
        seq = Sequence(request)
        self.waiting.append(seq)
        return seq

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.pool.free(seq.seq_id)
        seq.num_computed_tokens = 0
        seq.status = SeqStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.pool.note_preemption()
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence) -> None:
        """Free a finished sequence's blocks now."""
        self.running.remove(seq)
        self.pool.free(seq.seq_id)
        seq.status = SeqStatus.FINISHED

    #: admit when the step's token budget is spent (the members compute later)
    _admit_past_budget = False

    def _may_admit(self) -> bool:
        return True

    def _fits(self, seq: Sequence, admitted: list[Sequence]) -> bool:
        return True

    def schedule(self) -> list[tuple[Sequence, int]]:
        """The next step: ``(sequence, number of new tokens)`` pairs, running
        sequences first. Empty when nothing can run."""
        budget = self.max_num_batched_tokens
        out: list[tuple[Sequence, int]] = []
        preempted = False
        for seq in list(self.running):
            if seq.status is not SeqStatus.RUNNING:
                continue                          # preempted earlier in this loop
            n = min(len(seq.token_ids) - seq.num_computed_tokens, budget)
            if n <= 0:
                continue
            while not self.pool.allocate_slots(seq.seq_id, seq.num_computed_tokens, n):
                victim = self.running[-1]
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            else:
                out.append((seq, n))
                budget -= n
        if preempted or not self._may_admit():
            return out
        admitted: list[Sequence] = []
        while self.waiting and len(self.running) < self.max_num_seqs:
            if budget <= 0 and not self._admit_past_budget:
                break
            seq = self.waiting[0]
            if not self._fits(seq, admitted):
                break
            match = self.pool.add_sequence(seq.seq_id, seq.token_ids, seq.request.extra)
            n = min(len(seq.token_ids) - match.num_cached_tokens, budget)
            if not self.pool.allocate_slots(seq.seq_id, match.num_cached_tokens, max(n, 0)):
                self.pool.free(seq.seq_id)
                break
            self.waiting.popleft()
            seq.num_computed_tokens = match.num_cached_tokens
            seq.status = SeqStatus.RUNNING
            if not seq._admitted:
                seq._admitted = True
                seq.cached_tokens_memory = match.memory_tokens
                seq.cached_tokens_durable = match.durable_tokens
            self.running.append(seq)
            admitted.append(seq)
            if n > 0:
                out.append((seq, n))
                budget -= n
        return out


class StaticScheduler(ContinuousScheduler):
    """Request-level batching: admit a batch only when nothing is running;
    the batch then runs until its longest member finishes.

    Admission reserves (counts, without holding) blocks for each member's
    prompt plus ``max_new_tokens``, so a batch normally never preempts.
    """

    def _may_admit(self) -> bool:
        return not self.running

    def _fits(self, seq: Sequence, admitted: list[Sequence]) -> bool:
        need = sum(self.pool.blocks_needed(len(s.request.prompt_token_ids)
                                           + s.request.max_new_tokens)
                   for s in (*admitted, seq))
        return not admitted or need <= self.pool.num_free_blocks + sum(
            len(self.pool.block_tables[s.seq_id]) for s in admitted)
