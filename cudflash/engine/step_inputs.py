"""The inputs of one engine step, packed into one int32 array so that they reach the device in one copy.

Every forward the engine runs (a step's drafter and target batches, eager or replayed from CUDA graphs, and any
rows a caller asks for) is staged here. A batch is a list of `Chunk`s, one per sequence: `ids` at positions
start .. start + len(ids) - 1, seeing the keys of positions 0 .. start + len(ids) - 1. Decoding sequences come last,
so the drafter's batch (their blocks alone) is a suffix of every per-row and per-sequence field.

Layout (`StepLayout`), int32, T rows, n sequences, the last nd of them decoding with q rows each:
  ids        [T]              token ids: prefill chunks, then each decode's [pending token, MASK x (q - 1)]
  positions  [T]
  slots      [T]              paged-cache slot of each row; -1 for a padding row (nothing is stored)
  context    [n]              keys each sequence sees: positions 0 .. context - 1
  cu         [n + 1]          sequence s owns rows cu[s] .. cu[s + 1] - 1
  draft_cu   [nd + 1]         cu of the decode rows alone (the drafter's batch); present when drafting
  score_rows [R]              rows whose logits are needed; present unless every row's are (R = 0)
  tree_seq   [n]              1 for a sequence whose rows are a draft tree; present with tree masks (W > 0)
  tree_mask  [T, W]           per row, bit j: the row sees its chunk's row j (engine/tree.py); present when W > 0
  state_slot [n]              each sequence's GDN state slot, -1 for a padding sequence; present for a hybrid target
                              (its forward and its commit, replayed from CUDA graphs too, read them from here)
  tables     [n, max_blocks]  block tables; entries past a sequence's own blocks are left as they were (attention
                              reads the blocks of positions below the context only)
A padding sequence (a CUDA graph's batch bucket) has mask ids, positions 0 .. q - 1, slots -1, context q, the
dummy block in every table entry its q keys span (a padded draft tree's width crosses blocks; the staging memory is
reused, so entries not written hold another step's block ids) and state slot -1: it reads only the dummy block and
writes nothing.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple, Sequence as Seq

import numpy as np

from cudflash.backends.base import AttentionMeta
from cudflash.engine.proposal import HeadRows
from cudflash.engine.sequence import Sequence
from cudflash.models.batch import ForwardBatch


class Chunk(NamedTuple):
    seq: Sequence | None  # None: a padding sequence
    start: int  # cache slot of ids[0] (rows take consecutive slots), and its position unless `positions` says
    ids: list[int]
    positions: list[int] | None = None  # a draft tree's rows: the position of each (their slots stay consecutive)
    tree_mask: np.ndarray | None = None  # int32 [len(ids), tree_words]: which of the chunk's rows each row sees


@dataclass(frozen=True, slots=True)
class StepLayout:
    rows: int  # T
    seqs: int  # n
    decodes: int  # nd: the last nd sequences decode, q rows each (0 when there is no drafter batch)
    q: int  # rows per decoding sequence (0 when there is no drafter batch)
    score_rows: int  # R; 0: every row is scored
    max_blocks: int
    tree_words: int = 0  # W: int32 words of a tree row's mask; 0: no tree in the batch
    state_slots: bool = False  # the state_slot field is present (a hybrid target's batch)

    @property
    def draft_rows(self) -> int:
        return self.decodes * self.q

    @property
    def state_slots_at(self) -> int:
        return self.tree_mask_at + self.rows * self.tree_words

    @property
    def tables_at(self) -> int:
        return self.state_slots_at + (self.seqs if self.state_slots else 0)

    @property
    def tree_seq_at(self) -> int:
        draft_cu = self.decodes + 1 if self.decodes else 0
        return 3 * self.rows + 2 * self.seqs + 1 + draft_cu + self.score_rows

    @property
    def tree_mask_at(self) -> int:
        return self.tree_seq_at + (self.seqs if self.tree_words else 0)

    @property
    def size(self) -> int:
        return self.tables_at + self.seqs * self.max_blocks


def chunk_slots(table: list[int], start: int, count: int, block_size: int) -> list[int]:
    """Slots of positions start .. start + count - 1: one run per cache block they cross."""
    out: list[int] = []
    p, end = start, start + count
    while p < end:
        blk, off = divmod(p, block_size)
        base = table[blk] * block_size + off
        n = min(block_size - off, end - p)
        out.extend(range(base, base + n))
        p += n
    return out


def fill(packed: np.ndarray, layout: StepLayout, chunks: Seq[Chunk], block_size: int, dummy_block: int,
         score_rows: Seq[int] = ()) -> int:
    """Write `chunks` into `packed` (int32 [layout.size], any previous contents); returns the longest context.

    This runs on every step while the device waits, so the small fields go through one Python list and one slice
    assignment rather than a numpy call per field and per sequence."""
    n, max_blocks = layout.seqs, layout.max_blocks
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    ctx: list[int] = []
    cu = [0]
    tables = packed[layout.tables_at:].reshape(n, max_blocks)
    for i, (seq, start, tokens, rows_at, _) in enumerate(chunks):
        count = len(tokens)
        ids += tokens
        positions += range(start, start + count) if rows_at is None else rows_at
        if seq is None:  # padding: no K/V written; its rows' keys (positions 0 .. count - 1) read the dummy block
            slots += [-1] * count
            tables[i, :-(-count // block_size)] = dummy_block  # a tree's padded width spans several blocks
        else:
            table = seq.block_table
            slots += chunk_slots(table, start, count, block_size)
            tables[i, :len(table)] = table
        ctx.append(start + count)
        cu.append(cu[-1] + count)
    head = ids + positions + slots + ctx + cu
    if layout.decodes:
        first = cu[n - layout.decodes]
        head += [c - first for c in cu[n - layout.decodes:]]
    head += score_rows
    if layout.tree_words:
        head += [int(c.tree_mask is not None) for c in chunks]
    packed[:layout.tree_mask_at] = np.array(head, dtype=np.int32)  # faster than assigning the list itself
    if layout.tree_words:
        masks = packed[layout.tree_mask_at:layout.tables_at].reshape(layout.rows, layout.tree_words)
        for c, lo, hi in zip(chunks, cu, cu[1:]):
            masks[lo:hi] = c.tree_mask if c.tree_mask is not None else 0
    if layout.state_slots:
        packed[layout.state_slots_at:layout.tables_at] = [c.seq.state_slot if c.seq is not None else -1
                                                          for c in chunks]
    return max(ctx)


@dataclass
class StepTensors:
    """One staged batch as the models take it: views of the packed array on the backend (`device`) and of its host
    copy (`host`: the attention metadata's host side, which the numpy backend and the launch-shape choices read)."""

    layout: StepLayout
    host: np.ndarray  # int32 [layout.size]
    device: Any  # int32 [layout.size] on the backend (the host array itself on the numpy backend)
    max_context: int  # the longest context, or the CUDA graph's context bucket
    verify_ids: Any = None  # int32 [T]: ids with the drafts in place of the masks (a drafting step), else ids
    rows: HeadRows | None = None  # the drafter heads' index rows of the decode blocks (a drafting step)
    score_first: list[int] | None = None  # per sequence: the index of its first scored row among the logits rows
    chunked_seqs: int = 0  # leading sequences that are prefill chunks (the rest decode)
    scores: bool = True  # False: no row needs logits (prefill chunks that complete no prompt: no LM head at all)
    _verify: ForwardBatch | None = field(default=None, repr=False)  # verify_batch, once built

    def _view(self, a: Any, name: str) -> Any:
        t, n, nd, r = self.layout.rows, self.layout.seqs, self.layout.decodes, self.layout.score_rows
        at = {"ids": (0, t), "positions": (t, 2 * t), "slots": (2 * t, 3 * t), "context": (3 * t, 3 * t + n),
              "cu": (3 * t + n, 3 * t + 2 * n + 1)}
        draft_cu = 3 * t + 2 * n + 1
        at["draft_cu"] = (draft_cu, draft_cu + (nd + 1 if nd else 0))
        at["score_rows"] = (at["draft_cu"][1], at["draft_cu"][1] + r)
        lo, hi = at[name]
        return a[lo:hi]

    def _tables(self, a: Any) -> Any:
        return a[self.layout.tables_at:].reshape(self.layout.seqs, self.layout.max_blocks)

    def __post_init__(self) -> None:
        self.ids, self.positions, self.slots = (self._view(self.device, f) for f in ("ids", "positions", "slots"))
        if self.verify_ids is None:
            self.verify_ids = self.ids
        self.score_rows = self._view(self.device, "score_rows") if self.layout.score_rows else None
        # Hybrid targets: each sequence's GDN state slot, int32 [n] on the host and on the backend (None: no field)
        states = slice(self.layout.state_slots_at, self.layout.tables_at)
        self.state_slots = self.host[states] if self.layout.state_slots else None
        self.state_slots_device = self.device[states] if self.layout.state_slots else None

    def meta(self, backend: Any, drafter: bool = False) -> AttentionMeta:
        """The attention metadata of the whole batch, or of the decode rows alone (`drafter`)."""
        lay, h, d = self.layout, self.host, self.device
        first = lay.seqs - lay.decodes if drafter else 0
        cu = "draft_cu" if drafter else "cu"
        host_cu = self._view(h, cu)
        max_q = lay.q if drafter else int(np.max(np.diff(host_cu)))
        meta = AttentionMeta(host_cu, self._view(h, "context")[first:], self._tables(h)[first:], max_q,
                             self.max_context)
        on_device = [self._view(d, cu), self._view(d, "context")[first:], self._tables(d)[first:]]
        if lay.tree_words and not drafter:
            tree = (slice(lay.tree_seq_at, lay.tree_mask_at), slice(lay.tree_mask_at, lay.tables_at))
            meta.tree_seq, meta.tree_mask = h[tree[0]], h[tree[1]].reshape(lay.rows, lay.tree_words)
            on_device += [d[tree[0]], d[tree[1]].reshape(lay.rows, lay.tree_words)]
        return backend.prepare_meta(meta, tuple(on_device))

    def verify_batch(self, backend: Any) -> ForwardBatch:
        """The target's batch (verify and commit_context both read it: built once)."""
        if self._verify is None:
            self._verify = ForwardBatch(self.verify_ids, self.positions, self.slots, self.meta(backend),
                                        self.state_slots, self.chunked_seqs, self.state_slots_device)
        return self._verify

    def draft_batch(self, backend: Any) -> ForwardBatch:
        t = self.layout.rows - self.layout.draft_rows
        return ForwardBatch(self.ids[t:], self.positions[t:], self.slots[t:], self.meta(backend, drafter=True))


def layout_for(chunks: Seq[Chunk], decodes: int, q: int, score_rows: int, max_blocks: int,
               state_slots: bool = False) -> StepLayout:
    words = max((c.tree_mask.shape[1] for c in chunks if c.tree_mask is not None), default=0)
    return StepLayout(sum(len(c.ids) for c in chunks), len(chunks), decodes, q, score_rows, max_blocks, words,
                      state_slots)
