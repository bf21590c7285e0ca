"""What a proposer hands the speculative step, and the index rows its device part reads: plain data, no engine logic.

A block batch holds n sequences x `block` rows, sequence-major: row i * block + j is slot j of sequence i, at
position L_i + j (L_i its committed length); slot 0 holds the pending token, slots 1.. hold MASK. The drafts of a
sequence are S = block - 1 tokens for positions L_i + 1 .. L_i + S, which the verify batch holds at slots 1..S.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(slots=True)
class Proposal:
    drafts: list[np.ndarray] | np.ndarray  # per sequence: int64 [k <= block - 1] draft tokens (a tree's: its nodes)
    q: list[np.ndarray | None] | None = None  # per sequence: [k, V] draft distributions; None = argmax (one-hot)
    trees: list[Any] | None = None  # per sequence: a tree.DraftTree to verify instead of a single path


def block_rows(n: int, block: int, first: int, count: int) -> np.ndarray:
    """Rows first .. first+count-1 of each of n blocks of `block` rows, flattened."""
    return (np.arange(n)[:, None] * block + np.arange(first, first + count)[None, :]).reshape(-1)


@dataclass(slots=True)
class HeadRows:
    """Index rows of a block batch (n sequences x `block` rows) for a proposer's device part, int32 on the backend:
    built once per shape, outside any CUDA graph (a graph cannot copy them from the host)."""

    draft: Any  # [n S]: block rows whose drafter outputs become the S drafts, sequence-major (first row 1, or 0
    #             for shifted-row drafters)
    anchor: Any  # [n]: each sequence's first block row (its pending token, the anchor of the walks)
    by_slot: Any  # [S, n]: index of (slot e, sequence i) among the n S draft rows
    seq_major: Any  # [n S]: index of (sequence i, slot e) in a slot-major [S n] list
    pred: Any  # [n S]: the selector's predecessor row: slot e - 1's, or n S + i (the anchor) for slot 0
    verify: Any  # [n S]: block rows where the drafts sit in the verify batch (slots 1..S)


def head_rows(b: Any, n: int, block: int, first: int) -> HeadRows:
    slots = block - 1
    pred = np.arange(n * slots) - 1
    pred[::slots] = n * slots + np.arange(n)
    arrays = (block_rows(n, block, first, slots), np.arange(n) * block,
              np.arange(n)[None, :] * slots + np.arange(slots)[:, None],
              (np.arange(slots)[None, :] * n + np.arange(n)[:, None]).reshape(-1), pred,
              block_rows(n, block, 1, slots))
    return HeadRows(*(b.asarray(np.ascontiguousarray(a).astype(np.int32), "i32") for a in arrays))


@dataclass(slots=True)
class HeadOutputs:
    """What a proposer's device part computed for a block batch; every field stays on the device."""

    h: Any = None  # [n S, H]: the drafter's hidden rows of the drafts
    drafts: Any = None  # int32 [n S] target ids, sequence-major (argmax, or the Markov walk)
    scores: Any = None  # float32 [n S, K, K]: the selector's pair scores; [n S, K]: a tree's top-K logits
    cand: Any = None  # int32 [n S, K]: the selector's candidates, or a tree's top-K tokens (target ids)
    lse: Any = None  # float32 [n S]: log-sum-exp of each row's logits (a tree's top-K log-probabilities)
