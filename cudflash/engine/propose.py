"""Proposers: how a drafter turns the block batch [pending token, MASK x (block-1)] into drafts.

A proposer may return fewer than block-1 drafts for a sequence (e.g. a confidence cut); verification then
scores only the rows it needs. For drafters that sample, `q` carries the draft distributions so that
speculative rejection sampling stays exactly lossless.

`DraftProposer` serves every drafter family (its per-row math lives in models/draft_heads.py):

| drafter | rows (block B, anchor at L)     | token choice                                               |
|---------|---------------------------------|------------------------------------------------------------|
| DFlash  | 1..B-1 predict L+1..L+B-1       | argmax (q one-hot, also when the request samples)          |
| DFlash2 | 1..B-1                          | selector walk from the anchor: argmax, or a sample whose q |
|         |                                 | over the row's K candidates goes to verification           |
| DSpark  | 0..B-2 predict L+1..L+B-1       | Markov walk from the anchor, argmax (shifted rows)         |

DSpark's last row (B-1) predicts L+B, one past what a step can verify (the pending token plus B-1 drafts):
its prediction is not computed. DSpark options, both off by default (then every draft is verified):
- a confidence threshold cuts each draft before its first row whose confidence is below it;
- the adaptive policy picks every sequence's verify length at once: with c the row confidences, the survival
  s_j = c_1 ... c_j is the chance that drafts 1..j are all accepted, so verifying k drafts emits 1 + s_1 + ...
  + s_k tokens on average; it maximises (expected tokens of the batch) / (1 + verify_cost * tokens verified),
  a step cost that is fixed plus linear in the verified tokens. (A step replayed from CUDA graphs verifies the
  whole block whatever the cut, so there the cost of a verified token is nearly zero: cuda_graph.verify_drafts.)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from cudflash.draft_config import DraftOptions
from cudflash.engine.model_runner import ModelRunner
from cudflash.engine.sequence import Sequence
from cudflash.models.batch import ForwardBatch


@dataclass(slots=True)
class Proposal:
    drafts: list[np.ndarray] | np.ndarray  # per sequence: int64 [k <= block - 1] draft tokens
    q: list[np.ndarray | None] | None = None  # per sequence: [k, V] draft distributions; None = argmax (one-hot)


Proposer = Callable[[ModelRunner, ForwardBatch, list[Sequence], int], Proposal]


def block_rows(n: int, block: int, first: int, count: int) -> np.ndarray:
    """Rows first .. first+count-1 of each of n blocks of `block` rows, flattened: where the drafts come from."""
    return (np.arange(n)[:, None] * block + np.arange(first, first + count)[None, :]).reshape(-1)


def dflash_propose(runner: ModelRunner, batch: ForwardBatch, seqs: list[Sequence], block: int) -> Proposal:
    """Drafter forward over the block batch; row j predicts position L + j, so rows 1..block-1 are the drafts."""
    hidden = runner.draft_forward(batch)
    rows = block_rows(len(seqs), block, 1, block - 1)
    drafts = runner.backend.to_numpy(runner.backend.argmax(runner.logits(hidden, rows)))
    return Proposal(drafts.reshape(len(seqs), block - 1).astype(np.int64))


def confident_lengths(conf: np.ndarray, threshold: float) -> np.ndarray:
    """Per sequence: the rows before the first one whose confidence is below the threshold. conf [n, S]."""
    low = conf < threshold
    return np.where(low.any(axis=1), low.argmax(axis=1), conf.shape[1])


def adaptive_lengths(conf: np.ndarray, limit: np.ndarray, verify_cost: float) -> np.ndarray:
    """Verify lengths (at most `limit` per sequence) maximising expected tokens / (1 + verify_cost * tokens)."""
    n, slots = conf.shape
    survival = np.cumprod(conf, axis=1)
    seq, row = np.nonzero(np.arange(slots)[None, :] < limit[:, None])
    order = np.lexsort((row, seq, -survival[seq, row]))  # best marginal gain first; each sequence in row order
    expected = n + np.concatenate([[0.0], np.cumsum(survival[seq, row][order])])
    ratio = expected / (1.0 + verify_cost * (n + np.arange(len(order) + 1)))
    best = int(np.argmax(ratio))
    return np.bincount(seq[order[:best]], minlength=n)


@dataclass(slots=True)
class HeadRows:
    """Index rows of a block batch (n sequences x `block` rows) for the drafter heads, int32 on the backend: built
    once per shape, outside any CUDA graph (a graph cannot copy them from the host)."""

    draft: Any  # [n S]: block-batch rows whose outputs become the S = block - 1 drafts, sequence-major
    anchor: Any  # [n]: each sequence's first block row (its pending token, the anchor of the walks)
    by_slot: Any  # [S, n]: index of (slot e, sequence i) among the n S draft rows
    pred: Any  # [n S]: the selector's predecessor row: slot e - 1's, or n S + i (the anchor) for slot 0


def head_rows(b: Any, n: int, block: int, first: int) -> HeadRows:
    slots = block - 1
    pred = np.arange(n * slots) - 1
    pred[::slots] = n * slots + np.arange(n)
    arrays = (block_rows(n, block, first, slots), np.arange(n) * block,
              np.arange(n)[None, :] * slots + np.arange(slots)[:, None], pred)
    return HeadRows(*(b.asarray(a.astype(np.int32), "i32") for a in arrays))


@dataclass(slots=True)
class HeadOutputs:
    """What a drafter's heads compute on the device for a block batch (DraftProposer.device_part)."""

    h: Any  # [n S, H]: the drafter's hidden rows of the drafts
    drafts: Any | None = None  # int32 target ids: [S n] slot-major (Markov walk) or [n S] (argmax)
    slot_major: bool = False
    scores: Any | None = None  # float32 [n S, K, K]: the selector's pair scores
    cand: Any | None = None  # int32 [n S, K]: the selector's candidates (target ids)


class DraftProposer:
    """Every drafter family but plain DFlash, in two parts: `device_part`, backend ops only (a CUDA graph holds it:
    cuda_graph.StepGraphs.propose), and `host_part`, the selector walk, confidence cuts and read-back."""

    def __init__(self, runner: ModelRunner, options: DraftOptions | None = None):
        self.opts = options or DraftOptions()
        runner.draft.check_target(runner.target_cfg)

    def __call__(self, runner: ModelRunner, batch: ForwardBatch, seqs: list[Sequence], block: int) -> Proposal:
        b, n = runner.backend, len(seqs)
        rows = head_rows(b, n, block, self.first_row(runner))
        return self.host_part(runner, self.device_part(runner, batch, rows), seqs, block)

    @staticmethod
    def first_row(runner: ModelRunner) -> int:
        return 0 if runner.draft_cfg.shifted_rows else 1

    @staticmethod
    def device_part(runner: ModelRunner, batch: ForwardBatch, rows: HeadRows) -> HeadOutputs:
        b, draft = runner.backend, runner.draft
        h = b.take_rows(runner.draft_forward(batch), rows.draft)  # [n S, H]
        logits = draft.logits(h, runner.target)  # [n S, Vd]
        anchors = b.take_rows(batch.ids, rows.anchor)
        if draft.selector is not None:
            scores, cand = draft.selector.lattice(b, logits, h, anchors, rows.pred, draft.to_target)
            return HeadOutputs(h, scores=scores, cand=cand)
        if draft.markov is not None:
            return HeadOutputs(h, draft.markov.walk(b, logits, anchors, rows.by_slot, draft.to_target), True)
        return HeadOutputs(h, draft.to_target(b.argmax(logits)))

    def host_part(self, runner: ModelRunner, out: HeadOutputs, seqs: list[Sequence], block: int) -> Proposal:
        """The proposal of `seqs`, the first len(seqs) sequences of `out` (a CUDA graph's batch may be padded)."""
        b, draft = runner.backend, runner.draft
        n, slots = len(seqs), block - 1
        padded = out.h.shape[0] // slots
        anchors = np.array([s.last_token for s in seqs], dtype=np.int64)
        q = None
        if out.scores is not None:
            k = draft.selector.top_k
            drafts, q = self._select(draft, b.to_numpy(out.scores).reshape(padded, slots, k, k)[:n],
                                     b.to_numpy(out.cand).astype(np.int64).reshape(padded, slots, k)[:n], seqs,
                                     runner.target_cfg.vocab_size)
        else:
            drafts = b.to_numpy(out.drafts).astype(np.int64)
            drafts = (drafts.reshape(slots, padded).T if out.slot_major else drafts.reshape(padded, slots))[:n]
        lengths = np.full(n, slots)
        if self.opts.uses_confidence:
            prev = np.concatenate([anchors[:, None], drafts[:, :-1]], axis=1).reshape(-1)
            conf = draft.confidence(b, out.h[:n * slots], prev, draft.markov).reshape(n, slots)
            if self.opts.confidence_threshold > 0:
                lengths = confident_lengths(conf, self.opts.confidence_threshold)
            if self.opts.adaptive:
                lengths = adaptive_lengths(conf, lengths, self.opts.verify_cost)
        return Proposal([drafts[i, :lengths[i]] for i in range(n)],
                        None if q is None else [None if x is None else x[:lengths[i]] for i, x in enumerate(q)])

    @staticmethod
    def _select(draft, scores: np.ndarray, cand: np.ndarray, seqs: list[Sequence], vocab: int):
        """The selector walk of every sequence: drafts [n, S], and q (dense [S, V] per sampling sequence)."""
        drafts, qs = [], []
        for i, s in enumerate(seqs):
            tokens, q = draft.selector.walk(scores[i], cand[i], s.params.temperature, s.rng)
            drafts.append(tokens)
            if q is not None:
                dense = np.zeros((len(tokens), vocab))
                np.put_along_axis(dense, cand[i], q, axis=1)
                q = dense
            qs.append(q)
        return np.stack(drafts), (qs if any(q is not None for q in qs) else None)


def make_proposer(runner: ModelRunner, options: DraftOptions | None = None) -> Proposer:
    """`dflash_propose` itself for a plain DFlash drafter that borrows the target's head (the engine recognises it,
    e.g. to replay the step as CUDA graphs); `DraftProposer` for everything else."""
    draft = runner.draft
    plain = (runner.draft_cfg.kind == "dflash" and draft.lm_head is None and draft.embed_tokens is None
             and draft.d2t is None)
    if plain:
        draft.check_target(runner.target_cfg)
        return dflash_propose
    return DraftProposer(runner, options)
