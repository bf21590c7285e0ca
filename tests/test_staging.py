"""The packed inputs of a graphed step (cudflash/engine/staging.py) against a plain numpy statement of the layout."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from cudflash.engine.staging import fill_step_inputs

BS, MASK, DUMMY, MAX_BLOCKS = 16, 7, 999, 12


def reference(n: int, q: int, seqs, mask: int, bs: int, dummy: int, max_blocks: int,
              ahead: int = 0) -> tuple[np.ndarray, int]:
    ids, positions = np.full((n, q), mask, np.int32), np.tile(np.arange(q, dtype=np.int32), (n, 1))
    slots, ctx = np.full((n, q), -1, np.int32), np.full(n, q, np.int32)
    tables = np.full((n, max_blocks), dummy, np.int32)
    for i, s in enumerate(seqs):
        ids[i, 0] = s.last_token
        pos = s.num_cached + ahead + np.arange(q)
        positions[i] = pos
        table = np.asarray(s.block_table, np.int32)
        slots[i] = table[pos // bs] * bs + pos % bs
        ctx[i] = s.num_cached + ahead + q
        tables[i, :len(table)] = table
    packed = np.concatenate([ids.ravel(), positions.ravel(), slots.ravel(), ctx, tables.ravel()])
    return packed, int(ctx.max())


@pytest.mark.parametrize("n,q,running,ahead", [(1, 1, 1, 0), (1, 16, 1, 0), (4, 16, 3, 0), (8, 1, 5, 0),
                                               (2, 4, 0, 0), (1, 1, 1, 1), (8, 1, 5, 1)])
def test_fill_step_inputs_matches_the_layout(n, q, running, ahead):
    """Sequences whose block crosses a boundary inside the step, tables of different lengths, padded rows; the
    buffer holds the previous step's values (stale garbage must all be overwritten). ahead = 1: the plain decoding
    step staged while the one before it is in flight, one position further on."""
    rng = np.random.default_rng(n * 100 + q * 10 + running + ahead)
    seqs = []
    for _ in range(running):
        num_cached = int(rng.integers(0, (MAX_BLOCKS - 2) * BS - q))
        blocks = -(-(num_cached + ahead + q) // BS) + int(rng.integers(0, 2))
        table = rng.permutation(500)[:blocks].tolist()
        seqs.append(SimpleNamespace(last_token=int(rng.integers(0, 1000)), num_cached=num_cached, block_table=table))
    want, longest = reference(n, q, seqs, MASK, BS, DUMMY, MAX_BLOCKS, ahead)
    packed = rng.integers(-5, 5000, size=want.size).astype(np.int32)  # last step's leftovers
    assert fill_step_inputs(packed, n, q, seqs, MASK, BS, DUMMY, ahead) == longest
    np.testing.assert_array_equal(packed, want)
