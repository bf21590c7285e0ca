"""The packed inputs of a step (cudflash/engine/step_inputs.py) against a plain numpy statement of the layout, and
the views the models read from them."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from cudflash.backends.numpy_backend import NumpyBackend
from cudflash.engine.step_inputs import Chunk, StepTensors, chunk_slots, fill, layout_for
from cudflash.engine.tree import DraftTree, ancestor_masks, pack_bits

BS, MASK, DUMMY, MAX_BLOCKS = 16, 7, 999, 12


def reference(chunks: list[Chunk], decodes: int, q: int, score_rows: list[int],
              words: int = 0) -> tuple[np.ndarray, int]:
    ids, positions, slots, ctx, cu, tables = [], [], [], [], [0], np.full((len(chunks), MAX_BLOCKS), DUMMY, np.int32)
    tree_seq, masks = [], []
    for i, (seq, start, tokens, rows_at, mask) in enumerate(chunks):
        pos = np.arange(start, start + len(tokens))  # the slots' positions
        ids.append(np.asarray(tokens))
        positions.append(pos if rows_at is None else np.asarray(rows_at))
        tree_seq.append(int(mask is not None))
        masks.append(mask if mask is not None else np.zeros((len(tokens), words), np.int32))
        if seq is None:
            slots.append(np.full(len(tokens), -1))
        else:
            table = np.asarray(seq.block_table)
            slots.append(table[pos // BS] * BS + pos % BS)
            tables[i, :len(table)] = table
        ctx.append(start + len(tokens))
        cu.append(cu[-1] + len(tokens))
    draft_cu = np.asarray(cu[len(chunks) - decodes:]) - cu[len(chunks) - decodes] if decodes else np.zeros(0)
    parts = [np.concatenate(ids), np.concatenate(positions), np.concatenate(slots), ctx, cu, draft_cu, score_rows]
    if words:
        parts += [tree_seq, np.concatenate(masks).ravel()]
    parts.append(tables.ravel())
    return np.concatenate([np.asarray(p, dtype=np.int64) for p in parts]).astype(np.int32), max(ctx)


def _seq(rng, need: int):
    blocks = -(-need // BS) + int(rng.integers(0, 2))
    return SimpleNamespace(block_table=rng.permutation(500)[:blocks].tolist())


@pytest.mark.parametrize("prefills,decodes,padding,q,ahead", [
    (0, 1, 0, 1, 0), (0, 1, 0, 16, 0), (0, 3, 1, 16, 0), (0, 5, 3, 1, 0), (0, 0, 2, 4, 0), (0, 1, 0, 1, 1),
    (0, 5, 3, 1, 1), (2, 3, 0, 8, 0), (3, 0, 0, 0, 0), (1, 2, 0, 16, 0), (0, 2, 3, 65, 0)])
def test_fill_matches_the_layout(prefills, decodes, padding, q, ahead):
    """Prefill chunks crossing block boundaries, decode blocks (staged `ahead`), padding sequences (a draft tree's
    padded width spans several cache blocks: q = 65), tables of different lengths, score rows; the buffer holds the
    previous step's values (all that attention reads must be overwritten)."""
    rng = np.random.default_rng(prefills * 1000 + decodes * 100 + q * 10 + padding + ahead)
    chunks = []
    for _ in range(prefills):
        start, count = int(rng.integers(0, 3 * BS)), int(rng.integers(1, 3 * BS))
        chunks.append(Chunk(_seq(rng, start + count), start, rng.integers(0, 1000, count).tolist()))
    for _ in range(decodes):
        num_cached = int(rng.integers(0, (MAX_BLOCKS - 2) * BS - q))
        start = num_cached + ahead
        chunks.append(Chunk(_seq(rng, start + q), start, [int(rng.integers(0, 1000))] + [MASK] * (q - 1)))
    chunks += [Chunk(None, 0, [MASK] * q)] * padding
    drafting = decodes + padding if q > 1 else 0
    rows = sum(len(c.ids) for c in chunks)
    score_rows = sorted(rng.choice(rows, size=min(rows, 3), replace=False).tolist()) if prefills else []
    layout = layout_for(chunks, drafting, q if drafting else 0, len(score_rows), MAX_BLOCKS)
    want, longest = reference(chunks, drafting, q, score_rows)
    packed = rng.integers(-5, 5000, size=layout.size).astype(np.int32)  # last step's leftovers
    assert packed.size == want.size
    assert fill(packed, layout, chunks, BS, DUMMY, score_rows) == longest
    np.testing.assert_array_equal(packed[:layout.tables_at], want[:layout.tables_at])
    got_tables = packed[layout.tables_at:].reshape(len(chunks), MAX_BLOCKS)
    want_tables = want[layout.tables_at:].reshape(len(chunks), MAX_BLOCKS)
    for i, (seq, start, tokens, *_) in enumerate(chunks):  # the entries attention reads: its blocks, or the dummy
        used = len(seq.block_table) if seq is not None else -(-len(tokens) // BS)  # padding: every block it spans
        assert -(-(start + len(tokens)) // BS) <= used
        np.testing.assert_array_equal(got_tables[i, :used], want_tables[i, :used])


def test_views_give_each_batch_its_rows():
    """The verify batch sees every row; the drafter's batch the decode blocks alone, with their own row offsets."""
    rng = np.random.default_rng(0)
    q = 4
    chunks = [Chunk(_seq(rng, 40), 10, list(range(30))), Chunk(_seq(rng, 60), 50, [9, MASK, MASK, MASK]),
              Chunk(_seq(rng, 80), 70, [8, MASK, MASK, MASK])]
    layout = layout_for(chunks, 2, q, 0, MAX_BLOCKS)
    host = np.empty(layout.size, np.int32)
    fill(host, layout, chunks, BS, DUMMY)
    b = NumpyBackend()
    inp = StepTensors(layout, host, host, 74)
    full, draft = inp.verify_batch(b), inp.draft_batch(b)
    assert full.ids.tolist() == list(range(30)) + [9, MASK, MASK, MASK, 8, MASK, MASK, MASK]
    assert full.meta.cu_seqlens_q.tolist() == [0, 30, 34, 38] and full.meta.max_q_len == 30
    assert draft.ids.tolist() == [9, MASK, MASK, MASK, 8, MASK, MASK, MASK]
    assert draft.positions.tolist() == [50, 51, 52, 53, 70, 71, 72, 73]
    assert draft.meta.cu_seqlens_q.tolist() == [0, 4, 8] and draft.meta.max_q_len == q
    assert draft.meta.context_lens.tolist() == [54, 74]
    assert draft.meta.block_tables.tolist() == full.meta.block_tables[1:].tolist()
    assert draft.slots.tolist() == chunk_slots(chunks[1].seq.block_table, 50, 4, BS) + \
        chunk_slots(chunks[2].seq.block_table, 70, 4, BS)


def test_fill_lays_out_a_tree_chunk():
    """A draft tree's chunk: consecutive slots from L, its own positions (L + depth), a mask row per row, and a
    flag for its sequence; a plain chunk beside it gets zero masks and no flag."""
    rng = np.random.default_rng(3)
    tree = DraftTree(np.array([4, 5, 6]), np.array([-1, -1, 0]), np.array([1, 1, 2]))
    mask = pack_bits(ancestor_masks(tree), 1)
    chunks = [Chunk(_seq(rng, 30), 20, [9, 8, 7]), Chunk(_seq(rng, 60), 40, [3, 4, 5, 6], [40, 41, 41, 42], mask)]
    layout = layout_for(chunks, 0, 0, 0, MAX_BLOCKS)
    assert layout.tree_words == 1
    want, longest = reference(chunks, 0, 0, [], words=1)
    packed = np.full(layout.size, -7, np.int32)
    assert fill(packed, layout, chunks, BS, DUMMY) == longest == 44
    np.testing.assert_array_equal(packed[:layout.tables_at], want[:layout.tables_at])
    meta = StepTensors(layout, packed, packed, longest).meta(NumpyBackend())
    assert meta.tree_seq.tolist() == [0, 1]
    assert meta.tree_mask[3:].ravel().tolist() == [0b1, 0b11, 0b101, 0b1011]


def test_a_hybrid_batch_stages_its_state_slots():
    """A hybrid target's layout carries each sequence's GDN state slot (-1 for a padding sequence) between the tree
    fields and the tables; the verify batch sees it on the host and on the backend, and every other field is where
    the layout without it puts it."""
    rng = np.random.default_rng(4)
    seqs = [_seq(rng, 40), _seq(rng, 60)]
    for s, slot in zip(seqs, (5, 0)):
        s.state_slot = slot
    chunks = [Chunk(seqs[0], 10, [3, MASK, MASK]), Chunk(seqs[1], 50, [4, MASK, MASK]), Chunk(None, 0, [MASK] * 3)]
    plain, hybrid = (layout_for(chunks, 3, 3, 0, MAX_BLOCKS, state_slots=on) for on in (False, True))
    assert hybrid.size == plain.size + 3 and hybrid.tables_at == hybrid.state_slots_at + 3 == plain.tables_at + 3
    want, _ = reference(chunks, 3, 3, [])
    packed = np.full(hybrid.size, 77, np.int32)
    fill(packed, hybrid, chunks, BS, DUMMY)
    np.testing.assert_array_equal(packed[:hybrid.state_slots_at], want[:plain.tables_at])
    assert packed[hybrid.state_slots_at:hybrid.tables_at].tolist() == [5, 0, -1]
    batch = StepTensors(hybrid, packed, packed.copy(), 60).verify_batch(NumpyBackend())
    assert batch.state_slots.tolist() == batch.state_slots_device.tolist() == [5, 0, -1]
    assert batch.meta.block_tables[:2, 0].tolist() == [s.block_table[0] for s in seqs]
    assert StepTensors(plain, packed[:plain.size], packed[:plain.size], 60).verify_batch(NumpyBackend()) \
        .state_slots is None
