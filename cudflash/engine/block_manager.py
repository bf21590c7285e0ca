"""Paged KV blocks: a free list, per-sequence block tables, append (reserve), roll back (trim), free.

A block holds `block_size` consecutive positions of one sequence for every layer of the target cache and
every layer of the drafter cache at once (same block table for both).
"""
from __future__ import annotations

from collections import deque

from cudflash.engine.sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.free_blocks: deque[int] = deque(range(num_blocks))

    def blocks_for(self, num_positions: int) -> int:
        return -(-num_positions // self.block_size)

    @property
    def num_free(self) -> int:
        return len(self.free_blocks)

    def can_reserve(self, seq: Sequence, num_positions: int) -> bool:
        return self.blocks_for(num_positions) - len(seq.block_table) <= self.num_free

    def reserve(self, seq: Sequence, num_positions: int) -> None:
        """Grow the block table so that positions 0..num_positions-1 have slots."""
        need = self.blocks_for(num_positions) - len(seq.block_table)
        if need > self.num_free:
            raise MemoryError(f"KV pool exhausted: need {need} blocks, {self.num_free} free")
        for _ in range(need):
            seq.block_table.append(self.free_blocks.popleft())

    def trim(self, seq: Sequence, num_positions: int) -> None:
        """Roll back: free the blocks that hold only positions >= num_positions."""
        keep = self.blocks_for(num_positions)
        while len(seq.block_table) > keep:
            self.free_blocks.append(seq.block_table.pop())

    def free(self, seq: Sequence) -> None:
        self.trim(seq, 0)

    def slots(self, seq: Sequence, start: int, count: int) -> list[int]:
        bs, table = self.block_size, seq.block_table
        return [table[p // bs] * bs + p % bs for p in range(start, start + count)]
