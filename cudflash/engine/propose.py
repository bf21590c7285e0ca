"""Proposers: how the block batch [pending token, MASK x (block-1)] of the decoding sequences becomes drafts.

Every proposer implements one protocol (`Proposer`), in two halves so that a CUDA graph can hold the device one:
`device_part` runs backend ops only (no host copy, no synchronisation), `host_part` whatever must run on the host
(a selector walk, a confidence cut, an oracle's lookup). Where the device part's drafts are final
(`drafts_on_device`), the step writes them into the verify batch on the device and reads them back only with the
verification's results: no host round trip between propose and verify.

A proposal may hold fewer than block-1 drafts for a sequence (e.g. a confidence cut); acceptance then reads only the
rows it needs. For drafters that sample, `q` carries the draft distributions so that speculative rejection sampling
stays exactly lossless.

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
  whole block whatever the cut, so there the cost of a verified token is nearly zero.)
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import numpy as np

from cudflash.draft_config import DraftOptions
from cudflash.engine.proposal import HeadOutputs, HeadRows, Proposal
from cudflash.engine.tree import build_lattice_tree, build_tree
from cudflash.engine.sequence import Sequence
from cudflash.models.batch import ForwardBatch

if TYPE_CHECKING:
    from cudflash.engine.model_runner import ModelRunner


class Proposer(Protocol):
    """How drafts are made; the speculative step (spec_decode.py) is the only caller."""

    drafts_on_device: bool  # device_part's `drafts` are final (every slot, one-hot q): host_part runs after verify
    first_row: int  # the block row whose drafter output is the first draft (HeadRows.draft): 1, or 0 (shifted)

    def device_part(self, runner: ModelRunner, batch: ForwardBatch, rows: HeadRows) -> HeadOutputs: ...

    def host_part(self, runner: ModelRunner, out: HeadOutputs, seqs: list[Sequence], block: int) -> Proposal:
        """The proposal of `seqs`, the first len(seqs) sequences of `out` (a CUDA graph's batch may be padded)."""
        ...


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


class DraftProposer:
    """Every drafter family (DFlash, DFlash2, DSpark): the drafter's forward and heads on the device, the selector walk
    and the confidence cuts on the host."""

    def __init__(self, runner: ModelRunner, options: DraftOptions | None = None):
        self.opts = options or DraftOptions()
        draft = runner.draft
        draft.check_target(runner.target_cfg)
        self.first_row = 0 if runner.draft_cfg.shifted_rows else 1
        self.drafts_on_device = draft.selector is None and not self.opts.uses_confidence

    def device_part(self, runner: ModelRunner, batch: ForwardBatch, rows: HeadRows) -> HeadOutputs:
        b, draft = runner.backend, runner.draft
        h = b.take_rows(runner.draft_forward(batch), rows.draft)  # [n S, H]
        logits = draft.logits(h, runner.target)  # [n S, Vd]
        if draft.selector is None and draft.markov is None:
            return HeadOutputs(h, draft.to_target(b.argmax(logits, nonfinite=0)))  # a draft is always a token
        anchors = b.take_rows(batch.ids, rows.anchor)
        if draft.selector is not None:
            scores, cand = draft.selector.lattice(b, logits, h, anchors, rows.pred, draft.to_target)
            return HeadOutputs(h, scores=scores, cand=cand)
        return HeadOutputs(h, draft.markov.walk(b, logits, anchors, rows.by_slot, rows.seq_major, draft.to_target))

    def host_part(self, runner: ModelRunner, out: HeadOutputs, seqs: list[Sequence], block: int) -> Proposal:
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
            drafts = b.to_numpy(out.drafts).astype(np.int64).reshape(padded, slots)[:n]
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


class TreeProposer(DraftProposer):
    """DDTree (engine/tree.py) over a DFlash drafter, from its K most likely tokens at each block row and their
    log-probabilities, or over a DFlash2 drafter, from its selector's lattice; the tree is built on the host."""

    def __init__(self, runner: ModelRunner, options: DraftOptions):
        super().__init__(runner, options)
        self.budget = options.tree_budget
        self.drafts_on_device = False

    def device_part(self, runner: ModelRunner, batch: ForwardBatch, rows: HeadRows) -> HeadOutputs:
        b, draft = runner.backend, runner.draft
        if draft.selector is not None:  # the lattice of pair scores, as the single path's walk reads it
            return super().device_part(runner, batch, rows)
        h = b.take_rows(runner.draft_forward(batch), rows.draft)  # [n S, H]
        logits = draft.logits(h, runner.target)  # [n S, Vd]
        vals, ids = b.topk(logits, min(self.budget, logits.shape[1]))  # a depth never holds more than the budget
        return HeadOutputs(h, scores=vals, cand=draft.to_target(ids), lse=b.logsumexp(logits))

    def host_part(self, runner: ModelRunner, out: HeadOutputs, seqs: list[Sequence], block: int) -> Proposal:
        b, n, slots = runner.backend, len(seqs), block - 1
        padded = out.h.shape[0] // slots
        ids = b.to_numpy(out.cand).astype(np.int64).reshape(padded, slots, -1)[:n]
        if out.lse is None:  # DFlash2: scores [n S, K, K]
            k = ids.shape[2]
            scores = b.to_numpy(out.scores).reshape(padded, slots, k, k)[:n]
            trees = [build_lattice_tree(scores[i], ids[i], self.budget) for i in range(n)]
        else:
            logits = b.to_numpy(out.scores).reshape(padded, slots, -1)[:n]
            logprobs = logits - b.to_numpy(out.lse).reshape(padded, slots, 1)[:n]
            trees = [build_tree(logprobs[i], ids[i], self.budget) for i in range(n)]
        return Proposal([t.tokens for t in trees], trees=trees)


class HostProposer:
    """A proposer that decides its drafts on the host alone (an oracle in tests, a lookup table): its device part is
    empty. Subclasses implement `propose`."""

    drafts_on_device = False
    first_row = 1

    def device_part(self, runner: ModelRunner, batch: ForwardBatch, rows: HeadRows) -> HeadOutputs:
        return HeadOutputs()

    def host_part(self, runner: ModelRunner, out: HeadOutputs, seqs: list[Sequence], block: int) -> Proposal:
        return self.propose(runner, seqs, block)

    def propose(self, runner: ModelRunner, seqs: list[Sequence], block: int) -> Proposal:
        raise NotImplementedError


def make_proposer(runner: ModelRunner, options: DraftOptions | None = None) -> Proposer:
    """The drafter's proposer: a tree of `options.tree_budget` nodes, or the drafter family's single path."""
    if options is not None and options.tree_budget is not None:
        return TreeProposer(runner, options)
    return DraftProposer(runner, options)
