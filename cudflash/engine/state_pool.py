"""The Gated DeltaNet state pool beside the KV blocks (hybrid targets): which slot of the state pools
(models/hybrid.HybridCache: conv [GDN layers, slots, C, K-1], states [GDN layers, slots, Hv, dk, dv]) holds what,
and the block manager that keeps states and KV blocks consistent.

Slots, by index:
| slots                          | holds                                                                    |
|--------------------------------|--------------------------------------------------------------------------|
| 0 .. live - 1                  | the live state of a running sequence (Sequence.state_slot), or nothing   |
| live .. live + snapshots - 1   | snapshots: the state after a hashed block (keyed by its chain hash), LRU |
| live + snapshots (the last)    | zeros, never written: a new sequence's slot is copied from it            |

Invariants:
- a live slot belongs to one sequence, from admission (`match_prefix`) to `free`; it is never shared (sharing goes
  through snapshots, which are copied, never written in place);
- a snapshot keyed by chain hash h is the state after exactly the tokens of the prefix h ends (the state is a
  function of those tokens alone), so it is valid whichever block holds that prefix's KV;
- a prefix-cache hit takes KV blocks only up to the last one whose snapshot exists, and copies that snapshot into
  the live slot: KV is never reused without its state. With no snapshot the sequence recomputes from position 0.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Callable

from cudflash.engine.block_manager import Block, BlockManager
from cudflash.engine.sequence import Sequence

# copy(src slots, dst slots): every GDN layer's conv and recurrent state copied, all sources read first
CopyStates = Callable[[list[int], list[int]], None]


class StateSlots:
    """Host bookkeeping of the state pools' slots; the copies go through `copy` (the runner's, on the backend)."""

    def __init__(self, live: int, snapshots: int, copy: CopyStates):
        self.live, self.num_snapshots, self.copy = live, snapshots, copy
        self.free_live = list(range(live - 1, -1, -1))  # popped from the end: slot 0 first
        self.free_snapshots = list(range(live + snapshots - 1, live - 1, -1))
        self.snapshots: OrderedDict[int, int] = OrderedDict()  # chain hash -> slot, least recently used first
        self.zero = live + snapshots

    @property
    def size(self) -> int:
        """Slots the pools hold (the zero slot included)."""
        return self.zero + 1

    def allocate(self, seq: Sequence, snapshot_of: int | None = None) -> None:
        """A live slot for the sequence, holding zeros or the snapshot keyed by `snapshot_of`."""
        assert seq.state_slot < 0, "a sequence holds one live state"
        seq.state_slot = self.free_live.pop()
        src = self.zero if snapshot_of is None else self.snapshots[snapshot_of]
        if snapshot_of is not None:
            self.snapshots.move_to_end(snapshot_of)
        self.copy([src], [seq.state_slot])

    def free(self, seq: Sequence) -> None:
        if seq.state_slot >= 0:
            self.free_live.append(seq.state_slot)
            seq.state_slot = -1

    def has(self, chain_hash: int) -> bool:
        return chain_hash in self.snapshots

    def take(self, states: list[tuple[int, int]]) -> None:
        """Snapshot each (chain hash, live slot): the live slot's state is the state after that hash's prefix.
        A hash already held is only marked recently used (its state is the same); else the least recently used
        snapshot makes room."""
        src, dst = [], []
        for chain_hash, live_slot in states:
            if chain_hash in self.snapshots:
                self.snapshots.move_to_end(chain_hash)
                continue
            if not self.free_snapshots:
                if not self.snapshots:
                    return  # a pool without snapshot slots
                self.free_snapshots.append(self.snapshots.popitem(last=False)[1])
            slot = self.free_snapshots.pop()
            self.snapshots[chain_hash] = slot
            src.append(live_slot)
            dst.append(slot)
        if src:
            self.copy(src, dst)

    def drop(self, chain_hash: int) -> None:
        slot = self.snapshots.pop(chain_hash, None)
        if slot is not None:
            self.free_snapshots.append(slot)


class HybridBlockManager(BlockManager):
    """KV blocks and GDN state slots together: a sequence gets its live state slot at admission and gives it back
    with its blocks; a prefix hit stops at the last matched block that has a state snapshot."""

    def __init__(self, num_blocks: int, block_size: int, states: StateSlots, enable_prefix_caching: bool = True):
        super().__init__(num_blocks, block_size, enable_prefix_caching)
        self.states = states

    def match_prefix(self, seq: Sequence) -> None:
        assert not seq.block_table and seq.num_cached == 0
        prefix = self.cached_prefix(seq) if self.enable_prefix_caching else []
        while prefix and not self.states.has(prefix[-1][1]):
            prefix.pop()  # KV without its state is no use: recompute from the last snapshot (or from 0)
        self.take_prefix(seq, prefix)
        self.states.allocate(seq, prefix[-1][1] if prefix else None)

    def prefill_chunk(self, seq: Sequence, n: int) -> int:
        """A prefill chunk that would run past the last full block before the prefill's end stops there, so the
        state at that boundary exists to be snapshotted: a prompt sent again, or continued by a follow-up turn,
        then hits all of its full blocks. (The chunked form commits a whole chunk at once.)"""
        if not self.enable_prefix_caching:
            return n
        boundary = (seq.prefill_end - 1) // self.block_size * self.block_size  # as far as match_prefix reaches
        return boundary - seq.num_cached if seq.num_cached < boundary < seq.num_cached + n else n

    def free(self, seq: Sequence) -> None:
        super().free(seq)
        self.states.free(seq)

    def forget(self, block: Block) -> None:
        if self.hash_to_block.get(block.hash) == block.block_id:
            self.states.drop(block.hash)  # no block holds that prefix any more: nothing can reach its snapshot
        super().forget(block)

    def snapshot_boundary(self, seq: Sequence, before: int, after: int) -> int | None:
        """The last block boundary in (before, after] whose block is hashed (a snapshot's key exists), or None."""
        if not self.enable_prefix_caching:
            return None
        boundary = after // self.block_size * self.block_size
        if boundary <= before or boundary == 0:
            return None
        block = self.blocks[seq.block_table[boundary // self.block_size - 1]]
        return boundary if block.hash != -1 else None

    def block_hash(self, seq: Sequence, boundary: int) -> int:
        """The chain hash of the block that ends at `boundary`."""
        return self.blocks[seq.block_table[boundary // self.block_size - 1]].hash
