"""The host's half of a graphed step: filling the packed inputs (cuda_graph.StepBuffers) for the running sequences.

Layout, int32: ids [n q] | positions [n q] | slots [n q] | context_lens [n] | block_tables [n, max_blocks]. Row i
of a running sequence is its pending token and q - 1 mask ids at positions num_cached .. num_cached + q - 1; rows
past the sequences pad the batch bucket (mask ids, positions 0..q-1, slot -1: nothing stored, context q, dummy
blocks).

This runs on every step while the device waits (BENCHMARKS.md, session 7: about 90 us of host time per step, of
which staging was the largest part), so the small fields are built as one Python list and written with one slice
assignment, not with a numpy call per field and per sequence: on the H200 machine's host, staging an AR step took
48 -> 20 us, a speculative step's 41 -> 28 us.
"""
from __future__ import annotations

from typing import Sequence as Seq

import numpy as np

from cudflash.engine.sequence import Sequence


def fill_step_inputs(packed: np.ndarray, n: int, q: int, seqs: Seq[Sequence], mask: int, block_size: int,
                     dummy_block: int, ahead: int = 0) -> int:
    """Fill `packed` (the layout above, any max_blocks) for `seqs` (at most n of them); returns the longest
    context (num_cached + ahead + q of a sequence, q for padding). `ahead` stages the step after the one in
    flight, `ahead` positions further on (plain decoding, cuda_graph.StepGraphs.decode): its pending token is not
    known yet, so ids hold each sequence's last token until the device writes the new one."""
    nq = n * q
    max_blocks = (len(packed) - 3 * nq - n) // n
    ids, positions, slots, ctx = [mask] * nq, list(range(q)) * n, [-1] * nq, [q] * n
    tables = packed[3 * nq + n:]
    for i, s in enumerate(seqs):
        first, start, table = i * q, s.num_cached + ahead, s.block_table
        ids[first] = s.last_token
        for j in range(q):
            pos = start + j
            positions[first + j] = pos
            slots[first + j] = table[pos // block_size] * block_size + pos % block_size
        ctx[i] = start + q
        row = i * max_blocks
        tables[row:row + len(table)] = table
        tables[row + len(table):row + max_blocks] = dummy_block
    tables[len(seqs) * max_blocks:] = dummy_block
    packed[:3 * nq + n] = ids + positions + slots + ctx
    return max(ctx)
