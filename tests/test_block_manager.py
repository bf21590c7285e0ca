from __future__ import annotations

import pytest

from cudflash.engine.block_manager import BlockManager
from cudflash.engine.sequence import Sequence
from cudflash.sampling_params import SamplingParams


def _seq(i=0):
    return Sequence(i, [1, 2, 3], SamplingParams())


def test_reserve_trim_free_keep_the_pool_consistent():
    bm = BlockManager(num_blocks=10, block_size=4)
    a, b = _seq(0), _seq(1)
    bm.reserve(a, 9)  # positions 0..8 -> 3 blocks
    bm.reserve(b, 4)
    assert len(a.block_table) == 3 and len(b.block_table) == 1 and bm.num_free == 6
    assert not set(a.block_table) & set(b.block_table)
    bm.reserve(a, 9)  # already covered: no change
    assert len(a.block_table) == 3
    bm.trim(a, 5)  # roll back to 5 positions -> 2 blocks
    assert len(a.block_table) == 2 and bm.num_free == 7
    bm.trim(a, 8)  # trimming never grows
    assert len(a.block_table) == 2
    bm.free(a), bm.free(b)
    assert bm.num_free == 10 and sorted(bm.free_blocks) == list(range(10))


def test_slots_follow_the_block_table():
    bm = BlockManager(num_blocks=8, block_size=4)
    s = _seq()
    bm.reserve(s, 12)
    s.block_table = [5, 2, 7]
    assert bm.slots(s, 2, 5) == [22, 23, 8, 9, 10]


def test_exhaustion_raises_without_touching_other_sequences():
    bm = BlockManager(num_blocks=3, block_size=4)
    a, b = _seq(0), _seq(1)
    bm.reserve(a, 8)
    assert not bm.can_reserve(b, 9)
    with pytest.raises(MemoryError):
        bm.reserve(b, 9)
    assert len(a.block_table) == 2 and b.block_table == [] and bm.num_free == 1
