"""Continuous batching: which sequences prefill (and how much) and which decode in the next engine step.

Policy, in order:
1. Every running sequence that has finished prefilling decodes (one speculative step). Its lookahead slots
   (the pending token + a block of drafts) are reserved first; when the pool runs dry the youngest running
   sequence is preempted (its blocks released, its whole history recomputed later), never an older one and
   never a write into another sequence's blocks.
2. The rest of the token budget goes to prefill chunks: first sequences already prefilling, then waiting
   ones (oldest first, preempted ones at the front), each after taking whatever prefix the cache holds.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from cudflash.engine.block_manager import BlockManager
from cudflash.engine.sequence import Sequence, SequenceStatus


@dataclass(slots=True)
class StepPlan:
    prefills: list[tuple[Sequence, int]] = field(default_factory=list)  # (sequence, tokens to compute now)
    decodes: list[Sequence] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.prefills and not self.decodes


class Scheduler:
    def __init__(self, blocks: BlockManager, block: int, max_num_seqs: int, max_num_batched_tokens: int,
                 lookahead: int | None = None):
        self.blocks, self.block = blocks, block
        # Positions past num_cached a decoding sequence holds slots for: the pending token plus block - 1 drafts, or
        # one more where plain decoding queues the next step ahead (cuda_graph.py).
        self.lookahead = lookahead or block
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order: the last one is the youngest
        # Counters for users and tests: preemptions, prompt tokens served by the prefix cache, tokens prefilled.
        self.num_preemptions = self.num_prefix_hit_tokens = self.num_prefill_tokens = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def remove(self, seq: Sequence) -> None:
        """Drop a finished or aborted sequence and give its blocks back at once."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.free(seq)

    def preempt_youngest(self) -> None:
        self._preempt(self.running[-1])

    def _preempt(self, seq: Sequence) -> None:
        self.num_preemptions += 1
        self.running.remove(seq)
        self.blocks.free(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)

    def schedule(self) -> StepPlan:
        plan = StepPlan()
        lookahead = self.lookahead
        for seq in [s for s in self.running if not s.is_prefilling]:
            if seq not in self.running:
                continue  # preempted while making room for an older sequence
            while not self.blocks.can_reserve(seq, seq.num_cached + lookahead):
                self._preempt(self.running[-1])
                if seq not in self.running:
                    break
            else:
                self.blocks.reserve(seq, seq.num_cached + lookahead)
                plan.decodes.append(seq)
        budget = self.max_num_batched_tokens - len(plan.decodes) * self.block
        for seq in [s for s in self.running if s.is_prefilling]:
            budget = self._plan_prefill(seq, budget, plan)
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            self.blocks.match_prefix(seq)
            if not self.blocks.can_reserve(seq, seq.num_cached + min(budget, seq.prefill_end - seq.num_cached)):
                self.blocks.free(seq)
                break
            self.waiting.popleft()
            self.num_prefix_hit_tokens += seq.num_cached
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            budget = self._plan_prefill(seq, budget, plan)
        return plan

    def _plan_prefill(self, seq: Sequence, budget: int, plan: StepPlan) -> int:
        n = self.blocks.prefill_chunk(seq, min(budget, seq.prefill_end - seq.num_cached))
        if n <= 0 or not self.blocks.can_reserve(seq, seq.num_cached + n):
            return budget
        self.blocks.reserve(seq, seq.num_cached + n)
        plan.prefills.append((seq, n))
        self.num_prefill_tokens += n
        return budget - n
