"""Paged KV blocks with reference counts and prefix caching (nano-vllm's design, extended for speculation).

A block holds `block_size` consecutive positions of a sequence for every layer of the target cache and every
layer of the drafter cache at once (one block table serves both). Invariants:

| block state          | ref_count | in free_blocks | hash                                          |
|----------------------|-----------|----------------|-----------------------------------------------|
| used, private        | 1         | no             | -1, or set once all its positions are cached  |
| used, shared prefix  | >= 2      | no             | set                                           |
| free, revivable      | 0         | yes            | set: a prompt with this prefix can take it back |
| free, blank          | 0         | yes            | -1                                            |

Only full blocks whose positions all hold *committed* tokens (target KV and drafter context K/V both valid)
are hashed, so a cache hit gives a new sequence both caches at once and never exposes draft scratch. Writes
only ever go to positions >= num_cached, which lie in private blocks.
"""
from __future__ import annotations

import hashlib
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from cudflash.engine.sequence import Sequence


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    hash: int = -1
    token_ids: list[int] = field(default_factory=list)  # kept to reject hash collisions


def chain_hash(token_ids: list[int], prefix_hash: int) -> int:
    h = hashlib.blake2b(digest_size=8)
    h.update(prefix_hash.to_bytes(8, "little", signed=True))
    h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    return int.from_bytes(h.digest(), "little", signed=True) & 0x7FFF_FFFF_FFFF_FFFF


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_blocks: deque[int] = deque(range(num_blocks))
        self.hash_to_block: dict[int, int] = {}

    def blocks_for(self, num_positions: int) -> int:
        return -(-num_positions // self.block_size)

    @property
    def num_free(self) -> int:
        return len(self.free_blocks)

    # ---- prefix cache
    def match_prefix(self, seq: Sequence) -> None:
        """Take cached blocks for the longest hashed prefix of the sequence's tokens (a fresh or preempted seq).

        At least one token of the prefill is always left to compute (the last block is never matched whole),
        so the prefill produces the logits it needs and never writes into a shared block.
        """
        assert not seq.block_table and seq.num_cached == 0
        if self.enable_prefix_caching:
            self.take_prefix(seq, self.cached_prefix(seq))

    def cached_prefix(self, seq: Sequence) -> list[tuple[int, int]]:
        """(block id, chain hash) of each block of the longest cached prefix of the sequence's prefill, leaving at
        least one token to compute; nothing is taken."""
        tokens, bs = seq.token_ids, self.block_size
        prefix_hash, found = -1, []
        for i in range((seq.prefill_end - 1) // bs):
            chunk = tokens[i * bs:(i + 1) * bs]
            prefix_hash = chain_hash(chunk, prefix_hash)
            block_id = self.hash_to_block.get(prefix_hash)
            if block_id is None or self.blocks[block_id].token_ids != chunk:
                break
            found.append((block_id, prefix_hash))
        return found

    def take_prefix(self, seq: Sequence, prefix: list[tuple[int, int]]) -> None:
        """The sequence takes these cached blocks (cached_prefix's, or a leading part of them) as its first."""
        for block_id, _ in prefix:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                self.free_blocks.remove(block_id)
            block.ref_count += 1
            seq.block_table.append(block_id)
        seq.num_cached = seq.num_hashed_blocks = len(seq.block_table)
        seq.num_cached *= self.block_size

    def prefill_chunk(self, seq: Sequence, n: int) -> int:
        """How many of the n prefill tokens the scheduler offers the sequence it computes in this step."""
        return n

    def hash_committed(self, seq: Sequence) -> None:
        """Register the blocks that became full of committed tokens since the last call."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        full = min(seq.num_cached // bs, len(seq.block_table))
        prefix_hash = self.blocks[seq.block_table[seq.num_hashed_blocks - 1]].hash if seq.num_hashed_blocks else -1
        for i in range(seq.num_hashed_blocks, full):
            chunk = [seq.token_at(p) for p in range(i * bs, (i + 1) * bs)]
            prefix_hash = chain_hash(chunk, prefix_hash)
            block = self.blocks[seq.block_table[i]]
            block.hash, block.token_ids = prefix_hash, chunk
            self.hash_to_block[prefix_hash] = block.block_id
        seq.num_hashed_blocks = max(seq.num_hashed_blocks, full)

    # ---- allocation
    def can_reserve(self, seq: Sequence, num_positions: int) -> bool:
        return self.blocks_for(num_positions) - len(seq.block_table) <= self.num_free

    def reserve(self, seq: Sequence, num_positions: int) -> None:
        """Grow the block table so that positions 0..num_positions-1 have slots."""
        need = self.blocks_for(num_positions) - len(seq.block_table)
        if need > self.num_free:
            raise MemoryError(f"KV pool exhausted: need {need} blocks, {self.num_free} free")
        for _ in range(need):
            block = self.blocks[self.free_blocks.popleft()]
            if block.hash != -1:  # evict the revivable contents it held
                self.forget(block)
            block.ref_count = 1
            seq.block_table.append(block.block_id)

    def forget(self, block: Block) -> None:
        """A revivable block is taken for new contents: its hash leaves the prefix cache."""
        if self.hash_to_block.get(block.hash) == block.block_id:
            del self.hash_to_block[block.hash]
        block.hash, block.token_ids = -1, []

    def trim(self, seq: Sequence, num_positions: int) -> None:
        """Roll back: release the blocks that hold only positions >= num_positions."""
        keep = self.blocks_for(num_positions)
        while len(seq.block_table) > keep:
            block = self.blocks[seq.block_table.pop()]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_blocks.append(block.block_id)
        seq.num_hashed_blocks = min(seq.num_hashed_blocks, len(seq.block_table))

    def free(self, seq: Sequence) -> None:
        self.trim(seq, 0)
        seq.num_cached = 0

    def slots(self, seq: Sequence, start: int, count: int) -> list[int]:
        bs, table = self.block_size, seq.block_table
        return [table[p // bs] * bs + p % bs for p in range(start, start + count)]
