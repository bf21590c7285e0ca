"""Proposers: how a drafter turns the block batch [pending token, MASK x (block-1)] into drafts.

A proposer may return fewer than block-1 drafts for a sequence (e.g. a confidence cut); verification then
scores only the rows it needs. For drafters that sample, `q` carries the draft distributions so that
speculative rejection sampling stays exactly lossless.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from cudflash.engine.model_runner import ModelRunner
from cudflash.engine.sequence import Sequence
from cudflash.models.batch import ForwardBatch


@dataclass(slots=True)
class Proposal:
    drafts: list[np.ndarray] | np.ndarray  # per sequence: int64 [k <= block - 1] draft tokens
    q: list[np.ndarray | None] | None = None  # per sequence: [k, V] draft distributions; None = argmax (one-hot)


Proposer = Callable[[ModelRunner, ForwardBatch, list[Sequence], int], Proposal]


def dflash_propose(runner: ModelRunner, batch: ForwardBatch, seqs: list[Sequence], block: int) -> Proposal:
    """Drafter forward over the block batch; row j predicts position L + j, so rows 1..block-1 are the drafts."""
    hidden = runner.draft_forward(batch)
    rows = (np.arange(len(seqs))[:, None] * block + np.arange(1, block)[None, :]).reshape(-1)
    drafts = runner.backend.to_numpy(runner.backend.argmax(runner.logits(hidden, rows)))
    return Proposal(drafts.reshape(len(seqs), block - 1).astype(np.int64))
